//! # saga-orchestrator
//!
//! Orchestrated sagas, beside the choreographed ones: an orchestrator owns each saga instance's state in
//! PostgreSQL and drives its steps by sending commands and reacting to replies.
//!
//! - [`SagaDefinition`]: the saga's data (a type of the user's, `D`), its steps in order, each with its
//!   command (built from `&D`), its typed replies (applied to `D`, each returning a [`Verdict`]), an optional
//!   [`definition::Compensation`] and a timeout; and its version.
//! - [`Orchestrator`]: starts instances (idempotent on the client's key), handles replies through
//!   ordinary consumer steps (deduplicated by their step keys), fires durable timers, and applies every
//!   transition as an optimistic-concurrency update in the same transaction as the commands it sends.
//!   Instances keep the version they started with ([`Orchestrator::keep_running`]); those stored by 0.2 are
//!   read by the definition that says how ([`SagaDefinition::reads_untyped`]).
//! - On a permanent failure it compensates the completed steps in reverse, each with its own key
//!   `{original-key}:compensate-{step}`; a compensation is re-sent until confirmed, never skipped.
//!
//! Decisions are a pure function of the definition, the instance's state and an event; [`store`] reads
//! instances and their history.
//!
//! # Examples
//!
//! ```no_run
//! use std::time::Duration;
//! use saga_consumer::{SagaEvent, Topic};
//! use saga_orchestrator::{Command, OnTimeout, Orchestrator, SagaDefinition, Step, Verdict};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Clone, Serialize, Deserialize)]
//! struct Order { order_id: i64, charge_id: Option<String> }
//!
//! #[derive(Serialize, Deserialize, SagaEvent)]
//! struct ProcessPayment { order_id: i64 }
//! #[derive(Serialize, Deserialize, SagaEvent)]
//! struct PaymentProcessed { charge_id: String }
//! #[derive(Serialize, Deserialize, SagaEvent)]
//! struct ArrangeShipment { order_id: i64 }
//! #[derive(Serialize, Deserialize, SagaEvent)]
//! struct ShipmentArranged { order_id: i64 }
//!
//! const PAYMENTS: Topic<ProcessPayment> = Topic::fixed("payment-commands");
//! const SHIPPING: Topic<ArrangeShipment> = Topic::fixed("shipping-commands");
//!
//! # fn example(pool: saga_consumer::sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let payment = Step::new("process-payment", Command::to(&PAYMENTS, |o: &Order| ProcessPayment { order_id: o.order_id }))?
//!     .replies(|o: &mut Order, paid: PaymentProcessed| {
//!         o.charge_id = Some(paid.charge_id);
//!         Verdict::Succeeded
//!     })
//!     .timeout(Duration::from_secs(60), OnTimeout::Fail);
//! let shipment = Step::new("arrange-shipment", Command::to(&SHIPPING, |o: &Order| ArrangeShipment { order_id: o.order_id }))?
//!     .replies(|_: &mut Order, _: ShipmentArranged| Verdict::Succeeded);
//! let saga = SagaDefinition::new("order-fulfillment", "order-replies")?.step(payment).step(shipment);
//!
//! // Its reply steps, its tables and its timers join the service.
//! let service = saga_consumer::SagaService::builder()
//!     .from_env()
//!     .pool(pool)
//!     .with(Orchestrator::new(saga)?)
//!     .build()?;
//! # let _ = service; Ok(()) }
//! ```

#![deny(missing_docs)]

mod clock;
pub mod definition;
mod engine;
mod error;
pub mod migrate;
mod orchestrator;
pub mod store;

pub use clock::SagaClock;
pub use definition::{
    Command, CommandError, LegacyData, OnTimeout, SagaData, SagaDefinition, Step, Verdict,
};
pub use engine::{Decision, Outgoing, SagaState, SagaStatus};
pub use error::OrchestratorError;
pub use orchestrator::{Orchestrator, RawReply, ReplyStep, SagaChange, SagaHooks, Started};
/// A step name both sides of an orchestrated saga read from one declaration ([`Step::shared`]).
pub use saga_core::SharedStep;
pub use store::{SagaInstance, Transition};

/// The README's code, compiled and checked as doc tests so that it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
mod readme {}

/// The guide's code, compiled and checked as doc tests (docs/guide).
#[cfg(doctest)]
mod guide {
    #[doc = include_str!("../../docs/guide/getting-started.md")]
    mod getting_started {}
    #[doc = include_str!("../../docs/guide/writing-steps.md")]
    mod writing_steps {}
    #[doc = include_str!("../../docs/guide/two-phase-steps.md")]
    mod two_phase_steps {}
    #[doc = include_str!("../../docs/guide/orchestrated-sagas.md")]
    mod orchestrated_sagas {}
    #[doc = include_str!("../../docs/guide/http-layer.md")]
    mod http_layer {}
    #[doc = include_str!("../../docs/guide/operating.md")]
    mod operating {}
    #[doc = include_str!("../../docs/guide/ordering.md")]
    mod ordering {}
    #[doc = include_str!("../../docs/guide/redis-fast-path.md")]
    mod redis_fast_path {}
    #[doc = include_str!("../../docs/guide/tracing.md")]
    mod tracing_guide {}
    #[doc = include_str!("../../docs/guide/wal-outbox.md")]
    mod wal_outbox {}
    #[doc = include_str!("../../docs/guide/configuration.md")]
    mod configuration {}
    #[doc = include_str!("../../docs/guide/deployment.md")]
    mod deployment {}
    #[doc = include_str!("../../docs/guide/slow-steps.md")]
    mod slow_steps {}
    #[doc = include_str!("../../docs/guide/connecting.md")]
    mod connecting {}
    #[doc = include_str!("../../docs/guide/how-it-works.md")]
    mod how_it_works {}
}
