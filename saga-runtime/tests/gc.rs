//! Garbage collection of the idempotency store against a real PostgreSQL.

use std::time::Duration;

use saga_runtime::store::gc::{GcPolicy, collect_idempotency_keys};
use saga_test_support::TestDb;

#[tokio::test]
async fn gc_deletes_only_what_is_old_enough_in_batches() {
    let db = TestDb::new("gc").await;
    // 25 finished keys 8 days old, 5 finished 1 day old, 3 started leases expired 2 days ago, 2 live leases.
    sqlx::raw_sql(
        "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status, created_at, updated_at) \
         SELECT 't', 'old-' || i || ':s', CASE WHEN i % 2 = 0 THEN 'completed' ELSE 'failed' END, \
                now() - interval '8 days', now() - interval '8 days' FROM generate_series(1, 25) i; \
         INSERT INTO saga_idempotency_keys (tenant_id, step_key, status, updated_at) \
         SELECT 't', 'young-' || i || ':s', 'completed', now() - interval '1 day' FROM generate_series(1, 5) i; \
         INSERT INTO saga_idempotency_keys (tenant_id, step_key, status, lease_expires_at) \
         SELECT 't', 'abandoned-' || i || ':s', 'started', now() - interval '2 days' FROM generate_series(1, 3) i; \
         INSERT INTO saga_idempotency_keys (tenant_id, step_key, status, lease_expires_at) \
         SELECT 't', 'live-' || i || ':s', 'started', now() + interval '1 minute' FROM generate_series(1, 2) i",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    let policy = GcPolicy {
        retention: Duration::from_secs(7 * 24 * 3600),
        abandoned_after: Duration::from_secs(24 * 3600),
        batch_size: 10,
    };
    let report = collect_idempotency_keys(&db.pool, &policy).await.unwrap();
    assert_eq!(report.finished_deleted, 25);
    assert_eq!(report.abandoned_deleted, 3);
    // 25 rows at 10 per statement: 10, 10, 5 (the short batch ends it); 3 abandoned: one short batch.
    assert_eq!(report.batches, 4);

    let left: Vec<String> =
        sqlx::query_scalar("SELECT step_key FROM saga_idempotency_keys ORDER BY step_key")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(left.len(), 7);
    assert!(
        left.iter()
            .all(|k| k.starts_with("young-") || k.starts_with("live-")),
        "{left:?}"
    );

    let again = collect_idempotency_keys(&db.pool, &policy).await.unwrap();
    assert_eq!((again.finished_deleted, again.abandoned_deleted), (0, 0));
}
