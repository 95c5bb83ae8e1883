//! # saga-admin
//!
//! See and repair sagas: the library behind the `saga` command and its inspector page. It works against
//! any service's schema and dead-letter topics, configured like the rest of the framework (`DATABASE_URL`,
//! `SAGA_SCHEMA`, `KAFKA_BROKERS`, `KAFKA_PROPERTY_*`).
//!
//! - [`dlq`]: list, show and replay dead letters. A replay re-produces each message to its original topic
//!   and partition, once: the table `saga_dlq_replays` records what was replayed.
//! - [`keys`]: the step keys derived from a client's key, and two-phase leases that ran out.
//! - [`sagas`]: orchestrated saga instances and their transitions as a timeline.
//! - [`lag`]: a consumer group's committed offsets, high watermarks and lag.
//! - [`outbox`]: the relay's backlog.
//! - [`inspect`]: the inspector page, server-rendered HTML that reads through the same functions.
//!
//! Errors are [`AdminError`]s: [`AdminError::Config`] and [`AdminError::BadInput`] are the caller's to fix,
//! and the `saga` binary answers them in one line with exit code 2.
//!
//! # Examples
//!
//! Replay the dead letters a payment step gave up on, once each:
//!
//! ```no_run
//! use saga_admin::dlq::{self, DlqFilter, ReplayOptions};
//! use saga_runtime::kafka::KafkaConfig;
//!
//! # async fn example(pool: sqlx::PgPool) -> Result<(), saga_admin::AdminError> {
//! let kafka = KafkaConfig::new("127.0.0.1:9092");
//! let mut filter = DlqFilter::default();
//! filter.step = Some("process-payment".to_owned());
//! let report = dlq::replay(&kafka, &pool, "payment-commands.dlq", &filter, &ReplayOptions::default()).await?;
//! println!("{} sent", report.sent());
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

mod broker;
pub mod cli;
pub mod dlq;
pub mod duration;
mod error;
pub mod inspect;
pub mod keys;
pub mod lag;
pub mod outbox;
pub mod sagas;
mod table;

pub use cli::main;
pub use error::AdminError;
