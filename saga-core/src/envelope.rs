//! The envelope around a saga event: what is read from the headers of a consumed message, the decoded
//! message a step receives, and the follow-up events a step emits (which inherit the saga's key, tenant and
//! correlation id).

use std::borrow::Cow;

use serde::Serialize;

use crate::event::{FromEvent, SagaEvent, Topic};
use crate::headers::{CLOUDEVENTS_SPEC_VERSION, HeaderError, Headers, TraceParent, names};
use crate::key::{ExternalKey, IdempotencyKey, KeyError, StepKey, StepName, TenantId};

/// Longest accepted event type, in bytes.
#[doc(hidden)]
pub const MAX_EVENT_TYPE_LEN: usize = 200;

/// Why a consumed message cannot be handled. Every variant is permanent: retrying the same bytes cannot
/// succeed, so the consumer dead-letters the message at once. (The runtime's: a step never sees one.)
#[doc(hidden)]
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EnvelopeError {
    /// A required header is absent.
    #[error("missing header {0:?}")]
    MissingHeader(&'static str),
    /// A header could not be read.
    #[error(transparent)]
    Header(#[from] HeaderError),
    /// A header holds an invalid key, tenant or step name.
    #[error("invalid header {header:?}: {source}")]
    InvalidKey {
        /// The header's name.
        header: &'static str,
        /// What is wrong with its value.
        source: KeyError,
    },
    /// The event type header is empty, too long or holds control characters.
    #[error("invalid event type {0:?}")]
    InvalidEventType(String),
    /// The payload is not the JSON the step expects.
    #[error("payload does not decode: {0}")]
    Payload(#[from] serde_json::Error),
}

/// What the framework reads from a message's headers (the runtime's; a step reads them through
/// [`Message`]'s accessors).
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventMetadata {
    /// The saga's original idempotency key (`idempotency-key`).
    pub idempotency_key: IdempotencyKey,
    /// The tenant (`tenant-id`); [`TenantId::default`] when absent.
    pub tenant: TenantId,
    /// The event type (`ce_type`).
    pub event_type: String,
    /// The message's id (`ce_id`), if the producer set one.
    pub message_id: Option<String>,
    /// Who produced the message (`ce_source`).
    pub source: Option<String>,
    /// The id shared by the saga's messages (`correlation-id`).
    pub correlation_id: Option<String>,
    /// The id of the message that caused this one (`causation-id`).
    pub causation_id: Option<String>,
    /// The W3C trace context (`traceparent`); malformed values are ignored.
    pub traceparent: Option<TraceParent>,
    /// The context of the span the runtime processes the message in, when it traces with OpenTelemetry
    /// (that span is the child of `traceparent`): events emitted while handling the message are its
    /// children. `None` when read from headers.
    pub span_context: Option<TraceParent>,
}

impl EventMetadata {
    /// Reads the metadata from `headers`. Fails, never panics, on any bytes.
    pub fn from_headers(headers: &Headers) -> Result<Self, EnvelopeError> {
        let key = headers
            .get_str(names::IDEMPOTENCY_KEY)?
            .ok_or(EnvelopeError::MissingHeader(names::IDEMPOTENCY_KEY))?;
        let idempotency_key =
            IdempotencyKey::new(key).map_err(|source| EnvelopeError::InvalidKey {
                header: names::IDEMPOTENCY_KEY,
                source,
            })?;
        let tenant = match headers.get_str(names::TENANT_ID)? {
            Some(t) => TenantId::new(t).map_err(|source| EnvelopeError::InvalidKey {
                header: names::TENANT_ID,
                source,
            })?,
            None => TenantId::default(),
        };
        let event_type = headers
            .get_str(names::CE_TYPE)?
            .ok_or(EnvelopeError::MissingHeader(names::CE_TYPE))?;
        validate_event_type(event_type)?;
        let optional = |name| -> Result<Option<String>, EnvelopeError> {
            Ok(headers.get_str(name)?.map(str::to_owned))
        };
        Ok(Self {
            idempotency_key,
            tenant,
            event_type: event_type.to_owned(),
            message_id: optional(names::CE_ID)?,
            source: optional(names::CE_SOURCE)?,
            correlation_id: optional(names::CORRELATION_ID)?,
            causation_id: optional(names::CAUSATION_ID)?,
            traceparent: headers
                .get_str(names::TRACEPARENT)
                .ok()
                .flatten()
                .and_then(TraceParent::parse),
            span_context: None,
        })
    }

    /// The step key of step `step` for this message.
    pub fn step_key(&self, step: &StepName) -> StepKey {
        self.idempotency_key.step_key(step)
    }
}

fn validate_event_type(event_type: &str) -> Result<(), EnvelopeError> {
    if event_type.is_empty()
        || event_type.len() > MAX_EVENT_TYPE_LEN
        || event_type.chars().any(char::is_control)
    {
        return Err(EnvelopeError::InvalidEventType(event_type.to_owned()));
    }
    Ok(())
}

/// Where a consumed message came from (the runtime's; see [`Message::topic`]).
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Origin {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The message's offset in its partition.
    pub offset: i64,
}

/// A consumed message as the broker delivered it, before decoding (the runtime's).
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawMessage {
    /// Where it came from.
    pub origin: Origin,
    /// The message key.
    pub key: Option<Vec<u8>>,
    /// The payload.
    pub payload: Option<Vec<u8>>,
    /// The headers.
    pub headers: Headers,
    /// The broker or producer timestamp, in milliseconds since the epoch.
    pub timestamp_ms: Option<i64>,
}

/// A decoded message, as a step's handler receives it: its payload, what its headers say about the saga,
/// and where it came from. The step key is the runtime's; a step hands an outside system
/// [`Message::external_key`].
#[derive(Debug, Clone)]
pub struct Message<P> {
    payload: P,
    metadata: EventMetadata,
    /// The step the message is decoded for: its external key is that step's.
    step: StepName,
    /// Worked out on first use: most steps never hand one out, and it costs a hash.
    external_key: std::sync::OnceLock<ExternalKey>,
    origin: Origin,
    headers: Headers,
}

impl<P> Message<P> {
    /// The typed payload.
    pub fn payload(&self) -> &P {
        &self.payload
    }

    /// The payload, taking the message apart.
    pub fn into_payload(self) -> P {
        self.payload
    }

    /// The saga's original idempotency key (the client's, carried by every message of the saga).
    pub fn idempotency_key(&self) -> &IdempotencyKey {
        &self.metadata.idempotency_key
    }

    /// The tenant the message belongs to.
    pub fn tenant(&self) -> &TenantId {
        &self.metadata.tenant
    }

    /// Its event type (`ce_type`).
    pub fn event_type(&self) -> &str {
        &self.metadata.event_type
    }

    /// Its id (`ce_id`), if its producer set one (the framework's events always have one).
    pub fn message_id(&self) -> Option<&str> {
        self.metadata.message_id.as_deref()
    }

    /// The id shared by the saga's messages (`correlation-id`), if any.
    pub fn correlation_id(&self) -> Option<&str> {
        self.metadata.correlation_id.as_deref()
    }

    /// The id of the message that caused this one (`causation-id`), if any.
    pub fn causation_id(&self) -> Option<&str> {
        self.metadata.causation_id.as_deref()
    }

    /// Who produced it (`ce_source`), if it says.
    pub fn source(&self) -> Option<&str> {
        self.metadata.source.as_deref()
    }

    /// The topic it was consumed from (a replay's: its original topic's).
    pub fn topic(&self) -> &str {
        &self.origin.topic
    }

    /// Its partition there.
    pub fn partition(&self) -> i32 {
        self.origin.partition
    }

    /// Its offset there.
    pub fn offset(&self) -> i64 {
        self.origin.offset
    }

    /// The text value of header `name`, if present (and not repeated with different values).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get_str(name).ok().flatten()
    }

    /// The key to hand to a system outside the database (a payment provider's idempotency key) for this
    /// step: unique across tenants, stable across attempts. See [`crate::ExternalKey`].
    pub fn external_key(&self) -> &ExternalKey {
        self.external_key.get_or_init(|| {
            ExternalKey::of(
                &self.metadata.tenant,
                &self.metadata.idempotency_key,
                &self.step,
            )
        })
    }

    /// The saga lineage that events emitted while handling this message inherit.
    pub fn lineage(&self) -> Lineage {
        Lineage::caused_by(&self.metadata)
    }

    /// What the headers say (the runtime's).
    #[doc(hidden)]
    pub fn metadata(&self) -> &EventMetadata {
        &self.metadata
    }

    /// The same message, for step `step` (its external key is that step's).
    pub(crate) fn for_step(self, step: &StepName) -> Self {
        Self::from_parts(self.payload, self.metadata, step, self.origin, self.headers)
    }

    /// The message with `payload` and what the runtime read, for step `step` (the runtime's).
    #[doc(hidden)]
    pub fn from_parts(
        payload: P,
        metadata: EventMetadata,
        step: &StepName,
        origin: Origin,
        headers: Headers,
    ) -> Self {
        Self {
            payload,
            metadata,
            step: step.clone(),
            external_key: std::sync::OnceLock::new(),
            origin,
            headers,
        }
    }
}

impl<P: FromEvent> Message<P> {
    /// Decodes `raw` for step `step`: reads the headers and parses the payload (the runtime's).
    #[doc(hidden)]
    pub fn decode(raw: &RawMessage, step: &StepName) -> Result<Self, EnvelopeError> {
        let metadata = EventMetadata::from_headers(&raw.headers)?;
        Self::decode_with(raw, metadata, step, raw.origin.clone())
    }

    /// Like [`Message::decode`], with headers already read, for a message first consumed at `origin` (its
    /// own position, or a replay's original one) (the runtime's).
    #[doc(hidden)]
    pub fn decode_with(
        raw: &RawMessage,
        metadata: EventMetadata,
        step: &StepName,
        origin: Origin,
    ) -> Result<Self, EnvelopeError> {
        let payload = P::from_event(
            &metadata.event_type,
            raw.payload.as_deref().unwrap_or(b"null"),
        )?;
        Ok(Self::from_parts(
            payload,
            metadata,
            step,
            origin,
            raw.headers.clone(),
        ))
    }
}

/// What an emitted event inherits from the saga: the original key, the tenant, the correlation id, its cause
/// and the trace. A step gets it from [`Message::lineage`]; a saga that starts outside a message (an HTTP
/// request, a scheduled job) begins one with [`Lineage::root`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lineage {
    idempotency_key: IdempotencyKey,
    tenant: TenantId,
    correlation_id: String,
    causation_id: Option<String>,
    traceparent: TraceParent,
}

impl Lineage {
    /// The lineage of a saga that starts here (an HTTP request, a scheduled job): the correlation id is the
    /// idempotency key, and a new trace begins.
    pub fn root(idempotency_key: IdempotencyKey, tenant: TenantId) -> Self {
        Self::root_traced(idempotency_key, tenant, None)
    }

    /// Like [`Lineage::root`], continuing the trace of `traceparent` if any (the runtime's).
    #[doc(hidden)]
    pub fn root_traced(
        idempotency_key: IdempotencyKey,
        tenant: TenantId,
        traceparent: Option<TraceParent>,
    ) -> Self {
        Self {
            correlation_id: idempotency_key.to_string(),
            idempotency_key,
            tenant,
            causation_id: None,
            traceparent: traceparent.map_or_else(TraceParent::new_root, |tp| tp.child()),
        }
    }

    /// The lineage of events caused by the message described by `cause`. Their trace parent is the span
    /// that processed `cause` ([`EventMetadata::span_context`]), else a new child of `cause`'s trace.
    #[doc(hidden)]
    pub fn caused_by(cause: &EventMetadata) -> Self {
        let of = LineageOf::cause(cause);
        Self {
            idempotency_key: of.idempotency_key.clone(),
            tenant: of.tenant.clone(),
            correlation_id: of.correlation_id().to_owned(),
            causation_id: of.causation_id.map(str::to_owned),
            traceparent: of.traceparent,
        }
    }

    /// Makes `span_context`, if any, the events' trace parent: the context of the span emitting them, when
    /// the runtime traces with OpenTelemetry (the runtime's).
    #[doc(hidden)]
    #[must_use]
    pub fn in_span(mut self, span_context: Option<TraceParent>) -> Self {
        if let Some(span) = span_context {
            self.traceparent = span;
        }
        self
    }

    /// The saga's original idempotency key.
    pub fn idempotency_key(&self) -> &IdempotencyKey {
        &self.idempotency_key
    }

    /// The saga's tenant.
    pub fn tenant(&self) -> &TenantId {
        &self.tenant
    }

    /// The saga's correlation id.
    pub fn correlation_id(&self) -> &str {
        &self.correlation_id
    }

    /// The id of the message whose handling emits the event, if any.
    pub fn causation_id(&self) -> Option<&str> {
        self.causation_id.as_deref()
    }

    /// The trace context the event carries (the runtime's).
    #[doc(hidden)]
    pub fn traceparent(&self) -> &TraceParent {
        &self.traceparent
    }
}

/// A follow-up event: its type, topic, key and payload. Steps emit typed events with
/// [`crate::StepContext::emit`]; this is for events whose type is known only at run time (a command an
/// orchestrator builds from saga data, say). It becomes an outbox row carrying the saga's lineage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    event_type: String,
    topic: String,
    partition_key: Option<String>,
    payload: Vec<u8>,
    extra_headers: Vec<(String, String)>,
}

impl Event {
    /// The event `event` for `topic`, keyed by `partition_key` (the aggregate id, which decides the
    /// partition and the order).
    pub fn of<E: SagaEvent>(
        topic: &Topic<E>,
        partition_key: impl Into<String>,
        event: &E,
    ) -> Result<Self, serde_json::Error> {
        Ok(Self {
            event_type: event.event_type().to_owned(),
            topic: topic.name().to_owned(),
            partition_key: Some(partition_key.into()),
            payload: event.to_json()?,
            extra_headers: Vec::new(),
        })
    }

    /// An event of type `event_type` for topic `topic`, keyed by `partition_key`, with `payload` as JSON,
    /// for types known only at run time. Prefer [`Event::of`].
    pub fn new(
        event_type: impl Into<String>,
        topic: impl Into<String>,
        partition_key: impl Into<String>,
        payload: &impl Serialize,
    ) -> Result<Self, serde_json::Error> {
        Ok(Self {
            event_type: event_type.into(),
            topic: topic.into(),
            partition_key: Some(partition_key.into()),
            payload: serde_json::to_vec(payload)?,
            extra_headers: Vec::new(),
        })
    }

    /// Adds a header of the caller's own.
    #[must_use]
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra_headers.push((name.into(), value.into()));
        self
    }

    /// Its event type.
    pub fn event_type(&self) -> &str {
        &self.event_type
    }

    /// Its topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Its Kafka key.
    pub fn partition_key(&self) -> Option<&str> {
        self.partition_key.as_deref()
    }

    /// Its JSON payload.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }
}

/// What an emitted event inherits, borrowed from a [`Lineage`] or straight from the metadata of the message
/// that caused it (the consumer's path, which so builds no `Lineage` per event).
struct LineageOf<'a> {
    idempotency_key: &'a IdempotencyKey,
    tenant: &'a TenantId,
    /// `None`: the saga's correlation id is its idempotency key.
    correlation_id: Option<&'a str>,
    causation_id: Option<&'a str>,
    traceparent: TraceParent,
}

impl<'a> LineageOf<'a> {
    fn lineage(lineage: &'a Lineage) -> Self {
        Self {
            idempotency_key: &lineage.idempotency_key,
            tenant: &lineage.tenant,
            correlation_id: Some(&lineage.correlation_id),
            causation_id: lineage.causation_id.as_deref(),
            traceparent: lineage.traceparent,
        }
    }

    /// See [`Lineage::caused_by`].
    fn cause(cause: &'a EventMetadata) -> Self {
        Self {
            idempotency_key: &cause.idempotency_key,
            tenant: &cause.tenant,
            correlation_id: cause.correlation_id.as_deref(),
            causation_id: cause.message_id.as_deref(),
            traceparent: cause.span_context.unwrap_or_else(|| {
                cause
                    .traceparent
                    .map_or_else(TraceParent::new_root, |tp| tp.child())
            }),
        }
    }

    fn correlation_id(&self) -> &'a str {
        self.correlation_id
            .unwrap_or_else(|| self.idempotency_key.as_str())
    }
}

/// A header of an outbox row: its name (the framework's own are static) and its text value (the runtime's).
#[doc(hidden)]
pub type OutboxHeader = (Cow<'static, str>, Cow<'static, str>);

/// A row of the transactional outbox: a message to publish as is (the runtime's).
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    /// The tenant it belongs to.
    pub tenant: TenantId,
    /// The topic.
    pub topic: String,
    /// The Kafka key.
    pub partition_key: Option<String>,
    /// The headers, in order (text values only).
    pub headers: Vec<OutboxHeader>,
    /// The payload.
    pub payload: Vec<u8>,
}

impl OutboxMessage {
    /// The outbox row for `event`, emitted by `source` within `lineage`. Gives the event a new message id.
    pub fn from_event(event: Event, lineage: &Lineage, source: &str) -> Self {
        Self::inheriting(event, &LineageOf::lineage(lineage), source)
    }

    /// The outbox row for `event`, emitted by `source` while handling the message described by `cause`:
    /// the same row as [`OutboxMessage::from_event`] with `cause`'s [`Lineage::caused_by`], built without
    /// it.
    pub fn caused_by(event: Event, cause: &EventMetadata, source: &str) -> Self {
        Self::inheriting(event, &LineageOf::cause(cause), source)
    }

    fn inheriting(event: Event, lineage: &LineageOf<'_>, source: &str) -> Self {
        let text = |value: &str| Cow::Owned(value.to_owned());
        let mut message_id = [0u8; uuid::fmt::Hyphenated::LENGTH];
        let message_id = uuid::Uuid::now_v7()
            .hyphenated()
            .encode_lower(&mut message_id);
        let mut headers: Vec<OutboxHeader> = Vec::with_capacity(11 + event.extra_headers.len());
        headers.extend([
            (
                Cow::Borrowed(names::CE_SPECVERSION),
                Cow::Borrowed(CLOUDEVENTS_SPEC_VERSION),
            ),
            (Cow::Borrowed(names::CE_ID), text(message_id)),
            (Cow::Borrowed(names::CE_TYPE), Cow::Owned(event.event_type)),
            (Cow::Borrowed(names::CE_SOURCE), text(source)),
            (
                Cow::Borrowed(names::CE_TIME),
                Cow::Owned(chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true)),
            ),
            (
                Cow::Borrowed(names::CONTENT_TYPE),
                Cow::Borrowed("application/json"),
            ),
            (
                Cow::Borrowed(names::IDEMPOTENCY_KEY),
                text(lineage.idempotency_key.as_str()),
            ),
            (
                Cow::Borrowed(names::TENANT_ID),
                text(lineage.tenant.as_str()),
            ),
            (
                Cow::Borrowed(names::CORRELATION_ID),
                text(lineage.correlation_id()),
            ),
        ]);
        if let Some(causation) = lineage.causation_id {
            headers.push((Cow::Borrowed(names::CAUSATION_ID), text(causation)));
        }
        headers.push((
            Cow::Borrowed(names::TRACEPARENT),
            Cow::Owned(lineage.traceparent.to_string()),
        ));
        headers.extend(
            event
                .extra_headers
                .into_iter()
                .map(|(name, value)| (Cow::Owned(name), Cow::Owned(value))),
        );
        Self {
            tenant: lineage.tenant.clone(),
            topic: event.topic,
            partition_key: event.partition_key,
            headers,
            payload: event.payload,
        }
    }

    /// The headers as a [`Headers`] list.
    pub fn header_list(&self) -> Headers {
        self.headers
            .iter()
            .fold(Headers::new(), |h, (n, v)| h.with(n.as_ref(), v.as_ref()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers() -> Headers {
        Headers::new()
            .with(names::IDEMPOTENCY_KEY, "k-1")
            .with(names::TENANT_ID, "acme")
            .with(names::CE_TYPE, "OrderCreated")
            .with(names::CE_ID, "m-1")
            .with(
                names::TRACEPARENT,
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            )
    }

    #[test]
    fn metadata_reads_framework_headers() {
        let meta = EventMetadata::from_headers(&headers()).unwrap();
        assert_eq!(meta.idempotency_key.as_str(), "k-1");
        assert_eq!(meta.tenant.as_str(), "acme");
        assert_eq!(meta.event_type, "OrderCreated");
        assert_eq!(meta.message_id.as_deref(), Some("m-1"));
        assert_eq!(meta.correlation_id, None);
        assert!(meta.traceparent.is_some());
    }

    #[test]
    fn missing_key_and_type_are_reported_by_name() {
        let mut h = headers();
        h.remove(names::IDEMPOTENCY_KEY);
        let err = EventMetadata::from_headers(&h).unwrap_err();
        assert!(matches!(
            err,
            EnvelopeError::MissingHeader("idempotency-key")
        ));
        let mut h = headers();
        h.remove(names::CE_TYPE);
        let err = EventMetadata::from_headers(&h).unwrap_err();
        assert_eq!(err.to_string(), "missing header \"ce_type\"");
        let h = headers().with(names::TENANT_ID, "other");
        assert!(matches!(
            EventMetadata::from_headers(&h),
            Err(EnvelopeError::Header(HeaderError::Conflicting { .. }))
        ));
    }

    #[test]
    fn tenant_defaults_when_absent() {
        let mut h = headers();
        h.remove(names::TENANT_ID);
        assert_eq!(
            EventMetadata::from_headers(&h).unwrap().tenant.as_str(),
            "default"
        );
    }

    #[test]
    fn emitted_events_inherit_key_tenant_correlation_and_trace() {
        let cause = EventMetadata::from_headers(&headers()).unwrap();
        let lineage = Lineage::caused_by(&cause);
        let event = Event::new(
            "PaymentProcessed",
            "payments",
            "order-7",
            &serde_json::json!({"ok": true}),
        )
        .unwrap()
        .with_header("x-extra", "1");
        let row = OutboxMessage::from_event(event, &lineage, "process-payment");
        let out = row.header_list();
        let meta = EventMetadata::from_headers(&out).unwrap();
        assert_eq!(meta.idempotency_key, cause.idempotency_key);
        assert_eq!(meta.tenant, cause.tenant);
        assert_eq!(meta.correlation_id.as_deref(), Some("k-1"));
        assert_eq!(meta.causation_id.as_deref(), Some("m-1"));
        assert_eq!(meta.event_type, "PaymentProcessed");
        assert_eq!(meta.source.as_deref(), Some("process-payment"));
        assert_ne!(meta.message_id, cause.message_id);
        let (in_tp, out_tp) = (cause.traceparent.unwrap(), meta.traceparent.unwrap());
        assert_eq!(in_tp.trace_id, out_tp.trace_id);
        assert_ne!(in_tp.parent_id, out_tp.parent_id);
        assert_eq!(
            out_tp, lineage.traceparent,
            "the row carries the lineage's context"
        );
        // Traced by the runtime: the events are the children of the span that processed the cause.
        let span = in_tp.child();
        let traced = EventMetadata {
            span_context: Some(span),
            ..cause
        };
        let row = OutboxMessage::from_event(
            Event::new("PaymentProcessed", "payments", "order-7", &1).unwrap(),
            &Lineage::caused_by(&traced),
            "process-payment",
        );
        let meta = EventMetadata::from_headers(&row.header_list()).unwrap();
        assert_eq!(meta.traceparent, Some(span));
        assert_eq!(out.get_str("x-extra"), Ok(Some("1")));
        assert_eq!(row.partition_key.as_deref(), Some("order-7"));
        assert_eq!(row.tenant.as_str(), "acme");
    }

    #[test]
    fn an_event_caused_by_a_message_gets_the_row_its_lineage_gives() {
        let event = || {
            Event::new("PaymentProcessed", "payments", "order-7", &1)
                .unwrap()
                .with_header("x-extra", "1")
        };
        // Ids and times differ from row to row: compare everything else.
        let stable = |row: OutboxMessage| {
            let headers: Vec<(String, String)> = row
                .headers
                .iter()
                .filter(|(n, _)| *n != names::CE_ID && *n != names::CE_TIME)
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect();
            (
                row.tenant,
                row.topic,
                row.partition_key,
                headers,
                row.payload,
            )
        };
        let cause = EventMetadata::from_headers(&headers()).unwrap();
        let span = cause.traceparent.unwrap().child();
        let without_correlation = EventMetadata {
            span_context: Some(span),
            ..cause.clone()
        };
        let with_correlation = EventMetadata {
            correlation_id: Some("c-9".into()),
            message_id: None,
            ..without_correlation.clone()
        };
        for cause in [without_correlation, with_correlation] {
            assert_eq!(
                stable(OutboxMessage::caused_by(event(), &cause, "process-payment")),
                stable(OutboxMessage::from_event(
                    event(),
                    &Lineage::caused_by(&cause),
                    "process-payment"
                )),
            );
        }
        // Without a span, a new child of the cause's trace.
        let row = OutboxMessage::caused_by(event(), &cause, "process-payment");
        let meta = EventMetadata::from_headers(&row.header_list()).unwrap();
        let (in_tp, out_tp) = (cause.traceparent.unwrap(), meta.traceparent.unwrap());
        assert_eq!(out_tp.trace_id, in_tp.trace_id);
        assert_ne!(out_tp.parent_id, in_tp.parent_id);
    }

    #[test]
    fn decode_reports_bad_json() {
        let raw = RawMessage {
            origin: Origin {
                topic: "t".into(),
                partition: 0,
                offset: 3,
            },
            key: None,
            payload: Some(b"{not json".to_vec()),
            headers: headers(),
            timestamp_ms: None,
        };
        #[derive(Debug, serde::Deserialize)]
        struct P {
            #[allow(dead_code)]
            x: u32,
        }
        let err = Message::<P>::decode(&raw, &StepName::from_static("s")).unwrap_err();
        assert!(matches!(err, EnvelopeError::Payload(_)));
        let ok = RawMessage {
            payload: Some(br#"{"x": 5}"#.to_vec()),
            ..raw
        };
        let msg = Message::<P>::decode(&ok, &StepName::from_static("s")).unwrap();
        assert_eq!(msg.external_key().as_str(), "acme:k-1:s");
        assert_eq!(msg.payload.x, 5);
    }
}
