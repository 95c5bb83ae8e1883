//! Tracing set-up for a service's `main`: log lines on stderr and, with the feature `otel`, the framework's
//! spans exported over OTLP (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME`).
//!
//! ```no_run
//! # async fn run() {}
//! # async fn main_() {
//! let _tracing = saga_consumer::telemetry::init_tracing(); // flushes the last spans when dropped
//! run().await;
//! # }
//! ```

#[cfg(feature = "otel")]
pub use saga_config::SampledOut;

/// Keeps the span exporter running; dropping it flushes the spans not yet exported and shuts the exporter
/// down. Hold it for the life of `main`.
#[must_use = "dropping the guard shuts the span exporter down"]
#[derive(Debug)]
pub struct TracingGuard {
    _exporter: saga_runtime::telemetry::TracingGuard,
}

/// Installs a `tracing` subscriber printing to stderr, filtered by `RUST_LOG` (default: `info`, with
/// librdkafka's own lines at `warn`), and, with the feature `otel` and an OTLP endpoint configured, an
/// OpenTelemetry layer exporting the spans. Does nothing if a subscriber is installed already.
pub fn init_tracing() -> TracingGuard {
    TracingGuard {
        _exporter: saga_runtime::telemetry::init_tracing(),
    }
}

/// The layer turning the framework's `tracing` spans into OpenTelemetry spans of `provider`, for a service
/// that installs its own subscriber. `sampled_out` says which spans `provider`'s sampler drops
/// ([`SampledOut::from_env`] when the sampler comes from `OTEL_TRACES_SAMPLER`): those are not built at
/// all, which is most of what tracing costs while spans are sampled out.
#[cfg(feature = "otel")]
pub fn otel_layer<S>(
    provider: &opentelemetry_sdk::trace::SdkTracerProvider,
    sampled_out: SampledOut,
) -> impl tracing_subscriber::Layer<S> + Send + Sync + 'static
where
    S: tracing::Subscriber
        + for<'span> tracing_subscriber::registry::LookupSpan<'span>
        + Send
        + Sync
        + 'static,
{
    saga_runtime::telemetry::otel_layer(provider, sampled_out)
}
