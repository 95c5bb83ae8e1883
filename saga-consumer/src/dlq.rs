//! Dead-lettering: a message that cannot be processed is produced to the dead-letter topic with headers
//! saying where it came from and why, and only then is its offset committed. Nothing is dropped silently.

use std::time::Duration;

use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Headers as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use saga_core::{Origin, RawMessage};
use saga_runtime::kafka::refused_for_good;
use tokio_util::sync::CancellationToken;

use crate::letters::{HeaderPair, IndexedLetter};

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
    /// Present (`true`) on a copy from which the payload and the original headers other than the
    /// framework's were dropped, because the dead-letter topic refused the whole message (too large).
    pub const TRUNCATED: &str = "dlq-truncated";
    /// The prefix of every header above.
    pub const PREFIX: &str = "dlq-";
    /// The longest `dlq-error` value, in bytes; longer errors are cut (at a character boundary) and
    /// marked.
    pub const MAX_ERROR_BYTES: usize = 2048;
}

use headers::MAX_ERROR_BYTES;

/// Why a message was dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// Its headers or payload do not decode.
    Undecodable,
    /// No step handles its event type, on a topic declared strict (or an operator's replay of it).
    UnknownEventType,
    /// The handler returned a permanent error or panicked.
    HandlerFailed,
    /// Transient failures used up the retry budget.
    RetriesExhausted,
    /// The consumer died several times while processing it.
    CrashLoop,
    /// Its key is held and the parked messages reached a cap (`SAGA_HOLD_MAX_PARKED_PER_KEY`,
    /// `SAGA_HOLD_MAX_PARKED`): it could not be parked.
    HoldQueueFull,
    /// A statement of the framework's own about it (parking it behind its held key, reading its key's
    /// hold, recording its batch's start) failed for good: a key too large for an index, a header the
    /// database refuses. Waiting would mend nothing; its partition goes on without it.
    StoreRefused,
}

impl DeadLetterReason {
    /// Every reason.
    pub const ALL: [Self; 7] = [
        Self::Undecodable,
        Self::UnknownEventType,
        Self::HandlerFailed,
        Self::RetriesExhausted,
        Self::CrashLoop,
        Self::HoldQueueFull,
        Self::StoreRefused,
    ];

    /// The `dlq-reason` header value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Undecodable => "undecodable",
            Self::UnknownEventType => "unknown-event-type",
            Self::HandlerFailed => "handler-failed",
            Self::RetriesExhausted => "retries-exhausted",
            Self::CrashLoop => "crash-loop",
            Self::HoldQueueFull => "hold-queue-full",
            Self::StoreRefused => "store-refused",
        }
    }
}

/// A message's death certificate.
#[derive(Debug, Clone)]
pub(crate) struct DeadLetter {
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
    pub(crate) fn new(producer: FutureProducer, topic: String, group: String) -> Self {
        Self {
            producer,
            topic,
            group,
        }
    }

    pub(crate) fn topic(&self) -> &str {
        &self.topic
    }

    /// Produces `raw` to the dead-letter topic with `letter`'s headers. Retries (every few seconds) until
    /// the broker acknowledges, and returns the letter as the broker holds it (for the index); returns
    /// `None` only if `cancel` fires first, in which case the message is not committed and comes back.
    ///
    /// If the broker refuses the dead letter for good (too large once the `dlq-*` headers are added, say),
    /// a copy without the payload and without the original headers other than the framework's is sent
    /// instead, marked `dlq-truncated` and saying why in `dlq-error`; if even that is refused, a minimal
    /// copy (the `dlq-*` headers with a short error, the idempotency key and the tenant). A dead letter
    /// never blocks its partition for its size, and the message's identity (topic, partition, offset, key,
    /// idempotency key) is kept.
    ///
    /// `original` is where the message was first consumed: its own position, or a replay's original one.
    pub(crate) async fn send(
        &self,
        raw: &RawMessage,
        original: &Origin,
        letter: &DeadLetter,
        cancel: &CancellationToken,
    ) -> Option<IndexedLetter> {
        let mut copy = Copy::Full;
        loop {
            let headers = self.record_parts(raw, original, letter, &copy);
            let payload = match copy {
                Copy::Full => raw.payload.as_deref(),
                Copy::Truncated(_) | Copy::Minimal(_) => None,
            };
            match self.produce(raw, &headers, payload, cancel).await {
                Sent::Acknowledged(position) => {
                    // The letter as the broker holds it, as the index records it.
                    let pairs: Vec<HeaderPair> = headers
                        .iter()
                        .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                        .collect();
                    return Some(IndexedLetter::of(
                        &self.topic,
                        position,
                        raw.key.as_deref(),
                        payload,
                        &pairs,
                        None,
                    ));
                }
                Sent::Cancelled => return None,
                Sent::Refused(reason) => {
                    copy = match copy {
                        Copy::Full => Copy::Truncated(reason),
                        Copy::Truncated(_) => Copy::Minimal(reason),
                        Copy::Minimal(_) => {
                            // Only a misconfigured topic refuses a few hundred bytes: say so, and wait for
                            // it to be fixed rather than lose the message.
                            tracing::error!(
                                topic = %self.topic, %reason,
                                "the dead-letter topic refuses even a minimal dead letter; check its \
                                 max.message.bytes. Retrying"
                            );
                            if !crate::executor::sleep_or_cancel(Duration::from_secs(10), cancel)
                                .await
                            {
                                return None;
                            }
                            copy
                        }
                    };
                    tracing::error!(
                        topic = %self.topic,
                        "the dead-letter topic refused the message; sending a smaller copy"
                    );
                }
            }
        }
    }

    /// The headers of a dead letter: the original ones (only the framework's in a truncated copy, only the
    /// key and tenant in a minimal one; never `dlq-*` ones a message came with), then the `dlq-*` ones.
    fn record_parts(
        &self,
        raw: &RawMessage,
        original: &Origin,
        letter: &DeadLetter,
        copy: &Copy,
    ) -> OwnedHeaders {
        let kept: &[&str] = match copy {
            Copy::Full => &[],
            Copy::Truncated(_) => &FRAMEWORK_HEADERS,
            Copy::Minimal(_) => &FRAMEWORK_HEADERS[..2],
        };
        let mut headers = OwnedHeaders::new_with_capacity(raw.headers.len() + 10);
        for h in raw.headers.iter() {
            if !matches!(copy, Copy::Full) && !kept.contains(&h.name.as_str()) {
                continue;
            }
            // Only this consumer says where a dead letter comes from and which group gave up on it.
            if h.name.starts_with(headers::PREFIX) {
                continue;
            }
            headers = headers.insert(Header {
                key: &h.name,
                value: h.value.as_deref(),
            });
        }
        let partition = original.partition.to_string();
        let offset = original.offset.to_string();
        let attempts = letter.attempts.to_string();
        let failed_at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        // The note first, so that cutting a long error never cuts it.
        let note = |reason: &str| {
            format!(
                "[the dead-letter topic refused the message ({reason}): payload and non-framework headers \
                 dropped] {}",
                letter.error
            )
        };
        let error = match copy {
            Copy::Full => bounded(&letter.error, MAX_ERROR_BYTES),
            Copy::Truncated(reason) => bounded(&note(reason), MAX_ERROR_BYTES / 2),
            Copy::Minimal(reason) => bounded(&note(reason), 200),
        };
        let mut extra = vec![
            (headers::ORIGINAL_TOPIC, original.topic.as_str()),
            (headers::ORIGINAL_PARTITION, partition.as_str()),
            (headers::ORIGINAL_OFFSET, offset.as_str()),
            (headers::CONSUMER_GROUP, self.group.as_str()),
            (headers::STEP, letter.step.as_deref().unwrap_or("")),
            (headers::REASON, letter.reason.as_str()),
            (headers::ERROR, error.as_str()),
            (headers::ATTEMPTS, attempts.as_str()),
            (headers::FAILED_AT, failed_at.as_str()),
        ];
        if !matches!(copy, Copy::Full) {
            extra.push((headers::TRUNCATED, "true"));
        }
        for (key, value) in extra {
            headers = headers.insert(Header {
                key,
                value: Some(value),
            });
        }
        headers
    }

    /// Produces one dead letter, retrying transient failures until acknowledged or cancelled.
    async fn produce(
        &self,
        raw: &RawMessage,
        headers: &OwnedHeaders,
        payload: Option<&[u8]>,
        cancel: &CancellationToken,
    ) -> Sent {
        let mut wait = Duration::from_millis(200);
        loop {
            let mut record = FutureRecord::<[u8], [u8]>::to(&self.topic).headers(headers.clone());
            if let Some(key) = raw.key.as_deref() {
                record = record.key(key);
            }
            if let Some(payload) = payload {
                record = record.payload(payload);
            }
            let sent = tokio::select! {
                _ = cancel.cancelled() => return Sent::Cancelled,
                sent = self.producer.send(record, Duration::from_secs(5)) => sent,
            };
            match sent {
                Ok(delivered) => {
                    return Sent::Acknowledged((delivered.partition, delivered.offset));
                }
                Err((KafkaError::MessageProduction(code), _)) if refused_for_good(code) => {
                    return Sent::Refused(code.to_string());
                }
                Err((e, _)) => {
                    tracing::error!(topic = %self.topic, error = %e, "dead-lettering failed; retrying");
                    tokio::select! {
                        _ = cancel.cancelled() => return Sent::Cancelled,
                        _ = tokio::time::sleep(wait) => {}
                    }
                    wait = (wait * 2).min(Duration::from_secs(10));
                }
            }
        }
    }
}

/// Which copy of a message is being dead-lettered, and why a smaller one.
enum Copy {
    Full,
    Truncated(String),
    Minimal(String),
}

/// How producing a dead letter ended.
enum Sent {
    /// At this partition and offset.
    Acknowledged((i32, i64)),
    Cancelled,
    /// The broker (or the client) refused this message for good; sending it again cannot help.
    Refused(String),
}

/// The headers a truncated dead letter keeps: what identifies the message and its saga.
const FRAMEWORK_HEADERS: [&str; 10] = [
    saga_core::headers::names::IDEMPOTENCY_KEY,
    saga_core::headers::names::TENANT_ID,
    saga_core::headers::names::CE_TYPE,
    saga_core::headers::names::CE_ID,
    saga_core::headers::names::CE_SOURCE,
    saga_core::headers::names::CORRELATION_ID,
    saga_core::headers::names::CAUSATION_ID,
    saga_core::headers::names::TRACEPARENT,
    saga_core::headers::names::SAGA_ID,
    saga_core::headers::names::REPLY_TO,
];

/// `error`, cut to at most `max` bytes at a character boundary, marked when cut.
fn bounded(error: &str, max: usize) -> String {
    const MARK: &str = " [truncated]";
    if error.len() <= max {
        return error.to_owned();
    }
    let mut end = max.saturating_sub(MARK.len());
    while !error.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{MARK}", &error[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_errors_are_cut_at_a_character_boundary_and_marked() {
        assert_eq!(bounded("short", MAX_ERROR_BYTES), "short");
        let long = "é".repeat(MAX_ERROR_BYTES);
        let cut = bounded(&long, MAX_ERROR_BYTES);
        assert!(cut.len() <= MAX_ERROR_BYTES, "{}", cut.len());
        assert!(cut.ends_with(" [truncated]"));
        assert!(
            cut.trim_end_matches(" [truncated]")
                .chars()
                .all(|c| c == 'é')
        );
    }
}
