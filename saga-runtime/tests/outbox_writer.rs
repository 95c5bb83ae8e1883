//! The outbox writer against a real PostgreSQL.

use std::time::{Duration, Instant};

use saga_core::Lineage;
use saga_core::{Event, IdempotencyKey, OutboxMessage, TenantId};
use saga_runtime::store::outbox;
use saga_test_support::TestDb;
use sqlx::postgres::PgListener;

fn message(key: &str, n: u32) -> OutboxMessage {
    let lineage = Lineage::root(
        IdempotencyKey::new("client-key").unwrap(),
        TenantId::new("acme").unwrap(),
    );
    let event = Event::new("Numbered", "numbers", key, &serde_json::json!({ "n": n })).unwrap();
    OutboxMessage::from_event(event, &lineage, "test")
}

#[tokio::test]
async fn outbox_rows_exist_only_when_the_transaction_commits() {
    let db = TestDb::new("outbox-commit").await;
    let mut tx = db.pool.begin().await.unwrap();
    let ids = outbox::append_rows(&mut tx, &[message("a", 1), message("b", 2)])
        .await
        .unwrap();
    assert_eq!(ids.len(), 2);
    assert_eq!(db.count("saga_outbox").await, 0, "invisible before commit");
    tx.rollback().await.unwrap();
    assert_eq!(db.count("saga_outbox").await, 0, "gone after rollback");

    let mut tx = db.pool.begin().await.unwrap();
    outbox::append_rows(&mut tx, &[message("a", 3)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let (topic, key, headers, payload): (String, Option<String>, Vec<String>, Vec<u8>) =
        sqlx::query_as("SELECT topic, partition_key, headers, payload FROM saga_outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((topic.as_str(), key.as_deref()), ("numbers", Some("a")));
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&payload).unwrap(),
        serde_json::json!({"n": 3})
    );
    let headers = outbox::headers_from_array(headers);
    assert!(headers.contains(&("ce_type".into(), "Numbered".into())));
    assert!(headers.contains(&("idempotency-key".into(), "client-key".into())));
}

#[tokio::test]
async fn a_commit_notifies_the_relay_with_the_schema() {
    let db = TestDb::new("outbox-notify").await;
    let mut listener = PgListener::connect_with(&db.pool).await.unwrap();
    listener.listen("saga_outbox").await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    outbox::append_rows(&mut tx, &[message("a", 1)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // The channel is shared by every schema of the database (other tests commit too): the payload says
    // whose outbox it is.
    let ours = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let notification = listener.recv().await.unwrap();
            if notification.payload() == db.schema {
                return notification;
            }
        }
    })
    .await
    .expect("a notification for this schema");
    assert_eq!(ours.channel(), "saga_outbox");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_of_one_key_are_numbered_in_commit_order() {
    let db = TestDb::new("outbox-order").await;
    // The first transaction appends key "k" and stays open.
    let mut first = db.pool.begin().await.unwrap();
    let first_ids = outbox::append_rows(&mut first, &[message("k", 1)])
        .await
        .unwrap();

    // A second transaction appending the same key waits for the first to commit, so its row is numbered
    // after it; one appending another key does not wait.
    let pool = db.pool.clone();
    let (pid_tx, pid_rx) = tokio::sync::oneshot::channel::<i32>();
    let same_key = tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        pid_tx.send(pid).unwrap();
        let ids = outbox::append_rows(&mut tx, &[message("k", 2)])
            .await
            .unwrap();
        tx.commit().await.unwrap();
        ids
    });
    // The second transaction is seen waiting on a lock (not merely not yet scheduled).
    let pid = pid_rx.await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'",
        )
        .bind(pid)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the second transaction never waited for the key"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut other = db.pool.begin().await.unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        outbox::append_rows(&mut other, &[message("other", 3)]),
    )
    .await
    .expect("another key is not blocked by the open transaction")
    .unwrap();
    other.commit().await.unwrap();
    assert!(
        !same_key.is_finished(),
        "the same key waits while the first transaction is open; another key did not"
    );

    first.commit().await.unwrap();
    let second_ids = same_key.await.unwrap();
    assert!(second_ids[0] > first_ids[0]);
}
