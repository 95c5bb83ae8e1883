-- Delayed retries (`SAGA_RETRY_DELAYED`): a message that failed transiently is parked at its key's head with
-- the time its next attempt is due, and its key is held (cause `retrying`) until it runs again and succeeds,
-- or is dead-lettered. The attempts it made and its last error travel with the parked message: a released
-- message that fails again is parked again, with a later due time. A parked message without a due time is
-- due at once (every message parked behind a dead letter or a paused step).
ALTER TABLE saga_parked_messages
    ADD COLUMN IF NOT EXISTS attempts   INT NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS due_at     TIMESTAMPTZ,
    ADD COLUMN IF NOT EXISTS last_error TEXT;
ALTER TABLE saga_held_keys DROP CONSTRAINT IF EXISTS saga_held_keys_cause_check;
ALTER TABLE saga_held_keys ADD CONSTRAINT saga_held_keys_cause_check
    CHECK (cause IN ('dead-letter', 'paused', 'retrying'));
