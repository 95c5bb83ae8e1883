//! The framework's spans, and the W3C trace context they carry through HTTP, the outbox and Kafka.
//!
//! Every span here is a `tracing` span named and attributed after OpenTelemetry's semantic conventions
//! (`otel.name`, `otel.kind`, `messaging.*`, `http.*`, plus `saga.*` for the step). With the feature `otel`
//! and a `tracing-opentelemetry` layer installed ([`crate::telemetry`]), they are OpenTelemetry spans:
//!
//! - the HTTP span continues the caller's trace (`traceparent` request header) and the events the request
//!   emits carry the HTTP span's context;
//! - the outbox row stores that context in its `traceparent` header, and the message keeps it;
//! - the relay's publish span links to the row's context (it publishes many sagas' rows in one batch);
//! - a step's process span is the child of the message's context, and the events the step emits carry the
//!   process span's context ([`saga_core::EventMetadata::span_context`]).
//!
//! Contexts are read by OpenTelemetry's `TraceContextPropagator`, over Kafka headers, outbox header pairs
//! and HTTP headers, and a span's own context is handed on as the W3C `traceparent` value that propagator
//! writes. Without the feature, the functions that tie spans to traces do nothing
//! and [`span_context`] is `None`: `traceparent` still travels, each step passing on a new child of it.
//!
//! A span the sampler would drop is not built for OpenTelemetry at all: where the layer's `SampledOut`
//! (feature `otel`) says so (a sampled-out parent under a parent-based sampler, or every span under
//! `always_off`), the span is opened under [`SAMPLED_OUT_TARGET`], which the layer of
//! `telemetry::otel_layer` (feature `otel`) filters out per call site. It is still log context; the
//! `traceparent` passed on keeps its "not sampled" flag.

use saga_core::{Headers, TraceParent};
use tracing::Span;

/// The W3C trace context header.
const TRACEPARENT: &str = "traceparent";

/// The target of the framework's spans that the sampler would drop: the layer of
/// `telemetry::otel_layer` (feature `otel`) filters it out, so that no OpenTelemetry span is built for
/// them. `RUST_LOG` directives for `saga_runtime` still cover it.
pub const SAMPLED_OUT_TARGET: &str = "saga_runtime::trace::sampled_out";

/// The most of a Kafka key a span carries: a key may be as long as a message, and is copied into every
/// span (and every log line and exported span) of its message.
pub const MAX_KEY_BYTES_IN_SPAN: usize = 256;

/// A Kafka key as a span attribute: as text (invalid UTF-8 replaced), at most [`MAX_KEY_BYTES_IN_SPAN`]
/// bytes of it, and a longer one cut at a character boundary and marked `…[truncated, N bytes]`.
pub fn bounded_key(key: &[u8]) -> std::borrow::Cow<'_, str> {
    if key.len() <= MAX_KEY_BYTES_IN_SPAN {
        return String::from_utf8_lossy(key);
    }
    let text = String::from_utf8_lossy(&key[..MAX_KEY_BYTES_IN_SPAN]);
    // A character cut in two at the end shows as U+FFFD: drop it.
    let text = text.trim_end_matches('\u{fffd}');
    std::borrow::Cow::Owned(format!("{text}…[truncated, {} bytes]", key.len()))
}

/// Opens a span under [`SAMPLED_OUT_TARGET`] when the first argument is true, under this module's target
/// otherwise: two call sites with one field list (`tracing` needs targets and field names at compile time).
macro_rules! at_target {
    ($sampled_out:expr, $($span:tt)+) => {
        if $sampled_out {
            tracing::info_span!(target: SAMPLED_OUT_TARGET, $($span)+)
        } else {
            tracing::info_span!($($span)+)
        }
    };
}

/// Which of the framework's spans the sampler would drop (defined with the settings, `saga_config`).
#[cfg(feature = "otel")]
pub use saga_config::SampledOut;

/// The per-layer filter of [`crate::telemetry::otel_layer`]: keeps the spans opened under
/// [`SAMPLED_OUT_TARGET`] away from the OpenTelemetry layer (decided once per call site), and tells the
/// framework's span functions, which find it through the current dispatcher, which spans to open there.
#[cfg(feature = "otel")]
#[derive(Debug, Clone, Copy)]
pub struct SampledOutFilter(pub SampledOut);

#[cfg(feature = "otel")]
impl<S> tracing_subscriber::layer::Filter<S> for SampledOutFilter {
    fn enabled(
        &self,
        meta: &tracing::Metadata<'_>,
        _: &tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        meta.target() != SAMPLED_OUT_TARGET
    }

    fn callsite_enabled(
        &self,
        meta: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        if meta.target() == SAMPLED_OUT_TARGET {
            tracing::subscriber::Interest::never()
        } else {
            tracing::subscriber::Interest::always()
        }
    }
}

/// Whether a span whose parent context is `parent()` (from a `traceparent` value, if any) is left out of
/// OpenTelemetry, by the `SampledOutFilter` (feature `otel`) of the current subscriber (none: no span
/// is). The header is read only when the answer depends on it.
fn sampled_out(parent: impl FnOnce() -> Option<TraceParent>) -> bool {
    #[cfg(feature = "otel")]
    {
        let policy = tracing::dispatcher::get_default(|dispatch| {
            dispatch.downcast_ref::<SampledOutFilter>().map(|f| f.0)
        });
        match policy {
            Some(SampledOut::ChildrenOfSampledOut) => parent().is_some_and(|p| p.flags & 1 == 0),
            Some(SampledOut::Everything) => true,
            // `Undecided`, no layer, and any kind a later version adds: the sampler decides.
            _ => false,
        }
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = parent;
        false
    }
}

/// The span of an HTTP request served by the `Idempotency-Key` layer (kind server), named
/// `{method} {route}` (`{method}` when the route is unknown), continuing the trace of the request's
/// `traceparent` header. Records `http.response.status_code` and `saga.step_key` later.
pub fn http_span(method: &http::Method, route: Option<&str>, headers: &http::HeaderMap) -> Span {
    let name = match route {
        Some(route) => format!("{method} {route}"),
        None => method.to_string(),
    };
    let parent = || {
        headers
            .get(TRACEPARENT)
            .and_then(|v| v.to_str().ok())
            .and_then(TraceParent::parse)
    };
    let skip = sampled_out(parent);
    let span = at_target!(
        skip,
        "http.request",
        otel.name = %name,
        otel.kind = "server",
        http.request.method = %method,
        http.route = route,
        http.response.status_code = tracing::field::Empty,
        saga.step_key = tracing::field::Empty,
    );
    #[cfg(feature = "otel")]
    if !skip {
        otel::continue_from(&span, &otel::HttpHeaders(headers));
    }
    span
}

/// What the span of a consumed message records: where the message came from and, as far as its headers
/// could be read, what it is.
#[derive(Debug, Clone, Copy, Default)]
pub struct MessageFields<'a> {
    /// The topic.
    pub topic: &'a str,
    /// The partition.
    pub partition: i32,
    /// The offset.
    pub offset: i64,
    /// The Kafka key.
    pub key: Option<&'a [u8]>,
    /// The consumer group.
    pub group: &'a str,
    /// The tenant, from the headers.
    pub tenant: Option<&'a str>,
    /// The event type, from the headers.
    pub event_type: Option<&'a str>,
    /// The step the message is for.
    pub step: Option<&'a str>,
    /// The message's step key.
    pub step_key: Option<&'a str>,
    /// The message's trace context, as its headers carry it (parsed).
    pub traceparent: Option<&'a TraceParent>,
}

/// An id as W3C trace context writes it (lower-case hex, zero-padded to `digits`: 32 for a trace id, 16 for a
/// span id), shown without building a string first.
struct Hex {
    id: u128,
    digits: usize,
}

impl std::fmt::Display for Hex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:0digits$x}", self.id, digits = self.digits)
    }
}

/// The span of a consumed message (kind consumer), named `process {topic}`, continuing the trace of the
/// message's `traceparent` header, with all of `fields` (recorded at once: a log layer formats a span's
/// fields each time some are recorded). Records the outcome later.
pub fn process_span(fields: &MessageFields<'_>, headers: &Headers) -> Span {
    let parent = || {
        fields.traceparent.copied().or_else(|| {
            headers
                .get_str(TRACEPARENT)
                .ok()
                .flatten()
                .and_then(TraceParent::parse)
        })
    };
    let skip = sampled_out(parent);
    let topic = fields.topic;
    let span = at_target!(
        skip,
        "saga.message",
        otel.name = %format_args!("process {topic}"),
        otel.kind = "consumer",
        messaging.system = "kafka",
        messaging.operation.type = "process",
        messaging.destination.name = %topic,
        messaging.destination.partition.id = fields.partition,
        messaging.kafka.offset = fields.offset,
        messaging.kafka.message.key = fields.key.map(bounded_key).as_deref(),
        messaging.consumer.group.name = %fields.group,
        saga.step = fields.step,
        saga.step_key = fields.step_key,
        saga.tenant = fields.tenant,
        saga.event_type = fields.event_type,
        saga.outcome = tracing::field::Empty,
        trace_id = fields
            .traceparent
            .map(|tp| tracing::field::display(Hex { id: tp.trace_id, digits: 32 })),
        parent_span_id = fields
            .traceparent
            .map(|tp| tracing::field::display(Hex { id: u128::from(tp.parent_id), digits: 16 })),
    );
    #[cfg(feature = "otel")]
    if !skip {
        otel::continue_from(&span, &otel::MessageHeaders(headers));
    }
    span
}

/// The span of the relay publishing an outbox row (kind producer), named `publish {topic}`, linked to the
/// context of the transaction that wrote the row (its `traceparent` header pair). Records the partition
/// and offset once the broker acknowledges. Without the feature `otel`, a disabled span: the relay
/// publishes thousands of rows a second and logs batches, not rows. The span is the root of a trace of its
/// own, so only a sampler that drops everything leaves it out before it is built.
pub fn publish_span(topic: &str, key: Option<&str>, headers: &[(String, String)]) -> Span {
    #[cfg(feature = "otel")]
    {
        let skip = sampled_out(|| None);
        let span = at_target!(
            skip,
            "outbox.publish",
            otel.name = %format_args!("publish {topic}"),
            otel.kind = "producer",
            messaging.system = "kafka",
            messaging.operation.type = "send",
            messaging.destination.name = %topic,
            messaging.kafka.message.key = key.map(str::as_bytes).map(bounded_key).as_deref(),
            messaging.destination.partition.id = tracing::field::Empty,
            messaging.kafka.offset = tracing::field::Empty,
        );
        if !skip {
            otel::link(&span, &otel::Pairs(headers));
        }
        span
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = (topic, key, headers);
        Span::none()
    }
}

/// The OpenTelemetry context of `span`, as the `traceparent` its children carry; `None` without the feature
/// `otel`, or when no OpenTelemetry layer records the span.
pub fn span_context(span: &Span) -> Option<TraceParent> {
    #[cfg(feature = "otel")]
    return otel::span_context(span);
    #[cfg(not(feature = "otel"))]
    {
        let _ = span;
        None
    }
}

/// Propagation through OpenTelemetry's `TraceContextPropagator`.
#[cfg(feature = "otel")]
mod otel {
    use opentelemetry::propagation::{Extractor, TextMapPropagator};
    use opentelemetry::trace::TraceContextExt;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use saga_core::{Headers, TraceParent};
    use tracing::Span;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    /// A Kafka message's headers (non-UTF-8 values read as absent).
    pub(super) struct MessageHeaders<'a>(pub &'a Headers);

    impl Extractor for MessageHeaders<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get_str(key).ok().flatten()
        }
        fn keys(&self) -> Vec<&str> {
            self.0.iter().map(|h| h.name.as_str()).collect()
        }
    }

    /// An outbox row's header pairs.
    pub(super) struct Pairs<'a>(pub &'a [(String, String)]);

    impl Extractor for Pairs<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0
                .iter()
                .find(|(name, _)| name.eq_ignore_ascii_case(key))
                .map(|(_, value)| value.as_str())
        }
        fn keys(&self) -> Vec<&str> {
            self.0.iter().map(|(name, _)| name.as_str()).collect()
        }
    }

    /// An HTTP request's headers.
    pub(super) struct HttpHeaders<'a>(pub &'a http::HeaderMap);

    impl Extractor for HttpHeaders<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|v| v.to_str().ok())
        }
        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(http::HeaderName::as_str).collect()
        }
    }

    pub(super) fn continue_from(span: &Span, carrier: &dyn Extractor) {
        let cx = TraceContextPropagator::new().extract(carrier);
        if cx.span().span_context().is_valid() {
            // Fails only where no OpenTelemetry layer records the span: nothing to continue then.
            let _ = span.set_parent(cx);
        }
    }

    pub(super) fn link(span: &Span, carrier: &dyn Extractor) {
        let cx = TraceContextPropagator::new().extract(carrier);
        span.add_link(cx.span().span_context().clone());
    }

    /// The span's context as the `traceparent` value the propagator would inject, read directly (the
    /// injection's text would only be parsed back).
    pub(super) fn span_context(span: &Span) -> Option<TraceParent> {
        let cx = span.context();
        let context = cx.span().span_context().clone();
        context.is_valid().then(|| TraceParent {
            trace_id: u128::from_be_bytes(context.trace_id().to_bytes()),
            parent_id: u64::from_be_bytes(context.span_id().to_bytes()),
            flags: context.trace_flags().to_u8(),
        })
    }
}

#[cfg(all(test, feature = "otel"))]
mod tests {
    use super::*;
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
    use tracing_subscriber::layer::SubscriberExt;

    /// An exporter recording finished spans, its provider (which must outlive the test: dropping it shuts
    /// the exporter down) and a subscriber sending spans to it.
    fn recording() -> (
        InMemorySpanExporter,
        SdkTracerProvider,
        impl tracing::Subscriber + Send + Sync,
    ) {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        (exporter, provider, subscriber)
    }

    #[test]
    fn a_message_span_continues_the_headers_trace_and_passes_its_own_context_on() {
        let (exporter, provider, subscriber) = recording();
        let incoming = TraceParent::new_root();
        let headers = Headers::new().with("traceparent", incoming.to_string());
        let context = tracing::subscriber::with_default(subscriber, || {
            let span = process_span(
                &MessageFields {
                    topic: "payments",
                    partition: 2,
                    offset: 41,
                    key: Some(b"order-7"),
                    group: "shipping",
                    ..MessageFields::default()
                },
                &headers,
            );
            let context = span_context(&span).expect("an OpenTelemetry span");
            span.record("saga.outcome", "processed");
            context
        });
        let _ = provider.force_flush();
        let spans = exporter.get_finished_spans().unwrap();
        let [span] = spans.as_slice() else {
            panic!("one span: {spans:?}")
        };
        assert_eq!(span.name, "process payments");
        assert_eq!(span.span_kind, opentelemetry::trace::SpanKind::Consumer);
        assert_eq!(
            u128::from_be_bytes(span.span_context.trace_id().to_bytes()),
            incoming.trace_id
        );
        assert_eq!(
            u64::from_be_bytes(span.parent_span_id.to_bytes()),
            incoming.parent_id
        );
        assert_eq!(
            u64::from_be_bytes(span.span_context.span_id().to_bytes()),
            context.parent_id,
            "children name this span as their parent"
        );
        let attribute = |key: &str| {
            span.attributes
                .iter()
                .find(|kv| kv.key.as_str() == key)
                .map(|kv| kv.value.to_string())
        };
        assert_eq!(attribute("messaging.system").as_deref(), Some("kafka"));
        assert_eq!(
            attribute("messaging.destination.name").as_deref(),
            Some("payments")
        );
        assert_eq!(
            attribute("messaging.kafka.message.key").as_deref(),
            Some("order-7")
        );
        assert_eq!(
            attribute("messaging.consumer.group.name").as_deref(),
            Some("shipping")
        );
        assert_eq!(attribute("messaging.kafka.offset").as_deref(), Some("41"));
        assert_eq!(attribute("saga.outcome").as_deref(), Some("processed"));
    }

    #[test]
    fn a_publish_span_links_to_the_rows_context_without_joining_its_trace() {
        let (exporter, provider, subscriber) = recording();
        let writer = TraceParent::new_root();
        let pairs = vec![("traceparent".to_owned(), writer.to_string())];
        tracing::subscriber::with_default(subscriber, || {
            let span = publish_span("orders", Some("order-7"), &pairs);
            span.record("messaging.kafka.offset", 9);
        });
        let _ = provider.force_flush();
        let spans = exporter.get_finished_spans().unwrap();
        let [span] = spans.as_slice() else {
            panic!("one span: {spans:?}")
        };
        assert_eq!(span.name, "publish orders");
        assert_eq!(span.span_kind, opentelemetry::trace::SpanKind::Producer);
        let links: Vec<_> = span.links.iter().collect();
        assert_eq!(links.len(), 1);
        assert_eq!(
            u128::from_be_bytes(links[0].span_context.trace_id().to_bytes()),
            writer.trace_id
        );
        assert_eq!(
            u64::from_be_bytes(links[0].span_context.span_id().to_bytes()),
            writer.parent_id
        );
        assert_ne!(
            u128::from_be_bytes(span.span_context.trace_id().to_bytes()),
            writer.trace_id,
            "a batch's publish is a trace of its own"
        );
    }

    #[test]
    fn a_span_the_sampler_would_drop_is_not_built_for_opentelemetry() {
        let exporter = InMemorySpanExporter::default();
        // OpenTelemetry's default sampler: parent-based, roots always on.
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let sampled = TraceParent::new_root();
        let unsampled = TraceParent {
            flags: 0,
            ..TraceParent::new_root()
        };
        let open = |parent: Option<TraceParent>| {
            let headers = match parent {
                Some(p) => Headers::new().with("traceparent", p.to_string()),
                None => Headers::new(),
            };
            let span = process_span(&message("payments", 1), &headers);
            let target = span.metadata().map(|m| m.target());
            (target, span_context(&span))
        };
        let children = tracing_subscriber::registry().with(crate::telemetry::otel_layer(
            &provider,
            SampledOut::ChildrenOfSampledOut,
        ));
        let [of_sampled, of_unsampled, root] = tracing::subscriber::with_default(children, || {
            [open(Some(sampled)), open(Some(unsampled)), open(None)]
        });
        assert_eq!(of_sampled.0, Some("saga_runtime::trace"));
        assert_eq!(of_sampled.1.map(|c| c.trace_id), Some(sampled.trace_id));
        assert_eq!(of_unsampled, (Some(SAMPLED_OUT_TARGET), None));
        assert_eq!(
            root.0,
            Some("saga_runtime::trace"),
            "roots are the sampler's"
        );
        assert!(root.1.is_some());
        let everything = tracing_subscriber::registry().with(crate::telemetry::otel_layer(
            &provider,
            SampledOut::Everything,
        ));
        let root = tracing::subscriber::with_default(everything, || open(None));
        assert_eq!(root, (Some(SAMPLED_OUT_TARGET), None));
        let _ = provider.force_flush();
        let spans = exporter.get_finished_spans().unwrap();
        let traces: Vec<u128> = spans
            .iter()
            .map(|s| u128::from_be_bytes(s.span_context.trace_id().to_bytes()))
            .collect();
        assert_eq!(
            traces.len(),
            2,
            "the sampled child and the first root: {traces:?}"
        );
        assert!(traces.contains(&sampled.trace_id));
        assert!(!traces.contains(&unsampled.trace_id));
    }

    #[test]
    fn the_sampler_variable_says_which_spans_are_sampled_out() {
        use SampledOut::*;
        for (value, expected) in [
            (None, ChildrenOfSampledOut),
            (Some(""), ChildrenOfSampledOut),
            (Some("parentbased_always_on"), ChildrenOfSampledOut),
            (Some("parentbased_traceidratio"), ChildrenOfSampledOut),
            (Some("always_off"), Everything),
            (Some("always_on"), Undecided),
            (Some("traceidratio"), Undecided),
        ] {
            assert_eq!(SampledOut::for_sampler(value), expected, "{value:?}");
        }
    }

    /// A message at `offset` of partition 0 of `topic`, whose headers could not be read.
    fn message(topic: &str, offset: i64) -> MessageFields<'_> {
        MessageFields {
            topic,
            offset,
            group: "g",
            ..MessageFields::default()
        }
    }

    #[test]
    fn without_an_opentelemetry_layer_there_is_no_span_context() {
        let span = process_span(&message("payments", 0), &Headers::new());
        assert_eq!(span_context(&span), None);
    }
}

#[cfg(test)]
mod log_context {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    /// A writer appending to a shared buffer.
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Shared {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// What `f` logs, formatted as the fmt layer writes it.
    fn logged(f: impl FnOnce()) -> String {
        let buffer = Arc::new(Mutex::new(Vec::new()));
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .fmt_fields(crate::telemetry::LogFields)
                .with_ansi(false)
                .with_writer(move || Shared(writer.clone())),
        );
        tracing::subscriber::with_default(subscriber, f);
        let bytes = buffer.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn a_log_line_inside_a_message_names_its_step_key_tenant_and_trace() {
        let parent = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        let line = logged(|| {
            let span = process_span(
                &MessageFields {
                    topic: "payments",
                    partition: 3,
                    offset: 17,
                    group: "shipping",
                    tenant: Some("acme"),
                    event_type: Some("PaymentProcessed"),
                    step: Some("arrange-shipment"),
                    step_key: Some("order-7:arrange-shipment"),
                    traceparent: parent.as_ref(),
                    ..MessageFields::default()
                },
                &Headers::new(),
            );
            span.in_scope(|| tracing::warn!("the carrier is slow"));
        });
        for expected in [
            "saga.step_key=\"order-7:arrange-shipment\"",
            "saga.tenant=\"acme\"",
            "saga.event_type=\"PaymentProcessed\"",
            "messaging.kafka.offset=17",
            "trace_id=4bf92f3577b34da6a3ce929d0e0e4736",
            "parent_span_id=00f067aa0ba902b7",
            "the carrier is slow",
        ] {
            assert!(line.contains(expected), "{expected} in {line}");
        }
    }

    #[test]
    fn a_log_line_escapes_hostile_text_and_leaves_out_what_only_opentelemetry_reads() {
        let line = logged(|| {
            let span = process_span(
                &MessageFields {
                    topic: "payments",
                    step_key: Some("k\nINFO forged:step"),
                    ..MessageFields::default()
                },
                &Headers::new(),
            );
            span.in_scope(|| {
                tracing::warn!(note = "a \"quoted\" word", error = %"bad\nthing", "one\rline");
            });
        });
        assert_eq!(line.lines().count(), 1, "{line}");
        for expected in [
            "saga.step_key=\"k\\nINFO forged:step\"",
            "messaging.destination.name=payments",
            "one\\rline",
            "note=\"a \\\"quoted\\\" word\"",
            "error=bad\\nthing",
        ] {
            assert!(line.contains(expected), "{expected} in {line}");
        }
        for left_out in ["otel.", "messaging.system", "messaging.operation.type"] {
            assert!(!line.contains(left_out), "{left_out} in {line}");
        }
    }

    #[test]
    fn a_span_carries_at_most_a_bounded_prefix_of_a_long_key() {
        // A key of a megabyte, of two-byte characters, so that the cut falls inside one.
        let key = "é".repeat(500_000) + "END";
        let line = logged(|| {
            let span = process_span(
                &MessageFields {
                    topic: "payments",
                    key: Some(key.as_bytes()),
                    ..MessageFields::default()
                },
                &Headers::new(),
            );
            span.in_scope(|| tracing::warn!("a message with a long key"));
        });
        let expected = format!(
            "messaging.kafka.message.key=\"{}…[truncated, {} bytes]\"",
            "é".repeat(MAX_KEY_BYTES_IN_SPAN / 2),
            key.len()
        );
        assert!(line.contains(&expected), "{line}");
        assert!(!line.contains("END"));
        assert!(line.len() < 1_000, "the line holds the bounded key only");
        assert_eq!(bounded_key(b"order-7"), "order-7", "short keys as they are");
    }
}
