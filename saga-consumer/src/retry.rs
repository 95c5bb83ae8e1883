//! The retry policy: how often a transiently failing message is retried, and how long to wait in between.

use std::time::Duration;

use saga_runtime::settings::value;

/// Exponential backoff with jitter, and a retry budget after which a message is dead-lettered.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use saga_consumer::RetryPolicy;
///
/// let policy = RetryPolicy::default()
///     .max_attempts(4)
///     .backoff(Duration::from_millis(50), Duration::from_secs(2));
/// assert_eq!(policy.max_attempts, 4);
/// ```
#[derive(Debug, Clone, PartialEq, clap::Args)]
#[group(id = "saga_retry")]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Attempts in all (the first one included) before a transiently failing message is dead-lettered (an
    /// unavailable database spends none).
    #[arg(long = "max-attempts", env = "SAGA_MAX_ATTEMPTS", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_attempts: u32,
    /// The wait before the second attempt, in milliseconds (exponential, with jitter).
    #[arg(long = "retry-initial-ms", env = "SAGA_RETRY_INITIAL_MS", default_value = "200", value_parser = value::millis)]
    pub initial_backoff: Duration,
    /// The longest wait between attempts, in milliseconds.
    #[arg(long = "retry-max-ms", env = "SAGA_RETRY_MAX_MS", default_value = "30000", value_parser = value::millis)]
    pub max_backoff: Duration,
    /// Each wait is this many times the previous one, before jitter (at least 1).
    #[arg(long = "retry-multiplier", env = "SAGA_RETRY_MULTIPLIER", default_value = "2", value_parser = value::factor)]
    pub multiplier: f64,
    /// Each wait is shortened by a random fraction of up to this (0 to 1), so that many failing consumers
    /// do not retry in lockstep.
    #[arg(long = "retry-jitter", env = "SAGA_RETRY_JITTER", default_value = "0.2", value_parser = value::fraction)]
    pub jitter: f64,
    /// Delayed retries: a keyed message that failed transiently is parked with the time of its next attempt
    /// (kept in PostgreSQL) and holds its key until it runs again, instead of waiting where it stands; the
    /// partition goes on with other keys, and the key's later messages (on any partition) wait behind it.
    /// Every consumer of the group must run a version that knows them.
    #[arg(long = "retry-delayed", env = "SAGA_RETRY_DELAYED", default_value_t = false, action = clap::ArgAction::Set)]
    pub delayed: bool,
}
saga_runtime::settings_group!(RetryPolicy);

impl RetryPolicy {
    /// `attempts` in all, backing off from `initial` to at most `max` (the declared growth and jitter).
    pub fn with_attempts_and_backoff(attempts: u32, initial: Duration, max: Duration) -> Self {
        Self::default().max_attempts(attempts).backoff(initial, max)
    }

    /// What is wrong with this policy, each naming its variable: the declarations' rules, for a policy made
    /// in code, and the one rule between two settings.
    pub fn problems(&self) -> Vec<saga_config::ConfigProblem> {
        let checks = [
            (
                "SAGA_MAX_ATTEMPTS",
                value::within(self.max_attempts, &(1..=u64::MAX)).err(),
            ),
            (
                "SAGA_RETRY_MULTIPLIER",
                value::factor_of(self.multiplier).err(),
            ),
            ("SAGA_RETRY_JITTER", value::fraction_of(self.jitter).err()),
            (
                "SAGA_RETRY_INITIAL_MS",
                (self.initial_backoff > self.max_backoff)
                    .then(|| "exceeds the longest wait (SAGA_RETRY_MAX_MS)".to_owned()),
            ),
        ];
        checks
            .into_iter()
            .filter_map(|(var, why)| {
                why.map(|why| saga_config::ConfigProblem::new(var, why, "fix the retry policy"))
            })
            .collect()
    }

    /// Attempts in all, the first one included, before a transiently failing message is dead-lettered.
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// Delayed retries on or off (`SAGA_RETRY_DELAYED`; see the field).
    #[must_use]
    pub fn delayed(mut self, on: bool) -> Self {
        self.delayed = on;
        self
    }

    /// The first wait between attempts, and the longest.
    #[must_use]
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.initial_backoff = initial;
        self.max_backoff = max;
        self
    }

    /// The factor between consecutive waits (at least 1), and the jitter (0 to 1).
    #[must_use]
    pub fn growth(mut self, multiplier: f64, jitter: f64) -> Self {
        self.multiplier = multiplier;
        self.jitter = jitter;
        self
    }

    /// The wait after failed attempt number `attempt` (1-based), with jitter.
    pub fn wait_after(&self, attempt: u32) -> Duration {
        let exponent = i32::try_from(attempt.saturating_sub(1)).unwrap_or(i32::MAX);
        let base = self.initial_backoff.as_secs_f64() * self.multiplier.powi(exponent);
        let capped = base.min(self.max_backoff.as_secs_f64());
        let jitter = self.jitter.clamp(0.0, 1.0) * rand::random::<f64>();
        Duration::from_secs_f64(capped * (1.0 - jitter))
    }

    /// Whether a message that failed `attempts` times may be tried again.
    pub fn may_retry(&self, attempts: u32) -> bool {
        attempts < self.max_attempts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_exponentially_up_to_the_cap_and_jitter_only_shortens() {
        let policy = RetryPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(1000),
            jitter: 0.0,
            ..RetryPolicy::default()
        };
        let waits: Vec<_> = (1..=6).map(|a| policy.wait_after(a).as_millis()).collect();
        assert_eq!(waits, vec![100, 200, 400, 800, 1000, 1000]);

        let jittered = RetryPolicy {
            jitter: 0.5,
            ..policy
        };
        for _ in 0..100 {
            let wait = jittered.wait_after(3);
            assert!(wait <= Duration::from_millis(400) && wait >= Duration::from_millis(200));
        }
    }

    #[test]
    fn the_budget_counts_the_first_attempt() {
        let policy = RetryPolicy {
            max_attempts: 3,
            ..RetryPolicy::default()
        };
        assert!(policy.may_retry(1));
        assert!(policy.may_retry(2));
        assert!(!policy.may_retry(3));
    }
}
