-- Schema v2 of the hl7-agent queue on PostgreSQL: the server's reason text with
-- each row, and the operator's actions. The same step as
-- queue/sqlite/migrations/0002_operator_actions_server_reason.sql.
--
-- Additive only (docs/queue.md#schema-versions-and-upgrades): one nullable
-- column and one new table, so an agent of schema v1 keeps working on a
-- migrated database (its queries name their columns and never see these) —
-- the other host, not upgraded yet, or the old process of an upgrade overlap.

-- The receiving system's own words for its answer (MSA-3, ERR-8/ERR-7 or the
-- coded ERR texts of the ACK it sent), written when a row settles, is retried
-- or given up after a server answer; NULL when the answer carried none.
ALTER TABLE messages ADD COLUMN server_reason text;

-- One row per operator command that changed the queue (pause, resume, retry,
-- purge, fail), written by the command in the same transaction as the change,
-- so it exists exactly when the change does. A command that changes rows in
-- several batches keeps one entry up to date: `rows` and `detail` count what
-- has committed so far, `status` stays 'running' until its last batch. A
-- daemon logs each entry once (`operator_action`) and marks it `logged_at`;
-- whichever process or host runs the command, the line is in one daemon's log.
CREATE TABLE operator_actions (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    action     text NOT NULL,               -- pause, resume, retry, purge, fail
    os_user    text NOT NULL,               -- who ran the command
    pid        integer NOT NULL,            -- the command's process id
    channel    text,                        -- the channel it named, if it named one
    reason     text,                        -- the operator's --reason, if given
    rows       integer NOT NULL DEFAULT 0,  -- rows changed (committed) so far
    detail     text NOT NULL DEFAULT '{}',  -- JSON: ids, per-channel counts, state, older_than
    status     text NOT NULL DEFAULT 'running'
        CHECK (status IN ('running', 'done', 'interrupted')),
    started_at double precision NOT NULL,
    updated_at double precision NOT NULL,
    logged_at  double precision             -- when a daemon wrote it to its log
);
CREATE INDEX operator_actions_unlogged ON operator_actions (id) WHERE logged_at IS NULL;
