//! The consumer's settings' own types (the settings are [`ConsumerArgs`](crate::settings::ConsumerArgs)).

use std::str::FromStr;

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

#[cfg(test)]
mod tests {
    use crate::settings::ConsumerArgs;
    use std::time::Duration;

    fn from(env: &[(&str, &str)]) -> Result<ConsumerArgs, saga_config::ConfigProblem> {
        ConsumerArgs::from_vars(|name| {
            env.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    #[test]
    fn environment_overrides_defaults() {
        let args = from(&[
            ("SAGA_GROUP_ID", "shipping"),
            ("SAGA_BATCH_SIZE", "250"),
            ("SAGA_RETRY_INITIAL_MS", "50"),
            ("SAGA_ASSIGNMENT_STRATEGY", "range"),
        ])
        .unwrap();
        assert_eq!(args.group_id.as_deref(), Some("shipping"));
        assert_eq!(args.batch_size, 250);
        assert_eq!(args.retry.initial_backoff, Duration::from_millis(50));
        assert_eq!(args.assignment, super::AssignmentStrategy::Range);
        assert_eq!(args.dlq_topic(), "shipping.dlq");
        assert!(args.problems().is_empty(), "{:?}", args.problems());
    }

    #[test]
    fn bad_values_are_named_when_parsed_and_when_set_in_code() {
        for (var, bad) in [
            ("SAGA_BATCH_SIZE", "lots"),
            ("SAGA_BATCH_SIZE", "0"),
            ("SAGA_BATCH_SIZE", "10001"),
            ("SAGA_KEY_CONCURRENCY", "0"),
            ("SAGA_COMMIT_INTERVAL_MS", "0"),
            ("SAGA_FETCH_WAIT_MS", "300001"),
            ("SAGA_MAX_ATTEMPTS", "0"),
            ("SAGA_RETRY_JITTER", "1.5"),
            ("SAGA_RETRY_MULTIPLIER", "0.5"),
            ("SAGA_GROUP_ID", " "),
        ] {
            let err = from(&[(var, bad)]).unwrap_err();
            assert_eq!(err.setting, var, "{var}={bad}: {err}");
        }
        // The same rules for a value set in code, every problem said, each naming its variable.
        let mut args = ConsumerArgs {
            batch_size: 0,
            retry_topic: Some("orders.dlq".into()),
            dlq_topic: Some("orders.dlq".into()),
            ..ConsumerArgs::default()
        };
        args.retry.initial_backoff = Duration::from_secs(10);
        args.retry.max_backoff = Duration::from_secs(1);
        let named: Vec<String> = args.problems().into_iter().map(|p| p.setting).collect();
        assert_eq!(
            named,
            [
                "SAGA_GROUP_ID",
                "SAGA_BATCH_SIZE",
                "SAGA_RETRY_TOPIC",
                "SAGA_RETRY_INITIAL_MS"
            ]
        );
    }
}
