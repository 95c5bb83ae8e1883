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
