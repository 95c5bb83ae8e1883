//! Scale-out: the framework's consumer in 1, 2 and 4 processes of one group, one key of a partition at a
//! time and with keys in parallel ([`KEY_CONCURRENCY`]), and the relay as one and as two instances on one
//! outbox.

use std::time::Duration;

use saga_runtime::kafka::{KafkaConfig, ensure_topics};
use sqlx::PgPool;

use crate::bench::otel::Tracing;
use crate::bench::{Progress, consumer};

/// The key concurrency of the scale-out runs with keys in parallel within a partition.
pub const KEY_CONCURRENCY: usize = 16;

/// The hidden `saga-bench` argument that makes a process one consumer of a measured run ([`Worker`]).
pub const WORKER_ARG: &str = "--scale-worker";

/// One consumer process of a measured run (scale-out, tracing): the measured consumer of `topic` in the
/// schema `schema`, until killed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Worker {
    /// The topic consumed.
    pub topic: String,
    /// The schema written to.
    pub schema: String,
    /// Messages per transaction, at most.
    pub batch_size: usize,
    /// The consumer group, `{topic}.{group}`.
    pub group: String,
    /// Partitions worked on at once.
    pub concurrency: usize,
    /// Keys of a partition run at once (`SAGA_KEY_CONCURRENCY`).
    pub key_concurrency: usize,
    /// Whether and how the process traces with OpenTelemetry.
    pub tracing: Tracing,
}

impl Worker {
    /// The value of [`WORKER_ARG`]: `topic|schema|batch size|group|concurrency|key concurrency|tracing`.
    pub fn arg(&self) -> String {
        format!(
            "{}|{}|{}|{}|{}|{}|{}",
            self.topic,
            self.schema,
            self.batch_size,
            self.group,
            self.concurrency,
            self.key_concurrency,
            self.tracing.as_str()
        )
    }

    /// Reads [`Worker::arg`] back.
    pub fn parse(arg: &str) -> anyhow::Result<Self> {
        let [
            topic,
            schema,
            batch_size,
            group,
            concurrency,
            key_concurrency,
            tracing,
        ] = arg.split('|').collect::<Vec<_>>()[..]
        else {
            anyhow::bail!(
                "{WORKER_ARG}: expected topic|schema|batch size|group|concurrency|key concurrency|tracing, \
                 got {arg:?}"
            );
        };
        Ok(Self {
            topic: topic.to_owned(),
            schema: schema.to_owned(),
            batch_size: batch_size.parse()?,
            group: group.to_owned(),
            concurrency: concurrency.parse()?,
            key_concurrency: key_concurrency.parse()?,
            tracing: Tracing::parse(tracing)?,
        })
    }

    /// Messages/s of `processes` processes of this worker (child processes of `saga-bench`), over the
    /// `count` messages that `pool` (this worker's schema) holds in `bench_effects` when they are done.
    /// The processes are stopped before it returns.
    pub async fn throughput(
        &self,
        processes: usize,
        kafka: &KafkaConfig,
        database_url: &str,
        pool: &PgPool,
        count: i64,
        progress: &Progress,
    ) -> anyhow::Result<f64> {
        let exe = std::env::current_exe()?;
        let children = (0..processes)
            .map(|_| {
                tokio::process::Command::new(&exe)
                    .arg(WORKER_ARG)
                    .arg(self.arg())
                    .arg("--brokers")
                    .arg(&kafka.brokers)
                    .arg("--database-url")
                    .arg(database_url)
                    .kill_on_drop(true)
                    .spawn()
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        let measured = consumer::throughput(pool, "bench_effects", count, progress).await;
        for mut child in children {
            let _ = child.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
        }
        measured
    }

    /// Runs the consumer (in the worker process).
    pub async fn run(&self, kafka: &KafkaConfig, database_url: &str) -> anyhow::Result<()> {
        let pool = saga_runtime::config::connect_postgres(
            "DATABASE_URL",
            database_url,
            Some(&self.schema),
            8,
        )
        .await?;
        let consumer = consumer::measured_consumer(
            kafka,
            &pool,
            &self.topic,
            &self.group,
            0,
            self.batch_size,
            self.concurrency,
        )
        .key_concurrency(self.key_concurrency)
        .build()?;
        consumer.run(saga_consumer::shutdown_signal()).await?;
        Ok(())
    }
}

/// How one setting of a scale-out run went.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ScaleStep {
    /// Consumer processes (or relay instances).
    pub instances: usize,
    /// Messages (or rows) per second.
    pub per_s: f64,
    /// `per_s` over the figure with one instance.
    pub ratio: f64,
}

/// Throughput of `messages` messages (each of its own key) over a fresh topic of `partitions` partitions,
/// consumed by `n` processes in one group running `key_concurrency` keys of a partition at once, for each
/// `(n, schema, pool)` of `settings` (a fresh schema each).
#[allow(clippy::too_many_arguments)]
pub async fn consumers(
    kafka: &KafkaConfig,
    database_url: &str,
    topic_prefix: &str,
    settings: Vec<(usize, String, PgPool)>,
    messages: i64,
    partitions: i32,
    batch_size: usize,
    key_concurrency: usize,
    progress: &Progress,
) -> anyhow::Result<Vec<ScaleStep>> {
    let mut steps: Vec<ScaleStep> = Vec::new();
    for (n, schema, pool) in settings {
        let topic = format!("{topic_prefix}.scale{n}k{key_concurrency}");
        ensure_topics(
            kafka,
            &[
                &topic,
                &format!("{topic}.dlq"),
                &format!("{topic}.retry"),
                &format!("{topic}.done"),
            ],
            partitions,
            1,
        )
        .await?;
        progress.note(&format!(
            "scale-out: {n} consumer process(es), {key_concurrency} key(s) at once: producing {messages} messages"
        ));
        consumer::produce(kafka, &topic, messages, progress).await?;
        consumer::create_effects_table(&pool).await?;
        let worker = Worker {
            topic: topic.clone(),
            schema,
            batch_size,
            group: "framework".to_owned(),
            concurrency: 4,
            key_concurrency,
            tracing: Tracing::Off,
        };
        let per_s = worker
            .throughput(n, kafka, database_url, &pool, messages, progress)
            .await?;
        let one = steps.first().map_or(per_s, |s| s.per_s);
        progress.note(&format!(
            "scale-out: {n} consumer process(es), {key_concurrency} key(s) at once: {per_s:.0} msg/s"
        ));
        steps.push(ScaleStep {
            instances: n,
            per_s,
            ratio: per_s / one,
        });
    }
    Ok(steps)
}
