-- Schema v4 on PostgreSQL: two index entries fewer for every row intake writes (the same as
-- queue/sqlite/migrations/0004_fewer_indexes.sql) (docs/queue.md#schema-versions-and-upgrades).
--
-- Not additive, and safe all the same: an index only changes how a query is
-- planned, never its answer, so an agent of schema v1-v3 keeps working on a
-- migrated database (min_compatible_version stays 1).

-- messages (control_id) served only `queue list --control-id`, an operator
-- command, while every row intake writes paid for it; that command now reads
-- the table, as it always did on SQLite.
DROP INDEX IF EXISTS messages_control_id;

-- messages (state, updated_at) now holds the rows that are no longer live
-- only (as on SQLite): intake's insert and dispatch's claim and inflight
-- marks no longer write it; only the settle does. Every query that reads it
-- asks for settled or audit rows and names the index's condition, as SQLite
-- needs; live rows are found through messages_live_head and
-- messages_partition_busy.
DROP INDEX IF EXISTS messages_state_updated;
CREATE INDEX IF NOT EXISTS messages_settled_updated ON messages (state, updated_at)
    WHERE state NOT IN ('queued', 'claimed', 'inflight');

-- messages_live_head carries the state too (as on SQLite), so the live rows
-- are counted by state from the index (an index-only scan) rather than by a
-- visit to every live row. No extra write: a state change already replaces
-- the row's entries in every index (never a HOT update: the state is indexed).
DROP INDEX IF EXISTS messages_live_head;
CREATE INDEX messages_live_head ON messages (channel, seq, state)
    WHERE state IN ('queued', 'claimed', 'inflight');
