//! Dead-lettering: a message that cannot be processed is produced to the dead-letter topic with headers
//! saying where it came from and why, and only then is its offset committed. Nothing is dropped silently.

use std::time::Duration;

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use saga_core::RawMessage;
use tokio_util::sync::CancellationToken;

/// Header names on dead-lettered messages (the original headers are kept before them).
pub mod headers {
    /// The topic the message was consumed from.
    pub const ORIGINAL_TOPIC: &str = "dlq-original-topic";
    /// Its partition.
    pub const ORIGINAL_PARTITION: &str = "dlq-original-partition";
    /// Its offset.
    pub const ORIGINAL_OFFSET: &str = "dlq-original-offset";
    /// The consumer group that gave up on it.
    pub const CONSUMER_GROUP: &str = "dlq-consumer-group";
    /// The step it was meant for, if one was found.
    pub const STEP: &str = "dlq-step";
    /// Why, as a category: see [`super::DeadLetterReason::as_str`].
    pub const REASON: &str = "dlq-reason";
    /// The error, for people.
    pub const ERROR: &str = "dlq-error";
    /// How many times processing was attempted.
    pub const ATTEMPTS: &str = "dlq-attempts";
    /// When it was dead-lettered (RFC 3339).
    pub const FAILED_AT: &str = "dlq-failed-at";
}

/// Why a message was dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLetterReason {
    /// Its headers or payload do not decode.
    Undecodable,
    /// No step handles its event type.
    UnknownEventType,
    /// The handler returned a permanent error or panicked.
    HandlerFailed,
    /// Transient failures used up the retry budget.
    RetriesExhausted,
    /// The consumer died several times while processing it.
    CrashLoop,
}

impl DeadLetterReason {
    /// The `dlq-reason` header value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Undecodable => "undecodable",
            Self::UnknownEventType => "unknown-event-type",
            Self::HandlerFailed => "handler-failed",
            Self::RetriesExhausted => "retries-exhausted",
            Self::CrashLoop => "crash-loop",
        }
    }
}

/// A message's death certificate.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// Why.
    pub reason: DeadLetterReason,
    /// The step, if known.
    pub step: Option<String>,
    /// The error text.
    pub error: String,
    /// Attempts made.
    pub attempts: u32,
}

/// Produces dead letters, waiting for the broker's acknowledgement and retrying until it comes.
pub(crate) struct DeadLetters {
    producer: FutureProducer,
    topic: String,
    group: String,
}

impl DeadLetters {
    pub fn new(producer: FutureProducer, topic: String, group: String) -> Self {
        Self {
            producer,
            topic,
            group,
        }
    }

    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Produces `raw` to the dead-letter topic with `letter`'s headers. Retries (every few seconds) until
    /// the broker acknowledges; returns `false` only if `cancel` fires first, in which case the message is
    /// not committed and comes back.
    pub async fn send(
        &self,
        raw: &RawMessage,
        letter: &DeadLetter,
        cancel: &CancellationToken,
    ) -> bool {
        let mut headers = OwnedHeaders::new_with_capacity(raw.headers.len() + 9);
        for h in raw.headers.iter() {
            headers = headers.insert(Header {
                key: &h.name,
                value: h.value.as_deref(),
            });
        }
        let partition = raw.origin.partition.to_string();
        let offset = raw.origin.offset.to_string();
        let attempts = letter.attempts.to_string();
        let failed_at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let extra = [
            (headers::ORIGINAL_TOPIC, raw.origin.topic.as_str()),
            (headers::ORIGINAL_PARTITION, partition.as_str()),
            (headers::ORIGINAL_OFFSET, offset.as_str()),
            (headers::CONSUMER_GROUP, self.group.as_str()),
            (headers::STEP, letter.step.as_deref().unwrap_or("")),
            (headers::REASON, letter.reason.as_str()),
            (headers::ERROR, letter.error.as_str()),
            (headers::ATTEMPTS, attempts.as_str()),
            (headers::FAILED_AT, failed_at.as_str()),
        ];
        for (key, value) in extra {
            headers = headers.insert(Header {
                key,
                value: Some(value),
            });
        }
        let mut wait = Duration::from_millis(200);
        loop {
            let mut record = FutureRecord::<[u8], [u8]>::to(&self.topic).headers(headers.clone());
            if let Some(key) = raw.key.as_deref() {
                record = record.key(key);
            }
            if let Some(payload) = raw.payload.as_deref() {
                record = record.payload(payload);
            }
            let sent = tokio::select! {
                _ = cancel.cancelled() => return false,
                sent = self.producer.send(record, Duration::from_secs(5)) => sent,
            };
            match sent {
                Ok(_) => return true,
                Err((e, _)) => {
                    tracing::error!(topic = %self.topic, error = %e, "dead-lettering failed; retrying");
                    tokio::select! {
                        _ = cancel.cancelled() => return false,
                        _ = tokio::time::sleep(wait) => {}
                    }
                    wait = (wait * 2).min(Duration::from_secs(10));
                }
            }
        }
    }
}
