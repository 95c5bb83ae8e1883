//! The toolkit's errors.

use saga_config::{BadInput, Cause, ConfigProblem};
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
    /// The broker failed (the client's error kept as the cause), or did not answer as it must.
    #[error("kafka: {0}")]
    Kafka(#[source] Cause),
    /// The key store failed, or answered with something this version cannot read (the store's error kept
    /// as the cause).
    #[error("key store: {0}")]
    Store(#[source] Cause),
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

    /// The broker's error, kept as the cause (a crate-private conversion: no rdkafka type in the public
    /// API, not even in a `From` implementation).
    pub(crate) fn kafka(e: rdkafka::error::KafkaError) -> Self {
        Self::Kafka(Cause::new(e))
    }

    /// The broker's error `e` while `doing`, kept as the cause.
    pub(crate) fn kafka_doing(
        doing: String,
        e: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Kafka(Cause::new(Doing {
            doing,
            source: Box::new(e),
        }))
    }

    /// The broker did not answer as it must: `what` says how.
    pub(crate) fn kafka_said(what: impl Into<String>) -> Self {
        Self::Kafka(Cause::message(what))
    }

    /// Whether the caller can fix it (bad input or configuration), as opposed to a failure.
    pub fn is_caller_error(&self) -> bool {
        matches!(self, Self::Config(_) | Self::BadInput(_))
    }
}

/// What was being done when a part failed, and its error (the cause's message says both; its source is the
/// part's error).
#[derive(Debug, thiserror::Error)]
#[error("{doing}: {source}")]
struct Doing {
    doing: String,
    #[source]
    source: Box<dyn std::error::Error + Send + Sync>,
}

impl From<ConfigProblem> for AdminError {
    fn from(problem: ConfigProblem) -> Self {
        Self::Config(problem)
    }
}

impl AdminError {
    /// The key store's error, kept as the cause (crate-private: the store's type is not part of this API).
    pub(crate) fn store(e: saga_runtime::store::idempotency::StoreError) -> Self {
        match e {
            saga_runtime::store::idempotency::StoreError::Database(d) => Self::Database(d),
            other => Self::Store(Cause::new(other)),
        }
    }
}
