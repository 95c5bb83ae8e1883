//! What a handler gets besides its message: the open transaction's connection and a way to emit
//! follow-up events into the outbox of that same transaction.

use std::sync::Arc;

use sqlx::PgConnection;

use crate::envelope::{Event, Lineage, Message, OutboxMessage};
use crate::event::{SagaEvent, Topic};
use crate::headers::names;
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
    emitted: &'t mut Vec<OutboxMessage>,
    /// Where [`StepContext::reply`] sends.
    reply_to: ReplyTo,
}

/// Where a step's message asks to be answered.
#[derive(Debug, Clone)]
enum ReplyTo {
    /// It asks for no answer.
    Unasked,
    /// To `topic`, keyed by `key` (the saga's).
    To { topic: Arc<str>, key: Arc<str> },
    /// It names a topic no reply may go to: why.
    Refused(Arc<str>),
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
    /// A context over `conn` (inside a transaction), for events of `lineage` emitted by `source` (the step's
    /// name), collected in `emitted` (the runtime's; tests use [`crate::testing`]).
    #[doc(hidden)]
    pub fn new(
        conn: &'t mut PgConnection,
        lineage: Lineage,
        source: &'t str,
        emitted: &'t mut Vec<OutboxMessage>,
    ) -> Self {
        Self {
            conn,
            lineage,
            source,
            emitted,
            reply_to: ReplyTo::Unasked,
        }
    }

    /// The context answering `cause`: [`StepContext::reply`] sends to the topic its `saga-reply-to` header
    /// names, keyed by its `saga-id` (the runtime's).
    #[doc(hidden)]
    pub fn answering<P>(mut self, cause: &Message<P>) -> Self {
        if let Some(topic) = cause.header(names::REPLY_TO) {
            self.reply_to = match refusal(topic, cause.topic()) {
                None => {
                    let key = cause
                        .header(names::SAGA_ID)
                        .unwrap_or_else(|| cause.idempotency_key().as_str());
                    ReplyTo::To {
                        topic: topic.into(),
                        key: key.into(),
                    }
                }
                Some(why) => ReplyTo::Refused(why.into()),
            };
        }
        self
    }

    /// The open transaction's connection, for the handler's business reads and writes.
    pub fn conn(&mut self) -> &mut PgConnection {
        self.conn
    }

    /// Emits `event` to `topic`, keyed by `partition_key` (the aggregate id, which decides the partition
    /// and the order). It is written to the outbox when the handler returns successfully, and discarded
    /// with everything else if it returns an error.
    pub fn emit<E: SagaEvent>(
        &mut self,
        topic: &Topic<E>,
        partition_key: impl Into<String>,
        event: &E,
    ) -> Result<(), StepError> {
        self.emit_event(Event::of(topic, partition_key, event)?);
        Ok(())
    }

    /// Answers the orchestrator whose command the step handles: `reply` goes to the reply topic the
    /// command names, keyed by the saga, with the saga's lineage (the orchestrator finds its instance by
    /// it), into the outbox with the step's other writes. The participant needs no view of the
    /// orchestrator's reply topic. A message that asks for no answer (not an orchestrator's command, or
    /// one naming no valid topic, a broker's own topic such as `__consumer_offsets`, or the topic it came
    /// from) fails the step permanently: it is dead-lettered with that reason. The reply is keyed by the
    /// command's `saga-id` (its idempotency key where it names none). A two-phase step that replies in its
    /// completion runs its outside call first: check `msg.header(names::REPLY_TO)` in the call to refuse a
    /// message no reply can answer before acting on it.
    ///
    /// ```
    /// # use saga_core::{Message, SagaEvent, StepContext, StepResult, StepOutcome};
    /// # #[derive(serde::Serialize, serde::Deserialize, SagaEvent)]
    /// # #[saga(crate = "saga_core")]
    /// # struct ProcessPayment { order_id: i64 }
    /// #[derive(serde::Serialize, serde::Deserialize, SagaEvent)]
    /// # #[saga(crate = "saga_core")]
    /// struct PaymentProcessed { charge_id: String }
    ///
    /// async fn process_payment(msg: &Message<ProcessPayment>, ctx: &mut StepContext<'_>) -> StepResult {
    ///     let charge_id = format!("ch-{}", msg.payload().order_id);
    ///     ctx.reply(&PaymentProcessed { charge_id })?;
    ///     Ok(StepOutcome::completed())
    /// }
    /// ```
    pub fn reply<E: SagaEvent>(&mut self, reply: &E) -> Result<(), StepError> {
        let (topic, key) = match &self.reply_to {
            ReplyTo::To { topic, key } => (topic.to_string(), key.to_string()),
            ReplyTo::Unasked => {
                return Err(StepError::permanent(format!(
                    "the step's message names no reply topic (`{}`): only an orchestrator's command \
                     can be replied to",
                    names::REPLY_TO
                )));
            }
            ReplyTo::Refused(why) => return Err(StepError::permanent(why.to_string())),
        };
        self.emit(&Topic::<E>::new(topic), key, reply)
    }

    /// The topic the step's message asks to be answered on, if it is an orchestrator's command: a step that
    /// serves a choreographed saga too replies when it is one, and emits otherwise.
    pub fn reply_topic(&self) -> Option<&str> {
        match &self.reply_to {
            ReplyTo::To { topic, .. } => Some(topic.as_ref()),
            ReplyTo::Unasked | ReplyTo::Refused(_) => None,
        }
    }

    /// Emits an event built at run time (see [`Event::new`]); prefer [`StepContext::emit`].
    pub fn emit_event(&mut self, event: Event) {
        self.emitted
            .push(OutboxMessage::from_event(event, &self.lineage, self.source));
    }

    /// The lineage emitted events inherit.
    pub fn lineage(&self) -> &Lineage {
        &self.lineage
    }

    /// A batch context over the same transaction and events: for a step whose `handle` hands its one
    /// message to its `handle_batch`.
    pub fn as_batch(&mut self) -> BatchContext<'_> {
        BatchContext::new(&mut *self.conn, self.source, &mut *self.emitted)
    }

    /// A context over the same transaction and events, borrowed for a shorter time (the runtime's: a
    /// function step's context).
    #[doc(hidden)]
    pub fn reborrow(&mut self) -> StepContext<'_> {
        StepContext {
            conn: &mut *self.conn,
            lineage: self.lineage.clone(),
            source: self.source,
            emitted: &mut *self.emitted,
            reply_to: self.reply_to.clone(),
        }
    }
}

/// The handler's view of the open transaction when it handles several messages at once
/// ([`crate::SagaStep::handle_batch`]).
pub struct BatchContext<'t> {
    conn: &'t mut PgConnection,
    source: &'t str,
    emitted: &'t mut Vec<OutboxMessage>,
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
    /// A context over `conn` for events emitted by `source` (the step's name), collected in `emitted` (the
    /// runtime's).
    #[doc(hidden)]
    pub fn new(
        conn: &'t mut PgConnection,
        source: &'t str,
        emitted: &'t mut Vec<OutboxMessage>,
    ) -> Self {
        Self {
            conn,
            source,
            emitted,
        }
    }

    /// The open transaction's connection.
    pub fn conn(&mut self) -> &mut PgConnection {
        self.conn
    }

    /// Emits `event` caused by `cause` to `topic`, keyed by `partition_key`; it inherits `cause`'s saga
    /// lineage.
    pub fn emit<P, E: SagaEvent>(
        &mut self,
        cause: &Message<P>,
        topic: &Topic<E>,
        partition_key: impl Into<String>,
        event: &E,
    ) -> Result<(), StepError> {
        self.emit_event(cause, Event::of(topic, partition_key, event)?);
        Ok(())
    }

    /// Emits an event built at run time, caused by `cause`; prefer [`BatchContext::emit`].
    pub fn emit_event<P>(&mut self, cause: &Message<P>, event: Event) {
        self.emitted.push(OutboxMessage::caused_by(
            event,
            cause.metadata(),
            self.source,
        ));
    }

    /// A single-message context for `cause`, sharing this batch's transaction and events.
    pub fn for_message<P>(&mut self, cause: &Message<P>) -> StepContext<'_> {
        StepContext::new(
            &mut *self.conn,
            cause.lineage(),
            self.source,
            &mut *self.emitted,
        )
        .answering(cause)
    }
}

/// Why no reply may go to topic `named` (by a message consumed from `from`), if none may: a name that is
/// no topic's, the broker's own topics (`__consumer_offsets`), or the topic the message came from (a
/// command naming its own topic would feed the participant its own replies).
fn refusal(named: &str, from: &str) -> Option<String> {
    let valid = (1..=249).contains(&named.len())
        && named != "."
        && named != ".."
        && named
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !valid {
        Some(format!(
            "the reply topic the message names ({named:?}) is no topic name: 1 to 249 of a-z, A-Z, \
             0-9, '.', '_' and '-'"
        ))
    } else if named.starts_with("__") {
        Some(format!(
            "the reply topic the message names ({named}) is one of the broker's own: no reply goes there"
        ))
    } else if named == from {
        Some(format!(
            "the reply topic the message names ({named}) is the topic it came from: no reply goes there"
        ))
    } else {
        None
    }
}
