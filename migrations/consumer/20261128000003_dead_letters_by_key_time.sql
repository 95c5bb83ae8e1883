-- A key's dead letters by time (`saga trace`): an index range read stopped by the trace's LIMIT, ties broken
-- by the letter's position. Replaces the key-only index. On a large table, build it first by hand with
-- `CREATE INDEX CONCURRENTLY` under the same name; an invalid one a failed build left is built again here.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid
               WHERE c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema()) AND NOT x.indisvalid
                 AND c.relname = 'saga_dead_letters_key_time') THEN
        EXECUTE format('DROP INDEX %I.%I', current_schema(), 'saga_dead_letters_key_time');
    END IF;
END
$$;
CREATE INDEX IF NOT EXISTS saga_dead_letters_key_time
    ON saga_dead_letters (idempotency_key, failed_at, dlq_topic, dlq_partition, dlq_offset);
DROP INDEX IF EXISTS saga_dead_letters_key;
