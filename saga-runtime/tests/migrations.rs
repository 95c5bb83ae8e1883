//! The embedded migrations against a real PostgreSQL.

use saga_runtime::store::migrate::{MIGRATIONS_TABLE, migrate, migrator};
use saga_test_support::TestDb;

#[tokio::test]
async fn migrations_apply_to_an_empty_schema_and_a_second_run_changes_nothing() {
    let db = TestDb::empty("migrations").await;
    migrate(&db.pool).await.unwrap();
    migrate(&db.pool).await.unwrap();

    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables \
         WHERE table_schema = current_schema() ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    // saga-core owns the key store and the outbox; the consumer's and the orchestrator's tables belong to
    // their own crates' migrations.
    assert_eq!(
        tables,
        [
            MIGRATIONS_TABLE,
            "saga_idempotency_keys",
            "saga_key_gc_horizon",
            "saga_outbox",
            "saga_outbox_wal_incidents",
            "saga_outbox_wal_parked",
            "saga_outbox_wal_slot"
        ],
        "saga-core's tables"
    );
    let applied: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {MIGRATIONS_TABLE} WHERE success"
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(applied, i64::try_from(migrator().iter().count()).unwrap());
    // Nothing leaked into the public schema: tables land in the connection's own schema.
    let public: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables \
         WHERE table_schema = 'public' AND table_name LIKE 'saga\\_%'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(public, 0);
}
