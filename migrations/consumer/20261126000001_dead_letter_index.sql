-- The index of dead letters: one row per letter of the schema's dead-letter topics, written by the consumer
-- once the broker acknowledged the letter and before the message's offset is committed (idempotent by
-- position), and by the operators' toolkit for letters it finds in a topic that no consumer indexed (written
-- before this table existed, or by hand). The toolkit reads groups, counts, traces and lists from here, and
-- reads the topic only to show or replay a letter.
CREATE TABLE IF NOT EXISTS saga_dead_letters (
    dlq_topic          TEXT        NOT NULL,
    dlq_partition      INTEGER     NOT NULL,
    dlq_offset         BIGINT      NOT NULL,
    -- The letter's identity: a hash of its original coordinates, key, payload and headers.
    letter_hash        TEXT        NOT NULL,
    -- `g-` and twelve hexadecimal digits of the letter's cause; `cause` is its normalised error.
    failure_group      TEXT        NOT NULL,
    cause              TEXT        NOT NULL,
    consumer_group     TEXT        NOT NULL,
    original_topic     TEXT        NOT NULL,
    original_partition INTEGER     NOT NULL,
    original_offset    BIGINT      NOT NULL,
    step               TEXT,
    reason             TEXT        NOT NULL,
    error              TEXT        NOT NULL,
    attempts           INTEGER     NOT NULL,
    failed_at          TIMESTAMPTZ NOT NULL,
    idempotency_key    TEXT,
    tenant_id          TEXT        NOT NULL,
    truncated          BOOLEAN     NOT NULL,
    replay_count       INTEGER     NOT NULL,
    -- What is wrong with a letter whose headers cannot be read (its reason is `unreadable`).
    unreadable         TEXT,
    indexed_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (dlq_topic, dlq_partition, dlq_offset)
);

CREATE INDEX IF NOT EXISTS saga_dead_letters_group ON saga_dead_letters (dlq_topic, failure_group);
CREATE INDEX IF NOT EXISTS saga_dead_letters_key ON saga_dead_letters (idempotency_key);

-- How far the toolkit has made sure the index holds every letter of a partition: every offset below
-- `next_offset` that the topic still holds is indexed.
CREATE TABLE IF NOT EXISTS saga_dead_letter_scans (
    dlq_topic     TEXT    NOT NULL,
    dlq_partition INTEGER NOT NULL,
    next_offset   BIGINT  NOT NULL,
    PRIMARY KEY (dlq_topic, dlq_partition)
);
