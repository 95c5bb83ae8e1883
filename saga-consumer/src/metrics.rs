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
    /// Messages behind the partition's end, from librdkafka's statistics.
    pub lag: Family<PartitionLabels, Gauge>,
}

impl Default for ConsumerMetrics {
    fn default() -> Self {
        Self {
            processed: Family::default(),
            duplicates: Family::default(),
            retries: Family::default(),
            dead_lettered: Family::default(),
            handler_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.000_25, 2.0, 16))
            }),
            batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 12)),
            lag: Family::default(),
        }
    }
}

impl ConsumerMetrics {
    /// Registers the metrics under the `saga_consumer` prefix.
    pub(crate) fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("saga_consumer");
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
            "lag",
            "Messages behind the end of the partition",
            self.lag.clone(),
        );
    }

    pub(crate) fn finished(&self, step: Option<&str>, outcome: &str) {
        self.processed
            .get_or_create(&StepLabels {
                step: step.unwrap_or_default().to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc();
    }
}
