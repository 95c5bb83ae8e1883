-- Dead letters replayed by `saga dlq replay` (saga-admin), by their place in the dead-letter topic: a replay
-- run again sends each dead letter once. `replays` counts the sends (more than one only with --force).
CREATE TABLE IF NOT EXISTS saga_dlq_replays (
    dlq_topic          TEXT        NOT NULL,
    dlq_partition      INTEGER     NOT NULL,
    dlq_offset         BIGINT      NOT NULL,
    original_topic     TEXT        NOT NULL,
    original_partition INTEGER     NOT NULL,
    original_offset    BIGINT      NOT NULL,
    replays            INTEGER     NOT NULL DEFAULT 0,
    -- Set once the broker acknowledged the last send (NULL: a send was under way when the run stopped).
    replayed_at        TIMESTAMPTZ,
    created_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (dlq_topic, dlq_partition, dlq_offset)
);
