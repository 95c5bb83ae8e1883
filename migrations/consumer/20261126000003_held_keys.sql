-- Per-key order through failures. A key is held for a consumer group when a message of it was dead-lettered
-- under the hold-key policy (its head letter), or when a message of a paused step arrived. Later messages of
-- a held key are parked here in arrival order and released one at a time, in that order, once the head is
-- replayed and succeeds, discarded, or its step resumed (see saga-consumer's `hold` module).
CREATE TABLE IF NOT EXISTS saga_held_keys (
    group_id     TEXT        NOT NULL,
    -- The Kafka message key (empty for keyless messages of a paused step).
    key          BYTEA       NOT NULL,
    -- `held`: nothing of it runs; `releasing`: its parked messages run one at a time, in order.
    state        TEXT        NOT NULL DEFAULT 'held' CHECK (state IN ('held', 'releasing')),
    -- `dead-letter` (its head letter failed) or `paused` (its messages wait for a paused step).
    cause        TEXT        NOT NULL CHECK (cause IN ('dead-letter', 'paused')),
    paused_step  TEXT,
    -- The dead letter at its head: identity (what a replay's `saga-replay-letter` header names) and position.
    head_letter  TEXT,
    head_topic   TEXT,
    head_partition INT,
    head_offset  BIGINT,
    head_reason  TEXT,
    -- The parked message last sent to the retry topic for release, and when.
    in_flight    BIGINT,
    in_flight_at TIMESTAMPTZ,
    parked       BIGINT      NOT NULL DEFAULT 0,
    held_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    released_by  TEXT,
    released_at  TIMESTAMPTZ,
    PRIMARY KEY (group_id, key)
);
CREATE INDEX IF NOT EXISTS saga_held_keys_head ON saga_held_keys (head_letter) WHERE head_letter IS NOT NULL;

CREATE TABLE IF NOT EXISTS saga_parked_messages (
    group_id      TEXT        NOT NULL,
    key           BYTEA       NOT NULL,
    seq           BIGSERIAL,
    -- Where it was first consumed (a replay's original coordinates).
    topic         TEXT        NOT NULL,
    "partition"   INT         NOT NULL,
    "offset"      BIGINT      NOT NULL,
    -- The step it is routed to, if any (a paused step's messages are not released while it is paused).
    step          TEXT,
    message_key   BYTEA,
    payload       BYTEA,
    header_names  TEXT[]      NOT NULL,
    header_values BYTEA[]     NOT NULL,
    timestamp_ms  BIGINT,
    -- What its release must carry: SHA-256 over its key, payload and headers but a replay's (hex).
    digest        TEXT        NOT NULL,
    parked_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, key, seq)
);

-- Steps an operator paused (`saga steps pause`), and who did what when.
CREATE TABLE IF NOT EXISTS saga_paused_steps (
    group_id   TEXT        NOT NULL,
    step       TEXT        NOT NULL,
    paused_by  TEXT        NOT NULL,
    reason     TEXT        NOT NULL,
    paused_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- When consumers start parking its messages: a little after every consumer of the group has seen it.
    effective_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, step)
);
CREATE TABLE IF NOT EXISTS saga_step_pause_log (
    id         BIGSERIAL   PRIMARY KEY,
    group_id   TEXT        NOT NULL,
    step       TEXT        NOT NULL,
    action     TEXT        NOT NULL CHECK (action IN ('pause', 'resume')),
    operator   TEXT        NOT NULL,
    reason     TEXT        NOT NULL,
    at         TIMESTAMPTZ NOT NULL DEFAULT now()
);
