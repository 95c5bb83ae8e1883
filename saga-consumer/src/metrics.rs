//! The consumer's Prometheus metrics.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of per-step counters.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StepLabels {
    /// The step (empty for messages no step took).
    pub step: String,
    /// What happened: `completed`, `rejected`, `duplicate`, `ignored`, `dead_lettered`, `superseded`.
    pub outcome: String,
}

/// Labels of per-partition gauges.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct PartitionLabels {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
}

/// Labels naming a step.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StepOnly {
    /// The step.
    pub step: String,
}

/// Labels of dead-letter counts.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct DeadLetterLabels {
    /// The topic the message came from.
    pub topic: String,
    /// The `dlq-reason`.
    pub reason: String,
}

/// Labels of the batch phase histogram.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct PhaseLabels {
    /// The phase: see [`BatchPhases`].
    pub phase: &'static str,
}

/// Where a partition worker's time goes, batch by batch, in seconds. Each is one series of
/// `saga_consumer_batch_phase_seconds`; their sums over a run, divided by the batch count, break a batch
/// down (`docs/performance.md`).
#[derive(Clone)]
pub(crate) struct BatchPhases {
    /// The worker had nothing to do: its partition's queue was empty.
    pub idle: Histogram,
    /// Decoding and routing the messages taken from the queue for the batch.
    pub route: Histogram,
    /// Waiting for one of the consumer's `concurrency` permits.
    pub permit: Histogram,
    /// The crash-loop bookkeeping before the batch (`saga_consumer_begin_batch`).
    pub guard: Histogram,
    /// Taking a pooled connection and `BEGIN`.
    pub begin: Histogram,
    /// Claiming the batch's step keys.
    pub claim: Histogram,
    /// The handlers (the same time as `saga_consumer_handler_seconds`, per batch).
    pub handler: Histogram,
    /// Recording outcomes and appending the outbox rows.
    pub record: Histogram,
    /// `COMMIT`, the WAL flush included.
    pub commit: Histogram,
}

impl BatchPhases {
    fn new(family: &Family<PhaseLabels, Histogram>) -> Self {
        let phase = |phase| family.get_or_create(&PhaseLabels { phase }).clone();
        Self {
            idle: phase("idle"),
            route: phase("route"),
            permit: phase("permit"),
            guard: phase("guard"),
            begin: phase("begin"),
            claim: phase("claim"),
            handler: phase("handler"),
            record: phase("record"),
            commit: phase("commit"),
        }
    }
}

/// Observes the time since `started` in `histogram`.
pub(crate) fn observe_since(histogram: &Histogram, started: std::time::Instant) {
    histogram.observe(started.elapsed().as_secs_f64());
}

/// The consumer's metrics, cheap to clone.
#[derive(Clone)]
pub(crate) struct ConsumerMetrics {
    /// Messages finished, by step and outcome.
    pub processed: Family<StepLabels, Counter>,
    /// Redeliveries skipped because their step key was done.
    pub duplicates: Family<StepOnly, Counter>,
    /// Retries after transient failures.
    pub retries: Family<StepOnly, Counter>,
    /// Messages sent to the dead-letter topic.
    pub dead_lettered: Family<DeadLetterLabels, Counter>,
    /// Handler latency in seconds (the handler alone, inside the transaction).
    pub handler_seconds: Family<StepOnly, Histogram>,
    /// Messages per committed transaction.
    pub batch_size: Histogram,
    /// Transactions that failed because the database could not be reached, each waited out and retried.
    pub database_unreachable: Counter,
    /// Transactions run again because their claim expected new keys and met an existing one.
    pub claims_rerun: Counter,
    /// Messages behind the partition's end, from librdkafka's statistics.
    pub lag: Family<PartitionLabels, Gauge>,
    /// Seconds per batch phase, by phase.
    pub phase_seconds: Family<PhaseLabels, Histogram>,
    /// The same series, one handle per phase.
    pub phases: BatchPhases,
    /// Keys the group holds (see `hold`).
    pub held_keys: Gauge,
    /// Messages parked behind held keys.
    pub parked: Gauge,
    /// Seconds since the oldest hold began.
    pub held_oldest_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Keys held longer than `SAGA_HOLD_ALERT_AFTER_SECS`.
    pub held_keys_overdue: Gauge,
    /// Steps an operator paused.
    pub paused_steps: Gauge,
    /// Keys held for their delayed retries.
    pub retrying_keys: Gauge,
    /// Seconds the most overdue delayed retry waits past its due time to be sent.
    pub retry_lag_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
}

impl Default for ConsumerMetrics {
    fn default() -> Self {
        let phase_seconds: Family<PhaseLabels, Histogram> =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.000_05, 2.0, 18)));
        let phases = BatchPhases::new(&phase_seconds);
        Self {
            processed: Family::default(),
            duplicates: Family::default(),
            retries: Family::default(),
            dead_lettered: Family::default(),
            handler_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.000_25, 2.0, 16))
            }),
            batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 12)),
            database_unreachable: Counter::default(),
            claims_rerun: Counter::default(),
            lag: Family::default(),
            phase_seconds,
            phases,
            held_keys: Gauge::default(),
            parked: Gauge::default(),
            held_oldest_seconds: Gauge::default(),
            held_keys_overdue: Gauge::default(),
            paused_steps: Gauge::default(),
            retrying_keys: Gauge::default(),
            retry_lag_seconds: Gauge::default(),
        }
    }
}

impl ConsumerMetrics {
    /// Registers the metrics under the `saga_consumer` prefix.
    pub(crate) fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("saga_consumer");
        r.register(
            "held_keys",
            "Keys the group holds: a dead letter or a paused step stops them, their later messages parked",
            self.held_keys.clone(),
        );
        r.register(
            "parked_messages",
            "Messages parked behind held keys, released in order",
            self.parked.clone(),
        );
        r.register(
            "held_key_oldest_seconds",
            "Seconds since the group's oldest hold began",
            self.held_oldest_seconds.clone(),
        );
        r.register(
            "held_keys_overdue",
            "Keys held longer than SAGA_HOLD_ALERT_AFTER_SECS",
            self.held_keys_overdue.clone(),
        );
        r.register(
            "paused_steps",
            "Steps an operator paused (saga steps pause)",
            self.paused_steps.clone(),
        );
        r.register(
            "retrying_keys",
            "Keys held while a message of them waits for its delayed retry (SAGA_RETRY_DELAYED)",
            self.retrying_keys.clone(),
        );
        r.register(
            "retry_lag_seconds",
            "Seconds the most overdue delayed retry has waited past its due time to be sent again",
            self.retry_lag_seconds.clone(),
        );
        r.register(
            "processed",
            "Messages finished, by step and outcome",
            self.processed.clone(),
        );
        r.register(
            "duplicates",
            "Redeliveries skipped because their step key was already done",
            self.duplicates.clone(),
        );
        r.register(
            "retries",
            "Retries after transient failures",
            self.retries.clone(),
        );
        r.register(
            "dead_lettered",
            "Messages sent to the dead-letter topic",
            self.dead_lettered.clone(),
        );
        r.register(
            "handler_seconds",
            "Handler latency inside the transaction",
            self.handler_seconds.clone(),
        );
        r.register(
            "batch_size",
            "Messages per committed transaction",
            self.batch_size.clone(),
        );
        r.register(
            "database_unreachable",
            "Transactions that failed because the database could not be reached (waited out, then retried)",
            self.database_unreachable.clone(),
        );
        r.register(
            "claims_rerun",
            "Transactions run again because their claim expected only new step keys and met an existing one",
            self.claims_rerun.clone(),
        );
        r.register(
            "batch_phase_seconds",
            "Seconds a partition worker spent per batch phase (idle, route, permit, guard, begin, claim, handler, record, commit)",
            self.phase_seconds.clone(),
        );
        r.register(
            "lag",
            "Messages behind the end of the partition",
            self.lag.clone(),
        );
    }

    /// Counts `messages` of `step` that ended with `outcome`.
    pub(crate) fn finished(&self, step: Option<&str>, outcome: &str, messages: u64) {
        self.processed
            .get_or_create(&StepLabels {
                step: step.unwrap_or_default().to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc_by(messages);
    }
}

impl ConsumerMetrics {
    /// Sets the hold gauges from a census of the group's holds.
    pub(crate) fn held(&self, census: &crate::hold::Census) {
        self.held_keys.set(census.keys);
        self.parked.set(census.parked);
        self.held_oldest_seconds.set(census.oldest_seconds);
        self.held_keys_overdue.set(census.overdue);
        self.paused_steps.set(census.paused_steps);
        self.retrying_keys.set(census.retrying);
        self.retry_lag_seconds.set(census.retry_lag_seconds);
    }
}
