//! The payment service as a process of its own, against a real broker: see `payment-service --help`.

use clap::Parser;
use saga_examples::service::{Service, ServiceArgs};

/// Runs the payment service of the example saga (consumer, outbox relay) until SIGTERM or Ctrl-C.
#[derive(Debug, Parser)]
#[command(name = "payment-service", version)]
struct Cli {
    #[command(flatten)]
    args: ServiceArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    saga_runtime::telemetry::init_tracing();
    let cli = Cli::parse();
    saga_examples::service::run(
        Service::Payment,
        cli.args,
        saga_runtime::shutdown::on_signal(),
    )
    .await
}
