-- Bulk operations on dead letters (`saga dlq replay --group`, `saga dlq discard`, and their undo): who
-- started them, what they selected, how far they got. A run that dies leaves its operation `running`;
-- `saga dlq operations resume` goes on with the letters not done yet (a replay sends each letter once:
-- see `saga_dlq_replays`).
CREATE TABLE IF NOT EXISTS saga_dlq_operations (
    id               BIGSERIAL   PRIMARY KEY,
    kind             TEXT        NOT NULL CHECK (kind IN ('replay', 'discard', 'undo-discard')),
    operator         TEXT        NOT NULL,
    -- What was selected: the dead-letter topic and failure group, or the operation undone.
    selection        JSONB       NOT NULL,
    status           TEXT        NOT NULL DEFAULT 'running' CHECK (status IN ('running', 'done', 'cancelled')),
    cancel_requested BOOLEAN     NOT NULL DEFAULT false,
    -- How many runs started: a run after the first resumes one that stopped.
    runs             INTEGER     NOT NULL DEFAULT 0,
    planned          INTEGER     NOT NULL,
    -- Letters sent (replay), discarded (discard) or restored (undo-discard).
    done             INTEGER     NOT NULL DEFAULT 0,
    -- Letters left alone: replayed or discarded already, or gone from the topic.
    skipped          INTEGER     NOT NULL DEFAULT 0,
    -- Letters a replay refuses: truncated copies, letters of another group, replayed too often.
    refused          INTEGER     NOT NULL DEFAULT 0,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    finished_at      TIMESTAMPTZ
);

-- The letters an operation selected, in order, and what it did with each (NULL: not yet).
CREATE TABLE IF NOT EXISTS saga_dlq_operation_letters (
    operation_id  BIGINT      NOT NULL REFERENCES saga_dlq_operations (id) ON DELETE CASCADE,
    seq           INTEGER     NOT NULL,
    dlq_topic     TEXT        NOT NULL,
    dlq_partition INTEGER     NOT NULL,
    dlq_offset    BIGINT      NOT NULL,
    letter_hash   TEXT        NOT NULL,
    outcome       TEXT        CHECK (outcome IN ('done', 'skipped', 'refused')),
    detail        TEXT,
    done_at       TIMESTAMPTZ,
    PRIMARY KEY (operation_id, seq)
);

-- Dead letters resolved without sending. Reversible: an undo sets undone_at, and the letter is open again.
CREATE TABLE IF NOT EXISTS saga_dlq_discards (
    dlq_topic         TEXT        NOT NULL,
    dlq_partition     INTEGER     NOT NULL,
    dlq_offset        BIGINT      NOT NULL,
    letter_hash       TEXT        NOT NULL,
    consumer_group    TEXT        NOT NULL,
    idempotency_key   TEXT,
    tenant_id         TEXT,
    operation_id      BIGINT      NOT NULL REFERENCES saga_dlq_operations (id),
    discarded_by      TEXT        NOT NULL,
    discarded_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    undone_by         TEXT,
    undone_at         TIMESTAMPTZ,
    undo_operation_id BIGINT      REFERENCES saga_dlq_operations (id),
    PRIMARY KEY (dlq_topic, dlq_partition, dlq_offset, letter_hash)
);
CREATE INDEX IF NOT EXISTS saga_dlq_discards_operation ON saga_dlq_discards (operation_id);
