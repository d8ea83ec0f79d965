-- Schema v4: two index entries fewer for every row intake writes (docs/queue.md#schema-versions-and-upgrades).
--
-- Not additive, and safe all the same: an index only changes how a query is
-- planned, never its answer, so an agent of schema v1-v3 keeps working on a
-- migrated file (min_compatible_version stays 1).

-- messages (control_id) served no query: `queue list --control-id` filters
-- with "(:control_id IS NULL OR control_id = :control_id)", which SQLite never
-- answers from an index (it scanned the received_at index instead), so the
-- index only cost a B-tree insert per row and a delete per purged row.
DROP INDEX IF EXISTS messages_control_id;

-- messages (state, updated_at) now holds the rows that are no longer live
-- only. Every row intake wrote (queued) got an entry, and dispatch moved it at
-- its claim and inflight marks, while every query that reads the index asks
-- for settled or audit rows: retention, queue purge, retry, export and
-- stats, the status page's recent failures. Live rows are found and counted
-- through messages_live_head and messages_partition_busy instead. SQLite
-- uses a partial index only for a query that names its condition word for
-- word, so those queries say "state NOT IN ('queued', 'claimed', 'inflight')".
-- An older agent's queries that used the old index read the table instead
-- while an upgrade overlap lasts (slower on a big file, the same answers).
DROP INDEX IF EXISTS messages_state_updated;
CREATE INDEX IF NOT EXISTS messages_settled_updated ON messages (state, updated_at)
    WHERE state NOT IN ('queued', 'claimed', 'inflight');

-- messages_live_head carries the state too, so live rows are counted by state
-- from the index alone (stats, the status page's depth): SQLite 3.40 reads
-- the row of every entry of a partial index whose condition names a column
-- the index lacks. It costs no extra write: a state change already rewrites
-- the entry of an index whose condition is on the state.
DROP INDEX IF EXISTS messages_live_head;
CREATE INDEX messages_live_head ON messages (channel, seq, state)
    WHERE state IN ('queued', 'claimed', 'inflight');
