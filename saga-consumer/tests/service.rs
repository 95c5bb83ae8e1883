//! The runner against the real broker and PostgreSQL: it applies its migrations, creates its topics when
//! asked, runs the consumer and the embedded relay together, and stops every part when one fails.

use std::time::{Duration, Instant};

use saga_consumer::{
    ConfigError, Message, SagaEvent, SagaService, ServiceError, StepContext, StepOutcome,
    StepResult, Topic,
};
use saga_test_support::{TestDb, TestKafka, unique_name, wait_until};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

mod steps;

use steps::{Placed, Reserved, place_orders, read_reserved, reserve_on, stop_service};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_service_migrates_creates_its_topics_consumes_and_publishes_what_its_steps_emit() {
    // An empty schema: the service applies the framework's tables itself.
    let db = TestDb::empty("service-e2e").await;
    sqlx::query("CREATE TABLE reservations (n BIGINT PRIMARY KEY)")
        .execute(&db.pool)
        .await
        .unwrap();
    let kafka = TestKafka::new().await;
    let topic = unique_name("service-e2e");
    let out = format!("{topic}.out");
    kafka.create_topic(&out, 1).await;
    let group = format!("{topic}-group");
    let service = SagaService::builder()
        .brokers(&kafka.brokers)
        .group_id(&group)
        .pool(db.pool.clone())
        .step(reserve_on(&topic))
        .create_topics(2, 1)
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let running = tokio::spawn(service.run(stop.clone().cancelled_owned()));

    // Its topic, its dead-letter topic and its retry topic were created.
    wait_until("the service's topics", WAIT, || async {
        (kafka.partition_count(&topic).await == 2
            && kafka.partition_count(&format!("{group}.dlq")).await == 2
            && kafka.partition_count(&format!("{group}.retry")).await == 2)
            .then_some(())
    })
    .await;
    kafka.delete_on_drop(&topic);
    kafka.delete_on_drop(&format!("{group}.dlq"));
    kafka.delete_on_drop(&format!("{group}.retry"));
    place_orders(&kafka, &topic, 1..=5).await;
    // The embedded relay published what the step emitted.
    let (published, ns) = read_reserved(&kafka, &out, 5, Duration::from_millis(500)).await;
    assert_eq!(ns, [1, 2, 3, 4, 5]);
    assert!(
        published
            .iter()
            .all(|m| m.header("ce_type") == Some(Reserved::TYPES[0]))
    );
    assert_eq!(db.count("reservations").await, 5);
    stop_service(stop, running).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn when_one_part_fails_the_service_stops_every_other_part_and_returns_the_failure() {
    let db = TestDb::empty("service-stop").await;
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("service-stop", 1).await;
    kafka.create_topic(&format!("{topic}-group.dlq"), 1).await;
    kafka.create_topic(&format!("{topic}-group.retry"), 1).await;
    let service = SagaService::builder()
        .brokers(&kafka.brokers)
        .group_id(format!("{topic}-group"))
        .pool(db.pool.clone())
        .step(reserve_on(&topic))
        .task("a failing task", |ctx| async move {
            // Fail once the rest of the service is up.
            tokio::time::sleep(Duration::from_secs(2)).await;
            assert!(!ctx.is_stopping());
            Err("the task's downstream is gone".into())
        })
        .build()
        .unwrap();
    let started = Instant::now();
    // The service is never told to stop: it must stop by itself, consumer and relay included.
    let result = tokio::time::timeout(WAIT, service.run(std::future::pending()))
        .await
        .expect("a failing part stops the whole service");
    match result {
        Err(ServiceError::Task { name, error }) => {
            assert_eq!(name, "a failing task");
            assert!(error.to_string().contains("downstream is gone"));
        }
        other => panic!("expected the task's failure, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[tokio::test]
async fn a_missing_required_setting_is_named_never_defaulted() {
    let db = TestDb::empty("service-settings").await;
    let step = || reserve_on("t");
    let no_brokers = SagaService::builder()
        .group_id("g")
        .pool(db.pool.clone())
        .step(step())
        .build()
        .unwrap_err();
    assert!(
        matches!(&no_brokers, ServiceError::Config(ConfigError::Problem(p)) if p.setting == "KAFKA_BROKERS"),
        "{no_brokers}"
    );
    let no_group = SagaService::builder()
        .brokers("127.0.0.1:9092")
        .pool(db.pool.clone())
        .step(step())
        .build()
        .unwrap_err();
    assert!(no_group.to_string().contains("SAGA_GROUP_ID"), "{no_group}");
    let no_pool = SagaService::builder()
        .brokers("127.0.0.1:9092")
        .group_id("g")
        .step(step())
        .build()
        .unwrap_err();
    assert!(no_pool.to_string().contains("database pool"), "{no_pool}");
}

/// The outbox handed to a service's other writers is the one the service opens: its settings made after it
/// was handed out are followed by every clone (before, a change after `outbox()` was refused at `build`,
/// and `outbox()`, a getter to look at, decided it).
#[tokio::test]
async fn the_outbox_handed_out_follows_the_settings_made_after() {
    let db = TestDb::empty("service-outbox-order").await;
    let builder = SagaService::builder()
        .brokers("127.0.0.1:9092")
        .group_id("g")
        .pool(db.pool.clone())
        .step(reserve_on("t"));
    let handed = builder.outbox();
    assert_eq!(handed.mode(), saga_consumer::OutboxMode::Table);
    assert!(handed.is_writable(), "a table outbox is writable at once");
    let service = builder
        .outbox_mode(saga_consumer::OutboxMode::Wal)
        .outbox_max_transaction_bytes(1_000)
        .relay(|r| r.replication_url(db.url()))
        .build()
        .unwrap();
    assert_eq!(handed.mode(), saga_consumer::OutboxMode::Wal);
    assert_eq!(handed.max_transaction_bytes(), 1_000);
    assert!(
        !handed.is_writable(),
        "a WAL outbox is not writable until the service opens it"
    );
    drop(service);

    // And back: the last setting made before `build` is the service's.
    let builder = SagaService::builder()
        .brokers("127.0.0.1:9092")
        .group_id("g")
        .pool(db.pool.clone())
        .step(reserve_on("t"))
        .outbox_mode(saga_consumer::OutboxMode::Wal);
    let handed = builder.outbox();
    assert!(!handed.is_writable());
    builder
        .outbox_mode(saga_consumer::OutboxMode::Table)
        .build()
        .unwrap();
    assert_eq!(handed.mode(), saga_consumer::OutboxMode::Table);
    assert!(handed.is_writable());
}

/// Every problem of a service's settings is reported by `build`, each naming its variable: those of the
/// environment, and those of values given in code, by the rules the variables are parsed with.
#[tokio::test]
async fn build_reports_every_settings_problem_naming_each_variable() {
    let db = TestDb::empty("service-problems").await;
    let args = saga_consumer::settings::ServiceArgs::from_vars(|name| {
        (name == "SAGA_RETRY_JITTER").then(|| "0.5".to_owned())
    })
    .unwrap();
    let refused = SagaService::builder()
        .args(&args)
        .pool(db.pool.clone())
        .step(reserve_on("t"))
        .batch_size(0)
        .key_concurrency(5_000)
        .commit_interval(std::time::Duration::ZERO)
        .relay(|r| r.batch_size(0))
        .build()
        .unwrap_err();
    let said = refused.to_string();
    for var in [
        "KAFKA_BROKERS",
        "SAGA_GROUP_ID",
        "SAGA_BATCH_SIZE",
        "SAGA_KEY_CONCURRENCY",
        "SAGA_COMMIT_INTERVAL_MS",
        "RELAY_BATCH_SIZE",
    ] {
        assert!(said.contains(var), "{var} is named: {said}");
    }
    assert!(!said.contains("SAGA_RETRY_JITTER"), "{said}");
    assert!(!said.contains('\n'), "one line: {said}");
}

/// Charges once per message of its step, recording the external key (which names the step).
async fn charge(msg: &Message<Placed>, ctx: &mut StepContext<'_>) -> StepResult {
    sqlx::query("INSERT INTO charges (external_key) VALUES ($1)")
        .bind(msg.external_key().as_str())
        .execute(ctx.conn())
        .await?;
    Ok(StepOutcome::completed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn renaming_a_step_makes_every_message_it_processed_new_to_it() {
    let db = TestDb::with("step-rename", &[saga_consumer::migrate::migrator()]).await;
    sqlx::query("CREATE TABLE charges (external_key TEXT NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("step-rename", 1).await;
    place_orders(&kafka, &topic, 1..=3).await;
    // Each run is a group of its own reading the topic from the start: the same messages delivered
    // again, as after a replay or offsets reset.
    let run = |group: &'static str, name: &'static str| {
        let (kafka, topic, pool) = (&kafka, topic.clone(), db.pool.clone());
        async move {
            let group = format!("{topic}-{group}");
            kafka.create_topic(&format!("{group}.dlq"), 1).await;
            kafka.create_topic(&format!("{group}.retry"), 1).await;
            let consumer = saga_consumer::SagaConsumer::builder()
                .brokers(kafka.brokers.clone())
                .group_id(&group)
                .pool(pool)
                .commit_interval(Duration::from_millis(100))
                .step(saga_consumer::step(name, charge).on(&Topic::new(&topic)))
                .build()
                .unwrap();
            let stop = CancellationToken::new();
            let running = tokio::spawn(consumer.run(stop.clone().cancelled_owned()));
            wait_until("the run to commit every message", WAIT, || async {
                let committed = kafka.committed_offsets(&group, &topic).await;
                (committed.get(&0) == Some(&3)).then_some(())
            })
            .await;
            stop.cancel();
            running.await.unwrap().unwrap();
        }
    };
    let charges = || async {
        let keys: Vec<String> =
            sqlx::query_scalar("SELECT external_key FROM charges ORDER BY external_key")
                .fetch_all(&db.pool)
                .await
                .unwrap();
        keys
    };
    run("first", "charge").await;
    assert_eq!(charges().await.len(), 3);
    // Delivered again to the step of the same name: absorbed by its step keys.
    run("again", "charge").await;
    assert_eq!(charges().await.len(), 3, "the same name: nothing ran twice");
    // Delivered again to the step renamed: its keys are new, so every message is charged again.
    run("renamed", "charge-v2").await;
    let keys = charges().await;
    assert_eq!(
        keys.len(),
        6,
        "the renamed step ran every message again: {keys:?}"
    );
    assert_eq!(keys.iter().filter(|k| k.ends_with(":charge-v2")).count(), 3);
}
