//! The operators' toolkit at scale: a dead-letter topic of many letters, the inspector (`saga inspect`, a
//! process of its own) answering its failure groups, its metrics and a saga's trace from the dead-letter
//! index, and how much memory it used; then the same after the index was emptied, so that the inspector
//! indexes the whole topic itself. Beside the letters, the schema's outbox holds a million events and its key
//! store the step keys of a hundred thousand sagas, so that a trace finds one saga among them; and a bulk
//! discard of 50,000 letters of 1 MB each (compressed on the broker, lz4) measures what a discard holds in memory.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use saga_consumer::admin::letters::{self, IndexedLetter};
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
    /// Events in the outbox while the trace was timed.
    pub outbox_rows: i64,
    /// Step keys in the key store while the trace was timed.
    pub step_keys: i64,
    /// The service schemas of the database while the trace was timed (it reads each of them).
    pub service_schemas: usize,
    /// Letters of the discarded failure group.
    pub discard_letters: i64,
    /// The size of each of their payloads, in bytes.
    pub discard_letter_bytes: usize,
    /// `saga dlq discard --group G --yes`, from its start to its exit, in seconds.
    pub discard_secs: f64,
    /// Its peak resident memory, in MiB.
    pub discard_peak_mib: f64,
}

/// Events in the outbox of the section's schema.
const OUTBOX_ROWS: i64 = 1_000_000;
/// Sagas whose step keys (two each) are in the key store.
const SAGAS: i64 = 100_000;
/// Letters of the discarded group.
const DISCARD_LETTERS: i64 = 50_000;
/// The payload of each of them.
const DISCARD_LETTER_BYTES: usize = 1_000_000;

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
    progress.note(&format!(
        "dlq-index: {OUTBOX_ROWS} outbox events and the step keys of {SAGAS} sagas"
    ));
    let (outbox_rows, step_keys) = fill_store(&pool).await?;

    let mut figures = DlqFigures {
        letters: letters_wanted,
        outbox_rows,
        step_keys,
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
        figures.service_schemas = saga_admin::trace::service_schemas(&pool).await?.len();
        // What is timed is a trace that finds the saga in the section's schema (the database may hold
        // others): its two step keys, its ten events, its letter, nothing of it unread or cut.
        let trace = inspector.get("/api/trace?key=order-777").await?;
        let events = trace["events"]
            .as_array()
            .map_or(0, |e| e.iter().filter(|e| e["lane"] == schema).count());
        let said = |list: &str| {
            trace[list].as_array().is_some_and(|l| {
                l.iter().any(|s| {
                    s.as_str()
                        .is_some_and(|s| s.starts_with(&format!("{schema}:")))
                })
            })
        };
        anyhow::ensure!(
            events == 13 && !said("unread") && !said("cut"),
            "the trace of order-777 holds {events} events in {schema} (expected 13: two step keys, ten \
             events emitted, one dead letter), or says it is incomplete: {trace}"
        );
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
    discard_large(
        kafka,
        &pool,
        &saga,
        &env,
        &format!("{dlq_topic}.large"),
        &mut figures,
        progress,
    )
    .await?;
    progress.note(&format!(
        "dlq-index: /groups {:.1} ms, /metrics {:.1} ms, /trace {:.1} ms, saga trace {:.1} ms, \
         inspector peak {:.1} MiB; indexing the topic {:.1} s, peak {:.1} MiB; discarding {} letters of {} \
         bytes {:.1} s, peak {:.1} MiB",
        figures.groups_ms,
        figures.metrics_ms,
        figures.trace_ms,
        figures.cli_trace_ms,
        figures.inspector_peak_mib,
        figures.reindex_secs,
        figures.reindex_peak_mib,
        figures.discard_letters,
        figures.discard_letter_bytes,
        figures.discard_secs,
        figures.discard_peak_mib
    ));
    Ok(figures)
}

/// Fills the outbox with [`OUTBOX_ROWS`] published events of [`SAGAS`] sagas (ten each, their
/// `idempotency-key` header the saga's key) and the key store with two step keys per saga; returns the
/// counts.
async fn fill_store(pool: &PgPool) -> anyhow::Result<(i64, i64)> {
    sqlx::query(
        "INSERT INTO saga_outbox (tenant_id, topic, partition_key, headers, payload, published_at) \
         SELECT 'default', 'orders', 'order-' || (n % $2), \
                ARRAY['ce_type', 'OrderCreated', 'ce_source', 'create-order', 'tenant-id', 'default', \
                      'idempotency-key', 'order-' || (n % $2)], \
                '{\"amount_cents\":1999}'::bytea, now() \
         FROM generate_series(1, $1) AS n",
    )
    .bind(OUTBOX_ROWS)
    .bind(SAGAS)
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status) \
         SELECT 'default', 'order-' || n || ':' || step, 'completed' \
         FROM generate_series(0, $1 - 1) AS n, unnest(ARRAY['process-payment', 'arrange-shipment']) AS step",
    )
    .bind(SAGAS)
    .execute(pool)
    .await?;
    sqlx::query("ANALYZE saga_outbox, saga_idempotency_keys")
        .execute(pool)
        .await?;
    let counts: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM saga_outbox), (SELECT count(*) FROM saga_idempotency_keys)",
    )
    .fetch_one(pool)
    .await?;
    Ok(counts)
}

/// [`DISCARD_LETTERS`] letters of [`DISCARD_LETTER_BYTES`] each, of one cause, on `dlq_topic` (created
/// here; lz4-compressed on the broker, which keeps the run's disk small), then `saga dlq discard --group G
/// --yes`: how long it takes and its peak memory.
async fn discard_large(
    kafka: &KafkaConfig,
    pool: &PgPool,
    saga: &PathBuf,
    env: &[(&str, &str)],
    dlq_topic: &str,
    figures: &mut DlqFigures,
    progress: &Progress,
) -> anyhow::Result<()> {
    let group = format!("{dlq_topic}-group");
    sqlx::query(
        "INSERT INTO saga_consumer_groups (group_id, dlq_topic, retry_topic, topics) \
         VALUES ($1, $2, $3, ARRAY['orders']) ON CONFLICT DO NOTHING",
    )
    .bind(&group)
    .bind(dlq_topic)
    .bind(format!("{group}.retry"))
    .execute(pool)
    .await?;
    ensure_topics(kafka, &[dlq_topic], 1, 1).await?;
    progress.note(&format!(
        "dlq-index: {DISCARD_LETTERS} letters of {DISCARD_LETTER_BYTES} bytes, to be discarded"
    ));
    let letters = Letters {
        dlq_topic,
        group: &group,
        causes: 1,
        payload_bytes: DISCARD_LETTER_BYTES,
    };
    letters.write(kafka, pool, DISCARD_LETTERS).await?;
    let groups: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT failure_group FROM saga_dead_letters WHERE dlq_topic = $1",
    )
    .bind(dlq_topic)
    .fetch_all(pool)
    .await?;
    let [failure_group] = groups.as_slice() else {
        anyhow::bail!("expected one failure group on {dlq_topic}, found {groups:?}");
    };
    let started = Instant::now();
    let mut child = tokio::process::Command::new(saga)
        .args([
            "dlq",
            "discard",
            "--group",
            failure_group,
            "--topic",
            dlq_topic,
            "--yes",
            "--reason",
            "bench",
        ])
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        // Said where the run's lines go (a pipe nobody reads would block it).
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true)
        .spawn()?;
    let pid = child
        .id()
        .ok_or_else(|| anyhow::anyhow!("the discard exited at once"))?;
    let mut peak = 0.0_f64;
    let status = loop {
        if let Ok(kib) = peak_kib(pid) {
            peak = peak.max(kib / 1024.0);
        }
        match tokio::time::timeout(Duration::from_millis(50), child.wait()).await {
            Ok(status) => break status?,
            Err(_) if started.elapsed() > Duration::from_secs(600) => {
                anyhow::bail!("saga dlq discard did not finish within 10 minutes")
            }
            Err(_) => {}
        }
    };
    anyhow::ensure!(status.success(), "saga dlq discard failed ({status})");
    figures.discard_secs = started.elapsed().as_secs_f64();
    figures.discard_peak_mib = peak;
    figures.discard_letters = DISCARD_LETTERS;
    figures.discard_letter_bytes = DISCARD_LETTER_BYTES;
    let discarded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM saga_dlq_discards WHERE dlq_topic = $1 AND undone_at IS NULL",
    )
    .bind(dlq_topic)
    .fetch_one(pool)
    .await?;
    anyhow::ensure!(
        discarded == DISCARD_LETTERS,
        "the discard resolved {discarded} of {DISCARD_LETTERS} letters"
    );
    Ok(())
}

/// The peak resident memory of process `pid` so far, in KiB (`VmHWM`).
fn peak_kib(pid: u32) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmHWM for process {pid}"))
}

/// Dead letters to write: of `group`, to `dlq_topic`, spread over `causes` causes, with payloads of
/// `payload_bytes` (at least a small JSON object).
struct Letters<'a> {
    dlq_topic: &'a str,
    group: &'a str,
    causes: i64,
    payload_bytes: usize,
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
    let letters = Letters {
        dlq_topic,
        group,
        causes: CAUSES,
        payload_bytes: 0,
    };
    letters.write(kafka, pool, n).await
}

impl Letters<'_> {
    /// The headers of letter `i`, as the consumer writes them.
    fn headers(&self, i: i64, failed_at: &str) -> Vec<(String, String)> {
        let cause = CAUSE_WORDS[usize::try_from(i % self.causes).unwrap_or_default()];
        [
            ("idempotency-key", format!("order-{i}")),
            ("ce_type", "OrderCreated".to_owned()),
            ("dlq-original-topic", "orders".to_owned()),
            ("dlq-original-partition", "0".to_owned()),
            ("dlq-original-offset", i.to_string()),
            ("dlq-consumer-group", self.group.to_owned()),
            ("dlq-step", "process-payment".to_owned()),
            ("dlq-reason", "handler-failed".to_owned()),
            ("dlq-error", format!("gateway {cause} refused charge {i}")),
            ("dlq-attempts", "3".to_owned()),
            ("dlq-failed-at", failed_at.to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// The payload of letter `i`: a JSON object, padded with spaces to `payload_bytes`.
    fn payload(&self, i: i64) -> Vec<u8> {
        let mut payload = format!("{{\"order_id\":{i},\"amount_cents\":1999}}").into_bytes();
        if payload.len() < self.payload_bytes {
            payload.resize(self.payload_bytes, b' ');
        }
        payload
    }

    /// Produces `n` of them and indexes each batch once the broker acknowledged it.
    async fn write(&self, kafka: &KafkaConfig, pool: &PgPool, n: i64) -> anyhow::Result<()> {
        // Large letters go compressed, in smaller batches.
        let batch = if self.payload_bytes > 100_000 {
            200
        } else {
            5_000
        };
        let producer: FutureProducer = saga_runtime::kafka::client_config(kafka)
            .set("linger.ms", "20")
            .set("batch.num.messages", "5000")
            .set("compression.type", "lz4")
            .set(
                "message.max.bytes",
                (self.payload_bytes + (1 << 20)).to_string(),
            )
            .create()?;
        let failed_at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let mut start = 0;
        while start < n {
            let end = (start + batch).min(n);
            let mut sends = Vec::new();
            let mut written = Vec::new();
            for i in start..end {
                let key = format!("order-{i}");
                let headers = self.headers(i, &failed_at);
                let payload = self.payload(i);
                let mut owned = OwnedHeaders::new_with_capacity(headers.len());
                for (k, v) in &headers {
                    owned = owned.insert(Header {
                        key: k,
                        value: Some(v.as_bytes()),
                    });
                }
                let record = FutureRecord::to(self.dlq_topic)
                    .key(key.as_bytes())
                    .payload(&payload)
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
                    self.dlq_topic,
                    (delivered.partition, delivered.offset),
                    Some(key.as_bytes()),
                    Some(&payload),
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
        Ok(peak_kib(pid)? / 1024.0)
    }
}

fn median_ms(mut times: Vec<Duration>) -> f64 {
    times.sort();
    times
        .get(times.len() / 2)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}
