//! # saga-runtime
//!
//! Plumbing shared by the consumer runtime (`saga-consumer`) and the relay (`outbox-relay`), kept out of
//! `saga-core` so that a service's steps do not depend on a broker client:
//!
//! - [`cli`]: argument parsing and exit codes for binaries (bad input: one line, exit code 2).
//! - [`config`]: configuration problems found at start-up, and the checks that find them.
//! - [`kafka`]: client configuration, the idempotent producer, topic creation, header conversion.
//! - [`ops`]: the HTTP endpoint with Prometheus metrics, `/healthz` and `/readyz`.
//! - [`shutdown`]: a cancellation token fired by SIGTERM or Ctrl-C.
//! - [`telemetry`]: tracing set-up for binaries.

#![deny(missing_docs)]

pub mod cli;
pub mod config;
pub mod kafka;
pub mod ops;
pub mod shutdown;
pub mod telemetry;
