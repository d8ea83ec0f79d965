-- Named queries of the operator commands (`hl7-agent queue ...`, `channel ...`), PostgreSQL.
-- Each block starts with "-- name: x"; the same names and guards as
-- queue/sqlite/operator.sql, so every name here starts with "op_" and is defined once.
--
-- The daemons may be running while these run: every write is one short
-- statement inside its own write transaction (the agent's advisory lock),
-- bounded by a LIMIT, and guarded on the row's state in the statement itself
-- (docs/queue.md#operator-actions: live rows are never touched by an operator
-- command, whatever the caller passed). Timestamps are Unix seconds (UTC).

-- name: op_settled_by_channel
SELECT channel, state, count(*) AS n
FROM messages
WHERE state NOT IN ('queued', 'claimed', 'inflight')
  AND state IN ('processed', 'rejected', 'failed', 'nacked')
GROUP BY channel, state

-- name: op_list
SELECT id, channel, seq, state, control_id, message_type, attempts, received_at, error_code,
       remote, updated_at, encoding, CASE WHEN %(show_body)s::int = 1 THEN body END AS body, error_text,
       server_reason, partition_key
FROM messages
WHERE (%(state)s::text IS NULL OR state = %(state)s::text)
  AND (%(channel)s::text IS NULL OR channel = %(channel)s::text)
  AND (%(since)s::float8 IS NULL OR received_at >= %(since)s::float8)
  AND (%(control_id)s::text IS NULL OR control_id = %(control_id)s::text)
ORDER BY received_at DESC, seq DESC NULLS LAST
LIMIT NULLIF(%(limit)s::bigint, -1)

-- name: op_ids_by_prefix
-- Every id starting with the prefix (ids are lower-case UUIDs). A scan, not an index probe
-- (the primary key's index follows the database's collation, not byte order): an operator
-- command runs it once per id typed, never the daemon.
SELECT id FROM messages WHERE starts_with(id, %(prefix)s) ORDER BY id LIMIT %(limit)s

-- name: op_row_place
SELECT state, channel, seq FROM messages WHERE id = %(id)s

-- name: op_redrive_one
-- Operator re-drive (docs/queue.md#operator-actions): failed/rejected -> queued, same id, due now,
-- max_attempts counted afresh from here (redrive_base). error_code/error_text
-- are kept as history until the next attempt overwrites them.
UPDATE messages SET state = 'queued', next_attempt_at = 0, redrive_base = attempts,
                    updated_at = %(now)s
WHERE id = %(id)s AND state IN ('failed', 'rejected')

-- name: op_redrive_batch
UPDATE messages SET state = 'queued', next_attempt_at = 0, redrive_base = attempts,
                    updated_at = %(now)s
WHERE rowid IN (
    SELECT rowid FROM messages
    WHERE state NOT IN ('queued', 'claimed', 'inflight') AND state = %(state)s
      AND (%(channel)s::text IS NULL OR channel = %(channel)s::text) AND rowid <= %(max_rowid)s
    ORDER BY rowid LIMIT %(limit)s)
  AND state IN ('failed', 'rejected')
RETURNING channel

-- name: op_set_aside
-- Operator set-aside (docs/queue.md#operator-actions): queued -> failed with the operator's
-- reason, in one guarded statement: only a row that is queued at this instant moves, so a
-- claim by the dispatcher and a set-aside never both win (on any host: both take the
-- agent's write lock). The application ACK a waiting sender is owed (built by the command)
-- is kept like a settle's; server_status and server_reason stay as the history of the last answer.
UPDATE messages SET state = 'failed', error_code = %(error_code)s, error_text = %(error_text)s,
                    app_ack = COALESCE(%(app_ack)s::bytea, app_ack), settled_at = %(now)s,
                    updated_at = %(now)s
WHERE id = %(id)s AND state = 'queued'

-- name: op_action_insert
-- An operator action, written in the same transaction as the change it records.
INSERT INTO operator_actions (action, os_user, pid, channel, reason, rows, detail, status,
                              started_at, updated_at)
VALUES (%(action)s, %(os_user)s, %(pid)s, %(channel)s, %(reason)s, %(rows)s, %(detail)s, %(status)s,
        %(now)s, %(now)s)
RETURNING id

-- name: op_action_update
-- The next batch of a running action, in that batch's transaction.
UPDATE operator_actions SET rows = %(rows)s, detail = %(detail)s, status = %(status)s,
                            channel = %(channel)s, updated_at = %(now)s
WHERE id = %(id)s

-- name: op_max_rowid
SELECT coalesce(max(rowid), 0) FROM messages

-- name: op_select_state
-- A settled or audit state (messages_settled_updated); the live states have
-- op_select_live_state (messages_live_head).
SELECT id, channel, seq, state, control_id, message_type, attempts, received_at, error_code,
       remote, updated_at, encoding, NULL::bytea AS body, error_text, server_reason
FROM messages
WHERE state NOT IN ('queued', 'claimed', 'inflight') AND state = %(state)s
  AND (%(channel)s::text IS NULL OR channel = %(channel)s::text)
ORDER BY channel COLLATE "C", seq IS NULL, seq, received_at

-- name: op_select_live_state
SELECT id, channel, seq, state, control_id, message_type, attempts, received_at, error_code,
       remote, updated_at, encoding, NULL::bytea AS body, error_text, server_reason
FROM messages
WHERE state IN ('queued', 'claimed', 'inflight') AND state = %(state)s
  AND (%(channel)s::text IS NULL OR channel = %(channel)s::text)
ORDER BY channel COLLATE "C", seq IS NULL, seq, received_at

-- name: op_count_state
-- A settled or audit state (messages_settled_updated); the live states have
-- op_count_live_state (messages_live_head).
SELECT count(*) FROM messages
WHERE state NOT IN ('queued', 'claimed', 'inflight') AND state = %(state)s
  AND (%(channel)s::text IS NULL OR channel = %(channel)s::text)

-- name: op_count_live_state
SELECT count(*) FROM messages
WHERE state IN ('queued', 'claimed', 'inflight') AND state = %(state)s
  AND (%(channel)s::text IS NULL OR channel = %(channel)s::text)

-- name: op_count_purgeable
SELECT count(*) FROM messages
WHERE state NOT IN ('queued', 'claimed', 'inflight') AND state = %(state)s AND updated_at < %(cutoff)s
  AND (%(channel)s::text IS NULL OR channel = %(channel)s::text)
  AND state IN ('processed', 'rejected', 'failed', 'nacked')

-- name: op_purge_batch
-- Terminal rows only, whatever the state asked for; dedupe_keys are left alone so a
-- purge never forgets a key before dedupe_window (docs/queue.md#dedupe).
DELETE FROM messages WHERE rowid IN (
    SELECT rowid FROM messages
    WHERE state NOT IN ('queued', 'claimed', 'inflight') AND state = %(state)s AND updated_at < %(cutoff)s
      AND (%(channel)s::text IS NULL OR channel = %(channel)s::text)
    ORDER BY updated_at LIMIT %(limit)s)
  AND state IN ('processed', 'rejected', 'failed', 'nacked')

-- name: op_export_ids
-- A settled or audit state (messages_settled_updated); the live states have
-- op_export_live_ids (messages_live_head).
SELECT id FROM messages
WHERE state NOT IN ('queued', 'claimed', 'inflight') AND state = %(state)s
  AND (%(channel)s::text IS NULL OR channel = %(channel)s::text)
ORDER BY channel COLLATE "C", seq IS NULL, seq, received_at

-- name: op_export_live_ids
SELECT id FROM messages
WHERE state IN ('queued', 'claimed', 'inflight') AND state = %(state)s
  AND (%(channel)s::text IS NULL OR channel = %(channel)s::text)
ORDER BY channel COLLATE "C", seq IS NULL, seq, received_at

-- name: op_bodies
SELECT id, body FROM messages WHERE id IN (SELECT jsonb_array_elements_text(%(ids)s::jsonb))
