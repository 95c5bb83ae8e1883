-- The order service's own tables (its schema also holds the framework's tables).
CREATE TABLE orders (
    order_id        UUID        PRIMARY KEY,
    tenant_id       TEXT        NOT NULL,
    idempotency_key TEXT        NOT NULL,
    customer        TEXT        NOT NULL,
    amount_cents    BIGINT      NOT NULL CHECK (amount_cents > 0),
    ship_to         TEXT        NOT NULL,
    -- PENDING -> PAID -> COMPLETED, or -> CANCELLED (declined, or refunded after a failed shipment).
    status          TEXT        NOT NULL CHECK (status IN ('PENDING', 'PAID', 'COMPENSATING', 'COMPLETED', 'CANCELLED')),
    reason          TEXT,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, idempotency_key)
);

-- Where each saga stands, step by step.
CREATE TABLE order_history (
    order_id UUID        NOT NULL REFERENCES orders (order_id),
    at       TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    status   TEXT        NOT NULL,
    note     TEXT        NOT NULL
);
CREATE INDEX order_history_order ON order_history (order_id, at);
