//! What a replay reaches and how it is claimed, on the real broker and PostgreSQL: only the group that
//! failed sees a replay (through its retry topic), two replays started together send each letter once, a
//! new letter at a reused position of a recreated dead-letter topic is a new letter, a forged letter naming
//! another group is refused, and each send is recorded with its operator.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use saga_admin::dlq::{self, DlqFilter, ReplayOptions, ReplayOutcome};
use saga_config::KafkaConfig;
use saga_consumer::{
    Message, SagaConsumer, SagaStep, StepContext, StepError, StepName, StepOutcome, StepResult,
    Subscription,
};
use saga_test_support::{TestDb, TestKafka, wait_until};
use tokio_util::sync::CancellationToken;

use common::Target;

const WAIT: Duration = Duration::from_secs(60);

/// Records each message's key in `table`, or fails it permanently while `broken` is set.
#[derive(Clone)]
struct Record {
    topic: String,
    table: &'static str,
    broken: Arc<AtomicBool>,
}

impl SagaStep for Record {
    type Payload = serde_json::Value;

    fn name(&self) -> StepName {
        StepName::from_static("record")
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        vec![Subscription::new(&self.topic, "Thing")]
    }

    async fn handle(
        &self,
        msg: &Message<serde_json::Value>,
        ctx: &mut StepContext<'_>,
    ) -> StepResult {
        if self.broken.load(Ordering::SeqCst) {
            return Err(StepError::permanent("the step is broken"));
        }
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {} (key, offset_seen) VALUES ($1, $2)",
            self.table
        )))
        .bind(msg.idempotency_key().as_str())
        .bind(msg.payload()["n"].as_i64())
        .execute(ctx.conn())
        .await?;
        Ok(StepOutcome::completed())
    }
}

struct Fixture {
    /// The schema of the service under test (group `a`).
    db: TestDb,
    /// The schema of another service reading the same topic (group `b`).
    other: TestDb,
    kafka: TestKafka,
    topic: String,
}

/// A service's schema: the framework's tables, the toolkit's, and an effects table.
async fn service_schema(name: &str, table: &str) -> TestDb {
    let db = TestDb::with(
        name,
        &[
            saga_consumer::migrate::migrator(),
            saga_admin::dlq::migrator(),
        ],
    )
    .await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {table} (key TEXT NOT NULL, offset_seen BIGINT)"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    db
}

impl Fixture {
    async fn new(name: &str) -> Self {
        let db = service_schema(name, "effects_a").await;
        let other = service_schema(&format!("{name}-other"), "effects_b").await;
        let kafka = TestKafka::new().await;
        let topic = kafka.topic(name, 1).await;
        Self {
            db,
            other,
            kafka,
            topic,
        }
    }

    /// A consumer of group `group` (on the schema of `b` for group `b`, else the fixture's) with its own
    /// dead-letter and retry topics, created here.
    async fn consumer(&self, group: &str, table: &'static str, broken: Arc<AtomicBool>) -> Running {
        let pool = if group == "b" {
            self.other.pool.clone()
        } else {
            self.db.pool.clone()
        };
        let group = format!("{}-{group}", self.topic);
        self.kafka.create_topic(&format!("{group}.dlq"), 1).await;
        self.kafka.create_topic(&format!("{group}.retry"), 1).await;
        let consumer = SagaConsumer::builder()
            .brokers(self.kafka.brokers.clone())
            .group_id(group.clone())
            .pool(pool)
            .commit_interval(Duration::from_millis(200))
            .session_timeout(Duration::from_secs(6))
            .step(Record {
                topic: self.topic.clone(),
                table,
                broken,
            })
            .build()
            .unwrap();
        let stop = CancellationToken::new();
        let handle = tokio::spawn(consumer.run(stop.clone().cancelled_owned()));
        Running {
            group,
            stop,
            handle,
        }
    }

    async fn thing(&self, key: &str, n: i64) {
        let producer = self.kafka.producer();
        self.kafka
            .produce(
                &producer,
                &self.topic,
                Some(key),
                &[("idempotency-key", key), ("ce_type", "Thing")],
                serde_json::json!({ "n": n }).to_string().as_bytes(),
            )
            .await;
    }

    async fn effects(&self, table: &str) -> Vec<String> {
        let pool = if table == "effects_b" {
            &self.other.pool
        } else {
            &self.db.pool
        };
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT key FROM {table} ORDER BY key"
        )))
        .fetch_all(pool)
        .await
        .unwrap()
    }

    fn kafka_config(&self) -> KafkaConfig {
        KafkaConfig::new(self.kafka.brokers.clone())
    }

    /// Replays every letter of `dlq_topic` into the service's schema with `options`.
    async fn replay(
        &self,
        dlq_topic: &str,
        options: &ReplayOptions,
    ) -> Result<dlq::ReplayReport, saga_admin::AdminError> {
        dlq::replay(
            &self.kafka_config(),
            &self.db.pool,
            dlq_topic,
            &DlqFilter::default(),
            options,
        )
        .await
    }

    /// Records in the schema that `group` writes `dlq` and reads `retry`, as its consumer does at start.
    async fn record_group(&self, group: &str, dlq: &str, retry: &str) {
        sqlx::query(
            "INSERT INTO saga_consumer_groups (group_id, dlq_topic, retry_topic, topics) \
             VALUES ($1, $2, $3, ARRAY[$4])",
        )
        .bind(group)
        .bind(dlq)
        .bind(retry)
        .bind(&self.topic)
        .execute(&self.db.pool)
        .await
        .unwrap();
    }

    /// Writes a dead letter of `group` to `dlq` by hand, for message `n` of key `key`.
    async fn letter(&self, dlq: &str, group: &str, key: &str, n: i64) -> (i32, i64) {
        let producer = self.kafka.producer();
        let failed_at = chrono::Utc::now().to_rfc3339();
        let offset = n.to_string();
        self.kafka
            .produce(
                &producer,
                dlq,
                Some(key),
                &[
                    ("idempotency-key", key),
                    ("ce_type", "Thing"),
                    ("dlq-original-topic", &self.topic),
                    ("dlq-original-partition", "0"),
                    ("dlq-original-offset", &offset),
                    ("dlq-consumer-group", group),
                    ("dlq-step", "record"),
                    ("dlq-reason", "handler-failed"),
                    ("dlq-error", "the step is broken"),
                    ("dlq-attempts", "1"),
                    ("dlq-failed-at", &failed_at),
                ],
                serde_json::json!({ "n": n }).to_string().as_bytes(),
            )
            .await
    }
}

struct Running {
    group: String,
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<Result<(), saga_consumer::ConsumerError>>,
}

impl Running {
    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(WAIT, self.handle)
            .await
            .expect("the consumer stops")
            .unwrap()
            .unwrap();
    }
}

fn sent(report: &dlq::ReplayReport) -> Vec<(i64, ReplayOutcome)> {
    report
        .letters
        .iter()
        .map(|l| (l.offset, l.outcome.clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replay_reaches_only_the_group_that_failed_and_it_processes_the_message_once() {
    let f = Fixture::new("replay-scope").await;
    let broken = Arc::new(AtomicBool::new(true));
    let a = f.consumer("a", "effects_a", broken.clone()).await;
    let b = f
        .consumer("b", "effects_b", Arc::new(AtomicBool::new(false)))
        .await;
    f.thing("order-1", 1).await;
    let dlq_topic = format!("{}.dlq", a.group);
    let kafka = f.kafka_config();
    wait_until("group a dead-lettered the message", WAIT, || async {
        let letters = dlq::list(&kafka, &f.db.pool, &dlq_topic, &DlqFilter::default())
            .await
            .ok()?;
        (letters.len() == 1).then_some(())
    })
    .await;
    wait_until("group b processed it", WAIT, || async {
        (f.effects("effects_b").await.len() == 1).then_some(())
    })
    .await;

    // The step is mended; the dead letter is replayed.
    broken.store(false, Ordering::SeqCst);
    let options = ReplayOptions::default().by("alice");
    let report = f.replay(&dlq_topic, &options).await.unwrap();
    assert_eq!(report.group, a.group);
    assert_eq!(report.retry_topic, format!("{}.retry", a.group));
    assert!(
        matches!(&sent(&report)[..], [(0, ReplayOutcome::Sent { topic, .. })] if *topic == report.retry_topic),
        "{report:?}"
    );
    wait_until("group a processed the replay", WAIT, || async {
        (f.effects("effects_a").await == ["order-1"]).then_some(())
    })
    .await;

    // Again: nothing is sent. Forced: sent, and absorbed by the step key.
    let again = f.replay(&dlq_topic, &options).await.unwrap();
    assert_eq!(sent(&again), [(0, ReplayOutcome::AlreadyReplayed)]);
    let mut forced = options.clone();
    forced.force = true;
    let forced = f.replay(&dlq_topic, &forced).await.unwrap();
    assert_eq!(forced.sent(), 1);
    let retry_topic = report.retry_topic.clone();
    wait_until("group a committed both replays", WAIT, || async {
        let committed = f.kafka.committed_offsets(&a.group, &retry_topic).await;
        (committed.get(&0) == Some(&2)).then_some(())
    })
    .await;
    assert_eq!(f.effects("effects_a").await, ["order-1"], "processed once");

    // The original topic holds the one message it was given; the other group saw nothing more.
    assert_eq!(f.kafka.end_offsets(&f.topic).await.get(&0), Some(&1));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(f.effects("effects_b").await, ["order-1"]);
    let committed_b = f.kafka.committed_offsets(&b.group, &f.topic).await;
    assert_eq!(committed_b.get(&0), Some(&1));
    assert_eq!(
        f.kafka
            .end_offsets(&format!("{}.retry", b.group))
            .await
            .get(&0),
        Some(&0),
        "nothing reached the other group's retry topic"
    );

    // Both sends are recorded, with their operator.
    let log = dlq::replays(&f.db.pool, Some(&dlq_topic), 10)
        .await
        .unwrap();
    assert_eq!(log.len(), 2);
    assert!(
        log.iter()
            .all(|r| r.operator == "alice" && r.group == a.group)
    );
    assert_eq!(
        log.iter().map(|r| r.forced).collect::<Vec<_>>(),
        [true, false]
    );
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replays_of_the_same_letters_started_together_send_each_letter_once() {
    let f = Fixture::new("replay-race").await;
    let group = format!("{}-g", f.topic);
    let (dlq_topic, retry_topic) = (format!("{group}.dlq"), format!("{group}.retry"));
    f.kafka.create_topic(&dlq_topic, 1).await;
    f.kafka.create_topic(&retry_topic, 1).await;
    f.record_group(&group, &dlq_topic, &retry_topic).await;
    for n in 0..8 {
        f.letter(&dlq_topic, &group, &format!("order-{n}"), n).await;
    }
    let kafka = f.kafka_config();
    let run = |who: &'static str| {
        let (kafka, pool, dlq_topic) = (kafka.clone(), f.db.pool.clone(), dlq_topic.clone());
        tokio::spawn(async move {
            dlq::replay(
                &kafka,
                &pool,
                &dlq_topic,
                &DlqFilter::default(),
                &ReplayOptions::default().by(who),
            )
            .await
            .unwrap()
        })
    };
    let (first, second) = tokio::join!(run("alice"), run("bob"));
    let (first, second) = (first.unwrap(), second.unwrap());
    assert_eq!(
        first.sent() + second.sent(),
        8,
        "each letter sent by one of them: {first:?} {second:?}"
    );
    for (a, b) in first.letters.iter().zip(&second.letters) {
        let sent = [&a.outcome, &b.outcome]
            .iter()
            .filter(|o| matches!(o, ReplayOutcome::Sent { .. }))
            .count();
        assert_eq!(
            sent, 1,
            "letter {}: {:?} / {:?}",
            a.offset, a.outcome, b.outcome
        );
    }
    assert_eq!(f.kafka.end_offsets(&retry_topic).await.get(&0), Some(&8));
    assert_eq!(f.kafka.end_offsets(&f.topic).await.get(&0), Some(&0));
    let log = dlq::replays(&f.db.pool, Some(&dlq_topic), 100)
        .await
        .unwrap();
    assert_eq!(log.len(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_letter_at_the_position_of_a_replayed_one_in_a_recreated_topic_is_replayed() {
    let f = Fixture::new("replay-reused").await;
    let group = format!("{}-g", f.topic);
    let (dlq_topic, retry_topic) = (format!("{group}.dlq"), format!("{group}.retry"));
    f.kafka.create_topic(&dlq_topic, 1).await;
    f.kafka.create_topic(&retry_topic, 1).await;
    f.record_group(&group, &dlq_topic, &retry_topic).await;
    let options = ReplayOptions::default().by("alice");

    assert_eq!(f.letter(&dlq_topic, &group, "order-1", 1).await, (0, 0));
    let first = f.replay(&dlq_topic, &options).await.unwrap();
    assert_eq!(first.sent(), 1);

    // The dead-letter topic is deleted and made again: offsets start over.
    f.kafka.delete_topic(&dlq_topic).await;
    f.kafka.create_topic(&dlq_topic, 1).await;
    assert_eq!(
        f.letter(&dlq_topic, &group, "order-2", 2).await,
        (0, 0),
        "the new letter sits where the replayed one did"
    );
    let second = f.replay(&dlq_topic, &options).await.unwrap();
    assert!(
        matches!(&sent(&second)[..], [(0, ReplayOutcome::Sent { .. })]),
        "{second:?}"
    );
    let again = f.replay(&dlq_topic, &options).await.unwrap();
    assert_eq!(sent(&again), [(0, ReplayOutcome::AlreadyReplayed)]);
    let replayed: Vec<String> = f
        .kafka
        .read_all(&retry_topic, 2, Duration::from_millis(500), WAIT)
        .await
        .iter()
        .map(|m| m.header("idempotency-key").unwrap().to_owned())
        .collect();
    assert_eq!(replayed, ["order-1", "order-2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_letter_naming_another_group_or_none_is_refused_and_nothing_is_sent() {
    let f = Fixture::new("replay-forged").await;
    let group = format!("{}-g", f.topic);
    let (dlq_topic, retry_topic) = (format!("{group}.dlq"), format!("{group}.retry"));
    f.kafka.create_topic(&dlq_topic, 1).await;
    f.kafka.create_topic(&retry_topic, 1).await;
    f.record_group(&group, &dlq_topic, &retry_topic).await;
    f.letter(&dlq_topic, "payments", "order-1", 1).await;
    f.letter(&dlq_topic, "", "order-2", 2).await;
    f.letter(&dlq_topic, &group, "order-3", 3).await;
    let report = f
        .replay(&dlq_topic, &ReplayOptions::default())
        .await
        .unwrap();
    assert!(
        matches!(
            &sent(&report)[..],
            [
                (0, ReplayOutcome::RefusedForeignGroup { group: named }),
                (1, ReplayOutcome::RefusedForeignGroup { group: none }),
                (2, ReplayOutcome::Sent { .. }),
            ] if named == "payments" && none.is_empty()
        ),
        "{report:?}"
    );
    assert_eq!(f.kafka.end_offsets(&retry_topic).await.get(&0), Some(&1));

    // A topic no group of the schema writes is refused as a whole.
    let stray = common::dlq_topic(&f.kafka, "replay-stray", 1).await;
    f.letter(&stray, &group, "order-4", 4).await;
    let refused = f
        .replay(&stray, &ReplayOptions::default())
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("no consumer group"),
        "{refused}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_command_records_who_replayed_and_dlq_replays_lists_them() {
    let f = Fixture::new("replay-operator").await;
    let group = format!("{}-g", f.topic);
    let (dlq_topic, retry_topic) = (format!("{group}.dlq"), format!("{group}.retry"));
    f.kafka.create_topic(&dlq_topic, 1).await;
    f.kafka.create_topic(&retry_topic, 1).await;
    f.record_group(&group, &dlq_topic, &retry_topic).await;
    f.letter(&dlq_topic, &group, "order-1", 1).await;
    f.letter(&dlq_topic, &group, "order-2", 2).await;
    let saga = Target {
        database_url: TestDb::database_url(),
        schema: f.db.schema.clone(),
        brokers: f.kafka.brokers.clone(),
    };
    // By name, and by default the OS user.
    saga.text(&[
        "dlq",
        "replay",
        "--topic",
        &dlq_topic,
        "--offset",
        "0",
        "--partition",
        "0",
        "--operator",
        "carol",
    ])
    .await;
    let mut by_user = saga.command(&["dlq", "replay", "--topic", &dlq_topic]);
    by_user.env("USER", "dave");
    assert!(by_user.output().await.unwrap().status.success());
    let listed = saga.json(&["dlq", "replays", "--topic", &dlq_topic]).await;
    let who: Vec<(&str, &str)> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["idempotency_key"].as_str().unwrap(),
                r["operator"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(who, [("order-2", "dave"), ("order-1", "carol")]);
    let table = saga.text(&["dlq", "replays"]).await;
    assert!(
        table.contains("carol") && table.contains(&retry_topic),
        "{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crafted_header_makes_its_own_letter_unreadable_and_hides_no_other() {
    let f = Fixture::new("replay-crafted").await;
    let a = f
        .consumer("a", "effects_a", Arc::new(AtomicBool::new(true)))
        .await;
    let group = a.group.clone();
    let dlq_topic = format!("{group}.dlq");
    // A plain message, then one carrying a replay count no replay wrote: the consumer dead-letters both,
    // copying the second's headers into its letter.
    f.thing("order-1", 1).await;
    f.kafka
        .produce(
            &f.kafka.producer(),
            &f.topic,
            Some("order-2"),
            &[
                ("idempotency-key", "order-2"),
                ("ce_type", "Thing"),
                ("saga-replay-count", "x"),
            ],
            br#"{"n":2}"#,
        )
        .await;
    // Both dead-lettered, and indexed by the consumer (before their offsets moved, before anything read
    // the topic).
    wait_until("both dead-lettered and indexed", WAIT, || async {
        let indexed: i64 =
            sqlx::query_scalar("SELECT count(*) FROM saga_dead_letters WHERE dlq_topic = $1")
                .bind(&dlq_topic)
                .fetch_one(&f.db.pool)
                .await
                .unwrap();
        (indexed == 2).then_some(())
    })
    .await;
    a.stop().await;
    assert_eq!(f.kafka.end_offsets(&dlq_topic).await.get(&0), Some(&2));

    let listed = dlq::list(
        &f.kafka_config(),
        &f.db.pool,
        &dlq_topic,
        &DlqFilter::default(),
    )
    .await
    .unwrap();
    // The index holds them as the consumer wrote them; the topic holds the same letters.
    let letters = dlq::with_records(&f.kafka_config(), &f.db.pool, listed.clone())
        .await
        .unwrap();
    assert_eq!(letters.len(), 2);
    for (indexed, read) in listed.iter().zip(&letters) {
        assert_eq!(indexed.identity(), read.identity());
        assert_eq!(
            (&indexed.reason, &indexed.unreadable, &indexed.error),
            (&read.reason, &read.unreadable, &read.error)
        );
    }
    let read: Vec<(Option<&str>, &str, bool)> = letters
        .iter()
        .map(|l| {
            (
                l.idempotency_key.as_deref(),
                l.reason.as_str(),
                l.unreadable.is_some(),
            )
        })
        .collect();
    assert_eq!(
        read,
        [
            (Some("order-1"), "handler-failed", false),
            (Some("order-2"), dlq::UNREADABLE, true),
        ]
    );
    assert!(
        letters[1].error.contains("saga-replay-count"),
        "{}",
        letters[1].error
    );
    // Counted, each under its reason; the strict parser names the header.
    let counts = dlq::counts(
        &f.kafka_config(),
        &f.db.pool,
        std::slice::from_ref(&dlq_topic),
    )
    .await
    .unwrap();
    assert_eq!(
        counts.values().copied().collect::<Vec<_>>(),
        [1, 1],
        "{counts:?}"
    );
    if std::env::var_os("SAGA_UPDATE_CORPUS").is_some() {
        write_fuzz_corpus(&letters);
    }
    let strict = dlq::DeadLetter::parse(&dlq_topic, letters[1].record.clone()).unwrap_err();
    assert!(strict.to_string().contains("saga-replay-count"), "{strict}");

    // The groups (and so `/metrics`) show both; the readable letter is replayed, the unreadable refused.
    let saga = Target {
        database_url: TestDb::database_url(),
        schema: f.db.schema.clone(),
        brokers: f.kafka.brokers.clone(),
    };
    let groups = saga.json(&["dlq", "groups"]).await;
    let mut reasons: Vec<(String, u64)> = groups
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["reason"].as_str().unwrap().to_owned(),
                g["open"].as_u64().unwrap(),
            )
        })
        .collect();
    reasons.sort();
    assert_eq!(
        reasons,
        [
            ("handler-failed".to_owned(), 1),
            (dlq::UNREADABLE.to_owned(), 1)
        ]
    );
    let report = f
        .replay(&dlq_topic, &ReplayOptions::default())
        .await
        .unwrap();
    assert!(
        matches!(
            &sent(&report)[..],
            [
                (0, ReplayOutcome::Sent { .. }),
                (1, ReplayOutcome::RefusedUnreadable { problem }),
            ] if problem.contains("saga-replay-count")
        ),
        "{report:?}"
    );
    assert_eq!(
        f.kafka.end_offsets(&format!("{group}.retry")).await.get(&0),
        Some(&1)
    );

    // And it can be discarded: its group closes.
    let unreadable = groups
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["reason"] == dlq::UNREADABLE)
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let discarded = saga
        .json(&["dlq", "discard", "--group", &unreadable, "--yes"])
        .await;
    assert_eq!(discarded["done"], 1, "{discarded}");
    let open: Vec<u64> = saga
        .json(&["dlq", "groups"])
        .await
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["open"].as_u64().unwrap())
        .collect();
    assert_eq!(open, [0, 0], "replayed and discarded");
}

/// Writes `letters`, as the consumer wrote them, into the letter parser's fuzz corpus
/// (`fuzz/corpus/dead_letter`), in the target's input format: header names and values, then the payload,
/// separated by `0xFF`.
fn write_fuzz_corpus(letters: &[dlq::DeadLetter]) {
    use sha2::Digest;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/dead_letter");
    std::fs::create_dir_all(&dir).unwrap();
    for letter in letters {
        let mut input = Vec::new();
        for (name, value) in &letter.record.headers {
            input.extend_from_slice(name.as_bytes());
            input.push(0xFF);
            input.extend_from_slice(value.as_deref().unwrap_or_default());
            input.push(0xFF);
        }
        input.extend_from_slice(letter.record.payload.as_deref().unwrap_or_default());
        let name: String = sha2::Sha256::digest(&input)[..20]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        std::fs::write(dir.join(name), input).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keys_the_index_cannot_hold_as_they_are_stop_neither_the_partition_nor_the_listing() {
    let f = Fixture::new("replay-nul").await;
    let a = f
        .consumer("a", "effects_a", Arc::new(AtomicBool::new(false)))
        .await;
    let group = a.group.clone();
    let dlq_topic = format!("{group}.dlq");
    // Two messages whose keys the consumer cannot read (a NUL byte; far too long, and not compressible
    // under an index row's 2.7 KB), dead-lettered as undecodable with their headers; then a message that
    // runs.
    let long = incompressible(5_000);
    for key in ["a\u{0}b", long.as_str()] {
        f.kafka
            .produce(
                &f.kafka.producer(),
                &f.topic,
                Some("k"),
                &[("idempotency-key", key), ("ce_type", "Thing")],
                br#"{"n":1}"#,
            )
            .await;
    }
    f.thing("order-3", 3).await;
    wait_until("the third message processed", WAIT, || async {
        (f.effects("effects_a").await == ["order-3"]).then_some(())
    })
    .await;
    let indexed: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT reason, idempotency_key FROM saga_dead_letters WHERE dlq_topic = $1 ORDER BY dlq_offset",
    )
    .bind(&dlq_topic)
    .fetch_all(&f.db.pool)
    .await
    .unwrap();
    assert_eq!(indexed.len(), 2, "{indexed:?}");
    assert!(indexed.iter().all(|(reason, _)| reason == "undecodable"));
    let keys: Vec<&str> = indexed.iter().filter_map(|(_, k)| k.as_deref()).collect();
    assert!(
        keys.iter().all(|k| !k.contains('\0') && k.len() <= 512),
        "{keys:?}"
    );
    a.stop().await;
    // The toolkit lists them, and the groups count them.
    let listed = dlq::list(
        &f.kafka_config(),
        &f.db.pool,
        &dlq_topic,
        &DlqFilter::default(),
    )
    .await
    .unwrap();
    assert_eq!(listed.len(), 2);
    let counts = dlq::counts(
        &f.kafka_config(),
        &f.db.pool,
        std::slice::from_ref(&dlq_topic),
    )
    .await
    .unwrap();
    assert_eq!(counts.values().sum::<usize>(), 2, "{counts:?}");
    // Replayed: each is sent once and its send recorded, its key kept as the index keeps it; a second
    // replay sends nothing.
    let options = ReplayOptions::default().by("alice");
    let report = f.replay(&dlq_topic, &options).await.unwrap();
    assert_eq!(report.sent(), 2, "{report:?}");
    assert_eq!(f.replay(&dlq_topic, &options).await.unwrap().sent(), 0);
    let logged: Vec<Option<String>> =
        sqlx::query_scalar("SELECT idempotency_key FROM saga_dlq_replay_log WHERE dlq_topic = $1")
            .bind(&dlq_topic)
            .fetch_all(&f.db.pool)
            .await
            .unwrap();
    assert_eq!(logged.len(), 2, "{logged:?}");
    assert!(
        logged
            .iter()
            .flatten()
            .all(|k| !k.contains('\0') && k.len() <= 512),
        "{logged:?}"
    );
    assert_eq!(
        f.kafka
            .end_offsets(&report.retry_topic)
            .await
            .values()
            .sum::<i64>(),
        2,
        "each sent once"
    );
}

/// `len` characters PostgreSQL cannot compress much (an xorshift over 64 symbols).
fn incompressible(len: usize) -> String {
    const SYMBOLS: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(SYMBOLS[(x % 64) as usize])
        })
        .collect()
}
