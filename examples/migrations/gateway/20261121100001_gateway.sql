-- The simulated payment gateway: an external system with its own storage, outside the payment service's
-- transactions. Like a real gateway it deduplicates on the caller's idempotency key. Its ledger is the
-- ground truth of what was charged and refunded.
CREATE TABLE gateway_charges (
    idempotency_key TEXT        PRIMARY KEY,
    charge_id       TEXT        NOT NULL UNIQUE,
    order_id        UUID        NOT NULL,
    amount_cents    BIGINT      NOT NULL,
    declined        BOOLEAN     NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE TABLE gateway_refunds (
    idempotency_key TEXT        PRIMARY KEY,
    refund_id       TEXT        NOT NULL UNIQUE,
    charge_id       TEXT        NOT NULL REFERENCES gateway_charges (charge_id),
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now()
);
