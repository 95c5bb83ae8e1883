//! The shipping service as a process of its own, against a real broker: see `shipping-service --help`.

use saga_examples::service::Service;

/// mimalloc, not the system's allocator: with glibc's malloc, allocation was about a quarter of the
/// consumer's own CPU (docs/guide/deployment.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    saga_consumer::setup::exit_code(saga_examples::service::main(
        Service::Shipping,
        "Runs the shipping service of the example saga (consumer, outbox relay) until SIGTERM or Ctrl-C.",
    )
    .await)
}
