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

use saga_core::{Headers, TraceParent};
use tracing::Span;

/// The span of an HTTP request served by the `Idempotency-Key` layer (kind server), named
/// `{method} {route}` (`{method}` when the route is unknown). Records `http.response.status_code` and
/// `saga.step_key` later.
pub fn http_span(method: &http::Method, route: Option<&str>) -> Span {
    let name = match route {
        Some(route) => format!("{method} {route}"),
        None => method.to_string(),
    };
    tracing::info_span!(
        "http.request",
        otel.name = %name,
        otel.kind = "server",
        http.request.method = %method,
        http.route = route,
        http.response.status_code = tracing::field::Empty,
        saga.step_key = tracing::field::Empty,
    )
}

/// The span of a consumed message (kind consumer), named `process {topic}`. Records the step, the step
/// key, the tenant, the event type and the outcome later.
pub fn process_span(
    topic: &str,
    partition: i32,
    offset: i64,
    key: Option<&[u8]>,
    group: &str,
) -> Span {
    tracing::info_span!(
        "saga.message",
        otel.name = %format_args!("process {topic}"),
        otel.kind = "consumer",
        messaging.system = "kafka",
        messaging.operation.type = "process",
        messaging.destination.name = %topic,
        messaging.destination.partition.id = partition,
        messaging.kafka.offset = offset,
        messaging.kafka.message.key = key.map(String::from_utf8_lossy).as_deref(),
        messaging.consumer.group.name = %group,
        saga.step = tracing::field::Empty,
        saga.step_key = tracing::field::Empty,
        saga.tenant = tracing::field::Empty,
        saga.event_type = tracing::field::Empty,
        saga.outcome = tracing::field::Empty,
        trace_id = tracing::field::Empty,
        parent_span_id = tracing::field::Empty,
    )
}

/// The span of the relay publishing an outbox row (kind producer), named `publish {topic}`, linked to the
/// context of the transaction that wrote the row (its `traceparent` header pair). Records the partition
/// and offset once the broker acknowledges. Without the feature `otel`, a disabled span: the relay
/// publishes thousands of rows a second and logs batches, not rows.
pub fn publish_span(topic: &str, key: Option<&str>, headers: &[(String, String)]) -> Span {
    #[cfg(feature = "otel")]
    {
        let span = tracing::info_span!(
            "outbox.publish",
            otel.name = %format_args!("publish {topic}"),
            otel.kind = "producer",
            messaging.system = "kafka",
            messaging.operation.type = "send",
            messaging.destination.name = %topic,
            messaging.kafka.message.key = key,
            messaging.destination.partition.id = tracing::field::Empty,
            messaging.kafka.offset = tracing::field::Empty,
        );
        otel::link(&span, &otel::Pairs(headers));
        span
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = (topic, key, headers);
        Span::none()
    }
}

/// Makes `span` the child of the trace context in a message's `headers`, if they carry one.
pub fn continue_from_message(span: &Span, headers: &Headers) {
    #[cfg(feature = "otel")]
    otel::continue_from(span, &otel::MessageHeaders(headers));
    #[cfg(not(feature = "otel"))]
    let _ = (span, headers);
}

/// Makes `span` the child of the trace context in an HTTP request's `headers`, if they carry one.
pub fn continue_from_http(span: &Span, headers: &http::HeaderMap) {
    #[cfg(feature = "otel")]
    otel::continue_from(span, &otel::HttpHeaders(headers));
    #[cfg(not(feature = "otel"))]
    let _ = (span, headers);
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
            let span = process_span("payments", 2, 41, Some(b"order-7"), "shipping");
            continue_from_message(&span, &headers);
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
    fn without_an_opentelemetry_layer_there_is_no_span_context() {
        let span = process_span("payments", 0, 0, None, "g");
        continue_from_message(&span, &Headers::new());
        assert_eq!(span_context(&span), None);
    }
}
