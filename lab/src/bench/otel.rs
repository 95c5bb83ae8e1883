//! The cost of OpenTelemetry while spans are sampled out: the framework's consumer on librdkafka's mock
//! cluster, in rounds over the same messages, each a fresh process, schema and consumer group, in turn:
//! without an OpenTelemetry layer; with the framework's layer (sampled-out spans never built); and with the
//! layer told nothing of the sampler (every span built, then dropped by the sampler), which shows what not
//! building them saves.
//!
//! The messages carry a `traceparent` whose "sampled" flag is clear, as every message of a saga whose root
//! the sampler dropped does; the traced processes run OpenTelemetry's default sampler (parent-based), so
//! every step span is sampled out. All are the same binary, built with the feature `otel`.

use saga_runtime::kafka::KafkaConfig;
use saga_runtime::trace::SampledOut;
use sqlx::PgPool;

use crate::bench::scale::Worker;
use crate::bench::{Progress, percentile};

/// The `traceparent` of the benchmark's messages: a valid context, not sampled.
pub const SAMPLED_OUT_PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";

/// How a worker process traces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tracing {
    /// No OpenTelemetry layer.
    Off,
    /// The framework's layer, told that the sampler is parent-based: sampled-out spans are not built.
    Layer,
    /// The layer told nothing of the sampler ([`SampledOut::Undecided`]): every span is built, then
    /// dropped by the sampler.
    Built,
}

impl Tracing {
    /// The name in a worker's argument.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Layer => "layer",
            Self::Built => "built",
        }
    }

    /// Reads [`Tracing::as_str`] back.
    pub fn parse(name: &str) -> anyhow::Result<Self> {
        [Self::Off, Self::Layer, Self::Built]
            .into_iter()
            .find(|t| t.as_str() == name)
            .ok_or_else(|| {
                anyhow::anyhow!("unknown tracing {name:?}: expected off, layer or built")
            })
    }

    /// What the layer is told of the sampler; `None`: no layer.
    pub fn sampled_out(self) -> Option<SampledOut> {
        match self {
            Self::Off => None,
            Self::Layer => Some(SampledOut::ChildrenOfSampledOut),
            Self::Built => Some(SampledOut::Undecided),
        }
    }
}

/// A provider with OpenTelemetry's default sampler (parent-based, roots always on) and no exporter, and
/// the framework's OpenTelemetry layer over it, told `sampled_out`. Keep the provider for the life of the
/// process.
pub fn layer<S>(
    sampled_out: SampledOut,
) -> (
    opentelemetry_sdk::trace::SdkTracerProvider,
    saga_runtime::telemetry::OtelLayer<S>,
)
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_sampler(opentelemetry_sdk::trace::Sampler::ParentBased(Box::new(
            opentelemetry_sdk::trace::Sampler::AlwaysOn,
        )))
        .build();
    let layer = saga_runtime::telemetry::otel_layer(&provider, sampled_out);
    (provider, layer)
}

/// Throughput with and without tracing.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Figures {
    /// Each round's messages/s without the layer.
    pub without_msgs_per_s: Vec<f64>,
    /// Each round's messages/s with the framework's layer (spans sampled out, not built).
    pub with_msgs_per_s: Vec<f64>,
    /// Each round's messages/s with the layer told nothing of the sampler (spans built, then dropped).
    pub built_msgs_per_s: Vec<f64>,
    /// The median with the layer over the median without.
    pub ratio: f64,
    /// The median with spans built over the median without.
    pub built_ratio: f64,
    /// The spread of the rounds without the layer, (max - min) / median: how far apart two runs of the
    /// same thing land. An overhead smaller than this is within noise.
    pub noise: f64,
}

/// Runs `pools.len() / 3` rounds of consumer processes over the `count` messages already in `topic`
/// (without the layer, with it, with spans built, in turn), each in its own schema from `pools` (migrated,
/// with a `bench_effects` table).
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
    let turns = [Tracing::Off, Tracing::Layer, Tracing::Built];
    for (i, (schema, pool)) in pools.iter().enumerate() {
        let tracing = turns[i % turns.len()];
        let worker = Worker {
            topic: topic.to_owned(),
            schema: schema.clone(),
            batch_size,
            group: format!("otel{i}"),
            concurrency,
            key_concurrency: 1,
            tracing,
        };
        let per_s = worker
            .throughput(1, kafka, database_url, pool, count, progress)
            .await?;
        progress.note(&format!(
            "otel round {}: {} {per_s:.0} msg/s",
            i / turns.len() + 1,
            match tracing {
                Tracing::Off => "without a layer",
                Tracing::Layer => "with the layer",
                Tracing::Built => "with spans built",
            }
        ));
        match tracing {
            Tracing::Off => figures.without_msgs_per_s.push(per_s),
            Tracing::Layer => figures.with_msgs_per_s.push(per_s),
            Tracing::Built => figures.built_msgs_per_s.push(per_s),
        }
    }
    let median = |v: &[f64]| percentile(&mut v.to_vec(), 0.5);
    let without = median(&figures.without_msgs_per_s);
    figures.ratio = median(&figures.with_msgs_per_s) / without;
    figures.built_ratio = median(&figures.built_msgs_per_s) / without;
    let (min, max) = figures
        .without_msgs_per_s
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
    figures.noise = (max - min) / without;
    Ok(figures)
}
