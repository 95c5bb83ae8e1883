//! # saga-admin
//!
//! See and repair sagas: the library behind the `saga` command and its inspector page. It works against
//! any service's schema and dead-letter topics, configured like the rest of the framework (`DATABASE_URL`,
//! `SAGA_SCHEMA`, `KAFKA_BROKERS`, `KAFKA_PROPERTY_*`).
//!
//! - [`dlq`]: list, show and replay dead letters. A replay sends each letter, once, to the retry topic of
//!   the consumer group that gave up on it (never to the original topic, which other groups read); the
//!   table `saga_dlq_replays` records what was replayed and `saga_dlq_replay_log` who replayed it.
//! - [`groups`]: dead letters grouped by a fingerprint of their cause; [`operations`]: a whole group
//!   replayed or discarded (reversibly) as a durable, resumable, cancellable operation.
//! - [`trace`]: one saga across every service schema: its step keys, the events they wrote, dead
//!   letters, replays and orchestrated transitions, ordered by time.
//! - [`keys`]: the step keys derived from a client's key, and two-phase leases that ran out.
//! - [`holds`]: keys held behind a dead letter or a paused step (per-key order through failures), and
//!   pausing and resuming a step.
//! - [`sagas`]: orchestrated saga instances and their transitions as a timeline.
//! - [`lag`]: a consumer group's committed offsets, high watermarks and lag.
//! - [`outbox`]: the relay's backlog.
//! - [`inspect`]: the inspector page, server-rendered HTML that reads through the same functions.
//! - [`audit`]: the audit log of every state-changing action of the command and the page.
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
//! use saga_config::KafkaConfig;
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

pub mod audit;
mod broker;
mod cli;
#[doc(hidden)]
#[cfg(feature = "redis")]
pub mod configuration;
pub mod dlq;
// Public for the fuzz targets only (fuzz/), not part of the API.
#[doc(hidden)]
pub mod duration;
mod error;
pub mod freshness;
pub mod groups;
pub mod holds;
pub mod index;
pub mod inspect;
pub mod keys;
pub mod lag;
pub mod operations;
pub mod outbox;
pub mod sagas;
mod table;
pub mod trace;

#[doc(hidden)]
pub use cli::command;
pub use cli::main;
pub use error::AdminError;
