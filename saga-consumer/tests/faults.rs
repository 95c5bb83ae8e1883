//! The test kit's fault injection against the real broker and PostgreSQL: failing every message once after
//! its handler ran (as a crash before the commit would) leaves a step that writes through its transaction
//! with one effect per message, and exposes a step that writes elsewhere: its effects double.

use std::time::Duration;

use saga_consumer::{
    Message, SagaService, StepContext, StepOutcome, StepResult, Topic, step, step_with,
};
use saga_test_support::{TestDb, TestKafka, wait_until};
use saga_testing::faults::fail_after_handler;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

mod steps;

use steps::{Placed, dead_letter_and_retry_topics, place_orders, quick_retries, stop_service};

const WAIT: Duration = Duration::from_secs(60);

/// Records the order in the step's transaction: its effect commits with its step key, or not at all.
async fn careful(msg: &Message<Placed>, ctx: &mut StepContext<'_>) -> StepResult {
    sqlx::query("INSERT INTO careful (n) VALUES ($1)")
        .bind(msg.payload().n)
        .execute(ctx.conn())
        .await?;
    Ok(StepOutcome::completed())
}

/// Records the order through a pool of its own, outside the step's transaction: deliberately not
/// idempotent.
async fn careless(msg: &Message<Placed>, _ctx: &mut StepContext<'_>, pool: &PgPool) -> StepResult {
    sqlx::query("INSERT INTO careless (n) VALUES ($1)")
        .bind(msg.payload().n)
        .execute(pool)
        .await?;
    Ok(StepOutcome::completed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failing_after_the_handler_keeps_a_transactional_step_once_and_catches_a_careless_one() {
    let db = TestDb::empty("faults").await;
    for table in ["careful", "careless"] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {table} (seq BIGSERIAL PRIMARY KEY, n BIGINT NOT NULL)"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("faults", 2).await;
    // A service subscribes one step to an event type of a topic: the careless step reads a copy.
    let copy = kafka.topic("faults-copy", 2).await;
    let group = format!("{topic}-group");
    dead_letter_and_retry_topics(&kafka, &group).await;
    let (orders, copies): (Topic<Placed>, Topic<Placed>) = (Topic::new(&topic), Topic::new(&copy));
    // One layer for both steps: it counts each step's runs of a message apart.
    let crash = fail_after_handler(1);
    let service = SagaService::builder()
        .brokers(&kafka.brokers)
        .group_id(&group)
        .pool(db.pool.clone())
        .retry(quick_retries(3))
        .step(step("careful", careful).on(&orders).layer(crash.clone()))
        .step(
            step_with("careless", db.pool.clone(), careless)
                .on(&copies)
                .layer(crash.clone()),
        )
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let running = tokio::spawn(service.run(stop.clone().cancelled_owned()));
    place_orders(&kafka, &topic, 1..=4).await;
    place_orders(&kafka, &copy, 1..=4).await;

    let count = |table: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM {table}"
            )))
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    wait_until("every order's steps done", WAIT, || async {
        let done: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM saga_idempotency_keys WHERE status = 'completed'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        (done == 8).then_some(())
    })
    .await;
    // Each step ran twice per order: the injected failure, then the retry.
    assert_eq!(crash.calls(), 16);
    // The transactional step's first run rolled back: one effect per order.
    assert_eq!(count("careful").await, 4);
    // The careless step's first run stayed: caught, two effects per order.
    assert_eq!(count("careless").await, 8);
    stop_service(stop, running).await;
}

/// A statement of the framework's that the schema refuses, whatever the message (here its crash-loop
/// record, whose function an operator dropped: migrations behind the binary), is the operator's problem:
/// the service stops with the reason; no message is dead-lettered for it and none is committed past.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_statement_the_schema_refuses_stops_the_service_naming_it_and_dead_letters_nothing() {
    let db = TestDb::empty("faults-schema").await;
    sqlx::query("CREATE TABLE careful (seq BIGSERIAL PRIMARY KEY, n BIGINT NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("faults-schema", 1).await;
    let group = format!("{topic}-group");
    dead_letter_and_retry_topics(&kafka, &group).await;
    let orders: Topic<Placed> = Topic::new(&topic);
    let service = SagaService::builder()
        .brokers(&kafka.brokers)
        .group_id(&group)
        .pool(db.pool.clone())
        .retry(quick_retries(1))
        .step(step("careful", careful).on(&orders))
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let running = tokio::spawn(service.run(stop.clone().cancelled_owned()));
    place_orders(&kafka, &topic, 1..=1).await;
    let careful_rows = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM careful")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    wait_until("the first order's step done", WAIT, || async {
        (careful_rows().await == 1).then_some(())
    })
    .await;
    wait_until("its offset committed", WAIT, || async {
        let committed = kafka.committed_offsets(&group, &topic).await;
        (committed.get(&0) == Some(&1)).then_some(())
    })
    .await;

    sqlx::query("DROP FUNCTION saga_consumer_begin_batch")
        .execute(&db.pool)
        .await
        .unwrap();
    place_orders(&kafka, &topic, 2..=3).await;
    let ended = tokio::time::timeout(WAIT, running)
        .await
        .expect("the service stops by itself")
        .unwrap();
    let error = ended
        .expect_err("the service stops with an error")
        .to_string();
    assert!(
        error.contains("saga_consumer_begin_batch") || error.contains("42883"),
        "the reason names the statement: {error}"
    );
    assert!(error.contains("migrations"), "and what to do: {error}");
    assert_eq!(careful_rows().await, 1, "no later order ran");
    assert_eq!(
        kafka.committed_offsets(&group, &topic).await.get(&0),
        Some(&1),
        "nothing committed past the first order"
    );
    assert_eq!(
        kafka
            .end_offsets(&format!("{group}.dlq"))
            .await
            .values()
            .sum::<i64>(),
        0,
        "nothing dead-lettered for the operator's problem"
    );
}
