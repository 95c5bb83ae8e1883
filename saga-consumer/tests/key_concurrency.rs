//! Keys in parallel within a partition (`SAGA_KEY_CONCURRENCY`), against the real broker and PostgreSQL:
//! messages of different keys run at once, each key's effects keep their order, the committed offset is
//! the first unfinished message (never the highest finished), a key held behind its dead letter parks
//! its later messages while the other keys run, and a transient failure waits parked for its delayed retry
//! (`SAGA_RETRY_DELAYED`) while the partition goes on, through a restart of the consumer and a rebalance of
//! the group.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use saga_consumer::{OrderPolicy, RetryPolicy, SagaConsumer, SagaConsumerBuilder};
use saga_core::Subscription;
use saga_core::{Message, SagaStep, StepContext, StepError, StepName, StepOutcome, StepResult};
use saga_test_support::{TestDb, TestKafka, wait_until};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Call {
    n: i64,
    /// How long the outside call takes.
    #[serde(default)]
    sleep_ms: u64,
    /// Wait until the test opens the gate.
    #[serde(default)]
    gated: bool,
    /// Fail permanently.
    #[serde(default)]
    permanent: bool,
    /// Fail transiently this many times first.
    #[serde(default)]
    transient: u32,
}

/// A slow step: counts the calls in flight, records each effect with the order it ran in.
#[derive(Clone)]
struct SlowStep {
    topic: String,
    in_flight: Arc<AtomicUsize>,
    most_in_flight: Arc<AtomicUsize>,
    gate: watch::Receiver<bool>,
    /// Calls made, by `n`, and when each was made.
    calls: Arc<std::sync::Mutex<HashMap<i64, u32>>>,
    times: Arc<std::sync::Mutex<HashMap<i64, Vec<std::time::Instant>>>>,
}

impl SagaStep for SlowStep {
    type Payload = Call;

    fn name(&self) -> StepName {
        StepName::from_static("slow")
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        vec![Subscription::new(&self.topic, "Call")]
    }

    async fn handle(&self, msg: &Message<Call>, ctx: &mut StepContext<'_>) -> StepResult {
        let call = msg.payload();
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_in_flight.fetch_max(now, Ordering::SeqCst);
        if call.gated {
            let mut gate = self.gate.clone();
            let _ = gate.wait_for(|open| *open).await;
        }
        tokio::time::sleep(Duration::from_millis(call.sleep_ms)).await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.times
            .lock()
            .unwrap()
            .entry(call.n)
            .or_default()
            .push(std::time::Instant::now());
        let made = {
            let mut calls = self.calls.lock().unwrap();
            let made = calls.entry(call.n).or_default();
            *made += 1;
            *made
        };
        if made <= call.transient {
            return Err(StepError::transient(format!(
                "call {} failed ({made})",
                call.n
            )));
        }
        if call.permanent {
            return Err(StepError::permanent(format!(
                "call {} cannot be made",
                call.n
            )));
        }
        sqlx::query("INSERT INTO effects (key, n) VALUES ($1, $2)")
            .bind(msg.idempotency_key().to_string())
            .bind(call.n)
            .execute(ctx.conn())
            .await?;
        Ok(StepOutcome::completed())
    }
}

struct Fixture {
    db: TestDb,
    kafka: TestKafka,
    topic: String,
    group: String,
    step: SlowStep,
    open: watch::Sender<bool>,
}

impl Fixture {
    async fn new(name: &str) -> Self {
        let db = TestDb::with(name, &[saga_consumer::migrate::migrator()]).await;
        sqlx::query("CREATE TABLE effects (seq BIGSERIAL, key TEXT NOT NULL, n BIGINT NOT NULL)")
            .execute(&db.pool)
            .await
            .unwrap();
        let kafka = TestKafka::new().await;
        let topic = kafka.topic(name, 1).await;
        let group = format!("{topic}-group");
        kafka.create_topic(&format!("{topic}.dlq"), 1).await;
        kafka.create_topic(&format!("{group}.retry"), 1).await;
        let (open, gate) = watch::channel(false);
        let step = SlowStep {
            topic: topic.clone(),
            in_flight: Arc::default(),
            most_in_flight: Arc::default(),
            gate,
            calls: Arc::default(),
            times: Arc::default(),
        };
        Self {
            db,
            kafka,
            topic,
            group,
            step,
            open,
        }
    }

    /// Publishes `call` under key `key` (the Kafka key and the idempotency key's prefix).
    async fn call(&self, producer: &rdkafka::producer::FutureProducer, key: &str, call: &Call) {
        let idempotency = format!("{key}-{}", call.n);
        let payload = serde_json::to_vec(call).unwrap();
        let headers = [
            ("idempotency-key", idempotency.as_str()),
            ("ce_type", "Call"),
        ];
        self.kafka
            .produce(producer, &self.topic, Some(key), &headers, &payload)
            .await;
    }

    fn consumer(&self, key_concurrency: usize) -> SagaConsumerBuilder {
        SagaConsumer::builder()
            .brokers(self.kafka.brokers.clone())
            .group_id(self.group.clone())
            .dlq_topic(format!("{}.dlq", self.topic))
            .pool(self.db.pool.clone())
            .commit_interval(Duration::from_millis(100))
            .session_timeout(Duration::from_secs(6))
            .retry(RetryPolicy::default().max_attempts(1))
            .key_concurrency(key_concurrency)
            .step(self.step.clone())
    }

    /// Each key's effects, in the order they ran.
    async fn effects_by_key(&self) -> BTreeMap<String, Vec<i64>> {
        let rows: Vec<(String, i64)> = sqlx::query_as("SELECT key, n FROM effects ORDER BY seq")
            .fetch_all(&self.db.pool)
            .await
            .unwrap();
        let mut by_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for (key, n) in rows {
            let kafka_key = key
                .rsplit_once('-')
                .map_or(key.clone(), |(k, _)| k.to_owned());
            by_key.entry(kafka_key).or_default().push(n);
        }
        by_key
    }

    async fn committed(&self) -> Option<i64> {
        self.kafka
            .committed_offsets(&self.group, &self.topic)
            .await
            .get(&0)
            .copied()
    }

    async fn wait_for_committed(&self, offset: i64) {
        wait_until(&format!("offset {offset} committed"), WAIT, || async {
            (self.committed().await == Some(offset)).then_some(())
        })
        .await;
    }

    /// Waits until `count` effects are written.
    async fn wait_for_effects(&self, count: i64) {
        wait_until(&format!("{count} effects"), WAIT, || async {
            (self.db.count("effects").await == count).then_some(())
        })
        .await;
    }

    /// Publishes calls `(key, n, transient failures)` in order.
    async fn calls(
        &self,
        producer: &rdkafka::producer::FutureProducer,
        calls: &[(&str, i64, u32)],
    ) {
        for &(key, n, transient) in calls {
            let call = Call {
                n,
                transient,
                ..Call::default()
            };
            self.call(producer, key, &call).await;
        }
    }

    /// Waits until the message at offset 0 waits parked for its delayed retry, due later.
    async fn wait_for_parked_retry(&self) {
        wait_until("the flaky call parked", WAIT, || async {
            sqlx::query_scalar::<_, i32>(
                "SELECT attempts FROM saga_parked_messages WHERE \"offset\" = 0 AND due_at > now()",
            )
            .fetch_optional(&self.db.pool)
            .await
            .unwrap()
        })
        .await;
    }

    /// Waits until no key is held.
    async fn wait_for_no_held_key(&self) {
        wait_until("every key let go", WAIT, || async {
            (self.db.count("saga_held_keys").await == 0).then_some(())
        })
        .await;
    }

    /// The dead letters, once `expected` are there (waiting up to `timeout`) and none follows for half a
    /// second.
    async fn letters(
        &self,
        expected: usize,
        timeout: Duration,
    ) -> Vec<saga_test_support::ReadMessage> {
        self.kafka
            .read_all(
                &format!("{}.dlq", self.topic),
                expected,
                Duration::from_millis(500),
                timeout,
            )
            .await
    }
}

fn run(builder: SagaConsumerBuilder) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let consumer = builder.build().expect("a valid consumer");
    let stop = CancellationToken::new();
    let running = stop.clone().cancelled_owned();
    let handle = tokio::spawn(async move {
        consumer
            .run(running)
            .await
            .expect("the consumer stops without error");
    });
    (stop, handle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keys_run_in_parallel_within_a_partition_and_each_keys_effects_keep_their_order() {
    let f = Fixture::new("key-lanes-order").await;
    let producer = f.kafka.producer();
    // 20 keys, 5 messages each, interleaved in one partition: n counts up within each key.
    let mut expected: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for round in 0..5 {
        for k in 0..20 {
            let key = format!("k{k:02}");
            let n = round * 100 + k;
            f.call(
                &producer,
                &key,
                &Call {
                    n,
                    sleep_ms: 20,
                    ..Call::default()
                },
            )
            .await;
            expected.entry(key).or_default().push(n);
        }
    }
    // Batches of two: a key's five messages of a window run as three transactions, in order.
    let (stop, handle) = run(f.consumer(8).batch_size(2));
    f.wait_for_committed(100).await;
    assert_eq!(
        f.effects_by_key().await,
        expected,
        "every message once, each key's in offset order"
    );
    let most = f.step.most_in_flight.load(Ordering::SeqCst);
    assert!(
        (2..=8).contains(&most),
        "several keys ran at once, never more than the key concurrency: {most}"
    );
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_committed_offset_is_the_first_unfinished_message_not_the_highest_finished() {
    let f = Fixture::new("key-lanes-mark").await;
    let producer = f.kafka.producer();
    // Offset 0 waits for the gate; offsets 1..=9, other keys, finish at once.
    f.call(
        &producer,
        "slow",
        &Call {
            n: 0,
            gated: true,
            ..Call::default()
        },
    )
    .await;
    for n in 1..=9 {
        f.call(
            &producer,
            &format!("quick{n}"),
            &Call {
                n,
                ..Call::default()
            },
        )
        .await;
    }
    let (stop, handle) = run(f.consumer(4));
    f.wait_for_effects(9).await;
    // Ten commit intervals: a consumer committing the highest finished offset would have committed 10.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        f.committed().await,
        None,
        "nothing below offset 0 is finished: nothing may be committed"
    );
    f.open.send_replace(true);
    f.wait_for_committed(10).await;
    assert_eq!(f.db.count("effects").await, 10);
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_key_parks_its_later_messages_while_the_other_keys_run_in_lanes() {
    let f = Fixture::new("key-lanes-hold").await;
    let producer = f.kafka.producer();
    f.call(
        &producer,
        "bad",
        &Call {
            n: 0,
            permanent: true,
            ..Call::default()
        },
    )
    .await;
    for n in 1..=12 {
        let key = if n % 4 == 0 {
            "bad".to_owned()
        } else {
            format!("good{}", n % 4)
        };
        f.call(
            &producer,
            &key,
            &Call {
                n,
                sleep_ms: 10,
                ..Call::default()
            },
        )
        .await;
    }
    let builder = f
        .consumer(4)
        .order_policy_for_topic(f.topic.clone(), OrderPolicy::HoldKey);
    let (stop, handle) = run(builder);
    f.wait_for_committed(13).await;
    let effects = f.effects_by_key().await;
    let expected: HashMap<&str, Vec<i64>> = HashMap::from([
        ("good1", vec![1, 5, 9]),
        ("good2", vec![2, 6, 10]),
        ("good3", vec![3, 7, 11]),
    ]);
    assert_eq!(effects.len(), 3, "nothing of the held key ran: {effects:?}");
    for (key, ns) in expected {
        assert_eq!(effects[key], ns, "{key}'s effects in order");
    }
    let parked: Vec<i64> =
        sqlx::query_scalar(r#"SELECT "offset" FROM saga_parked_messages ORDER BY seq"#)
            .fetch_all(&f.db.pool)
            .await
            .unwrap();
    assert_eq!(
        parked,
        vec![4, 8, 12],
        "the held key's later messages wait, in order"
    );
    let letters = f.letters(1, WAIT).await;
    assert_eq!(letters.len(), 1, "one dead letter: the failing call");
    assert!(
        f.step.most_in_flight.load(Ordering::SeqCst) >= 2,
        "the good keys ran beside each other"
    );
    stop.cancel();
    handle.await.unwrap();
}

/// Delayed retries, one key at a time: a key's transient failure does not hold the partition (the other
/// keys run meanwhile), it waits parked with its due time and attempts (in PostgreSQL) holding its key, its
/// key's later messages run after it, in order, and nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transient_failure_waits_parked_while_the_partition_goes_on_and_its_key_keeps_its_order()
{
    let f = Fixture::new("delayed-retry").await;
    let producer = f.kafka.producer();
    for n in 0..12 {
        let key = if n % 4 == 0 {
            "flaky".to_owned()
        } else {
            format!("good{}", n % 4)
        };
        let transient = if n == 0 { 2 } else { 0 };
        f.call(
            &producer,
            &key,
            &Call {
                n,
                transient,
                ..Call::default()
            },
        )
        .await;
    }
    let retry = RetryPolicy::default()
        .max_attempts(5)
        .backoff(Duration::from_secs(2), Duration::from_secs(2))
        .delayed(true);
    let (stop, handle) = run(f.consumer(1).retry(retry));
    // Waiting: its parked row says when it runs again, and its key is held for it.
    let (attempts, due_later): (i32, bool) = wait_until("the flaky call parked", WAIT, || async {
        sqlx::query_as(
            "SELECT p.attempts, p.due_at > now() FROM saga_parked_messages p \
             JOIN saga_held_keys h USING (group_id, key) WHERE h.cause = 'retrying' AND p.\"offset\" = 0",
        )
        .fetch_optional(&f.db.pool)
        .await
        .unwrap()
    })
    .await;
    assert_eq!(attempts, 1);
    assert!(due_later, "its next attempt is due later");
    f.wait_for_committed(12).await;
    f.wait_for_effects(12).await;
    let effects = f.effects_by_key().await;
    assert_eq!(
        effects["flaky"],
        vec![0, 4, 8],
        "the flaky key's effects in order"
    );
    for k in 1..4 {
        assert_eq!(effects[&format!("good{k}")], vec![k, k + 4, k + 8]);
    }
    let order: Vec<i64> = sqlx::query_scalar("SELECT n FROM effects ORDER BY seq")
        .fetch_all(&f.db.pool)
        .await
        .unwrap();
    assert_eq!(
        order.iter().position(|n| *n == 0),
        Some(9),
        "every other key ran while the flaky call waited: {order:?}"
    );
    assert_eq!(
        f.step.calls.lock().unwrap()[&0],
        3,
        "two failures, then the call"
    );
    // Each attempt waited for its due time: the backoff less its jitter (at most a fifth).
    let times = f.step.times.lock().unwrap()[&0].clone();
    for pair in times.windows(2) {
        let waited = pair[1] - pair[0];
        assert!(
            waited >= Duration::from_millis(1_600),
            "an attempt ran {waited:?} after the one before, before its due time"
        );
    }
    f.wait_for_no_held_key().await;
    assert_eq!(f.db.count("saga_parked_messages").await, 0);
    let letters = f.letters(0, Duration::from_secs(2)).await;
    assert!(letters.is_empty(), "nothing dead-lettered");
    stop.cancel();
    handle.await.unwrap();
}

/// A delayed retry whose attempts are spent is dead-lettered once, and under the default policy (skip and
/// continue) its key is let go: its later message runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delayed_retry_spent_is_dead_lettered_once_and_its_key_let_go() {
    let f = Fixture::new("delayed-retry-spent").await;
    let producer = f.kafka.producer();
    f.call(
        &producer,
        "spent",
        &Call {
            n: 0,
            transient: u32::MAX,
            ..Call::default()
        },
    )
    .await;
    f.call(
        &producer,
        "spent",
        &Call {
            n: 1,
            ..Call::default()
        },
    )
    .await;
    let retry = RetryPolicy::default()
        .max_attempts(3)
        .backoff(Duration::from_millis(100), Duration::from_millis(100))
        .delayed(true);
    let (stop, handle) = run(f.consumer(1).retry(retry));
    f.wait_for_effects(1).await;
    let letters = f.letters(1, WAIT).await;
    assert_eq!(letters.len(), 1, "one dead letter");
    assert_eq!(letters[0].header("dlq-reason"), Some("retries-exhausted"));
    assert_eq!(f.step.calls.lock().unwrap()[&0], 3, "its three attempts");
    assert_eq!(f.effects_by_key().await["spent"], vec![1]);
    f.wait_for_no_held_key().await;
    stop.cancel();
    handle.await.unwrap();
}

/// A delayed retry's due time and attempts are in PostgreSQL: a consumer stopped while the retry waits (its
/// partition revoked) leaves it parked, and the next consumer of the group runs it when due, after which the
/// key's later message runs, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delayed_retry_waits_through_a_restart_of_the_consumer() {
    let f = Fixture::new("delayed-retry-restart").await;
    let producer = f.kafka.producer();
    f.calls(&producer, &[("flaky", 0, 2), ("flaky", 1, 0)])
        .await;
    let retry = || {
        RetryPolicy::default()
            .max_attempts(5)
            .backoff(Duration::from_secs(3), Duration::from_secs(3))
            .delayed(true)
    };
    let (stop, handle) = run(f.consumer(1).retry(retry()));
    f.wait_for_parked_retry().await;
    f.wait_for_committed(2).await;
    stop.cancel();
    handle.await.unwrap();
    assert_eq!(f.db.count("effects").await, 0, "nothing ran yet");
    assert_eq!(
        f.db.count("saga_parked_messages").await,
        2,
        "it and the key's next wait"
    );
    // The next consumer of the group: what it finds in PostgreSQL is all it knows.
    let (stop, handle) = run(f.consumer(1).retry(retry()));
    f.wait_for_effects(2).await;
    assert_eq!(f.effects_by_key().await["flaky"], vec![0, 1], "in order");
    assert_eq!(
        f.step.calls.lock().unwrap()[&0],
        3,
        "two failures, then the call"
    );
    f.wait_for_no_held_key().await;
    stop.cancel();
    handle.await.unwrap();
}

/// A rebalance while a delayed retry waits: a second consumer joins the group and the first leaves while
/// the retry's due time is ahead, and the key's next message arrives meanwhile. The group's remaining
/// consumer runs the retry when due (its attempts and due time read from PostgreSQL), each attempt after
/// its backoff; the key's effects keep their order, the other key ran while it waited, nothing is
/// dead-lettered and the key is let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delayed_retry_waits_through_a_rebalance_of_the_group() {
    let f = Fixture::new("delayed-retry-rebalance").await;
    let producer = f.kafka.producer();
    f.calls(
        &producer,
        &[("flaky", 0, 2), ("flaky", 1, 0), ("steady", 2, 0)],
    )
    .await;
    let retry = || {
        RetryPolicy::default()
            .max_attempts(5)
            .backoff(Duration::from_secs(10), Duration::from_secs(10))
            .delayed(true)
    };
    let (stop_first, first) = run(f.consumer(4).retry(retry()));
    f.wait_for_parked_retry().await;
    f.wait_for_effects(1).await;
    assert_eq!(
        f.effects_by_key().await.get("flaky"),
        None,
        "the steady key ran while the flaky one waits"
    );
    // The group rebalances: a second consumer joins, the key's next message arrives, the first leaves.
    let (stop_second, second) = run(f.consumer(4).retry(retry()));
    f.calls(&producer, &[("flaky", 3, 0)]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_first.cancel();
    first.await.unwrap();
    let first_left = std::time::Instant::now();
    f.wait_for_effects(4).await;
    let effects = f.effects_by_key().await;
    assert_eq!(
        effects["flaky"],
        vec![0, 1, 3],
        "the flaky key's effects in order"
    );
    assert_eq!(effects["steady"], vec![2]);
    assert_eq!(
        f.step.calls.lock().unwrap()[&0],
        3,
        "two failures, then the call"
    );
    // The retry waited through the rebalance (its second attempt ran after the first consumer left), and
    // each attempt waited for its due time: the backoff less its jitter (at most a fifth).
    let times = f.step.times.lock().unwrap()[&0].clone();
    assert!(
        times[1] > first_left,
        "the retry ran before the first consumer left: no rebalance while it waited"
    );
    for pair in times.windows(2) {
        let waited = pair[1] - pair[0];
        assert!(
            waited >= Duration::from_millis(8_000),
            "an attempt ran {waited:?} after the one before, before its due time"
        );
    }
    f.wait_for_no_held_key().await;
    assert_eq!(f.db.count("saga_parked_messages").await, 0);
    let letters = f.letters(0, Duration::from_secs(2)).await;
    assert!(letters.is_empty(), "nothing dead-lettered");
    stop_second.cancel();
    second.await.unwrap();
}
