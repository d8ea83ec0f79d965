-- Named queries of the operator commands (`hl7-agent queue ...`, `channel ...`).
-- Each block starts with "-- name: x"; agent.storage.sql.load_queries() loads
-- them with queries.sql, so every name here starts with "op_" and is defined once.
--
-- The daemon may be running while these run: every write is one short
-- statement inside its own BEGIN IMMEDIATE, bounded by a LIMIT, and guarded
-- on the row's state in the statement itself (docs/queue.md#operator-actions:
-- live rows are never touched by an operator command, whatever the caller passed).
-- Timestamps are REAL Unix seconds (UTC).

-- name: op_settled_by_channel
SELECT channel, state, count(*) AS n
FROM messages WHERE state IN ('processed', 'rejected', 'failed', 'nacked')
GROUP BY channel, state

-- name: op_list
SELECT id, channel, seq, state, control_id, message_type, attempts, received_at, error_code,
       remote, updated_at, encoding, CASE WHEN :show_body THEN body END AS body
FROM messages
WHERE (:state IS NULL OR state = :state)
  AND (:channel IS NULL OR channel = :channel)
  AND (:since IS NULL OR received_at >= :since)
  AND (:control_id IS NULL OR control_id = :control_id)
ORDER BY received_at DESC, seq DESC
LIMIT :limit

-- name: op_ids_by_prefix
SELECT id FROM messages WHERE id >= :prefix AND id < :prefix || '~' ORDER BY id LIMIT 2

-- name: op_row_place
SELECT state, channel, seq FROM messages WHERE id = :id

-- name: op_redrive_one
-- Operator re-drive (docs/queue.md#operator-actions): failed/rejected -> queued, same id, due now,
-- max_attempts counted afresh from here (redrive_base). error_code/error_text
-- are kept as history until the next attempt overwrites them.
UPDATE messages SET state = 'queued', next_attempt_at = 0, redrive_base = attempts,
                    updated_at = :now
WHERE id = :id AND state IN ('failed', 'rejected')

-- name: op_redrive_batch
UPDATE messages SET state = 'queued', next_attempt_at = 0, redrive_base = attempts,
                    updated_at = :now
WHERE rowid IN (
    SELECT rowid FROM messages
    WHERE state = :state AND (:channel IS NULL OR channel = :channel) AND rowid <= :max_rowid
    ORDER BY rowid LIMIT :limit)
  AND state IN ('failed', 'rejected')
RETURNING channel

-- name: op_max_rowid
SELECT coalesce(max(rowid), 0) FROM messages

-- name: op_select_state
SELECT id, channel, seq, state, control_id, message_type, attempts, received_at, error_code,
       remote, updated_at, encoding, NULL AS body
FROM messages
WHERE state = :state AND (:channel IS NULL OR channel = :channel)
ORDER BY channel, seq IS NULL, seq, received_at

-- name: op_count_state
SELECT count(*) FROM messages WHERE state = :state AND (:channel IS NULL OR channel = :channel)

-- name: op_count_purgeable
SELECT count(*) FROM messages
WHERE state = :state AND updated_at < :cutoff AND (:channel IS NULL OR channel = :channel)
  AND state IN ('processed', 'rejected', 'failed', 'nacked')

-- name: op_purge_batch
-- Terminal rows only, whatever :state says; dedupe_keys are left alone so a
-- purge never forgets a key before dedupe_window (docs/queue.md#dedupe).
DELETE FROM messages WHERE rowid IN (
    SELECT rowid FROM messages
    WHERE state = :state AND updated_at < :cutoff AND (:channel IS NULL OR channel = :channel)
    ORDER BY updated_at LIMIT :limit)
  AND state IN ('processed', 'rejected', 'failed', 'nacked')

-- name: op_export_ids
SELECT id FROM messages
WHERE state = :state AND (:channel IS NULL OR channel = :channel)
ORDER BY channel, seq IS NULL, seq, received_at

-- name: op_bodies
SELECT id, body FROM messages WHERE id IN (SELECT value FROM json_each(:ids))
