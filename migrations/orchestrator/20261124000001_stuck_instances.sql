-- A due saga the definition has no move for (a step it was at is gone from the definition, say) is
-- marked stuck with the reason, and its deadline cleared, instead of being locked on every tick and
-- starving the other timers of its type. `saga sagas list --stuck` shows it; a transition clears it.
ALTER TABLE saga_instances ADD COLUMN IF NOT EXISTS stuck_reason TEXT;
ALTER TABLE saga_instances ADD COLUMN IF NOT EXISTS stuck_at TIMESTAMPTZ;
