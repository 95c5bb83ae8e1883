-- Where the message at a held key's head was first consumed: a redelivery of it (its offset not committed
-- before a crash, a revoke or a shutdown) is recognised and skipped, rather than parked behind its own key's
-- queue, where a discard of its letter would later run it.
ALTER TABLE saga_held_keys
    ADD COLUMN IF NOT EXISTS head_origin_topic     TEXT,
    ADD COLUMN IF NOT EXISTS head_origin_partition INT,
    ADD COLUMN IF NOT EXISTS head_origin_offset    BIGINT;
