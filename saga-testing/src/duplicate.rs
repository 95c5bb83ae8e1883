//! Duplicate deliveries: every message of the given topics is produced a second time, with the same key,
//! headers and payload, as a producer's retry or a replay would; the consumers must absorb the copies.
//! [`crate::SagaTest::duplicate_deliveries`] runs one on the mock cluster; the lab's demo and chaos
//! program run one against any broker.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use saga_consumer::KafkaConfig;

use crate::KitError;
use crate::error::kafka as kafka_error;

/// The header marking a copy, so that copies are not copied again.
pub const COPY_HEADER: &str = "x-saga-duplicate";

/// A running duplicator.
#[derive(Debug, Clone)]
pub struct Duplicator {
    group: String,
    topics: Vec<String>,
    copies: Arc<AtomicU64>,
}

impl Duplicator {
    /// Starts copying every message of `topics` once, reading them as consumer group `group` (whose
    /// committed offsets say what was copied), until `stop` resolves (a token's `cancelled_owned()`, a
    /// signal).
    ///
    /// The consumer is left to the process's end rather than closed when `stop` resolves: closing waits
    /// for the broker to confirm the leave, which a broker restarted (or a mock cluster dropped) under it
    /// may never do.
    pub fn start(
        kafka: &KafkaConfig,
        group: &str,
        topics: &[&str],
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> Result<Self, KitError> {
        let consumer: StreamConsumer = saga_runtime::kafka::client_config(kafka)
            .set("group.id", group)
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "true")
            .set("auto.commit.interval.ms", "50")
            // A message's offset is stored once its copy was acknowledged: a committed offset means copied.
            .set("enable.auto.offset.store", "false")
            .create()
            .map_err(kafka_error)?;
        consumer.subscribe(topics).map_err(kafka_error)?;
        let producer = saga_runtime::kafka::idempotent_producer(
            kafka,
            Duration::from_millis(2),
            Duration::from_secs(30),
        )
        .map_err(kafka_error)?;
        let copies = Arc::new(AtomicU64::new(0));
        let counter = copies.clone();
        // A worker thread blocked in the close would keep the program (or a test's runtime) from ending.
        let consumer: &'static StreamConsumer = Box::leak(Box::new(consumer));
        tokio::spawn(async move {
            let mut stream = consumer.stream();
            let mut stop = std::pin::pin!(stop);
            loop {
                let message = tokio::select! {
                    () = &mut stop => return,
                    m = stream.next() => m,
                };
                let Some(Ok(message)) = message else { continue };
                let headers = message.headers();
                if !headers.is_some_and(|h| h.iter().any(|h| h.key == COPY_HEADER)) {
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
                    // Until the copy is acknowledged: a later message's stored offset would count this
                    // one as copied.
                    loop {
                        let mut record =
                            FutureRecord::<[u8], [u8]>::to(message.topic()).headers(copy.clone());
                        if let Some(key) = message.key() {
                            record = record.key(key);
                        }
                        if let Some(payload) = message.payload() {
                            record = record.payload(payload);
                        }
                        if producer.send(record, Duration::from_secs(10)).await.is_ok() {
                            break;
                        }
                        tokio::select! {
                            () = &mut stop => return,
                            () = tokio::time::sleep(Duration::from_millis(100)) => {}
                        }
                    }
                    counter.fetch_add(1, Ordering::Relaxed);
                }
                let _ = consumer.store_offset_from_message(&message);
            }
        });
        Ok(Self {
            group: group.to_owned(),
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            copies,
        })
    }

    /// Copies made so far.
    pub fn copies(&self) -> u64 {
        self.copies.load(Ordering::Relaxed)
    }

    /// Its consumer group.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The topics it copies.
    pub fn topics(&self) -> &[String] {
        &self.topics
    }
}
