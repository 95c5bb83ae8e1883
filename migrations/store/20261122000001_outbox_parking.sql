-- Parking: a row the broker refuses for good (too large, not a valid record) is set aside after a few
-- attempts instead of being retried forever. A parked row is not published, stays visible to operators
-- (`outbox-relay status`, `saga outbox status`, the metric `saga_relay_parked_rows`) with its `last_error`,
-- and is published again once `parked_at` is cleared.
ALTER TABLE saga_outbox ADD COLUMN IF NOT EXISTS parked_at TIMESTAMPTZ;

DROP INDEX IF EXISTS saga_outbox_unpublished;
CREATE INDEX saga_outbox_unpublished ON saga_outbox (id) WHERE published_at IS NULL AND parked_at IS NULL;
CREATE INDEX IF NOT EXISTS saga_outbox_parked ON saga_outbox (parked_at) WHERE parked_at IS NOT NULL;
