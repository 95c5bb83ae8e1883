//! What a handler gets besides its message: the open transaction's connection and a way to emit
//! follow-up events into the outbox of that same transaction.

use sqlx::PgConnection;

use crate::envelope::{Event, Lineage, OutboxMessage};
use crate::event::SagaEvent;
use crate::step::StepError;

/// The handler's view of the open transaction.
///
/// Events passed to [`StepContext::emit`] inherit the saga's idempotency key, tenant and correlation id; the
/// runtime writes them to the outbox in the same transaction as the handler's own writes and the step key,
/// after the handler returns.
pub struct StepContext<'t> {
    conn: &'t mut PgConnection,
    lineage: Lineage,
    source: &'t str,
    emitted: Vec<OutboxMessage>,
}

impl std::fmt::Debug for StepContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepContext")
            .field("lineage", &self.lineage)
            .field("source", &self.source)
            .field("emitted", &self.emitted.len())
            .finish_non_exhaustive()
    }
}

impl<'t> StepContext<'t> {
    /// A context over `conn` (which should be inside a transaction), for events of `lineage` emitted by
    /// `source` (the step's name). The runtime builds these; tests of a step may too.
    pub fn new(conn: &'t mut PgConnection, lineage: Lineage, source: &'t str) -> Self {
        Self {
            conn,
            lineage,
            source,
            emitted: Vec::new(),
        }
    }

    /// The open transaction's connection, for the handler's business reads and writes.
    pub fn conn(&mut self) -> &mut PgConnection {
        self.conn
    }

    /// Emits a follow-up event. It is written to the outbox when the handler returns successfully, and
    /// discarded with everything else if it returns an error.
    pub fn emit(&mut self, event: Event) {
        self.emitted
            .push(OutboxMessage::from_event(event, &self.lineage, self.source));
    }

    /// Emits `event` to `topic`, keyed by `partition_key` (the aggregate id); its type comes from
    /// [`SagaEvent::TYPE`]. See [`StepContext::emit`].
    pub fn emit_to<E: SagaEvent>(
        &mut self,
        topic: impl Into<String>,
        partition_key: impl Into<String>,
        event: &E,
    ) -> Result<(), StepError> {
        self.emit(Event::of(topic, partition_key, event)?);
        Ok(())
    }

    /// The lineage emitted events inherit.
    pub fn lineage(&self) -> &Lineage {
        &self.lineage
    }

    /// The outbox rows emitted so far.
    pub fn emitted(&self) -> &[OutboxMessage] {
        &self.emitted
    }

    /// Ends the context, handing back what was emitted.
    pub fn into_emitted(self) -> Vec<OutboxMessage> {
        self.emitted
    }
}

/// The handler's view of the open transaction when it handles several messages at once
/// ([`crate::SagaStep::handle_batch`]).
pub struct BatchContext<'t> {
    conn: &'t mut PgConnection,
    source: &'t str,
    emitted: Vec<OutboxMessage>,
}

impl std::fmt::Debug for BatchContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchContext")
            .field("source", &self.source)
            .field("emitted", &self.emitted.len())
            .finish_non_exhaustive()
    }
}

impl<'t> BatchContext<'t> {
    /// A context over `conn` for events emitted by `source` (the step's name).
    pub fn new(conn: &'t mut PgConnection, source: &'t str) -> Self {
        Self {
            conn,
            source,
            emitted: Vec::new(),
        }
    }

    /// The open transaction's connection.
    pub fn conn(&mut self) -> &mut PgConnection {
        self.conn
    }

    /// Emits a follow-up event caused by `cause`; it inherits `cause`'s saga lineage.
    pub fn emit<P>(&mut self, cause: &crate::Message<P>, event: Event) {
        self.emitted.push(OutboxMessage::from_event(
            event,
            &cause.lineage(),
            self.source,
        ));
    }

    /// Emits `event` caused by `cause` to `topic`, keyed by `partition_key`; its type comes from
    /// [`SagaEvent::TYPE`].
    pub fn emit_to<P, E: SagaEvent>(
        &mut self,
        cause: &crate::Message<P>,
        topic: impl Into<String>,
        partition_key: impl Into<String>,
        event: &E,
    ) -> Result<(), StepError> {
        self.emit(cause, Event::of(topic, partition_key, event)?);
        Ok(())
    }

    /// A single-message context for `cause`, sharing this batch's connection; what it emits joins the
    /// batch's events when [`BatchContext::absorb`] takes it back.
    pub fn for_message<P>(&mut self, cause: &crate::Message<P>) -> StepContext<'_> {
        StepContext::new(&mut *self.conn, cause.lineage(), self.source)
    }

    /// Takes the events a single-message context emitted.
    pub fn absorb(&mut self, emitted: Vec<OutboxMessage>) {
        self.emitted.extend(emitted);
    }

    /// Ends the context, handing back what was emitted.
    pub fn into_emitted(self) -> Vec<OutboxMessage> {
        self.emitted
    }
}
