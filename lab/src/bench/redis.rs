//! The Redis fast path against PostgreSQL alone, in one run: a storm of concurrent requests on one key,
//! replays of a completed key, and a consumer on a topic where nine messages in ten are duplicates.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use saga_consumer::fast_path::FastPath;
use saga_consumer::http::IdempotencyLayer;
use saga_consumer::settings::FastPathArgs;
use saga_core::StepName;
use saga_runtime::kafka::KafkaConfig;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::bench::http::{Client, create_table, with_layer};
use crate::bench::{Progress, consumer, percentile};

/// What one side (with or without Redis) measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Side {
    /// The storm: p50 and p99 of the concurrent requests on one key, ms.
    pub storm_ms: (f64, f64),
    /// The most PostgreSQL connections the storm held at once.
    pub storm_connections: u32,
    /// The storm's answers by status code.
    pub storm_statuses: std::collections::BTreeMap<u16, usize>,
    /// The storm's 409s answered by Redis, without PostgreSQL (`saga_redis_answered_total{answer="in_flight"}`).
    pub storm_in_flight_from_redis: f64,
    /// Redis calls of the storm that failed or timed out, each answered by PostgreSQL instead
    /// (`saga_redis_errors_total`).
    pub storm_redis_errors: f64,
    /// Replays of a completed key, one after another: p50 and p99, ms.
    pub replay_ms: (f64, f64),
    /// Consumer throughput on the topic with 90% duplicates, messages/s.
    pub duplicates_msgs_per_s: f64,
}

/// Both sides.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Figures {
    /// PostgreSQL alone.
    pub postgres_only: Side,
    /// With the Redis fast path.
    pub with_redis: Side,
}

/// The HTTP figures of one side: a storm of `storm` requests on one key, then `replays` replays.
async fn http_side(
    pool: &PgPool,
    fast_path: Option<FastPath>,
    storm: usize,
    replays: usize,
    label: &str,
) -> anyhow::Result<Side> {
    create_table(pool).await?;
    // Connected and counted as a service's fast path is from its start (`FastPath::from_env`).
    let ops = fast_path.as_ref().map(FastPath::metrics);
    if let Some(fast) = &fast_path {
        anyhow::ensure!(fast.connect().await, "Redis does not answer");
    }
    let metric = |name: &str, labels: &str| {
        ops.as_ref()
            .and_then(|ops| ops.sample(name, labels))
            .unwrap_or(0.0)
    };
    let app = Router::new().route(
        "/orders",
        post(with_layer).layer(
            IdempotencyLayer::new(pool.clone(), StepName::from_static("create-order"))
                .with_fast_path(fast_path),
        ),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    // One connection per client, all opened first, so that the storm is only the requests.
    let mut clients = Vec::with_capacity(storm);
    for _ in 0..storm {
        clients.push(Client::connect(addr).await?);
    }
    let key = format!("storm-{label}-{}", uuid::Uuid::new_v4().simple());
    let body = serde_json::json!({ "key": key, "amount": 1 }).to_string();
    let stop_sampling = CancellationToken::new();
    let peak = Arc::new(AtomicU32::new(0));
    let sampler = {
        let (pool, peak, stop) = (pool.clone(), peak.clone(), stop_sampling.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let used = pool
                    .size()
                    .saturating_sub(u32::try_from(pool.num_idle()).unwrap_or(0));
                peak.fetch_max(used, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        })
    };
    let go = Arc::new(tokio::sync::Barrier::new(storm));
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|mut client| {
            let (go, key, body) = (go.clone(), key.clone(), body.clone());
            tokio::spawn(async move {
                go.wait().await;
                client.post_status("/orders", &key, body).await
            })
        })
        .collect();
    let mut storm_ms = Vec::with_capacity(storm);
    let mut storm_statuses = std::collections::BTreeMap::new();
    for task in tasks {
        let (status, elapsed) = task.await??;
        *storm_statuses.entry(status.as_u16()).or_default() += 1;
        storm_ms.push(elapsed.as_secs_f64() * 1000.0);
    }
    stop_sampling.cancel();
    sampler.await?;
    let storm_in_flight_from_redis = metric("saga_redis_answered_total", r#"answer="in_flight""#);
    let storm_redis_errors = metric("saga_redis_errors_total", "");
    // Let the first request's commit settle, then replay it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut client = Client::connect(addr).await?;
    let mut replay_ms = Vec::with_capacity(replays);
    for _ in 0..replays {
        let (status, elapsed) = client.post_status("/orders", &key, body.clone()).await?;
        anyhow::ensure!(status.is_success(), "a replay answered {status}");
        replay_ms.push(elapsed.as_secs_f64() * 1000.0);
    }
    server.abort();
    Ok(Side {
        storm_ms: (
            percentile(&mut storm_ms, 0.5),
            percentile(&mut storm_ms, 0.99),
        ),
        storm_connections: peak.load(Ordering::Relaxed),
        storm_statuses,
        storm_in_flight_from_redis,
        storm_redis_errors,
        replay_ms: (
            percentile(&mut replay_ms, 0.5),
            percentile(&mut replay_ms, 0.99),
        ),
        duplicates_msgs_per_s: 0.0,
    })
}

/// Consumer throughput over `topic` (`messages`, 90% duplicates), with `fast_path` or without.
async fn duplicates_side(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topic: &str,
    messages: i64,
    fast_path: Option<FastPath>,
    progress: &Progress,
) -> anyhow::Result<f64> {
    consumer::create_effects_table(pool).await?;
    let stop = CancellationToken::new();
    let group = if fast_path.is_some() { "redis" } else { "pg" };
    let consumer = consumer::measured_consumer(kafka, pool, topic, group, 0, 100, 4)
        .fast_path(fast_path)
        .build()?;
    let ops = consumer.ops();
    let running = tokio::spawn(consumer.run(stop.clone().cancelled_owned()));
    let processed = || {
        ops.render()
            .lines()
            .filter(|l| l.starts_with("saga_consumer_processed_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let mut first: Option<Instant> = None;
    #[allow(clippy::cast_precision_loss)]
    let target = messages as f64;
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let done = processed();
        if done > 0.0 && first.is_none() {
            first = Some(Instant::now());
        }
        if done >= target {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the consumer did not finish in 10 minutes"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let seconds = first.map_or(0.0, |f| f.elapsed().as_secs_f64());
    stop.cancel();
    running.await??;
    let rate = target / seconds.max(1e-9);
    progress.note(&format!(
        "redis: consumer on 90% duplicates {}: {rate:.0} msg/s",
        if seconds > 0.0 {
            ""
        } else {
            "(too fast to time)"
        }
    ));
    Ok(rate)
}

/// Runs both sides. `pools` are four fresh schemas: HTTP without and with Redis, consumer without and
/// with Redis. `kafka` is the mock cluster with `topic` (and `{topic}.dlq`) created.
#[allow(clippy::too_many_arguments)]
pub async fn figures(
    redis_url: &str,
    pools: [&PgPool; 4],
    kafka: &KafkaConfig,
    topic: &str,
    storm: usize,
    replays: usize,
    messages: i64,
    progress: &Progress,
) -> anyhow::Result<Figures> {
    let namespace = format!("saga-bench:{}", uuid::Uuid::new_v4().simple());
    let fast = |ns: &str| FastPath::with_namespace(FastPathArgs::new(redis_url), ns);
    progress.note(&format!(
        "redis: {storm} concurrent requests on one key, then {replays} replays"
    ));
    let mut postgres_only = http_side(pools[0], None, storm, replays, "pg").await?;
    let mut with_redis = http_side(
        pools[1],
        Some(fast(&format!("{namespace}:http"))?),
        storm,
        replays,
        "redis",
    )
    .await?;
    progress.note(&format!(
        "redis: consumer over {messages} messages, 90% duplicates"
    ));
    consumer::produce_keys(kafka, topic, messages, messages / 10, None, progress).await?;
    postgres_only.duplicates_msgs_per_s =
        duplicates_side(kafka, pools[2], topic, messages, None, progress).await?;
    with_redis.duplicates_msgs_per_s = duplicates_side(
        kafka,
        pools[3],
        topic,
        messages,
        Some(fast(&format!("{namespace}:consumer"))?),
        progress,
    )
    .await?;
    Ok(Figures {
        postgres_only,
        with_redis,
    })
}
