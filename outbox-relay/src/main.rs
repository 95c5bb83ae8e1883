//! The `outbox-relay` binary: see `outbox-relay --help`.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    outbox_relay::main().await
}
