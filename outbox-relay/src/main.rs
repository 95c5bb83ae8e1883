//! The `outbox-relay` binary: see `outbox_relay::cli`.

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    saga_runtime::telemetry::init_tracing();
    let cli: outbox_relay::cli::Cli = saga_runtime::cli::parse();
    saga_runtime::cli::exit_code(cli.execute(saga_runtime::shutdown::on_signal()).await)
}
