//! # saga-core
//!
//! The contract of saga-exactly-once, a framework that makes saga steps on Kafka take effect exactly once:
//! what a service implements (a [`step`] function, or the [`SagaStep`] and [`TwoPhaseStep`] traits), the
//! message a step receives ([`Message`]), the events it consumes and emits ([`SagaEvent`] on typed
//! [`Topic`]s), and the key a step hands to outside systems ([`ExternalKey`]). Services run their steps with
//! `saga-consumer`, which re-exports this crate; [`testing`] helps test a step on its own.
//!
//! No broker client type appears here: a step sees a decoded [`Message`] and the open transaction's
//! connection through a [`StepContext`]. sqlx is re-exported ([`sqlx`]) because that connection is its type.
//!
//! # Examples
//!
//! A step that records a shipment and emits `ShipmentArranged`, in one transaction with its step key:
//!
//! ```
//! use saga_core::{Message, SagaEvent, StepContext, StepOutcome, StepResult, Topic, step};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize, SagaEvent)]
//! #[saga(crate = "saga_core")]
//! struct PaymentProcessed { order_id: i64 }
//!
//! #[derive(Serialize, Deserialize, SagaEvent)]
//! #[saga(crate = "saga_core")]
//! struct ShipmentArranged { order_id: i64 }
//!
//! const PAYMENTS: Topic<PaymentProcessed> = Topic::fixed("saga.payments");
//! const SHIPPING: Topic<ShipmentArranged> = Topic::fixed("saga.shipping");
//!
//! async fn arrange_shipment(msg: &Message<PaymentProcessed>, ctx: &mut StepContext<'_>) -> StepResult {
//!     let order_id = msg.payload().order_id;
//!     sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
//!         .bind(order_id)
//!         .execute(ctx.conn())
//!         .await?;
//!     ctx.emit(&SHIPPING, order_id.to_string(), &ShipmentArranged { order_id })?;
//!     Ok(StepOutcome::completed())
//! }
//!
//! let arrange = step("arrange-shipment", arrange_shipment).on(&PAYMENTS);
//! # let _ = arrange;
//! ```

#![deny(missing_docs)]

mod context;
mod envelope;
mod event;
mod function;
#[doc(hidden)]
pub mod headers;
mod key;
mod shared_step;
mod step;
pub mod testing;
mod two_phase;

pub use context::{BatchContext, StepContext};
#[doc(hidden)]
pub use envelope::{
    EnvelopeError, EventMetadata, MAX_EVENT_TYPE_LEN, Origin, OutboxHeader, OutboxMessage,
    RawMessage,
};
pub use envelope::{Event, Lineage, Message};
pub use event::{FromEvent, SagaEvent, Topic};
pub use function::{FnStep, LayeredStep, StepCall, StepFn, StepFnWith, step, step_with};
#[doc(hidden)]
pub use function::{Invoke, Stateful, Stateless};
#[doc(hidden)]
pub use headers::{Header, HeaderError, Headers, TraceParent};
#[doc(hidden)]
pub use key::{
    DEFAULT_TENANT, MAX_IDEMPOTENCY_KEY_LEN, MAX_STEP_NAME_LEN, MAX_TENANT_LEN, StepKey,
};
pub use key::{ExternalKey, IdempotencyKey, KeyError, StepName, TenantId};
/// `#[derive(SagaEvent)]`: see the trait [`SagaEvent`].
pub use saga_macros::SagaEvent;
pub use shared_step::SharedStep;
/// The SQL toolkit a step writes with: [`StepContext::conn`] is a `sqlx` connection.
pub use sqlx;
pub use step::{
    ErrorKind, SagaStep, StepError, StepOutcome, StepResult, Subscription, TwoPhaseStep,
};
pub use two_phase::{
    CallFn, CompleteCall, CompleteFn, Completion, LayeredTwoPhase, TwoPhaseFn, two_phase,
};

/// What `#[derive(SagaEvent)]` expands to uses; not an API.
#[doc(hidden)]
pub mod __private {
    pub use serde;
    pub use serde_json;
}
