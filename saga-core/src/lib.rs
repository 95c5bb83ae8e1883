//! # saga-core
//!
//! The stable contract of the saga framework: what a service implements ([`SagaStep`], [`TwoPhaseStep`]),
//! the message envelope and its headers, step keys, the PostgreSQL idempotency store, and the outbox writer.
//! The consumer runtime (`saga-consumer`) and the relay (`outbox-relay`) build on it; a service's steps need
//! only this crate.
//!
//! No broker client type appears here: a step sees a decoded [`Message`] and the open transaction's
//! connection through a [`StepContext`].

#![deny(missing_docs)]

pub mod context;
pub mod envelope;
pub mod gc;
pub mod headers;
#[cfg(feature = "http")]
pub mod http;
pub mod idempotency;
pub mod key;
pub mod migrate;
pub mod outbox;
pub mod step;

pub use context::{BatchContext, StepContext};
pub use envelope::{
    EnvelopeError, Event, EventMetadata, Lineage, Message, Origin, OutboxMessage, RawMessage,
};
pub use headers::{Header, HeaderError, Headers, TraceParent};
pub use key::{ExternalKey, IdempotencyKey, KeyError, StepKey, StepName, TenantId};
pub use step::{
    ErrorKind, SagaStep, StepError, StepOutcome, StepResult, Subscription, TwoPhaseStep,
};
