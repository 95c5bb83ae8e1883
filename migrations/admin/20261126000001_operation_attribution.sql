-- Who moved a bulk operation after starting it: who asked it to stop, and who ran it (a resumed operation's
-- sends and discards are recorded under whoever resumed it, not under its starter).
ALTER TABLE saga_dlq_operations ADD COLUMN IF NOT EXISTS cancelled_by TEXT;
ALTER TABLE saga_dlq_operations ADD COLUMN IF NOT EXISTS cancelled_at TIMESTAMPTZ;

-- Each run of an operation: its number (1 for the run its start began), who ran it, when.
CREATE TABLE IF NOT EXISTS saga_dlq_operation_runs (
    operation_id BIGINT      NOT NULL REFERENCES saga_dlq_operations (id) ON DELETE CASCADE,
    run          INTEGER     NOT NULL,
    operator     TEXT        NOT NULL,
    started_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (operation_id, run)
);
