//! The demo's scene of per-key order through failures (the guide's "order 7"), on the demo's broker and
//! database: a small order service whose topic holds keys (`OrderPolicy::HoldKey`). Order 7's
//! `OrderCreated` is dead-lettered while the payment gateway is down; its `OrderCancelled` is parked behind
//! the letter while order 8's runs; the gateway back, the operator replays the letter (as `saga dlq replay`
//! does): order 7 is charged, then cancelled, in that order.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use saga_admin::dlq::{self, DlqFilter, ReplayOptions};
use saga_admin::holds;
use saga_consumer::{
    KafkaConfig, Message, OrderPolicy, RetryPolicy, SagaConsumer, SagaEvent, StepContext,
    StepError, StepOutcome, StepResult, Topic, step_with,
};
use saga_examples::service::quote_ident;

use crate::harness::broker::Broker;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// How long each stage of the scene may take.
const STAGE: Duration = Duration::from_secs(60);

#[derive(Serialize, Deserialize, SagaEvent)]
struct OrderCreated {
    order_id: i64,
}

#[derive(Serialize, Deserialize, SagaEvent)]
struct OrderCancelled {
    order_id: i64,
}

async fn charge(
    msg: &Message<OrderCreated>,
    ctx: &mut StepContext<'_>,
    gateway_down: &Arc<AtomicBool>,
) -> StepResult {
    if gateway_down.load(Ordering::SeqCst) {
        return Err(StepError::permanent("payment gateway down"));
    }
    effect(ctx, msg.payload().order_id, "charged").await
}

async fn cancel(
    msg: &Message<OrderCancelled>,
    ctx: &mut StepContext<'_>,
    _: &Arc<AtomicBool>,
) -> StepResult {
    effect(ctx, msg.payload().order_id, "cancelled").await
}

async fn effect(ctx: &mut StepContext<'_>, order_id: i64, what: &str) -> StepResult {
    sqlx::query("INSERT INTO held_demo_effects (order_id, what) VALUES ($1, $2)")
        .bind(order_id)
        .bind(what)
        .execute(ctx.conn())
        .await?;
    Ok(StepOutcome::completed())
}

/// Plays the scene in schema `{name}_held` and on topics `{name}.held.*`; returns what happened, line by
/// line. An effect out of order is an error. The schema is dropped afterwards unless `keep`.
pub async fn order_7(
    broker: &Broker,
    database_url: &str,
    name: &str,
    keep: bool,
) -> anyhow::Result<Vec<String>> {
    let schema = format!("{}_held", name.replace('-', "_"));
    let admin =
        saga_consumer::setup::connect_postgres("DATABASE_URL", database_url, None, 1).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA IF NOT EXISTS {}",
        quote_ident(&schema)
    )))
    .execute(&admin)
    .await?;
    let pool =
        saga_consumer::setup::connect_postgres("DATABASE_URL", database_url, Some(&schema), 4)
            .await?;
    let played = play(broker, &pool, name).await;
    pool.close().await;
    if !keep {
        crate::harness::drop_schema(&admin, &schema).await?;
    }
    played
}

async fn play(broker: &Broker, pool: &PgPool, name: &str) -> anyhow::Result<Vec<String>> {
    saga_consumer::migrate::migrate(pool).await?;
    sqlx::query(
        "CREATE TABLE held_demo_effects (seq BIGSERIAL PRIMARY KEY, order_id BIGINT NOT NULL, \
         what TEXT NOT NULL)",
    )
    .execute(pool)
    .await?;
    let kafka = KafkaConfig::new(broker.brokers());
    let orders = format!("{name}.held.orders");
    let group = format!("{name}.held");
    let (dlq, retry) = (format!("{group}.dlq"), format!("{group}.retry"));
    broker
        .create_topics(&[orders.clone(), dlq.clone(), retry.clone()], 1)
        .await?;

    let gateway_down = Arc::new(AtomicBool::new(true));
    let created: Topic<OrderCreated> = Topic::new(orders.clone());
    let cancelled: Topic<OrderCancelled> = Topic::new(orders.clone());
    let consumer = SagaConsumer::builder()
        .kafka(kafka.clone())
        .group_id(group.clone())
        .pool(pool.clone())
        .commit_interval(Duration::from_millis(100))
        .retry(RetryPolicy::default().max_attempts(1))
        .step(step_with("charge-order", gateway_down.clone(), charge).on(&created))
        .step(step_with("cancel-order", gateway_down.clone(), cancel).on(&cancelled))
        .order_policy_for_topic(orders.clone(), OrderPolicy::HoldKey)
        .build()?;
    let stop = CancellationToken::new();
    let running = tokio::spawn(consumer.run(stop.clone().cancelled_owned()));
    let scene = scene(&kafka, pool, &orders, &group, &dlq, &gateway_down).await;
    stop.cancel();
    running.await??;
    scene
}

async fn scene(
    kafka: &KafkaConfig,
    pool: &PgPool,
    orders: &str,
    group: &str,
    dlq: &str,
    gateway_down: &AtomicBool,
) -> anyhow::Result<Vec<String>> {
    let producer = saga_runtime::kafka::idempotent_producer(
        kafka,
        Duration::from_millis(1),
        Duration::from_secs(30),
    )?;
    let send = |order_id: i64, event_type: &'static str| {
        let producer = producer.clone();
        let orders = orders.to_owned();
        async move {
            let key = format!("order-{order_id}");
            let idempotency = format!("{key}-{event_type}");
            let headers = saga_runtime::kafka::pairs_to_kafka_headers(&[
                ("idempotency-key".to_owned(), idempotency),
                ("ce_type".to_owned(), event_type.to_owned()),
            ]);
            let payload = serde_json::to_vec(&serde_json::json!({ "order_id": order_id }))?;
            producer
                .send(
                    rdkafka::producer::FutureRecord::<str, [u8]>::to(&orders)
                        .key(key.as_str())
                        .payload(payload.as_slice())
                        .headers(headers),
                    Duration::from_secs(30),
                )
                .await
                .map_err(|(e, _)| anyhow::anyhow!("producing to {orders}: {e}"))?;
            anyhow::Ok(())
        }
    };
    let effects = || async {
        sqlx::query_as::<_, (i64, String)>(
            "SELECT order_id, what FROM held_demo_effects ORDER BY seq",
        )
        .fetch_all(pool)
        .await
    };
    let mut lines = Vec::new();

    send(7, "OrderCreated").await?;
    let letter = wait("order 7's dead letter", || async {
        let letters = dlq::list(kafka, pool, dlq, &DlqFilter::default())
            .await
            .ok()?;
        letters.into_iter().next()
    })
    .await?;
    lines.push(format!(
        "order 7's OrderCreated dead-lettered ({}): its key order-7 is held",
        letter.error
    ));
    send(7, "OrderCancelled").await?;
    send(8, "OrderCancelled").await?;
    let held = wait("order 7's cancel parked and order 8's run", || async {
        let held = holds::list(pool, Some(group), 10).await.ok()?;
        let ran = effects().await.ok()?.contains(&(8, "cancelled".to_owned()));
        (ran && held.first().is_some_and(|h| h.parked >= 1)).then_some(held)
    })
    .await?;
    lines.push(format!(
        "order 7's OrderCancelled parked behind it (saga keys held: {} held, {} parked); order 8's \
         OrderCancelled ran",
        held[0].key, held[0].parked
    ));

    gateway_down.store(false, Ordering::SeqCst);
    let mut options = ReplayOptions::default();
    options.operator = "saga-demo".to_owned();
    let report = dlq::replay(
        kafka,
        pool,
        dlq,
        &DlqFilter::at(letter.partition, letter.offset),
        &options,
    )
    .await?;
    anyhow::ensure!(report.sent() == 1, "the replay sent nothing: {report:?}");
    let order_7 = wait("order 7 charged and cancelled, its key let go", || async {
        let of_7: Vec<String> = effects()
            .await
            .ok()?
            .into_iter()
            .filter(|(o, _)| *o == 7)
            .map(|(_, w)| w)
            .collect();
        let held = holds::list(pool, Some(group), 10).await.ok()?;
        (of_7.len() == 2 && held.is_empty()).then_some(of_7)
    })
    .await?;
    anyhow::ensure!(
        order_7 == ["charged", "cancelled"],
        "order 7's effects out of order: {order_7:?}"
    );
    lines.push(format!(
        "gateway back, the letter replayed: order 7 {} (in order), its key let go",
        order_7.join(", then ")
    ));
    Ok(lines)
}

/// Waits until `check` gives a value, up to [`STAGE`].
async fn wait<T, F, Fut>(what: &str, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + STAGE;
    loop {
        if let Some(value) = check().await {
            return Ok(value);
        }
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!("held-key scene: {what} did not happen within {STAGE:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
