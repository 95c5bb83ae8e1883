//! # saga-orchestrator
//!
//! Orchestrated sagas, beside the choreographed ones: an orchestrator owns each saga instance's state in
//! PostgreSQL and drives its steps by sending commands and reacting to replies.
//!
//! - [`SagaDefinition`]: the steps in order, each with its command, the replies that complete or fail it,
//!   an optional [`definition::Compensation`] and a timeout.
//! - [`Orchestrator`]: starts instances (idempotent on the client's key), handles replies through
//!   ordinary consumer steps (deduplicated by their step keys), fires durable timers, and applies every
//!   transition as an optimistic-concurrency update in the same transaction as the commands it sends.
//! - On a permanent failure it compensates the completed steps in reverse, each with its own key
//!   `{original-key}:compensate-{step}`; a compensation is re-sent until confirmed, never skipped.
//!
//! Decisions are a pure function ([`engine::decide`]); [`store`] persists them.

#![deny(missing_docs)]

pub mod definition;
pub mod engine;
mod error;
pub mod migrate;
mod orchestrator;
pub mod store;

pub use definition::{Command, OnTimeout, SagaDefinition, Step};
pub use engine::{Decision, SagaStatus};
pub use error::OrchestratorError;
pub use orchestrator::{Orchestrator, ReplyStep, SagaHooks};
pub use store::{SagaInstance, Transition};
