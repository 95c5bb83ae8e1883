-- When the toolkit last made sure the index holds every letter of a partition: how stale an index that
-- cannot be brought up to date is.
ALTER TABLE saga_dead_letter_scans ADD COLUMN IF NOT EXISTS synced_at TIMESTAMPTZ;
