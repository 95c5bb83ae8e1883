//! # saga-runtime
//!
//! Plumbing shared by the consumer runtime (`saga-consumer`) and the relay (`outbox-relay`), kept out of
//! `saga-core` so that a service's steps do not depend on a broker client:
//!
//! - [`kafka`]: client configuration, the idempotent producer, topic creation, header conversion.
//! - [`ops`]: the HTTP endpoint with Prometheus metrics, `/healthz` and `/readyz`.
//! - [`shutdown`]: a cancellation token fired by SIGTERM or Ctrl-C.
//! - [`telemetry`]: tracing set-up for binaries.

pub mod kafka;
pub mod ops;
pub mod shutdown;
pub mod telemetry;
