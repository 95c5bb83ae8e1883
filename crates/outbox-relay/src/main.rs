//! The `outbox-relay` binary: see `outbox_relay::cli`.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    saga_runtime::telemetry::init_tracing();
    let cli = outbox_relay::cli::Cli::parse();
    cli.execute(saga_runtime::shutdown::on_signal()).await
}
