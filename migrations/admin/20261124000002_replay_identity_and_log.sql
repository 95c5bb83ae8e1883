-- A dead letter is identified by its position and its identity (its original coordinates and a hash of
-- its key, value and headers): after a dead-letter topic is deleted and recreated, a new letter at a reused
-- position is a new letter. Rows written before this migration have an empty hash; they stand for the
-- letter that was dead-lettered at the position before they were replayed (see `saga dlq replay`).
ALTER TABLE saga_dlq_replays ADD COLUMN IF NOT EXISTS letter_hash TEXT NOT NULL DEFAULT '';
ALTER TABLE saga_dlq_replays DROP CONSTRAINT IF EXISTS saga_dlq_replays_pkey;
ALTER TABLE saga_dlq_replays ADD PRIMARY KEY (dlq_topic, dlq_partition, dlq_offset, letter_hash);
-- The consumer group the letter belonged to, and who replayed it last.
ALTER TABLE saga_dlq_replays ADD COLUMN IF NOT EXISTS consumer_group TEXT;
ALTER TABLE saga_dlq_replays ADD COLUMN IF NOT EXISTS replayed_by TEXT;

-- Every send of a replay: which letter, who, when, and where it went (the group's retry topic).
CREATE TABLE IF NOT EXISTS saga_dlq_replay_log (
    id              BIGSERIAL   PRIMARY KEY,
    dlq_topic       TEXT        NOT NULL,
    dlq_partition   INTEGER     NOT NULL,
    dlq_offset      BIGINT      NOT NULL,
    letter_hash     TEXT        NOT NULL,
    consumer_group  TEXT        NOT NULL,
    operator        TEXT        NOT NULL,
    forced          BOOLEAN     NOT NULL DEFAULT false,
    retry_topic     TEXT        NOT NULL,
    retry_partition INTEGER     NOT NULL,
    retry_offset    BIGINT      NOT NULL,
    idempotency_key TEXT,
    tenant_id       TEXT,
    sent_at         TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS saga_dlq_replay_log_topic ON saga_dlq_replay_log (dlq_topic, sent_at);
