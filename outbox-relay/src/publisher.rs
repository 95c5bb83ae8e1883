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
use saga_runtime::kafka::{KafkaConfig, pairs_to_kafka_headers, refused_for_good};
use saga_runtime::trace;
use tokio_util::sync::CancellationToken;

use crate::store::OutboxRow;

/// A key whose order must be kept: topic and partition key.
pub(crate) type OrderKey = (String, Option<String>);

/// The order key of a row.
pub(crate) fn order_key(row: &OutboxRow) -> OrderKey {
    (row.topic.clone(), row.partition_key.clone())
}

/// A row whose publication failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failed {
    /// The row.
    pub id: i64,
    /// Why, for people.
    pub error: String,
    /// Whether the broker (or the client) refuses this row for good: publishing it again cannot succeed.
    pub refused: bool,
}

/// How a batch went.
#[derive(Debug, Default)]
pub(crate) struct BatchOutcome {
    /// Rows the broker acknowledged, with the row's write time and the acknowledgement time. Only rows all
    /// of whose key's earlier rows in the batch were acknowledged too.
    pub acked: Vec<(i64, DateTime<Utc>, DateTime<Utc>)>,
    /// Rows that failed.
    pub failed: Vec<Failed>,
    /// Rows not sent, or sent but not to be marked, because an earlier row of their key failed or waits
    /// for a retry: they are published again after it, so that a key's rows are never marked out of order.
    pub held_back: usize,
}

/// The relay's producer.
pub(crate) struct Publisher {
    kafka: KafkaConfig,
    linger: Duration,
    producer: FutureProducer,
}

impl Publisher {
    /// An idempotent producer for `kafka` that batches for `linger`.
    pub(crate) fn new(kafka: KafkaConfig, linger: Duration) -> Result<Self, KafkaError> {
        let producer = create(&kafka, linger)?;
        Ok(Self {
            kafka,
            linger,
            producer,
        })
    }

    /// Sends `rows` in order and waits for every acknowledgement. A key's rows after one that failed (at enqueueing or in its delivery report), are held back so that a key's
    /// rows are never marked out of order.
    /// Returns `None` if `shutdown` fired first (nothing is marked then; the rows are published again).
    pub(crate) async fn publish(
        &mut self,
        rows: &[OutboxRow],
        shutdown: &CancellationToken,
    ) -> Option<BatchOutcome> {
        let mut outcome = BatchOutcome::default();
        let mut blocked: HashSet<OrderKey> = HashSet::new();
        let mut pending = Vec::with_capacity(rows.len());
        for row in rows {
            // Most batches hold back nothing: build a row's key (two string copies) only when needed.
            if !blocked.is_empty() && blocked.contains(&order_key(row)) {
                outcome.held_back += 1;
                continue;
            }
            // Linked to the context of the transaction that wrote the row (a disabled span without `otel`).
            let span = trace::publish_span(&row.topic, row.partition_key.as_deref(), &row.headers);
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
                        pending.push(delivery.map(move |r| (row, created, r, Utc::now(), span)));
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
                        outcome.failed.push(failure(row.id, &e));
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
        // In row order: once a row of a key failed in its delivery report, the key's later rows are not
        // marked even if acknowledged (they are published again after it), so a key's rows are never marked
        // out of order.
        for (row, created, result, acked_at, span) in results {
            if !blocked.is_empty() && blocked.contains(&order_key(row)) {
                outcome.held_back += 1;
                continue;
            }
            let failed = match result {
                Ok(Ok(delivery)) => {
                    span.record("messaging.destination.partition.id", delivery.partition);
                    span.record("messaging.kafka.offset", delivery.offset);
                    outcome.acked.push((row.id, created, acked_at));
                    continue;
                }
                Ok(Err((e, _))) => failure(row.id, &e),
                Err(_) => Failed {
                    id: row.id,
                    error: "the producer dropped the message".into(),
                    refused: false,
                },
            };
            outcome.failed.push(failed);
            blocked.insert(order_key(row));
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
    pub(crate) fn flush(&self, timeout: Duration) {
        let _ = self.producer.flush(timeout);
    }
}

fn failure(id: i64, e: &KafkaError) -> Failed {
    Failed {
        id,
        error: e.to_string(),
        refused: matches!(e, KafkaError::MessageProduction(code) if refused_for_good(*code)),
    }
}

fn create(kafka: &KafkaConfig, linger: Duration) -> Result<FutureProducer, KafkaError> {
    // `message.timeout.ms=0`: wait for the broker forever rather than fail a row.
    let mut config = saga_runtime::kafka::producer_config(kafka, linger, Duration::ZERO);
    config
        .set("reconnect.backoff.max.ms", "2000")
        .set("queue.buffering.max.messages", "1000000");
    for (name, value) in &kafka.properties {
        config.set(name, value);
    }
    config.create()
}
