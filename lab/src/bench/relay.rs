//! Relay throughput on a backlog, and commit-to-acknowledgement latency at a steady write rate.

use std::time::{Duration, Instant};

use outbox_relay::{OutboxMode, Relay, RelayProbe};
use saga_core::Lineage;
use saga_core::{Event, IdempotencyKey, OutboxMessage, TenantId};
use saga_runtime::kafka::KafkaConfig;
use saga_runtime::store::{outbox, wal};
use sqlx::PgPool;
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

/// Where a relay of the benchmark reads: `mode`, and for the write-ahead log, the replication URL.
#[derive(Debug, Clone)]
pub struct Outbox {
    /// The outbox mode.
    pub mode: OutboxMode,
    /// The database's URL, for the WAL relay's replication connection.
    pub url: String,
}

impl Outbox {
    /// Writes `messages` in the caller's transaction, as this mode's writers do.
    async fn write(
        &self,
        tx: &mut sqlx::PgConnection,
        messages: &[OutboxMessage],
    ) -> Result<(), sqlx::Error> {
        if self.mode == OutboxMode::Wal {
            wal::emit(tx, messages).await
        } else {
            outbox::append_rows(tx, messages).await.map(drop)
        }
    }

    /// Readies the pool's schema for this mode: the WAL outbox's slot must exist before the first write.
    async fn prepare(&self, pool: &PgPool) -> anyhow::Result<()> {
        if self.mode == OutboxMode::Wal {
            wal::prepare(pool).await?;
        }
        Ok(())
    }
}

/// Starts a relay with the default settings, except `RELAY_LINGER_MS` when set (to measure the linger's
/// trade-off between latency and batching).
fn start_one(
    kafka: &KafkaConfig,
    pool: &PgPool,
    outbox: &Outbox,
    stop: &CancellationToken,
) -> (Running, RelayProbe) {
    let mut relay = Relay::builder()
        .kafka(kafka.clone())
        .pool(pool.clone())
        .rebalance_interval(Duration::from_millis(200))
        .mode(outbox.mode)
        .replication_url(outbox.url.clone());
    if let Some(ms) = std::env::var("RELAY_LINGER_MS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
    {
        relay = relay.linger(Duration::from_millis(ms));
    }
    let relay = relay.build().expect("a valid relay");
    let probe = relay.probe();
    (
        tokio::spawn(relay.run(stop.clone().cancelled_owned())),
        probe,
    )
}

/// Waits until the relays published `rows` events in all (read from their probes); returns the seconds
/// from their first acknowledgement to their last (to within 5 ms).
async fn wait_published(
    probes: &[RelayProbe],
    rows: i64,
    progress: &Progress,
) -> anyhow::Result<f64> {
    let total = u64::try_from(rows)?;
    let published = || probes.iter().map(RelayProbe::published).sum::<u64>();
    let mut first: Option<Instant> = None;
    let mut last_note = Instant::now();
    let mut last_progress = (Instant::now(), 0);
    loop {
        let n = published();
        if n > 0 && first.is_none() {
            first = Some(Instant::now());
        }
        if n >= total {
            return Ok(first.map_or(0.0, |f| f.elapsed().as_secs_f64()));
        }
        if n > last_progress.1 {
            last_progress = (Instant::now(), n);
        } else if last_progress.0.elapsed() > super::STALL_LIMIT {
            anyhow::bail!(
                "the relay published {n} of {total} events and then nothing for 2 minutes"
            );
        }
        if last_note.elapsed() > Duration::from_secs(1) {
            progress.note(&format!("{} events left to publish", total - n));
            last_note = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Writes `rows` events to `outbox` in transactions of 1,000.
async fn write_backlog(
    pool: &PgPool,
    topic: &str,
    rows: i64,
    outbox: &Outbox,
) -> anyhow::Result<()> {
    outbox.prepare(pool).await?;
    for chunk in (0..rows).collect::<Vec<_>>().chunks(1_000) {
        let messages = chunk
            .iter()
            .map(|n| row(topic, *n))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut tx = pool.begin().await?;
        outbox.write(&mut tx, &messages).await?;
        tx.commit().await?;
    }
    Ok(())
}

/// Writes a backlog of `rows` events in transactions of 1,000, then runs `instances` relays (each with its
/// own connections and producer; in table mode they share the outbox's shards, in WAL mode one reads the
/// slot and the others stand by) until all are published. Returns events/s, from the first
/// acknowledgement to the last.
pub async fn backlog(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topic: &str,
    rows: i64,
    instances: usize,
    outbox: &Outbox,
    progress: &Progress,
) -> anyhow::Result<f64> {
    write_backlog(pool, topic, rows, outbox).await?;
    progress.note(&format!(
        "{rows} events written ({}); relaying with {instances} relay(s)",
        outbox.mode.as_str()
    ));
    let stop = CancellationToken::new();
    let (relays, probes): (Vec<Running>, Vec<RelayProbe>) = (0..instances.max(1))
        .map(|_| start_one(kafka, pool, outbox, &stop))
        .unzip();
    let seconds = wait_published(&probes, rows, progress).await?;
    stop.cancel();
    for relay in relays {
        relay.await??;
    }
    if outbox.mode == OutboxMode::Table {
        // The rows' own acknowledgement times, exact.
        let seconds: f64 = sqlx::query_scalar(
            "SELECT extract(epoch FROM max(published_at) - min(published_at))::float8 FROM saga_outbox",
        )
        .fetch_one(pool)
        .await?;
        return Ok(rate(rows, seconds));
    }
    // The relay's acknowledgements, polled.
    Ok(rate(rows, seconds))
}

/// The table relay's SQL ceiling: the same backlog as [`backlog`] written to the table outbox, then drained
/// by the relay's own statements with no broker (each batch fetched and marked as if acknowledged at once).
/// Returns rows/s from the first fetch to the last mark.
pub async fn sql_ceiling(
    pool: &PgPool,
    topic: &str,
    rows: i64,
    progress: &Progress,
) -> anyhow::Result<f64> {
    let table = Outbox {
        mode: OutboxMode::Table,
        url: String::new(),
    };
    write_backlog(pool, topic, rows, &table).await?;
    progress.note(&format!(
        "{rows} events written; draining with the relay's SQL alone"
    ));
    let started = Instant::now();
    let marked = outbox_relay::drain_without_broker(pool, 2_000).await?;
    anyhow::ensure!(
        i64::try_from(marked)? == rows,
        "the relay's statements marked {marked} of {rows} rows"
    );
    Ok(rate(rows, started.elapsed().as_secs_f64()))
}

/// Writes `per_second` single-event transactions per second for `seconds` while the relay runs. Returns the
/// p50 and p99 of commit-to-acknowledgement latency in milliseconds, as the relay measured it (for the
/// table, the row's write stands for its commit: each transaction is one short insert).
pub async fn steady(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topic: &str,
    per_second: u32,
    seconds: u32,
    outbox: &Outbox,
    progress: &Progress,
) -> anyhow::Result<(f64, f64)> {
    outbox.prepare(pool).await?;
    let stop = CancellationToken::new();
    let (relay, probe) = start_one(kafka, pool, outbox, &stop);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let writers = 4;
    let interval = Duration::from_secs_f64(f64::from(writers) / f64::from(per_second.max(1)));
    let per_writer = i64::from(per_second / writers * seconds);
    let mut tasks = Vec::new();
    for w in 0..i64::from(writers) {
        let (pool, topic, outbox) = (pool.clone(), topic.to_owned(), outbox.clone());
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            for i in 0..per_writer {
                tick.tick().await;
                let message = row(&topic, w * 1_000_000 + i)?;
                let mut tx = pool.begin().await?;
                outbox.write(&mut tx, &[message]).await?;
                tx.commit().await?;
            }
            anyhow::Ok(())
        }));
    }
    progress.note(&format!(
        "writing {per_second} events/s for {seconds} s ({})",
        outbox.mode.as_str()
    ));
    for task in tasks {
        task.await??;
    }
    wait_published(
        std::slice::from_ref(&probe),
        per_writer * i64::from(writers),
        progress,
    )
    .await?;
    stop.cancel();
    relay.await??;
    let ms = |q| {
        probe
            .commit_to_ack(q)
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1_000.0)
    };
    Ok((ms(0.5), ms(0.99)))
}
