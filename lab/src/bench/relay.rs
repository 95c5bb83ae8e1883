//! Relay throughput on a backlog, and commit-to-acknowledgement latency at a steady write rate.

use std::time::Duration;

use outbox_relay::Relay;
use saga_core::Lineage;
use saga_core::{Event, IdempotencyKey, OutboxMessage, TenantId};
use saga_runtime::kafka::KafkaConfig;
use saga_runtime::store::outbox;
use sqlx::{PgPool, Row};
use tokio_util::sync::CancellationToken;

use crate::bench::{Progress, rate};

fn row(topic: &str, n: i64) -> anyhow::Result<OutboxMessage> {
    let lineage = Lineage::root(
        IdempotencyKey::new(&format!("bench-{n}"))?,
        TenantId::default(),
    );
    let event = Event::new(
        "Numbered",
        topic,
        format!("key-{}", n % 1_000),
        &serde_json::json!({ "n": n }),
    )?;
    Ok(OutboxMessage::from_event(event, &lineage, "saga-bench"))
}

type Running = tokio::task::JoinHandle<Result<(), outbox_relay::RelayError>>;

fn start(kafka: &KafkaConfig, pool: &PgPool) -> (CancellationToken, Running) {
    let stop = CancellationToken::new();
    let relay = start_one(kafka, pool, &stop);
    (stop, relay)
}

/// Starts a relay with the default settings, except `RELAY_LINGER_MS` when set (to measure the linger's
/// trade-off between latency and batching).
fn start_one(kafka: &KafkaConfig, pool: &PgPool, stop: &CancellationToken) -> Running {
    let mut relay = Relay::builder()
        .kafka(kafka.clone())
        .pool(pool.clone())
        .rebalance_interval(Duration::from_millis(200));
    if let Some(ms) = std::env::var("RELAY_LINGER_MS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
    {
        relay = relay.linger(Duration::from_millis(ms));
    }
    let relay = relay.build().expect("a valid relay");
    tokio::spawn(relay.run(stop.clone().cancelled_owned()))
}

async fn wait_published(pool: &PgPool, progress: &Progress) -> anyhow::Result<()> {
    super::wait_until_done(
        "the outbox",
        Duration::from_millis(500),
        super::STALL_LIMIT,
        || async {
            let left: i64 =
                sqlx::query_scalar("SELECT count(*) FROM saga_outbox WHERE published_at IS NULL")
                    .fetch_one(pool)
                    .await?;
            progress.note(&format!("{left} rows left to publish"));
            Ok(left)
        },
    )
    .await
}

/// Writes a backlog of `rows` rows, then runs `instances` relays (each with its own connections and
/// producer; they share the outbox's shards) until all are published. Returns rows/s, from the first
/// acknowledgement to the last.
pub async fn backlog(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topic: &str,
    rows: i64,
    instances: usize,
    progress: &Progress,
) -> anyhow::Result<f64> {
    for chunk in (0..rows).collect::<Vec<_>>().chunks(1_000) {
        let messages = chunk
            .iter()
            .map(|n| row(topic, *n))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut tx = pool.begin().await?;
        outbox::append(&mut tx, &messages).await?;
        tx.commit().await?;
    }
    progress.note(&format!(
        "{rows} rows written; relaying with {instances} relay(s)"
    ));
    let stop = CancellationToken::new();
    let relays: Vec<Running> = (0..instances.max(1))
        .map(|_| start_one(kafka, pool, &stop))
        .collect();
    wait_published(pool, progress).await?;
    stop.cancel();
    for relay in relays {
        relay.await??;
    }
    let seconds: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM max(published_at) - min(published_at))::float8 FROM saga_outbox",
    )
    .fetch_one(pool)
    .await?;
    Ok(rate(rows, seconds))
}

/// Writes `per_second` single-row transactions per second for `seconds` while the relay runs. Returns the
/// p50 and p99 of commit-to-acknowledgement latency in milliseconds (the row's write time stands for its
/// commit: each transaction is one short insert).
pub async fn steady(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topic: &str,
    per_second: u32,
    seconds: u32,
    progress: &Progress,
) -> anyhow::Result<(f64, f64)> {
    let (stop, relay) = start(kafka, pool);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let writers = 4;
    let interval = Duration::from_secs_f64(f64::from(writers) / f64::from(per_second.max(1)));
    let per_writer = i64::from(per_second / writers * seconds);
    let mut tasks = Vec::new();
    for w in 0..i64::from(writers) {
        let (pool, topic) = (pool.clone(), topic.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            for i in 0..per_writer {
                tick.tick().await;
                let message = row(&topic, w * 1_000_000 + i)?;
                let mut tx = pool.begin().await?;
                outbox::append(&mut tx, &[message]).await?;
                tx.commit().await?;
            }
            anyhow::Ok(())
        }));
    }
    progress.note(&format!("writing {per_second} rows/s for {seconds} s"));
    for task in tasks {
        task.await??;
    }
    wait_published(pool, progress).await?;
    stop.cancel();
    relay.await??;
    let row = sqlx::query(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), percentile_cont(0.99) WITHIN GROUP (ORDER BY ms) \
         FROM (SELECT extract(epoch FROM published_at - created_at) * 1000 AS ms FROM saga_outbox) AS l",
    )
    .fetch_one(pool)
    .await?;
    Ok((row.try_get(0)?, row.try_get(1)?))
}
