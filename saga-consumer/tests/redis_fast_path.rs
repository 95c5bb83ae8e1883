//! The Redis fast path against the real Redis at `REDIS_URL` (default 127.0.0.1:6379) and PostgreSQL: what
//! it answers without PostgreSQL, and that PostgreSQL still decides whenever Redis is down, has lost an
//! entry, or holds one that does not fit. Redis outages are made with a TCP proxy the test can cut.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use http_body_util::BodyExt;
use saga_consumer::OpsHandle;
use saga_consumer::fast_path::{FastPath, LockAnswer};
use saga_consumer::http::{IdempotencyLayer, REPLAYED_HEADER};
use saga_consumer::settings::{FastPathArgs, RetentionArgs};
use saga_consumer::{
    IdempotencyKey, Message, SagaConsumer, SagaStep, StepContext, StepName, StepOutcome,
    StepResult, Subscription, TenantId,
};
use saga_test_support::{TestDb, TestKafka, wait_until};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A namespace of its own per test and run, so that tests and runs never share keys.
fn namespace(test: &str) -> String {
    format!(
        "saga-test:{test}:{}:{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

fn fast_path(url: &str, namespace: &str) -> FastPath {
    let mut settings = FastPathArgs::new(url);
    settings.lock_ttl = Duration::from_millis(800);
    FastPath::with_namespace(settings, namespace).unwrap()
}

async fn redis() -> redis::aio::MultiplexedConnection {
    redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("Redis answers at REDIS_URL (scripts/dev-services starts nothing for it: it is a machine service)")
}

mod things;

use things::{AppState, create_thing, create_things_table};

struct Fixture {
    db: TestDb,
    pool: sqlx::PgPool,
    app: Router,
    calls: Arc<AtomicU32>,
    ops: OpsHandle,
    namespace: String,
}

impl Fixture {
    /// The app on a pool of `connections`, with the fast path at `url`.
    async fn new(test: &str, url: &str, connections: u32) -> Self {
        let db = TestDb::new(test).await;
        create_things_table(&db.pool).await;
        let pool = db.pool_of(connections).await;
        let namespace = namespace(test);
        let fast = fast_path(url, &namespace);
        let ops = fast.metrics();
        let state = AppState::default();
        let app = Router::new()
            .route(
                "/things",
                post(create_thing).layer(
                    IdempotencyLayer::new(pool.clone(), StepName::from_static("create-thing"))
                        .with_fast_path(Some(fast)),
                ),
            )
            .with_state(state.clone());
        Self {
            db,
            pool,
            app,
            calls: state.calls,
            ops,
            namespace,
        }
    }

    async fn post(
        &self,
        key: &str,
        tenant: &str,
        body: &str,
    ) -> (StatusCode, bool, serde_json::Value) {
        let request = Request::post("/things")
            .header("content-type", "application/json")
            .header("Idempotency-Key", key)
            .header("Tenant-Id", tenant)
            .body(Body::from(body.to_owned()))
            .unwrap();
        let response = self.app.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let replayed = response
            .headers()
            .get(REPLAYED_HEADER)
            .is_some_and(|v| v == "true");
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (
            status,
            replayed,
            serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
        )
    }

    fn metric(&self, name: &str, labels: &str) -> f64 {
        self.ops.sample(name, labels).unwrap_or(0.0)
    }

    fn redis_key(&self, kind: &str, tenant: &str, key: &str) -> String {
        format!("{}:{kind}:{tenant}:{key}:create-thing", self.namespace)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_request_in_flight_gets_409_without_taking_a_connection() {
    // One connection in the pool: the first request holds it (its transaction) while it sleeps.
    let f = Arc::new(Fixture::new("redis-in-flight", &redis_url(), 1).await);
    let first = {
        let f = f.clone();
        tokio::spawn(async move {
            f.post("k-1", "acme", r#"{"name":"a","sleep_ms":1500}"#)
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        f.pool.size() - f.pool.num_idle() as u32,
        1,
        "the first request holds the pool's only connection"
    );
    let started = Instant::now();
    let (status, _, _) = f
        .post("k-1", "acme", r#"{"name":"a","sleep_ms":1500}"#)
        .await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "answered from Redis, not after waiting for the pool's connection ({:?})",
        started.elapsed()
    );
    assert_eq!(
        f.metric("saga_redis_answered_total", r#"answer="in_flight""#),
        1.0
    );
    let (status, replayed, _) = first.await.unwrap();
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(f.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_first_uses_at_once_share_the_first_connection() {
    // A fast path that has not connected yet, hit by a storm on one key: every request but the first
    // must get Redis's "held", none may fall through to PostgreSQL for want of a connection.
    let fast = fast_path(&redis_url(), &namespace("first-use"));
    let ops = fast.metrics();
    let tenant = saga_core::TenantId::new("acme").unwrap();
    let step_key = saga_core::StepKey::new("storm:create-thing").unwrap();
    let go = Arc::new(tokio::sync::Barrier::new(100));
    let answers = futures::future::join_all((0..100).map(|_| {
        let (fast, tenant, step_key, go) =
            (fast.clone(), tenant.clone(), step_key.clone(), go.clone());
        tokio::spawn(async move {
            go.wait().await;
            fast.lock(&tenant, &step_key).await.0
        })
    }))
    .await;
    let count = |wanted: LockAnswer| {
        answers
            .iter()
            .filter(|a| *a.as_ref().unwrap() == wanted)
            .count()
    };
    assert_eq!(
        (
            count(LockAnswer::Acquired),
            count(LockAnswer::Held),
            count(LockAnswer::Unknown)
        ),
        (1, 99, 0)
    );
    let metric = |name: &str| ops.sample(name, "").unwrap_or(0.0);
    assert_eq!(metric("saga_redis_errors_total"), 0.0);
    assert_eq!(metric("saga_redis_available"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_answered_from_redis_with_the_database_gone() {
    let f = Fixture::new("redis-replay", &redis_url(), 2).await;
    let (status, replayed, first) = f.post("k-1", "acme", r#"{"name":"a"}"#).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    // No database at all now: only Redis can answer.
    f.pool.close().await;
    let (status, replayed, again) = f.post("k-1", "acme", r#"{"name":"a"}"#).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(again, first);
    assert_eq!(
        f.metric("saga_redis_answered_total", r#"answer="replay""#),
        1.0
    );
    assert_eq!(f.calls.load(Ordering::SeqCst), 1);
    // Another request with the key is not Redis's to answer: PostgreSQL (gone) would decide.
    let (status, _, _) = f.post("k-1", "acme", r#"{"name":"other"}"#).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_do_not_share_locks_or_cached_responses() {
    let f = Fixture::new("redis-tenants", &redis_url(), 4).await;
    let (status, _, a) = f.post("same-key", "tenant-a", r#"{"name":"a"}"#).await;
    assert_eq!(status, StatusCode::CREATED);
    // Tenant B, same key, another body: its own first request, not A's replay nor a 422.
    let (status, replayed, b) = f.post("same-key", "tenant-b", r#"{"name":"b"}"#).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_ne!(a, b);
    // A lock of tenant A's key does not hold tenant B's.
    let mut redis = redis().await;
    let _: () = redis::cmd("SET")
        .arg(f.redis_key("lock", "tenant-a", "other-key"))
        .arg("someone")
        .arg("PX")
        .arg(10_000)
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(
        f.post("other-key", "tenant-a", r#"{"name":"c"}"#).await.0,
        StatusCode::CONFLICT
    );
    assert_eq!(
        f.post("other-key", "tenant-b", r#"{"name":"c"}"#).await.0,
        StatusCode::CREATED
    );
    assert_eq!(f.db.count("things").await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_left_by_a_killed_process_expires_by_its_ttl() {
    let f = Fixture::new("redis-stale-lock", &redis_url(), 2).await;
    // What a process killed in the middle of a request leaves behind: its lock, with its TTL.
    let mut redis = redis().await;
    let _: () = redis::cmd("SET")
        .arg(f.redis_key("lock", "acme", "k-dead"))
        .arg("killed-process-token")
        .arg("PX")
        .arg(700)
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(
        f.post("k-dead", "acme", r#"{"name":"a"}"#).await.0,
        StatusCode::CONFLICT
    );
    tokio::time::sleep(Duration::from_millis(900)).await;
    let (status, replayed, _) = f.post("k-dead", "acme", r#"{"name":"a"}"#).await;
    assert_eq!(
        (status, replayed),
        (StatusCode::CREATED, false),
        "never a permanent 409"
    );
    assert_eq!(f.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_that_disagree_with_postgres_lose() {
    let f = Fixture::new("redis-disagree", &redis_url(), 2).await;
    let mut redis = redis().await;
    // 1. A cached response PostgreSQL knows nothing of, for another request (another fingerprint): the
    //    request is not refused or replayed on Redis's word; PostgreSQL has no key, so it runs.
    let foreign = serde_json::json!({
        "fingerprint": "00".repeat(32),
        "response": { "status": 200, "headers": [], "body": "{\"forged\":true}" }
    });
    let _: () = redis::cmd("SET")
        .arg(f.redis_key("http", "acme", "k-forged"))
        .arg(foreign.to_string())
        .query_async(&mut redis)
        .await
        .unwrap();
    let (status, replayed, body) = f.post("k-forged", "acme", r#"{"name":"a"}"#).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(body["name"], "a");
    // 2. An entry that does not decode: PostgreSQL answers (here: the replay of the committed request).
    let _: () = redis::cmd("SET")
        .arg(f.redis_key("http", "acme", "k-forged"))
        .arg("not json")
        .query_async(&mut redis)
        .await
        .unwrap();
    let (status, replayed, again) = f.post("k-forged", "acme", r#"{"name":"a"}"#).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(again, body);
    // ... and the replay from PostgreSQL put the right entry back.
    let cached: String = redis::cmd("GET")
        .arg(f.redis_key("http", "acme", "k-forged"))
        .query_async(&mut redis)
        .await
        .unwrap();
    assert!(cached.contains("\\\"name\\\":\\\"a\\\""), "{cached}");
    // 3. A lost entry (Redis flushed, evicted): PostgreSQL replays, the handler does not run again.
    let _: () = redis::cmd("DEL")
        .arg(f.redis_key("http", "acme", "k-forged"))
        .query_async(&mut redis)
        .await
        .unwrap();
    let (status, replayed, _) = f.post("k-forged", "acme", r#"{"name":"a"}"#).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    // 4. The same key with another request: 422 from PostgreSQL, whatever the cache says.
    assert_eq!(
        f.post("k-forged", "acme", r#"{"name":"b"}"#).await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(f.calls.load(Ordering::SeqCst), 1);
    assert_eq!(f.db.count("things").await, 1);
}

/// A TCP proxy to Redis that the test can cut: a Redis outage without stopping the machine's Redis.
struct CuttableProxy {
    url: String,
    cut: CancellationToken,
}

impl CuttableProxy {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("redis://{}", listener.local_addr().unwrap());
        let target = redis_url()
            .trim_start_matches("redis://")
            .trim_end_matches('/')
            .to_owned();
        let cut = CancellationToken::new();
        let stop = cut.clone();
        tokio::spawn(async move {
            loop {
                let (mut client, _) = tokio::select! {
                    () = stop.cancelled() => return,
                    accepted = listener.accept() => accepted.unwrap(),
                };
                let target = target.clone();
                let stop = stop.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(&target).await else {
                        return;
                    };
                    tokio::select! {
                        () = stop.cancelled() => {}
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                    }
                });
            }
        });
        Self { url, cut }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_down_at_start_everything_runs_on_postgres_and_says_so() {
    // Nothing listens on this port.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("redis://{}", closed.local_addr().unwrap());
    drop(closed);
    let f = Fixture::new("redis-down-at-start", &url, 2).await;
    let (status, replayed, _) = f.post("k-1", "acme", r#"{"name":"a"}"#).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let (status, replayed, _) = f.post("k-1", "acme", r#"{"name":"a"}"#).await;
    assert_eq!(
        (status, replayed),
        (StatusCode::CREATED, true),
        "replayed by PostgreSQL"
    );
    assert_eq!(f.calls.load(Ordering::SeqCst), 1);
    assert_eq!(f.metric("saga_redis_available", ""), 0.0);
    assert!(f.metric("saga_redis_errors_total", "") >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_lost_mid_run_everything_runs_on_postgres() {
    let proxy = CuttableProxy::start().await;
    let f = Fixture::new("redis-down-mid-run", &proxy.url, 2).await;
    assert_eq!(
        f.post("k-1", "acme", r#"{"name":"a"}"#).await.0,
        StatusCode::CREATED
    );
    assert_eq!(f.metric("saga_redis_available", ""), 1.0);
    proxy.cut.cancel();
    // Redis gone: a new request and a replay both still work, on PostgreSQL alone.
    let (status, replayed, _) = f.post("k-2", "acme", r#"{"name":"b"}"#).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let (status, replayed, _) = f.post("k-2", "acme", r#"{"name":"b"}"#).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(f.metric("saga_redis_available", ""), 0.0);
    assert!(f.metric("saga_redis_errors_total", "") >= 1.0);
    assert_eq!(f.calls.load(Ordering::SeqCst), 2);
    assert_eq!(f.db.count("things").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_refuse_a_key_ttl_longer_than_the_key_retention() {
    let vars = |pairs: &'static [(&'static str, &'static str)]| {
        move |name: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        }
    };
    let enabled = |pairs| {
        let get = vars(pairs);
        FastPathArgs::from_vars(get)
            .unwrap()
            .enabled(&RetentionArgs::from_vars(get).unwrap())
    };
    assert!(!enabled(&[]).unwrap(), "off without REDIS_URL");
    assert!(enabled(&[("REDIS_URL", "redis://127.0.0.1:6379")]).unwrap());
    let problem = enabled(&[
        ("REDIS_URL", "redis://127.0.0.1:6379"),
        ("REDIS_KEY_TTL_SECS", "18000"),
        ("SAGA_KEY_RETENTION_HOURS", "4"),
    ])
    .unwrap_err();
    assert_eq!(problem.setting, "REDIS_KEY_TTL_SECS");
    let problem = enabled(&[("REDIS_URL", "http://nope")]).unwrap_err();
    assert_eq!(problem.setting, "REDIS_URL");
    let zero = FastPathArgs::from_vars(vars(&[("REDIS_LOCK_TTL_MS", "0")])).unwrap_err();
    assert_eq!(zero.setting, "REDIS_LOCK_TTL_MS", "{zero}");
}

/// Waits until the test group's committed offset of partition 0 of `topic` is `next`.
async fn wait_committed(kafka: &TestKafka, topic: &str, next: i64, what: &str) {
    wait_until(what, Duration::from_secs(60), || async {
        let committed = kafka
            .committed_offsets(&format!("{topic}-group"), topic)
            .await;
        (committed.get(&0) == Some(&next)).then_some(())
    })
    .await;
}

/// Waits until Redis holds `key`.
async fn wait_known(redis: &redis::aio::MultiplexedConnection, key: &str, what: &str) {
    wait_until(what, Duration::from_secs(60), || async {
        let known: Option<String> = redis::cmd("GET")
            .arg(key)
            .query_async(&mut redis.clone())
            .await
            .unwrap();
        known.map(|_| ())
    })
    .await;
}

/// The consumer's step: one row per message.
struct RecordHit {
    topic: String,
}

impl SagaStep for RecordHit {
    type Payload = serde_json::Value;

    fn name(&self) -> StepName {
        StepName::from_static("record-hit")
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        vec![Subscription::new(&self.topic, "Hit")]
    }

    async fn handle(
        &self,
        msg: &Message<serde_json::Value>,
        ctx: &mut StepContext<'_>,
    ) -> StepResult {
        sqlx::query("INSERT INTO hits (step_key) VALUES ($1)")
            .bind(format!("{}:record-hit", msg.idempotency_key()))
            .execute(ctx.conn())
            .await?;
        Ok(StepOutcome::completed())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_acknowledges_duplicates_redis_knows_without_a_transaction_and_postgres_decides_the_rest()
 {
    let db = TestDb::with("redis-consumer", &[saga_consumer::migrate::migrator()]).await;
    sqlx::query("CREATE TABLE hits (step_key TEXT NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("redis-consumer", 1).await;
    kafka.create_topic(&format!("{topic}.dlq"), 1).await;
    kafka.create_topic(&format!("{topic}-group.retry"), 1).await;
    let producer = kafka.producer();
    let hit = |key: &'static str| {
        let (kafka, producer, topic) = (&kafka, &producer, &topic);
        async move {
            kafka
                .produce(
                    producer,
                    topic,
                    Some(key),
                    &[("idempotency-key", key), ("ce_type", "Hit")],
                    b"{}",
                )
                .await
        }
    };
    let namespace = namespace("redis-consumer");
    let fast = fast_path(&redis_url(), &namespace);
    let consumer = SagaConsumer::builder()
        .brokers(kafka.brokers.clone())
        .group_id(format!("{topic}-group"))
        .dlq_topic(format!("{topic}.dlq"))
        .pool(db.pool.clone())
        .commit_interval(Duration::from_millis(100))
        .fast_path(Some(fast))
        .step(RecordHit {
            topic: topic.clone(),
        })
        .build()
        .unwrap();
    let handle = consumer.ops();
    let stop = CancellationToken::new();
    let running = tokio::spawn(consumer.run(stop.clone().cancelled_owned()));
    let sample = |name: &str, labels: &str| handle.sample(name, labels).unwrap_or(0.0);
    let transactions = || sample("saga_consumer_batch_size_count", "");
    let redis_key = |key: &str| format!("{namespace}:step:default:{key}:record-hit");
    let mut redis = redis().await;

    hit("k-1").await;
    wait_known(
        &redis,
        &redis_key("k-1"),
        "k-1 recorded in Redis after its commit",
    )
    .await;
    assert_eq!(db.count("hits").await, 1);
    let before = transactions();

    // A duplicate Redis knows: acknowledged without a transaction.
    let (_, offset) = hit("k-1").await;
    wait_committed(
        &kafka,
        &topic,
        offset + 1,
        "the duplicate's offset committed",
    )
    .await;
    assert_eq!(transactions(), before, "no transaction for the duplicate");
    assert_eq!(
        sample("saga_redis_answered_total", r#"answer="duplicate""#),
        1.0
    );
    assert_eq!(
        sample("saga_consumer_duplicates_total", r#"step="record-hit""#),
        1.0
    );

    // A duplicate Redis has lost: PostgreSQL's claim finds it done; the handler does not run again, and
    // Redis learns the key back.
    let _: () = redis::cmd("DEL")
        .arg(redis_key("k-1"))
        .query_async(&mut redis)
        .await
        .unwrap();
    let (_, offset) = hit("k-1").await;
    wait_committed(
        &kafka,
        &topic,
        offset + 1,
        "the second duplicate's offset committed",
    )
    .await;
    assert_eq!(
        transactions(),
        before + 1.0,
        "PostgreSQL decided, in a transaction"
    );
    assert_eq!(
        sample("saga_consumer_duplicates_total", r#"step="record-hit""#),
        2.0
    );
    wait_known(&redis, &redis_key("k-1"), "k-1 back in Redis").await;

    // A key another tenant completed is not this tenant's.
    let (_, _) = kafka
        .produce(
            &producer,
            &topic,
            Some("k-1"),
            &[
                ("idempotency-key", "k-1"),
                ("ce_type", "Hit"),
                ("tenant-id", "other"),
            ],
            b"{}",
        )
        .await;
    wait_until(
        "the other tenant's message handled",
        Duration::from_secs(60),
        || async { (db.count("hits").await == 2).then_some(()) },
    )
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();
    assert_eq!(db.count("hits").await, 2, "k-1 once per tenant");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn namespace_two_clusters_with_the_same_database_and_schema_names_never_see_each_others_keys()
{
    use sqlx::Connection as _;
    // Two deployments sharing one Redis: one on the shared server, the other on a cluster of its own
    // whose database and schema have the same names (staging and production, or two regions).
    let here = TestDb::new("redis-ns").await;
    let server = saga_test_support::PrivatePostgres::start("redis-ns").await;
    let mut admin = sqlx::PgConnection::connect(&server.url("postgres"))
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE {}",
        here.database()
    )))
    .execute(&mut admin)
    .await
    .unwrap();
    let options: sqlx::postgres::PgConnectOptions = server.url(here.database()).parse().unwrap();
    let there =
        sqlx::PgPool::connect_with(options.options([("search_path", here.schema.as_str())]))
            .await
            .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA {}",
        here.schema
    )))
    .execute(&there)
    .await
    .unwrap();

    let settings = FastPathArgs::new(redis_url());
    let a = FastPath::new(settings.clone(), &here.pool).await.unwrap();
    let b = FastPath::new(settings, &there).await.unwrap();
    let names = format!(".{}.{}", here.database(), here.schema);
    assert!(
        a.namespace().ends_with(&names) && b.namespace().ends_with(&names),
        "{} / {}",
        a.namespace(),
        b.namespace()
    );
    assert_ne!(
        a.namespace(),
        b.namespace(),
        "the clusters' system identifiers tell the deployments apart"
    );
    // The timeline is part of it: a promoted replica, or a backup restored to a point in time, starts on a
    // new one, and so with a namespace of its own.
    let (sysid, timeline): (String, i32) = sqlx::query_as(
        "SELECT (SELECT system_identifier::text FROM pg_control_system()), \
                (SELECT timeline_id FROM pg_control_checkpoint())",
    )
    .fetch_one(&here.pool)
    .await
    .unwrap();
    assert_eq!(
        a.namespace(),
        format!("saga:{sysid}.{timeline}{names}"),
        "identifier, timeline, database, schema"
    );

    let tenant = TenantId::default();
    let key = IdempotencyKey::new("order-1")
        .unwrap()
        .step_key(&StepName::from_static("charge"));
    a.mark_completed(&[(&tenant, &key)]).await;
    assert_eq!(a.completed(&[(&tenant, &key)]).await, [true]);
    assert_eq!(
        b.completed(&[(&tenant, &key)]).await,
        [false],
        "a completion in one deployment is not seen by the other"
    );
    // After a point-in-time restore of `a`, its namespace is forgotten; `b`'s keys stay.
    b.mark_completed(&[(&tenant, &key)]).await;
    assert_eq!(a.forget_namespace().await.unwrap(), 1);
    assert_eq!(a.completed(&[(&tenant, &key)]).await, [false]);
    assert_eq!(b.completed(&[(&tenant, &key)]).await, [true]);
    assert_eq!(b.forget_namespace().await.unwrap(), 1);
    there.close().await;
}
