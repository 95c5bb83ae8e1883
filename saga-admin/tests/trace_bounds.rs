//! `saga trace` reads bounded lists: on a schema whose outbox holds more events of one key than a lane
//! shows, and many rows whose headers carry the key's text under another name (a tenant value every row
//! carries), the trace shows the key's first events only, says the list was cut, and never takes another
//! header's value for the key. Every list is one index range read stopped by its limit, under the generic
//! plan a prepared statement gets: no sequential scan, no sort of a key's rows.

use saga_admin::trace::{self, EventKind, MOST_PER_LIST};
use saga_test_support::TestDb;
use sqlx::Row;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_matches_the_key_exactly_and_says_when_a_list_is_cut() {
    let db = TestDb::new("trace-bounds").await;
    let more = i64::try_from(MOST_PER_LIST).unwrap() + 5;
    // The key's own events, more than a lane shows.
    sqlx::query(
        "INSERT INTO saga_outbox (tenant_id, topic, partition_key, headers, payload) \
         SELECT 'default', 'orders', 'k', \
                ARRAY['ce_type', 'OrderCreated', 'ce_source', 'create-order', 'idempotency-key', 'k-1'], \
                '{}'::bytea \
         FROM generate_series(1, $1)",
    )
    .bind(more)
    .execute(&db.pool)
    .await
    .unwrap();
    // Rows of other keys whose headers hold "default" (the tenant's value) and "k-1" as a value of
    // another header: neither is the key `default`.
    sqlx::query(
        "INSERT INTO saga_outbox (tenant_id, topic, partition_key, headers, payload) \
         SELECT 'default', 'orders', 'other', \
                ARRAY['tenant-id', 'default', 'idempotency-key', 'other-' || n, 'note', 'idempotency-key'], \
                '{}'::bytea \
         FROM generate_series(1, 50) AS n",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    let schemas = std::slice::from_ref(&db.schema);
    let found = trace::trace(&db.pool, "k-1", None, schemas).await.unwrap();
    let emitted = found
        .events
        .iter()
        .filter(|e| e.kind == EventKind::Emitted)
        .count();
    assert_eq!(emitted, MOST_PER_LIST, "the list is bounded");
    assert_eq!(found.cut.len(), 1, "{:?}", found.cut);
    assert!(found.cut[0].contains("events emitted"), "{:?}", found.cut);

    // `default` is a value every row carries, never an idempotency key here: nothing, and nothing cut.
    let none = trace::trace(&db.pool, "default", None, schemas)
        .await
        .unwrap();
    assert!(none.events.is_empty(), "{:?}", none.events.len());
    assert!(none.cut.is_empty(), "{:?}", none.cut);
    // A header's name in a value's place is not a key either.
    let other = trace::trace(&db.pool, "other-7", None, schemas)
        .await
        .unwrap();
    assert_eq!(other.events.len(), 1);
    // A value equal to the header's name before the name itself: the name's value all the same.
    sqlx::query(
        "INSERT INTO saga_outbox (tenant_id, topic, partition_key, headers, payload) \
         VALUES ('default', 'orders', 'c', \
                 ARRAY['note', 'idempotency-key', 'idempotency-key', 'crafted-1'], '{}'::bytea)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let crafted = trace::trace(&db.pool, "crafted-1", None, schemas)
        .await
        .unwrap();
    assert_eq!(crafted.events.len(), 1);

    // Step keys: the key's own (`other-7:…`), among thousands of others and keys it prefixes (`other-70`).
    sqlx::query(
        "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status) \
         SELECT 'default', 'other-' || n || ':' || step, 'completed' \
         FROM generate_series(1, 3000) AS n, unnest(ARRAY['charge', 'ship']) AS step",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE saga_outbox, saga_idempotency_keys")
        .execute(&db.pool)
        .await
        .unwrap();
    let scans = || async {
        let scans: Vec<(String, i64)> = sqlx::query_as(
            "SELECT indexrelname::text, idx_scan FROM pg_stat_user_indexes \
             WHERE schemaname = current_schema() \
               AND indexrelname IN ('saga_idempotency_keys_owner', 'saga_outbox_key_order') \
             ORDER BY 1",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        scans
    };
    // The earlier traces' statistics arrive within a second or so: counted before this one's.
    let mut before = scans().await;
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
        let again = scans().await;
        if again == before {
            break;
        }
        before = again;
    }
    let other = trace::trace(&db.pool, "other-7", None, schemas)
        .await
        .unwrap();
    let mut steps: Vec<&str> = other
        .events
        .iter()
        .filter(|e| e.kind == EventKind::Step)
        .map(|e| e.subject.as_str())
        .collect();
    steps.sort_unstable();
    assert_eq!(
        steps,
        ["charge", "ship"],
        "its own step keys, not other-70's"
    );
    // Both lists read through their index (the statistics arrive within a second or so).
    saga_test_support::wait_until(
        "index scans",
        std::time::Duration::from_secs(20),
        || async {
            let after = scans().await;
            (after.len() == 2 && after.iter().zip(&before).all(|(a, b)| a.1 > b.1)).then_some(())
        },
    )
    .await;
    // A key that prefixes others with ':' (`cust-1` of `cust-1:order-N`): their 1,500 step keys, older
    // than its own, neither fill its list nor cut it.
    sqlx::query(
        "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status, created_at) \
         SELECT 'default', 'cust-1:order-' || n || ':charge', 'completed', now() - interval '1 hour' \
         FROM generate_series(1, 1500) AS n",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status) \
         VALUES ('default', 'cust-1:charge', 'completed')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let prefixing = trace::trace(&db.pool, "cust-1", None, schemas)
        .await
        .unwrap();
    let own: Vec<&str> = prefixing
        .events
        .iter()
        .filter(|e| e.kind == EventKind::Step)
        .map(|e| e.subject.as_str())
        .collect();
    assert_eq!(own, ["charge"], "its own step key, found past the others");
    assert!(
        prefixing.cut.is_empty(),
        "nothing of its own was cut: {:?}",
        prefixing.cut
    );
}

/// The generic plan of each trace statement over `schema`, as `(list, its index, node types and
/// relations)`, on a connection of its own (its prepared statements and settings go with it).
async fn plans(db: &TestDb) -> Vec<(&'static str, &'static str, Vec<String>)> {
    use sqlx::Connection as _;
    let mut conn = sqlx::PgConnection::connect(&TestDb::database_url())
        .await
        .unwrap();
    sqlx::query("SET plan_cache_mode = force_generic_plan")
        .execute(&mut conn)
        .await
        .unwrap();
    let mut plans = Vec::new();
    for (n, (list, index, sql)) in trace::statements(&db.schema).into_iter().enumerate() {
        sqlx::query(sqlx::AssertSqlSafe(format!("PREPARE trace_{n} AS {sql}")))
            .execute(&mut conn)
            .await
            .unwrap();
        let plan: serde_json::Value = sqlx::query(sqlx::AssertSqlSafe(format!(
            "EXPLAIN (FORMAT JSON) EXECUTE trace_{n}('key-7', NULL, 1001)"
        )))
        .fetch_one(&mut conn)
        .await
        .unwrap()
        .try_get(0)
        .unwrap();
        let mut nodes = Vec::new();
        walk(&plan[0]["Plan"], &mut nodes);
        plans.push((list, index, nodes));
    }
    conn.close().await.unwrap();
    plans
}

/// Every node of `plan` as "Node Type" or "Node Type on relation using index".
fn walk(plan: &serde_json::Value, out: &mut Vec<String>) {
    let mut node = plan["Node Type"].as_str().unwrap_or("?").to_owned();
    if let Some(r) = plan["Relation Name"].as_str() {
        node.push_str(&format!(" on {r}"));
    }
    if let Some(i) = plan["Index Name"].as_str() {
        node.push_str(&format!(" using {i}"));
    }
    out.push(node);
    for child in plan["Plans"].as_array().into_iter().flatten() {
        walk(child, out);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_list_is_an_index_range_read_stopped_by_its_limit() {
    let db = TestDb::with(
        "trace-plans",
        &[
            saga_consumer::migrate::migrator(),
            saga_orchestrator::migrate::migrator(),
            saga_admin::dlq::migrator(),
        ],
    )
    .await;
    for fill in [
        "INSERT INTO saga_outbox (tenant_id, topic, partition_key, headers, payload) \
         SELECT 'default', 'orders', 'k', ARRAY['ce_type', 'T', 'ce_source', 'charge', \
                'idempotency-key', 'key-' || (n % 3000)], '{}'::bytea \
         FROM generate_series(1, 30000) AS n",
        "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status) \
         SELECT 'default', 'key-' || n || ':' || step, 'completed' \
         FROM generate_series(1, 10000) AS n, unnest(ARRAY['charge', 'ship']) AS step",
        "INSERT INTO saga_dead_letters (dlq_topic, dlq_partition, dlq_offset, letter_hash, failure_group, \
                cause, consumer_group, original_topic, original_partition, original_offset, reason, error, \
                attempts, failed_at, idempotency_key, tenant_id, truncated, replay_count) \
         SELECT 'orders.dlq', 0, n, 'h', 'g', 'c', 'payments', 'orders', 0, n, 'handler-error', 'e', 1, \
                now(), 'key-' || (n % 3000), 'default', false, 0 \
         FROM generate_series(1, 20000) AS n",
        "INSERT INTO saga_dlq_replay_log (dlq_topic, dlq_partition, dlq_offset, letter_hash, consumer_group, \
                operator, retry_topic, retry_partition, retry_offset, idempotency_key, tenant_id) \
         SELECT 'orders.dlq', 0, n, 'h', 'payments', 'ops', 'orders.retry', 0, n, 'key-' || (n % 3000), \
                'default' \
         FROM generate_series(1, 10000) AS n",
        "INSERT INTO saga_instances (saga_id, saga_type, tenant_id, idempotency_key, status, step_index, data) \
         SELECT md5(n::text)::uuid, 'order', 'default', 'key-' || n, 'completed', 0, '{}' \
         FROM generate_series(1, 5000) AS n",
        "INSERT INTO saga_transitions (saga_id, version, to_status, cause) \
         SELECT md5(n::text)::uuid, v, 'running', 'started' \
         FROM generate_series(1, 5000) AS n, generate_series(1, 3) AS v",
        "ANALYZE",
    ] {
        sqlx::query(fill).execute(&db.pool).await.unwrap();
    }

    let plans = plans(&db).await;
    assert_eq!(plans.len(), 5, "{plans:?}");
    for (list, index, nodes) in &plans {
        assert!(
            !nodes.iter().any(|n| n.starts_with("Seq Scan")),
            "{list}: a sequential scan: {nodes:?}"
        );
        assert_eq!(nodes[0], "Limit", "{list}: {nodes:?}");
        // Found through its own index (not, say, the primary key walked in order, every row filtered).
        assert!(
            nodes.iter().any(|n| n.ends_with(&format!("using {index}"))),
            "{list}: not through {index}: {nodes:?}"
        );
        if !matches!(*list, "step keys" | "transitions") {
            // One range read stopped by the limit: no sort of the key's rows, which would read them all.
            // (A key's step keys are one per step and tenant, its instances one per tenant and saga type,
            // each one's transitions limited: those are sorted.)
            assert!(
                !nodes.iter().any(|n| n == "Sort"),
                "{list}: the key's rows sorted, so all of them read: {nodes:?}"
            );
        }
    }

    // Each list, read: the key's own rows, in their order.
    let schemas = std::slice::from_ref(&db.schema);
    let found = trace::trace(&db.pool, "key-7", None, schemas)
        .await
        .unwrap();
    let count = |kind: EventKind| found.events.iter().filter(|e| e.kind == kind).count();
    assert_eq!(count(EventKind::Step), 2);
    assert_eq!(count(EventKind::Emitted), 10);
    assert_eq!(count(EventKind::DeadLetter), 7);
    assert_eq!(count(EventKind::Replay), 4);
    assert_eq!(count(EventKind::Transition), 3);
    assert!(
        found.cut.is_empty() && found.unindexed.is_empty(),
        "{found:?}"
    );
    let versions: Vec<&str> = found
        .events
        .iter()
        .filter(|e| e.kind == EventKind::Transition)
        .map(|e| {
            e.detail
                .split(':')
                .next()
                .unwrap()
                .rsplit(' ')
                .next()
                .unwrap()
        })
        .collect();
    assert_eq!(versions, ["v1", "v2", "v3"]);

    // A failed concurrent build leaves an invalid index under the name: the list is read without it,
    // correctly, and the trace says so.
    sqlx::query("DROP INDEX saga_dead_letters_key_time")
        .execute(&db.pool)
        .await
        .unwrap();
    let failed = sqlx::query(
        "CREATE UNIQUE INDEX CONCURRENTLY saga_dead_letters_key_time ON saga_dead_letters (idempotency_key)",
    )
    .execute(&db.pool)
    .await;
    assert!(failed.is_err(), "duplicate keys fail the unique build");
    let invalid: bool = sqlx::query_scalar(
        "SELECT NOT x.indisvalid FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid \
         WHERE c.relname = 'saga_dead_letters_key_time' AND c.relnamespace = \
               (SELECT oid FROM pg_namespace WHERE nspname = current_schema())",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        invalid,
        "the failed build left an invalid index under the name"
    );
    let without = trace::trace(&db.pool, "key-7", None, schemas)
        .await
        .unwrap();
    assert_eq!(
        without
            .events
            .iter()
            .filter(|e| e.kind == EventKind::DeadLetter)
            .count(),
        7
    );
    assert_eq!(without.unindexed.len(), 1, "{:?}", without.unindexed);
    assert!(
        without.unindexed[0].contains("dead letters")
            && without.unindexed[0].contains("saga_dead_letters_key_time"),
        "{:?}",
        without.unindexed
    );

    // A list whose table is locked past the statement timeout: named as not read, the others shown.
    let mut locker = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE saga_outbox IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();
    let held = trace::trace(&db.pool, "key-7", None, schemas)
        .await
        .unwrap();
    // The command shows what it read, names what it did not, and exits 1: an incomplete trace is no
    // complete answer.
    let schema = db.schema.clone();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_saga"))
            .args(["trace", "key-7", "--in-schema", &schema])
            .env("DATABASE_URL", TestDb::database_url())
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    locker.rollback().await.unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert_eq!(output.status.code(), Some(1), "{out}\n{err}");
    assert!(
        out.contains("not read: ") && out.contains("events emitted not read"),
        "{out}"
    );
    assert!(err.contains("incomplete"), "{err}");
    assert!(
        held.unread
            .iter()
            .any(|u| u.contains("events emitted not read")),
        "{:?}",
        held.unread
    );
    assert!(!held.events.iter().any(|e| e.kind == EventKind::Emitted));
    assert_eq!(
        held.events
            .iter()
            .filter(|e| e.kind == EventKind::Transition)
            .count(),
        3,
        "the schema's other lists are read"
    );

    // A NUL byte is bad input, said as such, not a database failure.
    let nul = trace::trace(&db.pool, "key\u{0}7", None, schemas)
        .await
        .unwrap_err();
    assert!(nul.is_caller_error(), "{nul}");
}

/// A list whose table the database user may not read is said not read, never shown as an empty lane; the
/// lists the user may read are read all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_the_user_may_not_read_is_said_not_read() {
    let db = TestDb::new("trace-forbidden").await;
    for fill in [
        "INSERT INTO saga_outbox (tenant_id, topic, partition_key, headers, payload) \
         VALUES ('default', 'orders', 'k', ARRAY['ce_type', 'T', 'ce_source', 'charge', \
                 'idempotency-key', 'k-1'], '{}'::bytea)",
        "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status) \
         VALUES ('default', 'k-1:charge', 'completed')",
    ] {
        sqlx::query(fill).execute(&db.pool).await.unwrap();
    }
    let schemas = std::slice::from_ref(&db.schema);
    let all = trace::trace(&db.pool, "k-1", None, schemas).await.unwrap();
    assert_eq!(all.events.len(), 2, "{all:?}");
    assert!(all.unread.is_empty(), "{:?}", all.unread);

    // A role that may read the key store but not the outbox.
    let role = format!("{}_reader", db.schema);
    let found = async {
        for grant in [
            format!("CREATE ROLE {role} NOLOGIN"),
            format!("GRANT USAGE ON SCHEMA {} TO {role}", db.schema),
            format!("GRANT SELECT ON saga_idempotency_keys TO {role}"),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(grant))
                .execute(&db.pool)
                .await?;
        }
        let options = db.connect_options().options([("role", role.as_str())]);
        let reader = sqlx::PgPool::connect_with(options).await?;
        let found = trace::trace(&reader, "k-1", None, schemas).await;
        reader.close().await;
        Ok::<_, Box<dyn std::error::Error>>(found?)
    }
    .await;
    // The role is the cluster's: gone whatever happened (the first statement fails if it was never made).
    for cleanup in [format!("DROP OWNED BY {role}"), format!("DROP ROLE {role}")] {
        let _ = sqlx::query(sqlx::AssertSqlSafe(cleanup))
            .execute(&db.pool)
            .await;
    }
    let found = found.unwrap();
    let kinds: Vec<EventKind> = found.events.iter().map(|e| e.kind).collect();
    assert_eq!(kinds, [EventKind::Step], "{found:?}");
    assert_eq!(found.unread.len(), 1, "{:?}", found.unread);
    assert!(
        found.unread[0]
            .contains("events emitted not read: saga_outbox: the database user may not read it"),
        "{:?}",
        found.unread
    );
}
