//! The consumer runtime against the real broker and the real PostgreSQL. Each test's name says which
//! behaviour it covers: crash, duplicate, dlq, retry, rebalance, shutdown.

use std::collections::{BTreeMap, HashMap};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::producer::FutureProducer;
use saga_consumer::{Hooks, RetryPolicy, SagaConsumer, dlq_headers};
use saga_core::{
    BatchContext, Event, Message, SagaStep, StepContext, StepError, StepName, StepOutcome,
    StepResult, Subscription,
};
use saga_test_support::{TestDb, TestKafka, wait_until};
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

/// The step key the runtime derives for `msg` and step `step`: `{idempotency-key}:{step}`, which the test
/// steps record as their effect's identity.
fn step_key<P>(msg: &Message<P>, step: &str) -> String {
    format!("{}:{step}", msg.idempotency_key())
}

/// The test step's payload: what to do, and how to misbehave.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Ping {
    n: u32,
    /// Fail transiently this many times before succeeding.
    #[serde(default)]
    transient_failures: u32,
    /// Fail permanently.
    #[serde(default)]
    permanent: bool,
    /// Reject (business failure).
    #[serde(default)]
    reject: bool,
    /// Panic in the handler.
    #[serde(default)]
    panic: bool,
    /// Sleep this long in the handler.
    #[serde(default)]
    sleep_ms: u64,
    /// Padding: makes the message (and, when permanent, its error) this long.
    #[serde(default)]
    pad: String,
    /// Emit an event with a NUL in a header value (PostgreSQL's text refuses it).
    #[serde(default)]
    nul_header: bool,
    /// Store a result with a NUL in it (PostgreSQL's jsonb refuses it).
    #[serde(default)]
    nul_result: bool,
    /// Kill the process handling it (a poison message), where the step may; elsewhere fail for good.
    #[serde(default)]
    abort: bool,
}

/// Records each handled ping in `effects` and emits a `Pong` to the outbox.
#[derive(Clone)]
struct RecordPing {
    topic: String,
    failures: Arc<Mutex<HashMap<String, u32>>>,
    /// Whether a ping that asks to kill the process does (only a child process's step may).
    aborts: bool,
}

impl RecordPing {
    fn new(topic: &str) -> Self {
        Self {
            topic: topic.to_owned(),
            failures: Arc::default(),
            aborts: false,
        }
    }
}

impl SagaStep for RecordPing {
    type Payload = Ping;

    fn name(&self) -> StepName {
        StepName::from_static("record-ping")
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        vec![Subscription::new(&self.topic, "Ping")]
    }

    async fn handle(&self, msg: &Message<Ping>, ctx: &mut StepContext<'_>) -> StepResult {
        let ping = msg.payload();
        if ping.sleep_ms > 0 {
            tokio::time::sleep(Duration::from_millis(ping.sleep_ms)).await;
        }
        assert!(!ping.panic, "ping {} asked to panic", ping.n);
        if ping.abort {
            if self.aborts {
                std::process::abort();
            }
            return Err(StepError::permanent(format!(
                "ping {} would have killed the process",
                ping.n
            )));
        }
        if ping.permanent {
            return Err(StepError::permanent(format!(
                "ping {} is unprocessable{}",
                ping.n, ping.pad
            )));
        }
        {
            let mut failures = self.failures.lock().unwrap();
            let seen = failures.entry(step_key(msg, "record-ping")).or_default();
            if *seen < ping.transient_failures {
                *seen += 1;
                return Err(StepError::transient(format!(
                    "ping {} fails, attempt {seen}",
                    ping.n
                )));
            }
        }
        sqlx::query("INSERT INTO effects (step_key, n) VALUES ($1, $2)")
            .bind(step_key(msg, "record-ping"))
            .bind(i64::from(ping.n))
            .execute(ctx.conn())
            .await?;
        let mut pong = Event::new(
            "Pong",
            format!("{}.out", self.topic),
            ping.n.to_string(),
            &serde_json::json!({ "n": ping.n }),
        )?;
        if ping.nul_header {
            pong = pong.with_header("x-note", "a\0b");
        }
        ctx.emit_event(pong);
        if ping.reject {
            return Ok(StepOutcome::rejected(format!("ping {} rejected", ping.n)));
        }
        if ping.nul_result {
            return StepOutcome::completed_with(
                &serde_json::json!({ "n": ping.n, "note": "a\u{0}b" }),
            );
        }
        StepOutcome::completed_with(&serde_json::json!({ "n": ping.n }))
    }
}

/// Handles whole batches with one multi-row INSERT, and fails the whole call (without saying which message
/// is to blame) when any message of it is marked permanent.
#[derive(Clone)]
struct RecordPingsInBulk {
    topic: String,
}

impl SagaStep for RecordPingsInBulk {
    type Payload = Ping;

    fn name(&self) -> StepName {
        StepName::from_static("record-pings-in-bulk")
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        vec![Subscription::new(&self.topic, "Ping")]
    }

    async fn handle(&self, msg: &Message<Ping>, ctx: &mut StepContext<'_>) -> StepResult {
        let mut batch = ctx.as_batch();
        let mut outcomes = self.handle_batch(&[msg], &mut batch).await?;
        Ok(outcomes.remove(0))
    }

    async fn handle_batch(
        &self,
        msgs: &[&Message<Ping>],
        ctx: &mut BatchContext<'_>,
    ) -> Result<Vec<StepOutcome>, StepError> {
        if msgs.iter().any(|m| m.payload().permanent) {
            return Err(StepError::permanent("one of these pings is unprocessable"));
        }
        let keys: Vec<String> = msgs
            .iter()
            .map(|m| step_key(m, "record-pings-in-bulk"))
            .collect();
        let ns: Vec<i64> = msgs.iter().map(|m| i64::from(m.payload().n)).collect();
        sqlx::query(
            "INSERT INTO effects (step_key, n) SELECT * FROM unnest($1::text[], $2::bigint[])",
        )
        .bind(&keys)
        .bind(&ns)
        .execute(ctx.conn())
        .await?;
        for m in msgs {
            ctx.emit_event(
                m,
                Event::new(
                    "Pong",
                    format!("{}.out", self.topic),
                    m.payload().n.to_string(),
                    &serde_json::json!({ "n": m.payload().n }),
                )?,
            );
        }
        Ok(msgs.iter().map(|_| StepOutcome::completed()).collect())
    }
}

/// Like [`RecordPingsInBulk`], but names the permanent message it fails on, and fails its first call of
/// several messages without one once (a timeout, say): a `Group` failure after an `Item` failure.
#[derive(Clone)]
struct BulkFailingOnceUnnamed {
    inner: RecordPingsInBulk,
    unnamed_failures: Arc<Mutex<u32>>,
}

impl SagaStep for BulkFailingOnceUnnamed {
    type Payload = Ping;

    fn name(&self) -> StepName {
        StepName::from_static("record-pings-in-bulk")
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        self.inner.subscriptions()
    }

    async fn handle(&self, msg: &Message<Ping>, ctx: &mut StepContext<'_>) -> StepResult {
        let mut batch = ctx.as_batch();
        let mut outcomes = self.handle_batch(&[msg], &mut batch).await?;
        Ok(outcomes.remove(0))
    }

    async fn handle_batch(
        &self,
        msgs: &[&Message<Ping>],
        ctx: &mut BatchContext<'_>,
    ) -> Result<Vec<StepOutcome>, StepError> {
        if let Some(i) = msgs.iter().position(|m| m.payload().permanent) {
            let n = msgs[i].payload().n;
            return Err(StepError::permanent(format!("ping {n} is unprocessable")).in_message(i));
        }
        if msgs.len() > 1 {
            let mut left = self.unnamed_failures.lock().unwrap();
            if *left > 0 {
                *left -= 1;
                return Err(StepError::transient("the bulk insert timed out"));
            }
        }
        self.inner.handle_batch(msgs, ctx).await
    }
}

struct Fixture {
    db: TestDb,
    kafka: TestKafka,
    topic: String,
    dlq: String,
    group: String,
    producer: FutureProducer,
}

impl Fixture {
    async fn new(name: &str, partitions: i32) -> Self {
        Self::with_dlq_config(name, partitions, &[]).await
    }

    /// A fixture whose dead-letter topic has topic configuration `dlq_config`.
    async fn with_dlq_config(name: &str, partitions: i32, dlq_config: &[(&str, &str)]) -> Self {
        let db = TestDb::with(name, &[saga_consumer::migrate::migrator()]).await;
        Self::on(db, name, partitions, dlq_config).await
    }

    /// A fixture whose schema is in a database of its own, for tests that change database-wide settings.
    async fn in_own_database(name: &str, partitions: i32) -> Self {
        let db = TestDb::with_own_database(name, &[saga_consumer::migrate::migrator()]).await;
        Self::on(db, name, partitions, &[]).await
    }

    async fn on(db: TestDb, name: &str, partitions: i32, dlq_config: &[(&str, &str)]) -> Self {
        sqlx::query("CREATE TABLE effects (step_key TEXT NOT NULL, n BIGINT NOT NULL)")
            .execute(&db.pool)
            .await
            .unwrap();
        let kafka = TestKafka::new().await;
        let topic = kafka.topic(name, partitions).await;
        let dlq = format!("{topic}.dlq");
        kafka.create_topic_with(&dlq, 1, dlq_config).await;
        // The group's retry topic (`{group}.retry` by default).
        kafka.create_topic(&format!("{topic}-group.retry"), 1).await;
        let producer = kafka.producer();
        Self {
            group: format!("{topic}-group"),
            db,
            kafka,
            topic,
            dlq,
            producer,
        }
    }

    /// Publishes a ping with idempotency key `key` (also the Kafka key).
    async fn ping(&self, key: &str, ping: &Ping) -> (i32, i64) {
        let payload = serde_json::to_vec(ping).unwrap();
        self.raw(
            Some(key),
            &[("idempotency-key", key), ("ce_type", "Ping")],
            &payload,
        )
        .await
    }

    async fn raw(&self, key: Option<&str>, headers: &[(&str, &str)], payload: &[u8]) -> (i32, i64) {
        self.kafka
            .produce(&self.producer, &self.topic, key, headers, payload)
            .await
    }

    fn consumer(&self, step: impl SagaStep) -> saga_consumer::SagaConsumerBuilder {
        SagaConsumer::builder()
            .brokers(self.kafka.brokers.clone())
            .group_id(self.group.clone())
            .dlq_topic(self.dlq.clone())
            .pool(self.db.pool.clone())
            .commit_interval(Duration::from_millis(200))
            .session_timeout(Duration::from_secs(6))
            .retry(
                RetryPolicy::default()
                    .max_attempts(4)
                    .backoff(Duration::from_millis(50), Duration::from_millis(200)),
            )
            .step(step)
    }

    fn start(&self, builder: saga_consumer::SagaConsumerBuilder) -> Running {
        let consumer = builder.build().expect("a valid consumer");
        let ops = consumer.ops();
        let stop = CancellationToken::new();
        let handle = tokio::spawn(consumer.run(stop.clone().cancelled_owned()));
        Running { stop, handle, ops }
    }

    async fn effects(&self) -> Vec<(String, i64)> {
        sqlx::query_as("SELECT step_key, n FROM effects ORDER BY n, step_key")
            .fetch_all(&self.db.pool)
            .await
            .unwrap()
    }

    async fn wait_for_effects(&self, expected: usize) {
        wait_until(&format!("{expected} effects"), WAIT, || async {
            (self.db.count("effects").await >= i64::try_from(expected).unwrap()).then_some(())
        })
        .await;
    }

    async fn committed(&self) -> BTreeMap<i32, i64> {
        self.kafka.committed_offsets(&self.group, &self.topic).await
    }

    async fn wait_for_committed(&self, expected: BTreeMap<i32, i64>) {
        wait_until(&format!("committed offsets {expected:?}"), WAIT, || async {
            (self.committed().await == expected).then_some(())
        })
        .await;
    }
}

struct Running {
    stop: CancellationToken,
    handle: JoinHandle<Result<(), saga_consumer::ConsumerError>>,
    ops: saga_consumer::OpsHandle,
}

impl Running {
    async fn stop(self) -> saga_consumer::OpsHandle {
        self.stop.cancel();
        tokio::time::timeout(WAIT, self.handle)
            .await
            .expect("the consumer stops within the timeout")
            .unwrap()
            .expect("the consumer stops without error");
        self.ops
    }

    /// The value of counter `name` with label set `labels` (as in the Prometheus text), 0 if absent.
    fn metric(&self, name: &str, labels: &str) -> f64 {
        metric(&self.ops, name, labels)
    }
}

fn metric(ops: &saga_consumer::OpsHandle, name: &str, labels: &str) -> f64 {
    ops.sample(name, labels).unwrap_or(0.0)
}

fn ping(n: u32) -> Ping {
    Ping {
        n,
        ..Ping::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_deliveries_of_one_message_have_one_effect() {
    let f = Fixture::new("duplicate", 1).await;
    // The same saga event published three times (a producer retry, a replay), and another event.
    f.ping("order-1", &ping(1)).await;
    f.ping("order-1", &ping(1)).await;
    f.ping("order-2", &ping(2)).await;
    f.ping("order-1", &ping(1)).await;
    let running = f.start(f.consumer(RecordPing::new(&f.topic)));
    f.wait_for_committed(BTreeMap::from([(0, 4)])).await;
    assert_eq!(
        f.effects().await,
        vec![
            ("order-1:record-ping".to_owned(), 1),
            ("order-2:record-ping".to_owned(), 2)
        ]
    );
    assert_eq!(f.db.count("saga_outbox").await, 2, "one Pong per effect");
    assert_eq!(
        running.metric("saga_consumer_duplicates_total", "step=\"record-ping\""),
        2.0
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_runs_of_redeliveries_cost_one_claim_rerun_each() {
    let f = Fixture::new("claim-rerun", 1).await;
    // New keys, a run of redeliveries of all of them, new keys again, and a second run of redeliveries.
    let sends = (0..30)
        .chain(0..30)
        .chain(30..40)
        .chain(0..5)
        .collect::<Vec<u32>>();
    for n in &sends {
        f.ping(&format!("k-{n}"), &ping(*n)).await;
    }
    let running = f.start(
        f.consumer(RecordPing::new(&f.topic))
            .batch_size(5)
            .concurrency(1),
    );
    f.wait_for_committed(BTreeMap::from([(0, 75)])).await;
    let effects = f.effects().await;
    let expected: Vec<(String, i64)> = (0..40).map(|n| (format!("k-{n}:record-ping"), n)).collect();
    assert_eq!(effects, expected, "each key took effect once");
    assert_eq!(f.db.count("saga_outbox").await, 40, "one Pong per effect");
    assert_eq!(
        running.metric("saga_consumer_duplicates_total", "step=\"record-ping\""),
        35.0
    );
    // Batches of new keys claim them with a plain insert. The first batch meeting a redelivered key runs
    // again with the checking claim, which the worker keeps while its batches meet existing keys, and
    // leaves after a batch of new keys only: one rerun per run of redeliveries (at most 5 per batch, so
    // each run spans several batches, and the new keys between them at least one batch of their own).
    assert_eq!(running.metric("saga_consumer_claims_rerun_total", ""), 2.0);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_type_no_step_reads_on_a_shared_topic_is_skipped_and_counted_not_dead_lettered() {
    let f = Fixture::new("shared", 1).await;
    f.ping("k-1", &ping(1)).await;
    // Another service's event on the topic this one reads through its typed view.
    f.raw(
        Some("k-2"),
        &[("idempotency-key", "k-2"), ("ce_type", "Pang")],
        br#"{"n": 2}"#,
    )
    .await;
    f.ping("k-3", &ping(3)).await;
    let running = f.start(f.consumer(RecordPing::new(&f.topic)));
    f.wait_for_committed(BTreeMap::from([(0, 3)])).await;
    let effects: Vec<i64> = f.effects().await.into_iter().map(|(_, n)| n).collect();
    assert_eq!(effects, vec![1, 3]);
    let ignored = running.metric(
        "saga_consumer_processed_total",
        "step=\"\",outcome=\"ignored\"",
    );
    assert_eq!(ignored, 1.0, "skipped, and counted");
    assert_eq!(
        f.kafka.end_offsets(&f.dlq).await.values().sum::<i64>(),
        0,
        "no dead letter"
    );

    // An operator's replay of a letter of that type is never skipped: sent to be run, it is dead-lettered
    // again, saying why, where a skip would close the letter with nothing done.
    let retry = format!("{}.retry", f.group);
    f.kafka
        .produce(
            &f.producer,
            &retry,
            Some("k-2"),
            &[
                ("idempotency-key", "k-2"),
                ("ce_type", "Pang"),
                ("saga-replay-original-topic", f.topic.as_str()),
                ("saga-replay-original-partition", "0"),
                ("saga-replay-original-offset", "1"),
                ("saga-replay-letter", "letter-1"),
            ],
            br#"{"n": 2}"#,
        )
        .await;
    let dead = f
        .kafka
        .read_all(&f.dlq, 1, Duration::from_millis(500), WAIT)
        .await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].header(dlq_headers::REASON),
        Some("unknown-event-type")
    );
    running.stop().await;

    // A strict topic no step reads is refused when the consumer is built (a typo would skip).
    let refused = f
        .consumer(RecordPing::new(&f.topic))
        .strict("no-such-topic")
        .build()
        .expect_err("refused");
    assert!(
        refused.to_string().contains("no step reads no-such-topic"),
        "{refused}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dlq_receives_poison_messages_with_their_reason_and_the_partition_keeps_flowing() {
    let f = Fixture::new("dlq", 1).await;
    f.ping("k-1", &ping(1)).await;
    f.raw(
        Some("k-2"),
        &[("idempotency-key", "k-2"), ("ce_type", "Ping")],
        b"{not json",
    )
    .await;
    f.raw(Some("k-3"), &[("ce_type", "Ping")], br#"{"n": 3}"#)
        .await;
    f.raw(
        Some("k-4"),
        &[
            ("idempotency-key", "bad key with spaces"),
            ("ce_type", "Ping"),
        ],
        br#"{"n": 4}"#,
    )
    .await;
    f.raw(
        Some("k-5"),
        &[("idempotency-key", "k-5"), ("ce_type", "Pang")],
        br#"{"n": 5}"#,
    )
    .await;
    f.ping(
        "k-6",
        &Ping {
            permanent: true,
            ..ping(6)
        },
    )
    .await;
    f.ping(
        "k-7",
        &Ping {
            panic: true,
            ..ping(7)
        },
    )
    .await;
    f.ping("k-8", &ping(8)).await;

    // Strict: every type on the topic is this service's, so `Pang` is poison, not another's type.
    let running = f.start(
        f.consumer(RecordPing::new(&f.topic))
            .strict(f.topic.clone()),
    );
    f.wait_for_committed(BTreeMap::from([(0, 8)])).await;
    let effects: Vec<i64> = f.effects().await.into_iter().map(|(_, n)| n).collect();
    assert_eq!(
        effects,
        vec![1, 8],
        "good messages around the poison ones took effect"
    );

    let dead = f
        .kafka
        .read_all(&f.dlq, 6, Duration::from_millis(500), WAIT)
        .await;
    assert_eq!(dead.len(), 6, "each poison message exactly once");
    let by_offset: BTreeMap<&str, (&str, &str)> = dead
        .iter()
        .map(|m| {
            (
                m.header(dlq_headers::ORIGINAL_OFFSET).unwrap(),
                (
                    m.header(dlq_headers::REASON).unwrap(),
                    m.header(dlq_headers::ERROR).unwrap(),
                ),
            )
        })
        .collect();
    assert_eq!(by_offset["1"].0, "undecodable");
    assert!(
        by_offset["1"].1.contains("payload does not decode"),
        "{by_offset:?}"
    );
    assert_eq!(by_offset["2"].0, "undecodable");
    assert!(
        by_offset["2"]
            .1
            .contains("missing header \"idempotency-key\"")
    );
    assert_eq!(by_offset["3"].0, "undecodable");
    assert!(
        by_offset["3"]
            .1
            .contains("invalid header \"idempotency-key\"")
    );
    assert_eq!(by_offset["4"].0, "unknown-event-type");
    assert!(by_offset["4"].1.contains("\"Pang\""));
    assert_eq!(by_offset["5"].0, "handler-failed");
    assert!(by_offset["5"].1.contains("unprocessable"));
    assert_eq!(by_offset["6"].0, "handler-failed");
    assert!(by_offset["6"].1.contains("panicked"));
    for m in &dead {
        assert_eq!(
            m.header(dlq_headers::ORIGINAL_TOPIC),
            Some(f.topic.as_str())
        );
        assert_eq!(m.header(dlq_headers::ORIGINAL_PARTITION), Some("0"));
        assert_eq!(
            m.header(dlq_headers::CONSUMER_GROUP),
            Some(f.group.as_str())
        );
        assert!(m.header(dlq_headers::ATTEMPTS).is_some());
    }
    let undecodable = dead
        .iter()
        .find(|m| m.header(dlq_headers::ORIGINAL_OFFSET) == Some("1"))
        .unwrap();
    assert_eq!(
        undecodable.payload, b"{not json",
        "the original payload is kept"
    );
    assert_eq!(undecodable.key.as_deref(), Some("k-2"));
    assert_eq!(
        running.metric(
            "saga_consumer_dead_lettered_total",
            &format!("topic=\"{}\",reason=\"undecodable\"", f.topic)
        ),
        3.0
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retry_transient_failures_then_succeed_once_and_exhausted_retries_go_to_the_dlq() {
    let f = Fixture::new("retry", 1).await;
    // Ten messages in one batch; the fifth fails twice, the eighth fails more often than the budget allows.
    for n in 1..=10 {
        let p = match n {
            5 => Ping {
                transient_failures: 2,
                ..ping(n)
            },
            8 => Ping {
                transient_failures: 100,
                ..ping(n)
            },
            _ => ping(n),
        };
        f.ping(&format!("k-{n}"), &p).await;
    }
    let running = f.start(f.consumer(RecordPing::new(&f.topic)).batch_size(10));
    f.wait_for_committed(BTreeMap::from([(0, 10)])).await;
    let effects: Vec<i64> = f.effects().await.into_iter().map(|(_, n)| n).collect();
    assert_eq!(
        effects,
        vec![1, 2, 3, 4, 5, 6, 7, 9, 10],
        "each message once; the failing ones did not take the others down"
    );
    assert_eq!(f.db.count("saga_outbox").await, 9);
    // Message 5: two retries. Message 8: three retries, then the fourth failure spends the budget.
    assert_eq!(
        running.metric("saga_consumer_retries_total", "step=\"record-ping\""),
        5.0
    );
    let dead = f
        .kafka
        .read_all(&f.dlq, 1, Duration::from_millis(500), WAIT)
        .await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].header(dlq_headers::REASON),
        Some("retries-exhausted")
    );
    assert_eq!(dead[0].header(dlq_headers::ATTEMPTS), Some("4"));
    assert_eq!(dead[0].header(dlq_headers::ORIGINAL_OFFSET), Some("7"));
    assert_eq!(dead[0].header(dlq_headers::STEP), Some("record-ping"));
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_commits_what_was_processed_and_a_restart_does_not_reprocess_it() {
    let f = Fixture::new("shutdown", 2).await;
    for n in 1..=40 {
        f.ping(&format!("k-{n}"), &ping(n)).await;
    }
    let running = f.start(
        f.consumer(RecordPing::new(&f.topic))
            .commit_interval(Duration::from_secs(3600)),
    );
    f.wait_for_effects(40).await;
    // With a commit interval of an hour, only the graceful stop commits.
    running.stop().await;
    let committed: i64 = f.committed().await.values().sum();
    assert_eq!(committed, 40, "the stop committed every processed message");

    for n in 41..=45 {
        f.ping(&format!("k-{n}"), &ping(n)).await;
    }
    let restarted = f.start(f.consumer(RecordPing::new(&f.topic)));
    f.wait_for_effects(45).await;
    let end: i64 = f.kafka.end_offsets(&f.topic).await.values().sum();
    wait_until("all offsets committed", WAIT, || async {
        (f.committed().await.values().sum::<i64>() == end).then_some(())
    })
    .await;
    assert_eq!(f.db.count("effects").await, 45);
    let ops = restarted.stop().await;
    assert_eq!(
        metric(
            &ops,
            "saga_consumer_processed_total",
            "step=\"record-ping\",outcome=\"completed\""
        ),
        5.0,
        "the restart handled only the new messages"
    );
    assert_eq!(
        metric(
            &ops,
            "saga_consumer_duplicates_total",
            "step=\"record-ping\""
        ),
        0.0,
        "and redelivered nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rebalance_with_a_member_joining_and_one_leaving_loses_and_doubles_nothing() {
    let f = Fixture::new("rebalance", 4).await;
    let total = 400;
    for n in 1..=total {
        f.ping(
            &format!("k-{n}"),
            &Ping {
                sleep_ms: 20,
                ..ping(n)
            },
        )
        .await;
    }
    let first = f.start(f.consumer(RecordPing::new(&f.topic)).batch_size(10));
    f.wait_for_effects(40).await;
    let second = f.start(f.consumer(RecordPing::new(&f.topic)).batch_size(10));
    f.wait_for_effects(200).await;
    let first_ops = first.stop().await;
    f.wait_for_effects(total as usize).await;
    let end = f.kafka.end_offsets(&f.topic).await;
    f.wait_for_committed(end).await;

    let effects = f.effects().await;
    assert_eq!(effects.len(), total as usize, "no effect doubled");
    let distinct: std::collections::BTreeSet<i64> = effects.iter().map(|(_, n)| *n).collect();
    assert_eq!(distinct.len(), total as usize, "no effect lost");
    assert_eq!(f.db.count("saga_outbox").await, i64::from(total));
    let second_ops = second.stop().await;
    let completed = |ops| {
        metric(
            ops,
            "saga_consumer_processed_total",
            "step=\"record-ping\",outcome=\"completed\"",
        )
    };
    assert!(
        completed(&first_ops) > 0.0 && completed(&second_ops) > 0.0,
        "both members did work"
    );
}

/// A child process's consumer as its parent test set it up (`CRASH_*`), and its topic: the broker, the
/// group, the dead-letter topic and the database, no step yet.
async fn child_consumer() -> (saga_consumer::SagaConsumerBuilder, String) {
    let (Ok(url), Ok(brokers), Ok(topic), Ok(group)) = (
        std::env::var("CRASH_DATABASE_URL"),
        std::env::var("CRASH_BROKERS"),
        std::env::var("CRASH_TOPIC"),
        std::env::var("CRASH_GROUP"),
    ) else {
        panic!("run by the crash test only");
    };
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let builder = SagaConsumer::builder()
        .brokers(brokers)
        .group_id(group)
        .dlq_topic(format!("{topic}.dlq"))
        .pool(pool)
        .session_timeout(Duration::from_secs(6));
    (builder, topic)
}

/// Runs the ignored test `child` of this binary in a child process, against `f`'s database, broker, topic
/// and group (and `extra` variables); how it ended.
async fn run_child(f: &Fixture, child: &str, extra: &[(&str, &str)]) -> std::process::ExitStatus {
    tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", child, "--ignored"])
        .env("CRASH_DATABASE_URL", f.db.url())
        .env("CRASH_BROKERS", &f.kafka.brokers)
        .env("CRASH_TOPIC", &f.topic)
        .env("CRASH_GROUP", &f.group)
        .envs(extra.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
        .unwrap()
}

/// Runs in a child process: a consumer that aborts right after its first database commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by crash_after_the_db_commit_before_the_offset_commit_still_yields_one_effect"]
async fn crash_child_process() {
    let (builder, topic) = child_consumer().await;
    builder
        .step(RecordPing::new(&topic))
        .hooks(Hooks::default().on_db_commit(|_| std::process::abort()))
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap();
}

/// Runs in a child process: a consumer that aborts right after any database commit of partition
/// `CRASH_PARTITION`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by crash_a_death_on_one_partition_is_not_charged_to_an_isolated_message_of_another"]
async fn crash_on_partition_child_process() {
    let Ok(partition) = std::env::var("CRASH_PARTITION") else {
        panic!("run by the crash test only");
    };
    let partition: i32 = partition.parse().unwrap();
    let (builder, topic) = child_consumer().await;
    builder
        .step(RecordPing::new(&topic))
        .crash_loop_limit(2)
        .hooks(Hooks::default().on_db_commit(move |info| {
            if info.partition == partition {
                std::process::abort();
            }
        }))
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap();
}

/// Runs in a child process: a consumer of one message a batch whose offsets are not committed while it
/// lives (a minute's interval), and whose step lets a poison ping kill the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by crash_a_poison_behind_a_lagging_committed_offset_is_isolated_and_dead_lettered"]
async fn crash_lagging_child_process() {
    let (builder, topic) = child_consumer().await;
    builder
        .batch_size(1)
        .commit_interval(Duration::from_secs(60))
        .crash_loop_limit(2)
        .step(RecordPing {
            aborts: true,
            ..RecordPing::new(&topic)
        })
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap();
}

/// A poison message that kills the process at once, behind messages whose offsets were not committed
/// yet: each restart redelivers those first (duplicates, absorbed), and the range the last run died in
/// must survive them, so that the poison is isolated and, after the crash-loop limit's deaths,
/// dead-lettered. Before the record kept that range, the first redelivered batch replaced it and the
/// poison killed every restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_a_poison_behind_a_lagging_committed_offset_is_isolated_and_dead_lettered() {
    let f = Fixture::new("crash-lagging", 1).await;
    for n in 1..=4 {
        f.ping(
            &format!("k-{n}"),
            &Ping {
                abort: n == 3,
                // The poison dies a moment into its handler: the batch's record, written beside the
                // transaction from the second batch of a run on, is in by then, so each run's death is
                // charged as this test counts (a death outrunning its record is the model's to explore).
                sleep_ms: if n == 3 { 300 } else { 0 },
                ..ping(n)
            },
        )
        .await;
    }
    // Three runs, each killed by the poison: the first as it met it in a batch, the next two isolating it
    // (the crash-loop limit is two isolated deaths).
    for run in 1..=3 {
        let status = run_child(&f, "crash_lagging_child_process", &[]).await;
        assert!(!status.success(), "run {run}: the poison killed the child");
        assert!(
            f.committed().await.is_empty(),
            "run {run}: no offset was committed, so every restart redelivers from the start"
        );
        assert_eq!(
            f.effects().await.len(),
            2,
            "run {run}: the two before the poison, once"
        );
    }
    let starts: i32 = sqlx::query_scalar(
        "SELECT starts FROM saga_consumer_suspects WHERE group_id = $1 AND \"offset\" = 2",
    )
    .bind(&f.group)
    .fetch_one(&f.db.pool)
    .await
    .unwrap();
    assert_eq!(starts, 2, "the poison's two isolated starts, both killed");

    let running = f.start(f.consumer(RecordPing::new(&f.topic)).crash_loop_limit(2));
    f.wait_for_committed(BTreeMap::from([(0, 4)])).await;
    let effects: Vec<i64> = f.effects().await.into_iter().map(|(_, n)| n).collect();
    assert_eq!(
        effects,
        vec![1, 2, 4],
        "every other message took effect, once"
    );
    let letters = f
        .kafka
        .read_all(&f.dlq, 1, Duration::from_millis(300), WAIT)
        .await;
    assert_eq!(letters.len(), 1, "the poison alone is dead-lettered");
    let letter = &letters[0];
    assert_eq!(letter.header(dlq_headers::REASON), Some("crash-loop"));
    assert_eq!(letter.header(dlq_headers::ORIGINAL_OFFSET), Some("2"));
    running.stop().await;
}

/// A worker stopping between batches closes its last range, which finished: a later owner starting behind
/// it (a commit refused on revoke, offsets reset back) takes nothing for a range a run died in.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_a_worker_stopping_between_batches_closes_its_finished_range() {
    let f = Fixture::new("crash-closed", 1).await;
    for n in 1..=3 {
        f.ping(&format!("k-{n}"), &ping(n)).await;
    }
    let running = f.start(f.consumer(RecordPing::new(&f.topic)).batch_size(1));
    f.wait_for_committed(BTreeMap::from([(0, 3)])).await;
    running.stop().await;
    let (first, last): (i64, i64) = sqlx::query_as(
        "SELECT batch_offset, batch_end FROM saga_consumer_progress WHERE group_id = $1 AND partition = 0",
    )
    .bind(&f.group)
    .fetch_one(&f.db.pool)
    .await
    .unwrap();
    assert_eq!((first, last), (2, 1), "the last batch's range, closed");
    let (isolate, clear): (bool, bool) =
        sqlx::query_as("SELECT isolate, clear FROM saga_consumer_begin_batch($1, $2, 0, 0, 0)")
            .bind(&f.group)
            .bind(&f.topic)
            .fetch_one(&f.db.pool)
            .await
            .unwrap();
    assert!(!isolate && clear, "a restart behind it runs normally");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_a_death_on_one_partition_is_not_charged_to_an_isolated_message_of_another() {
    let f = Fixture::new("crash-elsewhere", 2).await;
    // Partition 0: a slow message the last run died on, so it is processed in isolation. Partition 1: a
    // message after whose commit the process dies (another cause, another partition).
    let slow = serde_json::to_vec(&Ping {
        sleep_ms: 1_500,
        ..ping(1)
    })
    .unwrap();
    f.kafka
        .produce_to(
            &f.producer,
            &f.topic,
            Some(0),
            Some("k-1"),
            &[("idempotency-key", "k-1"), ("ce_type", "Ping")],
            &slow,
        )
        .await;
    // Slow enough that the isolated message of partition 0 is under way when this one's commit kills.
    let quick = serde_json::to_vec(&Ping {
        sleep_ms: 500,
        ..ping(2)
    })
    .unwrap();
    f.kafka
        .produce_to(
            &f.producer,
            &f.topic,
            Some(1),
            Some("k-2"),
            &[("idempotency-key", "k-2"), ("ce_type", "Ping")],
            &quick,
        )
        .await;
    sqlx::query(
        "INSERT INTO saga_consumer_progress (group_id, topic, partition, batch_offset, batch_end) \
         VALUES ($1, $2, 0, 0, 0)",
    )
    .bind(&f.group)
    .bind(&f.topic)
    .execute(&f.db.pool)
    .await
    .unwrap();
    for _ in 0..3 {
        let status = run_child(
            &f,
            "crash_on_partition_child_process",
            &[("CRASH_PARTITION", "1")],
        )
        .await;
        assert!(!status.success(), "the child died");
    }
    let running = f.start(f.consumer(RecordPing::new(&f.topic)).crash_loop_limit(2));
    f.wait_for_committed(BTreeMap::from([(0, 1), (1, 1)])).await;
    let effects: Vec<i64> = f.effects().await.into_iter().map(|(_, n)| n).collect();
    assert_eq!(effects, vec![1, 2], "both took effect, once");
    let (_, dead) = f
        .kafka
        .end_offsets(&f.dlq)
        .await
        .into_iter()
        .next()
        .unwrap();
    let letters = f
        .kafka
        .read_all(
            &f.dlq,
            usize::try_from(dead).unwrap(),
            Duration::from_millis(300),
            WAIT,
        )
        .await;
    // The quick message did kill the process after every commit: it may be dead-lettered as a crash loop.
    // The slow one, under way on the other partition each time, must not be.
    for letter in &letters {
        assert_eq!(
            letter.header(dlq_headers::ORIGINAL_PARTITION),
            Some("1"),
            "the slow message was not blamed for deaths on the other partition"
        );
        assert_eq!(letter.header(dlq_headers::REASON), Some("crash-loop"));
    }
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_after_the_db_commit_before_the_offset_commit_still_yields_one_effect() {
    let f = Fixture::new("crash", 1).await;
    f.ping("order-9", &ping(9)).await;

    let status = run_child(&f, "crash_child_process", &[]).await;
    assert!(!status.success(), "the child aborted");
    assert_eq!(
        f.effects().await.len(),
        1,
        "the effect committed before the crash"
    );
    assert!(
        f.committed().await.is_empty(),
        "the offset did not: the crash came first"
    );

    let running = f.start(f.consumer(RecordPing::new(&f.topic)));
    f.wait_for_committed(BTreeMap::from([(0, 1)])).await;
    assert_eq!(
        f.effects().await,
        vec![("order-9:record-ping".to_owned(), 9)],
        "the redelivery was recognised, not re-run"
    );
    assert_eq!(f.db.count("saga_outbox").await, 1);
    assert_eq!(
        running.metric("saga_consumer_duplicates_total", "step=\"record-ping\""),
        1.0
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dlq_a_batch_handler_failing_without_naming_the_message_dead_letters_only_that_message() {
    let f = Fixture::new("dlq-bulk", 1).await;
    for n in 1..=12 {
        let p = if n == 7 {
            Ping {
                permanent: true,
                ..ping(n)
            }
        } else {
            ping(n)
        };
        f.ping(&format!("k-{n}"), &p).await;
    }
    let running = f.start(
        f.consumer(RecordPingsInBulk {
            topic: f.topic.clone(),
        })
        .batch_size(12),
    );
    f.wait_for_committed(BTreeMap::from([(0, 12)])).await;
    let effects: Vec<i64> = f.effects().await.into_iter().map(|(_, n)| n).collect();
    assert_eq!(
        effects,
        vec![1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12],
        "every other message once"
    );
    assert_eq!(f.db.count("saga_outbox").await, 11);
    let dead = f
        .kafka
        .read_all(&f.dlq, 1, Duration::from_millis(500), WAIT)
        .await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].header(dlq_headers::ORIGINAL_OFFSET), Some("6"));
    assert_eq!(dead[0].header(dlq_headers::REASON), Some("handler-failed"));
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dlq_a_group_failure_after_an_item_failure_dead_letters_only_the_failing_message() {
    let f = Fixture::new("dlq-group-after-item", 1).await;
    for n in 1..=10 {
        let p = Ping {
            permanent: n == 10,
            ..ping(n)
        };
        f.ping(&format!("k-{n}"), &p).await;
    }
    let step = BulkFailingOnceUnnamed {
        inner: RecordPingsInBulk {
            topic: f.topic.clone(),
        },
        unnamed_failures: Arc::new(Mutex::new(1)),
    };
    let running = f.start(f.consumer(step).batch_size(10));
    f.wait_for_committed(BTreeMap::from([(0, 10)])).await;
    let effects: Vec<i64> = f.effects().await.into_iter().map(|(_, n)| n).collect();
    assert_eq!(
        effects,
        (1..=9).collect::<Vec<_>>(),
        "every healthy message once"
    );
    let dead = f
        .kafka
        .read_all(&f.dlq, 1, Duration::from_millis(800), WAIT)
        .await;
    assert_eq!(dead.len(), 1, "only the failing message is dead-lettered");
    assert_eq!(dead[0].header(dlq_headers::ORIGINAL_OFFSET), Some("9"));
    assert!(
        dead[0]
            .header(dlq_headers::ERROR)
            .unwrap()
            .contains("ping 10 is unprocessable"),
        "with its own error"
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dlq_a_statement_the_database_refuses_narrows_the_batch_and_dead_letters_the_culprit() {
    let f = Fixture::new("dlq-store-error", 1).await;
    for n in 1..=6 {
        let p = Ping {
            nul_header: n == 3,
            nul_result: n == 5,
            ..ping(n)
        };
        f.ping(&format!("k-{n}"), &p).await;
    }
    let running = f.start(f.consumer(RecordPing::new(&f.topic)).batch_size(6));
    f.wait_for_committed(BTreeMap::from([(0, 6)])).await;
    let effects: Vec<i64> = f.effects().await.into_iter().map(|(_, n)| n).collect();
    assert_eq!(effects, vec![1, 2, 4, 6], "the others took effect, once");
    let dead = f
        .kafka
        .read_all(&f.dlq, 2, Duration::from_millis(800), WAIT)
        .await;
    let offsets: Vec<&str> = dead
        .iter()
        .map(|m| m.header(dlq_headers::ORIGINAL_OFFSET).unwrap())
        .collect();
    assert_eq!(offsets, ["2", "4"], "the two culprits, and only they");
    // A NUL in an emitted header is refused by the outbox at once, in any mode (it would be refused the
    // same way again): dead-lettered on its first attempt, with the reason.
    let (header, result) = (&dead[0], &dead[1]);
    assert_eq!(header.header(dlq_headers::REASON), Some("handler-failed"));
    assert_eq!(header.header(dlq_headers::ATTEMPTS), Some("1"));
    let error = header.header(dlq_headers::ERROR).unwrap_or_default();
    assert!(error.contains("NUL"), "{error}");
    {
        let m = result;
        assert_eq!(m.header(dlq_headers::REASON), Some("retries-exhausted"));
        assert_eq!(
            m.header(dlq_headers::ATTEMPTS),
            Some("4"),
            "the budget was spent"
        );
    }
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dlq_a_dead_letter_the_topic_refuses_goes_as_a_truncated_copy_and_the_partition_flows() {
    // The dead-letter topic itself refuses messages over 2,000 bytes: the copy without the payload fits.
    let letter = dead_letter_refused_by_a_topic_of("dlq-too-large", "2000").await;
    assert_eq!(
        letter.header("ce_type"),
        Some("Ping"),
        "the framework's headers are kept"
    );
    // Over 700 bytes: only the minimal copy fits.
    let letter = dead_letter_refused_by_a_topic_of("dlq-much-too-large", "700").await;
    assert_eq!(letter.header("ce_type"), None, "a minimal copy");
}

/// Runs a permanent failure with a large payload and a long error against a dead-letter topic with
/// `max.message.bytes` = `limit`; checks that the partition flows and returns the dead letter.
async fn dead_letter_refused_by_a_topic_of(
    name: &str,
    limit: &str,
) -> saga_test_support::ReadMessage {
    let f = Fixture::with_dlq_config(name, 1, &[("max.message.bytes", limit)]).await;
    f.ping("k-1", &ping(1)).await;
    f.ping(
        "k-2",
        &Ping {
            permanent: true,
            pad: "x".repeat(5_000),
            ..ping(2)
        },
    )
    .await;
    f.ping("k-3", &ping(3)).await;
    let running = f.start(f.consumer(RecordPing::new(&f.topic)));
    f.wait_for_committed(BTreeMap::from([(0, 3)])).await;
    let effects: Vec<i64> = f.effects().await.into_iter().map(|(_, n)| n).collect();
    assert_eq!(effects, vec![1, 3], "the partition kept flowing");
    let mut dead = f
        .kafka
        .read_all(&f.dlq, 1, Duration::from_millis(800), WAIT)
        .await;
    running.stop().await;
    assert_eq!(dead.len(), 1);
    let letter = dead.remove(0);
    assert_eq!(letter.header(dlq_headers::TRUNCATED), Some("true"));
    assert_eq!(letter.header(dlq_headers::ORIGINAL_OFFSET), Some("1"));
    assert_eq!(letter.header(dlq_headers::REASON), Some("handler-failed"));
    assert_eq!(
        letter.header("idempotency-key"),
        Some("k-2"),
        "its identity is kept"
    );
    assert_eq!(letter.key.as_deref(), Some("k-2"));
    assert!(letter.payload.is_empty(), "the payload was dropped");
    let error = letter.header(dlq_headers::ERROR).unwrap();
    assert!(
        error.len() <= dlq_headers::MAX_ERROR_BYTES,
        "{}",
        error.len()
    );
    assert!(
        error.starts_with("[the dead-letter topic refused the message"),
        "{error}"
    );
    letter
}

/// Records the database backend each message's transaction ran on: `effects.n` is `pg_backend_pid()`.
#[derive(Clone)]
struct RecordBackend {
    topic: String,
}

impl SagaStep for RecordBackend {
    type Payload = Ping;

    fn name(&self) -> StepName {
        StepName::from_static("record-backend")
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        vec![Subscription::new(&self.topic, "Ping")]
    }

    async fn handle(&self, msg: &Message<Ping>, ctx: &mut StepContext<'_>) -> StepResult {
        tokio::time::sleep(Duration::from_millis(msg.payload().sleep_ms)).await;
        sqlx::query("INSERT INTO effects (step_key, n) VALUES ($1, pg_backend_pid())")
            .bind(step_key(msg, "record-backend"))
            .execute(ctx.conn())
            .await?;
        Ok(StepOutcome::completed())
    }
}

/// Ends the backend that ran `step_key`'s transaction, and waits until it is gone.
async fn terminate_backend_of(url: &str, step_key: &str) -> i64 {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let pid: i64 = sqlx::query_scalar("SELECT n FROM effects WHERE step_key = $1")
        .bind(step_key)
        .fetch_one(&pool)
        .await
        .unwrap();
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1::int)")
        .bind(pid)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(ended, "backend {pid} was ended");
    wait_until("the backend to exit", WAIT, || async {
        let alive: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = $1")
            .bind(i32::try_from(pid).unwrap())
            .fetch_one(&pool)
            .await
            .unwrap();
        (alive == 0).then_some(())
    })
    .await;
    pool.close().await;
    pid
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_keeps_its_connection_between_batches_and_replaces_a_broken_one_at_once() {
    let f = Fixture::new("connection", 1).await;
    // The first message holds its transaction open long enough for every other one to queue up behind it,
    // so that the batches after it run back to back.
    f.ping(
        "k-0",
        &Ping {
            n: 0,
            sleep_ms: 1000,
            ..Ping::default()
        },
    )
    .await;
    for n in 1..=24 {
        f.ping(&format!("k-{n}"), &ping(n)).await;
    }
    // Right after the first commit, while the worker keeps that transaction's connection for its next
    // batch, the server ends the backend behind it.
    let killed: Arc<Mutex<Option<i64>>> = Arc::default();
    let hooks = {
        let (killed, url, runtime) = (
            killed.clone(),
            f.db.url(),
            tokio::runtime::Handle::current(),
        );
        Hooks::default().on_db_commit(move |_| {
            let mut killed = killed.lock().unwrap();
            if killed.is_none() {
                let pid = std::thread::scope(|s| {
                    s.spawn(|| runtime.block_on(terminate_backend_of(&url, "k-0:record-backend")))
                        .join()
                        .unwrap()
                });
                *killed = Some(pid);
            }
        })
    };
    let running = f.start(
        f.consumer(RecordBackend {
            topic: f.topic.clone(),
        })
        .batch_size(5)
        .concurrency(1)
        .hooks(hooks),
    );
    f.wait_for_committed(BTreeMap::from([(0, 25)])).await;
    let effects = f.effects().await;
    let keys: std::collections::BTreeSet<_> = effects.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        (effects.len(), keys.len()),
        (25, 25),
        "each message took effect once"
    );
    let killed = killed
        .lock()
        .unwrap()
        .expect("the first commit ended its backend");
    let after: std::collections::BTreeSet<i64> = effects
        .iter()
        .map(|(_, pid)| *pid)
        .filter(|pid| *pid != killed)
        .collect();
    assert_eq!(
        after.len(),
        1,
        "the batches after the first ran on one kept connection: backends {after:?}"
    );
    // The first batch (the slow message and whatever had arrived with it), then 24 messages or fewer in
    // batches of 5: a batch whose BEGIN failed on the broken connection would have been waited out as a
    // lost database or gone through one message per transaction.
    let transactions = running
        .ops
        .sample("saga_consumer_batch_size_count", "")
        .unwrap();
    assert!(
        transactions <= 6.0,
        "the broken connection was replaced at once: {transactions} transactions for 25 messages"
    );
    assert_eq!(
        running
            .ops
            .sample("saga_consumer_database_unreachable_total", ""),
        Some(0.0),
        "no transaction waited for the database"
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_keeping_connections_leave_room_in_a_pool_no_larger_than_their_number() {
    let f = Fixture::new("small-pool", 2).await;
    for n in 0..120 {
        f.ping(&format!("k-{n}"), &ping(n)).await;
    }
    // As many connections as workers: every batch's crash-loop record needs one beside the transaction.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&f.db.url())
        .await
        .unwrap();
    let running = f.start(
        f.consumer(RecordPing::new(&f.topic))
            .pool(pool)
            .batch_size(10)
            .concurrency(2),
    );
    f.wait_for_effects(120).await;
    let committed = running
        .ops
        .sample("saga_consumer_batch_size_sum", "")
        .unwrap();
    assert_eq!(committed, 120.0, "every message committed once");
    let keys: std::collections::BTreeSet<String> =
        f.effects().await.into_iter().map(|(k, _)| k).collect();
    assert_eq!(keys.len(), 120);
    running.stop().await;
}

/// A connection to the server's administrative database (`DATABASE_URL`), outside the test's database.
async fn admin_connection() -> sqlx::PgConnection {
    let url = saga_test_support::services().await.database_url.clone();
    <sqlx::PgConnection as sqlx::Connection>::connect(&url)
        .await
        .unwrap()
}

/// Ends every session of `database` but the caller's, as a server going away or a switchover does.
async fn terminate_sessions_of(admin: &mut sqlx::PgConnection, database: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = $1 AND pid <> pg_backend_pid()",
    )
    .bind(database)
    .fetch_one(admin)
    .await
    .unwrap()
}

/// How many dead letters the fixture's dead-letter topic holds.
async fn dead_letters(f: &Fixture) -> i64 {
    f.kafka.end_offsets(&f.dlq).await.values().sum()
}

/// A consumer that would dead-letter a message at its first counted failure.
fn with_no_retries(
    builder: saga_consumer::SagaConsumerBuilder,
) -> saga_consumer::SagaConsumerBuilder {
    builder.retry(
        RetryPolicy::default()
            .max_attempts(1)
            .backoff(Duration::from_millis(50), Duration::from_millis(200)),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_a_backend_ended_in_the_middle_of_a_slow_handler_is_waited_out_not_dead_lettered()
{
    let f = Fixture::new("failover-terminate", 1).await;
    let running = f.start(with_no_retries(f.consumer(RecordPing::new(&f.topic))).batch_size(1));
    // The first message's handler sleeps inside its transaction; meanwhile its backend is ended.
    f.ping(
        "k-0",
        &Ping {
            n: 0,
            sleep_ms: 2_000,
            ..Ping::default()
        },
    )
    .await;
    for n in 1..10 {
        f.ping(&format!("k-{n}"), &ping(n)).await;
    }
    let url = f.db.url();
    let schema = f.db.schema.clone();
    let ended = wait_until("the handler's transaction to be open", WAIT, || {
        let (url, schema) = (url.clone(), schema.clone());
        async move {
            let pool = sqlx::PgPool::connect(&url).await.ok()?;
            let ended: Option<bool> = sqlx::query_scalar(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE application_name = $1 AND state = 'idle in transaction' LIMIT 1",
            )
            .bind(&schema)
            .fetch_optional(&pool)
            .await
            .ok()?;
            pool.close().await;
            ended.filter(|e| *e)
        }
    })
    .await;
    assert!(ended);
    f.wait_for_committed(BTreeMap::from([(0, 10)])).await;
    let effects = f.effects().await;
    let keys: std::collections::BTreeSet<_> = effects.iter().map(|(k, _)| k.clone()).collect();
    assert_eq!((effects.len(), keys.len()), (10, 10), "every effect once");
    assert_eq!(dead_letters(&f).await, 0, "no message dead-lettered");
    assert!(
        running.metric("saga_consumer_database_unreachable_total", "") >= 1.0,
        "the ended backend was waited out as an unavailable database"
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_a_database_read_only_for_a_while_is_waited_out_not_dead_lettered() {
    let f = Fixture::in_own_database("failover-ro", 2).await;
    let database = f.db.database().to_owned();
    let running = f.start(with_no_retries(f.consumer(RecordPing::new(&f.topic))).batch_size(5));
    for n in 0..10 {
        f.ping(&format!("k-{n}"), &ping(n)).await;
    }
    f.wait_for_effects(10).await;

    // A switchover: the sessions end, and new ones land on a server that is read-only for a while.
    let mut admin = admin_connection().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE {database} SET default_transaction_read_only = on"
    )))
    .execute(&mut admin)
    .await
    .unwrap();
    terminate_sessions_of(&mut admin, &database).await;
    for n in 10..30 {
        f.ping(&format!("k-{n}"), &ping(n)).await;
    }
    wait_until(
        "the consumer to meet the read-only database",
        WAIT,
        || async {
            (running.metric("saga_consumer_database_unreachable_total", "") >= 1.0).then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        f.db.count("effects").await,
        10,
        "nothing was written while read-only"
    );
    // The new primary takes writes. Connections opened meanwhile stay read-only: the consumer must not
    // keep using them.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE {database} RESET default_transaction_read_only"
    )))
    .execute(&mut admin)
    .await
    .unwrap();

    f.wait_for_effects(30).await;
    f.wait_for_committed(f.kafka.end_offsets(&f.topic).await)
        .await;
    let effects = f.effects().await;
    let keys: std::collections::BTreeSet<_> = effects.iter().map(|(k, _)| k.clone()).collect();
    assert_eq!((effects.len(), keys.len()), (30, 30), "every effect once");
    assert_eq!(dead_letters(&f).await, 0, "no message dead-lettered");
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retry_a_replay_on_the_retry_topic_is_routed_by_its_original_topic_and_dead_lettered_under_it()
 {
    let f = Fixture::new("retry-topic", 1).await;
    let retry = format!("{}.retry", f.group);
    let running = f.start(f.consumer(RecordPing::new(&f.topic)).batch_size(1));
    let replay = |key: &'static str, ping: Ping, original: Option<(&'static str, &'static str)>| {
        let (f, retry) = (&f, retry.clone());
        async move {
            let payload = serde_json::to_vec(&ping).unwrap();
            let mut headers = vec![("idempotency-key", key), ("ce_type", "Ping")];
            let topic = f.topic.clone();
            if let Some((partition, offset)) = original {
                headers.extend([
                    ("saga-replay-original-topic", topic.as_str()),
                    ("saga-replay-original-partition", partition),
                    ("saga-replay-original-offset", offset),
                    ("saga-replay-count", "1"),
                ]);
            }
            f.kafka
                .produce(&f.producer, &retry, Some(key), &headers, &payload)
                .await
        }
    };
    // A replay: processed by the step of the original topic.
    replay("k-1", ping(1), Some(("0", "41"))).await;
    // A replay that fails again: dead-lettered under its original coordinates, not the retry topic's.
    replay(
        "k-2",
        Ping {
            n: 2,
            permanent: true,
            ..Ping::default()
        },
        Some(("0", "42")),
    )
    .await;
    // A message on the retry topic that is no replay: dead-lettered as undecodable, naming the header.
    replay("k-3", ping(3), None).await;
    f.wait_for_effects(1).await;
    let letters = f
        .kafka
        .read_all(&f.dlq, 2, Duration::from_millis(500), WAIT)
        .await;
    assert_eq!(f.effects().await, [("k-1:record-ping".to_owned(), 1)]);
    let again = &letters[0];
    assert_eq!(again.header("idempotency-key"), Some("k-2"));
    assert_eq!(again.header("dlq-original-topic"), Some(f.topic.as_str()));
    assert_eq!(again.header("dlq-original-offset"), Some("42"));
    assert_eq!(again.header("dlq-reason"), Some("handler-failed"));
    assert_eq!(again.header("saga-replay-count"), Some("1"));
    let stray = &letters[1];
    assert_eq!(stray.header("idempotency-key"), Some("k-3"));
    assert_eq!(stray.header("dlq-reason"), Some("undecodable"));
    assert_eq!(stray.header("dlq-original-topic"), Some(retry.as_str()));
    assert!(
        stray
            .header("dlq-error")
            .unwrap_or_default()
            .contains("saga-replay-original-topic"),
        "{stray:?}"
    );
    wait_until(
        "every message of the retry topic committed",
        WAIT,
        || async {
            let committed = f.kafka.committed_offsets(&f.group, &retry).await;
            (committed.get(&0) == Some(&3)).then_some(())
        },
    )
    .await;
    running.stop().await;
}
