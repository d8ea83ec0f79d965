-- Named queries of the hl7-agent queue (PostgreSQL). Each block starts with "-- name: x".
-- The same names, columns and guards as queue/sqlite/queries.sql
-- (tests/unit/test_dialect_queries.py compares them); parameters are
-- psycopg's %(name)s, cast where PostgreSQL cannot infer a NULL's type.
-- Every state transition is a guarded UPDATE (WHERE id = ? AND state = ?)
-- whose row count the caller checks, named after its event in
-- agent/core/states.py (agent/storage/store_base.py: TRANSITION_QUERIES);
-- every dispatch write is fenced on the lease epoch (docs/queue.md#fencing).
-- Every write transaction of the agent holds its advisory lock
-- (agent/storage/postgres.py), so these statements never interleave across hosts.

-- name: dedupe_set_app_ack
-- By the key's primary key, read from the row: dedupe_keys has no index on
-- message_id, and a scan of every key per application ACK grows with the window.
UPDATE dedupe_keys SET app_ack = %(app_ack)s
WHERE (channel, sending_app, sending_facility, control_id) =
      (SELECT channel, sending_app, sending_facility, control_id FROM messages WHERE id = %(message_id)s)
  AND message_id = %(message_id)s

-- name: next_seqs
-- Takes the channel's counter row until COMMIT: seq order is commit order.
-- Advance the channel's seq by %(n)s (the rows one commit batch queues on it);
-- they take the seqs up to the returned one.
INSERT INTO channels (channel, last_seq) VALUES (%(channel)s, %(n)s)
ON CONFLICT (channel) DO UPDATE SET last_seq = channels.last_seq + excluded.last_seq
RETURNING last_seq

-- name: insert_message
-- One row: an audit row (record_audit). Intake's rows go a batch at a time (insert_messages).
INSERT INTO messages (id, channel, seq, state, remote, sending_app, sending_facility, control_id,
                      message_type, encoding, body, body_sha256, ack_mode, accept_ack_type,
                      application_ack_type, ack_sent, ack_outcome, attempts, next_attempt_at,
                      error_code, error_text, received_at, updated_at, partition_key)
VALUES (%(id)s, %(channel)s, %(seq)s, %(state)s, %(remote)s, %(sending_app)s, %(sending_facility)s,
        %(control_id)s, %(message_type)s, %(encoding)s, %(body)s, %(body_sha256)s, %(ack_mode)s,
        %(accept_ack_type)s, %(application_ack_type)s, %(ack_sent)s, %(ack_outcome)s, 0, 0,
        %(error_code)s, %(error_text)s, %(now)s, %(now)s, %(partition_key)s)

-- name: insert_messages
-- Event.INTAKE for a commit batch's new rows in one statement: the store puts
-- one insert_messages_row in place of the rows marker after VALUES for each
-- row (agent/storage/store_base.py: _multirow_sql); the parameters go
-- positionally, in the order of INTAKE_COLUMNS in agent/storage/store_intake.py,
-- which tests/unit/test_intake_sql.py holds to this list.
INSERT INTO messages (id, channel, seq, state, remote, sending_app, sending_facility, control_id,
                      message_type, encoding, body, body_sha256, ack_mode, accept_ack_type,
                      application_ack_type, ack_sent, ack_outcome, attempts, next_attempt_at,
                      received_at, updated_at, partition_key)
VALUES {rows}

-- name: insert_messages_row
(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, 0, 0, %s, %s, %s)

-- name: dedupe_insert_keys
-- The dedupe keys of a batch's new rows in one statement (one
-- dedupe_insert_keys_row per key, DEDUPE_COLUMNS' order; the last parameter
-- is now). The primary key is the constraint: a key still live is never
-- overwritten (the store counts the rows written and refuses the batch when
-- one is missing), an expired one is replaced.
INSERT INTO dedupe_keys (channel, sending_app, sending_facility, control_id, body_sha256,
                         message_id, ack_mode, commit_ack, app_ack, expires_at)
VALUES {rows}
ON CONFLICT (channel, sending_app, sending_facility, control_id) DO UPDATE SET
    body_sha256 = excluded.body_sha256, message_id = excluded.message_id,
    ack_mode = excluded.ack_mode, commit_ack = excluded.commit_ack,
    app_ack = NULL, expires_at = excluded.expires_at
WHERE dedupe_keys.expires_at <= %s

-- name: dedupe_insert_keys_row
(%s, %s, %s, %s, %s, %s, %s, %s, NULL, %s)

-- name: dedupe_lookup_keys
-- The live dedupe keys among a batch's (one dedupe_lookup_keys_row per key;
-- the last parameter is now): one search of the primary key each.
WITH k (channel, sending_app, sending_facility, control_id) AS (VALUES {rows})
SELECT d.channel, d.sending_app, d.sending_facility, d.control_id,
       d.body_sha256, d.message_id, d.ack_mode, d.commit_ack, d.app_ack
FROM k CROSS JOIN dedupe_keys AS d
WHERE d.channel = k.channel AND d.sending_app = k.sending_app
  AND d.sending_facility = k.sending_facility AND d.control_id = k.control_id
  AND d.expires_at > %s

-- name: dedupe_lookup_keys_row
(%s, %s, %s, %s)

-- name: dedupe_prior_row
-- The original row of a duplicate (it may have been purged since).
SELECT state, app_ack FROM messages WHERE id = %(id)s

-- name: set_ack_outcome
-- Leaves updated_at alone: retention counts from the row's last state change.
UPDATE messages SET ack_outcome = %(outcome)s
WHERE id = %(id)s AND ack_outcome <> %(outcome)s

-- name: set_ack_outcomes
-- set_ack_outcome for a batch's rows with one outcome, in one statement (one
-- set_ack_outcomes_row per id; the outcome is the first parameter and the last).
UPDATE messages SET ack_outcome = %s
WHERE id IN ({rows}) AND ack_outcome <> %s

-- name: set_ack_outcomes_row
%s

-- name: lease_row
SELECT holder, holder_pid, holder_boot, holder_pidns, holder_start, epoch, expires_at
FROM lease WHERE name = 'dispatch'

-- name: lease_take
UPDATE lease SET holder = %(holder)s, holder_pid = %(pid)s, holder_boot = %(boot)s,
                 holder_pidns = %(pidns)s, holder_start = %(start)s, epoch = epoch + 1,
                 expires_at = %(expires_at)s, acquired_at = %(now)s, renewed_at = %(now)s
WHERE name = 'dispatch' AND epoch = %(seen_epoch)s
RETURNING epoch

-- name: lease_renew
UPDATE lease SET expires_at = %(expires_at)s, renewed_at = %(now)s
WHERE name = 'dispatch' AND holder = %(holder)s AND epoch = %(epoch)s

-- name: lease_release
UPDATE lease SET holder = NULL, holder_pid = NULL, holder_boot = NULL, holder_pidns = NULL,
                 holder_start = NULL, expires_at = NULL
WHERE name = 'dispatch' AND holder = %(holder)s AND epoch = %(epoch)s

-- name: queue_id
-- The queue's UUID (made once by migrate): sent in hello with the lease epoch.
SELECT value FROM meta WHERE key = 'queue_id'

-- name: lease_fence
SELECT 1 FROM lease WHERE name = 'dispatch' AND holder = %(holder)s AND epoch = %(epoch)s

-- name: claimed_ids
-- The rows to recover, from the partial index of rows in flight
-- (messages_partition_busy: a handful of entries), never a pass over the table.
SELECT id FROM messages WHERE state IN ('claimed', 'inflight') AND state = 'claimed'

-- name: recover_claimed
-- The ids of claimed_ids (a JSON array), read in the same transaction.
UPDATE messages SET state = 'queued', updated_at = %(now)s
WHERE id IN (SELECT jsonb_array_elements_text(%(ids)s::jsonb)) AND state = 'claimed'
  AND EXISTS (SELECT 1 FROM lease WHERE name = 'dispatch' AND holder = %(holder)s AND epoch = %(epoch)s)

-- name: channel_head
-- With the channel's pause flag: the dispatcher reads both at every step.
SELECT id, channel, seq, state, attempts, next_attempt_at, claim_epoch, remote, control_id,
       message_type, encoding, body, received_at, ack_mode, redrive_base,
       COALESCE((SELECT paused FROM channels WHERE channels.channel = %(channel)s), 0) AS channel_paused
FROM messages
WHERE channel = %(channel)s AND state IN ('queued', 'claimed', 'inflight')
ORDER BY seq
LIMIT 1

-- Partitioned channels (docs/queue.md#partitioned-channels): order per key
-- value. A key's turn is its lowest-seq live row; while a row of the key is
-- claimed or inflight no other row of it is claimed; a live row with a NULL
-- key (taken in by an older agent, or before partition_key was set) holds
-- back every key behind it until the dispatcher computed its key.

-- name: partition_heads
-- The claimable heads of a partitioned channel, oldest first (messages_live_head
-- in seq order; each NOT EXISTS one probe of messages_partition_head,
-- messages_partition_busy or the pauses' primary key).
SELECT m.id, m.channel, m.seq, m.state, m.attempts, m.next_attempt_at, m.claim_epoch, m.remote,
       m.control_id, m.message_type, m.encoding, m.body, m.received_at, m.ack_mode, m.redrive_base,
       m.partition_key
FROM messages AS m
WHERE m.channel = %(channel)s AND m.state IN ('queued', 'claimed', 'inflight')
  AND m.state = 'queued' AND m.next_attempt_at <= %(now)s AND m.partition_key IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM messages AS e
                  WHERE e.channel = m.channel AND e.partition_key = m.partition_key
                    AND e.state IN ('queued', 'claimed', 'inflight') AND e.seq < m.seq)
  AND NOT EXISTS (SELECT 1 FROM messages AS n
                  WHERE n.channel = m.channel AND n.partition_key IS NULL
                    AND n.state IN ('queued', 'claimed', 'inflight') AND n.seq < m.seq)
  AND NOT EXISTS (SELECT 1 FROM messages AS b
                  WHERE b.channel = m.channel AND b.partition_key = m.partition_key
                    AND b.state IN ('claimed', 'inflight'))
  AND NOT EXISTS (SELECT 1 FROM partition_pauses AS p
                  WHERE p.channel = m.channel AND p.partition_key = m.partition_key)
ORDER BY m.seq
LIMIT %(limit)s

-- name: partition_claimable
-- The same rule for one row, checked under the write lock just before its claim
-- (the heads were read on another connection: a re-drive may have come between).
SELECT 1 FROM messages AS m
WHERE m.id = %(id)s AND m.partition_key IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM messages AS e
                  WHERE e.channel = m.channel AND e.partition_key = m.partition_key
                    AND e.state IN ('queued', 'claimed', 'inflight') AND e.seq < m.seq)
  AND NOT EXISTS (SELECT 1 FROM messages AS n
                  WHERE n.channel = m.channel AND n.partition_key IS NULL
                    AND n.state IN ('queued', 'claimed', 'inflight') AND n.seq < m.seq)
  AND NOT EXISTS (SELECT 1 FROM messages AS b
                  WHERE b.channel = m.channel AND b.partition_key = m.partition_key
                    AND b.state IN ('claimed', 'inflight') AND b.id <> m.id)
  AND NOT EXISTS (SELECT 1 FROM partition_pauses AS p
                  WHERE p.channel = m.channel AND p.partition_key = m.partition_key)

-- name: partition_busy
-- A partitioned channel's rows in flight (claimed or inflight), by seq: after a
-- restart or a takeover, the inflight ones are resent before their key goes on.
SELECT id, channel, seq, state, attempts, next_attempt_at, claim_epoch, remote, control_id,
       message_type, encoding, body, received_at, ack_mode, redrive_base, partition_key
FROM messages
WHERE channel = %(channel)s AND state IN ('claimed', 'inflight')
ORDER BY seq

-- name: partition_unkeyed
-- Live rows of a channel without a key yet (an older agent took them in).
SELECT id, body, encoding FROM messages
WHERE channel = %(channel)s AND partition_key IS NULL AND state IN ('queued', 'claimed', 'inflight')
ORDER BY seq
LIMIT %(limit)s

-- name: partition_set_key
UPDATE messages SET partition_key = %(partition_key)s WHERE id = %(id)s AND partition_key IS NULL

-- name: partition_pause
INSERT INTO partition_pauses (channel, partition_key, paused_at, reason)
VALUES (%(channel)s, %(partition_key)s, %(now)s, %(reason)s)
ON CONFLICT (channel, partition_key) DO UPDATE SET paused_at = excluded.paused_at,
                                                   reason = excluded.reason

-- name: partition_resume_all
DELETE FROM partition_pauses WHERE channel = %(channel)s

-- name: row_partition
-- queue show: a row's partition key and, when its key is paused, why.
SELECT m.partition_key, p.reason AS paused_reason
FROM messages AS m
LEFT JOIN partition_pauses AS p ON p.channel = m.channel AND p.partition_key = m.partition_key
WHERE m.id = %(id)s

-- name: partition_paused
-- Paused keys with their head (NULL when the key has no live row left).
SELECT p.channel, p.partition_key, p.paused_at, p.reason, m.id, m.seq, m.received_at, m.attempts,
       (SELECT count(*) FROM messages AS c
        WHERE c.channel = p.channel AND c.partition_key = p.partition_key
          AND c.state IN ('queued', 'claimed', 'inflight')) AS depth
FROM partition_pauses AS p
LEFT JOIN messages AS m
  ON m.channel = p.channel AND m.partition_key = p.partition_key
 AND m.seq = (SELECT min(h.seq) FROM messages AS h
              WHERE h.channel = p.channel AND h.partition_key = p.partition_key
                AND h.state IN ('queued', 'claimed', 'inflight'))
ORDER BY p.channel, p.paused_at

-- name: partition_retrying
-- Heads of keys waiting for a retry (due later than %(now)s); messages_partition_retry
-- holds the queued rows of partitioned channels by due time.
SELECT m.channel, m.partition_key, m.id, m.seq, m.received_at, m.attempts, m.next_attempt_at,
       m.error_code, m.server_status,
       (SELECT count(*) FROM messages AS c
        WHERE c.channel = m.channel AND c.partition_key = m.partition_key
          AND c.state IN ('queued', 'claimed', 'inflight')) AS depth
FROM messages AS m
WHERE m.state = 'queued' AND m.partition_key IS NOT NULL AND m.next_attempt_at > %(now)s
ORDER BY m.next_attempt_at
LIMIT %(limit)s

-- name: claim
UPDATE messages SET state = 'claimed', claim_epoch = %(epoch)s, claimed_at = %(now)s,
                    updated_at = %(now)s
WHERE id = %(id)s AND state = 'queued' AND next_attempt_at <= %(now)s
  AND EXISTS (SELECT 1 FROM lease WHERE name = 'dispatch' AND holder = %(holder)s AND epoch = %(epoch)s)

-- name: send
-- Committed before the frame is written: a claimed row goes out as attempt + 1.
UPDATE messages SET state = 'inflight', attempts = attempts + 1, sent_at = %(now)s,
                    claim_epoch = %(epoch)s, updated_at = %(now)s
WHERE id = %(id)s AND state = 'claimed' AND attempts = %(attempts)s
  AND EXISTS (SELECT 1 FROM lease WHERE name = 'dispatch' AND holder = %(holder)s AND epoch = %(epoch)s)
RETURNING attempts

-- name: claim_and_send
-- claim then send in one statement, for a head about to be written at once: the
-- row goes out as attempt + 1, and is claimed only inside this statement.
UPDATE messages SET state = 'inflight', attempts = attempts + 1, claim_epoch = %(epoch)s,
                    claimed_at = %(now)s, sent_at = %(now)s, updated_at = %(now)s
WHERE id = %(id)s AND state = 'queued' AND next_attempt_at <= %(now)s AND attempts = %(attempts)s
  AND EXISTS (SELECT 1 FROM lease WHERE name = 'dispatch' AND holder = %(holder)s AND epoch = %(epoch)s)
RETURNING attempts

-- name: resend
-- An inflight row sent again (a replaying server dedupes on its id), attempt + 1.
UPDATE messages SET state = 'inflight', attempts = attempts + 1, sent_at = %(now)s,
                    claim_epoch = %(epoch)s, updated_at = %(now)s
WHERE id = %(id)s AND state = 'inflight' AND attempts = %(attempts)s
  AND EXISTS (SELECT 1 FROM lease WHERE name = 'dispatch' AND holder = %(holder)s AND epoch = %(epoch)s)
RETURNING attempts

-- name: settle
UPDATE messages SET state = %(state)s, server_status = %(server_status)s,
                    server_ack = %(server_ack)s, app_ack = COALESCE(%(app_ack)s::bytea, app_ack),
                    error_code = %(error_code)s, error_text = %(error_text)s,
                    server_reason = %(server_reason)s, settled_at = %(now)s, updated_at = %(now)s
WHERE id = %(id)s AND state = 'inflight' AND attempts = %(attempt)s
  AND EXISTS (SELECT 1 FROM lease WHERE name = 'dispatch' AND holder = %(holder)s AND epoch = %(epoch)s)

-- name: requeue
UPDATE messages SET state = 'queued', next_attempt_at = %(next_attempt_at)s,
                    server_status = %(server_status)s, error_code = %(error_code)s,
                    error_text = %(error_text)s, server_reason = %(server_reason)s,
                    updated_at = %(now)s
WHERE id = %(id)s AND state IN ('inflight', 'claimed') AND attempts = %(attempt)s
  AND EXISTS (SELECT 1 FROM lease WHERE name = 'dispatch' AND holder = %(holder)s AND epoch = %(epoch)s)

-- name: fail_live
-- server_reason: the last answer's reason when a server answer ended it (max_attempts),
-- kept as it was otherwise (ambiguous, too big: no answer to read).
UPDATE messages SET state = %(state)s, error_code = %(error_code)s, error_text = %(error_text)s,
                    server_reason = COALESCE(%(server_reason)s::text, server_reason),
                    app_ack = COALESCE(%(app_ack)s::bytea, app_ack), settled_at = %(now)s,
                    updated_at = %(now)s
WHERE id = %(id)s AND state IN ('queued', 'claimed', 'inflight') AND attempts = %(attempt)s
  AND EXISTS (SELECT 1 FROM lease WHERE name = 'dispatch' AND holder = %(holder)s AND epoch = %(epoch)s)

-- name: channel_pause
INSERT INTO channels (channel, last_seq, paused, paused_at, paused_reason)
VALUES (%(channel)s, 0, 1, %(now)s, %(reason)s)
ON CONFLICT (channel) DO UPDATE SET paused = 1, paused_at = excluded.paused_at,
                                    paused_reason = excluded.paused_reason

-- name: channel_resume
INSERT INTO channels (channel, last_seq, paused) VALUES (%(channel)s, 0, 0)
ON CONFLICT (channel) DO UPDATE SET paused = 0, paused_at = NULL, paused_reason = NULL

-- name: channel_flags
SELECT channel, last_seq, paused, paused_at, paused_reason FROM channels ORDER BY channel COLLATE "C"

-- name: paused_channels
SELECT channel FROM channels WHERE paused = 1

-- name: count_by_state
-- Index entries only, never the rows: settled and audit rows from
-- messages_settled_updated, live ones from messages_live_head. One
-- statement, so one snapshot.
SELECT state, count(*) AS n FROM messages WHERE state NOT IN ('queued', 'claimed', 'inflight')
GROUP BY state
UNION ALL
SELECT state, count(*) AS n FROM messages WHERE state IN ('queued', 'claimed', 'inflight')
GROUP BY state

-- name: live_by_channel
SELECT channel, state, count(*) AS n, min(CASE WHEN state = 'queued' THEN received_at END) AS oldest
FROM messages WHERE state IN ('queued', 'claimed', 'inflight')
GROUP BY channel, state

-- name: purge_expired_dedupe_keys
DELETE FROM dedupe_keys WHERE expires_at <= %(now)s

-- name: purge_terminal_older_than
DELETE FROM messages WHERE id IN (
    SELECT id FROM messages
    WHERE state NOT IN ('queued', 'claimed', 'inflight')
      AND state IN ('processed', 'rejected', 'nacked') AND updated_at < %(cutoff)s
    ORDER BY updated_at LIMIT %(limit)s)

-- name: purge_oldest_terminal
DELETE FROM messages WHERE id IN (
    SELECT id FROM messages
    WHERE state NOT IN ('queued', 'claimed', 'inflight')
      AND state IN ('processed', 'rejected', 'nacked')
    ORDER BY updated_at LIMIT %(limit)s)

-- name: row_by_id
SELECT id, channel, seq, state, remote, sending_app, sending_facility, control_id, message_type,
       encoding, body, body_sha256, ack_mode, accept_ack_type, application_ack_type, ack_sent,
       app_ack, ack_outcome, attempts, redrive_base, next_attempt_at, claim_epoch, server_status,
       server_ack, error_code, error_text, received_at, claimed_at, sent_at, settled_at, updated_at,
       server_reason
FROM messages WHERE id = %(id)s

-- name: recent_failures
SELECT id, channel, control_id, message_type, state, error_code, error_text, attempts, updated_at,
       server_status, server_reason
FROM messages WHERE state NOT IN ('queued', 'claimed', 'inflight') AND state IN ('failed', 'rejected')
ORDER BY updated_at DESC LIMIT %(limit)s

-- name: settled_app_acks
-- The application-ACK relay's poll (docs/acks.md#relayed-application-acks):
-- rows among the ids given (a JSON array) whose application ACK is known.
SELECT id, app_ack FROM messages
WHERE id IN (SELECT jsonb_array_elements_text(%(ids)s::jsonb)) AND app_ack IS NOT NULL

-- name: probe_write
INSERT INTO meta (key, value) VALUES ('last_probe', %(now)s)
ON CONFLICT (key) DO UPDATE SET value = excluded.value

-- name: meta_table_exists
SELECT 1 WHERE to_regclass('meta') IS NOT NULL

-- name: meta_all
SELECT key, value FROM meta

-- name: meta_upsert
INSERT INTO meta (key, value) VALUES (%(key)s, %(value)s)
ON CONFLICT (key) DO UPDATE SET value = excluded.value

-- name: meta_insert
INSERT INTO meta (key, value) VALUES (%(key)s, %(value)s)

-- name: meta_insert_if_absent
INSERT INTO meta (key, value) VALUES (%(key)s, %(value)s) ON CONFLICT (key) DO NOTHING

-- name: operator_actions_due
-- Is there an operator action a daemon has not logged yet (finished, or silent for long)?
SELECT 1 FROM operator_actions
WHERE logged_at IS NULL AND (status <> 'running' OR updated_at < %(stale_before)s)
LIMIT 1

-- name: operator_actions_take
-- Marks them logged and returns them: the agent's write lock makes each entry one process's
-- to log, whichever host it runs on.
UPDATE operator_actions SET logged_at = %(now)s
WHERE logged_at IS NULL AND (status <> 'running' OR updated_at < %(stale_before)s)
RETURNING id, action, os_user, pid, channel, reason, rows, detail, status, started_at, updated_at

-- name: operator_actions_forget
-- Entries logged longer ago than the queue's retention.
DELETE FROM operator_actions WHERE logged_at IS NOT NULL AND logged_at < %(cutoff)s
