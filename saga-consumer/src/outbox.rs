//! The outbox a service writes its steps' follow-up events to: a value every writer of the service holds
//! (its consumer, its HTTP layer, an orchestrator), made by the service's builder
//! ([`SagaServiceBuilder::outbox`](crate::SagaServiceBuilder::outbox)) and opened when the service starts.
//! Its mode and its health travel with it: in WAL mode, a lost slot makes every clone unwritable within
//! seconds.

use saga_config::OutboxMode;

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

    /// Whether events may be written now.
    pub fn is_writable(&self) -> bool {
        self.0.health().is_writable()
    }

    /// The runtime's outbox, for the framework's writers.
    #[doc(hidden)]
    pub fn runtime(&self) -> &saga_runtime::store::outbox::Outbox {
        &self.0
    }
}
