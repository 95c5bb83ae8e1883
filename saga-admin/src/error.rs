//! The toolkit's errors.

use saga_config::{BadInput, ConfigProblem};
use saga_orchestrator::OrchestratorError;

/// Why an admin operation failed. [`AdminError::Config`] and [`AdminError::BadInput`] are the caller's to
/// fix (the `saga` command answers them in one line with exit code 2); the others are failures of the
/// database or the broker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// A setting is missing or wrong (names it and what to do).
    #[error("{0}")]
    Config(#[source] ConfigProblem),
    /// Input the operation cannot act on: an unknown topic or id, a topic that is not a dead-letter topic, a
    /// dead letter whose `dlq-*` headers are missing or malformed.
    #[error("{0}")]
    BadInput(#[source] BadInput),
    /// The database failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// The broker failed.
    #[error("kafka: {0}")]
    Kafka(String),
    /// The key store answered with something this version cannot read.
    #[error("key store: {0}")]
    Store(String),
    /// Migrations could not be applied (`what` says whose).
    #[error("applying {what}: {source}")]
    Migrations {
        /// Whose migrations.
        what: &'static str,
        /// Why.
        #[source]
        source: sqlx::migrate::MigrateError,
    },
    /// The inspector could not listen or serve.
    #[error("serving the inspector: {0}")]
    Serve(#[source] std::io::Error),
    /// Redis failed (`doing` says at what).
    #[error("{doing}: {source}")]
    Redis {
        /// What was being done.
        doing: String,
        /// Why.
        #[source]
        source: saga_consumer::Cause,
    },
    /// The toolkit failed in itself (a task it ran ended abnormally): a bug to report.
    #[error("{0}")]
    Internal(String),
    /// Another process holds what this one waits for, for longer than it waits (another sync of a topic's
    /// index).
    #[error("{0}")]
    Busy(String),
    /// The dead-letter index could not be brought up to date before a read: why, and how stale it is
    /// (see [`crate::freshness`]).
    #[error("{0}")]
    Stale(crate::freshness::Staleness),
    /// Reading saga instances failed.
    #[error("{0}")]
    Orchestrator(#[from] OrchestratorError),
}

impl AdminError {
    /// Bad input, said in one line.
    pub fn bad_input(message: impl Into<String>) -> Self {
        Self::BadInput(BadInput::new(message))
    }

    /// The broker's error, said (a crate-private conversion: no rdkafka type in the public API, not even
    /// in a `From` implementation).
    #[allow(clippy::needless_pass_by_value)] // `map_err(Self::kafka)` hands the error over
    pub(crate) fn kafka(e: rdkafka::error::KafkaError) -> Self {
        Self::Kafka(e.to_string())
    }

    /// Whether the caller can fix it (bad input or configuration), as opposed to a failure.
    pub fn is_caller_error(&self) -> bool {
        matches!(self, Self::Config(_) | Self::BadInput(_))
    }
}

impl From<ConfigProblem> for AdminError {
    fn from(problem: ConfigProblem) -> Self {
        Self::Config(problem)
    }
}

impl AdminError {
    /// The key store's error, said (crate-private: the store's type is not part of this API).
    #[allow(clippy::needless_pass_by_value)] // `map_err(AdminError::store)` hands the error over
    pub(crate) fn store(e: saga_runtime::store::idempotency::StoreError) -> Self {
        match e {
            saga_runtime::store::idempotency::StoreError::Database(d) => Self::Database(d),
            other => Self::Store(other.to_string()),
        }
    }
}
