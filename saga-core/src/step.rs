//! The contract a service implements: a saga step, what it consumes, and what its handler may return.
//!
//! A step's handler runs inside the PostgreSQL transaction that also records its step key and its outbox
//! rows, so its writes, its key and its follow-up events commit together or not at all.
//!
//! - [`SagaStep`] is the transactional mode (the default): everything happens in one transaction.
//! - [`TwoPhaseStep`] is for steps that must call a system outside the database (a payment gateway): the
//!   key is leased in a short transaction, the call runs outside any transaction with the step key as its
//!   own idempotency key, and a second transaction completes the step.

use std::future::Future;
use std::time::Duration;

use serde::Serialize;

use crate::context::{BatchContext, StepContext};
use crate::envelope::Message;
use crate::event::{FromEvent, SagaEvent, Topic};
use crate::key::StepName;

/// What a step consumes: events of one type on one topic.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Subscription {
    topic: String,
    event_type: String,
}

impl Subscription {
    /// Every event `topic` carries: one subscription per event type of `E` (several for a family).
    pub fn to<E: SagaEvent>(topic: &Topic<E>) -> Vec<Self> {
        E::TYPES
            .iter()
            .map(|event_type| Self::new(topic.name(), *event_type))
            .collect()
    }

    /// Events of type `event_type` on `topic`, for types known only at run time. Prefer
    /// [`Subscription::to`].
    pub fn new(topic: impl Into<String>, event_type: impl Into<String>) -> Self {
        Self {
            topic: topic.into(),
            event_type: event_type.into(),
        }
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The event type (`ce_type`).
    pub fn event_type(&self) -> &str {
        &self.event_type
    }
}

/// How a handled step ended. Both variants are final: the step key is recorded with this outcome and a
/// redelivery is a duplicate.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum StepOutcome {
    /// The step took effect. The optional result is stored and reported to duplicates.
    Completed {
        /// The stored result.
        result: Option<serde_json::Value>,
    },
    /// A business rejection (a declined card): permanent, recorded as `failed`. Events emitted before
    /// returning it (such as `PaymentFailed`) are still published.
    Rejected {
        /// Why, for people.
        reason: String,
        /// Details stored with the key.
        details: Option<serde_json::Value>,
    },
}

impl StepOutcome {
    /// Completed without a stored result.
    pub fn completed() -> Self {
        Self::Completed { result: None }
    }

    /// Completed, storing `result` as JSON.
    pub fn completed_with(result: &impl Serialize) -> Result<Self, StepError> {
        let result = serde_json::to_value(result).map_err(StepError::permanent)?;
        Ok(Self::Completed {
            result: Some(result),
        })
    }

    /// A business rejection with a reason.
    pub fn rejected(reason: impl Into<String>) -> Self {
        Self::Rejected {
            reason: reason.into(),
            details: None,
        }
    }

    /// Whether the step took effect (not a rejection).
    pub fn is_completed(&self) -> bool {
        matches!(self, Self::Completed { .. })
    }

    /// What is stored with the key: a completion's result, or a rejection's details.
    pub fn stored(&self) -> Option<&serde_json::Value> {
        match self {
            Self::Completed { result } => result.as_ref(),
            Self::Rejected { details, .. } => details.as_ref(),
        }
    }

    /// A rejection's reason.
    pub fn rejection_reason(&self) -> Option<&str> {
        match self {
            Self::Completed { .. } => None,
            Self::Rejected { reason, .. } => Some(reason),
        }
    }
}

/// Whether retrying a failed handler can help.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Everything rolls back and the message is retried with backoff (a deadlock, a timeout, a service that is
    /// briefly down). After the retry budget is spent the message is dead-lettered.
    Transient,
    /// Retrying cannot help (a bug, data the handler cannot process): everything rolls back and the message
    /// is dead-lettered at once. A business "no" is not an error: return [`StepOutcome::Rejected`].
    Permanent,
}

/// A handler failure. Nothing the handler wrote is kept.
#[derive(Debug, thiserror::Error)]
#[error("{kind:?} step error: {source}")]
pub struct StepError {
    kind: ErrorKind,
    #[source]
    source: Box<dyn std::error::Error + Send + Sync + 'static>,
    message_index: Option<usize>,
}

impl StepError {
    /// A transient error: retry.
    pub fn transient(
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        Self {
            kind: ErrorKind::Transient,
            source: source.into(),
            message_index: None,
        }
    }

    /// A permanent error: dead-letter.
    pub fn permanent(
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        Self {
            kind: ErrorKind::Permanent,
            source: source.into(),
            message_index: None,
        }
    }

    /// Whether retrying can help.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// Says which message of a [`SagaStep::handle_batch`] call failed (its index in the call's slice), so
    /// that the runtime retries or dead-letters that one directly.
    #[must_use]
    pub fn in_message(mut self, index: usize) -> Self {
        self.message_index = Some(index);
        self
    }

    /// The index of the failing message within a batch call, if known.
    pub fn message_index(&self) -> Option<usize> {
        self.message_index
    }

    /// Whether a database error means the database cannot take statements now, rather than that a
    /// statement failed: the connection was refused or lost, the pool is exhausted, the server is shutting
    /// down, starting or recovering (SQLSTATE 57P01, 57P02, 57P03, class 08, too many connections 53300),
    /// or it is read-only (25006: a switchover left the connection on a server that is no primary any
    /// more). The runtime waits those out without spending retry budgets, and does not reuse a connection
    /// that reported one.
    pub fn is_connection_error(err: &sqlx::Error) -> bool {
        match err {
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed
            | sqlx::Error::Protocol(_) => true,
            sqlx::Error::Database(db) => db.code().is_some_and(|code| is_unavailable_code(&code)),
            _ => false,
        }
    }

    /// Whether the error means the database itself is unavailable (see [`StepError::is_connection_error`]:
    /// connection refused or lost, pool exhausted, server shutting down or read-only after a switchover).
    /// The runtime retries those without spending the message's retry budget, so a database outage or a
    /// failover stalls consumption instead of dead-lettering every message.
    pub fn is_database_unavailable(&self) -> bool {
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(self.source.as_ref());
        while let Some(err) = source {
            if let Some(sqlx_err) = err.downcast_ref::<sqlx::Error>() {
                return Self::is_connection_error(sqlx_err);
            }
            source = err.source();
        }
        false
    }
}

/// Whether SQLSTATE `code` says the server cannot take statements now (see
/// [`StepError::is_connection_error`]).
fn is_unavailable_code(code: &str) -> bool {
    code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03" | "53300" | "25006")
}

impl From<sqlx::Error> for StepError {
    /// Database errors are transient: deadlocks, serialization failures and lost connections go away on retry.
    fn from(err: sqlx::Error) -> Self {
        Self::transient(err)
    }
}

impl From<serde_json::Error> for StepError {
    /// A value that does not serialize will not serialize next time either.
    fn from(err: serde_json::Error) -> Self {
        Self::permanent(err)
    }
}

/// What a handler returns.
pub type StepResult = Result<StepOutcome, StepError>;

/// A saga step in transactional mode: the key is claimed, the handler runs and its outbox rows are written,
/// all in one PostgreSQL transaction.
///
/// # Examples
///
/// ```
/// use saga_core::{Message, SagaEvent, SagaStep, StepContext, StepName, StepOutcome, StepResult, Subscription, Topic};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize, SagaEvent)]
/// #[saga(crate = "saga_core")]
/// struct PaymentProcessed { order_id: i64 }
///
/// #[derive(Serialize, Deserialize, SagaEvent)]
/// #[saga(crate = "saga_core")]
/// struct ShipmentArranged { order_id: i64 }
///
/// struct ArrangeShipment {
///     payments: Topic<PaymentProcessed>,
///     shipping: Topic<ShipmentArranged>,
/// }
///
/// impl SagaStep for ArrangeShipment {
///     type Payload = PaymentProcessed;
///     fn name(&self) -> StepName { StepName::from_static("arrange-shipment") }
///     fn subscriptions(&self) -> Vec<Subscription> { Subscription::to(&self.payments) }
///     async fn handle(&self, msg: &Message<PaymentProcessed>, ctx: &mut StepContext<'_>) -> StepResult {
///         let order_id = msg.payload().order_id;
///         sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)").bind(order_id).execute(ctx.conn()).await?;
///         ctx.emit(&self.shipping, order_id.to_string(), &ShipmentArranged { order_id })?;
///         Ok(StepOutcome::completed())
///     }
/// }
/// # let _ = ArrangeShipment { payments: Topic::new("payments"), shipping: Topic::new("shipping") };
/// ```
pub trait SagaStep: Send + Sync + 'static {
    /// The decoded payload type: an event (see [`SagaEvent`]), a family of events, or any `Deserialize`
    /// type.
    type Payload: FromEvent;

    /// The step's name; part of every step key.
    fn name(&self) -> StepName;

    /// What the step consumes: one or more event types. All of them share the step's key, so the step
    /// runs once per saga whichever arrives first (`cancel-order` on `PaymentFailed` or `PaymentRefunded`).
    fn subscriptions(&self) -> Vec<Subscription>;

    /// Handles one message inside the open transaction. Must not commit or roll back (it cannot: it only
    /// sees the connection). Returning `Err` rolls everything back.
    fn handle(
        &self,
        msg: &Message<Self::Payload>,
        ctx: &mut StepContext<'_>,
    ) -> impl Future<Output = StepResult> + Send;

    /// Handles several consecutive messages of one partition (all new to this step) in the open
    /// transaction, in order, returning one outcome per message. The default calls
    /// [`SagaStep::handle`] for each; override it to write the batch with multi-row statements.
    ///
    /// An error rolls the whole transaction back. If it names the failing message
    /// ([`StepError::in_message`]; the default implementation does), the messages before it commit and it
    /// is retried alone; otherwise the runtime narrows the batch down, one message per transaction. Either
    /// way only the failing message is retried or dead-lettered.
    fn handle_batch(
        &self,
        msgs: &[&Message<Self::Payload>],
        ctx: &mut BatchContext<'_>,
    ) -> impl Future<Output = Result<Vec<StepOutcome>, StepError>> + Send {
        async move {
            let mut outcomes = Vec::with_capacity(msgs.len());
            for (index, msg) in msgs.iter().enumerate() {
                let mut single = ctx.for_message(msg);
                let outcome = self
                    .handle(msg, &mut single)
                    .await
                    .map_err(|e| e.in_message(index))?;
                outcomes.push(outcome);
            }
            Ok(outcomes)
        }
    }
}

/// A saga step in two-phase mode, for work outside the database.
///
/// 1. The runtime leases the step key as `started` in a short transaction.
/// 2. [`TwoPhaseStep::call`] runs outside any transaction. It must pass [`Message::external_key`] to the
///    external system as that system's own idempotency key, because after a crash it runs again.
/// 3. [`TwoPhaseStep::complete`] runs in a second transaction that also marks the key `completed` (or
///    `failed`), fenced by the lease's attempt number: a worker whose lease was taken over cannot complete.
///
/// # Examples
///
/// ```
/// use saga_core::{Message, StepContext, StepError, StepName, StepOutcome, StepResult, Subscription, TwoPhaseStep};
///
/// /// A payment provider's client (its own idempotency on the key it is handed).
/// struct Provider;
/// impl Provider {
///     async fn charge(&self, idempotency_key: &str, cents: i64) -> Result<String, std::io::Error> {
///         Ok(format!("ch_{idempotency_key}_{cents}"))
///     }
/// }
///
/// struct Charge { provider: Provider }
///
/// impl TwoPhaseStep for Charge {
///     type Payload = serde_json::Value;
///     type Response = String;
///     fn name(&self) -> StepName { StepName::from_static("charge") }
///     fn subscriptions(&self) -> Vec<Subscription> { vec![Subscription::new("orders", "OrderPlaced")] }
///     async fn call(&self, msg: &Message<serde_json::Value>) -> Result<String, StepError> {
///         let cents = msg.payload()["cents"].as_i64().unwrap_or(0);
///         // The external key carries the tenant: never hand the bare step key to a provider.
///         self.provider.charge(msg.external_key().as_str(), cents).await.map_err(StepError::transient)
///     }
///     async fn complete(&self, msg: &Message<serde_json::Value>, charge_id: String, ctx: &mut StepContext<'_>) -> StepResult {
///         sqlx::query("INSERT INTO payments (charge_id) VALUES ($1)").bind(&charge_id).execute(ctx.conn()).await?;
///         StepOutcome::completed_with(&serde_json::json!({ "charge_id": charge_id }))
///     }
/// }
/// # let _ = Charge { provider: Provider };
/// ```
pub trait TwoPhaseStep: Send + Sync + 'static {
    /// The decoded payload type (see [`SagaStep::Payload`]).
    type Payload: FromEvent;
    /// What the external call returns.
    type Response: Send + 'static;

    /// The step's name; part of every step key.
    fn name(&self) -> StepName;

    /// What the step consumes (see [`SagaStep::subscriptions`]).
    fn subscriptions(&self) -> Vec<Subscription>;

    /// How long a lease lasts; after that another worker may take the key over. Must exceed the longest
    /// external call. Defaults to 30 seconds.
    fn lease(&self) -> Duration {
        Duration::from_secs(30)
    }

    /// The external call, outside any transaction. It may run more than once for one message (after a crash,
    /// or when a lease expired), so it must hand the external system [`Message::external_key`] as that
    /// system's own idempotency key: the external system then returns the first call's result.
    ///
    /// The external key, never the client's key or the step's name alone: a client's key is unique only
    /// within its tenant, while the external system usually serves every tenant with one account, so two
    /// tenants whose clients sent the same key would share one effect (one tenant's order paid with the
    /// other's charge).
    fn call(
        &self,
        msg: &Message<Self::Payload>,
    ) -> impl Future<Output = Result<Self::Response, StepError>> + Send;

    /// Records the call's result in the completing transaction.
    fn complete(
        &self,
        msg: &Message<Self::Payload>,
        response: Self::Response,
        ctx: &mut StepContext<'_>,
    ) -> impl Future<Output = StepResult> + Send;
}
