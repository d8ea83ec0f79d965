-- Schema v4 on PostgreSQL: one index fewer for every row intake writes (the same as
-- queue/sqlite/migrations/0004_fewer_indexes.sql) (docs/queue.md#schema-versions-and-upgrades).
--
-- Not additive, and safe all the same: an index only changes how a query is
-- planned, never its answer, so an agent of schema v1-v3 keeps working on a
-- migrated database (min_compatible_version stays 1).

-- messages (control_id) served only `queue list --control-id`, an operator
-- command, while every row intake writes paid for it; that command now reads
-- the table, as it always did on SQLite.
DROP INDEX IF EXISTS messages_control_id;
