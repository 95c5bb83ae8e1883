//! Slow steps: a two-phase step whose outside call takes [`CALL`], on one partition of [`KEYS`] keys, run
//! one key at a time (`SAGA_KEY_CONCURRENCY=1`, the default) and with keys in parallel within the partition
//! (`SAGA_KEY_CONCURRENCY=64`), each against the limit of the work: the keys at once ÷ the call's latency.
//! Then the parallel run again with 1% of keys failing transiently three times (their first message's first
//! three calls): the other keys' throughput against the failure-free run's, and whether every failing key's
//! effects are in its messages' order. Both parallel runs retry with delayed retries (`SAGA_RETRY_DELAYED`).
//!
//! Each run reads a topic of its own in a consumer group and schema of its own; a message's Kafka key is its
//! saga's key (`slow-{n % KEYS}`), its idempotency key its own (`slow-msg-{n}`), so a key's messages are
//! distinct steps that must take effect in offset order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rdkafka::producer::FutureRecord;
use saga_consumer::{
    Message, RetryPolicy, SagaConsumer, StepContext, StepError, StepOutcome, StepResult, Topic,
    two_phase,
};
use saga_runtime::kafka::KafkaConfig;
use serde::Serialize;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::bench::consumer::{Work, work_headers};
use crate::bench::cpu::{CpuSample, CpuUse};
use crate::bench::{Progress, rate};

/// The outside call's latency.
pub const CALL: Duration = Duration::from_millis(50);
/// Keys of the partition.
pub const KEYS: i64 = 1_000;
/// The parallel runs' key concurrency.
pub const KEY_CONCURRENCY: usize = 64;
/// Messages per key of the parallel runs (the serial run measures fewer: it takes a second per twenty).
pub const PER_KEY: i64 = 5;
/// Messages the serial run measures.
pub const SERIAL_MESSAGES: i64 = 200;
/// Every `FAILING_EVERY`th key fails transiently, three times: 1% of keys.
pub const FAILING_EVERY: i64 = 100;
/// How often a failing key fails before its call succeeds.
pub const FAILURES: u32 = 3;

/// One run's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// `SAGA_KEY_CONCURRENCY`.
    pub key_concurrency: usize,
    /// Messages measured.
    pub messages: i64,
    /// Messages per second (of the keys that did not fail, in the run with failures).
    pub msgs_per_s: f64,
    /// The limit of the work: key concurrency ÷ the call's latency, messages per second.
    pub limit_msgs_per_s: f64,
    /// `msgs_per_s` ÷ the limit.
    pub vs_limit: f64,
    /// What the run cost in CPU per message, where `/proc` tells: the whole machine's busy CPU from the first
    /// look that found effects to the last effect's (a look every 250 ms), over the messages that took effect
    /// in between (those of failing keys too).
    pub cpu: Option<CpuUse>,
    /// The rate these cores could sustain at that cost, all of them busy: cores × 10⁶ ÷ µs per message.
    pub cpu_bound_msgs_per_s: Option<f64>,
}

/// The section's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Figures {
    /// The outside call's latency, ms.
    pub call_ms: f64,
    /// Keys of the one partition.
    pub keys: i64,
    /// One key at a time (the default).
    pub serial: Run,
    /// Keys in parallel.
    pub parallel: Run,
    /// Keys in parallel, 1% of keys failing transiently three times: the other keys' throughput.
    pub with_failures: Run,
    /// The other keys' throughput with failures ÷ without.
    pub failures_vs_failure_free: f64,
    /// Whether every failing key's effects are in its messages' order (and each exactly once).
    pub failing_keys_in_order: bool,
}

/// The step's state: which calls fail.
#[derive(Debug, Default)]
struct Outside {
    /// Whether some keys fail.
    failing: bool,
    /// Calls made so far, per failing message.
    calls: Mutex<HashMap<i64, u32>>,
}

impl Outside {
    /// Whether this call of message `n` fails: the first [`FAILURES`] calls of a failing key's first message.
    fn fails(&self, n: i64) -> bool {
        if !self.failing || n % FAILING_EVERY != 0 || n >= KEYS {
            return false;
        }
        let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        let made = calls.entry(n).or_insert(0);
        *made += 1;
        *made <= FAILURES
    }
}

/// The outside call: [`CALL`] of waiting, then a transient failure or an answer.
async fn call(msg: &Message<Work>, outside: &Arc<Outside>) -> Result<i64, StepError> {
    tokio::time::sleep(CALL).await;
    let n = msg.payload().n;
    if outside.fails(n) {
        return Err(StepError::transient(std::io::Error::other(
            "the outside system is briefly unavailable",
        )));
    }
    Ok(n)
}

/// The completion: the effect, one row, in the step key's transaction.
async fn complete(
    msg: &Message<Work>,
    n: i64,
    ctx: &mut StepContext<'_>,
    _: &Arc<Outside>,
) -> StepResult {
    sqlx::query("INSERT INTO bench_slow (n, key) VALUES ($1, $2)")
        .bind(n)
        .bind(msg.payload().n % KEYS)
        .execute(ctx.conn())
        .await?;
    Ok(StepOutcome::completed())
}

/// Produces `count` messages to `topic`, message `n` on key `slow-{n % KEYS}`.
pub async fn produce(kafka: &KafkaConfig, topic: &str, count: i64) -> anyhow::Result<()> {
    let producer = saga_runtime::kafka::idempotent_producer(
        kafka,
        Duration::from_millis(5),
        Duration::from_secs(120),
    )?;
    let mut pending = Vec::new();
    for n in 0..count {
        let key = format!("slow-{}", n % KEYS);
        let id = format!("slow-msg-{n}");
        let payload = serde_json::to_vec(&Work { n })?;
        let headers = work_headers(&id);
        let record = FutureRecord::to(topic)
            .key(&key)
            .payload(&payload)
            .headers(headers);
        match producer.send_result(record) {
            Ok(delivery) => pending.push(delivery),
            Err((e, _)) => anyhow::bail!("producing to {topic}: {e}"),
        }
    }
    for delivery in pending {
        delivery.await?.map_err(|(e, _)| e)?;
    }
    Ok(())
}

/// Creates `bench_slow`, the step's effects, in order of commit.
pub async fn create_table(pool: &PgPool) -> Result<(), sqlx::Error> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_slow (seq bigserial PRIMARY KEY, n bigint NOT NULL, \
         key bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Runs the consumer over `topic` (already produced) with `key_concurrency` until `messages` effects are
/// written, some keys failing when `failing`. Returns the run's figures over the keys that did not fail.
pub async fn run(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topic: &str,
    key_concurrency: usize,
    messages: i64,
    failing: bool,
    progress: &Progress,
) -> anyhow::Result<Run> {
    let outside = Arc::new(Outside {
        failing,
        ..Outside::default()
    });
    let step = two_phase("slow-call", outside, call, complete).on(&Topic::<Work>::new(topic));
    let consumer = SagaConsumer::builder()
        .kafka(kafka.clone())
        .group_id(format!("{topic}.group"))
        .dlq_topic(format!("{topic}.dlq"))
        .retry_topic(format!("{topic}.retry"))
        .pool(pool.clone())
        .key_concurrency(key_concurrency)
        // Keys in parallel with delayed retries (both parallel runs, so that they compare alike): a failing
        // key's backoff waits parked, not in its window.
        .retry(RetryPolicy::default().delayed(key_concurrency > 1))
        .two_phase_step(step)
        .with_outbox(super::outbox())
        .build()?;
    let stop = CancellationToken::new();
    let running = tokio::spawn(consumer.run(stop.clone().cancelled_owned()));
    // CPU is counted from the first look that finds effects, with how many it found: the consumer's start
    // and its joining the group are not the work's.
    let first_effects: Mutex<Option<(Option<CpuSample>, i64)>> = Mutex::new(None);
    let first = &first_effects;
    let done = super::wait_until_done(
        topic,
        Duration::from_millis(250),
        super::STALL_LIMIT,
        || async {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM bench_slow")
                .fetch_one(pool)
                .await?;
            progress.doing(&format!("{topic}: {n}/{messages} effects"));
            let mut first = first.lock().unwrap_or_else(PoisonError::into_inner);
            if first.is_none() && n > 0 {
                *first = Some((CpuSample::now(), n));
            }
            Ok(messages - n)
        },
    )
    .await;
    let after = CpuSample::now();
    let (before, counted_from) = first_effects
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner)
        .unwrap_or((None, messages));
    stop.cancel();
    running.await??;
    done?;
    let (count, seconds): (i64, f64) = sqlx::query_as(
        "SELECT count(*), coalesce(extract(epoch FROM max(at) - min(at))::float8, 0) FROM bench_slow \
         WHERE key % $1 <> 0 OR NOT $2",
    )
    .bind(FAILING_EVERY)
    .bind(failing)
    .fetch_one(pool)
    .await?;
    let msgs_per_s = rate(count, seconds);
    let limit = key_concurrency as f64 / CALL.as_secs_f64();
    let cpu = before
        .zip(after)
        .filter(|_| counted_from < messages)
        .map(|(b, a)| b.until(&a, messages - counted_from));
    let cpu_bound = cpu.map(|c| c.bound_msgs_per_s());
    progress.note(&format!(
        "{topic}: key concurrency {key_concurrency}: {msgs_per_s:.0} msg/s of a limit of {limit:.0}{}",
        cpu.map(|c| format!("; {c}")).unwrap_or_default()
    ));
    Ok(Run {
        key_concurrency,
        messages: count,
        msgs_per_s,
        limit_msgs_per_s: limit,
        vs_limit: msgs_per_s / limit,
        cpu,
        cpu_bound_msgs_per_s: cpu_bound,
    })
}

/// Whether every failing key's effects are its messages, each once, in their order.
pub async fn failing_keys_in_order(pool: &PgPool) -> anyhow::Result<bool> {
    let rows: Vec<(i64, Vec<i64>)> = sqlx::query_as(
        "SELECT key, array_agg(n ORDER BY seq) FROM bench_slow WHERE key % $1 = 0 GROUP BY key",
    )
    .bind(FAILING_EVERY)
    .fetch_all(pool)
    .await?;
    let expected: Vec<i64> = (0..PER_KEY).map(|i| i * KEYS).collect();
    let keys = usize::try_from(KEYS / FAILING_EVERY)?;
    Ok(rows.len() == keys
        && rows
            .iter()
            .all(|(key, ns)| ns.iter().map(|n| n - key).collect::<Vec<_>>() == expected))
}

impl Figures {
    /// Prints the figures against the targets.
    pub fn print(&self) {
        let met = |ok: bool| if ok { "met" } else { "MISSED" };
        for (name, run) in [
            ("one key at a time", &self.serial),
            ("keys in parallel", &self.parallel),
            ("keys in parallel, 1% failing (others)", &self.with_failures),
        ] {
            println!(
                "slow step ({:.0} ms call), {name}: {:.0} msg/s, limit {:.0} ({:.2} of it; key concurrency {}){}",
                self.call_ms,
                run.msgs_per_s,
                run.limit_msgs_per_s,
                run.vs_limit,
                run.key_concurrency,
                run.cpu_bound_msgs_per_s
                    .map(|b| format!("; these cores' bound at its CPU per message: {b:.0} msg/s"))
                    .unwrap_or_default()
            );
        }
        println!(
            "slow step: keys in parallel ≥ 0.8 of the limit: {}; with 1% of keys failing, the others ≥ 0.9 of \
             the failure-free run: {:.2} {}; failing keys' effects in order: {}",
            met(self.parallel.vs_limit >= 0.8),
            self.failures_vs_failure_free,
            met(self.failures_vs_failure_free >= 0.9),
            met(self.failing_keys_in_order)
        );
    }
}
