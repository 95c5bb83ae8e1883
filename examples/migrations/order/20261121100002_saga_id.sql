-- Orchestrated mode: the saga instance that runs the order.
ALTER TABLE orders ADD COLUMN saga_id UUID;
