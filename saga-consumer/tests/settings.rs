//! A service's settings read from one declaration, against the real broker and PostgreSQL: the embedded
//! relay keeps keys as long as the relay binary would; `REDIS_URL` turns the fast path on; a topic that keeps
//! messages longer than the keys keeps the service from starting; a message older than the key retention
//! whose key retention may have deleted is dead-lettered, not run again; and the outbox is each service's
//! own, not the process's.

use std::time::Duration;

use saga_consumer::settings::ServiceArgs;
use saga_consumer::{OutboxMode, SagaEvent, SagaService, ServiceError};
use saga_test_support::{TestDb, TestKafka, unique_name, wait_until};
use tokio_util::sync::CancellationToken;

mod steps;

use steps::{Placed, place_orders, read_reserved, reserve_on, stop_service};

const WAIT: Duration = Duration::from_secs(60);
const HOUR: Duration = Duration::from_secs(3600);

/// Variables from pairs.
fn vars(pairs: Vec<(&'static str, String)>) -> impl Fn(&str) -> Option<String> {
    move |name| {
        pairs
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.clone())
    }
}

/// A schema with the `reservations` table the `reserve` step writes.
async fn reservations_db(name: &str) -> TestDb {
    let db = TestDb::empty(name).await;
    sqlx::query("CREATE TABLE reservations (n BIGINT PRIMARY KEY)")
        .execute(&db.pool)
        .await
        .unwrap();
    db
}

/// Runs `service` until the returned token is cancelled.
fn run(
    service: SagaService,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<Result<(), ServiceError>>,
) {
    let stop = CancellationToken::new();
    let running = tokio::spawn(service.run(stop.clone().cancelled_owned()));
    (stop, running)
}

async fn stop(stop: CancellationToken, running: tokio::task::JoinHandle<Result<(), ServiceError>>) {
    stop_service(stop, running).await;
}

/// The retention settings a service is given reach its embedded relay, as they reach `outbox-relay run`
/// (before, the embedded relay ignored them: keys told to live 30 days were deleted after 7).
#[tokio::test]
async fn a_services_embedded_relay_keeps_keys_as_long_as_the_relay_binary_does() {
    let db = TestDb::new("settings-retention").await;
    let env = vars(vec![
        ("KAFKA_BROKERS", "127.0.0.1:9092".into()),
        ("SAGA_GROUP_ID", "g".into()),
        ("SAGA_KEY_RETENTION_HOURS", "720".into()),
        ("RELAY_PUBLISHED_RETENTION_HOURS", "48".into()),
        ("RELAY_GC_BATCH_SIZE", "100".into()),
        ("SAGA_ABANDONED_LEASE_HOURS", "2".into()),
    ]);
    let args = ServiceArgs::from_vars(&env).unwrap();
    let service = SagaService::builder()
        .args(&args)
        .pool(db.pool.clone())
        .step(reserve_on("settings-retention"))
        .build()
        .unwrap();
    let embedded = service.relay_retention().expect("embedded");
    assert_eq!(
        (
            embedded.finished_keys,
            embedded.published_rows,
            embedded.batch_size,
            embedded.abandoned_leases
        ),
        (720 * HOUR, 48 * HOUR, 100, 2 * HOUR)
    );
    assert_eq!(service.key_retention(), 720 * HOUR);
    // The relay binary's groups, from the same variables: the same policy.
    let binary = outbox_relay::RelayArgs::from_vars(&env).unwrap();
    assert_eq!(&binary.retention.policy().unwrap(), embedded);
}

/// `REDIS_URL` turns the Redis fast path on for a service built from its settings (before, only the
/// examples' own code read it).
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_url_turns_the_fast_path_on_for_a_service() {
    let db = reservations_db("settings-redis").await;
    let kafka = TestKafka::new().await;
    let topic = unique_name("settings-redis");
    let redis = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let args = ServiceArgs::from_vars(vars(vec![
        ("KAFKA_BROKERS", kafka.brokers.clone()),
        ("SAGA_GROUP_ID", format!("{topic}-group")),
        ("SAGA_CREATE_TOPICS", "1".into()),
        ("REDIS_URL", redis),
        ("REDIS_NAMESPACE", unique_name("settings-redis")),
    ]))
    .unwrap();
    kafka.create_topic(&format!("{topic}.out"), 1).await;
    let service = SagaService::builder()
        .args(&args)
        .pool(db.pool.clone())
        .step(reserve_on(&topic))
        .build()
        .unwrap();
    let ops = service.ops();
    let (token, running) = run(service);
    kafka.delete_on_drop(&topic);
    kafka.delete_on_drop(&format!("{topic}-group.dlq"));
    kafka.delete_on_drop(&format!("{topic}-group.retry"));
    wait_until("the fast path to be on", WAIT, || async {
        (ops.sample("saga_redis_available", "") == Some(1.0)).then_some(())
    })
    .await;
    place_orders(&kafka, &topic, [1]).await;
    let (_, ns) = read_reserved(
        &kafka,
        &format!("{topic}.out"),
        1,
        Duration::from_millis(300),
    )
    .await;
    assert_eq!(ns, [1]);
    stop(token, running).await;
}

/// A topic the service reads keeps messages 30 days; its keys live 7: the service refuses to start, in one
/// line naming the setting, unless told to accept it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_topic_kept_longer_than_the_keys_keeps_the_service_from_starting() {
    let db = reservations_db("settings-key-expiry").await;
    let kafka = TestKafka::new().await;
    let topic = unique_name("settings-key-expiry");
    let month = (30 * 24 * HOUR).as_millis().to_string();
    kafka
        .create_topic_with(&topic, 1, &[("retention.ms", month.as_str())])
        .await;
    let group = format!("{topic}-group");
    for t in [format!("{group}.dlq"), format!("{group}.retry")] {
        kafka.create_topic(&t, 1).await;
    }
    let build = |accept: bool| {
        SagaService::builder()
            .args(
                &ServiceArgs::from_vars(vars(vec![
                    ("KAFKA_BROKERS", kafka.brokers.clone()),
                    ("SAGA_GROUP_ID", group.clone()),
                    ("SAGA_KEY_RETENTION_HOURS", "168".into()),
                    ("SAGA_ACCEPT_KEY_EXPIRY", accept.to_string()),
                ]))
                .unwrap(),
            )
            .pool(db.pool.clone())
            .step(reserve_on(&topic))
            .build()
            .unwrap()
    };
    let refused = tokio::time::timeout(WAIT, build(false).run(std::future::pending::<()>()))
        .await
        .expect("refused at once")
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("SAGA_KEY_RETENTION_HOURS")
            && refused.contains(&topic)
            && refused.contains("720 h")
            && refused.contains("SAGA_ACCEPT_KEY_EXPIRY")
            && !refused.contains('\n'),
        "{refused}"
    );
    let (token, running) = run(build(true));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!running.is_finished(), "accepted: it runs");
    stop(token, running).await;
    for t in [topic, format!("{group}.dlq"), format!("{group}.retry")] {
        kafka.delete_topic(&t).await;
    }
}

/// Retention (run by a process keeping keys a day, though the service keeps them a week) deleted keys up to a
/// day ago; a message written 30 hours ago arrives (a replay from a long-retention topic, a group reset),
/// whose key is not in the store: its step may have run, its key deleted since. It is dead-lettered, saying
/// why, not run again; a fresh message runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_older_than_the_key_retention_whose_key_may_be_gone_is_dead_lettered_not_run() {
    let db = reservations_db("settings-old-message").await;
    saga_runtime::store::migrate::migrate(&db.pool)
        .await
        .unwrap();
    // Retention ran with a retention of 24 hours: keys last written before then may be gone.
    let policy = saga_runtime::store::gc::GcPolicy {
        retention: 24 * HOUR,
        abandoned_after: 24 * HOUR,
        batch_size: 5_000,
    };
    saga_runtime::store::gc::collect_idempotency_keys(&db.pool, &policy)
        .await
        .unwrap();
    let kafka = TestKafka::new().await;
    let topic = unique_name("settings-old-message");
    let group = format!("{topic}-group");
    kafka.create_topic(&format!("{topic}.out"), 1).await;
    let service = SagaService::builder()
        .args(
            &ServiceArgs::from_vars(vars(vec![
                ("KAFKA_BROKERS", kafka.brokers.clone()),
                ("SAGA_GROUP_ID", group.clone()),
                ("SAGA_CREATE_TOPICS", "1".into()),
                ("SAGA_ACCEPT_KEY_EXPIRY", "true".into()),
            ]))
            .unwrap(),
        )
        .pool(db.pool.clone())
        .step(reserve_on(&topic))
        .build()
        .unwrap();
    let (token, running) = run(service);
    wait_until("the service's topics", WAIT, || async {
        (kafka.partition_count(&topic).await == 1).then_some(())
    })
    .await;
    kafka.delete_on_drop(&topic);
    kafka.delete_on_drop(&format!("{group}.dlq"));
    kafka.delete_on_drop(&format!("{group}.retry"));
    // Written 30 hours ago (its producer's timestamp), then a fresh one.
    let old =
        chrono::Utc::now().timestamp_millis() - i64::try_from((30 * HOUR).as_millis()).unwrap();
    let producer = kafka.producer();
    let payload = serde_json::to_vec(&Placed { n: 1 }).unwrap();
    let record = rdkafka::producer::FutureRecord::to(&topic)
        .key("order-1")
        .payload(&payload)
        .timestamp(old)
        .headers(
            rdkafka::message::OwnedHeaders::new()
                .insert(rdkafka::message::Header {
                    key: "idempotency-key",
                    value: Some("order-1"),
                })
                .insert(rdkafka::message::Header {
                    key: "ce_type",
                    value: Some(Placed::TYPES[0]),
                }),
        );
    producer
        .send(record, Duration::from_secs(10))
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    place_orders(&kafka, &topic, [2]).await;
    let letters = kafka
        .read_all(&format!("{group}.dlq"), 1, Duration::from_millis(500), WAIT)
        .await;
    assert_eq!(letters.len(), 1);
    let error = letters[0].header("dlq-error").unwrap_or_default();
    assert!(
        error.contains("SAGA_KEY_RETENTION_HOURS") && error.contains("replay it"),
        "{error}"
    );
    let (_, ns) = read_reserved(
        &kafka,
        &format!("{topic}.out"),
        1,
        Duration::from_millis(500),
    )
    .await;
    assert_eq!(ns, [2], "the fresh one ran, the old one did not");
    assert_eq!(db.count("reservations").await, 1);
    stop(token, running).await;
}

/// Two services in one process, one writing its outbox to the table, the other to the write-ahead log: each
/// writes where it is told (before, the mode was the process's: the last service set it for both).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_services_in_one_process_each_write_their_own_outbox() {
    let kafka = TestKafka::new().await;
    let mut running = Vec::new();
    let mut services = Vec::new();
    for mode in [OutboxMode::Table, OutboxMode::Wal] {
        let db = reservations_db(&format!("settings-mode-{}", mode.as_str())).await;
        let topic = unique_name(&format!("settings-mode-{}", mode.as_str()));
        kafka.create_topic(&format!("{topic}.out"), 1).await;
        let service = SagaService::builder()
            .brokers(&kafka.brokers)
            .group_id(format!("{topic}-group"))
            .pool(db.pool.clone())
            .step(reserve_on(&topic))
            .create_topics(1, 1)
            .outbox_mode(mode)
            .relay(|r| r.replication_url(db.url()))
            .build()
            .unwrap();
        running.push(run(service));
        services.push((mode, db, topic));
    }
    for (_, _, topic) in &services {
        wait_until("the service's topics", WAIT, || async {
            (kafka.partition_count(topic).await == 1).then_some(())
        })
        .await;
        kafka.delete_on_drop(topic);
        place_orders(&kafka, topic, [1, 2]).await;
    }
    for (mode, db, topic) in &services {
        let (_, ns) = read_reserved(
            &kafka,
            &format!("{topic}.out"),
            2,
            Duration::from_millis(300),
        )
        .await;
        assert_eq!(ns, [1, 2], "{mode:?}: each event once");
        let rows = db.count("saga_outbox").await;
        match mode {
            OutboxMode::Table => assert_eq!(rows, 2, "the table service wrote rows"),
            _ => assert_eq!(rows, 0, "the WAL service wrote to the log"),
        }
    }
    for (token, handle) in running {
        stop(token, handle).await;
    }
}

/// What Kafka, librdkafka or the framework's tables would refuse later is refused at parse time, naming
/// the variable: every such variable at once.
#[test]
fn values_kafka_would_refuse_later_are_refused_by_name_at_once() {
    let refused = ServiceArgs::from_vars(vars(vec![
        ("SAGA_SESSION_TIMEOUT_MS", "300001".to_owned()),
        ("SAGA_GROUP_ID", "g".repeat(3_000)),
        ("SAGA_DLQ_TOPIC", "orders dlq".to_owned()),
        ("SAGA_HOLD_ALERT_AFTER_SECS", "1000000000000".to_owned()),
        ("RELAY_LINGER_MS", "900001".to_owned()),
        ("RELAY_PARK_AFTER_SECS", "2147484".to_owned()),
    ]))
    .unwrap_err();
    let said = refused.to_string();
    for var in [
        "SAGA_SESSION_TIMEOUT_MS",
        "SAGA_GROUP_ID",
        "SAGA_DLQ_TOPIC",
        "SAGA_HOLD_ALERT_AFTER_SECS",
        "RELAY_LINGER_MS",
        "RELAY_PARK_AFTER_SECS",
    ] {
        assert!(refused.setting.contains(var), "{var}: {said}");
    }
    assert!(!said.contains('\n'), "{said}");
    // A group whose name makes no topic name needs its topics named.
    let args =
        ServiceArgs::from_vars(vars(vec![("SAGA_GROUP_ID", "orders:eu".to_owned())])).unwrap();
    let problems = args.consumer.problems();
    assert!(
        problems.iter().any(|p| p.setting == "SAGA_DLQ_TOPIC"),
        "{problems:?}"
    );
    assert!(
        problems.iter().any(|p| p.setting == "SAGA_RETRY_TOPIC"),
        "{problems:?}"
    );
    let named = ServiceArgs::from_vars(vars(vec![
        ("SAGA_GROUP_ID", "orders:eu".to_owned()),
        ("SAGA_DLQ_TOPIC", "orders.eu.dlq".to_owned()),
        ("SAGA_RETRY_TOPIC", "orders.eu.retry".to_owned()),
    ]))
    .unwrap();
    assert!(
        named.consumer.problems().is_empty(),
        "{:?}",
        named.consumer.problems()
    );
}
