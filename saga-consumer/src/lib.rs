//! # saga-consumer
//!
//! The runtime that runs a service's saga steps from Kafka, exactly once in effect.
//!
//! ```ignore
//! SagaConsumer::builder()
//!     .from_env()
//!     .group_id("payment-service")
//!     .pool(pool)
//!     .step(ProcessPayment::new(gateway))
//!     .build()?
//!     .run(saga_runtime::shutdown::on_signal())
//!     .await?;
//! ```
//!
//! For each message the runtime derives the step key from the `idempotency-key` header, claims it in a
//! PostgreSQL transaction, runs the step's handler in that transaction, writes the handler's follow-up
//! events to the outbox in it, commits, and only then lets the message's offset be committed. A redelivery
//! finds the key done and is skipped. Messages of one partition run in order, several per transaction;
//! partitions run concurrently. Transient failures are retried with backoff; messages that cannot be
//! processed go to a dead-letter topic with the reason. See `ARCHITECTURE.md` for the invariants.

#![deny(missing_docs)]

mod config;
mod consumer;
mod dedup;
mod delivery;
mod dlq;
mod error;
mod executor;
mod guard;
mod handler;
mod hooks;
mod metrics;
pub mod migrate;
mod offsets;
mod partition;
mod poll;
mod retry;
mod service;

pub use config::{AssignmentStrategy, ConsumerSettings};
pub use consumer::{SagaConsumer, SagaConsumerBuilder};
pub use delivery::PoisonReason;
pub use dlq::{DeadLetter, DeadLetterReason, headers as dlq_headers};
pub use error::{ConfigError, ConsumerError};
pub use hooks::{CommitInfo, Hooks};
pub use metrics::ConsumerMetrics;
pub use retry::RetryPolicy;
pub use service::{
    BoxStepService, CatchPanic, CatchPanicLayer, Handled, HandlerPanicked, HandlerService,
    HandlerTimedOut, InstrumentLayer, Instrumented, StepItem, StepRequest, StepService, Timeout,
    TimeoutLayer,
};
