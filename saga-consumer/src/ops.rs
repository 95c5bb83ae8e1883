//! A service's metrics and readiness, read from code (tests, dashboards of one's own, the benchmark).

/// A handle on a running service's (or consumer's) ops state: its Prometheus metrics and its readiness,
/// as `/metrics` and `/readyz` serve them. Cheap to clone.
#[derive(Clone)]
pub struct OpsHandle(saga_runtime::ops::OpsHandle);

impl std::fmt::Debug for OpsHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpsHandle")
            .field("ready", &self.is_ready())
            .finish()
    }
}

impl OpsHandle {
    pub(crate) fn new(handle: saga_runtime::ops::OpsHandle) -> Self {
        Self(handle)
    }

    /// The metrics in Prometheus's text format, as `/metrics` serves them.
    pub fn render(&self) -> String {
        self.0.render()
    }

    /// Whether the service is ready (connected and consuming, its outbox writable), as `/readyz` says.
    pub fn is_ready(&self) -> bool {
        self.0.is_ready()
    }

    /// Whether readiness check `name` passes, as `/readyz/{name}` says: `consumer` (partitions assigned),
    /// `outbox` (its writers may write: in WAL mode, its slot is there), `relay` (the embedded relay reads
    /// or stands by; it does not gate `/readyz`). `None`: no such check.
    pub fn is_check_ready(&self, name: &str) -> Option<bool> {
        self.0.is_check_ready(name)
    }

    /// The value of metric `name` with label set `labels` (as in the Prometheus text: `step="charge"`, or
    /// empty for none), if the service exposes it.
    pub fn sample(&self, name: &str, labels: &str) -> Option<f64> {
        self.0.sample(name, labels)
    }
}
