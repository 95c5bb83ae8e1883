//! The orchestrator's errors.

use saga_core::StepError;
use uuid::Uuid;

/// Why an orchestrator operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OrchestratorError {
    /// The database failed.
    #[error("orchestrator: {0}")]
    Database(#[from] sqlx::Error),
    /// Another transition of the same instance committed first; retry in a fresh transaction.
    #[error("saga {saga_id} moved past version {version} meanwhile")]
    VersionConflict {
        /// The instance.
        saga_id: Uuid,
        /// The version this transition started from.
        version: i32,
    },
    /// A reply names a saga this orchestrator does not know.
    #[error("no {saga_type} saga for key {key} of tenant {tenant}")]
    UnknownSaga {
        /// The saga type.
        saga_type: String,
        /// The tenant.
        tenant: String,
        /// The idempotency key.
        key: String,
    },
    /// No saga has this id.
    #[error("there is no saga {0}")]
    NoSuchSaga(Uuid),
    /// The saga is finished: there is nothing to retry.
    #[error(
        "saga {saga_id} is {status}: only a running or compensating saga can be retried (a compensated \
         saga's completed steps were undone; start a new saga instead)"
    )]
    NotRetryable {
        /// The saga.
        saga_id: Uuid,
        /// Its status.
        status: String,
    },
    /// Stored state this version cannot read.
    #[error("orchestrator: unreadable state: {0}")]
    Corrupt(String),
    /// An instance's data does not read as the saga's data type (or, stored by 0.2, the definition does
    /// not read 0.2 data).
    #[error("saga {saga_id}: {reason}")]
    Unreadable {
        /// The instance.
        saga_id: Uuid,
        /// Why.
        reason: String,
    },
    /// An instance runs a version of the definition this orchestrator does not have.
    #[error(
        "saga {saga_id} runs version {version} of its definition, and this orchestrator has versions \
         {known:?} (keep version {version} with Orchestrator::keep_running until its instances finish)"
    )]
    UnknownVersion {
        /// The instance.
        saga_id: Uuid,
        /// The version it runs.
        version: i32,
        /// The versions this orchestrator has.
        known: Vec<u32>,
    },
    /// A reply does not decode as its step's reply type: the saga stays where it is.
    #[error("saga {saga_id}: {reason}")]
    BadReply {
        /// The instance.
        saga_id: Uuid,
        /// Why.
        reason: String,
    },
    /// A command could not be built from the saga's data.
    #[error("saga {saga_id}: {source}")]
    BadCommand {
        /// The instance.
        saga_id: Uuid,
        /// Why.
        #[source]
        source: crate::definition::CommandError,
    },
    /// A hook failed.
    #[error("orchestrator hook: {0}")]
    Hook(#[from] StepError),
    /// The outbox may not be written now (in WAL mode, its slot is lost): the transition is tried again
    /// once it may.
    #[error("orchestrator: {0}")]
    OutboxUnavailable(#[source] saga_consumer::OutboxWriteError),
    /// The outbox refuses the transition's events for good (larger than it accepts).
    #[error("orchestrator: {0}")]
    OutboxRefused(#[source] saga_consumer::OutboxWriteError),
}

impl OrchestratorError {
    /// The orchestrator's error for what the outbox said.
    pub(crate) fn of_outbox(e: saga_consumer::OutboxWriteError) -> Self {
        use saga_consumer::OutboxWriteError;
        match e {
            OutboxWriteError::Database(e) => Self::Database(e),
            e @ OutboxWriteError::Refused(_) => Self::OutboxRefused(e),
            other => Self::OutboxUnavailable(other),
        }
    }
}

impl From<OrchestratorError> for StepError {
    /// Conflicts and database failures are transient (the consumer retries in a fresh transaction, which
    /// re-reads the instance); an unknown saga or unreadable state will not get better.
    fn from(e: OrchestratorError) -> Self {
        match e {
            OrchestratorError::Hook(inner) => inner,
            OrchestratorError::Database(_)
            | OrchestratorError::VersionConflict { .. }
            | OrchestratorError::OutboxUnavailable(_) => StepError::transient(e),
            // Newer than every version here: a rolling deploy, whose newer orchestrators will take it.
            OrchestratorError::UnknownVersion {
                version, ref known, ..
            } if known.iter().all(|&k| i64::from(k) < i64::from(version)) => {
                StepError::transient(e)
            }
            OrchestratorError::UnknownVersion { .. }
            | OrchestratorError::Unreadable { .. }
            | OrchestratorError::BadReply { .. }
            | OrchestratorError::BadCommand { .. } => StepError::permanent(e),
            OrchestratorError::UnknownSaga { .. }
            | OrchestratorError::OutboxRefused(_)
            | OrchestratorError::NoSuchSaga(_)
            | OrchestratorError::NotRetryable { .. }
            | OrchestratorError::Corrupt(_) => StepError::permanent(e),
        }
    }
}
