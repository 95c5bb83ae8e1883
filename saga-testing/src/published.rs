//! What the system published, read back from the mock cluster: typed events ([`Events`]) and dead letters
//! ([`DeadLetter`]).

use saga_consumer::dlq_headers;
use saga_consumer::{Message, RawMessage, SagaEvent, StepName};

use crate::KitError;
use crate::duplicate::COPY_HEADER;

/// The step name the kit's decoded messages carry (their external keys are not a step's).
const READER: &str = "saga-testing";

/// The events of one type published to a topic, in partition and offset order.
#[derive(Debug, Clone)]
pub struct Events<E> {
    topic: String,
    messages: Vec<Message<E>>,
}

impl<E: SagaEvent> Events<E> {
    /// Decodes the messages of `raw` (read from `topic`) whose event type is one of `E`'s.
    pub(crate) fn decode(topic: &str, raw: &[RawMessage]) -> Result<Self, KitError> {
        let step = StepName::new(READER).expect("a valid step name");
        let mut messages = Vec::new();
        for message in raw {
            let event_type = message
                .headers
                .get_str(saga_consumer::headers::names::CE_TYPE)
                .ok()
                .flatten();
            let copy = message.headers.iter().any(|h| h.name == COPY_HEADER);
            if copy || !event_type.is_some_and(|t| E::TYPES.contains(&t)) {
                continue;
            }
            let decoded =
                Message::<E>::decode(message, &step).map_err(|e| KitError::Undecodable {
                    topic: topic.to_owned(),
                    partition: message.origin.partition,
                    offset: message.origin.offset,
                    wanted: std::any::type_name::<E>(),
                    error: saga_consumer::Cause::new(e),
                })?;
            messages.push(decoded);
        }
        Ok(Self {
            topic: topic.to_owned(),
            messages,
        })
    }
}

impl<E> Events<E> {
    /// The messages, with their headers (idempotency key, tenant, correlation).
    pub fn messages(&self) -> &[Message<E>] {
        &self.messages
    }

    /// The payloads.
    pub fn payloads(&self) -> impl Iterator<Item = &E> {
        self.messages.iter().map(Message::payload)
    }

    /// How many there are.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// How many payloads `matches` accepts.
    pub fn count(&self, matches: impl Fn(&E) -> bool) -> usize {
        self.payloads().filter(|e| matches(e)).count()
    }

    /// The one message whose payload `matches` accepts. Panics, listing what was published, when there is
    /// none or more than one: the assertion "one `PaymentProcessed` for order 7".
    #[track_caller]
    pub fn one(&self, matches: impl Fn(&E) -> bool) -> &Message<E>
    where
        E: std::fmt::Debug,
    {
        let found: Vec<&Message<E>> = self
            .messages
            .iter()
            .filter(|m| matches(m.payload()))
            .collect();
        match found.as_slice() {
            [one] => one,
            _ => panic!(
                "expected one {} on {} to match, found {}; published there: {:#?}",
                std::any::type_name::<E>(),
                self.topic,
                found.len(),
                self.payloads().collect::<Vec<_>>()
            ),
        }
    }

    /// Asserts that no payload matches. Panics, listing those that do.
    #[track_caller]
    pub fn none(&self, matches: impl Fn(&E) -> bool)
    where
        E: std::fmt::Debug,
    {
        let found: Vec<&E> = self.payloads().filter(|e| matches(e)).collect();
        assert!(
            found.is_empty(),
            "expected no {} on {} to match, found: {found:#?}",
            std::any::type_name::<E>(),
            self.topic
        );
    }
}

/// A message a service gave up on, read back from its dead-letter topic.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Where it was consumed from.
    pub topic: String,
    /// Its partition there.
    pub partition: Option<i32>,
    /// Its offset there.
    pub offset: Option<i64>,
    /// The step it was meant for, when one was found.
    pub step: Option<String>,
    /// Why, as a category (`handler-failed`, `undecodable`, `retries-exhausted`, ...).
    pub reason: String,
    /// The error, for people.
    pub error: String,
    /// How many times processing was attempted.
    pub attempts: Option<u32>,
    /// Its event type.
    pub event_type: Option<String>,
    /// Its idempotency key.
    pub idempotency_key: Option<String>,
    /// Its payload.
    pub payload: Option<Vec<u8>>,
}

impl DeadLetter {
    /// Reads a message of a dead-letter topic, if consumer group `group` dead-lettered it.
    pub(crate) fn read(raw: &RawMessage, group: &str) -> Option<Self> {
        let text = |name: &str| {
            let value = raw.headers.get_str(name).ok().flatten();
            value.filter(|v| !v.is_empty()).map(str::to_owned)
        };
        if text(dlq_headers::CONSUMER_GROUP).is_some_and(|g| g != group) {
            return None;
        }
        Some(Self {
            topic: text(dlq_headers::ORIGINAL_TOPIC).unwrap_or_default(),
            partition: text(dlq_headers::ORIGINAL_PARTITION).and_then(|p| p.parse().ok()),
            offset: text(dlq_headers::ORIGINAL_OFFSET).and_then(|o| o.parse().ok()),
            step: text(dlq_headers::STEP),
            reason: text(dlq_headers::REASON).unwrap_or_default(),
            error: text(dlq_headers::ERROR).unwrap_or_default(),
            attempts: text(dlq_headers::ATTEMPTS).and_then(|a| a.parse().ok()),
            event_type: text(saga_consumer::headers::names::CE_TYPE),
            idempotency_key: text(saga_consumer::headers::names::IDEMPOTENCY_KEY),
            payload: raw.payload.clone(),
        })
    }
}
