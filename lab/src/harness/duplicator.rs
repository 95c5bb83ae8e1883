//! Fault injection: duplicate deliveries. Every saga event is produced a second time, with the same key,
//! headers and payload, as a producer retry or a replay would; the consumers must absorb the copies.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use saga_runtime::kafka::KafkaConfig;
use tokio_util::sync::CancellationToken;

/// The header marking a copy, so that copies are not copied again.
const COPY_HEADER: &str = "x-demo-duplicate";

/// Starts copying every message of `topics` once. Returns the number of copies made so far.
pub fn start(
    kafka: &KafkaConfig,
    group: &str,
    topics: &[&str],
    stop: CancellationToken,
) -> anyhow::Result<Arc<AtomicU64>> {
    let consumer: StreamConsumer = saga_runtime::kafka::client_config(kafka)
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "true")
        .create()?;
    consumer.subscribe(topics)?;
    let producer = saga_runtime::kafka::idempotent_producer(
        kafka,
        Duration::from_millis(2),
        Duration::from_secs(30),
    )?;
    let copies = Arc::new(AtomicU64::new(0));
    let counter = copies.clone();
    // Closing a consumer waits for the broker to confirm it left its group, which a broker restarted
    // under it may never do, and a worker thread blocked there keeps the program from exiting: the
    // consumer is left to the process's end instead.
    let consumer: &'static StreamConsumer = Box::leak(Box::new(consumer));
    tokio::spawn(async move {
        let mut stream = consumer.stream();
        loop {
            let message = tokio::select! {
                () = stop.cancelled() => return,
                m = stream.next() => m,
            };
            let Some(Ok(message)) = message else { continue };
            let headers = message.headers();
            if headers.is_some_and(|h| h.iter().any(|h| h.key == COPY_HEADER)) {
                continue;
            }
            let mut copy = OwnedHeaders::new();
            if let Some(headers) = headers {
                for h in headers.iter() {
                    copy = copy.insert(Header {
                        key: h.key,
                        value: h.value,
                    });
                }
            }
            copy = copy.insert(Header {
                key: COPY_HEADER,
                value: Some("1"),
            });
            let mut record = FutureRecord::<[u8], [u8]>::to(message.topic()).headers(copy);
            if let Some(key) = message.key() {
                record = record.key(key);
            }
            if let Some(payload) = message.payload() {
                record = record.payload(payload);
            }
            if producer.send(record, Duration::from_secs(10)).await.is_ok() {
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    Ok(copies)
}

/// Copies made so far.
pub fn count(copies: &AtomicU64) -> u64 {
    copies.load(Ordering::Relaxed)
}
