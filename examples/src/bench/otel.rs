//! The cost of tracing with OpenTelemetry while every span is sampled out: the framework's consumer on
//! librdkafka's mock cluster, with and without an OpenTelemetry layer whose sampler drops everything, in
//! alternating rounds over the same messages (each round a fresh schema and consumer group).
//!
//! The layer is in saga-bench's subscriber from the start ([`layer`]), behind a switch ([`set_tracing`]):
//! with it off, the layer sees no span, as if it were not installed.

use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use saga_runtime::kafka::KafkaConfig;
use sqlx::PgPool;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::FilterFn;
use tracing_subscriber::registry::LookupSpan;

use crate::bench::{Progress, consumer, percentile};

/// Whether the OpenTelemetry layer sees spans.
static TRACING: AtomicBool = AtomicBool::new(false);

/// Turns the OpenTelemetry layer of [`layer`] on or off.
pub fn set_tracing(on: bool) {
    TRACING.store(on, Ordering::SeqCst);
}

/// A provider whose sampler drops every span (`AlwaysOff`), and the framework's OpenTelemetry layer over
/// it, seeing spans only while [`set_tracing`] says so. Keep the provider for the life of the program.
pub fn layer<S>() -> (SdkTracerProvider, impl Layer<S>)
where
    S: tracing::Subscriber + for<'span> LookupSpan<'span>,
{
    let provider = SdkTracerProvider::builder()
        .with_sampler(Sampler::AlwaysOff)
        .build();
    let layer = saga_runtime::telemetry::otel_layer(&provider)
        .with_filter(FilterFn::new(|_| TRACING.load(Ordering::Relaxed)));
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

/// Runs `rounds` pairs of consumer runs over the `count` messages already in `topic` (one run without the
/// layer, one with, alternating), each in its own pool from `pools` (2 × `rounds`, migrated, with a
/// `bench_effects` table).
pub async fn figures(
    kafka: &KafkaConfig,
    pools: &[PgPool],
    topic: &str,
    count: i64,
    batch_size: usize,
    concurrency: usize,
    progress: &Progress,
) -> anyhow::Result<Figures> {
    let mut figures = Figures::default();
    for (i, pool) in pools.iter().enumerate() {
        let traced = i % 2 == 1;
        set_tracing(traced);
        let group = format!("otel{i}");
        let consumer =
            consumer::measured_consumer(kafka, pool, topic, &group, batch_size, concurrency)
                .build()?;
        let per_s = consumer::run_until(consumer, pool, count, progress).await?;
        set_tracing(false);
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
