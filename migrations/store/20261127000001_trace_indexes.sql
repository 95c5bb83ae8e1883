-- Indexes that find one saga's rows by its client's key (`saga trace`, the inspector's trace) without
-- reading the whole table.
--
-- Upgrading a large table: the indexes are built in the migration's transaction, which holds writes to the
-- table for as long as a build takes. To build them without that, create them first by hand with
-- `CREATE INDEX CONCURRENTLY` under the same names (and the function first); the migration then finds them.
-- A concurrent build that failed leaves an invalid index under its name (`pg_index.indisvalid`): drop it
-- and build it again before the migration runs, or it would be kept as it is.

-- The value of header `name` (the first, as the consumer reads it) in a flat `[name, value, ...]` header
-- array. PL/pgSQL, not a SQL function with a query: the index evaluates it for every row written, and a
-- query in a SQL function is planned, and JIT-compiled in a statement costly enough, at every call.
CREATE OR REPLACE FUNCTION saga_header(headers TEXT[], name TEXT) RETURNS TEXT
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
BEGIN
    FOR i IN 1 .. coalesce(array_length(headers, 1), 0) - 1 BY 2 LOOP
        IF headers[i] = name THEN
            RETURN headers[i + 1];
        END IF;
    END LOOP;
    RETURN NULL;
END $$;

-- The outbox's events by the idempotency key their step carried (exact match, not `headers @> ...`, which
-- also matches the key as any other header's value).
CREATE INDEX IF NOT EXISTS saga_outbox_idempotency_key
    ON saga_outbox (saga_header(headers, 'idempotency-key'));

-- Step keys by prefix (`{key}:`), byte-wise whatever the database's collation.
CREATE INDEX IF NOT EXISTS saga_idempotency_keys_step_key
    ON saga_idempotency_keys (step_key text_pattern_ops);
