//! # saga-core
//!
//! The stable contract of saga-exactly-once, a framework that makes saga steps on Kafka take effect exactly
//! once: what a service implements ([`SagaStep`], [`TwoPhaseStep`]), the message a step receives
//! ([`Message`]) and the events it emits ([`Event`], [`SagaEvent`]), step keys (`{original-key}:{step-name}`)
//! and the key a step hands to outside systems ([`ExternalKey`]). Services run their steps with
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
//! use saga_core::{Message, SagaEvent, SagaStep, StepContext, StepName, StepOutcome, StepResult, Subscription};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct PaymentProcessed { order_id: i64 }
//! impl SagaEvent for PaymentProcessed { const TYPE: &'static str = "PaymentProcessed"; }
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct ShipmentArranged { order_id: i64 }
//! impl SagaEvent for ShipmentArranged { const TYPE: &'static str = "ShipmentArranged"; }
//!
//! struct ArrangeShipment;
//!
//! impl SagaStep for ArrangeShipment {
//!     type Payload = PaymentProcessed;
//!
//!     fn name(&self) -> StepName {
//!         StepName::from_static("arrange-shipment")
//!     }
//!
//!     fn subscriptions(&self) -> Vec<Subscription> {
//!         vec![Subscription::of::<PaymentProcessed>("saga.payments")]
//!     }
//!
//!     async fn handle(&self, msg: &Message<PaymentProcessed>, ctx: &mut StepContext<'_>) -> StepResult {
//!         let order_id = msg.payload.order_id;
//!         sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
//!             .bind(order_id)
//!             .execute(ctx.conn())
//!             .await?;
//!         ctx.emit_to("saga.shipping", order_id.to_string(), &ShipmentArranged { order_id })?;
//!         Ok(StepOutcome::completed())
//!     }
//! }
//! # let _ = ArrangeShipment;
//! ```

#![deny(missing_docs)]

mod context;
mod envelope;
mod event;
pub mod headers;
mod key;
mod step;
pub mod testing;

pub use context::{BatchContext, StepContext};
pub use envelope::{
    EnvelopeError, Event, EventMetadata, Lineage, MAX_EVENT_TYPE_LEN, Message, Origin,
    OutboxMessage, RawMessage,
};
pub use event::SagaEvent;
pub use headers::{Header, HeaderError, Headers, TraceParent};
pub use key::{
    DEFAULT_TENANT, ExternalKey, IdempotencyKey, KeyError, MAX_IDEMPOTENCY_KEY_LEN,
    MAX_STEP_NAME_LEN, MAX_TENANT_LEN, StepKey, StepName, TenantId,
};
/// The SQL toolkit a step writes with: [`StepContext::conn`] is a `sqlx` connection.
pub use sqlx;
pub use step::{
    ErrorKind, SagaStep, StepError, StepOutcome, StepResult, Subscription, TwoPhaseStep,
};
