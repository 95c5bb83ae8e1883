//! `saga trace` reads bounded lists: on a schema whose outbox holds more events of one key than a lane
//! shows, and many rows whose headers carry the key's text under another name (a tenant value every row
//! carries), the trace shows the key's first events only, says the list was cut, and never takes another
//! header's value for the key. Both the events and the step keys are found through an index.

use saga_admin::trace::{self, EventKind, MOST_PER_LIST};
use saga_test_support::TestDb;

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
               AND indexrelname IN ('saga_outbox_idempotency_key', 'saga_idempotency_keys_step_key') \
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
