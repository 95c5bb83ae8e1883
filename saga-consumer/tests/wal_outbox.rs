//! A service in WAL mode (`SAGA_OUTBOX_MODE=wal`) against the real broker and PostgreSQL: its steps' events
//! go to the write-ahead log, not to `saga_outbox`, and its embedded relay publishes them from the schema's
//! slot, which the service created before its first write; a lost slot stops it until an operator recovers
//! it; its relay's readiness is its own; events over the size limit are refused. (A test binary of its own:
//! the outbox is the process's.)

use std::time::Duration;

use saga_consumer::{OpsHandle, OutboxMode, SagaEvent, SagaService, SagaServiceBuilder};
use saga_test_support::{TestDb, TestKafka, unique_name, wait_until};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

mod steps;

use steps::{Reserved, place_orders, read_reserved, reserve_on};

const WAIT: Duration = Duration::from_secs(60);

/// A service in WAL mode running the `reserve` step on a topic of its own (events to `{topic}.out`,
/// effects in `reservations`).
struct WalService {
    db: TestDb,
    kafka: TestKafka,
    topic: String,
    out: String,
    group: String,
    ops: OpsHandle,
    outbox: saga_consumer::Outbox,
    stop: CancellationToken,
    running: JoinHandle<Result<(), saga_consumer::ServiceError>>,
}

impl WalService {
    /// Starts it, `configure`d beyond the defaults (its relay reads the slot with the test's own URL).
    async fn start(
        name: &str,
        configure: impl FnOnce(SagaServiceBuilder) -> SagaServiceBuilder,
    ) -> Self {
        let db = TestDb::empty(name).await;
        sqlx::query("CREATE TABLE reservations (n BIGINT PRIMARY KEY)")
            .execute(&db.pool)
            .await
            .unwrap();
        let kafka = TestKafka::new().await;
        let topic = unique_name(name);
        let out = format!("{topic}.out");
        kafka.create_topic(&out, 1).await;
        let group = format!("{topic}-group");
        let url = db.url();
        let builder = SagaService::builder()
            .brokers(&kafka.brokers)
            .group_id(&group)
            .pool(db.pool.clone())
            .step(reserve_on(&topic))
            .create_topics(1, 1)
            .outbox_mode(OutboxMode::Wal)
            .relay(|r| r.replication_url(url));
        let builder = configure(builder);
        let outbox = builder.outbox();
        let service = builder.build().unwrap();
        let ops = service.ops();
        let stop = CancellationToken::new();
        let running = tokio::spawn(service.run(stop.clone().cancelled_owned()));
        wait_until("the service's topics", WAIT, || async {
            (kafka.partition_count(&topic).await == 1).then_some(())
        })
        .await;
        for t in [&topic, &format!("{group}.dlq"), &format!("{group}.retry")] {
            kafka.delete_on_drop(t);
        }
        // The topics come first; then the outbox is opened (its slot made) before anything is consumed.
        wait_until("the service's outbox opened", WAIT, || async {
            (ops.is_check_ready("outbox") == Some(true) || running.is_finished()).then_some(())
        })
        .await;
        Self {
            db,
            kafka,
            topic,
            out,
            group,
            ops,
            outbox,
            stop,
            running,
        }
    }

    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(WAIT, self.running)
            .await
            .expect("the service stops")
            .unwrap()
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_service_in_wal_mode_writes_its_events_to_the_log_and_its_relay_publishes_each_once() {
    let s = WalService::start("service-wal", |b| b).await;
    let slot_exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
    )
    .bind(saga_runtime::store::wal::slot_name(
        s.db.database(),
        &s.db.schema,
    ))
    .fetch_one(&s.db.pool)
    .await
    .unwrap();
    assert!(slot_exists, "the slot exists before the first event");

    // Every order delivered twice: one effect, one event each.
    place_orders(&s.kafka, &s.topic, (1..=5).chain(1..=5)).await;
    let (published, ns) = read_reserved(&s.kafka, &s.out, 5, Duration::from_millis(1_000)).await;
    assert_eq!(ns, [1, 2, 3, 4, 5], "each event once");
    assert!(
        published
            .iter()
            .all(|m| m.header("ce_type") == Some(Reserved::TYPES[0])
                && m.header("idempotency-key").is_some())
    );
    assert_eq!(s.db.count("reservations").await, 5);
    assert_eq!(
        s.db.count("saga_outbox").await,
        0,
        "no outbox row: the log carried them"
    );
    s.stop().await;
}

/// The service's slot is dropped (a failover, an operator's mistake) while it runs: within seconds its
/// consumer stops committing (a message arriving then is not processed, and not dead-lettered), its
/// readiness fails with the `outbox` check, `saga_outbox_writable` drops to 0, and nothing makes the slot
/// again; an operator's recovery lets it go on, and the waiting message is processed then, its event
/// published.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_service_whose_slot_is_lost_stops_committing_until_an_operator_recovers_it() {
    let s = WalService::start("service-wal-lost", |b| b).await;
    let (db, kafka, ops) = (&s.db, &s.kafka, &s.ops);
    place_orders(kafka, &s.topic, [1]).await;
    let (_, ns) = read_reserved(kafka, &s.out, 1, Duration::from_millis(300)).await;
    assert_eq!(ns, [1]);
    assert!(ops.is_ready());

    // The slot goes (the relay reading it is ended first, as a failover would).
    let slot = saga_runtime::store::wal::slot_name(db.database(), &db.schema);
    wait_until("the slot dropped", WAIT, || async {
        sqlx::query(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
             WHERE slot_name = $1 AND active_pid IS NOT NULL",
        )
        .bind(&slot)
        .execute(&db.pool)
        .await
        .unwrap();
        sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(&slot)
            .execute(&db.pool)
            .await
            .is_ok()
            .then_some(())
    })
    .await;
    wait_until("the service to notice", Duration::from_secs(10), || async {
        (ops.is_check_ready("outbox") == Some(false)).then_some(())
    })
    .await;
    assert!(!ops.is_ready());
    assert_eq!(ops.sample("saga_outbox_writable", ""), Some(0.0));
    place_orders(kafka, &s.topic, [2]).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        db.count("reservations").await,
        1,
        "nothing committed meanwhile"
    );
    let slot_back: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
    )
    .bind(&slot)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(!slot_back, "nothing made the slot again");
    assert_eq!(
        kafka
            .end_offsets(&format!("{}.dlq", s.group))
            .await
            .values()
            .sum::<i64>(),
        0,
        "nothing dead-lettered"
    );

    let recovery = saga_runtime::store::wal::recover(&db.pool, "tester")
        .await
        .unwrap();
    assert_eq!(recovery.what, "gone");
    let (_, ns) = read_reserved(kafka, &s.out, 2, Duration::from_millis(300)).await;
    assert_eq!(
        ns,
        [1, 2],
        "the waiting message processed, its event published"
    );
    assert_eq!(db.count("reservations").await, 2);
    wait_until("ready again", WAIT, || async {
        ops.is_ready().then_some(())
    })
    .await;
    s.stop().await;
}

/// An embedded relay that cannot read its slot (here: its replication connection is refused) is the
/// relay's readiness check, not the service's: the consumers and HTTP entry points carry on and `/readyz`
/// stays ready while `/readyz/relay` says not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_embedded_relay_that_cannot_read_does_not_make_the_service_unready() {
    let s = WalService::start("service-wal-relay-ready", |b| {
        b.relay(|r| r.replication_url("postgres://postgres@127.0.0.1:9/nowhere"))
    })
    .await;
    place_orders(&s.kafka, &s.topic, [1]).await;
    wait_until("the step to run", WAIT, || async {
        (s.db.count("reservations").await == 1).then_some(())
    })
    .await;
    wait_until("the service ready", WAIT, || async {
        s.ops.is_ready().then_some(())
    })
    .await;
    assert_eq!(
        s.ops.is_check_ready("relay"),
        Some(false),
        "the relay says it is not"
    );
    assert_eq!(s.ops.is_check_ready("consumer"), Some(true));
    s.stop().await;
}

/// A step whose events are larger than `SAGA_OUTBOX_MAX_TRANSACTION_BYTES` fails for good: its message is
/// dead-lettered at once with the limit named, nothing of it is committed, and the next message goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_step_whose_events_are_over_the_size_limit_is_dead_lettered_naming_it() {
    let s = WalService::start("service-wal-too-large", |b| {
        b.outbox_max_transaction_bytes(64)
    })
    .await;
    place_orders(&s.kafka, &s.topic, [1, 2]).await;
    let letters = s
        .kafka
        .read_all(
            &format!("{}.dlq", s.group),
            2,
            Duration::from_millis(500),
            WAIT,
        )
        .await;
    assert_eq!(letters.len(), 2);
    for letter in &letters {
        let error = letter.header("dlq-error").unwrap_or_default();
        assert!(
            error.contains("SAGA_OUTBOX_MAX_TRANSACTION_BYTES"),
            "{error}"
        );
        assert_eq!(
            letter.header("dlq-attempts"),
            Some("1"),
            "dead-lettered at once"
        );
    }
    assert_eq!(
        s.db.count("reservations").await,
        0,
        "nothing of them committed"
    );
    s.stop().await;
}

/// Emits `Reserved { n }` to the topic named by the `x-out` header, in the request's transaction.
async fn reserve_over_http(
    request: saga_consumer::http::IdempotentRequest,
    headers: axum::http::HeaderMap,
    axum::Json(n): axum::Json<i64>,
) -> axum::http::StatusCode {
    let out = headers["x-out"].to_str().unwrap().to_owned();
    request
        .emit(
            &saga_consumer::Topic::new(out),
            format!("order-{n}"),
            &Reserved { n },
        )
        .unwrap();
    axum::http::StatusCode::CREATED
}

/// An HTTP layer that was not given its service's WAL outbox writes the table; once a relay read the
/// schema's slot, table rows are not ordered with the log's events, so such a layer refuses (503) and
/// commits nothing; given the service's outbox, the same request commits and its event is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_writer_not_given_the_wal_outbox_refuses_once_the_schema_reads_the_log() {
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use saga_consumer::StepName;
    use saga_consumer::http::IdempotencyLayer;
    use tower::ServiceExt;

    let s = WalService::start("service-wal-http", |b| b).await;
    place_orders(&s.kafka, &s.topic, [1]).await;
    let (_, ns) = read_reserved(&s.kafka, &s.out, 1, Duration::from_millis(300)).await;
    assert_eq!(ns, [1]);
    let switched: Option<String> =
        sqlx::query_scalar("SELECT switched_at::text FROM saga_outbox_wal_slot")
            .fetch_one(&s.db.pool)
            .await
            .unwrap();
    assert!(switched.is_some(), "the relay read the slot");

    let post = |layer: IdempotencyLayer, key: &str, n: i64| {
        let app = axum::Router::new().route(
            "/reserve",
            axum::routing::post(reserve_over_http).layer(layer),
        );
        let request = Request::post("/reserve")
            .header("content-type", "application/json")
            .header("Idempotency-Key", key)
            .header("x-out", &s.out)
            .body(Body::from(n.to_string()))
            .unwrap();
        async move { app.oneshot(request).await.unwrap().status() }
    };
    let step = StepName::from_static("reserve-http");
    let not_given = IdempotencyLayer::new(s.db.pool.clone(), step.clone());
    assert_eq!(
        post(not_given, "http-2", 2).await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(s.db.count("saga_outbox").await, 0, "no table row");
    assert_eq!(
        s.db.count("saga_idempotency_keys").await,
        1,
        "only the consumed message's key: the request committed nothing"
    );

    let given = IdempotencyLayer::new(s.db.pool.clone(), step).with_outbox(&s.outbox);
    assert_eq!(post(given, "http-3", 3).await, StatusCode::CREATED);
    let (_, ns) = read_reserved(&s.kafka, &s.out, 2, Duration::from_millis(300)).await;
    assert_eq!(ns, [1, 3], "the given layer's event published from the log");
    assert_eq!(s.db.count("saga_outbox").await, 0);
    s.stop().await;
}

/// Records the order and emits `Reserved` keyed with a NUL character, which the outbox cannot store.
async fn reserve_with_a_nul_key(
    msg: &saga_consumer::Message<steps::Placed>,
    ctx: &mut saga_consumer::StepContext<'_>,
    out: &saga_consumer::Topic<Reserved>,
) -> saga_consumer::StepResult {
    let n = msg.payload().n;
    sqlx::query("INSERT INTO reservations (n) VALUES ($1)")
        .bind(n)
        .execute(ctx.conn())
        .await?;
    ctx.emit(out, format!("order\0{n}"), &Reserved { n })?;
    Ok(saga_consumer::StepOutcome::completed())
}

/// In WAL mode an event holding a NUL character is refused when the step writes it, as the table refuses
/// it (the log's bytes would take it, and the relay could not park it): the message is dead-lettered at
/// once with the reason, nothing of its step commits, and the relay reads on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_event_holding_a_nul_character_is_refused_at_write_and_its_message_dead_lettered() {
    let nul = unique_name("service-wal-nul-in");
    let (topic, out) = (nul.clone(), format!("{nul}.out"));
    let s = WalService::start("service-wal-nul", move |b| {
        b.step(
            saga_consumer::step_with(
                "reserve-nul",
                saga_consumer::Topic::<Reserved>::new(out),
                reserve_with_a_nul_key,
            )
            .on(&saga_consumer::Topic::<steps::Placed>::new(topic)),
        )
    })
    .await;
    s.kafka.delete_on_drop(&nul);
    place_orders(&s.kafka, &nul, [7]).await;
    place_orders(&s.kafka, &s.topic, [8]).await;
    let letters = s
        .kafka
        .read_all(
            &format!("{}.dlq", s.group),
            1,
            Duration::from_millis(500),
            WAIT,
        )
        .await;
    assert_eq!(letters.len(), 1);
    let error = letters[0].header("dlq-error").unwrap_or_default();
    assert!(error.contains("NUL"), "{error}");
    assert_eq!(
        letters[0].header("dlq-attempts"),
        Some("1"),
        "dead-lettered at once"
    );
    let (_, ns) = read_reserved(&s.kafka, &s.out, 1, Duration::from_millis(500)).await;
    assert_eq!(
        ns,
        [8],
        "the other step's event is published: the relay reads on"
    );
    assert_eq!(
        s.db.count("reservations").await,
        1,
        "only order 8's step committed"
    );
    s.stop().await;
}
