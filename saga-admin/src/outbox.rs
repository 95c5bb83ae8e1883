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

/// A parked event of the WAL outbox: set aside by the relay because it could not be published (or because
/// an earlier event of its key was), with its key's later events behind it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Parked {
    /// Its id (`saga outbox retry --id`, `saga outbox discard --id`).
    pub id: i64,
    /// The topic.
    pub topic: String,
    /// The Kafka key.
    pub key: Option<String>,
    /// Why.
    pub error: String,
    /// Failed attempts.
    pub attempts: i32,
    /// When it was parked.
    pub parked_at: chrono::DateTime<chrono::Utc>,
    /// When the relay tries it again.
    pub next_attempt_at: chrono::DateTime<chrono::Utc>,
    /// Whether its key's later events wait behind it.
    pub holds_key: bool,
    /// The payload's size.
    pub payload_bytes: i64,
}

/// The parked events of the WAL outbox not yet published or discarded, oldest first.
pub async fn parked(pool: &PgPool, limit: i64) -> Result<Vec<Parked>, AdminError> {
    Ok(outbox_relay::parked_events(pool, limit)
        .await?
        .into_iter()
        .map(|p| Parked {
            id: p.id,
            topic: p.topic,
            key: p.partition_key,
            error: p.error,
            attempts: p.attempts,
            parked_at: p.parked_at,
            next_attempt_at: p.next_attempt_at,
            holds_key: p.holds_key,
            payload_bytes: p.payload_bytes,
        })
        .collect())
}

/// Asks the relay to publish parked events again at its next round: event `id`'s key, or all of them.
/// Returns the events concerned; none is bad input.
pub async fn retry(pool: &PgPool, id: Option<i64>) -> Result<u64, AdminError> {
    let n = outbox_relay::retry_parked(pool, id).await?;
    if n == 0 {
        return Err(AdminError::bad_input(match id {
            Some(id) => format!("there is no open parked event {id}"),
            None => "there is no open parked event".to_owned(),
        }));
    }
    Ok(n)
}

/// Discards parked event `id`: it is never published, and its key's later events go on. Recorded with
/// `operator`.
pub async fn discard(pool: &PgPool, id: i64, operator: &str) -> Result<(), AdminError> {
    if outbox_relay::discard_parked(pool, id, operator).await? {
        Ok(())
    } else {
        Err(AdminError::bad_input(format!(
            "there is no open parked event {id}"
        )))
    }
}

/// What `saga outbox wal recover` did, and what was lost.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Recovery {
    /// The incident's id (`saga outbox wal incidents --keys ID` lists its step keys).
    pub incident: i64,
    /// The slot made again.
    pub slot: String,
    /// `lost` or `gone`.
    pub what: String,
    /// Events committed after this position ...
    pub lost_from_lsn: Option<String>,
    /// ... at this time ...
    pub lost_from: chrono::DateTime<chrono::Utc>,
    /// ... and before this one may never have been published.
    pub lost_to_lsn: String,
    /// When the new slot started.
    pub lost_to: chrono::DateTime<chrono::Utc>,
    /// Step keys completed in that window.
    pub steps_in_window: i64,
    /// Who recovered.
    pub recovered_by: String,
}

impl From<outbox_relay::SlotIncident> for Recovery {
    fn from(i: outbox_relay::SlotIncident) -> Self {
        Self {
            incident: i.id,
            slot: i.slot,
            what: i.what,
            lost_from_lsn: i.lost_from_lsn,
            lost_from: i.lost_from,
            lost_to_lsn: i.lost_to_lsn,
            lost_to: i.lost_to,
            steps_in_window: i.steps_in_window,
            recovered_by: i.recovered_by,
        }
    }
}

/// Recovers the schema's WAL outbox after its slot was lost or gone (see `outbox_relay::recover_slot`).
pub async fn recover(pool: &PgPool, operator: &str) -> Result<Recovery, AdminError> {
    outbox_relay::recover_slot(pool, operator)
        .await
        .map(Recovery::from)
        .map_err(slot_error)
}

/// The recorded losses of the schema's slot, newest first.
pub async fn incidents(pool: &PgPool, limit: i64) -> Result<Vec<Recovery>, AdminError> {
    Ok(outbox_relay::slot_incidents(pool, limit)
        .await?
        .into_iter()
        .map(Recovery::from)
        .collect())
}

/// A step key completed in an incident's window: its follow-up events may never have been published.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct LostStep {
    /// The tenant.
    pub tenant: String,
    /// The step key (`{client key}:{step}`).
    pub step_key: String,
    /// When it completed.
    pub completed_at: chrono::DateTime<chrono::Utc>,
}

/// The step keys completed in incident `id`'s window, oldest first.
pub async fn lost_steps(pool: &PgPool, id: i64, limit: i64) -> Result<Vec<LostStep>, AdminError> {
    Ok(outbox_relay::lost_step_keys(pool, id, limit)
        .await
        .map_err(slot_error)?
        .into_iter()
        .map(|(tenant, step_key, completed_at)| LostStep {
            tenant,
            step_key,
            completed_at,
        })
        .collect())
}

/// What `saga outbox wal retire` dropped.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Retired {
    /// The slot.
    pub slot: String,
    /// Unpublished events of the schema dropped with it (only with --force).
    pub unpublished_events: i64,
}

/// Takes the schema's WAL outbox down (see `outbox_relay::retire_slot`).
pub async fn retire(pool: &PgPool, force: bool) -> Result<Retired, AdminError> {
    let r = outbox_relay::retire_slot(pool, force)
        .await
        .map_err(slot_error)?;
    Ok(Retired {
        slot: r.slot,
        unpublished_events: r.unpublished_events,
    })
}

fn slot_error(e: outbox_relay::SlotError) -> AdminError {
    match e {
        outbox_relay::SlotError::Database(e) => AdminError::Database(e),
        other => AdminError::bad_input(other.to_string()),
    }
}
