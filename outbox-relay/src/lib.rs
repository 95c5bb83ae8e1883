//! # outbox-relay
//!
//! Publishes the rows of the transactional outbox (`saga_outbox`, written by `saga_core::outbox::append`)
//! to Kafka with the idempotent producer, and marks (or deletes) each row only after the broker
//! acknowledged it.
//!
//! - **Order.** Writers lock a row's partition key before the row gets its id, so for one key id order is
//!   commit order; the relay publishes each key's rows in id order.
//! - **No gaps.** Every row carries its own publication mark; there is no "published up to id N" watermark
//!   that a late-committing row could slip under.
//! - **Crash safety.** A crash between publishing and marking publishes the rows again (at least once; the
//!   consumers' step keys absorb the duplicates). A broker outage makes the relay wait.
//! - **Several instances.** Instances share the key space's 64 shards through PostgreSQL advisory locks;
//!   one key has one publisher at a time, and a dead instance's shards are taken over.

#![deny(missing_docs)]

pub mod cli;
pub mod gc;
pub mod metrics;
pub mod publisher;
pub mod relay;
pub mod shards;
pub mod store;

pub use relay::{Relay, RelayError, RelaySettings};
pub use store::AfterPublish;
