-- The idempotency store: one row per (tenant, step key).
--
-- Transactional mode writes the row inside the handler's transaction, already in its final state, so it is
-- visible only if the handler's effects are. Two-phase mode commits a `started` row with a lease first, and
-- completes it in a second transaction fenced by `attempts`.
CREATE TABLE saga_idempotency_keys (
    tenant_id        TEXT        NOT NULL,
    step_key         TEXT        NOT NULL,
    status           TEXT        NOT NULL CHECK (status IN ('started', 'completed', 'failed')),
    -- Number of times the key was claimed; the fencing token of two-phase mode.
    attempts         INTEGER     NOT NULL DEFAULT 1 CHECK (attempts > 0),
    -- Only for `started` rows: until when the claiming worker owns the key.
    lease_expires_at TIMESTAMPTZ,
    -- The stored outcome (handler result, rejection details or HTTP response), replayed to duplicates.
    outcome          JSONB,
    -- Why the step failed (business rejection) or why the last attempt was released.
    error            TEXT,
    -- HTTP entry points: a fingerprint of the request that first used the key.
    request_hash     BYTEA,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, step_key),
    CHECK ((status = 'started') = (lease_expires_at IS NOT NULL))
);

-- Garbage collection of finished keys, oldest first.
CREATE INDEX saga_idempotency_keys_finished ON saga_idempotency_keys (updated_at)
    WHERE status <> 'started';

-- Sweeping of abandoned two-phase claims.
CREATE INDEX saga_idempotency_keys_leases ON saga_idempotency_keys (lease_expires_at)
    WHERE status = 'started';

-- Claims one key in the caller's transaction without waiting for a concurrent claimant (HTTP entry points
-- answer 409 instead of queueing). The claimant holds a transaction-scoped advisory lock on the key's
-- 64-bit hash until its transaction ends; only this function inserts such keys, and always under that lock,
-- so the INSERT below never waits either. A new key is written `completed` (the caller's transaction
-- decides whether that becomes visible); an existing one is returned with its outcome.
CREATE FUNCTION saga_try_claim_key(p_tenant TEXT, p_key TEXT, p_request_hash BYTEA)
RETURNS TABLE (claimed BOOLEAN, busy BOOLEAN, status TEXT, outcome JSONB, error TEXT, request_hash BYTEA)
LANGUAGE plpgsql AS $$
BEGIN
    -- Scoped by schema: services sharing a database must not block each other's keys.
    IF NOT pg_try_advisory_xact_lock(
        hashtextextended(current_schema() || '/' || p_tenant || '/' || p_key, 1397178177)
    ) THEN
        RETURN QUERY SELECT false, true, NULL::TEXT, NULL::JSONB, NULL::TEXT, NULL::BYTEA;
        RETURN;
    END IF;
    INSERT INTO saga_idempotency_keys (tenant_id, step_key, status, request_hash)
    VALUES (p_tenant, p_key, 'completed', p_request_hash)
    ON CONFLICT (tenant_id, step_key) DO NOTHING;
    IF FOUND THEN
        RETURN QUERY SELECT true, false, 'completed'::TEXT, NULL::JSONB, NULL::TEXT, p_request_hash;
        RETURN;
    END IF;
    RETURN QUERY
        SELECT false, false, k.status, k.outcome, k.error, k.request_hash
        FROM saga_idempotency_keys k
        WHERE k.tenant_id = p_tenant AND k.step_key = p_key;
END
$$;
