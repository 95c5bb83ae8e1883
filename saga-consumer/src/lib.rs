//! # saga-consumer
//!
//! Runs a service's saga steps from Kafka, exactly once in effect: the crate a service depends on. It
//! re-exports the contract (`saga-core`: [`SagaStep`], [`Message`], [`StepContext`], ...), so one dependency
//! is enough.
//!
//! For each message the runtime derives the step key from the `idempotency-key` header, claims it in a
//! PostgreSQL transaction, runs the step's handler in that transaction, writes the handler's follow-up
//! events to the outbox in it, commits, and only then lets the message's offset be committed. A redelivery
//! finds the key done and is skipped. Messages of one partition run in order, several per transaction;
//! partitions run concurrently. Transient failures are retried with backoff; messages that cannot be
//! processed go to a dead-letter topic with the reason. The outbox relay, embedded by default, publishes
//! the emitted events. See `ARCHITECTURE.md` for the invariants.
//!
//! - [`SagaService`]: the runner (migrations, topics, consumer, embedded relay, background tasks).
//! - [`SagaConsumer`]: the consumer alone, for services that run the relay apart.
//! - [`http`]: the `Idempotency-Key` layer for HTTP entry points (tower, usable with axum).
//! - [`StepService`]: the handler as a service, for layers of one's own ([`SagaServiceBuilder::layer`]).
//!
//! # Examples
//!
//! A whole service: one step, an async function, run until SIGTERM or Ctrl-C.
//!
//! ```no_run
//! use saga_consumer::{Message, SagaEvent, SagaService, StepContext, StepOutcome, StepResult, Topic, step};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize, SagaEvent)]
//! struct PaymentProcessed { order_id: i64 }
//!
//! #[derive(Serialize, Deserialize, SagaEvent)]
//! struct ShipmentArranged { order_id: i64 }
//!
//! const PAYMENTS: Topic<PaymentProcessed> = Topic::fixed("saga.payments");
//! const SHIPPING: Topic<ShipmentArranged> = Topic::fixed("saga.shipping");
//!
//! async fn arrange_shipment(msg: &Message<PaymentProcessed>, ctx: &mut StepContext<'_>) -> StepResult {
//!     let order_id = msg.payload().order_id;
//!     saga_consumer::sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
//!         .bind(order_id)
//!         .execute(ctx.conn())
//!         .await?;
//!     ctx.emit(&SHIPPING, order_id.to_string(), &ShipmentArranged { order_id })?;
//!     Ok(StepOutcome::completed())
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let pool = saga_consumer::sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
//!     SagaService::builder()
//!         .from_env() // KAFKA_BROKERS and SAGA_GROUP_ID are required
//!         .pool(pool)
//!         .step(step("arrange-shipment", arrange_shipment).on(&PAYMENTS))
//!         .build()?
//!         .run(saga_consumer::shutdown_signal())
//!         .await?;
//!     Ok(())
//! }
//! ```

#![deny(missing_docs)]

mod builder;
mod config;
mod connection;
mod consumer;
mod crash_gate;
#[cfg(test)]
mod crash_record;
mod db_retry;
mod dedup;
mod delivery;
mod dlq;
mod error;
mod executor;
mod fast;
#[cfg(feature = "redis")]
pub mod fast_path;
mod guard;
mod handler;
mod hold;
mod hold_gate;
#[cfg(test)]
mod hold_model;
mod hooks;
pub mod http;
mod key_lanes;
#[cfg(test)]
mod lanes_model;
mod letters;
mod machine;
mod metrics;
pub mod migrate;
#[cfg(test)]
mod model;
mod offsets;
mod ops;
mod outbox;
mod partition;
mod poll;
mod retry;
#[cfg(test)]
mod retry_lanes_model;
mod runner;
mod service;
pub mod settings;
pub mod setup;
mod step_tx;
mod two_phase;

pub use builder::{ConsumerParts, SagaBuilder, SagaConsumerBuilder};
pub use config::AssignmentStrategy;
pub use consumer::SagaConsumer;
pub use dlq::{DeadLetterReason, headers as dlq_headers};
pub use error::{BrokerError, Cause, ConfigError, ConsumerError};
pub use hold::OrderPolicy;
pub use hooks::{CommitInfo, Hooks};
pub use ops::OpsHandle;
pub use outbox::{Outbox, OutboxWriteError};
pub use retry::RetryPolicy;
pub use runner::{
    Extension, SagaService, SagaServiceBuilder, ServiceError, ServiceParts, TaskContext, TaskError,
    shutdown_signal,
};
pub use saga_config::{BadInput, ConfigProblem, KafkaConfig, OutboxMode};
pub use saga_core::*;
pub use service::{
    BoxStepService, HandlerPanicked, HandlerTimedOut, StepItem, StepRequest, StepResponse,
    StepService,
};

pub mod telemetry;

/// What operators' tools do to a consumer group's tables: release its held keys, know when a pause takes
/// effect, read and index its dead letters. The `saga` command and the test kit use it; its statements
/// take a PostgreSQL connection or pool (no broker client crosses it).
pub mod admin {
    /// How long after it is written a pause takes effect (`saga_paused_steps.effective_at`).
    pub use crate::hold::PAUSE_DELAY;
    /// A held key's state and cause, as the table names them: one source for the consumer and its tools.
    pub use crate::hold::{HoldCause, HoldState, UnknownHold};
    /// Releasing held keys (`saga_held_keys`): what a discard, a resume or `saga keys release` does.
    pub use crate::hold::{Released, release as release_held, releasing_keys};

    /// Dead letters as records, and their index (`saga_dead_letters`).
    pub mod letters {
        pub use crate::letters::{
            HeaderPair, IndexedLetter, LetterFields, MAX_INDEXED_ERROR, MAX_INDEXED_NAME,
            UNREADABLE, failure_group, header, identity, index, indexable, normalise,
        };
    }
}
