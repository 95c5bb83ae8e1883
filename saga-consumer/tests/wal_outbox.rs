//! A service in WAL mode (`SAGA_OUTBOX_MODE=wal`) against the real broker and PostgreSQL: its steps' events
//! go to the write-ahead log, not to `saga_outbox`, and its embedded relay publishes them from the schema's
//! slot, which the service created before its first write. (A test binary of its own: the outbox mode is
//! the process's.)

use std::time::Duration;

use saga_consumer::{OutboxMode, SagaEvent, SagaService};
use saga_test_support::{TestDb, TestKafka, unique_name, wait_until};
use tokio_util::sync::CancellationToken;

mod steps;

use steps::{Reserved, place_orders, read_reserved, reserve_on};

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_service_in_wal_mode_writes_its_events_to_the_log_and_its_relay_publishes_each_once() {
    let db = TestDb::empty("service-wal").await;
    sqlx::query("CREATE TABLE reservations (n BIGINT PRIMARY KEY)")
        .execute(&db.pool)
        .await
        .unwrap();
    let kafka = TestKafka::new().await;
    let topic = unique_name("service-wal");
    let out = format!("{topic}.out");
    kafka.create_topic(&out, 1).await;
    let group = format!("{topic}-group");
    let service = SagaService::builder()
        .brokers(&kafka.brokers)
        .group_id(&group)
        .pool(db.pool.clone())
        .step(reserve_on(&topic))
        .create_topics(2, 1)
        .outbox_mode(OutboxMode::Wal)
        .relay(|r| r.replication_url(db.url()))
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let running = tokio::spawn(service.run(stop.clone().cancelled_owned()));
    wait_until("the service's topics", WAIT, || async {
        (kafka.partition_count(&topic).await == 2).then_some(())
    })
    .await;
    kafka.delete_on_drop(&topic);
    kafka.delete_on_drop(&format!("{group}.dlq"));
    kafka.delete_on_drop(&format!("{group}.retry"));
    let slot_exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
    )
    .bind(saga_runtime::store::wal::slot_name(
        db.database(),
        &db.schema,
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(slot_exists, "the slot exists before the first event");

    // Every order delivered twice: one effect, one event each.
    place_orders(&kafka, &topic, (1..=5).chain(1..=5)).await;
    let (published, ns) = read_reserved(&kafka, &out, 5, Duration::from_millis(1_000)).await;
    assert_eq!(ns, [1, 2, 3, 4, 5], "each event once");
    assert!(
        published
            .iter()
            .all(|m| m.header("ce_type") == Some(Reserved::TYPES[0])
                && m.header("idempotency-key").is_some())
    );
    assert_eq!(db.count("reservations").await, 5);
    assert_eq!(
        db.count("saga_outbox").await,
        0,
        "no outbox row: the log carried them"
    );
    stop.cancel();
    tokio::time::timeout(WAIT, running)
        .await
        .expect("the service stops")
        .unwrap()
        .unwrap();
}
