-- A saga whose timer fails to fire (its transition errs every time) is marked and tried later, with
-- backoff, instead of aborting every other due timer of its type.
ALTER TABLE saga_instances ADD COLUMN IF NOT EXISTS timer_failures INTEGER NOT NULL DEFAULT 0;
ALTER TABLE saga_instances ADD COLUMN IF NOT EXISTS last_error TEXT;
