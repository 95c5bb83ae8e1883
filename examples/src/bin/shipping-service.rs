//! The shipping service as a process of its own, against a real broker: see `shipping-service --help`.

use clap::Parser;
use saga_examples::service::{Service, ServiceArgs};

/// Runs the shipping service of the example saga (consumer, outbox relay) until SIGTERM or Ctrl-C.
#[derive(Debug, Parser)]
#[command(name = "shipping-service", version)]
struct Cli {
    #[command(flatten)]
    args: ServiceArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    saga_runtime::telemetry::init_tracing();
    let cli = Cli::parse();
    saga_examples::service::run(
        Service::Shipping,
        cli.args,
        saga_runtime::shutdown::on_signal(),
    )
    .await
}
