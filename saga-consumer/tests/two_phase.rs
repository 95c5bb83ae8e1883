//! Two-phase steps and the key they hand to an outside system, against the real broker and PostgreSQL: a
//! crash between the external call and the completion still yields one charge, and two tenants sending
//! the same client key are charged separately.

use std::process::Stdio;
use std::time::Duration;

use saga_consumer::SagaConsumer;
use saga_core::{Message, StepContext, StepError, StepName, StepOutcome, StepResult};
use saga_core::{Subscription, TwoPhaseStep};
use saga_test_support::{TestDb, TestKafka, wait_until};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

/// A payment step whose "provider" is a table keyed by the idempotency key it is handed, like a real
/// provider: charging twice with one key returns the first charge.
struct Charge {
    pool: PgPool,
    topic: String,
    /// Abort the process right after the provider charged (fault injection for the child process).
    crash_after_call: bool,
}

impl TwoPhaseStep for Charge {
    type Payload = serde_json::Value;
    type Response = String;

    fn name(&self) -> StepName {
        StepName::from_static("charge")
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        vec![Subscription::new(&self.topic, "OrderPlaced")]
    }

    fn lease(&self) -> Duration {
        Duration::from_secs(2)
    }

    async fn call(&self, msg: &Message<serde_json::Value>) -> Result<String, StepError> {
        let charge_id: String = sqlx::query_scalar(
            "WITH new AS (INSERT INTO provider_charges (idempotency_key, charge_id) \
                          VALUES ($1, gen_random_uuid()::text) \
                          ON CONFLICT (idempotency_key) DO NOTHING RETURNING charge_id) \
             SELECT charge_id FROM new UNION ALL \
             SELECT charge_id FROM provider_charges WHERE idempotency_key = $1 LIMIT 1",
        )
        .bind(msg.external_key().as_str())
        .fetch_one(&self.pool)
        .await?;
        if self.crash_after_call {
            std::process::abort();
        }
        Ok(charge_id)
    }

    async fn complete(
        &self,
        msg: &Message<serde_json::Value>,
        charge_id: String,
        ctx: &mut StepContext<'_>,
    ) -> StepResult {
        sqlx::query("INSERT INTO orders_paid (tenant, client_key, charge_id) VALUES ($1, $2, $3)")
            .bind(msg.tenant().as_str())
            .bind(msg.idempotency_key().as_str())
            .bind(&charge_id)
            .execute(ctx.conn())
            .await?;
        Ok(StepOutcome::completed())
    }
}

fn consumer(pool: PgPool, brokers: &str, topic: &str, crash: bool) -> SagaConsumer {
    SagaConsumer::builder()
        .brokers(brokers)
        .group_id(format!("{topic}-group"))
        .dlq_topic(format!("{topic}.dlq"))
        .pool(pool.clone())
        .session_timeout(Duration::from_secs(6))
        .two_phase_step(Charge {
            pool,
            topic: topic.to_owned(),
            crash_after_call: crash,
        })
        .build()
        .unwrap()
}

/// Runs in a child process: a consumer that aborts `ABORT_AFTER_MS` after it started, wherever it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by a_message_waiting_for_a_dead_workers_lease_is_not_blamed_for_deaths_meanwhile"]
async fn abort_after_child_process() {
    let (Ok(url), Ok(brokers), Ok(topic), Ok(after)) = (
        std::env::var("CRASH_DATABASE_URL"),
        std::env::var("CRASH_BROKERS"),
        std::env::var("CHARGE_TOPIC"),
        std::env::var("ABORT_AFTER_MS"),
    ) else {
        panic!("run by the lease test only");
    };
    let after = Duration::from_millis(after.parse().unwrap());
    std::thread::spawn(move || {
        std::thread::sleep(after);
        std::process::abort();
    });
    let pool = PgPool::connect(&url).await.unwrap();
    consumer(pool, &brokers, &topic, false)
        .run(std::future::pending())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_waiting_for_a_dead_workers_lease_is_not_blamed_for_deaths_meanwhile() {
    let db = TestDb::with(
        "two-phase-lease-wait",
        &[saga_consumer::migrate::migrator()],
    )
    .await;
    for table in [
        "CREATE TABLE provider_charges (idempotency_key TEXT PRIMARY KEY, charge_id TEXT NOT NULL)",
        "CREATE TABLE orders_paid (tenant TEXT, client_key TEXT, charge_id TEXT, PRIMARY KEY (tenant, client_key))",
    ] {
        sqlx::query(table).execute(&db.pool).await.unwrap();
    }
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("two-phase-lease-wait", 1).await;
    let dlq = format!("{topic}.dlq");
    kafka.create_topic(&dlq, 1).await;
    kafka.create_topic(&format!("{topic}-group.retry"), 1).await;
    let headers = [("idempotency-key", "order-1"), ("ce_type", "OrderPlaced")];
    kafka
        .produce(&kafka.producer(), &topic, Some("order-1"), &headers, b"{}")
        .await;
    // A previous run died in the batch of offset 0 while holding the step's lease, which runs a minute.
    sqlx::query(
        "INSERT INTO saga_consumer_progress (group_id, topic, partition, batch_offset, batch_end) \
         VALUES ($1, $2, 0, 0, 0)",
    )
    .bind(format!("{topic}-group"))
    .bind(&topic)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status, lease_expires_at) \
         VALUES ('default', 'order-1:charge', 'started', now() + interval '1 minute')",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    // Three consumers die, for reasons of their own, while the message waits for that lease: as many
    // deaths as the crash-loop limit.
    for _ in 0..3 {
        let status = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "abort_after_child_process", "--ignored"])
            .env("CRASH_DATABASE_URL", db.url())
            .env("CRASH_BROKERS", &kafka.brokers)
            .env("CHARGE_TOPIC", &topic)
            .env("ABORT_AFTER_MS", "10000")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await
            .unwrap();
        assert!(!status.success(), "the child died");
    }
    assert_eq!(
        db.count("provider_charges").await,
        0,
        "nothing ran meanwhile"
    );

    // The lease runs out; the next consumer charges, instead of dead-lettering the message as a crash loop.
    sqlx::query("UPDATE saga_idempotency_keys SET lease_expires_at = now()")
        .execute(&db.pool)
        .await
        .unwrap();
    let stop = CancellationToken::new();
    let running = tokio::spawn(
        consumer(db.pool.clone(), &kafka.brokers, &topic, false)
            .run(stop.clone().cancelled_owned()),
    );
    wait_until("the order paid", WAIT, || async {
        (db.count("orders_paid").await == 1).then_some(())
    })
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();
    assert_eq!(db.count("provider_charges").await, 1);
    let (_, high) = kafka.end_offsets(&dlq).await.into_iter().next().unwrap();
    assert_eq!(high, 0, "nothing was dead-lettered");
}

/// Runs in a child process: a consumer whose step aborts right after the provider charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by a_crash_between_the_external_call_and_the_completion_still_yields_one_charge_per_tenant"]
async fn crash_after_call_child_process() {
    let (Ok(url), Ok(brokers), Ok(topic)) = (
        std::env::var("CRASH_DATABASE_URL"),
        std::env::var("CRASH_BROKERS"),
        std::env::var("CHARGE_TOPIC"),
    ) else {
        panic!("run by the crash test only");
    };
    let pool = PgPool::connect(&url).await.unwrap();
    consumer(pool, &brokers, &topic, true)
        .run(std::future::pending())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crash_between_the_external_call_and_the_completion_still_yields_one_charge_per_tenant() {
    let db = TestDb::with("two-phase-crash", &[saga_consumer::migrate::migrator()]).await;
    for table in [
        "CREATE TABLE provider_charges (idempotency_key TEXT PRIMARY KEY, charge_id TEXT NOT NULL)",
        "CREATE TABLE orders_paid (tenant TEXT, client_key TEXT, charge_id TEXT, PRIMARY KEY (tenant, client_key))",
    ] {
        sqlx::query(table).execute(&db.pool).await.unwrap();
    }
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("two-phase-crash", 1).await;
    kafka.create_topic(&format!("{topic}.dlq"), 1).await;
    kafka.create_topic(&format!("{topic}-group.retry"), 1).await;
    let producer = kafka.producer();
    let place = |tenant: &'static str| {
        let (kafka, producer, topic) = (&kafka, &producer, &topic);
        async move {
            let headers = [
                ("idempotency-key", "order-1"),
                ("tenant-id", tenant),
                ("ce_type", "OrderPlaced"),
            ];
            kafka
                .produce(producer, topic, Some("order-1"), &headers, b"{}")
                .await;
        }
    };

    // Tenant A's order: the first worker charges at the provider, then dies before completing.
    place("tenant-a").await;
    let status = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_after_call_child_process", "--ignored"])
        .env("CRASH_DATABASE_URL", db.url())
        .env("CRASH_BROKERS", &kafka.brokers)
        .env("CHARGE_TOPIC", &topic)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
        .unwrap();
    assert!(!status.success(), "the child aborted after the call");
    let charged_before_crash: Vec<(String, String)> =
        sqlx::query_as("SELECT idempotency_key, charge_id FROM provider_charges")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        charged_before_crash.len(),
        1,
        "charged once before the crash"
    );
    assert_eq!(
        db.count("orders_paid").await,
        0,
        "the completion never committed"
    );

    // Tenant B sends the same client key; a new worker takes tenant A's lease over once it expires.
    place("tenant-b").await;
    let stop = CancellationToken::new();
    let running = tokio::spawn(
        consumer(db.pool.clone(), &kafka.brokers, &topic, false)
            .run(stop.clone().cancelled_owned()),
    );
    wait_until("both orders paid", WAIT, || async {
        (db.count("orders_paid").await == 2).then_some(())
    })
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();

    let charges: Vec<(String, String)> =
        sqlx::query_as("SELECT idempotency_key, charge_id FROM provider_charges ORDER BY 1")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        charges.len(),
        2,
        "one charge per tenant, none for the retry: {charges:?}"
    );
    assert_eq!(
        charges.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
        ["tenant-a:order-1:charge", "tenant-b:order-1:charge"]
    );
    assert_ne!(charges[0].1, charges[1].1, "different charges");
    let paid: Vec<(String, String)> =
        sqlx::query_as("SELECT tenant, charge_id FROM orders_paid ORDER BY tenant")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        paid,
        vec![
            ("tenant-a".to_owned(), charged_before_crash[0].1.clone()),
            ("tenant-b".to_owned(), charges[1].1.clone()),
        ],
        "tenant A completed with the charge made before the crash, tenant B with its own"
    );
    let attempts: i32 = sqlx::query_scalar(
        "SELECT attempts FROM saga_idempotency_keys WHERE tenant_id = 'tenant-a'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(attempts, 2, "tenant A's lease was taken over once");
}

/// Retention (of a relay keeping keys a day) deleted keys up to a day ago; a message written 30 hours ago
/// arrives twice (a replay, then its duplicate), its key not in the store: the provider may have charged it
/// before its key was deleted, so neither copy calls the provider again: both are dead-lettered, saying
/// why, and the key is left absent. A fresh message is charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_older_than_what_retention_deleted_is_not_charged_again() {
    const HOUR: Duration = Duration::from_secs(3600);
    let db = TestDb::with("two-phase-old", &[saga_consumer::migrate::migrator()]).await;
    for table in [
        "CREATE TABLE provider_charges (idempotency_key TEXT PRIMARY KEY, charge_id TEXT NOT NULL)",
        "CREATE TABLE orders_paid (tenant TEXT, client_key TEXT, charge_id TEXT, PRIMARY KEY (tenant, client_key))",
    ] {
        sqlx::query(table).execute(&db.pool).await.unwrap();
    }
    outbox_relay::run_retention(
        &db.pool,
        &outbox_relay::RetentionArgs::from_vars(|name| {
            (name == "SAGA_KEY_RETENTION_HOURS").then(|| "24".to_owned())
        })
        .unwrap()
        .policy()
        .unwrap(),
    )
    .await
    .unwrap();
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("two-phase-old", 1).await;
    kafka.create_topic(&format!("{topic}.dlq"), 1).await;
    kafka.create_topic(&format!("{topic}-group.retry"), 1).await;
    let producer = kafka.producer();
    let old =
        chrono::Utc::now().timestamp_millis() - i64::try_from((30 * HOUR).as_millis()).unwrap();
    for (key, timestamp) in [
        ("order-1", Some(old)),
        ("order-1", Some(old)),
        ("order-2", None),
    ] {
        let mut record = rdkafka::producer::FutureRecord::to(&topic)
            .key(key)
            .payload("{}")
            .headers(
                rdkafka::message::OwnedHeaders::new()
                    .insert(rdkafka::message::Header {
                        key: "idempotency-key",
                        value: Some(key),
                    })
                    .insert(rdkafka::message::Header {
                        key: "ce_type",
                        value: Some("OrderPlaced"),
                    }),
            );
        if let Some(t) = timestamp {
            record = record.timestamp(t);
        }
        producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .unwrap();
    }
    let stop = CancellationToken::new();
    let running = tokio::spawn(
        consumer(db.pool.clone(), &kafka.brokers, &topic, false)
            .run(stop.clone().cancelled_owned()),
    );
    let letters = kafka
        .read_all(&format!("{topic}.dlq"), 2, Duration::from_millis(500), WAIT)
        .await;
    wait_until("the fresh order paid", WAIT, || async {
        (db.count("orders_paid").await == 1).then_some(())
    })
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();
    assert_eq!(
        letters.len(),
        2,
        "both copies of the old message dead-lettered"
    );
    for letter in &letters {
        let error = letter.header("dlq-error").unwrap_or_default();
        assert!(error.contains("SAGA_KEY_RETENTION_HOURS"), "{error}");
    }
    let charged: Vec<String> = sqlx::query_scalar("SELECT idempotency_key FROM provider_charges")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        charged,
        ["default:order-2:charge"],
        "only the fresh order charged"
    );
    let old_key: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM saga_idempotency_keys WHERE step_key = 'order-1:charge'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(old_key, 0, "the old message's key left absent");
}
