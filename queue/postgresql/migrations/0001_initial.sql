-- Schema v1 of the hl7-agent queue on PostgreSQL (docs/queue.md#row-states, docs/ha.md).
--
-- The same tables, columns and rules as queue/sqlite/migrations/0001_initial.sql,
-- in PostgreSQL's types (BLOB -> bytea, REAL -> double precision, INTEGER ->
-- bigint/integer). Rules for every later migration: additive only (new tables,
-- new nullable columns, new indexes), explicit column lists in every query, so
-- the previous agent version keeps working on a migrated database while both
-- run (an upgrade overlap, or two hosts upgraded one after the other).
-- The state set below is frozen.
-- Timestamps are Unix seconds (UTC) as double precision; the CLI renders them
-- as RFC 3339. The lease's expiry is on the database server's clock.
-- Runs inside the agent's write transaction, under its advisory lock: several
-- processes starting at once migrate once.

CREATE TABLE meta (
    key   text PRIMARY KEY,
    value text NOT NULL
);

-- One row per frame that reached intake with an MSH (queued), and one audit
-- row (nacked) per frame that was refused, answered as a duplicate conflict,
-- was an inbound ACK, or had no MSH at all.
CREATE TABLE messages (
    -- Insertion order, as SQLite's rowid (a re-drive by state stops at the newest row).
    rowid                bigint GENERATED ALWAYS AS IDENTITY UNIQUE,
    id                   text PRIMARY KEY,          -- transmit UUID, fixed for life
    channel              text NOT NULL,
    seq                  bigint,                    -- per-channel, queued rows only
    state                text NOT NULL CHECK (state IN
        ('queued', 'claimed', 'inflight', 'processed', 'rejected', 'failed', 'nacked')),
    remote               text NOT NULL,             -- peer "host:port"
    sending_app          text NOT NULL DEFAULT '',  -- MSH-3
    sending_facility     text NOT NULL DEFAULT '',  -- MSH-4
    control_id           text NOT NULL DEFAULT '',  -- MSH-10
    message_type         text NOT NULL DEFAULT '',  -- MSH-9
    encoding             text,                      -- Python codec the body decodes with
    body                 bytea NOT NULL,            -- bytes exactly as received
    body_sha256          text NOT NULL,
    ack_mode             text NOT NULL DEFAULT 'commit'
        CHECK (ack_mode IN ('commit', 'application', 'enhanced')),
    accept_ack_type      text NOT NULL DEFAULT '',  -- MSH-15
    application_ack_type text NOT NULL DEFAULT '',  -- MSH-16
    ack_sent             bytea,                     -- intake ACK sent to the source
    app_ack              bytea,                     -- application ACK owed/relayed to the source
    ack_outcome          text NOT NULL DEFAULT 'pending'
        CHECK (ack_outcome IN ('pending', 'delivered', 'undelivered', 'not_owed')),
    attempts             integer NOT NULL DEFAULT 0,  -- grows for life (attempt-scoped settles)
    redrive_base         integer NOT NULL DEFAULT 0,  -- attempts at the last operator re-drive
    next_attempt_at      double precision NOT NULL DEFAULT 0,
    claim_epoch          bigint,                    -- lease epoch of the last claim
    server_status        integer,
    server_ack           text,
    error_code           text,
    error_text           text,
    received_at          double precision NOT NULL,
    claimed_at           double precision,
    sent_at              double precision,
    settled_at           double precision,
    updated_at           double precision NOT NULL
);

-- The head of a channel: lowest seq among live rows (claim is FIFO per channel).
CREATE INDEX messages_live_head ON messages (channel, seq)
    WHERE state IN ('queued', 'claimed', 'inflight');
CREATE UNIQUE INDEX messages_channel_seq ON messages (channel, seq) WHERE seq IS NOT NULL;
CREATE INDEX messages_state_updated ON messages (state, updated_at);
CREATE INDEX messages_received ON messages (received_at);
CREATE INDEX messages_control_id ON messages (control_id);

-- Per-channel durable state: the seq counter (its row is taken by the queued
-- insert's transaction, so seq order is commit order across hosts) and the
-- operator's pause flag.
CREATE TABLE channels (
    channel       text PRIMARY KEY,
    last_seq      bigint NOT NULL DEFAULT 0,
    paused        smallint NOT NULL DEFAULT 0 CHECK (paused IN (0, 1)),
    paused_at     double precision,
    paused_reason text
);

-- Dedupe keys outlive their rows: purging messages never forgets a key
-- before dedupe_window (docs/queue.md#dedupe). The primary key is the unique
-- constraint every host's intake meets; the body hash decides duplicate or conflict.
CREATE TABLE dedupe_keys (
    channel          text NOT NULL,
    sending_app      text NOT NULL,
    sending_facility text NOT NULL,
    control_id       text NOT NULL,
    body_sha256      text NOT NULL,
    message_id       text NOT NULL,
    ack_mode         text NOT NULL,
    commit_ack       bytea,           -- intake ACK as sent (replayed byte for byte)
    app_ack          bytea,           -- application ACK once known
    expires_at       double precision NOT NULL,
    PRIMARY KEY (channel, sending_app, sending_facility, control_id)
);
CREATE INDEX dedupe_keys_expiry ON dedupe_keys (expires_at);
CREATE INDEX dedupe_keys_message ON dedupe_keys (message_id);

-- The dispatch lease: one row. Every dispatch write is fenced on epoch.
-- expires_at is on the database server's clock (hosts' clocks need not agree).
CREATE TABLE lease (
    name          text PRIMARY KEY CHECK (name = 'dispatch'),
    holder        text,
    holder_pid    integer,
    holder_boot   text,     -- /proc/sys/kernel/random/boot_id
    holder_pidns  text,     -- readlink /proc/self/ns/pid
    holder_start  bigint,   -- /proc/PID/stat starttime (clock ticks since boot)
    epoch         bigint NOT NULL DEFAULT 0,
    expires_at    double precision,
    acquired_at   double precision,
    renewed_at    double precision
);
INSERT INTO lease (name, epoch) VALUES ('dispatch', 0);
