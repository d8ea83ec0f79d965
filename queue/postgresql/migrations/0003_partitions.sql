-- Schema v3 on PostgreSQL: partitioned channels (the same as queue/sqlite/migrations/0003_partitions.sql) (docs/queue.md#partitioned-channels).
--
-- Additive only (docs/queue.md#schema-versions-and-upgrades): one nullable
-- column, two partial indexes and one new table, so an agent of schema v1/v2
-- keeps working on a migrated file. Such an agent stores NULL keys; the
-- dispatcher of a partitioned channel treats a live NULL-key row as a
-- barrier for every key behind it until it has computed that row's key.

-- The row's partition key on a partitioned channel: the unescaped values of
-- the channel's partition_key paths joined by U+001F ('' when all are absent).
-- NULL on a channel without partition_key, and on rows an older agent took in.
ALTER TABLE messages ADD COLUMN partition_key text;

-- "The next claimable head of each key": the lowest live seq of a key is one
-- probe here, and so is "is there a live NULL-key row before this seq".
CREATE INDEX messages_partition_head ON messages (channel, partition_key, seq)
    WHERE state IN ('queued', 'claimed', 'inflight');

-- "Is a row of this key in flight": a handful of entries at any time.
CREATE INDEX messages_partition_busy ON messages (channel, partition_key)
    WHERE state IN ('claimed', 'inflight');

-- A key paused by on_reject = "pause" on a partitioned channel: only that key
-- waits; `channel resume` deletes every row of its channel.
CREATE TABLE partition_pauses (
    channel       text NOT NULL,
    partition_key text NOT NULL,
    paused_at     double precision NOT NULL,
    reason        text NOT NULL,
    PRIMARY KEY (channel, partition_key)
);

-- Keys waiting for a retry (stats, metrics, the status page): the queued rows
-- of partitioned channels by due time; a due-later one is a retrying head.
CREATE INDEX messages_partition_retry ON messages (next_attempt_at)
    WHERE state = 'queued' AND partition_key IS NOT NULL;
