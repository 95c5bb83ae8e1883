//! The relay's Prometheus metrics.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The relay's metrics, cheap to clone.
#[derive(Clone)]
pub(crate) struct RelayMetrics {
    /// Rows the broker acknowledged.
    pub published: Counter,
    /// Rows whose publication failed (they are retried).
    pub failures: Counter,
    /// Rows parked because the broker refuses them for good.
    pub parked: Counter,
    /// Parked rows in the outbox (sampled).
    pub parked_rows: Gauge,
    /// Unpublished rows (sampled).
    pub backlog: Gauge,
    /// Age in seconds of the oldest unpublished row (sampled).
    pub oldest_age_seconds: Gauge,
    /// Shards this instance owns.
    pub owned_shards: Gauge,
    /// Seconds from a row's write (its transaction's commit, for short transactions) to the broker's
    /// acknowledgement.
    pub commit_to_ack_seconds: Histogram,
    /// WAL mode: 1 while this relay reads the slot, 0 while it stands by for another.
    pub wal_active: Gauge,
    /// WAL mode: bytes of write-ahead log between the server's position and what the relay confirmed
    /// (sampled).
    pub wal_lag_bytes: Gauge,
    /// WAL mode: how far behind the relay's confirmations are, in seconds (the server's `replay_lag`;
    /// sampled).
    pub wal_lag_seconds: Gauge,
    /// WAL mode: 1 while this relay waits at the switch's fence (rows of the table outbox unpublished, or a
    /// writer in table mode running) before it reads the slot.
    pub wal_fenced: Gauge,
    /// WAL mode: keys held behind parked events (their later events are parked behind them).
    pub wal_held_keys: Gauge,
    /// The latest commit-to-acknowledgement latencies in seconds (at most [`LATENCY_SAMPLES`]), for
    /// [`crate::RelayProbe::commit_to_ack`].
    pub latencies: Arc<Mutex<VecDeque<f64>>>,
}

/// How many latencies [`RelayMetrics::latencies`] keeps.
pub(crate) const LATENCY_SAMPLES: usize = 200_000;

impl RelayMetrics {
    /// Records the commit-to-acknowledgement latencies of a batch.
    pub(crate) fn observe_commit_to_ack(&self, seconds: impl Iterator<Item = f64>) {
        let mut kept = self
            .latencies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for s in seconds {
            self.commit_to_ack_seconds.observe(s);
            if kept.len() == LATENCY_SAMPLES {
                kept.pop_front();
            }
            kept.push_back(s);
        }
    }
}

impl Default for RelayMetrics {
    fn default() -> Self {
        Self {
            published: Counter::default(),
            failures: Counter::default(),
            parked: Counter::default(),
            parked_rows: Gauge::default(),
            backlog: Gauge::default(),
            oldest_age_seconds: Gauge::default(),
            owned_shards: Gauge::default(),
            commit_to_ack_seconds: Histogram::new(exponential_buckets(0.000_5, 2.0, 18)),
            wal_active: Gauge::default(),
            wal_lag_bytes: Gauge::default(),
            wal_lag_seconds: Gauge::default(),
            wal_fenced: Gauge::default(),
            wal_held_keys: Gauge::default(),
            latencies: Arc::default(),
        }
    }
}

impl RelayMetrics {
    /// Registers the metrics under the `saga_relay` prefix.
    pub(crate) fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("saga_relay");
        r.register(
            "published",
            "Rows the broker acknowledged",
            self.published.clone(),
        );
        r.register(
            "failures",
            "Failed publications (retried)",
            self.failures.clone(),
        );
        r.register(
            "parked",
            "Rows parked because the broker refuses them for good",
            self.parked.clone(),
        );
        r.register(
            "parked_rows",
            "Parked rows in the outbox",
            self.parked_rows.clone(),
        );
        r.register("backlog", "Unpublished rows", self.backlog.clone());
        r.register(
            "oldest_age_seconds",
            "Age of the oldest unpublished row",
            self.oldest_age_seconds.clone(),
        );
        r.register(
            "owned_shards",
            "Shards this instance owns",
            self.owned_shards.clone(),
        );
        r.register(
            "commit_to_ack_seconds",
            "From a row's write to the broker's acknowledgement",
            self.commit_to_ack_seconds.clone(),
        );
        r.register(
            "wal_active",
            "WAL mode: 1 while this relay reads the slot, 0 while it stands by",
            self.wal_active.clone(),
        );
        r.register(
            "wal_lag_bytes",
            "WAL mode: write-ahead log between the server's position and what the relay confirmed",
            self.wal_lag_bytes.clone(),
        );
        r.register(
            "wal_lag_seconds",
            "WAL mode: how far behind the relay's confirmations are, in seconds",
            self.wal_lag_seconds.clone(),
        );
        r.register(
            "wal_fenced",
            "WAL mode: 1 while the relay waits for the table outbox to drain and its table-mode writers to go",
            self.wal_fenced.clone(),
        );
        r.register(
            "wal_held_keys",
            "WAL mode: keys held behind parked events",
            self.wal_held_keys.clone(),
        );
    }
}
