//! The outbox's backlog, as the relay sees it (one implementation: `outbox_relay::backlog`).

use serde::Serialize;
use sqlx::PgPool;

use crate::error::AdminError;

/// The state of the outbox in a schema.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct OutboxStatus {
    /// Rows waiting to be published.
    pub unpublished: i64,
    /// Age in seconds of the oldest waiting row.
    pub oldest_age_seconds: Option<f64>,
    /// Waiting rows whose publication failed at least once.
    pub failing: i64,
    /// Rows the broker refuses for good, set aside.
    pub parked: i64,
    /// Published rows kept until their retention ends.
    pub published_kept: i64,
    /// The outbox on the write-ahead log, where the schema has a slot for it.
    pub wal: Option<WalStatus>,
}

/// A schema's outbox on the write-ahead log: its slot and how far behind its relay is.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct WalStatus {
    /// The replication slot.
    pub slot: String,
    /// Whether a relay reads it now (an abandoned slot keeps the server's log from being recycled:
    /// `max_slot_wal_keep_size` bounds what it may hold).
    pub reading: bool,
    /// Bytes of write-ahead log the relay has not confirmed.
    pub lag_bytes: i64,
    /// How far behind the relay is in time, while it reads and is behind.
    pub lag_seconds: Option<f64>,
    /// `reserved`, `extended`, `unreserved`, or `lost` (the events it had not read are gone).
    pub wal_status: Option<String>,
    /// Events the broker refused for good, set aside.
    pub parked: i64,
}

/// The backlog of the outbox in `pool`'s schema.
pub async fn status(pool: &PgPool) -> Result<OutboxStatus, AdminError> {
    let b = outbox_relay::backlog(pool).await?;
    Ok(OutboxStatus {
        unpublished: b.unpublished,
        oldest_age_seconds: b.oldest_age.map(|a| a.as_secs_f64()),
        failing: b.failing,
        parked: b.parked,
        published_kept: b.published_kept,
        wal: b.wal.map(|w| WalStatus {
            slot: w.slot,
            reading: w.reading,
            lag_bytes: w.lag_bytes,
            lag_seconds: w.lag.map(|l| l.as_secs_f64()),
            wal_status: w.wal_status,
            parked: w.parked,
        }),
    })
}
