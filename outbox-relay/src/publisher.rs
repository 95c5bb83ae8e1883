//! Publishing a batch of rows with the idempotent producer and waiting for the broker's acknowledgements.
//!
//! The producer never gives up on a message by itself (`message.timeout.ms=0`): during a broker outage a
//! batch simply waits, and nothing is marked published that the broker did not acknowledge. The idempotent
//! producer keeps each partition's order across its retries. A row the broker refuses outright is retried
//! with backoff, and its key's later rows are held back meanwhile; after a fatal producer error the
//! producer is recreated and the unmarked rows are published again.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::FutureExt;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use saga_runtime::kafka::{KafkaConfig, pairs_to_kafka_headers};
use tokio_util::sync::CancellationToken;

use crate::store::OutboxRow;

/// A key whose order must be kept: topic and partition key.
pub type OrderKey = (String, Option<String>);

/// The order key of a row.
pub fn order_key(row: &OutboxRow) -> OrderKey {
    (row.topic.clone(), row.partition_key.clone())
}

/// How a batch went.
#[derive(Debug, Default)]
pub struct BatchOutcome {
    /// Rows the broker acknowledged, with the row's write time and the acknowledgement time.
    pub acked: Vec<(i64, DateTime<Utc>, DateTime<Utc>)>,
    /// Rows that failed, with the error.
    pub failed: Vec<(i64, String)>,
    /// Rows not sent because an earlier row of their key is waiting for a retry.
    pub held_back: usize,
}

/// The relay's producer.
pub struct Publisher {
    kafka: KafkaConfig,
    linger: Duration,
    producer: FutureProducer,
}

impl Publisher {
    /// An idempotent producer for `kafka` that batches for `linger`.
    pub fn new(kafka: KafkaConfig, linger: Duration) -> Result<Self, KafkaError> {
        let producer = create(&kafka, linger)?;
        Ok(Self {
            kafka,
            linger,
            producer,
        })
    }

    /// Sends `rows` in order and waits for every acknowledgement. Rows of a key in `blocked`, and the rows
    /// after a row whose enqueueing failed, are held back so that a key's rows never overtake each other.
    /// Returns `None` if `shutdown` fired first (nothing is marked then; the rows are published again).
    pub async fn publish(
        &mut self,
        rows: &[OutboxRow],
        mut blocked: HashSet<OrderKey>,
        shutdown: &CancellationToken,
    ) -> Option<BatchOutcome> {
        let mut outcome = BatchOutcome::default();
        let mut pending = Vec::with_capacity(rows.len());
        for row in rows {
            // Most batches hold back nothing: build a row's key (two string copies) only when needed.
            if !blocked.is_empty() && blocked.contains(&order_key(row)) {
                outcome.held_back += 1;
                continue;
            }
            let headers = pairs_to_kafka_headers(&row.headers);
            let mut record = FutureRecord::<str, [u8]>::to(&row.topic).headers(headers);
            if let Some(k) = row.partition_key.as_deref() {
                record = record.key(k);
            }
            if let Some(p) = row.payload.as_deref() {
                record = record.payload(p);
            }
            loop {
                match self.producer.send_result(record) {
                    Ok(delivery) => {
                        let created = row.created_at;
                        pending.push(delivery.map(move |r| (row.id, created, r, Utc::now())));
                        break;
                    }
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                        record = back;
                        tokio::select! {
                            _ = shutdown.cancelled() => return None,
                            _ = tokio::time::sleep(Duration::from_millis(5)) => {}
                        }
                    }
                    Err((e, _)) => {
                        outcome.failed.push((row.id, e.to_string()));
                        blocked.insert(order_key(row));
                        break;
                    }
                }
            }
        }
        let results = tokio::select! {
            _ = shutdown.cancelled() => return None,
            results = futures::future::join_all(pending) => results,
        };
        for (id, created, result, acked_at) in results {
            match result {
                Ok(Ok(_)) => outcome.acked.push((id, created, acked_at)),
                Ok(Err((e, _))) => outcome.failed.push((id, e.to_string())),
                Err(_) => outcome
                    .failed
                    .push((id, "the producer dropped the message".into())),
            }
        }
        if let Some((code, reason)) = self.producer.client().fatal_error() {
            tracing::error!(?code, %reason, "fatal producer error; recreating the producer");
            match create(&self.kafka, self.linger) {
                Ok(producer) => self.producer = producer,
                Err(e) => tracing::error!(error = %e, "cannot recreate the producer"),
            }
        }
        Some(outcome)
    }

    /// Waits until queued messages are delivered, up to `timeout`.
    pub fn flush(&self, timeout: Duration) {
        let _ = self.producer.flush(timeout);
    }
}

fn create(kafka: &KafkaConfig, linger: Duration) -> Result<FutureProducer, KafkaError> {
    // `message.timeout.ms=0`: wait for the broker forever rather than fail a row.
    let mut config = kafka.producer_config(linger, Duration::ZERO);
    config
        .set("reconnect.backoff.max.ms", "2000")
        .set("queue.buffering.max.messages", "1000000");
    for (name, value) in &kafka.properties {
        config.set(name, value);
    }
    config.create()
}
