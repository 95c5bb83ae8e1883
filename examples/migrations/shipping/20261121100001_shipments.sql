-- The shipping service's own tables.
CREATE TABLE shipments (
    order_id    UUID        PRIMARY KEY,
    shipment_id UUID        NOT NULL,
    ship_to     TEXT        NOT NULL,
    -- ARRANGED, or FAILED when the address cannot be served.
    status      TEXT        NOT NULL CHECK (status IN ('ARRANGED', 'FAILED')),
    reason      TEXT,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
