-- Schema v2: the server's reason text with each row, and the operator's actions.
--
-- Additive only (docs/queue.md#schema-versions-and-upgrades): one nullable
-- column and one new table, so an agent of schema v1 keeps working on a
-- migrated file (its queries name their columns and never see these).

-- The receiving system's own words for its answer (MSA-3, ERR-8/ERR-7 or the
-- coded ERR texts of the ACK it sent), written when a row settles, is retried
-- or given up after a server answer; NULL when the answer carried none.
ALTER TABLE messages ADD COLUMN server_reason TEXT;

-- One row per operator command that changed the queue (pause, resume, retry,
-- purge, fail), written by the command in the same transaction as the change,
-- so it exists exactly when the change does. A command that changes rows in
-- several batches keeps one entry up to date: `rows` and `detail` count what
-- has committed so far, `status` stays 'running' until its last batch. A
-- daemon logs each entry once (`operator_action`) and marks it `logged_at`;
-- whichever process runs the command, the line is in the daemon's log.
CREATE TABLE operator_actions (
    id         INTEGER PRIMARY KEY,
    action     TEXT NOT NULL,               -- pause, resume, retry, purge, fail
    os_user    TEXT NOT NULL,               -- who ran the command
    pid        INTEGER NOT NULL,            -- the command's process id
    channel    TEXT,                        -- the channel it named, if it named one
    reason     TEXT,                        -- the operator's --reason, if given
    rows       INTEGER NOT NULL DEFAULT 0,  -- rows changed (committed) so far
    detail     TEXT NOT NULL DEFAULT '{}',  -- JSON: ids, per-channel counts, state, older_than
    status     TEXT NOT NULL DEFAULT 'running'
        CHECK (status IN ('running', 'done', 'interrupted')),
    started_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    logged_at  REAL                         -- when a daemon wrote it to its log
) STRICT;
CREATE INDEX operator_actions_unlogged ON operator_actions (id) WHERE logged_at IS NULL;
