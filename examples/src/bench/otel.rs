//! The cost of OpenTelemetry while spans are sampled out: the framework's consumer on librdkafka's mock
//! cluster, in alternating rounds over the same messages, one process without an OpenTelemetry layer and
//! one with (each round a fresh process, schema and consumer group).
//!
//! The messages carry a `traceparent` whose "sampled" flag is clear, as every message of a saga whose root
//! the sampler dropped does; the traced process runs OpenTelemetry's default sampler (parent-based), so
//! every step span is sampled out. Both processes are the same binary, built with the feature `otel`.

use saga_runtime::kafka::KafkaConfig;
use sqlx::PgPool;

use crate::bench::scale::{Worker, stop};
use crate::bench::{Progress, consumer, percentile};

/// The `traceparent` of the benchmark's messages: a valid context, not sampled.
pub const SAMPLED_OUT_PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";

/// A provider with OpenTelemetry's default sampler (parent-based; `OTEL_TRACES_SAMPLER` if set) and no
/// exporter, and the framework's OpenTelemetry layer over it. Keep the provider for the life of the
/// process.
pub fn layer<S>() -> (
    opentelemetry_sdk::trace::SdkTracerProvider,
    saga_runtime::telemetry::OtelLayer<S>,
)
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
    let layer =
        saga_runtime::telemetry::otel_layer(&provider, saga_runtime::trace::SampledOut::from_env());
    (provider, layer)
}

/// Throughput with and without tracing.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Figures {
    /// Each round's messages/s without the layer.
    pub without_msgs_per_s: Vec<f64>,
    /// Each round's messages/s with the layer (spans sampled out).
    pub with_msgs_per_s: Vec<f64>,
    /// The median with over the median without.
    pub ratio: f64,
    /// The spread of the rounds without the layer, (max - min) / median: how far apart two runs of the
    /// same thing land. An overhead smaller than this is within noise.
    pub noise: f64,
}

/// Runs `pools.len() / 2` pairs of consumer processes over the `count` messages already in `topic` (one
/// without the layer, one with, alternating), each in its own schema from `pools` (migrated, with a
/// `bench_effects` table).
#[allow(clippy::too_many_arguments)]
pub async fn figures(
    kafka: &KafkaConfig,
    database_url: &str,
    pools: &[(String, PgPool)],
    topic: &str,
    count: i64,
    batch_size: usize,
    concurrency: usize,
    progress: &Progress,
) -> anyhow::Result<Figures> {
    let mut figures = Figures::default();
    for (i, (schema, pool)) in pools.iter().enumerate() {
        let traced = i % 2 == 1;
        let worker = Worker {
            topic: topic.to_owned(),
            schema: schema.clone(),
            batch_size,
            group: format!("otel{i}"),
            concurrency,
            traced,
        };
        let child = worker.spawn(kafka, database_url)?;
        let measured = consumer::throughput(pool, "bench_effects", count, progress).await;
        stop(vec![child]).await;
        let per_s = measured?;
        progress.note(&format!(
            "otel round {}: {} {per_s:.0} msg/s",
            i / 2 + 1,
            if traced { "with the layer" } else { "without" }
        ));
        if traced {
            figures.with_msgs_per_s.push(per_s);
        } else {
            figures.without_msgs_per_s.push(per_s);
        }
    }
    let without = percentile(&mut figures.without_msgs_per_s.clone(), 0.5);
    let with = percentile(&mut figures.with_msgs_per_s.clone(), 0.5);
    figures.ratio = with / without;
    let (min, max) = figures
        .without_msgs_per_s
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
    figures.noise = (max - min) / without;
    Ok(figures)
}
