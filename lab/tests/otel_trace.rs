//! One order through the example saga, traced with OpenTelemetry into the SDK's in-memory exporter: one
//! trace from the client's `traceparent` to the last step, with the parent chain HTTP request →
//! process-payment → arrange-shipment → complete-order (and mark-order-paid beside arrange-shipment), and
//! the relay's publish spans linked to the span that wrote each row.

use opentelemetry::trace::{SpanId, SpanKind, TraceId};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use saga_core::TraceParent;
use saga_lab::harness::client::send;
use saga_lab::harness::local::{LocalSaga, WAIT};
use saga_lab::harness::run::{PlannedOrder, plan};
use saga_runtime::trace::SampledOut;
use saga_test_support::wait_until;
use tracing_subscriber::layer::SubscriberExt;

fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

/// The process span of `step`.
fn step_span<'a>(spans: &'a [SpanData], step: &str) -> Option<&'a SpanData> {
    spans
        .iter()
        .find(|s| attribute(s, "saga.step").as_deref() == Some(step))
}

/// Places one happy-path order of run `run` as a client whose span is `client`; asserts it was accepted.
async fn place_order(saga: &LocalSaga, run: &str, client: TraceParent) -> PlannedOrder {
    let order = plan(run, 1).remove(0);
    let header = client.to_string();
    let body = serde_json::to_vec(&order.request).unwrap();
    let answer = send(
        saga.api(),
        "POST",
        "/orders",
        &[
            ("idempotency-key", order.key.as_str()),
            ("traceparent", header.as_str()),
        ],
        Some(body),
    )
    .await
    .unwrap();
    assert_eq!(answer.status, 201, "{}", answer.body);
    order
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_order_is_one_trace_from_the_http_request_to_the_last_step() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    // The framework's layer, told of the provider's sampler: OpenTelemetry's default, parent-based.
    let layer = saga_runtime::telemetry::otel_layer(&provider, SampledOut::ChildrenOfSampledOut);
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer)).unwrap();

    let saga = LocalSaga::start("otel-trace").await;
    let client = TraceParent::new_root();
    let order = place_order(&saga, "otel", client).await;
    saga.wait_finished(1).await;

    let trace_id = TraceId::from_bytes(client.trace_id.to_be_bytes());
    // Every step's span: the order can be finished (complete-order) before mark-order-paid, which reads
    // another topic, has run.
    let steps = [
        "process-payment",
        "mark-order-paid",
        "arrange-shipment",
        "complete-order",
    ];
    let spans = wait_until("every step's span", WAIT, || async {
        let spans: Vec<SpanData> = exporter.get_finished_spans().unwrap();
        steps
            .iter()
            .all(|step| step_span(&spans, step).is_some())
            .then_some(spans)
    })
    .await;
    let in_trace: Vec<SpanData> = spans
        .iter()
        .filter(|s| s.span_context.trace_id() == trace_id)
        .cloned()
        .collect();

    let http = in_trace
        .iter()
        .find(|s| s.span_kind == SpanKind::Server)
        .expect("the HTTP span is in the client's trace");
    assert_eq!(http.name, "POST /orders");
    assert_eq!(
        http.parent_span_id,
        SpanId::from_bytes(client.parent_id.to_be_bytes()),
        "the HTTP span is the child of the client's span"
    );
    assert_eq!(
        attribute(http, "http.response.status_code").as_deref(),
        Some("201")
    );
    let chain = [
        ("process-payment", http.span_context.span_id()),
        (
            "mark-order-paid",
            step_span(&in_trace, "process-payment")
                .expect("process-payment is in the trace")
                .span_context
                .span_id(),
        ),
        (
            "arrange-shipment",
            step_span(&in_trace, "process-payment")
                .unwrap()
                .span_context
                .span_id(),
        ),
        (
            "complete-order",
            step_span(&in_trace, "arrange-shipment")
                .expect("arrange-shipment is in the trace")
                .span_context
                .span_id(),
        ),
    ];
    for (step, parent) in chain {
        let span = step_span(&in_trace, step).unwrap_or_else(|| {
            panic!("{step} is in the client's trace: {in_trace:#?}");
        });
        assert_eq!(span.parent_span_id, parent, "{step}'s parent");
        assert_eq!(span.span_kind, SpanKind::Consumer, "{step}");
        assert_eq!(
            attribute(span, "messaging.system").as_deref(),
            Some("kafka")
        );
        assert_eq!(
            attribute(span, "saga.step_key"),
            Some(format!("{}:{step}", order.key)),
        );
        assert_eq!(
            span.name,
            format!(
                "process {}",
                attribute(span, "messaging.destination.name").unwrap()
            )
        );
        assert!(
            attribute(span, "messaging.kafka.offset").is_some(),
            "{step}"
        );
        assert!(
            attribute(span, "messaging.consumer.group.name").is_some(),
            "{step}"
        );
    }

    // The relay published each writer's row in a publish span linked to the writer.
    for writer in ["create-order", "process-payment", "arrange-shipment"] {
        let writer_id = if writer == "create-order" {
            http.span_context.span_id()
        } else {
            step_span(&in_trace, writer).unwrap().span_context.span_id()
        };
        let published = spans.iter().any(|s| {
            s.span_kind == SpanKind::Producer
                && s.links.iter().any(|l| {
                    l.span_context.trace_id() == trace_id && l.span_context.span_id() == writer_id
                })
                && attribute(s, "messaging.kafka.offset").is_some()
        });
        assert!(
            published,
            "a publish span with an offset links to {writer}'s span"
        );
    }

    // A second order whose client sampled its trace out: the whole saga stays sampled out (every hop
    // hands the flag on), so no span of its trace is exported, and it still completes.
    let unsampled = TraceParent {
        flags: 0,
        ..TraceParent::new_root()
    };
    place_order(&saga, "otel-unsampled", unsampled).await;
    saga.wait_finished(2).await;
    // The last step's span closes just after its commit: give it the time to.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let _ = provider.force_flush();
    let unsampled_id = TraceId::from_bytes(unsampled.trace_id.to_be_bytes());
    let exported: Vec<SpanData> = exporter
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| s.span_context.trace_id() == unsampled_id)
        .collect();
    assert!(
        exported.is_empty(),
        "no span of a sampled-out saga is exported: {exported:#?}"
    );
    // Meanwhile the exporter recorded the relay's publish spans of that saga's rows (roots of their own,
    // sampled), linked to its context, which still says "not sampled".
    let linked_unsampled = exporter
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| s.span_kind == SpanKind::Producer)
        .flat_map(|s| s.links.links)
        .filter(|l| l.span_context.trace_id() == unsampled_id)
        .map(|l| l.span_context.is_sampled())
        .collect::<Vec<_>>();
    assert!(
        !linked_unsampled.is_empty() && linked_unsampled.iter().all(|sampled| !sampled),
        "publish spans link to the sampled-out saga's context, flag clear: {linked_unsampled:?}"
    );
    saga.stop().await;
    drop(provider);
}
