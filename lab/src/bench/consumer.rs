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
use saga_consumer::{
    BatchContext, Message, SagaConsumer, SagaEvent, SagaStep, StepContext, StepError, StepName,
    StepOutcome, StepResult, Subscription, Topic,
};
use saga_runtime::kafka::KafkaConfig;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::bench::{Progress, rate};

/// The benchmark's message.
#[derive(Debug, Clone, Serialize, Deserialize, SagaEvent)]
pub struct Work {
    /// Its number.
    pub n: i64,
}

/// What the measured step emits for each message.
#[derive(Debug, Clone, Serialize, Deserialize, SagaEvent)]
pub struct WorkDone {
    /// The message's number.
    pub n: i64,
}

/// The measured step: one INSERT and one emitted event.
#[derive(Debug)]
pub struct RecordWork {
    /// `record-work`, or `record-work-{round}` for a later round over the same messages (its step keys are
    /// new again).
    pub name: StepName,
    /// The consumed topic.
    pub work: Topic<Work>,
    /// Where it emits: `{topic}.done`.
    pub done: Topic<WorkDone>,
}

impl RecordWork {
    /// The step consuming `topic`.
    pub fn on(topic: &str) -> Self {
        Self::in_round(topic, 0)
    }

    /// The step consuming `topic` in round `round` of a measurement that reads the same messages again.
    pub fn in_round(topic: &str, round: usize) -> Self {
        Self {
            name: if round == 0 {
                StepName::from_static("record-work")
            } else {
                StepName::new(&format!("record-work-{round}")).expect("a valid step name")
            },
            work: Topic::new(topic),
            done: Topic::new(format!("{topic}.done")),
        }
    }
}

impl SagaStep for RecordWork {
    type Payload = Work;

    fn name(&self) -> StepName {
        self.name.clone()
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        Subscription::to(&self.work)
    }

    async fn handle(&self, msg: &Message<Work>, ctx: &mut StepContext<'_>) -> StepResult {
        let n = msg.payload().n;
        sqlx::query("INSERT INTO bench_effects (n) VALUES ($1)")
            .bind(n)
            .execute(ctx.conn())
            .await?;
        ctx.emit(&self.done, n.to_string(), &WorkDone { n })?;
        Ok(StepOutcome::completed())
    }

    async fn handle_batch(
        &self,
        msgs: &[&Message<Work>],
        ctx: &mut BatchContext<'_>,
    ) -> Result<Vec<StepOutcome>, StepError> {
        let ns: Vec<i64> = msgs.iter().map(|m| m.payload().n).collect();
        insert_batch(ctx.conn(), "bench_effects", &ns).await?;
        for (msg, n) in msgs.iter().zip(ns) {
            ctx.emit(msg, &self.done, n.to_string(), &WorkDone { n })?;
        }
        Ok(vec![StepOutcome::completed(); msgs.len()])
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
        let headers = work_headers(&key);
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
    ensure_kept(kafka, topic).await
}

/// The headers of a [`Work`] message whose idempotency key (and event id) is `id`.
pub fn work_headers(id: &str) -> OwnedHeaders {
    OwnedHeaders::new()
        .insert(Header {
            key: "idempotency-key",
            value: Some(id),
        })
        .insert(Header {
            key: "ce_type",
            value: Some("Work"),
        })
        .insert(Header {
            key: "ce_id",
            value: Some(id),
        })
}

/// Fails when the broker no longer keeps the first messages of `topic` (a partition's low watermark is
/// above 0), as librdkafka's mock cluster does past 5 MiB per partition: a run would otherwise wait for
/// messages nobody can read.
pub async fn ensure_kept(kafka: &KafkaConfig, topic: &str) -> anyhow::Result<()> {
    let partitions = saga_runtime::kafka::watermarks(kafka, topic)
        .await?
        .unwrap_or_default();
    let dropped: i64 = partitions.iter().map(|w| w.low).sum();
    anyhow::ensure!(
        dropped == 0,
        "{topic}: the broker dropped the first {dropped} messages before they were read (librdkafka's \
         mock cluster keeps at most 5 MiB per partition): use fewer --messages or more --partitions"
    );
    Ok(())
}

/// The framework's consumer of [`RecordWork`] (of `round`) over `topic`, in group `{topic}.{group}`.
pub fn measured_consumer(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topic: &str,
    group: &str,
    round: usize,
    batch_size: usize,
    concurrency: usize,
) -> saga_consumer::SagaConsumerBuilder {
    let builder = SagaConsumer::builder()
        .kafka(kafka.clone())
        .group_id(format!("{topic}.{group}"))
        .dlq_topic(format!("{topic}.dlq"))
        .retry_topic(format!("{topic}.retry"))
        .pool(pool.clone())
        .batch_size(batch_size)
        .concurrency(concurrency)
        .step(RecordWork::in_round(topic, round))
        .with_outbox(super::outbox());
    if super::hold_keys() {
        builder.order_policy_for_topic(topic, saga_consumer::OrderPolicy::HoldKey)
    } else {
        builder
    }
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
    super::wait_until_done(
        table,
        Duration::from_millis(500),
        super::STALL_LIMIT,
        || async {
            let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(count_sql.clone()))
                .fetch_one(pool)
                .await?;
            progress.note(&format!("{table}: {n}/{count}"));
            Ok(count - n)
        },
    )
    .await?;
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

/// Runs the framework's consumer over `topic` until it processed `count` messages. Round `round` reads the
/// topic from the start in a group of its own, with step keys of its own, into an emptied `bench_effects`.
#[allow(clippy::too_many_arguments)]
pub async fn framework(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topic: &str,
    round: usize,
    count: i64,
    batch_size: usize,
    concurrency: usize,
    progress: &Progress,
) -> anyhow::Result<FrameworkRun> {
    sqlx::query("TRUNCATE bench_effects").execute(pool).await?;
    let group = format!("framework{round}");
    let consumer =
        measured_consumer(kafka, pool, topic, &group, round, batch_size, concurrency).build()?;
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
/// with one multi-row statement per table, on `connections` connections at once, with the statements
/// `kind` names. Run after [`framework`], whose rows it copies the shape of; `round` numbers the call
/// (each writes keys of its own). Returns messages/s. [`Ceiling::PLAIN`] is the ceiling the consumer is
/// measured against; a single round varies by ±30%, so callers take the median of [`CEILING_ROUNDS`],
/// running the ceilings they compare in turns.
pub async fn sql_ceiling(
    pool: &PgPool,
    kind: Ceiling,
    round: usize,
    count: i64,
    batch_size: usize,
    connections: usize,
) -> anyhow::Result<f64> {
    let (topic, headers) = emitted_sample(pool).await?;
    let outcome: Option<serde_json::Value> = sqlx::query_scalar(
        "SELECT outcome FROM saga_idempotency_keys WHERE step_key LIKE '%:record-work' LIMIT 1",
    )
    .fetch_one(pool)
    .await?;
    let rows = Arc::new(CeilingRows {
        topic,
        headers,
        outcome,
    });
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_ceiling \
         (n BIGINT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(pool)
    .await?;
    let connections = connections.max(1);
    let batch = i64::try_from(batch_size.max(1))?;
    let started = std::time::Instant::now();
    let workers: Vec<_> = (0..connections)
        .map(|worker| {
            let (pool, rows) = (pool.clone(), rows.clone());
            let worker = i64::try_from(worker).unwrap_or_default();
            let stride = i64::try_from(connections).unwrap_or(1);
            tokio::spawn(async move {
                let mut conn = pool.acquire().await?;
                let mut first = worker * batch;
                while first < count {
                    let ns: Vec<i64> = (first..(first + batch).min(count)).collect();
                    CeilingBatch {
                        kind,
                        round,
                        worker,
                        ns: &ns,
                    }
                    .write(&pool, &mut conn, &rows)
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
    Ok(rate(count, started.elapsed().as_secs_f64()))
}

/// Rounds of each SQL ceiling; its figure is their median.
pub const CEILING_ROUNDS: usize = 3;

/// The topic and headers of an event the measured step emitted, for the ceiling's rows: the first row of
/// the table outbox or, in WAL mode, the first outbox message in the schema's slot (peeked, not consumed).
async fn emitted_sample(pool: &PgPool) -> anyhow::Result<(String, Vec<(String, String)>)> {
    use saga_runtime::store::wal;
    if super::outbox().mode() == saga_consumer::OutboxMode::Table {
        let (topic, headers): (String, Vec<String>) =
            sqlx::query_as("SELECT topic, headers FROM saga_outbox ORDER BY id LIMIT 1")
                .fetch_one(pool)
                .await?;
        return Ok((
            topic,
            saga_runtime::store::outbox::headers_from_array(headers),
        ));
    }
    let (database, schema): (String, String) =
        sqlx::query_as("SELECT current_database()::text, current_schema()::text")
            .fetch_one(pool)
            .await?;
    // pgoutput's logical message: 'M', flags (1 byte), LSN (8), the prefix (NUL-terminated), the content's
    // length (4) and the content.
    let changes: Vec<Vec<u8>> = sqlx::query_scalar(
        "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, 64, 'proto_version', '1', \
         'publication_names', $2, 'messages', 'true')",
    )
    .bind(wal::slot_name(&database, &schema))
    .bind(wal::PUBLICATION)
    .fetch_all(pool)
    .await?;
    let prefix = wal::prefix(&schema);
    for data in changes {
        let Some(rest) = data.strip_prefix(b"M").and_then(|d| d.get(9..)) else {
            continue;
        };
        let Some(nul) = rest.iter().position(|b| *b == 0) else {
            continue;
        };
        if rest[..nul] != *prefix.as_bytes() {
            continue;
        }
        let content = rest.get(nul + 5..).unwrap_or_default();
        if let Some(event) = wal::decode(content)?.into_iter().next() {
            return Ok((event.topic, event.headers));
        }
    }
    anyhow::bail!("no outbox message of {schema} in its slot")
}

/// Which of the statements the framework's guarantees need [`sql_ceiling`] makes, beside the plain
/// multi-row `INSERT`s of the rows themselves. Each is called as the consumer calls it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ceiling {
    /// The crash-loop record of each batch (`saga_consumer_begin_batch`), on a pooled connection of its
    /// own beside the transaction, whose commit waits for it.
    pub crash_loop_record: bool,
    /// The step keys claimed as the consumer claims new keys (`claim_new_in_transaction`: sorted, so
    /// that concurrent claims lock in one order) instead of a plain `INSERT`.
    pub sorted_claim: bool,
    /// The outbox rows through `saga_outbox_append` (a lock per partition key, each row's headers as an
    /// array literal, a plpgsql function) instead of a plain `INSERT`.
    pub outbox_append: bool,
}

impl Ceiling {
    /// The rows alone, as cheaply as PostgreSQL takes them: the yardstick.
    pub const PLAIN: Self = Self {
        crash_loop_record: false,
        sorted_claim: false,
        outbox_append: false,
    };
    /// Every statement the guarantees need, and nothing else: what is left between this and the consumer
    /// is the runtime and Kafka.
    pub const WITH_GUARANTEES: Self = Self {
        crash_loop_record: true,
        sorted_claim: true,
        outbox_append: true,
    };
    /// From [`Ceiling::PLAIN`] to [`Ceiling::WITH_GUARANTEES`], one statement added at a time.
    pub const STEPS: [Self; 4] = [
        Self::PLAIN,
        Self {
            crash_loop_record: true,
            ..Self::PLAIN
        },
        Self {
            outbox_append: false,
            ..Self::WITH_GUARANTEES
        },
        Self::WITH_GUARANTEES,
    ];

    /// A short name for the JSON report.
    pub fn id(&self) -> String {
        let mut id = String::from("plain");
        for (on, part) in [
            (self.crash_loop_record, "+crash_loop_record"),
            (self.sorted_claim, "+sorted_claim"),
            (
                self.outbox_append,
                if super::outbox().mode() == saga_consumer::OutboxMode::Wal {
                    "+outbox_wal_emit"
                } else {
                    "+outbox_append"
                },
            ),
        ] {
            if on {
                id.push_str(part);
            }
        }
        id
    }
}

impl std::fmt::Display for Ceiling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Self::PLAIN => f.write_str("SQL ceiling"),
            Self::WITH_GUARANTEES => f.write_str("SQL with the guarantees"),
            _ => write!(f, "SQL ceiling {}", self.id()),
        }
    }
}

/// What every batch of a ceiling writes the same way.
struct CeilingRows {
    topic: String,
    headers: Vec<(String, String)>,
    outcome: Option<serde_json::Value>,
}

/// One transaction of a ceiling: the three rows of each message in `ns`.
struct CeilingBatch<'a> {
    kind: Ceiling,
    round: usize,
    /// The connection's number, the batch's partition in the crash-loop record.
    worker: i64,
    ns: &'a [i64],
}

impl CeilingBatch<'_> {
    async fn write(
        &self,
        pool: &PgPool,
        conn: &mut sqlx::PgConnection,
        rows: &CeilingRows,
    ) -> anyhow::Result<()> {
        let Self {
            kind, round, ns, ..
        } = *self;
        let record = kind
            .crash_loop_record
            .then(|| self.record_start(pool.clone()));
        // Keys differ between ceilings and rounds: every claim is of new keys.
        let prefix = format!("ceiling-{}-{round}", kind.id());
        let keys: Vec<String> = ns.iter().map(|n| format!("{prefix}-{n}")).collect();
        let mut tx = sqlx::Connection::begin(conn).await?;
        if kind.sorted_claim {
            let tenant = saga_core::TenantId::default();
            let step = StepName::from_static("record-work");
            let claims = keys
                .iter()
                .map(|k| {
                    Ok((
                        tenant.clone(),
                        saga_core::IdempotencyKey::new(k)?.step_key(&step),
                    ))
                })
                .collect::<Result<Vec<_>, saga_core::KeyError>>()?;
            let claimed =
                saga_runtime::store::idempotency::claim_new_in_transaction(&mut tx, &claims)
                    .await?;
            anyhow::ensure!(
                claimed == saga_runtime::store::idempotency::NewClaims::Claimed,
                "a ceiling claims new keys only"
            );
        } else {
            let step_keys: Vec<String> = keys.iter().map(|k| format!("{k}:record-work")).collect();
            sqlx::query(
                "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status, outcome) \
                 SELECT 'default', k, 'completed', $2 FROM unnest($1::text[]) AS k",
            )
            .bind(&step_keys)
            .bind(rows.outcome.as_ref())
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query("INSERT INTO bench_ceiling (n) SELECT * FROM unnest($1::bigint[])")
            .bind(ns)
            .execute(&mut *tx)
            .await?;
        let payloads: Vec<Vec<u8>> = ns
            .iter()
            .map(|n| serde_json::to_vec(&Work { n: *n }).unwrap_or_default())
            .collect();
        if kind.outbox_append {
            let tenant = saga_core::TenantId::default();
            let messages: Vec<saga_core::OutboxMessage> = keys
                .into_iter()
                .zip(payloads)
                .map(|(key, payload)| saga_core::OutboxMessage {
                    tenant: tenant.clone(),
                    topic: rows.topic.clone(),
                    partition_key: Some(key),
                    headers: rows
                        .headers
                        .iter()
                        .map(|(n, v)| (n.clone().into(), v.clone().into()))
                        .collect(),
                    payload,
                })
                .collect();
            super::outbox().append(&mut tx, &messages).await?;
        } else {
            let flat: Vec<&str> = rows
                .headers
                .iter()
                .flat_map(|(name, value)| [name.as_str(), value.as_str()])
                .collect();
            sqlx::query(
                "INSERT INTO saga_outbox (tenant_id, topic, partition_key, headers, payload) \
                 SELECT 'default', $1, k, $2, p FROM unnest($3::text[], $4::bytea[]) AS t (k, p)",
            )
            .bind(&rows.topic)
            .bind(&flat)
            .bind(&keys)
            .bind(&payloads)
            .execute(&mut *tx)
            .await?;
        }
        if let Some(record) = record {
            record.await??;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Records the batch's start for crash-loop detection as the consumer does, in a task of its own on a
    /// connection of its own.
    fn record_start(
        &self,
        pool: PgPool,
    ) -> tokio::task::JoinHandle<Result<sqlx::postgres::PgRow, sqlx::Error>> {
        let group = format!("ceiling-{}-{}", self.kind.id(), self.round);
        let partition = i32::try_from(self.worker).unwrap_or_default();
        let (first, last) = (self.ns[0], self.ns[self.ns.len() - 1]);
        tokio::spawn(async move {
            let mut conn = pool.acquire().await?;
            sqlx::query("SELECT isolate, deaths FROM saga_consumer_begin_batch($1, $2, $3, $4, $5)")
                .bind(group)
                .bind("bench_ceiling")
                .bind(partition)
                .bind(first)
                .bind(last)
                .fetch_one(&mut *conn)
                .await
        })
    }
}

/// Consumes `count` messages of `topic` (in a group of its own, from the start) and does nothing with them
/// but decode each payload and store its offset, then commits the offsets: what reading its messages from
/// Kafka costs any consumer. Returns messages/s.
pub async fn consume_only(
    kafka: &KafkaConfig,
    topic: &str,
    count: i64,
    progress: &Progress,
) -> anyhow::Result<f64> {
    let consumer: StreamConsumer = saga_runtime::kafka::client_config(kafka)
        .set("group.id", format!("{topic}.consume-only"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "true")
        .set("enable.auto.offset.store", "false")
        .set("fetch.wait.max.ms", "100")
        .create()?;
    consumer.subscribe(&[topic])?;
    let mut started = None;
    let mut seen = 0i64;
    let mut sum = 0i64;
    while seen < count {
        let message = consumer.recv().await?;
        started.get_or_insert_with(std::time::Instant::now);
        let work: Work = serde_json::from_slice(message.payload().unwrap_or_default())?;
        sum = sum.wrapping_add(work.n);
        consumer.store_offset_from_message(&message)?;
        seen += 1;
    }
    consumer.commit_consumer_state(CommitMode::Sync)?;
    let seconds = started.map_or(0.0, |s| s.elapsed().as_secs_f64());
    progress.note(&format!(
        "consumed {seen} messages without processing them (sum of n {sum})"
    ));
    Ok(rate(count, seconds))
}
