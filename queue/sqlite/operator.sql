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
FROM messages
WHERE state NOT IN ('queued', 'claimed', 'inflight')
  AND state IN ('processed', 'rejected', 'failed', 'nacked')
GROUP BY channel, state

-- name: op_list
SELECT id, channel, seq, state, control_id, message_type, attempts, received_at, error_code,
       remote, updated_at, encoding, CASE WHEN :show_body THEN body END AS body, error_text,
       server_reason, partition_key
FROM messages
WHERE (:state IS NULL OR state = :state)
  AND (:channel IS NULL OR channel = :channel)
  AND (:since IS NULL OR received_at >= :since)
  AND (:control_id IS NULL OR control_id = :control_id)
ORDER BY received_at DESC, seq DESC
LIMIT :limit

-- name: op_ids_by_prefix
-- Ids are lower-case UUIDs: every id starting with :prefix sorts in [prefix, prefix || '~').
SELECT id FROM messages WHERE id >= :prefix AND id < :prefix || '~' ORDER BY id LIMIT :limit

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
    WHERE state NOT IN ('queued', 'claimed', 'inflight') AND state = :state
      AND (:channel IS NULL OR channel = :channel) AND rowid <= :max_rowid
    ORDER BY rowid LIMIT :limit)
  AND state IN ('failed', 'rejected')
RETURNING channel

-- name: op_set_aside
-- Operator set-aside (docs/queue.md#operator-actions): queued -> failed with the operator's
-- reason, in one guarded statement: only a row that is queued at this instant moves, so a
-- claim by the dispatcher and a set-aside never both win. The application ACK a waiting
-- sender is owed (built by the command) is kept like a settle's; server_status and
-- server_reason stay as the history of the last answer.
UPDATE messages SET state = 'failed', error_code = :error_code, error_text = :error_text,
                    app_ack = COALESCE(:app_ack, app_ack), settled_at = :now, updated_at = :now
WHERE id = :id AND state = 'queued'

-- name: op_action_insert
-- An operator action, written in the same transaction as the change it records.
INSERT INTO operator_actions (action, os_user, pid, channel, reason, rows, detail, status,
                              started_at, updated_at)
VALUES (:action, :os_user, :pid, :channel, :reason, :rows, :detail, :status, :now, :now)
RETURNING id

-- name: op_action_update
-- The next batch of a running action, in that batch's transaction.
UPDATE operator_actions SET rows = :rows, detail = :detail, status = :status, channel = :channel,
                            updated_at = :now
WHERE id = :id

-- name: op_max_rowid
SELECT coalesce(max(rowid), 0) FROM messages

-- name: op_select_state
-- A settled or audit state (messages_settled_updated); the live states have
-- op_select_live_state (messages_live_head).
SELECT id, channel, seq, state, control_id, message_type, attempts, received_at, error_code,
       remote, updated_at, encoding, NULL AS body, error_text, server_reason
FROM messages
WHERE state NOT IN ('queued', 'claimed', 'inflight') AND state = :state
  AND (:channel IS NULL OR channel = :channel)
ORDER BY channel, seq IS NULL, seq, received_at

-- name: op_select_live_state
SELECT id, channel, seq, state, control_id, message_type, attempts, received_at, error_code,
       remote, updated_at, encoding, NULL AS body, error_text, server_reason
FROM messages
WHERE state IN ('queued', 'claimed', 'inflight') AND state = :state
  AND (:channel IS NULL OR channel = :channel)
ORDER BY channel, seq IS NULL, seq, received_at

-- name: op_count_state
-- A settled or audit state (messages_settled_updated); the live states have
-- op_count_live_state (messages_live_head).
SELECT count(*) FROM messages WHERE state NOT IN ('queued', 'claimed', 'inflight') AND state = :state
  AND (:channel IS NULL OR channel = :channel)

-- name: op_count_live_state
SELECT count(*) FROM messages WHERE state IN ('queued', 'claimed', 'inflight') AND state = :state
  AND (:channel IS NULL OR channel = :channel)

-- name: op_count_purgeable
SELECT count(*) FROM messages
WHERE state NOT IN ('queued', 'claimed', 'inflight') AND state = :state
  AND updated_at < :cutoff AND (:channel IS NULL OR channel = :channel)
  AND state IN ('processed', 'rejected', 'failed', 'nacked')

-- name: op_purge_batch
-- Terminal rows only, whatever :state says; dedupe_keys are left alone so a
-- purge never forgets a key before dedupe_window (docs/queue.md#dedupe).
DELETE FROM messages WHERE rowid IN (
    SELECT rowid FROM messages
    WHERE state NOT IN ('queued', 'claimed', 'inflight') AND state = :state
  AND updated_at < :cutoff AND (:channel IS NULL OR channel = :channel)
    ORDER BY updated_at LIMIT :limit)
  AND state IN ('processed', 'rejected', 'failed', 'nacked')

-- name: op_export_ids
-- A settled or audit state (messages_settled_updated); the live states have
-- op_export_live_ids (messages_live_head).
SELECT id FROM messages
WHERE state NOT IN ('queued', 'claimed', 'inflight') AND state = :state
  AND (:channel IS NULL OR channel = :channel)
ORDER BY channel, seq IS NULL, seq, received_at

-- name: op_export_live_ids
SELECT id FROM messages
WHERE state IN ('queued', 'claimed', 'inflight') AND state = :state
  AND (:channel IS NULL OR channel = :channel)
ORDER BY channel, seq IS NULL, seq, received_at

-- name: op_bodies
SELECT id, body FROM messages WHERE id IN (SELECT value FROM json_each(:ids))
