-- The WAL outbox made as safe as the table outbox.
--
-- The schema's record of its replication slot: which slot holds its events, since when, and how far its
-- relay confirmed. A slot recorded here that is gone (dropped, a failover, a restore) or lost
-- (`wal_status = 'lost'`) is never made again silently: writers stop, and `saga outbox wal recover`
-- makes a new one and records what was lost in saga_outbox_wal_incidents.
CREATE TABLE IF NOT EXISTS saga_outbox_wal_slot (
    singleton     BOOLEAN     PRIMARY KEY DEFAULT true CHECK (singleton),
    slot_name     TEXT        NOT NULL,
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    created_lsn   PG_LSN,
    -- The last position a relay confirmed, and the commit time of the transaction that ended there.
    confirmed_lsn PG_LSN,
    confirmed_at  TIMESTAMPTZ,
    -- When a relay first read the slot, once the table outbox was drained and no table-mode writer was left.
    switched_at   TIMESTAMPTZ,
    -- When a process first found the slot lost or gone; only a recovery clears it.
    lost_at       TIMESTAMPTZ
);

CREATE TABLE IF NOT EXISTS saga_outbox_wal_incidents (
    id              BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    slot_name       TEXT        NOT NULL,
    -- 'lost' (the server dropped what the slot held) or 'gone' (no such slot).
    what            TEXT        NOT NULL,
    -- Events committed after lost_from_lsn (at lost_from_time) and before lost_to_lsn may never have been
    -- published.
    lost_from_lsn   PG_LSN,
    lost_from_time  TIMESTAMPTZ NOT NULL,
    lost_to_lsn     PG_LSN      NOT NULL,
    lost_to_time    TIMESTAMPTZ NOT NULL,
    steps_in_window BIGINT      NOT NULL,
    recovered_by    TEXT        NOT NULL,
    recovered_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Parked events hold their key: an event that cannot be published is parked with every later event of its
-- key (in commit order), so that the slot moves on for the other keys, and they are published in order once
-- the cause is gone. Each is parked once, by its place in the log (message_lsn, event_index), however often
-- a relay reads it again after a crash.
ALTER TABLE saga_outbox_wal_parked
    ADD COLUMN IF NOT EXISTS message_lsn     PG_LSN,
    ADD COLUMN IF NOT EXISTS event_index     INTEGER,
    -- Rows parked before this version did not hold their key (NULL): only new rows do.
    ADD COLUMN IF NOT EXISTS holds_key       BOOLEAN,
    ADD COLUMN IF NOT EXISTS next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS published_at    TIMESTAMPTZ,
    ADD COLUMN IF NOT EXISTS discarded_at    TIMESTAMPTZ,
    ADD COLUMN IF NOT EXISTS discarded_by    TEXT;

CREATE UNIQUE INDEX IF NOT EXISTS saga_outbox_wal_parked_position
    ON saga_outbox_wal_parked (message_lsn, event_index);
CREATE INDEX IF NOT EXISTS saga_outbox_wal_parked_open
    ON saga_outbox_wal_parked (id) WHERE published_at IS NULL AND discarded_at IS NULL;
