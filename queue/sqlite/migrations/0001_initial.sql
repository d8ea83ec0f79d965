-- Schema v1 of the hl7-agent queue (docs/queue.md#row-states).
--
-- Rules for every later migration: additive only (new tables, new nullable
-- columns, new indexes), explicit column lists in every query, so the previous
-- agent version keeps working on a migrated file during an upgrade overlap.
-- The state set below is frozen.
-- Timestamps are REAL Unix seconds (UTC); the CLI renders them as RFC 3339.

CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
) STRICT;

-- One row per frame that reached intake with an MSH (queued), and one audit
-- row (nacked) per frame that was refused, answered as a duplicate conflict,
-- was an inbound ACK, or had no MSH at all.
CREATE TABLE messages (
    id                   TEXT PRIMARY KEY,          -- transmit UUID, fixed for life
    channel              TEXT NOT NULL,
    seq                  INTEGER,                   -- per-channel, queued rows only
    state                TEXT NOT NULL CHECK (state IN
        ('queued', 'claimed', 'inflight', 'processed', 'rejected', 'failed', 'nacked')),
    remote               TEXT NOT NULL,             -- peer "host:port"
    sending_app          TEXT NOT NULL DEFAULT '',  -- MSH-3
    sending_facility     TEXT NOT NULL DEFAULT '',  -- MSH-4
    control_id           TEXT NOT NULL DEFAULT '',  -- MSH-10
    message_type         TEXT NOT NULL DEFAULT '',  -- MSH-9
    encoding             TEXT,                      -- Python codec the body decodes with
    body                 BLOB NOT NULL,             -- bytes exactly as received
    body_sha256          TEXT NOT NULL,
    ack_mode             TEXT NOT NULL DEFAULT 'commit'
        CHECK (ack_mode IN ('commit', 'application', 'enhanced')),
    accept_ack_type      TEXT NOT NULL DEFAULT '',  -- MSH-15
    application_ack_type TEXT NOT NULL DEFAULT '',  -- MSH-16
    ack_sent             BLOB,                      -- intake ACK sent to the source
    app_ack              BLOB,                      -- application ACK owed/relayed to the source
    ack_outcome          TEXT NOT NULL DEFAULT 'pending'
        CHECK (ack_outcome IN ('pending', 'delivered', 'undelivered', 'not_owed')),
    attempts             INTEGER NOT NULL DEFAULT 0,  -- grows for life (attempt-scoped settles)
    redrive_base         INTEGER NOT NULL DEFAULT 0,  -- attempts at the last operator re-drive
    next_attempt_at      REAL NOT NULL DEFAULT 0,
    claim_epoch          INTEGER,                   -- lease epoch of the last claim
    server_status        INTEGER,
    server_ack           TEXT,
    error_code           TEXT,
    error_text           TEXT,
    received_at          REAL NOT NULL,
    claimed_at           REAL,
    sent_at              REAL,
    settled_at           REAL,
    updated_at           REAL NOT NULL
) STRICT;

-- The head of a channel: lowest seq among live rows (claim is FIFO per channel).
CREATE INDEX messages_live_head ON messages (channel, seq)
    WHERE state IN ('queued', 'claimed', 'inflight');
CREATE UNIQUE INDEX messages_channel_seq ON messages (channel, seq) WHERE seq IS NOT NULL;
CREATE INDEX messages_state_updated ON messages (state, updated_at);
CREATE INDEX messages_received ON messages (received_at);
CREATE INDEX messages_control_id ON messages (control_id);

-- Per-channel durable state: the seq counter (advanced in the same
-- BEGIN IMMEDIATE as the queued insert) and the operator's pause flag.
CREATE TABLE channels (
    channel       TEXT PRIMARY KEY,
    last_seq      INTEGER NOT NULL DEFAULT 0,
    paused        INTEGER NOT NULL DEFAULT 0 CHECK (paused IN (0, 1)),
    paused_at     REAL,
    paused_reason TEXT
) STRICT;

-- Dedupe keys outlive their rows: purging messages never forgets a key
-- before dedupe_window (docs/queue.md#dedupe).
CREATE TABLE dedupe_keys (
    channel          TEXT NOT NULL,
    sending_app      TEXT NOT NULL,
    sending_facility TEXT NOT NULL,
    control_id       TEXT NOT NULL,
    body_sha256      TEXT NOT NULL,
    message_id       TEXT NOT NULL,
    ack_mode         TEXT NOT NULL,
    commit_ack       BLOB,            -- intake ACK as sent (replayed byte for byte)
    app_ack          BLOB,            -- application ACK once known
    expires_at       REAL NOT NULL,
    PRIMARY KEY (channel, sending_app, sending_facility, control_id)
) STRICT, WITHOUT ROWID;
CREATE INDEX dedupe_keys_expiry ON dedupe_keys (expires_at);

-- The dispatch lease: one row. Every dispatch write is fenced on epoch.
CREATE TABLE lease (
    name          TEXT PRIMARY KEY CHECK (name = 'dispatch'),
    holder        TEXT,
    holder_pid    INTEGER,
    holder_boot   TEXT,     -- /proc/sys/kernel/random/boot_id
    holder_pidns  TEXT,     -- readlink /proc/self/ns/pid
    holder_start  INTEGER,  -- /proc/PID/stat starttime (clock ticks since boot)
    epoch         INTEGER NOT NULL DEFAULT 0,
    expires_at    REAL,
    acquired_at   REAL,
    renewed_at    REAL
) STRICT;
INSERT INTO lease (name, epoch) VALUES ('dispatch', 0);
