-- Each consumer group that runs in this schema, with its dead-letter and retry topics, written at start:
-- `saga dlq replay` finds the group a dead-letter topic belongs to and replays into that group's retry
-- topic only, so that no other group reading the original topic ever sees a replay.
CREATE TABLE IF NOT EXISTS saga_consumer_groups (
    group_id    TEXT        PRIMARY KEY,
    dlq_topic   TEXT        NOT NULL,
    retry_topic TEXT        NOT NULL,
    topics      TEXT[]      NOT NULL,
    started_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS saga_consumer_groups_dlq_topic ON saga_consumer_groups (dlq_topic);
