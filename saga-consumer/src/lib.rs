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
//! A whole service: one step, run until SIGTERM or Ctrl-C.
//!
//! ```no_run
//! use saga_consumer::{Message, SagaEvent, SagaService, SagaStep, StepContext, StepName, StepOutcome,
//!                     StepResult, Subscription};
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
//!     fn name(&self) -> StepName { StepName::from_static("arrange-shipment") }
//!     fn subscriptions(&self) -> Vec<Subscription> { vec![Subscription::of::<PaymentProcessed>("saga.payments")] }
//!     async fn handle(&self, msg: &Message<PaymentProcessed>, ctx: &mut StepContext<'_>) -> StepResult {
//!         let order_id = msg.payload.order_id;
//!         saga_consumer::sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
//!             .bind(order_id)
//!             .execute(ctx.conn())
//!             .await?;
//!         ctx.emit_to("saga.shipping", order_id.to_string(), &ShipmentArranged { order_id })?;
//!         Ok(StepOutcome::completed())
//!     }
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let pool = saga_consumer::sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
//!     saga_consumer::SagaService::builder()
//!         .from_env() // KAFKA_BROKERS and SAGA_GROUP_ID are required
//!         .pool(pool)
//!         .step(ArrangeShipment)
//!         .build()?
//!         .run(saga_consumer::shutdown_signal())
//!         .await?;
//!     Ok(())
//! }
//! ```

#![deny(missing_docs)]

mod config;
mod connection;
mod consumer;
mod dedup;
mod delivery;
mod dlq;
mod error;
mod executor;
mod fast;
mod guard;
mod handler;
mod hooks;
mod metrics;
pub mod migrate;
mod offsets;
mod partition;
mod poll;
mod retry;
mod runner;
mod service;

pub use config::{AssignmentStrategy, ConsumerSettings};
pub use consumer::{SagaConsumer, SagaConsumerBuilder};
pub use dlq::{DeadLetterReason, headers as dlq_headers};
pub use error::{ConfigError, ConsumerError};
pub use hooks::{CommitInfo, Hooks};
pub use retry::RetryPolicy;
pub use runner::{
    Extension, SagaService, SagaServiceBuilder, ServiceError, TaskContext, TaskError,
    shutdown_signal,
};
pub use saga_core::*;
pub use saga_runtime::config::ConfigProblem;
pub use saga_runtime::kafka::KafkaConfig;
pub use saga_runtime::ops::OpsHandle;
pub use service::{
    BoxStepService, Handled, HandlerPanicked, HandlerTimedOut, StepItem, StepRequest, StepService,
};

/// The `Idempotency-Key` layer for HTTP entry points: a `tower` layer, usable with axum.
///
/// A request with a new key runs its handler in a transaction that also claims the key and stores the
/// response; the handler writes with [`http::IdempotentRequest::transaction`] and starts the saga with
/// [`http::IdempotentRequest::emit`]. A retry gets the stored response (`Idempotent-Replayed: true`); the
/// same key with another request gets 422; a key still in flight gets 409.
///
/// # Examples
///
/// ```no_run
/// use axum::{Router, http::StatusCode, routing::post};
/// use saga_consumer::StepName;
/// use saga_consumer::http::{IdempotencyLayer, IdempotentRequest};
///
/// async fn create_order(request: IdempotentRequest) -> StatusCode {
///     let mut tx = request.transaction().await;
///     let written = saga_consumer::sqlx::query("INSERT INTO orders (key) VALUES ($1)")
///         .bind(request.key().as_str())
///         .execute(&mut *tx)
///         .await;
///     drop(tx);
///     if written.is_err() {
///         return StatusCode::SERVICE_UNAVAILABLE; // a 5xx rolls everything back; the key is free again
///     }
///     request.emit(saga_consumer::Event::new("OrderCreated", "orders", request.key().as_str(), &"…").unwrap());
///     StatusCode::CREATED
/// }
///
/// # fn app(pool: saga_consumer::sqlx::PgPool) -> Router {
/// Router::new().route(
///     "/orders",
///     post(create_order).layer(IdempotencyLayer::new(pool, StepName::from_static("create-order"))),
/// )
/// # }
/// ```
pub mod http {
    pub use saga_runtime::http::{
        IDEMPOTENCY_KEY_HEADER, Idempotency, IdempotencyConfig, IdempotencyLayer,
        IdempotentRequest, REPLAYED_HEADER, RequestTransaction, TENANT_HEADER,
    };
}

/// The optional Redis fast path for hot keys (feature `redis`), PostgreSQL still the source of truth: an
/// in-flight lock and a replay cache in front of the HTTP layer ([`http::IdempotencyLayer::with_fast_path`]),
/// and a pre-check of step keys in front of the consumer's claims ([`SagaConsumerBuilder::fast_path`]).
///
/// Turn it on where collisions on one key are frequent (a button pressed by many clients, a duplicate
/// storm after a producer's retry loop); for rare collisions PostgreSQL alone is simpler and as correct.
///
/// # Examples
///
/// ```no_run
/// # async fn example(pool: saga_consumer::sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use saga_consumer::fast_path::{FastPath, FastPathSettings};
///
/// // REDIS_URL unset: None, and everything runs on PostgreSQL alone.
/// let fast_path = match FastPathSettings::from_env()? {
///     Some(settings) => Some(FastPath::new(settings, &pool).await?),
///     None => None,
/// };
/// # let _ = fast_path; Ok(()) }
/// ```
#[cfg(feature = "redis")]
pub mod fast_path {
    pub use saga_runtime::fast_path::{
        CachedResponse, FastPath, FastPathSettings, InFlight, LockAnswer, RECONNECT_INTERVAL,
    };
}

/// Tracing set-up for a service's `main`: log lines on stderr and, with the feature `otel`, the framework's
/// spans exported over OTLP (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME`).
///
/// ```no_run
/// # async fn run() {}
/// # async fn main_() {
/// let _tracing = saga_consumer::telemetry::init_tracing(); // flushes the last spans when dropped
/// run().await;
/// # }
/// ```
pub mod telemetry {
    #[cfg(feature = "otel")]
    pub use saga_runtime::telemetry::{OtelLayer, otel_layer};
    pub use saga_runtime::telemetry::{TracingGuard, init_tracing};
    #[cfg(feature = "otel")]
    pub use saga_runtime::trace::{SampledOut, SampledOutFilter};
}
