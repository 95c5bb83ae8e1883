//! Tracing set-up for the framework's binaries.

/// Installs a `tracing` subscriber printing to stderr, filtered by `RUST_LOG` (default: `info`, with
/// librdkafka's own lines at `warn`). Does nothing if one is installed already.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,librdkafka=warn,sqlx=warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
