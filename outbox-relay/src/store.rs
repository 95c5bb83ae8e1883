//! The relay's SQL: reading unpublished rows in id order, marking or deleting published ones, recording
//! failures, the backlog, and deleting published rows after their retention.

use std::time::Duration;

use chrono::{DateTime, Utc};
use saga_core::gc::delete_in_batches;
use saga_core::outbox::headers_from_array;
use sqlx::{PgConnection, PgPool, Row};

/// An outbox row to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRow {
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

/// Reads up to `limit` unpublished rows of `shards`, in id order (for one key: commit order).
pub async fn fetch_unpublished(
    conn: &mut PgConnection,
    shards: &[i16],
    limit: i64,
) -> Result<Vec<OutboxRow>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT id, topic, partition_key, headers, payload, created_at FROM saga_outbox \
         WHERE published_at IS NULL AND shard = ANY($1) ORDER BY id LIMIT $2",
    )
    .bind(shards)
    .bind(limit)
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

/// Marks (or deletes) the rows `acked` as published; `published_at` is the broker's acknowledgement time.
pub async fn mark_published(
    conn: &mut PgConnection,
    acked: &[(i64, DateTime<Utc>)],
    after: AfterPublish,
) -> Result<u64, sqlx::Error> {
    if acked.is_empty() {
        return Ok(0);
    }
    let (ids, times): (Vec<i64>, Vec<DateTime<Utc>>) = acked.iter().copied().unzip();
    let done = match after {
        AfterPublish::Mark => {
            sqlx::query(
                "UPDATE saga_outbox o SET published_at = a.at \
                 FROM unnest($1::bigint[], $2::timestamptz[]) AS a(id, at) \
                 WHERE o.id = a.id AND o.published_at IS NULL",
            )
            .bind(&ids)
            .bind(&times)
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

/// Records a failed publication of row `id`.
pub async fn record_failure(
    conn: &mut PgConnection,
    id: i64,
    error: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE saga_outbox SET attempts = attempts + 1, last_error = $2 WHERE id = $1")
        .bind(id)
        .bind(error)
        .execute(conn)
        .await?;
    Ok(())
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
    /// Published rows kept until their retention ends.
    pub published_kept: i64,
}

/// Reads the backlog.
pub async fn backlog(pool: &PgPool) -> Result<Backlog, sqlx::Error> {
    let row = sqlx::query(
        "SELECT count(*) FILTER (WHERE published_at IS NULL), \
                extract(epoch FROM now() - min(created_at) FILTER (WHERE published_at IS NULL))::float8, \
                count(*) FILTER (WHERE published_at IS NULL AND attempts > 0), \
                count(*) FILTER (WHERE published_at IS NOT NULL) \
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
    })
}

/// Deletes rows published longer ago than `retention`, `batch_size` per statement. Returns the rows
/// deleted and the statements run.
pub async fn delete_published(
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
