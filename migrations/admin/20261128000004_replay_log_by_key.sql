-- A key's replays by time (`saga trace`): an index range read stopped by the trace's LIMIT. On a large
-- table, build it first by hand with `CREATE INDEX CONCURRENTLY` under the same name; an invalid one a failed
-- build left is built again here.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid
               WHERE c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema()) AND NOT x.indisvalid
                 AND c.relname = 'saga_dlq_replay_log_key') THEN
        EXECUTE format('DROP INDEX %I.%I', current_schema(), 'saga_dlq_replay_log_key');
    END IF;
END
$$;
CREATE INDEX IF NOT EXISTS saga_dlq_replay_log_key ON saga_dlq_replay_log (idempotency_key, sent_at, id);
