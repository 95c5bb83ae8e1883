//! # outbox-relay
//!
//! Publishes the rows of the transactional outbox (written by the saga consumer in the same transaction as
//! each step, and by the HTTP layer) to Kafka with the idempotent producer, and marks (or deletes) each row
//! only after the broker acknowledged it. Also the `outbox-relay` binary (`run`, `migrate`, `status`, `gc`).
//! `saga-consumer`'s `SagaService` embeds it by default; run it on its own to scale publishing apart.
//!
//! - **Order.** Writers lock a row's partition key before the row gets its id, so for one key id order is
//!   commit order; the relay publishes each key's rows in id order. A failed row holds its key.
//! - **No gaps.** Every row carries its own publication mark; there is no "published up to id N" watermark
//!   that a late-committing row could slip under.
//! - **Crash safety.** A crash between publishing and marking publishes the rows again (at least once; the
//!   consumers' step keys absorb the duplicates). A broker outage makes the relay wait.
//! - **Several instances.** Instances share the key space's 64 shards through PostgreSQL advisory locks;
//!   one key has one publisher at a time, and a dead instance's shards are taken over.
//! - **Poison rows.** A row the broker refuses for good is parked after a few attempts, not retried forever.
//! - **The write-ahead log.** With `SAGA_OUTBOX_MODE=wal`, services write their events as logical messages
//!   instead of rows, and the relay reads them through the schema's replication slot in commit order,
//!   confirming the slot's position only after the broker acknowledged everything before it. One relay
//!   reads a slot; others stand by and take over when it dies.
//!
//! # Examples
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/orders").await?;
//! let relay = outbox_relay::Relay::builder().from_env().pool(pool).build()?;
//! relay.run(async { tokio::signal::ctrl_c().await.ok(); }).await?;
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

mod cli;
mod gc;
mod hooks;
mod kafka_security;
mod key_order;
mod metrics;
#[cfg(test)]
mod model;
mod parked;
mod publisher;
mod relay;
mod settings;
mod shards;
mod slot_admin;
mod store;
mod wal;
mod wal_batch;
#[cfg(test)]
mod wal_model;

#[doc(hidden)]
pub use cli::command;
pub use cli::main;
pub use gc::{RetentionPolicy, RetentionReport, run_retention};
pub use hooks::{PublishAttempt, PublishHooks};
pub use kafka_security::{SaslMechanism, Secret, SecurityProtocol};
pub use parked::{ParkedEvent, discard_parked, parked_events, retry_parked};
pub use relay::{Relay, RelayBuilder, RelayError, RelayProbe};
pub use saga_config::{Cause, KafkaConfig, OutboxMode};
pub use settings::{DatabaseArgs, KafkaArgs, OutboxArgs, RelayArgs, RetentionArgs, SchemaArgs};
pub use slot_admin::{
    RetiredSlot, SlotError, SlotIncident, lost_step_keys, recover_slot, retire_slot, slot_incidents,
};
#[doc(hidden)]
pub use store::drain_without_broker;
pub use store::{AfterPublish, Backlog, WalBacklog, backlog};
