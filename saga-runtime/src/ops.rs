//! The ops endpoint: `/metrics` (Prometheus text format), `/healthz` (the process serves requests) and
//! `/readyz` (the component says it is ready, for example a consumer with its partitions assigned).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::text::encode;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

/// Shared state of the ops endpoint: the metrics registry and the readiness flag.
#[derive(Clone, Default)]
pub struct Ops {
    registry: Arc<Mutex<Registry>>,
    ready: Arc<AtomicBool>,
}

impl std::fmt::Debug for Ops {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ops")
            .field("ready", &self.is_ready())
            .finish_non_exhaustive()
    }
}

impl Ops {
    /// An empty registry, not ready.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers metrics: `f` receives the registry.
    pub fn register(&self, f: impl FnOnce(&mut Registry)) {
        f(&mut self.registry.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Sets readiness.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    /// Whether ready.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// The metrics in Prometheus text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &registry);
        out
    }

    /// A read-only handle on this state: the metrics text and the readiness.
    pub fn handle(&self) -> OpsHandle {
        OpsHandle(self.clone())
    }

    /// The endpoint's routes, to mount into an application's own router or serve with [`Ops::serve`].
    pub fn router(&self) -> Router {
        Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(|| async { "ok" }))
            .route("/readyz", get(readyz))
            .with_state(self.clone())
    }

    /// Serves the endpoint on `addr` until `shutdown` is cancelled. Returns the bound address (useful with
    /// port 0) once listening.
    pub async fn serve(
        &self,
        addr: SocketAddr,
        shutdown: CancellationToken,
    ) -> std::io::Result<SocketAddr> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let bound = listener.local_addr()?;
        let router = self.router();
        tokio::spawn(async move {
            let result = axum::serve(listener, router)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await;
            if let Err(e) = result {
                tracing::error!(error = %e, "ops endpoint stopped");
            }
        });
        Ok(bound)
    }
}

/// The ops state of a running consumer or relay, read-only: its metrics in the Prometheus text format and
/// its readiness (what `/metrics` and `/readyz` serve).
#[derive(Clone, Debug)]
pub struct OpsHandle(Ops);

impl OpsHandle {
    /// The metrics, in the Prometheus text format.
    pub fn render(&self) -> String {
        self.0.render()
    }

    /// Whether ready (a consumer with its partitions assigned, a relay connected).
    pub fn is_ready(&self) -> bool {
        self.0.is_ready()
    }

    /// The value of the sample `name{labels}` (labels as in the text format, `step="charge"`; empty for
    /// none), if present.
    pub fn sample(&self, name: &str, labels: &str) -> Option<f64> {
        let prefix = if labels.is_empty() {
            format!("{name} ")
        } else {
            format!("{name}{{{labels}}} ")
        };
        self.render()
            .lines()
            .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
    }
}

async fn metrics(State(ops): State<Ops>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        ops.render(),
    )
}

async fn readyz(State(ops): State<Ops>) -> impl IntoResponse {
    if ops.is_ready() {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    }
}
