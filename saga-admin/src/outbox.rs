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

/// A parked event: set aside by the relay because it could not be published (or because an earlier event
/// of its key was), with its key's later events behind it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Parked {
    /// Its id (`saga outbox retry --id`; for the WAL outbox, `saga outbox discard --id` too).
    pub id: i64,
    /// Which outbox parked it: `wal` (an event of the WAL outbox) or `table` (a row of `saga_outbox`).
    pub outbox: ParkedIn,
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

/// The parked events not yet published or discarded, of both outboxes (the WAL outbox's events, the table
/// outbox's parked rows, which the relay tries again with backoff while their key's later rows wait behind
/// them), oldest first, at most `limit`. Each outbox numbers its own: `outbox` says whose id it is.
pub async fn parked(pool: &PgPool, limit: i64) -> Result<Vec<Parked>, AdminError> {
    let mut found: Vec<Parked> = outbox_relay::parked_events(pool, limit)
        .await?
        .into_iter()
        .map(|p| Parked {
            id: p.id,
            outbox: ParkedIn::Wal,
            topic: p.topic,
            key: p.partition_key,
            error: p.error,
            attempts: p.attempts,
            parked_at: p.parked_at,
            next_attempt_at: p.next_attempt_at,
            holds_key: p.holds_key,
            payload_bytes: p.payload_bytes,
        })
        .collect();
    found.extend(parked_rows(pool, limit).await?);
    found.sort_by_key(|p| p.parked_at);
    found.truncate(usize::try_from(limit).unwrap_or_default());
    Ok(found)
}

/// The table outbox's parked rows, oldest first, at most `limit`. Beside the WAL outbox (a slot is
/// recorded), the relay tries a parked row again after a backoff and holds its key's later rows behind it;
/// the table outbox alone does neither (the row waits for `saga outbox retry`, later rows go on): its
/// `next_attempt_at` is then its parking time.
async fn parked_rows(pool: &PgPool, limit: i64) -> Result<Vec<Parked>, AdminError> {
    let beside_the_log: bool = sqlx::query_scalar(
        "SELECT to_regclass('saga_outbox_wal_slot') IS NOT NULL \
            AND EXISTS (SELECT 1 FROM saga_outbox_wal_slot)",
    )
    .fetch_one(pool)
    .await
    .unwrap_or(false);
    let rows: Vec<ParkedRow> = sqlx::query_as(
        "SELECT id, topic, partition_key, coalesce(last_error, ''), attempts, parked_at, \
                coalesce(octet_length(payload), 0)::bigint \
         FROM saga_outbox WHERE parked_at IS NOT NULL AND published_at IS NULL ORDER BY id LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await
    .or_else(absent_is_empty)?;
    Ok(rows
        .into_iter()
        .map(
            |(id, topic, key, error, attempts, parked_at, payload_bytes)| Parked {
                id,
                outbox: ParkedIn::Table,
                topic,
                key,
                error,
                attempts,
                parked_at,
                // Beside the log, the relay unparks a row after a backoff that doubles with its attempts, up
                // to five minutes.
                next_attempt_at: if beside_the_log {
                    parked_at
                        + chrono::Duration::seconds(1_i64 << attempts.clamp(0, 12))
                            .min(chrono::Duration::minutes(5))
                } else {
                    parked_at
                },
                holds_key: beside_the_log,
                payload_bytes,
            },
        )
        .collect())
}

type ParkedRow = (
    i64,
    String,
    Option<String>,
    String,
    i32,
    chrono::DateTime<chrono::Utc>,
    i64,
);

/// Which outbox holds a parked event: ids are numbered apart in each, so one id may name an event of both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum ParkedIn {
    /// The WAL outbox (`saga_outbox_wal_parked`).
    Wal,
    /// The table outbox (a parked row of `saga_outbox`).
    Table,
}

impl ParkedIn {
    /// `wal` or `table`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Wal => "wal",
            Self::Table => "table",
        }
    }
}

impl std::str::FromStr for ParkedIn {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "wal" => Ok(Self::Wal),
            "table" => Ok(Self::Table),
            other => Err(format!("{other:?} is not an outbox: wal or table")),
        }
    }
}

/// An open parked event, found by its id: which outbox holds it, its topic and its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkedEvent {
    /// Its id in its outbox.
    pub id: i64,
    /// Its outbox.
    pub outbox: ParkedIn,
    /// Its topic.
    pub topic: String,
    /// Its key.
    pub key: Option<String>,
}

impl ParkedEvent {
    /// The event in words: `event 7 of the wal outbox (key k of orders)`.
    pub fn describe(&self) -> String {
        let what = match self.outbox {
            ParkedIn::Wal => "event",
            ParkedIn::Table => "row",
        };
        format!(
            "{what} {} of the {} outbox (key {} of {})",
            self.id,
            self.outbox.as_str(),
            self.key.as_deref().unwrap_or("(none)"),
            self.topic
        )
    }
}

/// The open parked event `id` of `outbox`, or of whichever outbox holds one: bad input if none does, or
/// both do and `outbox` does not say which.
pub async fn locate(
    pool: &PgPool,
    id: i64,
    outbox: Option<ParkedIn>,
) -> Result<ParkedEvent, AdminError> {
    let mut found = Vec::new();
    for (kind, sql) in [
        (
            ParkedIn::Wal,
            "SELECT topic, partition_key FROM saga_outbox_wal_parked \
             WHERE id = $1 AND published_at IS NULL AND discarded_at IS NULL",
        ),
        (
            ParkedIn::Table,
            "SELECT topic, partition_key FROM saga_outbox \
             WHERE id = $1 AND parked_at IS NOT NULL AND published_at IS NULL",
        ),
    ] {
        if outbox.is_some_and(|o| o != kind) {
            continue;
        }
        let rows: Vec<(String, Option<String>)> = sqlx::query_as(sql)
            .bind(id)
            .fetch_all(pool)
            .await
            .or_else(absent_is_empty)?;
        found.extend(rows.into_iter().map(|(topic, key)| ParkedEvent {
            id,
            outbox: kind,
            topic,
            key,
        }));
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(AdminError::bad_input(format!(
            "there is no open parked event {id}{}",
            outbox.map_or_else(String::new, |o| format!(" in the {} outbox", o.as_str()))
        ))),
        _ => Err(AdminError::bad_input(format!(
            "{id} names a parked event of both outboxes ({}): say which with --outbox wal or --outbox table",
            found
                .iter()
                .map(ParkedEvent::describe)
                .collect::<Vec<_>>()
                .join("; ")
        ))),
    }
}

/// No rows where the schema lacks the table or a column (no service of this version ran in it).
fn absent_is_empty<T>(e: sqlx::Error) -> Result<Vec<T>, sqlx::Error> {
    match &e {
        sqlx::Error::Database(d) if matches!(d.code().as_deref(), Some("42P01" | "42703")) => {
            Ok(Vec::new())
        }
        _ => Err(e),
    }
}

/// What [`retry`] would publish again, in a line (the confirmation's question).
pub async fn retry_scope(
    pool: &PgPool,
    id: Option<i64>,
    outbox: Option<ParkedIn>,
) -> Result<String, AdminError> {
    match id {
        None => Ok("publish again every parked event, in order per key".to_owned()),
        Some(id) => Ok(format!(
            "publish again the parked events of the key of {}",
            locate(pool, id, outbox).await?.describe()
        )),
    }
}

/// Asks the relay to publish parked events again at its next round: those of the key of parked event `id`
/// (see [`locate`]), or all of them. Returns the events concerned; none is bad input.
pub async fn retry(
    pool: &PgPool,
    id: Option<i64>,
    outbox: Option<ParkedIn>,
) -> Result<u64, AdminError> {
    let n = match id {
        None => outbox_relay::retry_parked(pool, None).await?,
        Some(id) => match locate(pool, id, outbox).await? {
            ParkedEvent {
                outbox: ParkedIn::Wal,
                ..
            } => outbox_relay::retry_parked(pool, Some(id)).await?,
            ParkedEvent { topic, key, .. } => {
                // The table outbox's relay publishes a row again once it is unparked: the key's rows, in
                // their order.
                sqlx::query(
                    "UPDATE saga_outbox SET parked_at = NULL \
                     WHERE parked_at IS NOT NULL AND published_at IS NULL \
                       AND topic = $1 AND partition_key IS NOT DISTINCT FROM $2",
                )
                .bind(topic)
                .bind(key)
                .execute(pool)
                .await?
                .rows_affected()
            }
        },
    };
    if n == 0 {
        return Err(AdminError::bad_input(match id {
            Some(id) => format!("there is no open parked event {id}"),
            None => "there is no open parked event".to_owned(),
        }));
    }
    Ok(n)
}

/// Discards parked event `id` of the WAL outbox: it is never published, and its key's later events go on.
/// Recorded with `operator`. A parked row of the table outbox is not discarded (bad input): [`retry`] it
/// once the cause is fixed.
pub async fn discard(
    pool: &PgPool,
    id: i64,
    outbox: Option<ParkedIn>,
    operator: &str,
) -> Result<(), AdminError> {
    let event = locate(pool, id, outbox).await?;
    if event.outbox == ParkedIn::Table {
        return Err(AdminError::bad_input(format!(
            "{} cannot be discarded: retry it once the cause is fixed (`saga outbox retry`); only the WAL \
             outbox's parked events are discarded",
            event.describe()
        )));
    }
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
