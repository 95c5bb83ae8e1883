//! Publishing a batch of rows with the idempotent producer and waiting for the broker's acknowledgements.
//!
//! **A key has at most one row in flight.** A key's next row is given to the producer only once the broker
//! acknowledged the row before it. Should a row's delivery fail (at enqueueing or in its delivery report),
//! none of its key's later rows has been sent: they are held back and published after it, so the topic
//! never holds a key's later row before an earlier one (a row acknowledged and then published again after
//! a crash is a later duplicate, which the consumers' step keys absorb). Rows of different keys are sent
//! together, so a batch of distinct keys goes out at once; a key with several rows in a batch costs a round
//! trip to the broker per row.
//!
//! The producer never gives up on a message by itself (`message.timeout.ms=0`): during a broker outage a
//! batch simply waits, and nothing is marked published that the broker did not acknowledge. After a fatal
//! producer error the producer is recreated and the unmarked rows are published again.

use std::borrow::Borrow;
use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::Either;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use saga_runtime::kafka::{KafkaConfig, pairs_to_kafka_headers, refused_for_good};
use saga_runtime::trace;
use tokio_util::sync::CancellationToken;
use tracing::Span;

use crate::hooks::{PublishAttempt, PublishHooks};
use crate::key_order::KeyOrder;
use crate::store::OutboxRow;

/// A key whose order must be kept: topic and partition key.
pub(crate) type OrderKey = (String, Option<String>);

/// The order key of a row.
pub(crate) fn order_key(row: &OutboxRow) -> OrderKey {
    (row.topic.clone(), row.partition_key.clone())
}

/// A row's order key, borrowed from the row.
type KeyRef<'a> = (&'a str, Option<&'a str>);

fn key_ref(row: &OutboxRow) -> KeyRef<'_> {
    (row.topic.as_str(), row.partition_key.as_deref())
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

/// A row the broker acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Acked {
    /// The row's id.
    pub id: i64,
    /// When the row was written.
    pub created_at: DateTime<Utc>,
    /// When the broker acknowledged it.
    pub acked_at: DateTime<Utc>,
    /// Where the broker put it.
    pub partition: i32,
    /// Its offset there.
    pub offset: i64,
}

impl Acked {
    /// Seconds from the row's commit (its write) to the broker's acknowledgement.
    pub(crate) fn latency_seconds(&self) -> f64 {
        (self.acked_at - self.created_at)
            .to_std()
            .unwrap_or_default()
            .as_secs_f64()
    }
}

/// How a batch went.
#[derive(Debug, Default)]
pub(crate) struct BatchOutcome {
    /// Rows the broker acknowledged. A key's rows are acknowledged in row order: each was sent only after
    /// the one before it was acknowledged.
    pub acked: Vec<Acked>,
    /// Rows that failed.
    pub failed: Vec<Failed>,
    /// Rows not sent because an earlier row of their key failed: they are published after it.
    pub held_back: usize,
}

/// A row handed to the producer, or refused by an injected fault.
enum Sent {
    Delivery(DeliveryFuture),
    Refused(String),
}

/// Where a row's delivery report says it went, or why it failed.
type Report = Result<(i32, i64), Failed>;

/// The relay's producer.
pub(crate) struct Publisher {
    kafka: KafkaConfig,
    linger: Duration,
    message_timeout: Duration,
    producer: FutureProducer,
    hooks: PublishHooks,
}

impl Publisher {
    /// An idempotent producer for `kafka` that batches for `linger` and gives a message up after
    /// `message_timeout` (zero: never; a delivery then fails only when the broker refuses it).
    pub(crate) fn new(
        kafka: KafkaConfig,
        linger: Duration,
        message_timeout: Duration,
        hooks: PublishHooks,
    ) -> Result<Self, KafkaError> {
        let producer = create(&kafka, linger, message_timeout)?;
        Ok(Self {
            kafka,
            linger,
            message_timeout,
            producer,
            hooks,
        })
    }

    /// Whether a broker answers a metadata request within a few seconds: a failure that comes while none
    /// does is the outage's, not the event's.
    pub(crate) async fn broker_answers(&self) -> bool {
        let producer = self.producer.clone();
        tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(None, Duration::from_secs(5))
                .is_ok()
        })
        .await
        .unwrap_or(false)
    }

    /// Sends `rows` (in id order) and waits for every acknowledgement, at most one row per key in flight
    /// (see the module documentation). Returns `None` if `shutdown` fired first (nothing is marked then;
    /// the rows are published again).
    pub(crate) async fn publish<R: Borrow<OutboxRow>>(
        &mut self,
        rows: &[R],
        shutdown: &CancellationToken,
    ) -> Option<BatchOutcome> {
        let mut outcome = BatchOutcome::default();
        let mut order: KeyOrder<KeyRef<'_>> = KeyOrder::new();
        let mut in_flight = FuturesUnordered::new();
        for (index, row) in rows.iter().map(Borrow::borrow).enumerate() {
            let key = key_ref(row);
            if !order.offer(index, key) {
                continue;
            }
            match self.send(row, shutdown).await? {
                Ok((sent, span)) => in_flight.push(in_flight_row(index, row.id, sent, span)),
                Err(failed) => {
                    outcome.failed.push(failed);
                    order.refused_at_send(&key);
                }
            }
        }
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => return None,
                next = in_flight.next() => next,
            };
            let Some((index, report, acked_at, span)) = next else {
                break;
            };
            let row = rows[index].borrow();
            let key = key_ref(row);
            match report {
                Ok((partition, offset)) => {
                    span.record("messaging.destination.partition.id", partition);
                    span.record("messaging.kafka.offset", offset);
                    outcome.acked.push(Acked {
                        id: row.id,
                        created_at: row.created_at,
                        acked_at,
                        partition,
                        offset,
                    });
                    // The broker has this row: the key's next one may go.
                    if let Some(next) = order.acked(&key) {
                        let next_row = rows[next].borrow();
                        match self.send(next_row, shutdown).await? {
                            Ok((sent, span)) => {
                                in_flight.push(in_flight_row(next, next_row.id, sent, span));
                            }
                            Err(failed) => {
                                outcome.failed.push(failed);
                                order.refused_at_send(&key);
                            }
                        }
                    }
                }
                Err(failed) => {
                    outcome.failed.push(failed);
                    order.failed(&key);
                }
            }
        }
        outcome.held_back = order.held_back();
        if let Some((code, reason)) = self.producer.client().fatal_error() {
            tracing::error!(?code, %reason, "fatal producer error; recreating the producer");
            match create(&self.kafka, self.linger, self.message_timeout) {
                Ok(producer) => self.producer = producer,
                Err(e) => tracing::error!(error = %e, "cannot recreate the producer"),
            }
        }
        Some(outcome)
    }

    /// Gives `row` to the producer, waiting while its queue is full. `None` if `shutdown` fired first;
    /// a failure to enqueue is the row's failure.
    async fn send(
        &self,
        row: &OutboxRow,
        shutdown: &CancellationToken,
    ) -> Option<Result<(Sent, Span), Failed>> {
        // Linked to the context of the transaction that wrote the row (a disabled span without `otel`).
        let span = trace::publish_span(&row.topic, row.partition_key.as_deref(), &row.headers);
        let attempt = PublishAttempt {
            id: row.id,
            topic: &row.topic,
            key: row.partition_key.as_deref(),
            payload: row.payload.as_deref(),
        };
        if let Some(error) = self.hooks.injected_failure(&attempt) {
            return Some(Ok((Sent::Refused(error), span)));
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
                Ok(delivery) => return Some(Ok((Sent::Delivery(delivery), span))),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    tokio::select! {
                        _ = shutdown.cancelled() => return None,
                        _ = tokio::time::sleep(Duration::from_millis(5)) => {}
                    }
                }
                Err((e, _)) => return Some(Err(failure(row.id, &e))),
            }
        }
    }

    /// Waits until queued messages are delivered, up to `timeout`.
    pub(crate) fn flush(&self, timeout: Duration) {
        let _ = self.producer.flush(timeout);
    }
}

/// The delivery report of row `id` (at `index` in its batch), with the time it came and the row's span.
fn in_flight_row(
    index: usize,
    id: i64,
    sent: Sent,
    span: Span,
) -> impl Future<Output = (usize, Report, DateTime<Utc>, Span)> {
    let report = match sent {
        Sent::Delivery(delivery) => Either::Left(delivery.map(move |result| match result {
            Ok(Ok(delivery)) => Ok((delivery.partition, delivery.offset)),
            Ok(Err((e, _))) => Err(failure(id, &e)),
            Err(_) => Err(Failed {
                id,
                error: "the producer dropped the message".into(),
                refused: false,
            }),
        })),
        Sent::Refused(error) => Either::Right(futures::future::ready(Err(Failed {
            id,
            error,
            refused: false,
        }))),
    };
    report.map(move |report| (index, report, Utc::now(), span))
}

fn failure(id: i64, e: &KafkaError) -> Failed {
    Failed {
        id,
        error: e.to_string(),
        refused: matches!(e, KafkaError::MessageProduction(code) if refused_for_good(*code)),
    }
}

fn create(
    kafka: &KafkaConfig,
    linger: Duration,
    message_timeout: Duration,
) -> Result<FutureProducer, KafkaError> {
    // The table relay: `message.timeout.ms=0`, wait for the broker forever rather than fail a row. The WAL
    // relay: a delivery that never comes back (a partition without a leader) fails after its bound, and
    // what it does about that depends on whether the broker answers at all.
    let mut config = saga_runtime::kafka::producer_config(kafka, linger, message_timeout);
    config
        .set("reconnect.backoff.max.ms", "2000")
        .set("queue.buffering.max.messages", "1000000");
    for (name, value) in &kafka.properties {
        config.set(name, value);
    }
    config.create()
}
