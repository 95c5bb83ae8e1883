-- A retry an operator asked for (`saga sagas retry`): the instance is made due at once, and the service's
-- orchestrator (which has the definition) re-sends its current command, with the same step key, at its next
-- timer tick. Any transition clears the request.
ALTER TABLE saga_instances ADD COLUMN IF NOT EXISTS retry_requested_by TEXT;
ALTER TABLE saga_instances ADD COLUMN IF NOT EXISTS retry_requested_at TIMESTAMPTZ;
-- A retry's transition names who asked for it and the version whose attempt it retries.
ALTER TABLE saga_transitions ADD COLUMN IF NOT EXISTS operator TEXT;
ALTER TABLE saga_transitions ADD COLUMN IF NOT EXISTS retry_of INTEGER;
