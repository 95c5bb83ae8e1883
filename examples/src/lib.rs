//! # The order → payment → shipping saga
//!
//! The example the framework is judged by: three services that talk only through Kafka, each with its own
//! PostgreSQL schema and outbox.
//!
//! - [`order`]: `POST /orders` behind the Idempotency-Key layer, `GET /orders/{id}`, and the steps that
//!   follow the saga to its end.
//! - [`payment`]: `process-payment` (two-phase, around the simulated [`gateway`]) and the compensating
//!   `refund-payment`.
//! - [`shipping`], with the step `arrange-shipment`.
//! - [`service`]: running a service (consumer, embedded relay, HTTP).
//!
//! The demo runner, the chaos program, the benchmark and the test harness are the lab's (`lab/`).

//!
//! # Examples
//!
//! Run the payment service in this process, against the broker and database of the environment, until
//! Ctrl-C:
//!
//! ```no_run
//! use clap::Parser;
//! use saga_examples::service::{self, Service, ServiceArgs};
//!
//! #[derive(Parser)]
//! struct Cli {
//!     #[command(flatten)]
//!     args: ServiceArgs,
//! }
//!
//! # async fn example() -> anyhow::Result<()> {
//! let cli = Cli::parse();
//! service::run(Service::Payment, cli.args, saga_consumer::shutdown_signal()).await
//! # }
//! ```

#![deny(missing_docs)]

pub mod events;
pub mod gateway;
pub mod order;
pub mod payment;
pub mod service;
pub mod shipping;
