//! Tracing set-up for the framework's binaries: log lines on stderr and, with the feature `otel`, the
//! framework's spans ([`crate::trace`]) exported over OTLP.
//!
//! OpenTelemetry is configured by its standard variables: `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) turns the export on (OTLP over HTTP with protobuf, for example
//! `http://localhost:4318`), `OTEL_SERVICE_NAME` names the service, `OTEL_TRACES_SAMPLER` and its argument
//! choose the sampler, `OTEL_SDK_DISABLED=true` turns it off.

use std::fmt::Write as _;

/// Keeps the span exporter running; dropping it flushes the spans not yet exported and shuts the exporter
/// down. Hold it for the life of `main`.
#[must_use = "dropping the guard shuts the span exporter down"]
#[derive(Debug, Default)]
pub struct TracingGuard {
    #[cfg(feature = "otel")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Drop for TracingGuard {
    fn drop(&mut self) {
        #[cfg(feature = "otel")]
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            eprintln!("OpenTelemetry: could not flush the last spans: {e}");
        }
    }
}

/// Installs a `tracing` subscriber printing to stderr, filtered by `RUST_LOG` (default: `info`, with
/// librdkafka's own lines at `warn`), and, with the feature `otel` and an OTLP endpoint configured, an
/// OpenTelemetry layer exporting the spans. Does nothing if a subscriber is installed already.
pub fn init_tracing() -> TracingGuard {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;

    let registry = tracing_subscriber::registry()
        .with(env_filter())
        .with(log_lines());
    #[cfg(feature = "otel")]
    {
        let provider = otlp_provider();
        let layer = provider
            .as_ref()
            .map(|p| otel_layer(p, crate::trace::SampledOut::from_env()));
        if registry.with(layer).try_init().is_err() {
            return TracingGuard::default();
        }
        TracingGuard { provider }
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = registry.try_init();
        TracingGuard::default()
    }
}

/// The filter of [`init_tracing`]: `RUST_LOG`, else `info` with librdkafka's and sqlx's own lines at
/// `warn`.
pub fn env_filter() -> tracing_subscriber::EnvFilter {
    tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,librdkafka=warn,sqlx=warn"))
}

/// The log lines of [`init_tracing`], on stderr; coloured only when stderr is a terminal (escape codes
/// have no place in a log file, and formatting them costs CPU for every span).
pub fn log_lines<S>() -> tracing_subscriber::fmt::Layer<
    S,
    LogFields,
    tracing_subscriber::fmt::format::Format,
    fn() -> std::io::Stderr,
>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    use std::io::IsTerminal as _;
    tracing_subscriber::fmt::layer()
        .fmt_fields(LogFields)
        .with_writer(std::io::stderr as fn() -> std::io::Stderr)
        .with_ansi(std::io::stderr().is_terminal())
}

/// How [`log_lines`] writes the fields of spans and events: `name=value`, text quoted and escaped as
/// `Debug` writes it, the event's message first and bare, and every control character escaped wherever it
/// comes from (a newline in a hostile key or error cannot start a forged log line). It leaves out what only
/// OpenTelemetry reads (`otel.*`) and the semantic conventions' constants (`messaging.system`,
/// `messaging.operation.type`), and writes plain text without going through `Debug`: the runtime opens a span
/// per consumed message, and formatting its fields is the largest cost of a log layer.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogFields;

/// Fields a log line leaves out (see [`LogFields`]).
fn left_out_of_log_lines(name: &str) -> bool {
    name.starts_with("otel.") || name == "messaging.system" || name == "messaging.operation.type"
}

impl<'writer> tracing_subscriber::fmt::FormatFields<'writer> for LogFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        writer: tracing_subscriber::fmt::format::Writer<'writer>,
        fields: R,
    ) -> std::fmt::Result {
        let mut visitor = LogVisitor {
            writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct LogVisitor<'writer> {
    writer: tracing_subscriber::fmt::format::Writer<'writer>,
    first: bool,
    result: std::fmt::Result,
}

impl LogVisitor<'_> {
    /// Writes a number or a flag as it is.
    fn record_number(&mut self, field: &tracing::field::Field, value: impl std::fmt::Display) {
        if self.start(field.name()) {
            self.result = write!(self.writer, "{value}");
        }
    }

    /// Writes the separator and `name=` (nothing for the message); `false` if the field is left out.
    fn start(&mut self, name: &str) -> bool {
        if self.result.is_err() || left_out_of_log_lines(name) {
            return false;
        }
        if !self.first {
            self.result = self.writer.write_char(' ');
        }
        self.first = false;
        if name != "message" && self.result.is_ok() {
            self.result = self
                .writer
                .write_str(name)
                .and_then(|()| self.writer.write_char('='));
        }
        self.result.is_ok()
    }
}

impl tracing::field::Visit for LogVisitor<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if !self.start(field.name()) {
            return;
        }
        let plain = || {
            value
                .bytes()
                .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
        };
        self.result = if field.name() == "message" {
            EscapingControls(&mut self.writer).write_str(value)
        } else if plain() {
            self.writer
                .write_char('"')
                .and_then(|()| self.writer.write_str(value))
                .and_then(|()| self.writer.write_char('"'))
        } else {
            write!(self.writer, "{value:?}")
        };
    }

    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        self.record_number(field, value);
    }

    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.record_number(field, value);
    }

    fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
        self.record_number(field, value);
    }

    fn record_error(
        &mut self,
        field: &tracing::field::Field,
        value: &(dyn std::error::Error + 'static),
    ) {
        if self.start(field.name()) {
            self.result = write!(self.writer, "{:?}", value.to_string());
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if self.start(field.name()) {
            self.result = write!(EscapingControls(&mut self.writer), "{value:?}");
        }
    }
}

/// Writes text through, control characters escaped (`\n`, `\u{1b}`): a value shown with `%` or `?` cannot
/// break a log line or forge another.
struct EscapingControls<'a, W>(&'a mut W);

impl<W: std::fmt::Write> std::fmt::Write for EscapingControls<'_, W> {
    fn write_str(&mut self, text: &str) -> std::fmt::Result {
        if !text.chars().any(char::is_control) {
            return self.0.write_str(text);
        }
        text.chars().try_for_each(|c| {
            if c.is_control() {
                write!(self.0, "{}", c.escape_debug())
            } else {
                self.0.write_char(c)
            }
        })
    }
}

/// The layer of [`otel_layer`]: tracing-opentelemetry's, behind the filter that keeps sampled-out spans
/// away from it.
#[cfg(feature = "otel")]
pub type OtelLayer<S> = tracing_subscriber::filter::Filtered<
    tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>,
    crate::trace::SampledOutFilter,
    S,
>;

/// The layer turning the framework's `tracing` spans into OpenTelemetry spans of `provider`, for a service
/// that installs its own subscriber. `sampled_out` says which spans `provider`'s sampler drops
/// ([`crate::trace::SampledOut::from_env`] when the sampler comes from `OTEL_TRACES_SAMPLER`): those are
/// not built at all, which is most of what tracing costs while spans are sampled out.
#[cfg(feature = "otel")]
pub fn otel_layer<S>(
    provider: &opentelemetry_sdk::trace::SdkTracerProvider,
    sampled_out: crate::trace::SampledOut,
) -> OtelLayer<S>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    use opentelemetry::trace::TracerProvider as _;
    use tracing_subscriber::Layer as _;
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("saga-exactly-once"))
        // What costs on every span and poll but no one reads: source locations, busy/idle times, the
        // target attribute, and making the span's context the thread's current one on every entry (the
        // framework hands contexts on explicitly).
        .with_location(false)
        .with_threads(false)
        .with_tracked_inactivity(false)
        .with_target(false)
        .with_context_activation(false)
        .with_filter(crate::trace::SampledOutFilter(sampled_out))
}

/// A provider exporting over OTLP/HTTP, if the environment asks for one (an OTLP endpoint set, the SDK not
/// disabled). A configuration the exporter cannot use is reported on stderr, and spans stay local.
#[cfg(feature = "otel")]
fn otlp_provider() -> Option<opentelemetry_sdk::trace::SdkTracerProvider> {
    let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
    let disabled =
        std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim().eq_ignore_ascii_case("true"));
    if disabled
        || !(set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    {
        return None;
    }
    match opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
    {
        Ok(exporter) => Some(
            opentelemetry_sdk::trace::SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .build(),
        ),
        Err(e) => {
            eprintln!("OpenTelemetry: cannot export spans over OTLP: {e}");
            None
        }
    }
}
