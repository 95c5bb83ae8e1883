//! The order service as a process of its own, against a real broker: see `order-service --help`.

use clap::Parser;
use saga_examples::service::{Service, ServiceArgs};

/// Runs the order service of the example saga (consumer, outbox relay, HTTP API) until SIGTERM or Ctrl-C.
#[derive(Debug, Parser)]
#[command(name = "order-service", version)]
struct Cli {
    #[command(flatten)]
    args: ServiceArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    saga_runtime::telemetry::init_tracing();
    let cli = Cli::parse();
    saga_examples::service::run(
        Service::Order,
        cli.args,
        saga_runtime::shutdown::on_signal(),
    )
    .await
}
