//! What operators do with a schema's WAL outbox slot (`saga outbox wal ...`): recover it after it was lost
//! or gone, list what was lost, and take the WAL outbox down.
//!
//! A slot that the schema recorded and that is gone (dropped, a failover to a replica, a restore) or lost
//! (`wal_status = 'lost'`) is never made again by a service or a relay: their writers stop and they refuse
//! to start, saying so. Recovering is an operator's act ([`recover_slot`]), which records the incident: from
//! where the relay last confirmed to the new slot's start, events may never have been published, and the
//! step keys completed in that window ([`lost_step_keys`]) are the steps whose follow-up events may be
//! missing.

use chrono::{DateTime, Utc};
use saga_runtime::store::wal;
use sqlx::{PgPool, Row};

/// Why a slot operation did nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SlotError {
    /// There is nothing to do, or it is not safe now (says why, and what to do).
    #[error("{0}")]
    Refused(String),
    /// The database failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
}

/// Recovers the current schema's WAL outbox after its slot was lost or gone: makes a new slot, records
/// the incident with `operator`, and lets the schema's writers go on (within their monitor's interval).
/// Refuses when the slot is healthy, when the schema has none, and while a relay still reads a lost slot.
/// Returns the incident: what was lost.
pub async fn recover_slot(pool: &PgPool, operator: &str) -> Result<SlotIncident, SlotError> {
    match wal::recover(pool, operator).await {
        Ok(r) => Ok(SlotIncident {
            id: r.incident,
            slot: r.slot,
            what: r.what,
            lost_from_lsn: r.lost_from_lsn,
            lost_from: r.lost_from,
            lost_to_lsn: r.lost_to_lsn,
            lost_to: r.lost_to,
            steps_in_window: r.steps_in_window,
            recovered_by: operator.to_owned(),
        }),
        Err(wal::RecoverError::Database(e)) => Err(SlotError::Database(e)),
        Err(wal::RecoverError::Prepare(wal::PrepareError::Database(e))) => {
            Err(SlotError::Database(e))
        }
        Err(other) => Err(SlotError::Refused(other.to_string())),
    }
}

/// A recorded loss of the WAL outbox's slot, and its recovery.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct SlotIncident {
    /// Its id.
    pub id: i64,
    /// The slot.
    pub slot: String,
    /// `lost` or `gone`.
    pub what: String,
    /// Events committed after this position may never have been published (`None`: the relay never
    /// confirmed one, so everything since the slot was taken on) ...
    pub lost_from_lsn: Option<String>,
    /// ... the end of the last transaction the relay confirmed, committed at this time ...
    pub lost_from: DateTime<Utc>,
    /// ... and before the new slot's start (events committed after it are published).
    pub lost_to_lsn: String,
    /// When the slot was made again.
    pub lost_to: DateTime<Utc>,
    /// Step keys completed in the window.
    pub steps_in_window: i64,
    /// Who recovered.
    pub recovered_by: String,
}

/// The incidents recorded by [`recover_slot`], newest first.
pub async fn slot_incidents(pool: &PgPool, limit: i64) -> Result<Vec<SlotIncident>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT id, slot_name, what, lost_from_lsn::text, lost_from_time, lost_to_lsn::text, lost_to_time, \
                steps_in_window, recovered_by \
         FROM saga_outbox_wal_incidents ORDER BY id DESC LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await?;
    rows.into_iter()
        .map(|r| {
            Ok(SlotIncident {
                id: r.try_get(0)?,
                slot: r.try_get(1)?,
                what: r.try_get(2)?,
                lost_from_lsn: r.try_get(3)?,
                lost_from: r.try_get(4)?,
                lost_to_lsn: r.try_get(5)?,
                lost_to: r.try_get(6)?,
                steps_in_window: r.try_get(7)?,
                recovered_by: r.try_get(8)?,
            })
        })
        .collect()
}

/// The step keys completed in incident `id`'s window (from a minute before its start: a key's time is its
/// transaction's start), at most `limit`, oldest first: `(tenant, step key, completed at)`. Their steps ran and committed, and their follow-up events may never have been
/// published: what a team re-drives (see the WAL outbox guide).
pub async fn lost_step_keys(
    pool: &PgPool,
    id: i64,
    limit: i64,
) -> Result<Vec<(String, String, DateTime<Utc>)>, SlotError> {
    let window: Option<(DateTime<Utc>, DateTime<Utc>)> = sqlx::query_as(
        "SELECT lost_from_time, lost_to_time FROM saga_outbox_wal_incidents WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(pool)
    .await?;
    let Some((from, to)) = window else {
        return Err(SlotError::Refused(format!("there is no incident {id}")));
    };
    Ok(sqlx::query_as(
        "SELECT tenant_id, step_key, updated_at FROM saga_idempotency_keys \
         WHERE status <> 'started' AND updated_at >= $1 - $4::interval AND updated_at <= $2 \
         ORDER BY updated_at LIMIT $3",
    )
    .bind(from)
    .bind(to)
    .bind(limit)
    .bind(wal::slot::WINDOW_MARGIN)
    .fetch_all(pool)
    .await?)
}

/// What [`retire_slot`] dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetiredSlot {
    /// The slot.
    pub slot: String,
    /// Events of the schema it still held, unpublished (dropped with it; zero unless forced).
    pub unpublished_events: i64,
}

/// Takes the current schema's WAL outbox down, to go back to the table outbox: drops its slot and forgets
/// it (and the switch). Refuses while a relay reads the slot, and while the slot holds events of the schema
/// not yet published (unless `force`: they are then lost). Stop the writers and wait until the relay is
/// caught up, stop the relays, retire, then start the services in table mode.
pub async fn retire_slot(pool: &PgPool, force: bool) -> Result<RetiredSlot, SlotError> {
    let mut conn = pool.acquire().await?;
    let Some(record) = wal::slot::recorded(&mut conn).await? else {
        return Err(SlotError::Refused(
            "this schema has no WAL outbox (no slot recorded)".into(),
        ));
    };
    let parked: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM saga_outbox_wal_parked WHERE published_at IS NULL AND discarded_at IS NULL",
    )
    .fetch_one(&mut *conn)
    .await?;
    if parked > 0 {
        return Err(SlotError::Refused(format!(
            "{parked} parked events of the WAL outbox are neither published nor discarded, and only a relay \
             in WAL mode publishes them: `saga outbox parked`, then retry or discard them first"
        )));
    }
    let slot: Option<(bool, Option<String>)> = sqlx::query_as(
        "SELECT active, wal_status FROM pg_replication_slots \
         WHERE slot_name = $1 AND database = current_database()",
    )
    .bind(&record.slot_name)
    .fetch_optional(&mut *conn)
    .await?;
    if slot.as_ref().is_some_and(|(active, _)| *active) {
        return Err(SlotError::Refused(format!(
            "a relay reads the slot {}: stop the schema's relays first",
            record.slot_name
        )));
    }
    let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(&mut *conn)
        .await?;
    // A lost slot cannot be read (what it held is gone already).
    let readable = slot
        .as_ref()
        .is_some_and(|(_, status)| status.as_deref() != Some("lost"));
    let unpublished = if readable {
        pending_messages(&mut conn, &record.slot_name, &wal::prefix(&schema)).await?
    } else {
        0
    };
    if unpublished > 0 && !force {
        return Err(SlotError::Refused(format!(
            "the slot {} still holds {unpublished} unpublished outbox messages of this schema: start a relay \
             until it is caught up (or --force to drop them)",
            record.slot_name
        )));
    }
    if slot.is_some() {
        // Fails, and nothing is forgotten, should a relay have started reading it meanwhile.
        sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(&record.slot_name)
            .execute(&mut *conn)
            .await?;
    }
    sqlx::query("DELETE FROM saga_outbox_wal_slot")
        .execute(&mut *conn)
        .await?;
    Ok(RetiredSlot {
        slot: record.slot_name,
        unpublished_events: unpublished,
    })
}

/// The schema's outbox messages `slot` holds, unread (peeked: nothing is consumed).
async fn pending_messages(
    conn: &mut sqlx::PgConnection,
    slot: &str,
    prefix: &str,
) -> Result<i64, sqlx::Error> {
    // pgoutput's logical message: 'M', flags (1 byte), its LSN (8), the prefix (NUL-terminated), ...
    let data: Vec<Vec<u8>> = sqlx::query_scalar(
        "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, 'proto_version', '1', \
         'publication_names', $2, 'messages', 'true')",
    )
    .bind(slot)
    .bind(wal::PUBLICATION)
    .fetch_all(conn)
    .await?;
    Ok(data
        .iter()
        .filter(|d| {
            d.first() == Some(&b'M')
                && d.get(10..10 + prefix.len()) == Some(prefix.as_bytes())
                && d.get(10 + prefix.len()) == Some(&0)
        })
        .count() as i64)
}
