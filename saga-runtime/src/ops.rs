//! The ops endpoint: `/metrics` (Prometheus text format), `/healthz` (the process serves requests) and
//! `/readyz` (the process's components say they are ready).
//!
//! Readiness is a set of named checks ([`Ops::check`]): a consumer with its partitions assigned, an outbox
//! its writers may write, a relay connected. `/readyz` answers 200 when every *gating* check passes (503
//! naming those that do not); `/readyz/{check}` answers for one. A relay embedded in a service is not
//! gating: while it stands by or reconnects, the service's consumers and HTTP entry points carry on, so it
//! must not take them out of a load balancer; its own state is at `/readyz/relay`.

use std::collections::BTreeMap;
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

/// A readiness check's state: a flag its component sets, or a probe read when asked.
#[derive(Clone)]
enum CheckState {
    Flag(Arc<AtomicBool>),
    Probe(Arc<dyn Fn() -> bool + Send + Sync>),
}

impl CheckState {
    fn passes(&self) -> bool {
        match self {
            Self::Flag(flag) => flag.load(Ordering::Relaxed),
            Self::Probe(probe) => probe(),
        }
    }
}

#[derive(Clone)]
struct Check {
    gates: bool,
    state: CheckState,
}

/// One readiness check of a component, set by it (see [`Ops::check`]).
#[derive(Clone, Debug, Default)]
pub struct ReadyFlag(Arc<AtomicBool>);

impl ReadyFlag {
    /// Sets the check's state.
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::Relaxed);
    }

    /// Its state.
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Shared state of the ops endpoint: the metrics registry and the readiness checks.
#[derive(Clone, Default)]
pub struct Ops {
    registry: Arc<Mutex<Registry>>,
    checks: Arc<Mutex<BTreeMap<&'static str, Check>>>,
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

    fn checks(&self) -> std::sync::MutexGuard<'_, BTreeMap<&'static str, Check>> {
        self.checks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The readiness check `name` (registered, not passing, on first use; the same flag after): whether
    /// `/readyz` waits for it is `gates`.
    pub fn check(&self, name: &'static str, gates: bool) -> ReadyFlag {
        let mut checks = self.checks();
        let check = checks.entry(name).or_insert_with(|| Check {
            gates,
            state: CheckState::Flag(Arc::default()),
        });
        check.gates = gates;
        match &check.state {
            CheckState::Flag(flag) => ReadyFlag(flag.clone()),
            CheckState::Probe(_) => ReadyFlag::default(),
        }
    }

    /// A readiness check `name` read from `probe` when asked.
    pub fn probe(
        &self,
        name: &'static str,
        gates: bool,
        probe: impl Fn() -> bool + Send + Sync + 'static,
    ) {
        self.checks().insert(
            name,
            Check {
                gates,
                state: CheckState::Probe(Arc::new(probe)),
            },
        );
    }

    /// Whether ready: at least one gating check, and every one passes.
    pub fn is_ready(&self) -> bool {
        let checks = self.checks();
        let mut gating = checks.values().filter(|c| c.gates).peekable();
        gating.peek().is_some() && gating.all(|c| c.state.passes())
    }

    /// The gating checks that do not pass, by name.
    pub fn not_ready(&self) -> Vec<&'static str> {
        self.checks()
            .iter()
            .filter(|(_, c)| c.gates && !c.state.passes())
            .map(|(name, _)| *name)
            .collect()
    }

    /// Whether check `name` passes (`None`: no such check).
    pub fn is_check_ready(&self, name: &str) -> Option<bool> {
        self.checks().get(name).map(|c| c.state.passes())
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
            .route("/readyz/{check}", get(readyz_check))
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

    /// Whether ready (a consumer with its partitions assigned, an outbox writable, a relay connected).
    pub fn is_ready(&self) -> bool {
        self.0.is_ready()
    }

    /// Whether readiness check `name` passes (`consumer`, `outbox`, `relay`); `None`: no such check.
    pub fn is_check_ready(&self, name: &str) -> Option<bool> {
        self.0.is_check_ready(name)
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
        (StatusCode::OK, "ready".to_owned())
    } else {
        let failing = ops.not_ready();
        let body = if failing.is_empty() {
            "not ready: starting".to_owned()
        } else {
            format!("not ready: {}", failing.join(", "))
        };
        (StatusCode::SERVICE_UNAVAILABLE, body)
    }
}

async fn readyz_check(
    State(ops): State<Ops>,
    axum::extract::Path(check): axum::extract::Path<String>,
) -> impl IntoResponse {
    match ops.is_check_ready(&check) {
        Some(true) => (StatusCode::OK, "ready"),
        Some(false) => (StatusCode::SERVICE_UNAVAILABLE, "not ready"),
        None => (StatusCode::NOT_FOUND, "no such check"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_waits_for_every_gating_check_and_only_those() {
        let ops = Ops::new();
        assert!(!ops.is_ready(), "no check yet: starting");
        let consumer = ops.check("consumer", true);
        let relay = ops.check("relay", false);
        consumer.set(true);
        assert!(
            ops.is_ready(),
            "an embedded relay standing by does not gate"
        );
        assert_eq!(ops.is_check_ready("relay"), Some(false));
        relay.set(true);
        let writable = Arc::new(AtomicBool::new(false));
        let probe = writable.clone();
        ops.probe("outbox", true, move || probe.load(Ordering::Relaxed));
        assert!(!ops.is_ready());
        assert_eq!(ops.not_ready(), ["outbox"]);
        writable.store(true, Ordering::Relaxed);
        assert!(ops.is_ready());
        assert_eq!(ops.is_check_ready("nothing"), None);
        // The same name gives the same flag.
        ops.check("consumer", true).set(false);
        assert!(!consumer.get());
    }
}
