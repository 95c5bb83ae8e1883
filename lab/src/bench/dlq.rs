//! The operators' toolkit at scale: a dead-letter topic of many letters, the inspector (`saga inspect`, a
//! process of its own) answering its failure groups, its metrics and a saga's trace from the dead-letter
//! index, and how much memory it used; then the same after the index was emptied, so that the inspector
//! indexes the whole topic itself.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use saga_consumer::toolkit::letters::{self, IndexedLetter};
use saga_runtime::kafka::{KafkaConfig, ensure_topics};
use serde::Serialize;
use sqlx::PgPool;
use tokio::io::AsyncBufReadExt;

use crate::bench::Progress;
use crate::harness::client;

/// What the section measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DlqFigures {
    /// Letters on the dead-letter topic.
    pub letters: i64,
    /// Failure groups they fall into.
    pub groups: usize,
    /// `/groups` (the page), median of the timed requests, in milliseconds.
    pub groups_ms: f64,
    /// `/metrics`, median, in milliseconds.
    pub metrics_ms: f64,
    /// `/trace?key=…` (the page), median, in milliseconds.
    pub trace_ms: f64,
    /// `saga trace KEY`, the command from its start to its exit, median, in milliseconds.
    pub cli_trace_ms: f64,
    /// The inspector's peak resident memory over those requests, in MiB (`VmHWM`).
    pub inspector_peak_mib: f64,
    /// The first `/groups` after the index was emptied: the inspector indexes the whole topic, in seconds.
    pub reindex_secs: f64,
    /// The peak resident memory of an inspector that indexed the whole topic, in MiB.
    pub reindex_peak_mib: f64,
}

/// Letters per failure cause: the section's letters fall into this many groups.
const CAUSES: i64 = 20;
/// A word per cause (numbers would be normalised away: see `saga_admin::groups::normalise`).
const CAUSE_WORDS: [&str; 20] = [
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett",
    "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango",
];

/// The `saga` binary beside this one (`cargo build --release -p saga-admin` builds it).
fn saga_binary() -> anyhow::Result<PathBuf> {
    let path = std::env::current_exe()?
        .parent()
        .map(|d| d.join("saga"))
        .ok_or_else(|| anyhow::anyhow!("no directory for the saga binary"))?;
    anyhow::ensure!(
        path.exists(),
        "{} is missing: build it first (cargo build --release -p saga-admin)",
        path.display()
    );
    Ok(path)
}

/// Runs the section: `letters` letters of `dlq_topic` (created here) in `schema` (created here) of the
/// database at `database_url`.
pub async fn run(
    kafka: &KafkaConfig,
    database_url: &str,
    schema: &str,
    dlq_topic: &str,
    letters_wanted: i64,
    progress: &Progress,
) -> anyhow::Result<DlqFigures> {
    let saga = saga_binary()?;
    let pool =
        saga_runtime::config::connect_postgres("DATABASE_URL", database_url, None, 4).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA IF NOT EXISTS \"{schema}\""
    )))
    .execute(&pool)
    .await?;
    let pool =
        saga_runtime::config::connect_postgres("DATABASE_URL", database_url, Some(schema), 4)
            .await?;
    saga_consumer::migrate::migrate(&pool).await?;
    let group = format!("{dlq_topic}-group");
    sqlx::query(
        "INSERT INTO saga_consumer_groups (group_id, dlq_topic, retry_topic, topics) \
         VALUES ($1, $2, $3, ARRAY['orders']) ON CONFLICT DO NOTHING",
    )
    .bind(&group)
    .bind(dlq_topic)
    .bind(format!("{group}.retry"))
    .execute(&pool)
    .await?;
    ensure_topics(kafka, &[dlq_topic], 1, 1).await?;

    progress.note(&format!(
        "dlq-index: {letters_wanted} dead letters, produced and indexed as the consumer does"
    ));
    write_letters(kafka, &pool, dlq_topic, &group, letters_wanted).await?;

    let mut figures = DlqFigures {
        letters: letters_wanted,
        ..DlqFigures::default()
    };
    let env = [
        ("DATABASE_URL", database_url),
        ("SAGA_SCHEMA", schema),
        ("KAFKA_BROKERS", kafka.brokers.as_str()),
    ];
    // The inspector over the index the letters' consumer wrote.
    {
        let inspector = Inspector::start(&saga, &env, dlq_topic).await?;
        let groups = inspector.get("/api/groups").await?;
        figures.groups = groups.as_array().map_or(0, Vec::len);
        anyhow::ensure!(
            figures.groups == usize::try_from(CAUSES)?,
            "expected {CAUSES} failure groups, found {}",
            figures.groups
        );
        figures.groups_ms = inspector.median("/groups").await?;
        figures.metrics_ms = inspector.median("/metrics").await?;
        figures.trace_ms = inspector.median("/trace?key=order-777").await?;
        figures.inspector_peak_mib = inspector.peak_mib()?;
    }
    let mut cli = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        let output = tokio::process::Command::new(&saga)
            .args(["trace", "order-777"])
            .envs(env)
            .env("RUST_LOG", "warn")
            .output()
            .await?;
        anyhow::ensure!(
            output.status.success(),
            "saga trace failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        cli.push(started.elapsed());
    }
    figures.cli_trace_ms = median_ms(cli);

    // The index emptied: the inspector reads the whole topic once, in chunks.
    sqlx::query("DELETE FROM saga_dead_letters WHERE dlq_topic = $1")
        .bind(dlq_topic)
        .execute(&pool)
        .await?;
    sqlx::query("DELETE FROM saga_dead_letter_scans WHERE dlq_topic = $1")
        .bind(dlq_topic)
        .execute(&pool)
        .await?;
    progress.note("dlq-index: the index emptied, the inspector indexes the topic itself");
    {
        let inspector = Inspector::start(&saga, &env, dlq_topic).await?;
        let started = Instant::now();
        inspector.get("/api/groups").await?;
        figures.reindex_secs = started.elapsed().as_secs_f64();
        figures.reindex_peak_mib = inspector.peak_mib()?;
    }
    let indexed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM saga_dead_letters WHERE dlq_topic = $1")
            .bind(dlq_topic)
            .fetch_one(&pool)
            .await?;
    anyhow::ensure!(
        indexed == letters_wanted,
        "the inspector indexed {indexed} of {letters_wanted} letters"
    );
    progress.note(&format!(
        "dlq-index: /groups {:.1} ms, /metrics {:.1} ms, /trace {:.1} ms, saga trace {:.1} ms, \
         inspector peak {:.1} MiB; indexing the topic {:.1} s, peak {:.1} MiB",
        figures.groups_ms,
        figures.metrics_ms,
        figures.trace_ms,
        figures.cli_trace_ms,
        figures.inspector_peak_mib,
        figures.reindex_secs,
        figures.reindex_peak_mib
    ));
    Ok(figures)
}

/// Produces `n` dead letters of `group` to `dlq_topic`, headers as the consumer writes them, and indexes
/// each batch once the broker acknowledged it, as the consumer does.
async fn write_letters(
    kafka: &KafkaConfig,
    pool: &PgPool,
    dlq_topic: &str,
    group: &str,
    n: i64,
) -> anyhow::Result<()> {
    let producer: FutureProducer = saga_runtime::kafka::client_config(kafka)
        .set("linger.ms", "20")
        .set("batch.num.messages", "5000")
        .create()?;
    let failed_at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let mut start = 0;
    while start < n {
        let end = (start + 5_000).min(n);
        let mut sends = Vec::new();
        let mut written = Vec::new();
        for i in start..end {
            let key = format!("order-{i}");
            let headers: Vec<(String, String)> = [
                ("idempotency-key", key.clone()),
                ("ce_type", "OrderCreated".to_owned()),
                ("dlq-original-topic", "orders".to_owned()),
                ("dlq-original-partition", "0".to_owned()),
                ("dlq-original-offset", i.to_string()),
                ("dlq-consumer-group", group.to_owned()),
                ("dlq-step", "process-payment".to_owned()),
                ("dlq-reason", "handler-failed".to_owned()),
                (
                    "dlq-error",
                    format!(
                        "gateway {} refused charge {i}",
                        CAUSE_WORDS[usize::try_from(i % CAUSES).unwrap_or_default()]
                    ),
                ),
                ("dlq-attempts", "3".to_owned()),
                ("dlq-failed-at", failed_at.clone()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
            let payload = format!("{{\"order_id\":{i},\"amount_cents\":1999}}");
            let mut owned = OwnedHeaders::new_with_capacity(headers.len());
            for (k, v) in &headers {
                owned = owned.insert(Header {
                    key: k,
                    value: Some(v.as_bytes()),
                });
            }
            let record = FutureRecord::to(dlq_topic)
                .key(key.as_bytes())
                .payload(payload.as_bytes())
                .headers(owned);
            sends.push(producer.send_result(record).map_err(|(e, _)| e)?);
            written.push((key, payload, headers));
        }
        let mut indexed = Vec::with_capacity(sends.len());
        for (send, (key, payload, headers)) in sends.into_iter().zip(written) {
            let delivered = send
                .await?
                .map_err(|(e, _)| anyhow::anyhow!("producing a dead letter: {e}"))?;
            let pairs: Vec<letters::HeaderPair> = headers
                .into_iter()
                .map(|(k, v)| (k, Some(v.into_bytes())))
                .collect();
            indexed.push(IndexedLetter::of(
                dlq_topic,
                (delivered.partition, delivered.offset),
                Some(key.as_bytes()),
                Some(payload.as_bytes()),
                &pairs,
                None,
            ));
        }
        let mut conn = pool.acquire().await?;
        letters::index(&mut conn, &indexed).await?;
        start = end;
    }
    Ok(())
}

/// A `saga inspect` process.
struct Inspector {
    child: tokio::process::Child,
    addr: SocketAddr,
}

impl Inspector {
    async fn start(saga: &PathBuf, env: &[(&str, &str)], dlq_topic: &str) -> anyhow::Result<Self> {
        let mut child = tokio::process::Command::new(saga)
            .args([
                "inspect",
                "--listen",
                "127.0.0.1:0",
                "--dlq-topic",
                dlq_topic,
            ])
            .envs(env.iter().copied())
            .env("RUST_LOG", "warn")
            .env_remove("SAGA_ADMIN_TOKEN")
            .env_remove("SAGA_ADMIN_TOKENS")
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await??
            .unwrap_or_default();
        let addr = line
            .strip_prefix("inspector on http://")
            .and_then(|rest| rest.trim_end_matches('/').parse().ok())
            .ok_or_else(|| anyhow::anyhow!("the inspector said {line:?}"))?;
        Ok(Self { child, addr })
    }

    async fn get(&self, path: &str) -> anyhow::Result<serde_json::Value> {
        let answer = client::send(
            self.addr,
            "GET",
            path,
            &[("accept", "application/json")],
            None,
        )
        .await?;
        anyhow::ensure!(
            answer.status == 200,
            "{path}: {} {}",
            answer.status,
            answer.body
        );
        Ok(answer.body)
    }

    /// The median time of eleven `GET path` (the first is not counted), in milliseconds.
    async fn median(&self, path: &str) -> anyhow::Result<f64> {
        let mut times = Vec::new();
        for round in 0..11 {
            let started = Instant::now();
            let (status, _, _) = client::request(self.addr, "GET", path, &[], None).await?;
            anyhow::ensure!(status == 200, "{path}: {status}");
            if round > 0 {
                times.push(started.elapsed());
            }
        }
        Ok(median_ms(times))
    }

    /// The process's peak resident memory so far, in MiB.
    fn peak_mib(&self) -> anyhow::Result<f64> {
        let pid = self
            .child
            .id()
            .ok_or_else(|| anyhow::anyhow!("the inspector exited"))?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .ok_or_else(|| anyhow::anyhow!("no VmHWM for process {pid}"))?;
        Ok(kib / 1024.0)
    }
}

fn median_ms(mut times: Vec<Duration>) -> f64 {
    times.sort();
    times
        .get(times.len() / 2)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}
