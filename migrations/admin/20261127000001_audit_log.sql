-- The audit log: every state-changing action of the `saga` command and the inspector page, who took it,
-- why, when, what it touched and how it ended. A row is written before the action runs (outcome `running`)
-- and finished after it: an action whose process died midway stays `running`, visibly.
CREATE TABLE IF NOT EXISTS saga_admin_audit (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    finished_at TIMESTAMPTZ,
    operator    TEXT        NOT NULL,
    reason      TEXT,
    -- `command` or `page`.
    via         TEXT        NOT NULL,
    -- What was done, as `saga` names it: `dlq replay`, `keys release`, `outbox retry`, ...
    action      TEXT        NOT NULL,
    -- What it touched: names and values (topic, group, key, operation, ...), as printable text.
    target      JSONB       NOT NULL DEFAULT '{}'::jsonb,
    -- `running`, then `done`, `refused` (the input was wrong: nothing was done) or `failed`.
    outcome     TEXT        NOT NULL DEFAULT 'running',
    -- What it did (`3 sent`), or why it was refused or failed.
    detail      TEXT
);

CREATE INDEX IF NOT EXISTS saga_admin_audit_at ON saga_admin_audit (at DESC);

-- Why an operation's last run stopped before its end (the broker unreachable, a read that timed out), and
-- when: shown with the operation until a run goes on with it.
ALTER TABLE saga_dlq_operations ADD COLUMN IF NOT EXISTS stopped_error TEXT;
ALTER TABLE saga_dlq_operations ADD COLUMN IF NOT EXISTS stopped_at TIMESTAMPTZ;
