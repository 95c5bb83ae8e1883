//! The consumer's settings: defaults, environment variables, validation.

use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

use saga_runtime::kafka::KafkaConfig;

use crate::error::ConfigError;
use crate::retry::RetryPolicy;

/// How partitions are spread over a group's members. Only the eager protocols are safe with manual offset
/// commits today; cooperative-sticky is offered for brokers and versions where it works.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum AssignmentStrategy {
    /// Contiguous ranges of partitions per member (eager).
    Range,
    /// Partitions dealt out in turn (eager). The default.
    #[default]
    RoundRobin,
    /// Incremental rebalancing. Known upstream problems with manual commits during rebalances.
    CooperativeSticky,
}

impl AssignmentStrategy {
    /// The `partition.assignment.strategy` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Range => "range",
            Self::RoundRobin => "roundrobin",
            Self::CooperativeSticky => "cooperative-sticky",
        }
    }
}

impl FromStr for AssignmentStrategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "range" => Ok(Self::Range),
            "roundrobin" => Ok(Self::RoundRobin),
            "cooperative-sticky" => Ok(Self::CooperativeSticky),
            other => Err(format!(
                "{other:?} is not one of range, roundrobin, cooperative-sticky"
            )),
        }
    }
}

/// Every setting of the consumer. Build it with [`crate::SagaConsumer::builder`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ConsumerSettings {
    /// The broker (`KAFKA_BROKERS`, required; `KAFKA_PROPERTY_*` for librdkafka properties).
    pub kafka: Option<KafkaConfig>,
    /// The consumer group (`SAGA_GROUP_ID`).
    pub group_id: Option<String>,
    /// Partitions processed at once (`SAGA_CONCURRENCY`, default 4).
    pub concurrency: usize,
    /// Most messages of one partition per transaction (`SAGA_BATCH_SIZE`, default 100).
    pub batch_size: usize,
    /// Messages of different keys of one partition that run at once (`SAGA_KEY_CONCURRENCY`, default 1).
    pub key_concurrency: usize,
    /// Retries of transient failures (`SAGA_MAX_ATTEMPTS`, `SAGA_RETRY_INITIAL_MS`, `SAGA_RETRY_MAX_MS`).
    pub retry: RetryPolicy,
    /// The dead-letter topic (`SAGA_DLQ_TOPIC`, default `{group}.dlq`).
    pub dlq_topic: Option<String>,
    /// The retry topic (`SAGA_RETRY_TOPIC`, default `{group}.retry`): where `saga dlq replay` sends this
    /// group's dead letters back, so that no other group sees a replay. The consumer reads it with the same
    /// steps, routing each message by the original topic its replay headers name.
    pub retry_topic: Option<String>,
    /// How often finished offsets are committed (`SAGA_COMMIT_INTERVAL_MS`, default 1 s).
    pub commit_interval: Duration,
    /// librdkafka's `fetch.wait.max.ms` (`SAGA_FETCH_WAIT_MS`, default 10 ms): how long the broker may hold
    /// a fetch that found nothing. Kafka answers a waiting fetch as soon as a message arrives, whatever
    /// this is; a broker that does not (the local Nisshi) delivers up to this late, at every hop of a saga.
    /// Lower costs more fetch requests while idle (100 a second per broker at 10 ms), nothing else.
    pub fetch_wait: Duration,
    /// Longest a handler may run before it is failed transiently (`SAGA_HANDLER_TIMEOUT_MS`, default 30 s).
    pub handler_timeout: Duration,
    /// Longest a revoke waits for the revoked partitions' in-flight batches (default 10 s).
    pub revoke_timeout: Duration,
    /// Longest a graceful stop waits for in-flight batches (`SAGA_SHUTDOWN_TIMEOUT_MS`, default 30 s).
    pub shutdown_timeout: Duration,
    /// `partition.assignment.strategy` (`SAGA_ASSIGNMENT_STRATEGY`, default roundrobin).
    pub assignment: AssignmentStrategy,
    /// `session.timeout.ms` (default 10 s): how soon the group notices a dead member.
    pub session_timeout: Duration,
    /// Deaths tolerated per message before it is dead-lettered as a crash loop (`SAGA_CRASH_LOOP_LIMIT`,
    /// default 3; 0 turns detection off).
    pub crash_loop_limit: u32,
    /// Where to serve `/metrics`, `/healthz` and `/readyz` (`SAGA_OPS_ADDR`; off by default).
    pub ops_addr: Option<SocketAddr>,
    /// How long finished step keys are kept (`SAGA_KEY_RETENTION_HOURS`, default 7 days): a service
    /// refuses to start when a topic it reads keeps messages longer. (Whatever it is, a message whose key
    /// retention may have deleted is dead-lettered rather than run again.)
    pub key_retention: Duration,
    /// Most messages parked behind one held key (`SAGA_HOLD_MAX_PARKED_PER_KEY`, default 10,000).
    pub hold_max_parked_per_key: u32,
    /// Most messages parked behind the group's held keys together (`SAGA_HOLD_MAX_PARKED`, default
    /// 100,000).
    pub hold_max_parked: u32,
    /// A key held longer counts as overdue (`SAGA_HOLD_ALERT_AFTER_SECS`, default 1 h).
    pub hold_alert_after: Duration,
}

impl Default for ConsumerSettings {
    /// The defaults of [`ConsumerArgs`](crate::settings::ConsumerArgs) and
    /// [`RetentionArgs`](crate::settings::RetentionArgs), declared there once, without a broker.
    fn default() -> Self {
        crate::settings::ConsumerArgs::default()
            .settings(None, &crate::settings::RetentionArgs::default())
            .expect("the consumer's default settings are valid")
    }
}

impl ConsumerSettings {
    /// The settings no variable sets; every other field is set by
    /// [`ConsumerArgs::settings`](crate::settings::ConsumerArgs::settings).
    pub(crate) fn internal_defaults() -> Self {
        Self {
            kafka: None,
            group_id: None,
            concurrency: 1,
            batch_size: 1,
            key_concurrency: 1,
            retry: RetryPolicy::with_attempts_and_backoff(1, Duration::ZERO, Duration::ZERO),
            dlq_topic: None,
            retry_topic: None,
            commit_interval: Duration::from_secs(1),
            fetch_wait: Duration::ZERO,
            handler_timeout: Duration::from_secs(1),
            revoke_timeout: Duration::from_secs(10),
            shutdown_timeout: Duration::from_secs(1),
            assignment: AssignmentStrategy::default(),
            session_timeout: Duration::from_secs(10),
            crash_loop_limit: 0,
            ops_addr: None,
            key_retention: Duration::ZERO,
            hold_max_parked_per_key: 1,
            hold_max_parked: 1,
            hold_alert_after: Duration::from_secs(1),
        }
    }

    /// The settings from the environment, through their one declaration
    /// ([`KafkaArgs`](crate::settings::KafkaArgs), [`ConsumerArgs`](crate::settings::ConsumerArgs), and
    /// [`RetentionArgs`](crate::settings::RetentionArgs) for the key retention). A variable that does not
    /// parse is a [`ConfigProblem`](saga_core::ConfigProblem) naming it; a missing broker is left for
    /// [`ConsumerSettings::validate`].
    pub fn from_env() -> Result<Self, saga_core::ConfigProblem> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`ConsumerSettings::from_env`] over any source of variables.
    pub fn from_vars(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, saga_core::ConfigProblem> {
        use saga_runtime::settings::from_vars;
        let kafka: crate::settings::KafkaArgs = from_vars(&get)?;
        let consumer: crate::settings::ConsumerArgs = from_vars(&get)?;
        let retention: crate::settings::RetentionArgs = from_vars(&get)?;
        // KAFKA_PROPERTY_* are read from the process's environment; a missing broker list is left for
        // `validate`, security settings that cannot work together are refused here.
        let kafka = kafka.brokers.as_ref().map(|_| kafka.config()).transpose()?;
        consumer.settings(kafka, &retention)
    }

    /// Checks every setting; the first problem is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |setting, reason: &str| {
            Err(ConfigError::Invalid {
                setting,
                reason: reason.to_owned(),
            })
        };
        if self
            .kafka
            .as_ref()
            .is_none_or(|k| k.brokers.trim().is_empty())
        {
            return Err(ConfigError::Missing("brokers (KAFKA_BROKERS)"));
        }
        match &self.group_id {
            None => return Err(ConfigError::Missing("group id (SAGA_GROUP_ID)")),
            Some(g) if g.trim().is_empty() => return invalid("SAGA_GROUP_ID", "is empty"),
            Some(_) => {}
        }
        if self.concurrency == 0 {
            return invalid("SAGA_CONCURRENCY", "must be at least 1");
        }
        if !(1..=10_000).contains(&self.batch_size) {
            return invalid("SAGA_BATCH_SIZE", "must be between 1 and 10000");
        }
        if !(1..=1_024).contains(&self.key_concurrency) {
            return invalid("SAGA_KEY_CONCURRENCY", "must be between 1 and 1024");
        }
        if self.retry.max_attempts == 0 {
            return invalid(
                "SAGA_MAX_ATTEMPTS",
                "must be at least 1 (the first attempt)",
            );
        }
        if self.retry.initial_backoff > self.retry.max_backoff {
            return invalid(
                "SAGA_RETRY_INITIAL_MS",
                "the initial backoff exceeds the maximum (SAGA_RETRY_MAX_MS)",
            );
        }
        if !(0.0..=1.0).contains(&self.retry.jitter) || self.retry.multiplier < 1.0 {
            return invalid(
                "retry policy",
                "jitter must be within 0..=1 and the multiplier at least 1",
            );
        }
        if self.commit_interval.is_zero() {
            return invalid("SAGA_COMMIT_INTERVAL_MS", "must be positive");
        }
        if self.fetch_wait > Duration::from_secs(300) {
            return invalid("SAGA_FETCH_WAIT_MS", "must be at most 300000 ms");
        }
        if self.handler_timeout.is_zero() {
            return invalid("SAGA_HANDLER_TIMEOUT_MS", "must be positive");
        }
        if matches!(&self.dlq_topic, Some(t) if t.trim().is_empty()) {
            return invalid("SAGA_DLQ_TOPIC", "is empty");
        }
        if matches!(&self.retry_topic, Some(t) if t.trim().is_empty()) {
            return invalid("SAGA_RETRY_TOPIC", "is empty");
        }
        if self.retry_topic() == self.dlq_topic() {
            return invalid(
                "SAGA_RETRY_TOPIC",
                "is the dead-letter topic (SAGA_DLQ_TOPIC)",
            );
        }
        Ok(())
    }

    /// The retry topic: the configured one, or `{group}.retry`.
    pub fn retry_topic(&self) -> String {
        self.retry_topic
            .clone()
            .unwrap_or_else(|| format!("{}.retry", self.group_id.as_deref().unwrap_or("saga")))
    }

    /// The dead-letter topic: the configured one, or `{group}.dlq`.
    pub fn dlq_topic(&self) -> String {
        self.dlq_topic
            .clone()
            .unwrap_or_else(|| format!("{}.dlq", self.group_id.as_deref().unwrap_or("saga")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid() -> ConsumerSettings {
        ConsumerSettings {
            group_id: Some("payments".into()),
            kafka: Some(KafkaConfig::new("127.0.0.1:9092")),
            ..ConsumerSettings::default()
        }
    }

    #[test]
    fn environment_overrides_defaults() {
        let env = [
            ("KAFKA_BROKERS", "10.0.0.1:9092"),
            ("SAGA_GROUP_ID", "shipping"),
            ("SAGA_BATCH_SIZE", "250"),
            ("SAGA_RETRY_INITIAL_MS", "50"),
            ("SAGA_ASSIGNMENT_STRATEGY", "range"),
        ];
        let settings = ConsumerSettings::from_vars(|name| {
            env.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        })
        .unwrap();
        assert_eq!(settings.kafka.as_ref().unwrap().brokers, "10.0.0.1:9092");
        assert_eq!(settings.group_id.as_deref(), Some("shipping"));
        assert_eq!(settings.batch_size, 250);
        assert_eq!(settings.retry.initial_backoff, Duration::from_millis(50));
        assert_eq!(settings.assignment, AssignmentStrategy::Range);
        assert_eq!(settings.dlq_topic(), "shipping.dlq");
        settings.validate().unwrap();
    }

    #[test]
    fn bad_values_are_named() {
        let err = ConsumerSettings::from_vars(|name| {
            (name == "SAGA_BATCH_SIZE").then(|| "lots".to_owned())
        })
        .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("SAGA_BATCH_SIZE: \"lots\" does not parse"),
            "{err}"
        );

        assert!(matches!(
            ConsumerSettings::default().validate(),
            Err(ConfigError::Missing(_))
        ));
        let no_brokers = ConsumerSettings {
            group_id: Some("payments".into()),
            ..ConsumerSettings::default()
        };
        assert!(
            no_brokers
                .validate()
                .unwrap_err()
                .to_string()
                .contains("KAFKA_BROKERS"),
            "a missing broker list is named, never defaulted"
        );
        let zero_batch = ConsumerSettings {
            batch_size: 0,
            ..valid()
        };
        assert!(
            zero_batch
                .validate()
                .unwrap_err()
                .to_string()
                .contains("SAGA_BATCH_SIZE")
        );
        let inverted = ConsumerSettings {
            retry: RetryPolicy::default().backoff(Duration::from_secs(10), Duration::from_secs(1)),
            ..valid()
        };
        assert!(inverted.validate().is_err());
    }
}
