-- Orchestrated sagas: the orchestrator's persistent state, one row per saga instance, and its history.
-- Applied by saga-orchestrator (`saga_orchestrator::migrate`).
--
-- Written to be re-runnable: databases set up by 0.1.0, whose single migration set already created these
-- objects, upgrade by running it again (IF NOT EXISTS).
--
-- Every transition is an optimistic-concurrency update (`WHERE saga_id = $1 AND version = $2`) made in the
-- same transaction as the outbox rows (commands) it emits and the step key of the reply that caused it.
CREATE TABLE IF NOT EXISTS saga_instances (
    saga_id         UUID        PRIMARY KEY,
    saga_type       TEXT        NOT NULL,
    tenant_id       TEXT        NOT NULL,
    idempotency_key TEXT        NOT NULL,
    status          TEXT        NOT NULL CHECK (status IN ('running', 'compensating', 'completed', 'compensated')),
    -- The step being run (running) or compensated (compensating).
    step_index      INTEGER     NOT NULL,
    -- How many times the current command was sent (timeouts may re-send it, with the same key).
    attempt         INTEGER     NOT NULL DEFAULT 1,
    -- The step keys issued so far, by step (and compensation) name.
    step_keys       JSONB       NOT NULL DEFAULT '{}',
    -- The saga's data: what it was started with, and every reply's payload under its step's name.
    data            JSONB       NOT NULL,
    -- The durable timer of the current step; NULL once the saga ended.
    deadline        TIMESTAMPTZ,
    failure         TEXT,
    version         INTEGER     NOT NULL DEFAULT 1,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, saga_type, idempotency_key)
);

CREATE INDEX IF NOT EXISTS saga_instances_due ON saga_instances (deadline) WHERE deadline IS NOT NULL;

CREATE TABLE IF NOT EXISTS saga_transitions (
    saga_id     UUID        NOT NULL REFERENCES saga_instances (saga_id) ON DELETE CASCADE,
    -- The instance's version after the transition.
    version     INTEGER     NOT NULL,
    at          TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    from_status TEXT,
    to_status   TEXT        NOT NULL,
    step        TEXT,
    -- What caused it: `started`, a reply's event type, `timeout`.
    cause       TEXT        NOT NULL,
    PRIMARY KEY (saga_id, version)
);
