//! Each crate applies its own tables, and a database set up by 0.1.0 (one migration set for every
//! framework table) upgrades to the split sets cleanly, keeping its rows.

use saga_test_support::TestDb;
use sqlx::PgPool;
use sqlx::migrate::Migrator;

async fn tables(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables \
         WHERE table_schema = current_schema() ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn recorded(pool: &PgPool, table: &str) -> Vec<i64> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT version FROM {table} WHERE success ORDER BY version"
    )))
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn each_crate_applies_only_its_own_tables() {
    let db = TestDb::empty("migrations-owned").await;
    saga_consumer::migrate::migrate(&db.pool).await.unwrap();
    let consumer_only = tables(&db.pool).await;
    assert_eq!(
        consumer_only,
        [
            "_saga_consumer_migrations",
            "_saga_migrations",
            "saga_consumer_groups",
            "saga_consumer_progress",
            "saga_consumer_suspects",
            "saga_dead_letter_scans",
            "saga_dead_letters",
            "saga_held_keys",
            "saga_idempotency_keys",
            "saga_key_gc_horizon",
            "saga_outbox",
            "saga_outbox_wal_incidents",
            "saga_outbox_wal_parked",
            "saga_outbox_wal_slot",
            "saga_parked_messages",
            "saga_paused_steps",
            "saga_step_pause_log",
        ],
        "a choreographed service gets no orchestrator tables"
    );
    saga_orchestrator::migrate::migrate(&db.pool).await.unwrap();
    saga_orchestrator::migrate::migrate(&db.pool).await.unwrap();
    let all = tables(&db.pool).await;
    for table in [
        "_saga_orchestrator_migrations",
        "saga_instances",
        "saga_transitions",
    ] {
        assert!(all.iter().any(|t| t == table), "{table} missing: {all:?}");
    }
}

#[tokio::test]
async fn a_database_of_the_single_0_1_0_set_upgrades_to_the_split_sets_and_keeps_its_rows() {
    let db = TestDb::empty("migrations-upgrade").await;
    // 0.1.0: every framework table from one set, recorded in `_saga_migrations`.
    let mut old = Migrator::new(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/migrations-0.1.0"
    )))
    .await
    .unwrap();
    old.dangerous_set_table_name(saga_runtime::store::migrate::MIGRATIONS_TABLE);
    old.run(&db.pool).await.unwrap();
    sqlx::query(
        "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status) VALUES ('t', 'k:s', 'completed')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO saga_consumer_progress (group_id, topic, partition, batch_offset, batch_end) \
         VALUES ('g', 't', 0, 5, 9)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO saga_instances (saga_id, saga_type, tenant_id, idempotency_key, status, step_index, data) \
         VALUES (gen_random_uuid(), 'st', 't', 'k', 'running', 0, '{}')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let before = tables(&db.pool).await;

    // The new sets, as a service applies them at its next start.
    saga_consumer::migrate::migrate(&db.pool).await.unwrap();
    saga_orchestrator::migrate::migrate(&db.pool).await.unwrap();

    let after = tables(&db.pool).await;
    for table in &before {
        assert!(after.contains(table), "{table} lost in the upgrade");
    }
    for (table, expected) in [
        ("saga_idempotency_keys", 1),
        ("saga_consumer_progress", 1),
        ("saga_instances", 1),
    ] {
        assert_eq!(db.count(table).await, expected, "rows of {table} kept");
    }
    assert_eq!(
        recorded(&db.pool, saga_consumer::migrate::MIGRATIONS_TABLE).await,
        [
            20_261_121_000_003,
            20_261_123_000_001,
            20_261_124_000_002,
            20_261_126_000_001,
            20_261_126_000_002,
            20_261_126_000_003,
            20_261_127_000_001,
            20_261_128_000_001,
            20_261_128_000_003,
            20_261_129_000_001,
            20_261_129_000_002
        ]
    );
    assert_eq!(
        recorded(&db.pool, saga_orchestrator::migrate::MIGRATIONS_TABLE).await,
        [
            20_261_121_000_004,
            20_261_122_000_002,
            20_261_124_000_001,
            20_261_125_000_001,
            20_261_126_000_001,
            20_261_128_000_005
        ]
    );
    // The old set's record stays, beside the core's later migrations: the core migrator tolerates the
    // versions it no longer owns.
    assert_eq!(
        recorded(&db.pool, saga_runtime::store::migrate::MIGRATIONS_TABLE).await,
        [
            20_261_121_000_001,
            20_261_121_000_002,
            20_261_121_000_003,
            20_261_121_000_004,
            20_261_122_000_001,
            20_261_122_000_004,
            20_261_125_000_001,
            20_261_125_000_002,
            20_261_126_000_001,
            20_261_126_000_002,
            20_261_127_000_001,
            20_261_128_000_002
        ]
    );
    // And the upgraded functions still work.
    let isolate: bool =
        sqlx::query_scalar("SELECT isolate FROM saga_consumer_begin_batch('g', 't', 0, 10, 12)")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(!isolate, "a batch after the recorded one starts normally");
}
