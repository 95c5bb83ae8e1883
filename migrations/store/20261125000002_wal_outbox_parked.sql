-- The WAL outbox's events the broker refuses for good (too large, not a valid record), set aside with the
-- reason after a few attempts instead of holding the relay (and the slot) forever. Publish one again by
-- hand, or write it again in a transaction of its own, after fixing the cause.
CREATE TABLE IF NOT EXISTS saga_outbox_wal_parked (
    id            BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    commit_lsn    TEXT        NOT NULL,
    tenant_id     TEXT        NOT NULL,
    topic         TEXT        NOT NULL,
    partition_key TEXT,
    headers       TEXT[]      NOT NULL DEFAULT '{}',
    payload       BYTEA,
    error         TEXT        NOT NULL,
    attempts      INTEGER     NOT NULL,
    parked_at     TIMESTAMPTZ NOT NULL DEFAULT now()
);
