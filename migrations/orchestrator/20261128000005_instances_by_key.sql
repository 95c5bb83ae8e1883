-- A key's instances of every tenant and saga type, in order (`saga trace` without a tenant): the unique
-- constraint leads with the tenant, so it cannot find them. On a large table, build it first by hand with
-- `CREATE INDEX CONCURRENTLY` under the same name; an invalid one a failed build left is built again here.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid
               WHERE c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema()) AND NOT x.indisvalid
                 AND c.relname = 'saga_instances_key') THEN
        EXECUTE format('DROP INDEX %I.%I', current_schema(), 'saga_instances_key');
    END IF;
END
$$;
CREATE INDEX IF NOT EXISTS saga_instances_key ON saga_instances (idempotency_key, created_at, saga_id);
