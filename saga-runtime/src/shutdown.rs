//! Graceful shutdown on SIGTERM or Ctrl-C.

use std::future::Future;

use tokio_util::sync::CancellationToken;

/// A token cancelled on the first SIGTERM or Ctrl-C (SIGINT). Pass it to `run` methods.
pub fn on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutdown signal received");
        cancel.cancel();
    });
    token
}

/// Resolves on the first SIGTERM or Ctrl-C.
pub async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Runs the work `start` returns, handing it a token that is cancelled when `shutdown` resolves, and
/// returns the work's result. The work stops on its own terms once the token fires (it finishes what it is
/// in); `shutdown` may be any future, as with axum's `with_graceful_shutdown`.
pub async fn run_until<Fut, T>(
    shutdown: impl Future<Output = ()> + Send,
    start: impl FnOnce(CancellationToken) -> Fut,
) -> T
where
    Fut: Future<Output = T>,
{
    let token = CancellationToken::new();
    let work = start(token.clone());
    tokio::pin!(work);
    tokio::select! {
        result = &mut work => result,
        () = shutdown => {
            token.cancel();
            work.await
        }
    }
}
