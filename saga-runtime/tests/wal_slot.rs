//! The WAL outbox's slot against a real PostgreSQL (`wal_level = logical`, set by scripts/dev-services).

use std::time::{Duration, Instant};

use saga_runtime::store::wal;
use saga_test_support::TestDb;

/// A service and its relay start together and both prepare the schema's slot. The one that loses the race
/// to create it must not go on (and write events) while the other is still creating it: PostgreSQL names the
/// slot at once but decodes only what commits after the transactions running then have ended, so an event
/// written meanwhile would never be published.
#[tokio::test]
async fn a_process_finding_the_slot_being_created_waits_until_it_decodes() {
    let db = TestDb::new("wal-slot").await;
    // A transaction with an id, open: the slot's creation waits for it.
    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::query("SELECT txid_current()")
        .execute(&mut *blocker)
        .await
        .unwrap();

    let pool = db.pool.clone();
    let creating = tokio::spawn(async move { wal::prepare(&pool).await });
    let slot = wal::slot_name(&db.schema);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if slot_decodes(&db, &slot).await.is_some() {
            break;
        }
        assert!(Instant::now() < deadline, "the slot's creation never began");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let pool = db.pool.clone();
    let finding = tokio::spawn(async move { wal::prepare(&pool).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !finding.is_finished(),
        "the second process went on while the slot was still being created"
    );
    assert!(!creating.is_finished());

    blocker.commit().await.unwrap();
    let created = creating.await.unwrap().unwrap();
    let found = finding.await.unwrap().unwrap();
    assert_eq!(created.slot, found.slot);
    assert_eq!(slot_decodes(&db, &slot).await, Some(true));
    let mut conn = db.pool.acquire().await.unwrap();
    assert!(wal::drop_slot(&mut conn, &db.schema).await.unwrap());
}

/// Whether `slot` decodes yet (`None`: no such slot).
async fn slot_decodes(db: &TestDb, slot: &str) -> Option<bool> {
    sqlx::query_scalar(
        "SELECT confirmed_flush_lsn IS NOT NULL FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(&db.pool)
    .await
    .unwrap()
}
