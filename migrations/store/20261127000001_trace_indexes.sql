-- Indexes that find one saga's rows by its client's key (`saga trace`, the inspector's trace) without
-- reading the whole table.
--
-- Upgrading a large table: the indexes are built in the migration's transaction, which holds writes to the
-- table for as long as a build takes. To build them without that, create them first by hand with
-- `CREATE INDEX CONCURRENTLY` under the same names (and the function first); the migration then finds them.
-- A concurrent build that failed leaves an invalid index under its name (`pg_index.indisvalid`): drop it
-- and build it again before the migration runs, or it would be kept as it is.

-- The value of header `name` in a flat `[name, value, ...]` header array: where the name first appears in a
-- name's place (odd), or, where a value equal to the name came first, where it appears next; else NULL (an
-- event so written is not found by the trace, never taken for another key's). An expression, not a query
-- nor a loop: the index evaluates it for every row written and marked published, and a SQL function with a
-- query is planned, and in a costly statement JIT-compiled, at every call.
CREATE OR REPLACE FUNCTION saga_header(headers TEXT[], name TEXT) RETURNS TEXT
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE
        WHEN array_position(headers, name) IS NULL THEN NULL
        WHEN array_position(headers, name) % 2 = 1 THEN headers[array_position(headers, name) + 1]
        WHEN array_position(headers, name, array_position(headers, name) + 1) % 2 = 1
            THEN headers[array_position(headers, name, array_position(headers, name) + 1) + 1]
    END;

-- The outbox's events by the idempotency key their step carried (exact match, not `headers @> ...`, which
-- also matches the key as any other header's value).
CREATE INDEX IF NOT EXISTS saga_outbox_idempotency_key
    ON saga_outbox (saga_header(headers, 'idempotency-key'));

-- Step keys by prefix (`{key}:`), byte-wise whatever the database's collation.
CREATE INDEX IF NOT EXISTS saga_idempotency_keys_step_key
    ON saga_idempotency_keys (step_key text_pattern_ops);
