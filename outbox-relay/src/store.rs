//! The relay's SQL: reading unpublished rows in id order, marking or deleting published ones, recording
//! failures, the backlog, and deleting published rows after their retention.

use std::time::Duration;

use chrono::{DateTime, Utc};
use saga_runtime::store::gc::delete_in_batches;
use saga_runtime::store::outbox::headers_from_array;
use sqlx::{PgConnection, PgPool, Row};

use crate::publisher::{Acked, OrderKey};

/// An outbox row to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OutboxRow {
    /// The row id.
    pub id: i64,
    /// The topic.
    pub topic: String,
    /// The Kafka key.
    pub partition_key: Option<String>,
    /// The headers.
    pub headers: Vec<(String, String)>,
    /// The payload.
    pub payload: Option<Vec<u8>>,
    /// When the row was written (stands for its commit time: transactions writing the outbox are short).
    pub created_at: DateTime<Utc>,
}

/// What happens to a row once the broker acknowledged it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AfterPublish {
    /// Set `published_at`; the retention job deletes it later (an audit trail meanwhile). The default.
    #[default]
    Mark,
    /// Delete it at once.
    Delete,
}

/// Reads up to `limit` unpublished, unparked rows of `shards`, in id order (for one key: commit order),
/// leaving out the keys in `held` (topic and partition key): rows of keys waiting for a retry must not fill
/// the batch and starve the others.
pub(crate) async fn fetch_unpublished(
    conn: &mut PgConnection,
    shards: &[i16],
    held: &[OrderKey],
    limit: i64,
) -> Result<Vec<OutboxRow>, sqlx::Error> {
    let (held_topics, held_keys): (Vec<&str>, Vec<Option<&str>>) = held
        .iter()
        .map(|(topic, key)| (topic.as_str(), key.as_deref()))
        .unzip();
    let rows = sqlx::query(
        "SELECT id, topic, partition_key, headers, payload, created_at FROM saga_outbox o \
         WHERE published_at IS NULL AND parked_at IS NULL AND shard = ANY($1) \
           AND NOT EXISTS (SELECT 1 FROM unnest($3::text[], $4::text[]) AS h(topic, key) \
                           WHERE h.topic = o.topic AND h.key IS NOT DISTINCT FROM o.partition_key) \
         ORDER BY id LIMIT $2",
    )
    .bind(shards)
    .bind(limit)
    .bind(&held_topics)
    .bind(&held_keys)
    .fetch_all(conn)
    .await?;
    rows.into_iter()
        .map(|row| {
            Ok(OutboxRow {
                id: row.try_get(0)?,
                topic: row.try_get(1)?,
                partition_key: row.try_get(2)?,
                headers: headers_from_array(row.try_get::<Vec<String>, _>(3)?),
                payload: row.try_get(4)?,
                created_at: row.try_get(5)?,
            })
        })
        .collect()
}

/// Marks (or deletes) the rows `acked` as published: `published_at` is the broker's acknowledgement time,
/// with the partition and offset the broker gave the row.
pub(crate) async fn mark_published(
    conn: &mut PgConnection,
    acked: &[Acked],
    after: AfterPublish,
) -> Result<u64, sqlx::Error> {
    if acked.is_empty() {
        return Ok(0);
    }
    let ids: Vec<i64> = acked.iter().map(|a| a.id).collect();
    let done = match after {
        AfterPublish::Mark => {
            let times: Vec<DateTime<Utc>> = acked.iter().map(|a| a.acked_at).collect();
            let partitions: Vec<i32> = acked.iter().map(|a| a.partition).collect();
            let offsets: Vec<i64> = acked.iter().map(|a| a.offset).collect();
            sqlx::query(
                "UPDATE saga_outbox o \
                 SET published_at = a.at, published_partition = a.partition, published_offset = a.off \
                 FROM unnest($1::bigint[], $2::timestamptz[], $3::int[], $4::bigint[]) \
                      AS a(id, at, partition, off) \
                 WHERE o.id = a.id AND o.published_at IS NULL",
            )
            .bind(&ids)
            .bind(&times)
            .bind(&partitions)
            .bind(&offsets)
            .execute(conn)
            .await?
        }
        AfterPublish::Delete => {
            sqlx::query("DELETE FROM saga_outbox WHERE id = ANY($1)")
                .bind(&ids)
                .execute(conn)
                .await?
        }
    };
    Ok(done.rows_affected())
}

/// Records a failed publication of row `id`; a row refused for good (`refused`) is parked once it has
/// failed `park_after` times. Returns whether it was parked.
pub(crate) async fn record_failure(
    conn: &mut PgConnection,
    id: i64,
    error: &str,
    refused: bool,
    park_after: u32,
) -> Result<bool, sqlx::Error> {
    let parked: Option<bool> = sqlx::query_scalar(
        "UPDATE saga_outbox SET attempts = attempts + 1, last_error = $2, \
             parked_at = CASE WHEN $3 AND attempts + 1 >= $4 THEN now() END \
         WHERE id = $1 RETURNING parked_at IS NOT NULL",
    )
    .bind(id)
    .bind(error)
    .bind(refused)
    .bind(i32::try_from(park_after).unwrap_or(i32::MAX))
    .fetch_optional(conn)
    .await?;
    Ok(parked == Some(true))
}

/// The state of the outbox, for `status` and the backlog gauge.
#[derive(Debug, Clone, PartialEq)]
pub struct Backlog {
    /// Unpublished rows.
    pub unpublished: i64,
    /// Age of the oldest unpublished row.
    pub oldest_age: Option<Duration>,
    /// Unpublished rows whose publication failed at least once.
    pub failing: i64,
    /// Rows the broker refused for good, set aside (see the `parked_at` column).
    pub parked: i64,
    /// Published rows kept until their retention ends.
    pub published_kept: i64,
    /// The write-ahead log's outbox, where the schema has a slot for it.
    pub wal: Option<WalBacklog>,
}

/// The state of a schema's outbox on the write-ahead log.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct WalBacklog {
    /// Its replication slot.
    pub slot: String,
    /// Whether a relay reads it now (an abandoned slot keeps the server's log from being recycled).
    pub reading: bool,
    /// Bytes of write-ahead log between the server's position and what the relay confirmed.
    pub lag_bytes: i64,
    /// How far behind the relay's confirmations are in time, while it reads and is behind.
    pub lag: Option<Duration>,
    /// The server's view of the slot's log: `reserved`, `extended`, `unreserved`, or `lost` (it fell behind
    /// `max_slot_wal_keep_size`: the events it had not read are gone).
    pub wal_status: Option<String>,
    /// Events the broker refused for good, set aside in `saga_outbox_wal_parked`.
    pub parked: i64,
}

/// Reads the backlog.
pub async fn backlog(pool: &PgPool) -> Result<Backlog, sqlx::Error> {
    let row = sqlx::query(
        "SELECT count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NULL), \
                extract(epoch FROM now() - min(created_at) \
                    FILTER (WHERE published_at IS NULL AND parked_at IS NULL))::float8, \
                count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NULL AND attempts > 0), \
                count(*) FILTER (WHERE published_at IS NOT NULL), \
                count(*) FILTER (WHERE parked_at IS NOT NULL AND published_at IS NULL) \
         FROM saga_outbox",
    )
    .fetch_one(pool)
    .await?;
    Ok(Backlog {
        unpublished: row.try_get(0)?,
        oldest_age: row
            .try_get::<Option<f64>, _>(1)?
            .map(|s| Duration::from_secs_f64(s.max(0.0))),
        failing: row.try_get(2)?,
        published_kept: row.try_get(3)?,
        parked: row.try_get(4)?,
        wal: wal_backlog(pool).await?,
    })
}

async fn wal_backlog(pool: &PgPool) -> Result<Option<WalBacklog>, sqlx::Error> {
    let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(pool)
        .await?;
    let Some(lag) = saga_runtime::store::wal::slot_lag(pool, &schema).await? else {
        return Ok(None);
    };
    let parked: i64 = sqlx::query_scalar(
        "SELECT CASE WHEN to_regclass('saga_outbox_wal_parked') IS NULL THEN 0 \
                ELSE (SELECT count(*) FROM saga_outbox_wal_parked) END",
    )
    .fetch_one(pool)
    .await?;
    Ok(Some(WalBacklog {
        slot: lag.slot,
        reading: lag.active,
        lag_bytes: lag.lag_bytes,
        lag: lag.lag_seconds.map(|s| Duration::from_secs_f64(s.max(0.0))),
        wal_status: lag.wal_status,
        parked,
    }))
}

/// Deletes rows published longer ago than `retention`, `batch_size` per statement. Returns the rows
/// deleted and the statements run.
pub(crate) async fn delete_published(
    pool: &PgPool,
    retention: Duration,
    batch_size: u32,
) -> Result<(u64, u64), sqlx::Error> {
    let mut batches = 0;
    let deleted = delete_in_batches(
        pool,
        "DELETE FROM saga_outbox WHERE id = ANY(ARRAY( \
             SELECT id FROM saga_outbox \
             WHERE published_at < now() - $1 * interval '1 millisecond' \
             ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED))",
        retention,
        batch_size,
        &mut batches,
    )
    .await?;
    Ok((deleted, batches))
}
