//! Scale-out: the framework's consumer in 1, 2 and 4 processes of one group, and the relay as one and as
//! two instances on one outbox.

use std::time::Duration;

use saga_runtime::kafka::{KafkaConfig, ensure_topics};
use sqlx::PgPool;

use crate::bench::{Progress, consumer};

/// The hidden `saga-bench` argument that makes a process one consumer of a scale-out run.
pub const WORKER_ARG: &str = "--scale-worker";

/// One process of a scale-out run: the measured consumer of `topic` in the schema `schema`, until killed.
pub async fn worker(
    kafka: &KafkaConfig,
    database_url: &str,
    topic: &str,
    schema: &str,
    batch_size: usize,
) -> anyhow::Result<()> {
    let pool =
        saga_runtime::config::connect_postgres("DATABASE_URL", database_url, Some(schema), 8)
            .await?;
    let consumer =
        consumer::measured_consumer(kafka, &pool, topic, "framework", batch_size, 4).build()?;
    consumer.run(saga_consumer::shutdown_signal()).await?;
    Ok(())
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

/// Throughput of `messages` messages over a fresh topic of `partitions` partitions, consumed by `n`
/// processes in one group, for each `(n, schema, pool)` of `settings` (a fresh schema each).
#[allow(clippy::too_many_arguments)]
pub async fn consumers(
    kafka: &KafkaConfig,
    database_url: &str,
    topic_prefix: &str,
    settings: Vec<(usize, String, PgPool)>,
    messages: i64,
    partitions: i32,
    batch_size: usize,
    progress: &Progress,
) -> anyhow::Result<Vec<ScaleStep>> {
    let mut steps: Vec<ScaleStep> = Vec::new();
    for (n, schema, pool) in settings {
        let topic = format!("{topic_prefix}.scale{n}");
        ensure_topics(
            kafka,
            &[&topic, &format!("{topic}.dlq"), &format!("{topic}.done")],
            partitions,
            1,
        )
        .await?;
        progress.note(&format!(
            "scale-out: {n} consumer process(es): producing {messages} messages"
        ));
        consumer::produce(kafka, &topic, messages, progress).await?;
        consumer::create_effects_table(&pool).await?;
        let exe = std::env::current_exe()?;
        let mut children = Vec::new();
        for _ in 0..n {
            children.push(
                tokio::process::Command::new(&exe)
                    .arg(WORKER_ARG)
                    .arg(format!("{topic}|{schema}|{batch_size}"))
                    .arg("--brokers")
                    .arg(&kafka.brokers)
                    .arg("--database-url")
                    .arg(database_url)
                    .kill_on_drop(true)
                    .spawn()?,
            );
        }
        let measured = consumer::throughput(&pool, "bench_effects", messages, progress).await;
        for child in &mut children {
            let _ = child.start_kill();
        }
        for mut child in children {
            let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
        }
        let per_s = measured?;
        let one = steps.first().map_or(per_s, |s| s.per_s);
        progress.note(&format!(
            "scale-out: {n} consumer process(es): {per_s:.0} msg/s"
        ));
        steps.push(ScaleStep {
            instances: n,
            per_s,
            ratio: per_s / one,
        });
    }
    Ok(steps)
}
