//! A step wrapped in tower's stock layers, against the real broker and PostgreSQL: `TimeoutLayer` turns a
//! handler that runs too long into a transient failure (its transaction rolled back, the message retried,
//! then dead-lettered with the timeout as the reason), and `ConcurrencyLimitLayer` bounds the handlers
//! running at once across the step's partitions.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use saga_consumer::{
    Message, SagaService, StepContext, StepOutcome, StepResult, Topic, dlq_headers, step_with,
};
use saga_test_support::{TestDb, TestKafka, wait_until};
use tokio_util::sync::CancellationToken;
use tower::limit::ConcurrencyLimitLayer;
use tower::timeout::TimeoutLayer;

mod steps;

use steps::{Placed, dead_letter_and_retry_topics, place_orders, quick_retries, stop_service};

const WAIT: Duration = Duration::from_secs(60);

/// How the step behaves: it records the order, then takes as long as the order says (`2`: 3 s the first
/// time only; `3`: always 3 s), and counts the handlers running at once.
#[derive(Default)]
struct Behaviour {
    slow_once_seen: AtomicUsize,
    running: AtomicUsize,
    most_running: AtomicUsize,
}

async fn reserve(
    msg: &Message<Placed>,
    ctx: &mut StepContext<'_>,
    behaviour: &Arc<Behaviour>,
) -> StepResult {
    let n = msg.payload().n;
    let _running = Running::enter(behaviour);
    sqlx::query("INSERT INTO reservations (n) VALUES ($1)")
        .bind(n)
        .execute(ctx.conn())
        .await?;
    let slow = n == 3 || (n == 2 && behaviour.slow_once_seen.fetch_add(1, Ordering::SeqCst) == 0);
    if slow {
        tokio::time::sleep(Duration::from_secs(3)).await;
    } else {
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    Ok(StepOutcome::completed())
}

/// One handler running, until it returns or the timeout drops it.
struct Running<'a>(&'a Behaviour);

impl<'a> Running<'a> {
    fn enter(behaviour: &'a Behaviour) -> Self {
        let now = behaviour.running.fetch_add(1, Ordering::SeqCst) + 1;
        behaviour.most_running.fetch_max(now, Ordering::SeqCst);
        Self(behaviour)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stock_tower_layers_wrap_a_step_a_timeout_rolls_back_retries_and_dead_letters() {
    let db = TestDb::empty("tower-layers").await;
    sqlx::query("CREATE TABLE reservations (n BIGINT PRIMARY KEY)")
        .execute(&db.pool)
        .await
        .unwrap();
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("tower-layers", 4).await;
    let group = format!("{topic}-group");
    dead_letter_and_retry_topics(&kafka, &group).await;
    let behaviour = Arc::new(Behaviour::default());
    let step = step_with("reserve", Arc::clone(&behaviour), reserve)
        .on(&Topic::new(&topic))
        .layer(TimeoutLayer::new(Duration::from_secs(1)))
        .layer(ConcurrencyLimitLayer::new(2));
    let service = SagaService::builder()
        .brokers(&kafka.brokers)
        .group_id(&group)
        .pool(db.pool.clone())
        .retry(quick_retries(2))
        .step(step)
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let running = tokio::spawn(service.run(stop.clone().cancelled_owned()));

    // Keys spread over the four partitions: the fast ones run side by side, at most two at once.
    place_orders(&kafka, &topic, [1, 2, 3, 4, 5, 6, 7, 8]).await;

    // The order that was slow once timed out, rolled back, and was recorded on its retry: once.
    wait_until("every order but the slow one recorded", WAIT, || async {
        (db.count("reservations").await == 7).then_some(())
    })
    .await;
    let recorded: Vec<i64> = sqlx::query_scalar("SELECT n FROM reservations ORDER BY n")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(recorded, [1, 2, 4, 5, 6, 7, 8], "order 3 never committed");
    assert_eq!(
        behaviour.slow_once_seen.load(Ordering::SeqCst),
        2,
        "order 2 ran twice: timed out, then retried"
    );

    // The order that is always slow was dead-lettered, the timeout its reason.
    let letters = kafka
        .read_all(&format!("{group}.dlq"), 1, Duration::from_millis(500), WAIT)
        .await;
    assert_eq!(letters.len(), 1);
    let letter = &letters[0];
    assert_eq!(letter.json()["n"], 3);
    let error = letter.header(dlq_headers::ERROR).unwrap_or_default();
    // tower's timeout, not the runtime's own handler timeout ("handler timed out after …").
    assert!(error.contains("request timed out"), "{error}");
    assert_eq!(letter.header(dlq_headers::ATTEMPTS), Some("2"));

    // The concurrency limit held across the partitions, which ran side by side up to it.
    let most = behaviour.most_running.load(Ordering::SeqCst);
    assert_eq!(most, 2, "handlers at once");
    stop_service(stop, running).await;
}
