//! `saga-bench` fails a run that cannot finish instead of hanging it: a wait that sees no progress gives up
//! saying what is left, and a topic whose first messages the broker dropped (librdkafka's mock cluster keeps
//! at most 5 MiB per partition) is refused before any consumer waits for them.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use rdkafka::producer::{FutureProducer, FutureRecord};
use saga_lab::bench::consumer::ensure_kept;
use saga_lab::bench::wait_until_done;
use saga_lab::harness::broker::Broker;
use saga_runtime::kafka::{KafkaConfig, Watermarks, watermarks};

#[tokio::test]
async fn a_wait_ends_when_nothing_is_left() {
    let (left, calls) = (AtomicI64::new(5), AtomicI64::new(0));
    wait_until_done(
        "work",
        Duration::from_millis(1),
        Duration::from_secs(30),
        || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok(left.fetch_sub(1, Ordering::SeqCst))
        },
    )
    .await
    .expect("the count reaches 0");
    // Asked at 5, 4, 3, 2, 1 and 0: not once more.
    assert_eq!(calls.load(Ordering::SeqCst), 6);
}

#[tokio::test]
async fn a_wait_that_sees_no_progress_gives_up_saying_what_is_left() {
    let limit = Duration::from_millis(600);
    let (left, calls) = (AtomicI64::new(9), AtomicI64::new(0));
    let started = Instant::now();
    let outcome = wait_until_done(
        "bench_effects",
        Duration::from_millis(20),
        limit,
        || async {
            // Progress for the first three answers (9, 8, 7), then none.
            let n = calls.fetch_add(1, Ordering::SeqCst);
            Ok(if n < 2 {
                left.fetch_sub(1, Ordering::SeqCst)
            } else {
                left.load(Ordering::SeqCst)
            })
        },
    )
    .await;
    let error = outcome.expect_err("a count that stops moving fails the wait");
    assert_eq!(
        error.to_string(),
        "bench_effects: 7 left, unchanged for 1 s: the run stalled (see the log above)"
    );
    // The limit counts from the last change, not from the start.
    assert!(
        started.elapsed() >= limit,
        "gave up after {:?}",
        started.elapsed()
    );
    assert!(calls.load(Ordering::SeqCst) > 3);
}

async fn send(producer: &FutureProducer, topic: &str, payload: &[u8]) {
    producer
        .send(
            FutureRecord::<(), [u8]>::to(topic).payload(payload),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| e)
        .expect("delivered");
}

#[tokio::test]
async fn a_topic_whose_first_messages_the_broker_dropped_is_refused() {
    let mock = Broker::mock().expect("mock cluster");
    let kafka = KafkaConfig::new(mock.brokers());
    let (kept, dropped) = ("kept".to_owned(), "dropped".to_owned());
    mock.create_topics(&[kept.clone(), dropped.clone()], 1)
        .await
        .expect("topics");
    let producer = saga_runtime::kafka::idempotent_producer(
        &kafka,
        Duration::from_millis(0),
        Duration::from_secs(30),
    )
    .expect("producer");
    // Twelve messages of 900 kB: past the mock cluster's 5 MiB, so it drops the oldest as it appends.
    let large = vec![b'x'; 900_000];
    for _ in 0..12 {
        send(&producer, &dropped, &large).await;
    }
    for _ in 0..3 {
        send(&producer, &kept, b"{}").await;
    }

    let partitions = watermarks(&kafka, &dropped)
        .await
        .expect("watermarks")
        .expect("the topic exists");
    assert_eq!(partitions.len(), 1);
    let Watermarks {
        partition,
        low,
        high,
    } = partitions[0];
    assert_eq!((partition, high), (0, 12));
    assert!(low > 0 && low < 12, "low watermark {low}");
    let refused = ensure_kept(&kafka, &dropped)
        .await
        .expect_err("dropped messages are refused")
        .to_string();
    assert!(
        refused.starts_with(&format!(
            "dropped: the broker dropped the first {low} messages before they were read"
        )),
        "{refused}"
    );

    ensure_kept(&kafka, &kept)
        .await
        .expect("a topic that keeps all its messages passes");
    assert_eq!(
        watermarks(&kafka, &kept).await.expect("watermarks"),
        Some(vec![Watermarks {
            partition: 0,
            low: 0,
            high: 3
        }])
    );
    assert_eq!(
        watermarks(&kafka, "no-such-topic")
            .await
            .expect("watermarks"),
        None
    );
}
