//! # saga-runtime
//!
//! **No semver guarantees.** An internal crate of saga-exactly-once: what the framework's crates share, kept
//! out of `saga-core` (the contract steps implement) so that the contract stays small and free of broker
//! clients. Any release may change any of it; the framework's crates depend on it with an exact version
//! (`=0.2.0`). Depend on `saga-consumer` (services), `outbox-relay` (the relay), `saga-orchestrator` or
//! `saga-admin` instead: they own every type a user names.
//!
//! - [`store`]: the PostgreSQL idempotency store, the outbox writer, garbage collection, migrations.
//! - [`kafka`]: client configuration, the idempotent producer, topic creation, header conversion.
//! - [`ops`]: the HTTP endpoint with Prometheus metrics, `/healthz` and `/readyz`.
//! - [`replay`]: the headers of a dead letter replayed into its group's retry topic.
//! - [`shutdown`]: a cancellation token fired by SIGTERM or Ctrl-C.
//! - [`telemetry`]: tracing set-up for binaries, with OTLP export under the feature `otel`.
//! - [`trace`]: the framework's spans and the W3C trace context they carry through HTTP, the outbox and
//!   Kafka (OpenTelemetry spans under the feature `otel`).
//! - [`cli`], [`config`]: exit codes and one-line configuration errors for binaries.
//!
//! # Examples
//!
//! A setting that keeps a binary from starting is reported as one line naming it:
//!
//! ```
//! use saga_runtime::config::ConfigProblem;
//!
//! let problem = ConfigProblem::new("KAFKA_BROKERS", "is not set", "set it to the bootstrap servers");
//! assert_eq!(problem.to_string(), "KAFKA_BROKERS: is not set; set it to the bootstrap servers");
//! ```

#![deny(missing_docs)]

pub mod cli;
pub mod config;
pub mod kafka;
mod kafka_probe;
pub mod ops;
pub mod replay;
pub mod settings;
pub mod shutdown;
pub mod store;
pub mod telemetry;
pub mod trace;
