-- Schema v4: one index fewer for every row intake writes (docs/queue.md#schema-versions-and-upgrades).
--
-- Not additive, and safe all the same: an index only changes how a query is
-- planned, never its answer, so an agent of schema v1-v3 keeps working on a
-- migrated file (min_compatible_version stays 1).

-- messages (control_id) served no query: `queue list --control-id` filters
-- with "(:control_id IS NULL OR control_id = :control_id)", which SQLite never
-- answers from an index (it scanned the received_at index instead), so the
-- index only cost a B-tree insert per row and a delete per purged row.
DROP INDEX IF EXISTS messages_control_id;
