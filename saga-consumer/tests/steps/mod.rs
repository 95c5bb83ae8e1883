//! The step the service tests run: records each order and emits `Reserved`.

#![allow(dead_code, unreachable_pub)]

use saga_consumer::{Message, SagaEvent, StepContext, StepOutcome, StepResult, Topic, step_with};

#[derive(serde::Serialize, serde::Deserialize, SagaEvent)]
pub struct Placed {
    pub n: i64,
}

#[derive(serde::Serialize, serde::Deserialize, SagaEvent)]
pub struct Reserved {
    pub n: i64,
}

/// Records each order and emits `Reserved` to `out`.
async fn reserve(
    msg: &Message<Placed>,
    ctx: &mut StepContext<'_>,
    out: &Topic<Reserved>,
) -> StepResult {
    let n = msg.payload().n;
    sqlx::query("INSERT INTO reservations (n) VALUES ($1)")
        .bind(n)
        .execute(ctx.conn())
        .await?;
    ctx.emit(out, n.to_string(), &Reserved { n })?;
    Ok(StepOutcome::completed())
}

/// The step `reserve` on `topic`, emitting to `{topic}.out`.
pub fn reserve_on(topic: &str) -> impl saga_consumer::SagaStep {
    step_with("reserve", Topic::new(format!("{topic}.out")), reserve).on(&Topic::new(topic))
}

/// Produces `Placed { n }`, keyed `order-{n}`, to `topic` for each `n` of `orders`.
pub async fn place_orders(
    kafka: &saga_test_support::TestKafka,
    topic: &str,
    orders: impl IntoIterator<Item = i64>,
) {
    let producer = kafka.producer();
    for n in orders {
        kafka
            .produce_event(
                &producer,
                topic,
                &format!("order-{n}"),
                Placed::TYPES[0],
                &Placed { n },
            )
            .await;
    }
}

/// The `Reserved` events read from `out` (`count` of them, then `idle` without more), with their `n`
/// sorted.
pub async fn read_reserved(
    kafka: &saga_test_support::TestKafka,
    out: &str,
    count: usize,
    idle: std::time::Duration,
) -> (Vec<saga_test_support::ReadMessage>, Vec<i64>) {
    let published = kafka
        .read_all(out, count, idle, std::time::Duration::from_secs(60))
        .await;
    let mut ns: Vec<i64> = published
        .iter()
        .map(|m| m.json()["n"].as_i64().unwrap())
        .collect();
    ns.sort_unstable();
    (published, ns)
}

/// Creates the dead-letter and retry topics of `group` (one partition each), deleted when `kafka` drops.
pub async fn dead_letter_and_retry_topics(kafka: &saga_test_support::TestKafka, group: &str) {
    for suffix in ["dlq", "retry"] {
        kafka.create_topic(&format!("{group}.{suffix}"), 1).await;
        kafka.delete_on_drop(&format!("{group}.{suffix}"));
    }
}

/// `attempts` in all, retried after 50 to 100 ms: a test's failing message is dead-lettered quickly.
pub fn quick_retries(attempts: u32) -> saga_consumer::RetryPolicy {
    saga_consumer::RetryPolicy::with_attempts_and_backoff(
        attempts,
        std::time::Duration::from_millis(50),
        std::time::Duration::from_millis(100),
    )
}

/// Stops a service started with `tokio::spawn(service.run(stop.cancelled_owned()))`, and checks that it
/// stops within a minute and without an error.
pub async fn stop_service(
    stop: tokio_util::sync::CancellationToken,
    running: tokio::task::JoinHandle<Result<(), saga_consumer::ServiceError>>,
) {
    stop.cancel();
    tokio::time::timeout(std::time::Duration::from_secs(60), running)
        .await
        .expect("the service stops")
        .unwrap()
        .unwrap();
}
