//! The outbox on PostgreSQL's write-ahead log: a transaction's events as one transactional logical message
//! (`pg_logical_emit_message`), which logical decoding delivers to the relay at commit, in commit order, with
//! no table, no index, no lock and nothing to delete afterwards.
//!
//! - **Mode.** [`OutboxMode`]: `table` (the default: needs no server setting) or `wal` (`SAGA_OUTBOX_MODE`).
//!   Every writer of the framework (steps, the HTTP layer, the orchestrator) goes through
//!   [`super::outbox::Outbox::append`].
//! - **Write.** [`emit`]: one statement per transaction, `pg_logical_emit_message(true, 'saga-outbox:' ||
//!   current_schema(), batch)`, the batch encoded by [`codec`].
//! - **Read.** The relay reads the schema's slot through the `pgoutput` plugin with logical messages on,
//!   keeps the messages of its [`prefix`], and [`decode`]s them.
//! - **Set-up and safety.** [`slot`]: the slot's name (database and schema), its creation under a lock, the
//!   schema's record of it, and its recovery after it was lost. [`monitor`]: the process's watch over the
//!   slot, which stops its writers within seconds of the slot being lost. [`fence`]: the switch from the table
//!   outbox, schema-wide.

pub mod codec;
pub mod fence;
pub mod monitor;
pub mod slot;

use saga_core::OutboxMessage;
use sqlx::PgConnection;

pub use codec::{DecodeError, WalEvent, decode, encode, encoded_len, storable};
pub use saga_config::OutboxMode;
pub use slot::{
    PrepareError, RecoverError, Recovery, SlotLag, SlotRecord, SlotState, WalOutbox, drop_slot,
    legacy_slot_name, prepare, recover, slot_lag, slot_name,
};

/// The publication the `pgoutput` plugin is started with: it holds no table (only messages are read).
pub const PUBLICATION: &str = "saga_outbox_wal";

/// The prefix of the logical messages of `schema`'s outbox.
pub fn prefix(schema: &str) -> String {
    format!("saga-outbox:{schema}")
}

/// Writes `messages` to the write-ahead log in the caller's transaction, as one transactional logical
/// message of the current schema's prefix: decoded for the relay when the transaction commits, never if it
/// rolls back. The framework's writers go through [`super::outbox::Outbox::append`], which checks the
/// outbox is writable and the size limit first.
pub async fn emit(conn: &mut PgConnection, messages: &[OutboxMessage]) -> Result<(), sqlx::Error> {
    if messages.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "SELECT pg_logical_emit_message(true, 'saga-outbox:' || current_schema(), $1::bytea)",
    )
    .bind(encode(messages))
    .execute(conn)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn modes_parse() {
        use super::OutboxMode;
        assert_eq!(OutboxMode::parse("WAL").unwrap(), OutboxMode::Wal);
        assert!(OutboxMode::parse("kafka").is_err());
    }
}
