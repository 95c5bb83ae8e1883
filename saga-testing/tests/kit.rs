//! The test kit on its own terms, on librdkafka's mock cluster and the real PostgreSQL: virtual time fires a
//! one-hour saga timeout without waiting an hour, a quiet-wait that runs out names what was busy, and the
//! faults it injects catch a step that is not idempotent while a careful one keeps one effect per order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use saga_consumer::{
    Message, SagaEvent, StepContext, StepError, StepOutcome, StepResult, Topic, step, step_with,
    two_phase,
};
use saga_orchestrator::{
    Command, OnTimeout, Orchestrator, SagaDefinition, SagaStatus, Step, Verdict,
};
use saga_testing::faults::fail_after_handler;
use saga_testing::{Culprit, KitError, SagaTest, ServiceSetup};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

#[derive(Debug, Clone, Serialize, Deserialize, SagaEvent)]
struct Placed {
    n: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, SagaEvent)]
struct Noted {
    n: i64,
}

/// The saga's data: the order.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    n: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, SagaEvent)]
struct Reserved {
    n: i64,
}

/// A saga of one step whose participant never answers: it times out after an hour.
fn slow_saga(test: &SagaTest) -> SagaDefinition<Order> {
    let replies = test.topic::<Reserved>("replies");
    SagaDefinition::new("reserve-saga", replies.name())
        .unwrap()
        .step(
            Step::new(
                "reserve",
                Command::to(&test.topic::<Placed>("reservations"), |o: &Order| Placed {
                    n: o.n,
                }),
            )
            .unwrap()
            .replies(|_o: &mut Order, _r: Reserved| Verdict::Succeeded)
            .timeout(Duration::from_secs(3600), OnTimeout::Fail),
        )
}

async fn start_saga(
    msg: &Message<Placed>,
    ctx: &mut StepContext<'_>,
    orchestrator: &Orchestrator<Order>,
) -> StepResult {
    let order = Order { n: msg.payload().n };
    orchestrator
        .start(ctx.conn(), &msg.lineage(), order)
        .await?;
    Ok(StepOutcome::completed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn virtual_time_fires_a_one_hour_saga_timeout_without_waiting_an_hour() {
    let mut test = SagaTest::start("kit-time").await.unwrap();
    let orders = test.topic::<Placed>("orders");
    test.create_topic(test.topic::<Placed>("reservations").name())
        .unwrap();
    let (input, definition) = (orders.clone(), slow_saga(&test));
    test.service("orders", move |s: &ServiceSetup| {
        let builder = s.builder();
        let orchestrator = s
            .orchestrator(Orchestrator::new(definition.clone()).unwrap())
            .with_outbox(&builder.outbox());
        builder
            .step(step_with("start-saga", orchestrator.clone(), start_saga).on(&input))
            .with(orchestrator)
    })
    .await
    .unwrap();
    test.send(&orders, "order-1", &Placed { n: 1 })
        .await
        .unwrap();
    test.wait_quiet().await.unwrap();
    let sagas = test.sagas("orders").await.unwrap();
    assert_eq!(sagas.len(), 1);
    let saga = test
        .saga::<Order>("orders", "order-1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(saga.status, SagaStatus::Running, "waiting for its reply");
    assert_eq!(saga.data.n, 1);
    assert!(
        test.saga::<Order>("orders", "order-2")
            .await
            .unwrap()
            .is_none()
    );

    let advanced = Instant::now();
    test.advance(Duration::from_secs(3600));
    // Were the hour waited for, the wait would run out: a timer due is busy.
    test.set_quiet_timeout(Duration::from_secs(5));
    test.wait_quiet().await.unwrap();
    let fired_after = advanced.elapsed();
    let saga = test
        .saga::<Order>("orders", "order-1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        saga.status,
        SagaStatus::Compensated,
        "the timeout failed the step: {saga:?}"
    );
    // Data of another shape is said, not guessed.
    let unreadable = test.saga::<Vec<u8>>("orders", "order-1").await.unwrap_err();
    assert!(
        unreadable.to_string().contains("does not read as"),
        "{unreadable}"
    );
    println!("a one-hour timeout fired {fired_after:?} after the clock moved");
    test.stop().await.unwrap();
}

/// Takes its time: a message is in flight for half a second.
async fn slow(_msg: &Message<Placed>, _ctx: &mut StepContext<'_>) -> StepResult {
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(StepOutcome::completed())
}

/// Notes the order, keyed by the order's number.
async fn note(msg: &Message<Placed>, ctx: &mut StepContext<'_>, out: &Topic<Noted>) -> StepResult {
    let n = msg.payload().n;
    ctx.emit(out, n.to_string(), &Noted { n })?;
    Ok(StepOutcome::completed())
}

/// Notes the order, keyed like the order itself (its idempotency key).
async fn note_by_key(
    msg: &Message<Placed>,
    ctx: &mut StepContext<'_>,
    out: &Topic<Noted>,
) -> StepResult {
    let n = msg.payload().n;
    ctx.emit(out, msg.idempotency_key().as_str(), &Noted { n })?;
    Ok(StepOutcome::completed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_quiet_wait_that_runs_out_names_the_service_and_what_it_had_left() {
    let mut test = SagaTest::start("kit-busy").await.unwrap();
    let (orders, notes) = (test.topic::<Placed>("orders"), test.topic::<Noted>("notes"));
    let input = orders.clone();
    test.service("slow", move |s: &ServiceSetup| {
        s.builder().step(step("slow", slow).on(&input))
    })
    .await
    .unwrap();
    // A service whose relay runs apart, and was never started: its events stay in the outbox.
    let (input, out) = (orders.clone(), notes.clone());
    test.service("unrelayed", move |s: &ServiceSetup| {
        s.builder()
            .embedded_relay(false)
            .step(step_with("note", out.clone(), note).on(&input))
    })
    .await
    .unwrap();
    test.send(&orders, "order-1", &Placed { n: 1 })
        .await
        .unwrap();

    let Err(KitError::Busy(busy)) = test.wait_quiet_for(Duration::from_millis(250)).await else {
        panic!("a message is in flight: the system is not quiet");
    };
    let text = busy.to_string();
    assert!(
        busy.culprits.iter().any(|c| matches!(c,
            Culprit::Unconsumed { service, topic, behind: 1, .. }
                if service == "slow" && topic == orders.name())),
        "{text}"
    );
    assert!(text.contains("the slow service has 1 message(s)"), "{text}");
    // The slow step finishes; the unpublished event stays.
    test.set_quiet_timeout(Duration::from_secs(2));
    let Err(KitError::Busy(busy)) = test.wait_quiet().await else {
        panic!("an event is unpublished: the system is not quiet");
    };
    assert!(!busy.concerns("slow"), "the slow step finished: {busy}");
    assert_eq!(
        busy.culprits,
        vec![Culprit::Unpublished {
            service: "unrelayed".to_owned(),
            rows: 1,
            topic: notes.name().to_owned(),
            key: Some("1".to_owned()),
        }],
        "{busy}"
    );
    assert!(test.published(&notes).await.unwrap().is_empty());
    test.stop().await.unwrap();
}

/// Records the order in the step's transaction: its effect commits with its step key, or not at all.
async fn careful(msg: &Message<Placed>, ctx: &mut StepContext<'_>) -> StepResult {
    sqlx::query("INSERT INTO effects (n) VALUES ($1)")
        .bind(msg.payload().n)
        .execute(ctx.conn())
        .await?;
    Ok(StepOutcome::completed())
}

/// Records the order through a pool of its own, outside the step's transaction: deliberately not
/// idempotent.
async fn careless(msg: &Message<Placed>, _ctx: &mut StepContext<'_>, pool: &PgPool) -> StepResult {
    sqlx::query("INSERT INTO effects (n) VALUES ($1)")
        .bind(msg.payload().n)
        .execute(pool)
        .await?;
    Ok(StepOutcome::completed())
}

/// A service whose table `effects` counts its step's effects; `carefully` chooses the step, and `crash`
/// loses each message's first run after its handler ran.
async fn effects_service(
    s: ServiceSetup,
    orders: Topic<Placed>,
    carefully: bool,
    crash: bool,
) -> Result<saga_consumer::SagaServiceBuilder, sqlx::Error> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS effects (seq BIGSERIAL PRIMARY KEY, n BIGINT NOT NULL)",
    )
    .execute(s.pool())
    .await?;
    let builder = s.builder();
    let times = u32::from(crash);
    Ok(if carefully {
        builder.step(
            step("record", careful)
                .on(&orders)
                .layer(fail_after_handler(times)),
        )
    } else {
        builder.step(
            step_with("record", s.pool().clone(), careless)
                .on(&orders)
                .layer(fail_after_handler(times)),
        )
    })
}

async fn effects(test: &SagaTest, service: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(test.pool(service).unwrap())
        .await
        .unwrap()
}

/// The redeliveries service `service` skipped since it last started.
fn skipped(test: &SagaTest, service: &str) -> f64 {
    let ops = test.ops(service).unwrap();
    ops.sample("saga_consumer_duplicates_total", "step=\"record\"")
        .unwrap_or(0.0)
}

/// Starts the careful and the careless service on `orders`.
async fn careful_and_careless(test: &mut SagaTest, orders: &Topic<Placed>, crash: bool) {
    for (name, carefully) in [("careful", true), ("careless", false)] {
        let input = orders.clone();
        test.service_async(name, move |s| {
            effects_service(s, input.clone(), carefully, crash)
        })
        .await
        .unwrap();
    }
}

async fn send_orders(
    test: &SagaTest,
    orders: &Topic<Placed>,
    range: std::ops::RangeInclusive<i64>,
) {
    for n in range {
        test.send(orders, &format!("order-{n}"), &Placed { n })
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn losing_each_first_run_after_the_handler_catches_a_step_that_writes_outside_its_transaction()
 {
    let mut test = SagaTest::start("kit-crash").await.unwrap();
    let orders = test.topic::<Placed>("orders");
    careful_and_careless(&mut test, &orders, true).await;
    send_orders(&test, &orders, 1..=3).await;
    test.wait_quiet().await.unwrap();
    assert_eq!(effects(&test, "careful").await, 3, "one effect per order");
    let careless = effects(&test, "careless").await;
    assert!(careless >= 6, "caught: {careless} effects of 3 orders");
    test.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redeliveries_after_a_crash_before_the_offset_commit_and_duplicates_are_absorbed() {
    let mut test = SagaTest::start("kit-redeliver").await.unwrap();
    let orders = test.topic::<Placed>("orders");
    careful_and_careless(&mut test, &orders, false).await;
    send_orders(&test, &orders, 1..=3).await;
    test.wait_quiet().await.unwrap();

    for service in ["careful", "careless"] {
        let again = test.crash_before_offset_commit(service).await.unwrap();
        assert_eq!(again, 3, "{service}: its three orders are delivered again");
    }
    test.wait_quiet().await.unwrap();
    for service in ["careful", "careless"] {
        // Delivered again, and skipped: their step keys are done.
        assert_eq!(skipped(&test, service), 3.0, "{service}");
        assert_eq!(effects(&test, service).await, 3, "{service}");
    }

    // Every message of the topic twice: the three there, and two more.
    test.duplicate_deliveries(&[orders.name()]).unwrap();
    send_orders(&test, &orders, 4..=5).await;
    test.wait_quiet().await.unwrap();
    assert_eq!(test.duplicates(), 5);
    for service in ["careful", "careless"] {
        assert_eq!(skipped(&test, service), 3.0 + 5.0, "{service}");
        assert_eq!(effects(&test, service).await, 5, "{service}");
    }
    // The copies are the kit's, not the system's: the topic shows the five orders.
    assert_eq!(test.published(&orders).await.unwrap().len(), 5);
    assert!(matches!(
        test.duplicate_deliveries(&[orders.name()]),
        Err(KitError::Unsupported(_))
    ));
    test.stop().await.unwrap();
}

/// Notes every order; refuses order 13 for good.
async fn note_or_refuse(
    msg: &Message<Placed>,
    ctx: &mut StepContext<'_>,
    out: &Topic<Noted>,
) -> StepResult {
    if msg.payload().n == 13 {
        return Err(StepError::permanent("order 13 is refused"));
    }
    note_by_key(msg, ctx, out).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn published_events_and_dead_letters_are_read_back_typed() {
    let mut test = SagaTest::start("kit-published").await.unwrap();
    let (orders, notes) = (test.topic::<Placed>("orders"), test.topic::<Noted>("notes"));
    let (input, out) = (orders.clone(), notes.clone());
    test.service("notes", move |s: &ServiceSetup| {
        s.builder()
            .step(step_with("note", out.clone(), note_or_refuse).on(&input))
    })
    .await
    .unwrap();
    // Both topics of the test's partition count: a key's partition is the same on both.
    test.create_topic(notes.name()).unwrap();
    let mut partitions = std::collections::HashMap::new();
    for n in [7, 8, 13] {
        let (partition, _) = test
            .send(&orders, &format!("order-{n}"), &Placed { n })
            .await
            .unwrap();
        partitions.insert(n, partition);
    }
    // Order 13's letter was not announced: the quiet wait fails on it, naming its reason and error.
    match test.wait_quiet().await {
        Err(KitError::DeadLettered {
            service,
            expected,
            letters,
        }) => {
            assert_eq!((service.as_str(), expected), ("notes", 0));
            assert_eq!(letters.len(), 1, "{letters:?}");
            assert_eq!(letters[0].reason, "handler-failed");
            assert_eq!(letters[0].idempotency_key.as_deref(), Some("order-13"));
        }
        other => panic!("expected the unexpected letter, got {other:?}"),
    }
    let said = test.wait_quiet().await.unwrap_err().to_string();
    assert!(
        said.contains("order 13 is refused") && said.contains("expect_dead_letters(\"notes\", n)"),
        "{said}"
    );
    test.expect_dead_letters("notes", 1).unwrap();
    test.wait_quiet().await.unwrap();
    let published = test.published(&notes).await.unwrap();
    assert_eq!(published.len(), 2);
    let seven = published.one(|e| e.n == 7);
    assert_eq!(
        seven.idempotency_key().as_str(),
        "order-7",
        "the saga's key"
    );
    // The kit's producer partitions a key as the relay does: the test's event and the service's, both keyed
    // `order-7`, share a partition.
    for message in published.messages() {
        assert_eq!(message.partition(), partitions[&message.payload().n]);
    }
    published.none(|e| e.n == 13);
    // Another type's view of the topic skips these events.
    assert!(
        test.published(&test.topic::<Reserved>("notes"))
            .await
            .unwrap()
            .is_empty()
    );
    let letters = test.dead_letters("notes").await.unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    let letter = &letters[0];
    assert_eq!(letter.topic, orders.name());
    assert_eq!(letter.step.as_deref(), Some("note"));
    assert_eq!(letter.idempotency_key.as_deref(), Some("order-13"));
    assert!(letter.error.contains("order 13 is refused"), "{letter:?}");
    // Delivered again after a crash, order 13 is dead-lettered again: the same message, counted once.
    test.crash_before_offset_commit("notes").await.unwrap();
    test.wait_quiet().await.unwrap();
    assert_eq!(test.dead_letters("notes").await.unwrap().len(), 2);
    test.stop().await.unwrap();
}

#[tokio::test]
async fn an_unknown_service_and_an_unreachable_database_are_clear_errors() {
    let test = SagaTest::start("kit-errors").await.unwrap();
    let err = test.pool("nobody").unwrap_err();
    assert_eq!(
        err.to_string(),
        "no service named \"nobody\" runs in this test"
    );
    test.stop().await.unwrap();
    let err = SagaTest::start_with("kit-errors", Some("not a database URL".into()), 1)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("DATABASE_URL"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn names_a_second_service_of_a_schema_and_the_wal_outbox_are_refused() {
    let mut test = SagaTest::start("kit-refusals").await.unwrap();
    let orders = test.topic::<Placed>("orders");
    for bad in ["Payment", "a.b", "", "a-name-longer-than-20"] {
        let input = orders.clone();
        let refused = test
            .service(bad, move |s: &ServiceSetup| {
                s.builder().step(step("slow", slow).on(&input))
            })
            .await;
        assert!(
            matches!(&refused, Err(KitError::BadServiceName(name)) if name == bad),
            "{refused:?}"
        );
    }
    let input = orders.clone();
    test.service("a_b", move |s: &ServiceSetup| {
        s.builder().step(step("slow", slow).on(&input))
    })
    .await
    .unwrap();
    let input = orders.clone();
    let clash = test
        .service("a-b", move |s: &ServiceSetup| {
            s.builder().step(step("slow", slow).on(&input))
        })
        .await;
    assert!(
        matches!(clash, Err(KitError::DuplicateService(_))),
        "{clash:?}"
    );
    let input = orders.clone();
    let wal = test
        .service("wal", move |s: &ServiceSetup| {
            s.builder()
                .outbox_mode(saga_consumer::OutboxMode::Wal)
                .step(step("slow", slow).on(&input))
        })
        .await
        .unwrap_err();
    assert!(wal.to_string().contains("table outbox"), "{wal}");
    test.stop().await.unwrap();
}

/// A pool on the test database, outside any test's schema.
async fn database() -> PgPool {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    PgPool::connect(&url).await.unwrap()
}

/// The schema of service `service`.
async fn schema_of(test: &SagaTest, service: &str) -> String {
    sqlx::query_scalar("SELECT current_schema()")
        .fetch_one(test.pool(service).unwrap())
        .await
        .unwrap()
}

async fn schema_exists(pool: &PgPool, schema: &str) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
        .bind(schema)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_service_that_stops_is_named_and_a_test_dropped_without_stop_drops_its_schemas() {
    let mut test = SagaTest::start("kit-stopped").await.unwrap();
    let orders = test.topic::<Placed>("orders");
    // The service's task fails when the test says so.
    let give_up = std::sync::Arc::new(tokio::sync::Notify::new());
    let told = give_up.clone();
    test.service("fragile", move |s: &ServiceSetup| {
        let told = told.clone();
        s.builder().step(step("slow", slow).on(&orders)).task(
            "fails-when-told",
            |_ctx| async move {
                told.notified().await;
                Err("the task gave up".into())
            },
        )
    })
    .await
    .unwrap();
    give_up.notify_one();
    let schema = schema_of(&test, "fragile").await;
    // Quiet until the service has stopped, then never again.
    let mut busy = None;
    for _ in 0..100 {
        match test.wait_quiet_for(Duration::from_millis(100)).await {
            Ok(()) => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(KitError::Busy(b)) => {
                busy = Some(b);
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    let busy = busy.expect("a stopped service is not quiet");
    assert!(
        busy.culprits.iter().any(|c| matches!(c,
            Culprit::Stopped { service, reason } if service == "fragile" && reason.contains("gave up"))),
        "{busy}"
    );
    let pool = database().await;
    drop(test);
    assert!(
        !schema_exists(&pool, &schema).await,
        "{schema} dropped with the test"
    );
}

/// Writes its row, then takes its time with its transaction open.
async fn slow_writer(msg: &Message<Placed>, ctx: &mut StepContext<'_>) -> StepResult {
    sqlx::query("INSERT INTO effects (n) VALUES ($1)")
        .bind(msg.payload().n)
        .execute(ctx.conn())
        .await?;
    tokio::time::sleep(Duration::from_secs(30)).await;
    Ok(StepOutcome::completed())
}

/// On a runtime of one thread, which the test's drop blocks: the aborted step's transaction cannot roll
/// back, and its locks stay until its session is ended.
#[tokio::test]
async fn a_test_dropped_while_a_step_holds_its_transaction_open_still_drops_its_schemas() {
    let mut test = SagaTest::start("kit-dropped").await.unwrap();
    let orders = test.topic::<Placed>("orders");
    let input = orders.clone();
    test.service_async("writer", move |s| {
        let input = input.clone();
        async move {
            sqlx::query("CREATE TABLE IF NOT EXISTS effects (n BIGINT NOT NULL)")
                .execute(s.pool())
                .await?;
            Ok::<_, sqlx::Error>(s.builder().step(step("write", slow_writer).on(&input)))
        }
    })
    .await
    .unwrap();
    let schema = schema_of(&test, "writer").await;
    test.send(&orders, "order-1", &Placed { n: 1 })
        .await
        .unwrap();
    let pool = database().await;
    let locked = || {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = 'effects' AND l.mode = 'RowExclusiveLock')",
        )
        .bind(&schema)
        .fetch_one(&pool)
    };
    let mut waited = 0;
    while !locked().await.unwrap() {
        waited += 1;
        assert!(waited < 200, "the step never wrote its row");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(test);
    assert!(
        !schema_exists(&pool, &schema).await,
        "{schema} dropped with the test"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_service_whose_setup_fails_on_its_restart_is_named_as_not_started() {
    let mut test = SagaTest::start("kit-restart").await.unwrap();
    let orders = test.topic::<Placed>("orders");
    let setups = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counted = setups.clone();
    test.service_async("flaky", move |s| {
        let first = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
        let builder = s.builder().step(step("slow", slow).on(&orders));
        async move {
            if first {
                Ok(builder)
            } else {
                Err("its configuration went missing")
            }
        }
    })
    .await
    .unwrap();
    let restarted = test.crash_before_offset_commit("flaky").await;
    assert!(
        matches!(&restarted, Err(KitError::Service { service, error })
            if service == "flaky" && error.to_string().contains("went missing")),
        "{restarted:?}"
    );
    assert_eq!(setups.load(std::sync::atomic::Ordering::SeqCst), 2);
    let Err(KitError::Busy(busy)) = test.wait_quiet_for(Duration::from_millis(200)).await else {
        panic!("a service that did not start again is not quiet");
    };
    assert!(
        busy.culprits.iter().any(|c| matches!(c,
            Culprit::Stopped { service, reason } if service == "flaky" && reason.contains("did not start"))),
        "{busy}"
    );
    // `stop` reports it too.
    let stopped = test.stop().await;
    assert!(
        matches!(&stopped, Err(KitError::Service { service, .. }) if service == "flaky"),
        "{stopped:?}"
    );
}

/// An outside provider: its calls, by the external key each was made with.
#[derive(Clone, Default)]
struct Provider(Arc<Mutex<HashMap<String, u32>>>);

async fn charge_call(msg: &Message<Placed>, provider: &Provider) -> Result<i64, StepError> {
    let key = msg.external_key().as_str().to_owned();
    *provider.0.lock().unwrap().entry(key).or_default() += 1;
    Ok(msg.payload().n * 100)
}

async fn record_charge(
    _msg: &Message<Placed>,
    cents: i64,
    ctx: &mut StepContext<'_>,
    _provider: &Provider,
) -> StepResult {
    sqlx::query("INSERT INTO effects (n) VALUES ($1)")
        .bind(cents)
        .execute(ctx.conn())
        .await?;
    Ok(StepOutcome::completed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_two_phase_step_whose_completion_is_lost_after_its_call_calls_again_and_records_once() {
    let mut test = SagaTest::start("kit-two-phase").await.unwrap();
    let orders = test.topic::<Placed>("orders");
    let provider = Provider::default();
    let (input, calls) = (orders.clone(), provider.clone());
    test.service_async("payments", move |s| {
        let (input, provider) = (input.clone(), calls.clone());
        async move {
            sqlx::query(
                "CREATE TABLE IF NOT EXISTS effects (seq BIGSERIAL PRIMARY KEY, n BIGINT NOT NULL)",
            )
            .execute(s.pool())
            .await?;
            let charge = two_phase("charge", provider, charge_call, record_charge)
                .on(&input)
                .layer(fail_after_handler(1));
            Ok::<_, sqlx::Error>(s.builder().two_phase_step(charge))
        }
    })
    .await
    .unwrap();
    send_orders(&test, &orders, 1..=3).await;
    test.wait_quiet().await.unwrap();
    assert_eq!(
        effects(&test, "payments").await,
        3,
        "each charge recorded once"
    );
    let calls = provider.0.lock().unwrap().clone();
    assert_eq!(calls.len(), 3, "{calls:?}");
    assert!(
        calls.values().all(|n| *n == 2),
        "each call made again, with its key, after its completion was lost: {calls:?}"
    );
    assert!(test.dead_letters("payments").await.unwrap().is_empty());
    test.stop().await.unwrap();
}
