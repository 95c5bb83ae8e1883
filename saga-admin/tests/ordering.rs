//! Per-key order through failures, end to end on the real broker and the real PostgreSQL.
//!
//! The story: `OrderCreated` of order 7 is dead-lettered (the payment gateway is down), then
//! `OrderCancelled` of order 7 arrives. Without a policy the cancel runs at once and the replayed create
//! charges a cancelled order. With `OrderPolicy::HoldKey` the cancel is parked behind the dead letter and
//! runs after the replayed create, in order, while other orders go on. Then a longer queue released in
//! order through a second failure (the new head), a paused step, and crashes in the middle of a release.

mod common;

use std::collections::BTreeMap;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use saga_admin::dlq::{self, DlqFilter, ReplayOptions};
use saga_admin::holds;
use saga_config::KafkaConfig;
use saga_consumer::{
    Hooks, Message, OrderPolicy, RetryPolicy, SagaConsumer, SagaEvent, StepContext, StepError,
    StepOutcome, StepResult, Topic, step_with,
};
use saga_test_support::{TestDb, TestKafka, wait_until};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

#[derive(Serialize, Deserialize, SagaEvent)]
struct OrderCreated {
    order_id: i64,
}

#[derive(Serialize, Deserialize, SagaEvent)]
struct OrderCancelled {
    order_id: i64,
}

#[derive(Serialize, Deserialize, SagaEvent)]
struct OrderNoted {
    order_id: i64,
    note: i64,
}

/// What the steps call: a payment gateway that can be down, and a note that fails while it is the one set.
#[derive(Default)]
struct Shop {
    gateway_down: AtomicBool,
    failing_note: AtomicI64,
}

async fn charge(
    msg: &Message<OrderCreated>,
    ctx: &mut StepContext<'_>,
    shop: &Arc<Shop>,
) -> StepResult {
    if shop.gateway_down.load(Ordering::SeqCst) {
        return Err(StepError::permanent("payment gateway down"));
    }
    effect(ctx, msg.payload().order_id, "charge".into()).await
}

async fn cancel(
    msg: &Message<OrderCancelled>,
    ctx: &mut StepContext<'_>,
    _: &Arc<Shop>,
) -> StepResult {
    effect(ctx, msg.payload().order_id, "cancel".into()).await
}

async fn note(
    msg: &Message<OrderNoted>,
    ctx: &mut StepContext<'_>,
    shop: &Arc<Shop>,
) -> StepResult {
    let OrderNoted { order_id, note } = *msg.payload();
    if shop.failing_note.load(Ordering::SeqCst) == note {
        return Err(StepError::permanent(format!("note {note} refused")));
    }
    effect(ctx, order_id, format!("note-{note}")).await
}

async fn effect(ctx: &mut StepContext<'_>, order_id: i64, what: String) -> StepResult {
    sqlx::query("INSERT INTO effects (order_id, what) VALUES ($1, $2)")
        .bind(order_id)
        .bind(what)
        .execute(ctx.conn())
        .await?;
    Ok(StepOutcome::completed())
}

struct Fixture {
    db: TestDb,
    kafka: TestKafka,
    orders: String,
    dlq: String,
    retry: String,
    group: String,
    shop: Arc<Shop>,
    producer: rdkafka::producer::FutureProducer,
}

impl Fixture {
    async fn new(name: &str) -> Self {
        let db = TestDb::with(name, &[saga_consumer::migrate::migrator()]).await;
        sqlx::query(
            "CREATE TABLE effects (seq BIGSERIAL PRIMARY KEY, order_id BIGINT NOT NULL, what TEXT NOT NULL)",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        let kafka = TestKafka::new().await;
        let orders = kafka.topic(name, 1).await;
        let group = format!("{orders}-group");
        let dlq = format!("{orders}.dlq");
        let retry = format!("{group}.retry");
        kafka.create_topic(&dlq, 1).await;
        kafka.create_topic(&retry, 1).await;
        let producer = kafka.producer();
        Self {
            db,
            kafka,
            orders,
            dlq,
            retry,
            group,
            shop: Arc::default(),
            producer,
        }
    }

    fn consumer(&self, hold: bool) -> saga_consumer::SagaConsumerBuilder {
        consumer(
            &self.kafka.brokers,
            &self.orders,
            self.db.pool.clone(),
            &self.shop,
            hold,
        )
    }

    fn start(&self, builder: saga_consumer::SagaConsumerBuilder) -> Running {
        start(builder)
    }

    async fn send<E: Serialize>(&self, order_id: i64, event_type: &str, event: &E) -> (i32, i64) {
        let key = format!("order-{order_id}");
        // Each event of an order is its own saga message: its own idempotency key, the order's Kafka key.
        let idempotency = format!(
            "{key}-{event_type}-{}",
            serde_json::to_string(event).unwrap()
        );
        let idempotency: String = idempotency
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
            .collect();
        self.kafka
            .produce(
                &self.producer,
                &self.orders,
                Some(&key),
                &[("idempotency-key", &idempotency), ("ce_type", event_type)],
                &serde_json::to_vec(event).unwrap(),
            )
            .await
    }

    /// The effects, in the order they committed.
    async fn effects(&self) -> Vec<(i64, String)> {
        sqlx::query_as("SELECT order_id, what FROM effects ORDER BY seq")
            .fetch_all(&self.db.pool)
            .await
            .unwrap()
    }

    fn of(effects: &[(i64, String)], order_id: i64) -> Vec<String> {
        effects
            .iter()
            .filter(|(o, _)| *o == order_id)
            .map(|(_, w)| w.clone())
            .collect()
    }

    async fn wait_effects(&self, n: usize) -> Vec<(i64, String)> {
        wait_until(&format!("{n} effects"), WAIT, || async {
            let effects = self.effects().await;
            (effects.len() >= n).then_some(effects)
        })
        .await
    }

    async fn wait_letters(&self, n: usize) {
        wait_until(&format!("{n} dead letters indexed"), WAIT, || async {
            (self.db.count("saga_dead_letters").await >= n as i64).then_some(())
        })
        .await;
    }

    async fn wait_committed(&self, topic: &str, offset: i64) {
        wait_until(&format!("{topic} committed to {offset}"), WAIT, || async {
            (self.kafka.committed_offsets(&self.group, topic).await
                == BTreeMap::from([(0, offset)]))
            .then_some(())
        })
        .await;
    }

    /// Order 7's create dead-lettered (the gateway down), then its notes 1 to `notes` consumed: with the
    /// hold-key policy, parked behind the letter.
    async fn hold_order_7_with_notes(&self, notes: i64) {
        self.shop.gateway_down.store(true, Ordering::SeqCst);
        self.send(7, "OrderCreated", &OrderCreated { order_id: 7 })
            .await;
        self.wait_letters(1).await;
        for note in 1..=notes {
            self.send(7, "OrderNoted", &OrderNoted { order_id: 7, note })
                .await;
        }
        self.wait_committed(&self.orders, notes + 1).await;
    }

    async fn held(&self) -> Vec<holds::HeldKey> {
        holds::list(&self.db.pool, Some(&self.group), 1_000)
            .await
            .unwrap()
    }

    /// Replays the dead letter at `offset` of the dead-letter topic.
    async fn replay(&self, offset: i64) {
        let kafka = KafkaConfig::new(self.kafka.brokers.clone());
        let mut options = ReplayOptions::default();
        options.operator = "test".into();
        let report = dlq::replay(
            &kafka,
            &self.db.pool,
            &self.dlq,
            &DlqFilter::at(0, offset),
            &options,
        )
        .await
        .unwrap();
        assert_eq!(report.sent(), 1, "{report:?}");
    }

    async fn wait_released(&self) {
        wait_until("no key held", WAIT, || async {
            self.held().await.is_empty().then_some(())
        })
        .await;
    }
}

/// The order service's consumer of `orders` (its group `{orders}-group`), holding keys or not.
fn consumer(
    brokers: &str,
    orders: &str,
    pool: sqlx::PgPool,
    shop: &Arc<Shop>,
    hold: bool,
) -> saga_consumer::SagaConsumerBuilder {
    consumer_with(
        saga_consumer::settings::ConsumerArgs::default(),
        brokers,
        orders,
        pool,
        shop,
        hold,
    )
}

/// [`consumer`], starting from `settings`.
fn consumer_with(
    settings: saga_consumer::settings::ConsumerArgs,
    brokers: &str,
    orders: &str,
    pool: sqlx::PgPool,
    shop: &Arc<Shop>,
    hold: bool,
) -> saga_consumer::SagaConsumerBuilder {
    let created: Topic<OrderCreated> = Topic::new(orders.to_owned());
    let cancelled: Topic<OrderCancelled> = Topic::new(orders.to_owned());
    let noted: Topic<OrderNoted> = Topic::new(orders.to_owned());
    let builder = SagaConsumer::builder()
        .consumer_args(settings)
        .brokers(brokers.to_owned())
        .group_id(format!("{orders}-group"))
        .dlq_topic(format!("{orders}.dlq"))
        .pool(pool)
        .commit_interval(Duration::from_millis(100))
        .session_timeout(Duration::from_secs(6))
        .retry(
            RetryPolicy::default()
                .max_attempts(2)
                .backoff(Duration::from_millis(20), Duration::from_millis(50)),
        )
        .step(step_with("charge-order", shop.clone(), charge).on(&created))
        .step(step_with("cancel-order", shop.clone(), cancel).on(&cancelled))
        .step(step_with("note-order", shop.clone(), note).on(&noted));
    if hold {
        builder.order_policy_for_topic(orders.to_owned(), OrderPolicy::HoldKey)
    } else {
        builder
    }
}

fn start(builder: saga_consumer::SagaConsumerBuilder) -> Running {
    let consumer = builder.build().expect("a valid consumer");
    let ops = consumer.ops();
    let stop = CancellationToken::new();
    let handle = tokio::spawn(consumer.run(stop.clone().cancelled_owned()));
    Running { stop, handle, ops }
}

struct Running {
    ops: saga_consumer::OpsHandle,
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

/// The story up to the replay: order 7's create dead-lettered, its cancel and order 8's cancel sent.
async fn order_7_story(f: &Fixture, hold: bool) -> Vec<(i64, String)> {
    let running = f.start(f.consumer(hold));
    f.shop.gateway_down.store(true, Ordering::SeqCst);
    f.send(7, "OrderCreated", &OrderCreated { order_id: 7 })
        .await;
    f.wait_letters(1).await;
    f.send(7, "OrderCancelled", &OrderCancelled { order_id: 7 })
        .await;
    f.send(8, "OrderCancelled", &OrderCancelled { order_id: 8 })
        .await;
    f.wait_committed(&f.orders, 3).await;
    let before = f.effects().await;
    assert!(
        before.contains(&(8, "cancel".into())),
        "another key goes on: {before:?}"
    );
    let held = f.held().await;
    if hold {
        assert_eq!(
            Fixture::of(&before, 7),
            Vec::<String>::new(),
            "the cancel waits"
        );
        assert_eq!(held.len(), 1, "{held:?}");
        assert_eq!(held[0].key, "order-7");
        assert_eq!(held[0].state, "held");
        assert_eq!(held[0].parked, 1);
        assert_eq!(held[0].head, Some((f.dlq.clone(), 0, 0)));
    } else {
        assert_eq!(
            Fixture::of(&before, 7),
            ["cancel"],
            "the cancel ran at once"
        );
        assert!(held.is_empty(), "{held:?}");
    }

    // The gateway is back; the operator replays the create.
    f.shop.gateway_down.store(false, Ordering::SeqCst);
    f.replay(0).await;
    let effects = f.wait_effects(3).await;
    f.wait_released().await;
    f.wait_committed(&f.retry, if hold { 2 } else { 1 }).await;
    running.stop().await;
    assert_eq!(f.effects().await, effects, "nothing ran after");
    assert_eq!(f.db.count("saga_dead_letters").await, 1, "no other letter");
    effects
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_a_policy_the_replayed_create_charges_an_order_after_its_cancel() {
    let f = Fixture::new("order-skip").await;
    let effects = order_7_story(&f, false).await;
    assert_eq!(
        Fixture::of(&effects, 7),
        ["cancel", "charge"],
        "charged after it was cancelled: what the policy is for"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn holding_the_key_runs_the_cancel_after_the_replayed_create() {
    let f = Fixture::new("order-hold").await;
    let effects = order_7_story(&f, true).await;
    assert_eq!(Fixture::of(&effects, 7), ["charge", "cancel"], "in order");
    assert_eq!(Fixture::of(&effects, 8), ["cancel"]);
    assert_eq!(f.db.count("saga_parked_messages").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queue_is_released_in_order_and_a_release_that_fails_is_the_new_head() {
    let f = Fixture::new("order-queue").await;
    let running = f.start(f.consumer(true));
    f.shop.failing_note.store(2, Ordering::SeqCst);
    f.hold_order_7_with_notes(3).await;
    let held = f.held().await;
    assert_eq!((held.len(), held[0].parked), (1, 3), "{held:?}");
    // What the operator sees: the failure group holds one key with three messages behind it.
    let target = common::Target {
        database_url: f.db.url(),
        schema: f.db.schema.clone(),
        brokers: f.kafka.brokers.clone(),
    };
    let listed = target.json(&["keys", "held", "--group", &f.group]).await;
    assert_eq!(listed[0]["key"], "order-7", "{listed}");
    assert_eq!(listed[0]["parked"], 3, "{listed}");
    let groups = target.json(&["dlq", "groups", "--topic", &f.dlq]).await;
    assert_eq!(groups[0]["held_keys"], 1, "{groups}");
    assert_eq!(groups[0]["parked"], 3, "{groups}");

    // The create replayed: it and note 1 run; note 2 fails for good and is the key's new head.
    f.shop.gateway_down.store(false, Ordering::SeqCst);
    f.replay(0).await;
    f.wait_letters(2).await;
    f.send(
        7,
        "OrderNoted",
        &OrderNoted {
            order_id: 7,
            note: 4,
        },
    )
    .await;
    f.wait_committed(&f.orders, 5).await;
    let held = wait_until("note 2 heads the key", WAIT, || async {
        let held = f.held().await;
        (held.len() == 1 && held[0].head == Some((f.dlq.clone(), 0, 1))).then_some(held)
    })
    .await;
    assert_eq!(held[0].state, "held");
    assert_eq!(held[0].parked, 2, "notes 3 and 4 wait behind note 2");
    assert_eq!(Fixture::of(&f.effects().await, 7), ["charge", "note-1"]);

    // Note 2 fixed and replayed: 2, 3 and 4 run, in order, and the key is let go.
    f.shop.failing_note.store(0, Ordering::SeqCst);
    f.replay(1).await;
    let effects = f.wait_effects(5).await;
    f.wait_released().await;
    assert_eq!(
        Fixture::of(&effects, 7),
        ["charge", "note-1", "note-2", "note-3", "note-4"]
    );
    // A message of the key after the release runs at once.
    f.send(7, "OrderCancelled", &OrderCancelled { order_id: 7 })
        .await;
    let effects = f.wait_effects(6).await;
    assert_eq!(effects.last(), Some(&(7, "cancel".into())));
    running.stop().await;
    assert_eq!(f.db.count("saga_parked_messages").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_step_parks_its_messages_per_key_and_resuming_runs_them_in_order() {
    let f = Fixture::new("order-pause").await;
    let running = f.start(f.consumer(false));
    // The consumer records its group as it starts: a pause names a group that runs here.
    wait_until("the group recorded", WAIT, || async {
        (f.db.count("saga_consumer_groups").await == 1).then_some(())
    })
    .await;
    let paused = holds::pause(
        &f.db.pool,
        &f.group,
        "note-order",
        "ops",
        "the notes service is down",
    )
    .await
    .unwrap();
    assert!(paused);
    // Every consumer of the group counts the pause within a second (its gauge says so); the pause takes
    // effect a little later, when all of them read holds.
    wait_until("the consumer counts the pause", WAIT, || async {
        (running.ops.sample("saga_consumer_paused_steps", "") == Some(1.0)).then_some(())
    })
    .await;
    wait_until("the pause takes effect", WAIT, || async {
        let effective: bool =
            sqlx::query_scalar("SELECT bool_and(effective_at <= now()) FROM saga_paused_steps")
                .fetch_one(&f.db.pool)
                .await
                .unwrap();
        effective.then_some(())
    })
    .await;
    f.send(
        7,
        "OrderNoted",
        &OrderNoted {
            order_id: 7,
            note: 1,
        },
    )
    .await;
    f.send(7, "OrderCancelled", &OrderCancelled { order_id: 7 })
        .await;
    f.send(8, "OrderCancelled", &OrderCancelled { order_id: 8 })
        .await;
    f.wait_committed(&f.orders, 3).await;
    assert_eq!(
        f.effects().await,
        [(8, "cancel".to_owned())],
        "order 8 goes on; order 7's note is parked, and its cancel behind it"
    );
    let listed = holds::paused(&f.db.pool, Some(&f.group)).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].held_keys, listed[0].parked), (1, 2));
    assert_eq!(listed[0].paused_by, "ops");

    let released = holds::resume(&f.db.pool, &f.group, "note-order", "ops", "back")
        .await
        .unwrap();
    assert_eq!(released, 1);
    let effects = f.wait_effects(3).await;
    f.wait_released().await;
    assert_eq!(Fixture::of(&effects, 7), ["note-1", "cancel"]);
    running.stop().await;
    let err = holds::resume(&f.db.pool, &f.group, "note-order", "ops", "again")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("is not paused"), "{err}");
}

/// Runs in a child process: a consumer with the hold-key policy that aborts right after the database
/// commit of the message at offset `CRASH_RETRY_OFFSET` of the retry topic (a replayed head, or a release).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by a_consumer_killed_in_the_middle_of_a_release_runs_nothing_twice_and_keeps_the_order"]
async fn release_crash_child_process() {
    let (Ok(url), Ok(brokers), Ok(orders), Ok(offset)) = (
        std::env::var("CRASH_DATABASE_URL"),
        std::env::var("CRASH_BROKERS"),
        std::env::var("CRASH_ORDERS"),
        std::env::var("CRASH_RETRY_OFFSET"),
    ) else {
        panic!("run by the crash test only");
    };
    let offset: i64 = offset.parse().unwrap();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let retry = format!("{orders}-group.retry");
    let builder = consumer(&brokers, &orders, pool, &Arc::default(), true).hooks(
        Hooks::default().on_db_commit(move |info| {
            if info.topic == retry && info.last_offset >= offset {
                std::process::abort();
            }
        }),
    );
    start(builder).handle.await.unwrap().unwrap();
}

impl Fixture {
    /// Runs the crash child until it aborts after committing retry-topic offset `offset`.
    async fn crash_at(&self, offset: i64) {
        let status = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "release_crash_child_process",
                "--ignored",
                "--nocapture",
            ])
            .env("CRASH_DATABASE_URL", self.db.url())
            .env("CRASH_BROKERS", &self.kafka.brokers)
            .env("CRASH_ORDERS", &self.orders)
            .env("CRASH_RETRY_OFFSET", offset.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await
            .unwrap();
        assert!(!status.success(), "the child aborted");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_killed_in_the_middle_of_a_release_runs_nothing_twice_and_keeps_the_order() {
    let f = Fixture::new("order-crash").await;
    let running = f.start(f.consumer(true));
    f.hold_order_7_with_notes(2).await;
    running.stop().await;
    f.shop.gateway_down.store(false, Ordering::SeqCst);
    f.replay(0).await;

    // Killed after the replayed create committed, before its release was recorded; then after the first
    // released note committed, before the next was sent.
    f.crash_at(0).await;
    assert_eq!(Fixture::of(&f.effects().await, 7), ["charge"]);
    f.crash_at(1).await;
    assert_eq!(Fixture::of(&f.effects().await, 7), ["charge", "note-1"]);

    let running = f.start(f.consumer(true));
    let effects = f.wait_effects(3).await;
    f.wait_released().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.stop().await;
    assert_eq!(f.effects().await, effects, "nothing ran twice");
    assert_eq!(Fixture::of(&effects, 7), ["charge", "note-1", "note-2"]);
    assert_eq!(f.db.count("saga_dead_letters").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_the_cap_a_message_of_a_held_key_is_dead_lettered_with_the_reason_not_dropped() {
    let f = Fixture::new("order-cap").await;
    let mut settings = saga_consumer::settings::ConsumerArgs::default();
    settings.hold_max_parked_per_key = 1;
    let running = f.start(consumer_with(
        settings,
        &f.kafka.brokers,
        &f.orders,
        f.db.pool.clone(),
        &f.shop,
        true,
    ));
    f.hold_order_7_with_notes(2).await;
    f.wait_letters(2).await;
    let held = f.held().await;
    assert_eq!((held.len(), held[0].parked), (1, 1), "{held:?}");
    let kafka = KafkaConfig::new(f.kafka.brokers.clone());
    let letters = dlq::list(&kafka, &f.db.pool, &f.dlq, &DlqFilter::default())
        .await
        .unwrap();
    let full = letters.iter().find(|l| l.offset == 1).unwrap();
    assert_eq!(full.reason, "hold-queue-full");
    assert!(
        full.error.contains("SAGA_HOLD_MAX_PARKED_PER_KEY"),
        "{}",
        full.error
    );
    assert_eq!(
        held[0].head,
        Some((f.dlq.clone(), 0, 0)),
        "the cap makes no new head"
    );

    // The head replayed: the create and the parked note run, the key is let go; the note past the cap
    // waits in the dead-letter topic for its own replay.
    f.shop.gateway_down.store(false, Ordering::SeqCst);
    f.replay(0).await;
    f.wait_released().await;
    assert_eq!(
        Fixture::of(&f.wait_effects(2).await, 7),
        ["charge", "note-1"]
    );
    f.replay(1).await;
    let effects = f.wait_effects(3).await;
    running.stop().await;
    assert_eq!(Fixture::of(&effects, 7), ["charge", "note-1", "note-2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_releases_a_held_key_by_hand_and_its_letter_stays() {
    let f = Fixture::new("order-release").await;
    let running = f.start(f.consumer(true));
    f.shop.gateway_down.store(true, Ordering::SeqCst);
    f.send(7, "OrderCreated", &OrderCreated { order_id: 7 })
        .await;
    f.wait_letters(1).await;
    f.send(7, "OrderCancelled", &OrderCancelled { order_id: 7 })
        .await;
    f.wait_committed(&f.orders, 2).await;
    assert_eq!(f.held().await.len(), 1);
    let target = common::Target {
        database_url: f.db.url(),
        schema: f.db.schema.clone(),
        brokers: f.kafka.brokers.clone(),
    };
    let released = target
        .json(&[
            "keys",
            "release",
            "order-7",
            "--group",
            &f.group,
            "--operator",
            "ops",
        ])
        .await;
    assert_eq!(released["state"], "releasing", "{released}");
    assert_eq!(released["released_by"], "release by ops", "{released}");
    let effects = f.wait_effects(1).await;
    f.wait_released().await;
    running.stop().await;
    assert_eq!(
        Fixture::of(&effects, 7),
        ["cancel"],
        "the create stays a letter"
    );
    // Not held (any more): one line, exit code 2.
    saga_test_support::expect_usage_error(
        target.command(&["keys", "release", "order-7", "--group", &f.group]),
        "is not held",
    )
    .await;
}

impl Fixture {
    /// `event` of `event_type` for order `order_id`, with Kafka key `key` (any bytes), to `partition`.
    async fn send_keyed<E: Serialize>(
        &self,
        key: &[u8],
        partition: Option<i32>,
        event_type: &str,
        event: &E,
        idempotency: &str,
    ) {
        self.kafka
            .produce_bytes(
                &self.producer,
                &self.orders,
                partition,
                Some(key),
                &[("idempotency-key", idempotency), ("ce_type", event_type)],
                &serde_json::to_vec(event).unwrap(),
            )
            .await;
    }
}

/// Two dead letters of one key at the same moment (its messages on two partitions of one group, both
/// failing at once): the second is queued behind the first, never lost, so that once the head is replayed
/// each partition's effects of the key come in its offset order. (A decision on a key that was not held
/// took no lock: both letters found it free, one held it, the other was neither head nor queued, and ran,
/// replayed, after its partition's later message.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_letters_of_one_key_at_once_both_stay_in_its_order() {
    const KEYS: i64 = 40;
    let mut f = Fixture::new("order-two-letters").await;
    // Two partitions of the orders topic: each key's messages are sent to both.
    let orders = f.kafka.topic("order-two-letters-2p", 2).await;
    f.group = format!("{orders}-group");
    f.dlq = format!("{orders}.dlq");
    f.retry = format!("{}.retry", f.group);
    f.kafka.create_topic(&f.dlq, 1).await;
    f.kafka.create_topic(&f.retry, 1).await;
    f.orders = orders;
    // Per key: on partition 0 its create (the gateway is down) then note 0; on partition 1 note 9 (refused)
    // then note 1. The first message of each partition fails for good, at about the same moment.
    f.shop.gateway_down.store(true, Ordering::SeqCst);
    f.shop.failing_note.store(9, Ordering::SeqCst);
    for order in 0..KEYS {
        let key = format!("order-{order}");
        let create = OrderCreated { order_id: order };
        let id = format!("{key}-create");
        f.send_keyed(key.as_bytes(), Some(0), "OrderCreated", &create, &id)
            .await;
        let refused = OrderNoted {
            order_id: order,
            note: 9,
        };
        let id = format!("{key}-note-9");
        f.send_keyed(key.as_bytes(), Some(1), "OrderNoted", &refused, &id)
            .await;
        for partition in [0, 1] {
            let noted = OrderNoted {
                order_id: order,
                note: i64::from(partition),
            };
            let id = format!("{key}-note-{partition}");
            f.send_keyed(key.as_bytes(), Some(partition), "OrderNoted", &noted, &id)
                .await;
        }
    }
    let mut settings = saga_consumer::settings::ConsumerArgs::default();
    settings.concurrency = 2;
    let running = f.start(consumer_with(
        settings,
        &f.kafka.brokers,
        &f.orders,
        f.db.pool.clone(),
        &f.shop,
        true,
    ));
    wait_until("both partitions consumed", WAIT, || async {
        let committed = f.kafka.committed_offsets(&f.group, &f.orders).await;
        (committed == BTreeMap::from([(0, 2 * KEYS), (1, 2 * KEYS)])).then_some(())
    })
    .await;
    // Every key: held behind one letter, with the other failing message (its letter queued, or, when it
    // was read after the key was held, parked without running) and both notes queued. Most keys' two
    // letters were written at about the same moment: the race this is about.
    let letters = f.db.count("saga_dead_letters").await;
    assert!(
        letters > KEYS + KEYS / 2,
        "the two letters of most keys: {letters}"
    );
    let held = f.held().await;
    assert_eq!(held.len(), usize::try_from(KEYS).unwrap());
    let lost: Vec<&str> = held
        .iter()
        .filter(|h| h.parked != 3)
        .map(|h| h.key.as_str())
        .collect();
    assert!(
        lost.is_empty(),
        "keys whose second letter is neither head nor queued: {lost:?}"
    );
    // The gateway is back; each head is replayed; every queue is released in order.
    f.shop.gateway_down.store(false, Ordering::SeqCst);
    f.shop.failing_note.store(-1, Ordering::SeqCst);
    for h in &held {
        let (_, _, offset) = h.head.clone().expect("a letter heads each key");
        f.replay(offset).await;
    }
    let effects = f.wait_effects(usize::try_from(4 * KEYS).unwrap()).await;
    f.wait_released().await;
    running.stop().await;
    for order in 0..KEYS {
        let mine = Fixture::of(&effects, order);
        assert_eq!(mine.len(), 4, "order {order}: {mine:?}");
        let at = |what: &str| mine.iter().position(|w| w == what).unwrap();
        assert!(
            at("charge") < at("note-0"),
            "order {order}, partition 0: {mine:?}"
        );
        assert!(
            at("note-9") < at("note-1"),
            "order {order}, partition 1: {mine:?}"
        );
    }
}

/// A message whose key is too large for the held keys' index (3,000 bytes), of a paused step: parking it is
/// refused for good (SQLSTATE 54000), so it is dead-lettered with the reason (`store-refused`), and its
/// partition goes on: the step's other keys are parked, another step's messages run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_3000_byte_key_behind_a_paused_step_stops_nothing_else() {
    let f = Fixture::new("order-big-key").await;
    let running = f.start(f.consumer(false));
    wait_until("the group recorded", WAIT, || async {
        (f.db.count("saga_consumer_groups").await == 1).then_some(())
    })
    .await;
    holds::pause(&f.db.pool, &f.group, "note-order", "ops", "notes down")
        .await
        .unwrap();
    wait_until("the pause takes effect", WAIT, || async {
        let effective: bool =
            sqlx::query_scalar("SELECT bool_and(effective_at <= now()) FROM saga_paused_steps")
                .fetch_one(&f.db.pool)
                .await
                .unwrap();
        (effective && running.ops.sample("saga_consumer_paused_steps", "") == Some(1.0))
            .then_some(())
    })
    .await;
    // Bytes that do not compress: PostgreSQL compresses a long index entry before it refuses it.
    let mut seed: u32 = 7;
    let big: Vec<u8> = (0..3_000)
        .map(|_| {
            seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            (seed >> 16) as u8
        })
        .collect();
    let noted = |order_id| OrderNoted { order_id, note: 1 };
    f.send_keyed(&big, None, "OrderNoted", &noted(1), "big-note")
        .await;
    f.send(2, "OrderNoted", &noted(2)).await;
    f.send(3, "OrderCancelled", &OrderCancelled { order_id: 3 })
        .await;
    f.send(4, "OrderCancelled", &OrderCancelled { order_id: 4 })
        .await;
    f.wait_committed(&f.orders, 4).await;
    let effects = f.effects().await;
    assert_eq!(
        effects,
        [(3, "cancel".to_owned()), (4, "cancel".to_owned())],
        "the other step's messages ran"
    );
    let held = f.held().await;
    assert_eq!(held.len(), 1, "order 2's note is parked: {held:?}");
    assert_eq!(held[0].key, "order-2");
    f.wait_letters(1).await;
    let letters = f
        .kafka
        .read_all(&f.dlq, 1, Duration::from_millis(500), WAIT)
        .await;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].header("dlq-reason"), Some("store-refused"));
    let error = letters[0].header("dlq-error").unwrap_or_default();
    assert!(
        error.contains("54000") || error.contains("index row"),
        "{error}"
    );
    running.stop().await;
}

/// A held key that is not text (a zero byte, a byte that is not UTF-8) is listed with its exact bytes and
/// released by them; its text alone cannot release another key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_that_is_not_text_is_listed_and_released_by_its_exact_bytes() {
    let f = Fixture::new("order-hex-key").await;
    let running = f.start(f.consumer(true));
    f.shop.gateway_down.store(true, Ordering::SeqCst);
    let key: &[u8] = b"\x00\xffk";
    f.send_keyed(
        key,
        None,
        "OrderCreated",
        &OrderCreated { order_id: 7 },
        "hex-create",
    )
    .await;
    f.wait_letters(1).await;
    f.send_keyed(
        key,
        None,
        "OrderCancelled",
        &OrderCancelled { order_id: 7 },
        "hex-cancel",
    )
    .await;
    f.wait_committed(&f.orders, 2).await;
    let target = common::Target {
        database_url: f.db.url(),
        schema: f.db.schema.clone(),
        brokers: f.kafka.brokers.clone(),
    };
    let listed = target.json(&["keys", "held", "--group", &f.group]).await;
    let held = &listed[0];
    assert_eq!(held["key_hex"], "00ff6b", "{listed}");
    assert_eq!(held["key"], "\\u{0}\\xffk", "{listed}");
    // Its text, typed back, names other bytes: not held.
    saga_test_support::expect_usage_error(
        target.command(&["keys", "release", "\\u{0}\\xffk", "--group", &f.group]),
        "is not held",
    )
    .await;
    saga_test_support::expect_usage_error(
        target.command(&["keys", "release", "--key-hex", "zz", "--group", &f.group]),
        "not hexadecimal",
    )
    .await;
    let released = target
        .json(&[
            "keys",
            "release",
            "--key-hex",
            "00ff6b",
            "--group",
            &f.group,
        ])
        .await;
    assert_eq!(released["state"], "releasing", "{released}");
    let effects = f.wait_effects(1).await;
    f.wait_released().await;
    running.stop().await;
    assert_eq!(Fixture::of(&effects, 7), ["cancel"]);
}
