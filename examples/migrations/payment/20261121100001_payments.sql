-- The payment service's own tables.
CREATE TABLE payments (
    order_id     UUID        PRIMARY KEY,
    charge_id    TEXT,
    amount_cents BIGINT      NOT NULL,
    -- CHARGED, DECLINED, or REFUNDED after compensation.
    status       TEXT        NOT NULL CHECK (status IN ('CHARGED', 'DECLINED', 'REFUNDED')),
    refund_id    TEXT,
    reason       TEXT,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at   TIMESTAMPTZ NOT NULL DEFAULT now()
);
