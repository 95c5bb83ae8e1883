//! Consumer throughput: the framework's consumer running a step that does one business INSERT per message
//! (with the step-key claim and one outbox event per message), against a plain at-least-once consumer
//! doing the same INSERT with the same batching and concurrency, but no deduplication and no outbox. Both
//! write a batch's rows with one multi-row statement (`SagaStep::handle_batch` on the framework's side).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::Message as _;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use saga_consumer::SagaConsumer;
use saga_core::{
    BatchContext, Event, Message, SagaStep, StepContext, StepError, StepName, StepOutcome,
    StepResult, Subscription,
};
use saga_runtime::kafka::KafkaConfig;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::bench::{Progress, rate};

/// The benchmark's message.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Work {
    /// Its number.
    pub n: i64,
}

/// The measured step: one INSERT and one emitted event.
#[derive(Debug)]
pub struct RecordWork {
    /// The consumed topic.
    pub topic: String,
}

impl SagaStep for RecordWork {
    type Payload = Work;

    fn name(&self) -> StepName {
        StepName::from_static("record-work")
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        vec![Subscription::new(&self.topic, "Work")]
    }

    async fn handle(&self, msg: &Message<Work>, ctx: &mut StepContext<'_>) -> StepResult {
        sqlx::query("INSERT INTO bench_effects (n) VALUES ($1)")
            .bind(msg.payload.n)
            .execute(ctx.conn())
            .await?;
        ctx.emit(self.done(msg)?);
        Ok(StepOutcome::completed())
    }

    async fn handle_batch(
        &self,
        msgs: &[&Message<Work>],
        ctx: &mut BatchContext<'_>,
    ) -> Result<Vec<StepOutcome>, StepError> {
        let ns: Vec<i64> = msgs.iter().map(|m| m.payload.n).collect();
        insert_batch(ctx.conn(), "bench_effects", &ns).await?;
        for msg in msgs {
            ctx.emit(msg, self.done(msg)?);
        }
        Ok(vec![StepOutcome::completed(); msgs.len()])
    }
}

impl RecordWork {
    fn done(&self, msg: &Message<Work>) -> Result<Event, serde_json::Error> {
        Event::new(
            "WorkDone",
            format!("{}.done", self.topic),
            msg.payload.n.to_string(),
            &msg.payload,
        )
    }
}

/// The business write both consumers do: one row per message, one statement per batch.
async fn insert_batch(
    conn: &mut sqlx::PgConnection,
    table: &'static str,
    ns: &[i64],
) -> Result<(), sqlx::Error> {
    let sql = match table {
        "bench_effects" => "INSERT INTO bench_effects (n) SELECT * FROM unnest($1::bigint[])",
        _ => "INSERT INTO bench_baseline (n) SELECT * FROM unnest($1::bigint[])",
    };
    sqlx::query(sql).bind(ns).execute(conn).await?;
    Ok(())
}

/// Produces `count` messages with distinct idempotency keys to `topic`.
pub async fn produce(
    kafka: &KafkaConfig,
    topic: &str,
    count: i64,
    progress: &Progress,
) -> anyhow::Result<()> {
    let producer = saga_runtime::kafka::idempotent_producer(
        kafka,
        Duration::from_millis(5),
        Duration::from_secs(120),
    )?;
    let mut pending = Vec::new();
    for n in 0..count {
        let key = format!("bench-{n}");
        let payload = serde_json::to_vec(&Work { n })?;
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "idempotency-key",
                value: Some(key.as_str()),
            })
            .insert(Header {
                key: "ce_type",
                value: Some("Work"),
            })
            .insert(Header {
                key: "ce_id",
                value: Some(key.as_str()),
            });
        loop {
            let record = FutureRecord::to(topic)
                .key(&key)
                .payload(&payload)
                .headers(headers.clone());
            match producer.send_result(record) {
                Ok(delivery) => {
                    pending.push(delivery);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        }
        if n % 20_000 == 0 {
            progress.note(&format!("produced {n}/{count}"));
        }
    }
    for delivery in pending {
        delivery.await?.map_err(|(e, _)| e)?;
    }
    Ok(())
}

/// Rows per second written to `table`, from the first row's to the last row's timestamp, once it has
/// `count` rows.
async fn throughput(
    pool: &PgPool,
    table: &str,
    count: i64,
    progress: &Progress,
) -> anyhow::Result<f64> {
    let count_sql = format!("SELECT count(*) FROM {table}");
    loop {
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(count_sql.clone()))
            .fetch_one(pool)
            .await?;
        progress.note(&format!("{table}: {n}/{count}"));
        if n >= count {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let seconds: f64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT extract(epoch FROM max(at) - min(at))::float8 FROM {table}"
    )))
    .fetch_one(pool)
    .await?;
    Ok(rate(count, seconds))
}

/// Runs the framework's consumer over `topic` until it processed `count` messages; returns messages/s.
pub async fn framework(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topic: &str,
    count: i64,
    batch_size: usize,
    concurrency: usize,
    progress: &Progress,
) -> anyhow::Result<f64> {
    let stop = CancellationToken::new();
    let consumer = SagaConsumer::builder()
        .kafka(kafka.clone())
        .group_id(format!("{topic}.framework"))
        .dlq_topic(format!("{topic}.dlq"))
        .pool(pool.clone())
        .batch_size(batch_size)
        .concurrency(concurrency)
        .step(RecordWork {
            topic: topic.to_owned(),
        })
        .build()?;
    let ops = consumer.ops();
    let running = tokio::spawn(consumer.run(stop.clone().cancelled_owned()));
    let result = throughput(pool, "bench_effects", count, progress).await;
    stop.cancel();
    running.await??;
    let metrics = ops.render();
    let value = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let (sum, transactions) = (
        value("saga_consumer_batch_size_sum "),
        value("saga_consumer_batch_size_count "),
    );
    progress.note(&format!(
        "framework: {transactions} transactions, {:.1} messages per transaction on average",
        sum / transactions.max(1.0)
    ));
    result
}

/// Runs a plain at-least-once consumer over `topic`: per partition, batches of `batch_size` in one
/// transaction each with the same INSERT, offsets stored after the commit. Returns messages/s.
pub async fn baseline(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topic: &str,
    count: i64,
    batch_size: usize,
    progress: &Progress,
) -> anyhow::Result<f64> {
    let consumer: Arc<StreamConsumer> = Arc::new(
        saga_runtime::kafka::client_config(kafka)
            .set("group.id", format!("{topic}.baseline"))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "true")
            .set("enable.auto.offset.store", "false")
            .set("fetch.wait.max.ms", "100")
            .create()?,
    );
    consumer.subscribe(&[topic])?;
    let stop = CancellationToken::new();
    let dispatcher = {
        let (consumer, pool, stop) = (consumer.clone(), pool.clone(), stop.clone());
        tokio::spawn(async move {
            let mut workers: HashMap<i32, mpsc::Sender<(i64, i64)>> = HashMap::new();
            loop {
                let message = tokio::select! {
                    () = stop.cancelled() => return,
                    m = consumer.recv() => m,
                };
                let Ok(message) = message else { continue };
                let Ok(work) =
                    serde_json::from_slice::<Work>(message.payload().unwrap_or_default())
                else {
                    continue;
                };
                let partition = message.partition();
                let sender = workers.entry(partition).or_insert_with(|| {
                    let (tx, rx) = mpsc::channel(batch_size * 2);
                    let (consumer, pool, topic) =
                        (consumer.clone(), pool.clone(), message.topic().to_owned());
                    tokio::spawn(baseline_worker(
                        rx, consumer, pool, topic, partition, batch_size,
                    ));
                    tx
                });
                let _ = sender.send((message.offset(), work.n)).await;
            }
        })
    };
    let result = throughput(pool, "bench_baseline", count, progress).await;
    stop.cancel();
    let _ = dispatcher.await;
    let _ = consumer.commit_consumer_state(CommitMode::Sync);
    result
}

async fn baseline_worker(
    mut rx: mpsc::Receiver<(i64, i64)>,
    consumer: Arc<StreamConsumer>,
    pool: PgPool,
    topic: String,
    partition: i32,
    batch_size: usize,
) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < batch_size {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        loop {
            let ns: Vec<i64> = batch.iter().map(|(_, n)| *n).collect();
            let attempt: Result<(), sqlx::Error> = async {
                let mut tx = pool.begin().await?;
                insert_batch(&mut tx, "bench_baseline", &ns).await?;
                tx.commit().await
            }
            .await;
            if attempt.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let last = batch.last().map_or(0, |(offset, _)| *offset);
        let _ = consumer.store_offset(&topic, partition, last);
    }
}
