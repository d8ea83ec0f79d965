-- Named queries of the status page and /status.json (agent/runtime/admin.py), PostgreSQL.
-- Each block starts with "-- name: x"; every name starts with "status_"; the same
-- names, parameters and guards as queue/sqlite/status.sql.
-- Each is one probe of an index, whatever the size of the queue: the page is
-- refreshed every few seconds and its reads share the daemon's reader connection.

-- name: status_head
-- The channel's head (lowest live seq: messages_live_head), without its body.
SELECT id, seq, state, attempts, redrive_base, next_attempt_at, server_status, error_code,
       error_text, received_at, updated_at
FROM messages
WHERE channel = %(channel)s AND state IN ('queued', 'claimed', 'inflight')
ORDER BY seq
LIMIT 1

-- name: status_last_received
-- The newest queued message of the channel (highest seq: messages_channel_seq).
SELECT received_at FROM messages
WHERE channel = %(channel)s AND seq IS NOT NULL
ORDER BY seq DESC
LIMIT 1

-- name: status_last_settled
-- The newest settled row before the given seq in delivery order (messages_channel_seq):
-- with the head's seq, the row the channel delivered last.
SELECT state, settled_at FROM messages
WHERE channel = %(channel)s AND seq < %(before)s AND state IN ('processed', 'rejected', 'failed')
ORDER BY seq DESC
LIMIT 1

-- name: status_live_depth
-- Every live row (the partial index messages_live_head holds exactly these).
SELECT count(*) FROM messages WHERE state IN ('queued', 'claimed', 'inflight')

-- name: status_server_acks
-- The server's ACK text of these rows (a JSON array of ids), where it sent one.
SELECT id, server_ack FROM messages
WHERE id IN (SELECT jsonb_array_elements_text(%(ids)s::jsonb)) AND server_ack IS NOT NULL
