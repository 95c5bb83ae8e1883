//! `saga`: see and repair sagas (see `saga --help`).

#[tokio::main]
async fn main() -> std::process::ExitCode {
    saga_admin::main().await
}
