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
    produce_keys(kafka, topic, count, count, None, progress).await
}

/// Produces `count` messages to `topic` whose idempotency keys repeat after `distinct` messages: with
/// `distinct` a tenth of `count`, nine messages in ten are duplicates of an earlier one (in the same
/// partition, as the key is also the Kafka key). Each message carries `traceparent`, if given.
pub async fn produce_keys(
    kafka: &KafkaConfig,
    topic: &str,
    count: i64,
    distinct: i64,
    traceparent: Option<&str>,
    progress: &Progress,
) -> anyhow::Result<()> {
    let producer = saga_runtime::kafka::idempotent_producer(
        kafka,
        Duration::from_millis(5),
        Duration::from_secs(120),
    )?;
    let mut pending = Vec::new();
    for n in 0..count {
        let key = format!("bench-{}", n % distinct.max(1));
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
        let headers = match traceparent {
            Some(value) => headers.insert(Header {
                key: "traceparent",
                value: Some(value),
            }),
            None => headers,
        };
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

/// The framework's consumer of [`RecordWork`] over `topic`, in group `{topic}.{group}`.
pub fn measured_consumer(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topic: &str,
    group: &str,
    batch_size: usize,
    concurrency: usize,
) -> saga_consumer::SagaConsumerBuilder {
    SagaConsumer::builder()
        .kafka(kafka.clone())
        .group_id(format!("{topic}.{group}"))
        .dlq_topic(format!("{topic}.dlq"))
        .pool(pool.clone())
        .batch_size(batch_size)
        .concurrency(concurrency)
        .step(RecordWork {
            topic: topic.to_owned(),
        })
}

/// Rows per second written to `table`, from the first row's to the last row's timestamp, once it has
/// `count` rows.
pub(crate) async fn throughput(
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

/// What a run of the framework's consumer measured.
#[derive(Debug, Clone, Serialize)]
pub struct FrameworkRun {
    /// Messages per second.
    pub msgs_per_s: f64,
    /// Messages per committed transaction, on average.
    pub messages_per_batch: f64,
    /// Where a partition worker's time went, milliseconds per committed batch, by phase
    /// (`saga_consumer_batch_phase_seconds`).
    pub batch_phases_ms: std::collections::BTreeMap<String, f64>,
}

/// Runs the framework's consumer over `topic` until it processed `count` messages.
pub async fn framework(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topic: &str,
    count: i64,
    batch_size: usize,
    concurrency: usize,
    progress: &Progress,
) -> anyhow::Result<FrameworkRun> {
    let consumer =
        measured_consumer(kafka, pool, topic, "framework", batch_size, concurrency).build()?;
    let ops = consumer.ops();
    let result = run_until(consumer, pool, count, progress).await;
    let value = |name: &str| ops.sample(name, "").unwrap_or(0.0);
    let (sum, transactions) = (
        value("saga_consumer_batch_size_sum"),
        value("saga_consumer_batch_size_count"),
    );
    let metrics = ops.render();
    let batches = transactions.max(1.0);
    let batch_phases_ms = metrics
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("saga_consumer_batch_phase_seconds_sum{phase=\"")?;
            let (phase, value) = rest.split_once("\"}")?;
            let seconds: f64 = value.trim().parse().ok()?;
            Some((phase.to_owned(), seconds * 1000.0 / batches))
        })
        .collect();
    let run = FrameworkRun {
        msgs_per_s: result?,
        messages_per_batch: sum / batches,
        batch_phases_ms,
    };
    progress.note(&format!(
        "framework: {transactions} transactions, {:.1} messages per transaction; ms per batch by phase: {}",
        run.messages_per_batch,
        run.batch_phases_ms
            .iter()
            .map(|(phase, ms)| format!("{phase} {ms:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    Ok(run)
}

/// Creates `bench_effects`, the table [`RecordWork`] writes.
pub async fn create_effects_table(pool: &PgPool) -> Result<(), sqlx::Error> {
    create_table(pool, "bench_effects").await
}

/// Creates `bench_baseline`, the table the baseline writes.
pub async fn create_baseline_table(pool: &PgPool) -> Result<(), sqlx::Error> {
    create_table(pool, "bench_baseline").await
}

async fn create_table(pool: &PgPool, table: &'static str) -> Result<(), sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {table} (n BIGINT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())"
    )))
    .execute(pool)
    .await?;
    Ok(())
}

/// Runs `consumer` until `bench_effects` in `pool` holds `count` rows; returns messages/s.
pub async fn run_until(
    consumer: SagaConsumer,
    pool: &PgPool,
    count: i64,
    progress: &Progress,
) -> anyhow::Result<f64> {
    let stop = CancellationToken::new();
    let running = tokio::spawn(consumer.run(stop.clone().cancelled_owned()));
    let result = throughput(pool, "bench_effects", count, progress).await;
    stop.cancel();
    running.await??;
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

/// The SQL the framework cannot avoid, with no Kafka at all: for `count` messages, the rows the framework
/// wrote for [`RecordWork`] in `pool`'s schema (a completed step key, the business row, an outbox row with
/// the same topic and headers as the framework's first one), in transactions of `batch_size` messages
/// with one multi-row statement per table, on `connections` connections at once. Run after
/// [`framework`], whose rows it copies the shape of. Returns messages/s, the median of
/// [`CEILING_ROUNDS`] rounds (one lasts about a second, and a single one varies by ±30%): the ceiling the
/// consumer is measured against.
pub async fn sql_ceiling(
    pool: &PgPool,
    count: i64,
    batch_size: usize,
    connections: usize,
    progress: &Progress,
) -> anyhow::Result<f64> {
    let (topic, headers): (String, Vec<String>) =
        sqlx::query_as("SELECT topic, headers FROM saga_outbox ORDER BY id LIMIT 1")
            .fetch_one(pool)
            .await?;
    let outcome: Option<serde_json::Value> = sqlx::query_scalar(
        "SELECT outcome FROM saga_idempotency_keys WHERE step_key LIKE '%:record-work' LIMIT 1",
    )
    .fetch_one(pool)
    .await?;
    sqlx::query(
        "CREATE TABLE bench_ceiling (n BIGINT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(pool)
    .await?;
    progress.note(&format!(
        "SQL ceiling: {count} messages, batches of {batch_size}, {connections} connections"
    ));
    let connections = connections.max(1);
    let batch = i64::try_from(batch_size.max(1))?;
    let mut rounds = Vec::with_capacity(CEILING_ROUNDS);
    for round in 0..CEILING_ROUNDS {
        let started = std::time::Instant::now();
        let workers: Vec<_> = (0..connections)
            .map(|worker| {
                let (pool, topic, headers, outcome) = (
                    pool.clone(),
                    topic.clone(),
                    headers.clone(),
                    outcome.clone(),
                );
                let worker = i64::try_from(worker).unwrap_or_default();
                let stride = i64::try_from(connections).unwrap_or(1);
                tokio::spawn(async move {
                    let mut conn = pool.acquire().await?;
                    let mut first = worker * batch;
                    while first < count {
                        let ns: Vec<i64> = (first..(first + batch).min(count)).collect();
                        write_ceiling_batch(
                            &mut conn,
                            round,
                            &ns,
                            &topic,
                            &headers,
                            outcome.as_ref(),
                        )
                        .await?;
                        first += stride * batch;
                    }
                    anyhow::Ok(())
                })
            })
            .collect();
        for worker in workers {
            worker.await??;
        }
        rounds.push(rate(count, started.elapsed().as_secs_f64()));
    }
    progress.note(&format!(
        "SQL ceiling rounds: {}",
        rounds
            .iter()
            .map(|r| format!("{r:.0} msg/s"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    Ok(crate::bench::percentile(&mut rounds, 0.5))
}

/// Rounds of the SQL ceiling; its figure is their median.
pub const CEILING_ROUNDS: usize = 3;

/// One transaction of the SQL ceiling: the three rows of each message in `ns`, one statement per table.
async fn write_ceiling_batch(
    conn: &mut sqlx::PgConnection,
    round: usize,
    ns: &[i64],
    topic: &str,
    headers: &[String],
    outcome: Option<&serde_json::Value>,
) -> Result<(), sqlx::Error> {
    let keys: Vec<String> = ns.iter().map(|n| format!("ceiling{round}-{n}")).collect();
    let step_keys: Vec<String> = keys.iter().map(|k| format!("{k}:record-work")).collect();
    let payloads: Vec<Vec<u8>> = ns
        .iter()
        .map(|n| serde_json::to_vec(&Work { n: *n }).unwrap_or_default())
        .collect();
    let mut tx = sqlx::Connection::begin(conn).await?;
    sqlx::query(
        "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status, outcome) \
         SELECT 'default', k, 'completed', $2 FROM unnest($1::text[]) AS k",
    )
    .bind(&step_keys)
    .bind(outcome)
    .execute(&mut *tx)
    .await?;
    sqlx::query("INSERT INTO bench_ceiling (n) SELECT * FROM unnest($1::bigint[])")
        .bind(ns)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO saga_outbox (tenant_id, topic, partition_key, headers, payload) \
         SELECT 'default', $1, k, $2, p FROM unnest($3::text[], $4::bytea[]) AS t (k, p)",
    )
    .bind(topic)
    .bind(headers)
    .bind(&keys)
    .bind(&payloads)
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}
