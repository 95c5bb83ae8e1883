-- Indexes that make each of the trace's lists one index range read stopped by its LIMIT: a key with a
-- million rows costs what its first thousand cost, and a key with none one index probe. They replace the
-- indexes of 20261127000001, which found a key's rows and left them to be sorted (all of them read).
--
-- Upgrading a large table: the indexes are built in the migration's transaction, which holds writes to the
-- table for as long as a build takes. To build them without that, create them first by hand with
-- `CREATE INDEX CONCURRENTLY` under the same names (the function first); the migration then finds them. A
-- concurrent build that failed leaves an invalid index under its name (`pg_index.indisvalid`): the
-- migration drops it and builds it again, and until then the trace reads without it and says so.

-- The client's key a step key was derived from: `{key}:{step}` without its last `:{step}` (a step's name
-- holds no ':'; a key may). An expression, for the same reason as `saga_header`; the trace writes its body
-- out, so that it reads schemas migrated before it too.
CREATE OR REPLACE FUNCTION saga_step_owner(step_key TEXT) RETURNS TEXT
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN left(step_key, length(step_key) - strpos(reverse(step_key), ':'));

-- Indexes of these names left invalid by a failed concurrent build.
DO $$
DECLARE
    name TEXT;
BEGIN
    FOR name IN
        SELECT c.relname FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid
        WHERE c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema()) AND NOT x.indisvalid
          AND c.relname IN ('saga_outbox_key_order', 'saga_idempotency_keys_owner')
    LOOP
        EXECUTE format('DROP INDEX %I.%I', current_schema(), name);
    END LOOP;
END
$$;

-- A key's events in the outbox's order.
CREATE INDEX IF NOT EXISTS saga_outbox_key_order
    ON saga_outbox (saga_header(headers, 'idempotency-key'), id);
DROP INDEX IF EXISTS saga_outbox_idempotency_key;

-- A key's own step keys (not those of the keys it prefixes: `cust-1` of `cust-1:order-7`): one per step,
-- tenant and HTTP operation, few enough to sort, so the index holds no more than the owner (it is written
-- with every message a consumer takes).
CREATE INDEX IF NOT EXISTS saga_idempotency_keys_owner
    ON saga_idempotency_keys (saga_step_owner(step_key));
DROP INDEX IF EXISTS saga_idempotency_keys_step_key;
