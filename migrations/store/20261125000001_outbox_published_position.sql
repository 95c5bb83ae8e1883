-- Where the broker put a published row: its partition and offset, set with `published_at` by the relay
-- (`saga trace` shows them beside the step that wrote the row).
ALTER TABLE saga_outbox ADD COLUMN IF NOT EXISTS published_partition INTEGER;
ALTER TABLE saga_outbox ADD COLUMN IF NOT EXISTS published_offset BIGINT;
