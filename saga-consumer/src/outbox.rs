//! The outbox a service writes its steps' follow-up events to: a value every writer of the service holds
//! (its consumer, its HTTP layer, an orchestrator), made by the service's builder
//! ([`SagaServiceBuilder::outbox`](crate::SagaServiceBuilder::outbox)) and opened when the service starts.
//! Its mode and its health travel with it: in WAL mode, a lost slot makes every clone unwritable within
//! seconds.

use saga_config::{Cause, OutboxMode};
use saga_core::OutboxMessage;
use saga_runtime::store::outbox::OutboxError;
use sqlx::PgConnection;

/// Where and how a service writes its outbox (cheap to clone: the clones share its health).
#[derive(Clone, Debug, Default)]
pub struct Outbox(saga_runtime::store::outbox::Outbox);

impl Outbox {
    /// A table outbox with the default size limit, writable at once: what a writer uses when it is given
    /// none.
    pub fn table() -> Self {
        Self::default()
    }

    /// An outbox of `mode` whose writes are at most `max_transaction_bytes`. A WAL outbox is writable
    /// only once the service opened it (set up its slot).
    pub fn new(mode: OutboxMode, max_transaction_bytes: usize) -> Self {
        Self(
            saga_runtime::store::outbox::Outbox::new(mode)
                .with_max_transaction_bytes(max_transaction_bytes),
        )
    }

    /// Where it writes.
    pub fn mode(&self) -> OutboxMode {
        self.0.mode()
    }

    /// The largest size of one write of a transaction's events, in bytes
    /// (`SAGA_OUTBOX_MAX_TRANSACTION_BYTES`).
    pub fn max_transaction_bytes(&self) -> usize {
        self.0.max_transaction_bytes()
    }

    /// Whether events may be written now.
    pub fn is_writable(&self) -> bool {
        self.0.health().is_writable()
    }

    /// Appends `messages` to the outbox in the caller's transaction `conn`, in order (the relay publishes
    /// each key's events in the order their transactions commit). Refuses while the outbox may not be
    /// written, and events it cannot take. Write a transaction's events with one call where possible: two
    /// calls that lock keys in opposite orders can deadlock with another transaction doing the same.
    ///
    /// The framework's own writers' (the orchestrator's): a step emits its events through its
    /// `StepContext`, an HTTP handler through the layer's `IdempotentRequest`. Not part of the API.
    #[doc(hidden)]
    pub async fn append(
        &self,
        conn: &mut PgConnection,
        messages: &[OutboxMessage],
    ) -> Result<(), OutboxWriteError> {
        match self.0.append(conn, messages).await {
            Ok(_) => Ok(()),
            Err(OutboxError::Database(e)) => Err(OutboxWriteError::Database(e)),
            Err(e @ (OutboxError::TooLarge { .. } | OutboxError::Refused { .. })) => {
                Err(OutboxWriteError::Refused(Cause::new(e)))
            }
            Err(e) => Err(OutboxWriteError::Unwritable(Cause::new(e))),
        }
    }

    /// The runtime's outbox, for the framework's writers in this crate.
    pub(crate) fn runtime(&self) -> &saga_runtime::store::outbox::Outbox {
        &self.0
    }
}

/// Why a write of events to the outbox (the orchestrator's) wrote nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxWriteError {
    /// The database failed.
    #[error("writing the outbox: {0}")]
    Database(#[source] sqlx::Error),
    /// The outbox may not be written now (in WAL mode: its slot is lost or gone): committing would lose the
    /// events. Transient: wait it out, as an unavailable database.
    #[error("{0}")]
    Unwritable(#[source] Cause),
    /// The outbox refuses these events for good: larger than its limit
    /// (`SAGA_OUTBOX_MAX_TRANSACTION_BYTES`), or holding a NUL character.
    #[error("{0}")]
    Refused(#[source] Cause),
}
