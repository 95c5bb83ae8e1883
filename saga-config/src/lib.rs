//! # saga-config
//!
//! The settings types every part of saga-exactly-once shares, kept out of `saga-core` so that the contract a
//! step implementor depends on stays small: where the broker is ([`KafkaConfig`]), how the outbox is read
//! ([`OutboxMode`]), and the one-line report of a setting that keeps a process from starting
//! ([`ConfigProblem`]), and the [`Cause`] the boundary crates' errors keep of a part whose error type is not
//! part of their API. `saga-consumer` and `outbox-relay` re-export them; a service names them from there.
//!
//! # Examples
//!
//! ```
//! use saga_config::{ConfigProblem, KafkaConfig};
//!
//! let kafka = KafkaConfig::new("127.0.0.1:9092").with_property("sasl.password", "hunter2");
//! assert!(!format!("{kafka:?}").contains("hunter2"));
//!
//! let problem = ConfigProblem::new("KAFKA_BROKERS", "is not set", "set it to the bootstrap servers");
//! assert!(problem.to_string().starts_with("KAFKA_BROKERS: is not set"));
//! ```

#![deny(missing_docs)]

use std::fmt;

mod cause;
mod sampled_out;
pub use cause::Cause;
pub use sampled_out::SampledOut;

/// Where the broker is, and extra librdkafka properties: the framework's own Kafka settings type, free of
/// any client library's types. The consumer, the relay and the `saga` command take it. Its `Debug` shows
/// the value of no property that holds a secret ([`KafkaConfig::is_secret`]).
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KafkaConfig {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// Extra librdkafka properties, applied last (security settings, tuning).
    pub properties: Vec<(String, String)>,
}

/// The variable naming the brokers.
const BROKERS_VAR: &str = "KAFKA_BROKERS";

impl KafkaConfig {
    /// The broker list `brokers` with no extra properties.
    pub fn new(brokers: impl Into<String>) -> Self {
        Self {
            brokers: brokers.into(),
            properties: Vec::new(),
        }
    }

    /// Adds a librdkafka property (`security.protocol`, say), applied after the framework's own.
    #[must_use]
    pub fn with_property(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.push((name.into(), value.into()));
        self
    }

    /// From the environment: `KAFKA_BROKERS` (required: a missing one is a [`ConfigProblem`], never a
    /// silent default), and every `KAFKA_PROPERTY_*` variable as a librdkafka property
    /// (`KAFKA_PROPERTY_SECURITY_PROTOCOL=ssl` sets `security.protocol`). It does not read the security
    /// settings (`KAFKA_SECURITY_PROTOCOL`, `KAFKA_SASL_*`, `KAFKA_SSL_*`) nor check them together: a
    /// service reads those with `outbox_relay::KafkaArgs::from_env()?.config()`.
    pub fn from_env() -> Result<Self, ConfigProblem> {
        Self::with_env_properties(std::env::var(BROKERS_VAR).ok())
    }

    /// `brokers` (read by a command line from a flag or `KAFKA_BROKERS`) with every `KAFKA_PROPERTY_*`
    /// variable as a librdkafka property; a missing or blank one is a [`ConfigProblem`] naming
    /// `KAFKA_BROKERS`.
    pub fn with_env_properties(brokers: Option<String>) -> Result<Self, ConfigProblem> {
        let brokers = brokers.filter(|b| !b.trim().is_empty()).ok_or_else(|| {
            ConfigProblem::new(
                BROKERS_VAR,
                "is not set",
                "set it to the bootstrap servers, such as 127.0.0.1:9092",
            )
        })?;
        Ok(Self {
            brokers,
            properties: properties_from_env(),
        })
    }
}

impl KafkaConfig {
    /// Whether the librdkafka property `name` holds a secret (a password or passphrase, a client secret, a
    /// private key or a JAAS configuration): its value is never shown.
    pub fn is_secret(name: &str) -> bool {
        let name = name.to_ascii_lowercase();
        [
            "password",
            "secret",
            "jaas",
            "ssl.key.pem",
            "keystore",
            "oauthbearer.config",
            "passphrase",
            "private.key",
        ]
        .iter()
        .any(|word| name.contains(word))
    }
}

impl fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let properties: Vec<(&str, &str)> = self
            .properties
            .iter()
            .map(|(name, value)| {
                let shown = if Self::is_secret(name) {
                    "<redacted>"
                } else {
                    value.as_str()
                };
                (name.as_str(), shown)
            })
            .collect();
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("properties", &properties)
            .finish()
    }
}

/// Every `KAFKA_PROPERTY_*` variable, as a librdkafka property name and value. Other variables may hold
/// anything (`std::env::vars` would panic on one that is not UTF-8); a property's value that is not UTF-8
/// is passed with its bad bytes replaced (U+FFFD), for librdkafka or the broker to refuse by name.
fn properties_from_env() -> Vec<(String, String)> {
    std::env::vars_os()
        .filter_map(|(name, value)| {
            let property = name.to_str()?.strip_prefix("KAFKA_PROPERTY_")?;
            Some((
                property.to_ascii_lowercase().replace('_', "."),
                value.to_string_lossy().into_owned(),
            ))
        })
        .collect()
}

/// A setting that keeps a process from starting: which one, what is wrong, and what to do. The framework's
/// binaries print it as one line and exit with code 2.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConfigProblem {
    /// The environment variable (or flag) at fault, such as `DATABASE_URL` (several, comma-separated, when
    /// [`ConfigProblem::all`] says several problems).
    pub setting: String,
    /// What is wrong with it.
    pub problem: String,
    /// What to do about it.
    pub fix: String,
}

impl ConfigProblem {
    /// A problem with `setting`: `problem`, fixed by `fix`.
    pub fn new(
        setting: impl Into<String>,
        problem: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Self {
            setting: setting.into(),
            problem: problem.into(),
            fix: fix.into(),
        }
    }

    /// Every problem of `problems` said at once, each with its setting and fix (none: `None`), so that a
    /// start refused for several settings names them all, not only the first.
    pub fn all(problems: Vec<ConfigProblem>) -> Option<Self> {
        // The same problem found twice (two groups read the same variable) is said once.
        let mut problems = problems.into_iter().fold(Vec::new(), |mut kept, p| {
            if !kept.contains(&p) {
                kept.push(p);
            }
            kept
        });
        if problems.len() <= 1 {
            return problems.pop();
        }
        let settings: Vec<&str> = problems.iter().map(|p| p.setting.as_str()).collect();
        let each: Vec<String> = problems
            .iter()
            .map(|p| format!("{} {} ({})", p.setting, p.problem, p.fix))
            .collect();
        Some(Self::new(
            settings.join(", "),
            each.join("; "),
            "fix each of them",
        ))
    }
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Errors of libraries may span lines; the report is one line.
        let one_line = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
        write!(
            f,
            "{}: {}; {}",
            self.setting,
            one_line(&self.problem),
            one_line(&self.fix)
        )
    }
}

impl std::error::Error for ConfigProblem {}

/// Input a command cannot act on (an unknown id, a topic that is not what it should be, a value that does
/// not parse), said in one line. The framework's binaries print it and exit with code 2, as on a
/// [`ConfigProblem`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BadInput(pub String);

impl BadInput {
    /// Bad input, said by `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

impl fmt::Display for BadInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.split_whitespace().collect::<Vec<_>>().join(" "))
    }
}

impl std::error::Error for BadInput {}

/// Where the framework writes a transaction's events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OutboxMode {
    /// Rows of `saga_outbox`, published by the table relay (the default).
    #[default]
    Table,
    /// A logical message on the write-ahead log, read by the WAL relay through a replication slot.
    Wal,
}

impl OutboxMode {
    /// The mode's name in `SAGA_OUTBOX_MODE`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Table => "table",
            Self::Wal => "wal",
        }
    }

    /// Parses `table` or `wal`.
    pub fn parse(value: &str) -> Result<Self, ConfigProblem> {
        match value.trim().to_ascii_lowercase().as_str() {
            "table" | "" => Ok(Self::Table),
            "wal" => Ok(Self::Wal),
            other => Err(ConfigProblem::new(
                "SAGA_OUTBOX_MODE",
                format!("{other:?} is no outbox mode"),
                "use table (the default) or wal",
            )),
        }
    }

    /// `SAGA_OUTBOX_MODE`, or the default.
    #[deprecated(
        since = "0.3.0",
        note = "read SAGA_OUTBOX_MODE through its one declaration: saga_consumer::settings::OutboxArgs::from_env()"
    )]
    pub fn from_env() -> Result<Self, ConfigProblem> {
        std::env::var("SAGA_OUTBOX_MODE").map_or(Ok(Self::Table), |v| Self::parse(&v))
    }
}

#[cfg(test)]
mod secret_tests {
    use super::KafkaConfig;

    #[test]
    fn every_property_that_holds_a_secret_is_kept_out_of_debug() {
        let secrets = [
            "sasl.password",
            "ssl.key.password",
            "ssl.key.pem",
            "ssl.keystore.password",
            "sasl.oauthbearer.client.secret",
            "sasl.oauthbearer.config",
            "sasl.oauthbearer.assertion.private.key.passphrase",
            "sasl.oauthbearer.assertion.private.key.pem",
            "sasl.jaas.config",
        ];
        let config = secrets
            .iter()
            .fold(KafkaConfig::new("broker:9093"), |c, name| {
                c.with_property(*name, "canary-7f3")
            })
            .with_property("sasl.username", "svc");
        let shown = format!("{config:?}");
        assert!(!shown.contains("canary-7f3"), "{shown}");
        assert!(
            shown.contains("svc"),
            "what is not a secret is shown: {shown}"
        );
    }
}
