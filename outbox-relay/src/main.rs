//! The `outbox-relay` binary: see `outbox-relay --help`.

/// mimalloc, not the system's allocator: with glibc's malloc, allocation was about a quarter of the
/// consumer's own CPU (docs/guide/deployment.md).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    outbox_relay::main().await
}
