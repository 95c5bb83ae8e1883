-- Who holds a two-phase lease (`{group}@{host}/{pid}`), for operators: `saga leases`, `saga keys show`.
ALTER TABLE saga_idempotency_keys ADD COLUMN IF NOT EXISTS lease_holder TEXT;
