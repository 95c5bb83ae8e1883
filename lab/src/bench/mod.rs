//! `saga-bench`: throughput and latency of the framework's parts on this machine, against the targets.
//! A program that prints figures (and writes `target/saga-bench.json`), not a test.

pub mod broker;
pub mod consumer;
pub mod cpu;
pub mod dlq;
pub mod http;
pub mod otel;
pub mod redis;
pub mod relay;
pub mod saga;
pub mod scale;
pub mod slow;
pub mod tls;

/// The outbox the benchmark's writers use now (the consumer's rounds, the ceilings, the HTTP layer's):
/// `saga-bench` sets it for each outbox mode it measures.
static OUTBOX: Mutex<Option<saga_consumer::Outbox>> = Mutex::new(None);

/// The outbox the benchmark's writers use now (a table outbox until [`set_outbox`]).
pub fn outbox() -> saga_consumer::Outbox {
    OUTBOX
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
        .unwrap_or_default()
}

/// Whether the measured consumer holds keys (`OrderPolicy::HoldKey` on its topic): `saga-bench --hold-keys`.
static HOLD_KEYS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the measured consumer holds keys (see [`set_hold_keys`]).
pub fn hold_keys() -> bool {
    HOLD_KEYS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Makes the measured consumer hold keys (each of its batches then reads its keys' holds) or not.
pub fn set_hold_keys(hold: bool) {
    HOLD_KEYS.store(hold, std::sync::atomic::Ordering::Relaxed);
}

/// Makes `outbox` the one the benchmark's writers use.
pub fn set_outbox(outbox: saga_consumer::Outbox) {
    *OUTBOX
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(outbox);
}

use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Serialize;

/// Progress lines with the time since the start, and the running section's deadline: a section that runs
/// past it ends the run, saying what the section last said it was doing.
#[derive(Debug)]
pub struct Progress {
    started: Instant,
    watch: std::sync::Arc<Mutex<Watch>>,
}

/// What the watchdog of a run checks.
#[derive(Debug, Default)]
struct Watch {
    /// The running section, when it started, and its deadline.
    section: Option<(String, Instant, Duration)>,
    /// What it last said it was doing.
    doing: String,
    /// Whether the watchdog's thread runs.
    watching: bool,
}

impl Default for Progress {
    fn default() -> Self {
        Self::new()
    }
}

impl Progress {
    /// Starts the clock.
    pub fn new() -> Self {
        Self {
            started: Instant::now(),
            watch: std::sync::Arc::default(),
        }
    }

    /// Prints `what` with the elapsed time; it is also what the running section is doing.
    pub fn note(&self, what: &str) {
        eprintln!("[{:>6.1}s] {what}", self.started.elapsed().as_secs_f64());
        self.doing(what);
    }

    /// Says what the running section waits for now (without printing it).
    pub fn doing(&self, what: &str) {
        lock(&self.watch).doing = what.to_owned();
    }

    /// Ends the running section's deadline.
    pub fn end_section(&self) {
        lock(&self.watch).section = None;
    }

    /// Starts section `name`, which must end within `limit`: past it, the run ends (exit code 1) with a
    /// line naming the section and what it was doing. Returns `true`, for `if section(..) && begin(..)`.
    pub fn begin_section(&self, name: &str, limit: Duration) -> bool {
        let mut watch = lock(&self.watch);
        watch.section = Some((name.to_owned(), Instant::now(), limit));
        watch.doing = "starting".to_owned();
        if !watch.watching {
            watch.watching = true;
            let shared = std::sync::Arc::clone(&self.watch);
            std::thread::spawn(move || watchdog(&shared));
        }
        true
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Ends the process once the running section of `watch` is past its deadline.
fn watchdog(watch: &Mutex<Watch>) {
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let w = lock(watch);
        if let Some((name, started, limit)) = &w.section
            && started.elapsed() > *limit
        {
            eprintln!(
                "saga-bench: section {name} did not end within {} s; it was: {}",
                limit.as_secs(),
                w.doing
            );
            std::process::exit(1);
        }
    }
}

/// How long a wait may see no progress before it gives up, so that a consumer or relay that stopped
/// moving fails the run with the count it reached instead of hanging it.
pub const STALL_LIMIT: Duration = Duration::from_secs(120);

/// Asks `left` every `every` how much of `what` is left to do, until nothing is; fails when the answer
/// stays the same for `stall_limit` ([`STALL_LIMIT`] in a run).
pub async fn wait_until_done<F, Fut>(
    what: &str,
    every: Duration,
    stall_limit: Duration,
    mut left: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<i64>>,
{
    let mut last = (left().await?, Instant::now());
    loop {
        if last.0 <= 0 {
            return Ok(());
        }
        tokio::time::sleep(every).await;
        let now = left().await?;
        if now != last.0 {
            last = (now, Instant::now());
        } else if last.1.elapsed() >= stall_limit {
            anyhow::bail!(
                "{what}: {now} left, unchanged for {:.0} s: the run stalled (see the log above)",
                stall_limit.as_secs_f64()
            );
        }
    }
}

/// `count` per `seconds`, guarding against a zero duration.
pub fn rate(count: i64, seconds: f64) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let count = count as f64;
    count / seconds.max(1e-9)
}

/// The `q` quantile (0 to 1) of `samples` (sorted in place), nearest-rank.
pub fn percentile(samples: &mut [f64], q: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    samples.sort_by(f64::total_cmp);
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss
    )]
    let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len());
    samples[rank - 1]
}

/// What a run measured; written to `target/saga-bench.json`.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    /// Whether the run reached its end: a run that stopped (a section failed or ran out of time) wrote
    /// the figures it had, and says so here (`scripts/bench-report` refuses to publish it as a run).
    pub complete: bool,
    /// Framework consumer (dedup + outbox), messages/s.
    pub consumer_msgs_per_s: Option<f64>,
    /// At-least-once baseline, messages/s.
    pub baseline_msgs_per_s: Option<f64>,
    /// consumer / baseline.
    pub consumer_vs_baseline_ratio: Option<f64>,
    /// The SQL the consumer must do (the same rows, batches and connections), without Kafka, messages/s.
    pub sql_ceiling_msgs_per_s: Option<f64>,
    /// consumer / SQL ceiling.
    pub consumer_vs_sql_ceiling_ratio: Option<f64>,
    /// The statements the framework's guarantees need (crash-loop record, sorted key claim, outbox append
    /// with per-key locks) for the same rows, without Kafka or the runtime, messages/s.
    pub sql_with_guarantees_msgs_per_s: Option<f64>,
    /// consumer / SQL with the guarantees: what the runtime and Kafka leave of it.
    pub consumer_vs_sql_with_guarantees_ratio: Option<f64>,
    /// Consuming the same messages from the broker and doing nothing with them, messages/s.
    pub kafka_consume_only_msgs_per_s: Option<f64>,
    /// The SQL ceilings from the plain rows to every statement the guarantees need, one statement added
    /// at a time: messages/s and CPU per message of each.
    pub sql_ceiling_steps: Option<serde_json::Value>,
    /// The consumer's run in detail: messages per batch, milliseconds per batch by phase.
    pub consumer_run: Option<consumer::FrameworkRun>,
    /// CPU per message of the consumer's run and of the SQL ceiling (machine, PostgreSQL, this process).
    pub consumer_cpu: Option<serde_json::Value>,
    /// Relay on a backlog, rows/s.
    pub relay_rows_per_s: Option<f64>,
    /// The relay's statements alone over the same backlog (no broker), rows/s.
    pub relay_sql_ceiling_rows_per_s: Option<f64>,
    /// Relay commit-to-ack p50 at the steady rate, ms.
    pub relay_commit_to_ack_p50_ms: Option<f64>,
    /// Relay commit-to-ack p99 at the steady rate, ms.
    pub relay_commit_to_ack_p99_ms: Option<f64>,
    /// HTTP layer's added p50 latency, ms.
    pub http_overhead_p50_ms: Option<f64>,
    /// HTTP layer's added p99 latency, ms.
    pub http_overhead_p99_ms: Option<f64>,
    /// With the layer, p50 and p99, ms.
    pub http_with_layer_ms: Option<(f64, f64)>,
    /// Without the layer, p50 and p99, ms.
    pub http_without_layer_ms: Option<(f64, f64)>,
    /// Saga end to end p50, ms.
    pub saga_e2e_p50_ms: Option<f64>,
    /// Saga end to end p99, ms.
    pub saga_e2e_p99_ms: Option<f64>,
    /// The saga's hops, each part's p50 and p99.
    pub saga_hops: Option<Vec<saga::Hop>>,
    /// Scale-out on the broker: the consumer in 1, 2 and 4 processes of one group.
    pub scale_consumers: Option<Vec<scale::ScaleStep>>,
    /// The same with keys in parallel within each partition (`SAGA_KEY_CONCURRENCY` =
    /// [`scale::KEY_CONCURRENCY`]).
    pub scale_consumers_keys_in_parallel: Option<Vec<scale::ScaleStep>>,
    /// Scale-out on the broker: the relay as one and as two instances on one outbox backlog.
    pub scale_relays: Option<Vec<scale::ScaleStep>>,
    /// The Redis fast path against PostgreSQL alone.
    pub redis: Option<redis::Figures>,
    /// The consumer with and without an OpenTelemetry layer sampling every span out.
    pub otel: Option<otel::Figures>,
    /// The broker alone: messages/s acknowledged from one idempotent producer, without headers.
    pub broker_produce_msgs_per_s: Option<f64>,
    /// The broker alone: the same with ten headers per message, as outbox events carry.
    pub broker_produce_with_headers_msgs_per_s: Option<f64>,
    /// The broker alone: p50 and p99 acknowledgement latency of single messages, ms.
    pub broker_ack_ms: Option<(f64, f64)>,
    /// The broker alone: from sending a message to a plain consumer receiving it, at 20 messages/s, p50
    /// and p99 in ms (what one hop of a saga spends in the broker cannot be less).
    pub broker_delivery_ms: Option<(f64, f64)>,
    /// The same with the consumer reading every partition of the topic and of a second topic where
    /// nothing is sent, as a service with steps on two topics does.
    pub broker_delivery_two_topics_ms: Option<(f64, f64)>,
    /// The consumer and relay figures again on librdkafka's in-process mock cluster: the framework's own
    /// cost, without this machine's broker (under `wal`, with the outbox on the write-ahead log).
    pub mock_broker: Option<serde_json::Value>,
    /// The relay and saga figures with the outbox on the write-ahead log (the top-level ones are the
    /// table's).
    pub wal: Option<serde_json::Value>,
    /// The consumer with its database connections over TLS against plaintext, on the mock cluster (the
    /// `consumer-tls` section).
    pub consumer_tls: Option<tls::TlsFigures>,
    /// The operators' toolkit over a dead-letter topic of many letters (the `dlq-index` section).
    pub dlq_index: Option<dlq::DlqFigures>,
    /// A slow two-phase step on one partition, one key at a time and keys in parallel, against the limit of
    /// the work (the `slow-steps` section, on the mock cluster).
    pub slow_steps: Option<slow::Figures>,
    /// The machine the figures were measured on.
    pub machine: Option<serde_json::Value>,
    /// The run's settings.
    pub settings: serde_json::Value,
}

impl Report {
    /// Prints the figures against the targets.
    pub fn print(&self) {
        let fmt = |v: Option<f64>, unit: &str| {
            v.map_or_else(|| "-".to_owned(), |v| format!("{v:.2} {unit}"))
        };
        let check = |v: Option<f64>, ok: fn(f64) -> bool| match v {
            Some(v) if ok(v) => "met",
            Some(_) => "MISSED",
            None => "-",
        };
        let rows = [
            (
                "consumer, dedup + outbox",
                fmt(self.consumer_msgs_per_s, "msg/s"),
                "≥ 25,000 msg/s",
                check(self.consumer_msgs_per_s, |v| v >= 25_000.0),
            ),
            (
                "consumer, at-least-once baseline",
                fmt(self.baseline_msgs_per_s, "msg/s"),
                "",
                "",
            ),
            (
                "consumer / baseline",
                fmt(self.consumer_vs_baseline_ratio, ""),
                "≥ 0.85",
                check(self.consumer_vs_baseline_ratio, |v| v >= 0.85),
            ),
            (
                "SQL ceiling (same rows, no Kafka)",
                fmt(self.sql_ceiling_msgs_per_s, "msg/s"),
                "",
                "",
            ),
            (
                "consumer / SQL ceiling",
                fmt(self.consumer_vs_sql_ceiling_ratio, ""),
                "≥ 0.8 (mock cluster)",
                check(self.consumer_vs_sql_ceiling_ratio, |v| v >= 0.8),
            ),
            (
                "SQL with the guarantees (no Kafka)",
                fmt(self.sql_with_guarantees_msgs_per_s, "msg/s"),
                "",
                "",
            ),
            (
                "consumer / SQL with the guarantees",
                fmt(self.consumer_vs_sql_with_guarantees_ratio, ""),
                "",
                "",
            ),
            (
                "Kafka consumption alone",
                fmt(self.kafka_consume_only_msgs_per_s, "msg/s"),
                "",
                "",
            ),
            (
                "consumer, database over TLS / plaintext (mock cluster)",
                fmt(self.consumer_tls.as_ref().map(|t| t.tls_vs_plain_ratio), ""),
                "≥ 0.85",
                check(
                    self.consumer_tls.as_ref().map(|t| t.tls_vs_plain_ratio),
                    |v| v >= 0.85,
                ),
            ),
            (
                "relay, 100k-row backlog",
                fmt(self.relay_rows_per_s, "rows/s"),
                "≥ 30,000 rows/s",
                check(self.relay_rows_per_s, |v| v >= 30_000.0),
            ),
            (
                "relay's SQL alone, same backlog",
                fmt(self.relay_sql_ceiling_rows_per_s, "rows/s"),
                "",
                "",
            ),
            (
                "relay commit→ack p50 at 1,000 rows/s",
                fmt(self.relay_commit_to_ack_p50_ms, "ms"),
                "",
                "",
            ),
            (
                "relay commit→ack p99 at 1,000 rows/s",
                fmt(self.relay_commit_to_ack_p99_ms, "ms"),
                "≤ 25 ms",
                check(self.relay_commit_to_ack_p99_ms, |v| v <= 25.0),
            ),
            (
                "HTTP layer added latency p50",
                fmt(self.http_overhead_p50_ms, "ms"),
                "",
                "",
            ),
            (
                "HTTP layer added latency p99",
                fmt(self.http_overhead_p99_ms, "ms"),
                "≤ 2 ms",
                check(self.http_overhead_p99_ms, |v| v <= 2.0),
            ),
            (
                "saga end to end p50",
                fmt(self.saga_e2e_p50_ms, "ms"),
                "",
                "",
            ),
            (
                "saga end to end p99 (20 orders/s)",
                fmt(self.saga_e2e_p99_ms, "ms"),
                "≤ 60 ms",
                check(self.saga_e2e_p99_ms, |v| v <= 60.0),
            ),
        ];
        println!();
        println!("{:<40} {:>20}  {:<18}", "figure", "measured", "target");
        println!("{}", "─".repeat(90));
        for (name, value, target, met) in rows {
            println!("{name:<40} {value:>20}  {target:<18} {met}");
        }
        if let Some(s) = &self.slow_steps {
            s.print();
        }
        if let Some(d) = &self.dlq_index {
            println!(
                "dead-letter index, {} letters in {} groups: /groups {:.1} ms, /metrics {:.1} ms, \
                 /trace {:.1} ms, `saga trace` {:.1} ms (target each < 200 ms); inspector peak {:.1} MiB \
                 (target < 100 MiB); indexing the whole topic itself {:.1} s, peak {:.1} MiB",
                d.letters,
                d.groups,
                d.groups_ms,
                d.metrics_ms,
                d.trace_ms,
                d.cli_trace_ms,
                d.inspector_peak_mib,
                d.reindex_secs,
                d.reindex_peak_mib
            );
        }
        if let Some(rate) = self.broker_produce_msgs_per_s {
            println!(
                "(the broker alone: {rate:.0} msg/s from one idempotent producer, without headers)"
            );
        }
        if let Some(rate) = self.broker_produce_with_headers_msgs_per_s {
            println!(
                "(the broker alone: {rate:.0} msg/s with ten headers per message, as outbox events)"
            );
        }
        if let Some((p50, p99)) = self.broker_ack_ms {
            println!("(the broker alone: single-message ack p50 {p50:.2} ms, p99 {p99:.2} ms)");
        }
        if let Some((p50, p99)) = self.broker_delivery_ms {
            println!(
                "(the broker alone: send to a plain consumer's receipt at 20 msg/s p50 {p50:.2} ms, p99 {p99:.2} ms)"
            );
        }
        if let Some((p50, p99)) = self.broker_delivery_two_topics_ms {
            println!(
                "(the broker alone: the same, the consumer reading every partition of two topics: p50 {p50:.2} ms, p99 {p99:.2} ms)"
            );
        }
        if let Some(mock) = &self.mock_broker {
            println!("(on librdkafka's in-process mock cluster instead of the broker: {mock})");
        }
        if let Some(wal) = &self.wal {
            println!("(with the outbox on the write-ahead log: {wal})");
        }
        for (what, steps) in [
            ("consumer processes", &self.scale_consumers),
            (
                "consumer processes, keys in parallel within each partition",
                &self.scale_consumers_keys_in_parallel,
            ),
            ("relay instances", &self.scale_relays),
        ] {
            if let Some(steps) = steps {
                let line: Vec<String> = steps
                    .iter()
                    .map(|s| format!("{}: {:.0}/s (×{:.2})", s.instances, s.per_s, s.ratio))
                    .collect();
                println!("(scale-out, {what}: {})", line.join(", "));
            }
        }
        if let Some(r) = &self.redis {
            for (side, f) in [
                ("PostgreSQL alone", &r.postgres_only),
                ("with Redis", &r.with_redis),
            ] {
                println!(
                    "(redis, {side}: 200 requests on one key p50/p99 {:.1}/{:.1} ms with at most {} connections, answers {:?} ({} 409s from Redis, {} Redis errors); replay p50/p99 {:.2}/{:.2} ms; consumer on 90% duplicates {:.0} msg/s)",
                    f.storm_ms.0,
                    f.storm_ms.1,
                    f.storm_connections,
                    f.storm_statuses,
                    f.storm_in_flight_from_redis,
                    f.storm_redis_errors,
                    f.replay_ms.0,
                    f.replay_ms.1,
                    f.duplicates_msgs_per_s
                );
            }
        }
        if let Some(o) = &self.otel {
            let rounds = |v: &[f64]| {
                v.iter()
                    .map(|r| format!("{r:.0}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            println!(
                "(otel, spans sampled out: consumer with the layer / without = {:.3}, noise between runs without ±{:.1}%; with spans built then dropped / without = {:.3}; rounds without: {} msg/s; with: {} msg/s; built: {} msg/s)",
                o.ratio,
                o.noise * 50.0,
                o.built_ratio,
                rounds(&o.without_msgs_per_s),
                rounds(&o.with_msgs_per_s),
                rounds(&o.built_msgs_per_s)
            );
        }
        for hop in self.saga_hops.iter().flatten() {
            println!(
                "(saga hop {}: relay {:.1}/{:.1} ms, delivery {:.1}/{:.1} ms, step {:.1}/{:.1} ms, p50/p99)",
                hop.hop,
                hop.relay_ms.0,
                hop.relay_ms.1,
                hop.delivery_ms.0,
                hop.delivery_ms.1,
                hop.step_ms.0,
                hop.step_ms.1
            );
        }
        if let (Some(with), Some(without)) = (self.http_with_layer_ms, self.http_without_layer_ms) {
            println!(
                "(HTTP p50/p99: {:.2}/{:.2} ms with the layer, {:.2}/{:.2} ms without)",
                with.0, with.1, without.0, without.1
            );
        }
    }
}
