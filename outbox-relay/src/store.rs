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

impl OutboxRow {
    /// A row read as `id, topic, partition_key, headers, payload, created_at`.
    pub(crate) fn read(row: &sqlx::postgres::PgRow) -> Result<Self, sqlx::Error> {
        Ok(Self {
            id: row.try_get(0)?,
            topic: row.try_get(1)?,
            partition_key: row.try_get(2)?,
            headers: headers_from_array(row.try_get::<Vec<String>, _>(3)?),
            payload: row.try_get(4)?,
            created_at: row.try_get(5)?,
        })
    }
}

/// What happens to a row once the broker acknowledged it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum AfterPublish {
    /// Set `published_at`; the retention job deletes it later (an audit trail meanwhile). The default.
    #[default]
    Mark,
    /// Delete it at once.
    Delete,
}

/// The fetch: the oldest unpublished, unparked rows of some shards (`$1`), at most `$2`, without the keys
/// held for a retry (topics `$3`, keys `$4`).
const FETCH_UNPUBLISHED: &str = "SELECT id, topic, partition_key, headers, payload, created_at FROM saga_outbox o \
     WHERE published_at IS NULL AND parked_at IS NULL AND shard = ANY($1) \
       AND NOT EXISTS (SELECT 1 FROM unnest($3::text[], $4::text[]) AS h(topic, key) \
                       WHERE h.topic = o.topic AND h.key IS NOT DISTINCT FROM o.partition_key) \
     ORDER BY id LIMIT $2";

/// The fetch beside the write-ahead log's outbox: as [`FETCH_UNPUBLISHED`], and a parked row holds its key's
/// later rows (it is unparked and tried again on its own, see [`UNPARK_DUE`]): in WAL mode a row is parked
/// for any lasting failure, not only a refusal for good, and must not be overtaken.
const FETCH_UNPUBLISHED_BEHIND_PARKED: &str = "SELECT id, topic, partition_key, headers, payload, created_at \
     FROM saga_outbox o \
     WHERE published_at IS NULL AND parked_at IS NULL AND shard = ANY($1) \
       AND NOT EXISTS (SELECT 1 FROM unnest($3::text[], $4::text[]) AS h(topic, key) \
                       WHERE h.topic = o.topic AND h.key IS NOT DISTINCT FROM o.partition_key) \
       AND NOT EXISTS (SELECT 1 FROM saga_outbox p \
                       WHERE p.parked_at IS NOT NULL AND p.published_at IS NULL AND p.id < o.id \
                         AND p.topic = o.topic AND p.partition_key IS NOT DISTINCT FROM o.partition_key) \
     ORDER BY id LIMIT $2";

/// Beside the write-ahead log's outbox: parked rows of some shards (`$1`) whose pause is over (1 s doubling
/// with their attempts, up to 5 minutes) are tried again.
const UNPARK_DUE: &str = "UPDATE saga_outbox SET parked_at = NULL \
     WHERE parked_at IS NOT NULL AND published_at IS NULL AND shard = ANY($1) \
       AND parked_at < now() - least(interval '1 second' * power(2, least(attempts, 12)), \
                                     interval '5 minutes')";

/// The mark: ids `$1` acknowledged at `$2` in partitions `$3` at offsets `$4`.
///
/// A row published twice (by two relays across a rebalance) keeps its first acknowledgement.
/// The condition sits in the SET list, not the WHERE clause: a filter on `published_at` lets a
/// planner with stale statistics (a backlog grown since the last ANALYZE) drive the join from
/// the outbox instead of from the 2,000 ids (seconds per batch, measured).
const MARK_PUBLISHED: &str = "UPDATE saga_outbox o \
     SET published_at = coalesce(o.published_at, a.at), \
         published_partition = CASE WHEN o.published_at IS NULL THEN a.partition \
                                    ELSE o.published_partition END, \
         published_offset = CASE WHEN o.published_at IS NULL THEN a.off ELSE o.published_offset END \
     FROM unnest($1::bigint[], $2::timestamptz[], $3::int[], $4::bigint[]) AS a(id, at, partition, off) \
     WHERE o.id = a.id";

/// Pins the plans of the relay's work connection to index walks bounded by the batch: the ordered scan of
/// `saga_outbox_unpublished` for the fetch, primary-key lookups for marking.
///
/// The statistics of `saga_outbox` are at their most wrong exactly when the relay is busiest: a backlog
/// that grew since the last ANALYZE (an outage, a burst) still looks like the handful of unpublished rows
/// of the steady state. With them the planner reads the whole backlog and sorts it for every batch of
/// 2,000 (tens of milliseconds per batch, growing with the backlog) or drives the mark's join from the
/// outbox. The work connection runs only the relay's own statements, whose good plans are known, so it
/// turns the other strategies off for its session; it is never returned to the pool.
pub(crate) async fn pin_plans(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(
        "SET enable_seqscan = off; SET enable_bitmapscan = off; SET enable_sort = off; \
         SET enable_hashjoin = off; SET enable_mergejoin = off",
    )
    .execute(conn)
    .await
    .map(drop)
}

/// Reads up to `limit` unpublished, unparked rows of `shards`, in id order (for one key: commit order),
/// leaving out the keys in `held` (topic and partition key): rows of keys waiting for a retry must not fill
/// the batch and starve the others.
pub(crate) async fn fetch_unpublished(
    conn: &mut PgConnection,
    shards: &[i16],
    held: &[OrderKey],
    limit: i64,
    behind_parked: bool,
) -> Result<Vec<OutboxRow>, sqlx::Error> {
    let (held_topics, held_keys): (Vec<&str>, Vec<Option<&str>>) = held
        .iter()
        .map(|(topic, key)| (topic.as_str(), key.as_deref()))
        .unzip();
    let fetch = if behind_parked {
        FETCH_UNPUBLISHED_BEHIND_PARKED
    } else {
        FETCH_UNPUBLISHED
    };
    let rows = sqlx::query(fetch)
        .bind(shards)
        .bind(limit)
        .bind(&held_topics)
        .bind(&held_keys)
        .fetch_all(conn)
        .await?;
    rows.iter().map(OutboxRow::read).collect()
}

/// The relay's own statements without a broker: on a pinned work connection, fetches batches of `batch`
/// rows of every shard and marks them as if the broker had acknowledged each at once, until none is left.
/// Returns the rows marked. The benchmark's yardstick for the table relay (the SQL that must run whatever
/// the broker), not a way to publish: nothing reaches Kafka.
#[doc(hidden)]
pub async fn drain_without_broker(pool: &PgPool, batch: i64) -> Result<u64, sqlx::Error> {
    let mut conn: PgConnection = pool.acquire().await?.detach();
    pin_plans(&mut conn).await?;
    let shards: Vec<i16> = (0..crate::shards::SHARDS).collect();
    let mut marked = 0;
    loop {
        let rows = fetch_unpublished(&mut conn, &shards, &[], batch, false).await?;
        if rows.is_empty() {
            return Ok(marked);
        }
        let acked_at = Utc::now();
        let acked: Vec<Acked> = rows
            .iter()
            .zip(0..)
            .map(|(row, offset)| Acked {
                id: row.id,
                created_at: row.created_at,
                acked_at,
                partition: 0,
                offset,
            })
            .collect();
        marked += mark_published(&mut conn, &acked, AfterPublish::Mark).await?;
    }
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
            sqlx::query(MARK_PUBLISHED)
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

/// Beside the write-ahead log's outbox: unparks the parked rows of `shards` whose pause is over, so that the
/// fetch tries them again. Returns how many.
pub(crate) async fn unpark_due(
    conn: &mut PgConnection,
    shards: &[i16],
) -> Result<u64, sqlx::Error> {
    if shards.is_empty() {
        return Ok(0);
    }
    Ok(sqlx::query(UNPARK_DUE)
        .bind(shards)
        .execute(conn)
        .await?
        .rows_affected())
}

/// Records a failed publication of row `id`; a row refused for good (`refused`) is parked once it has
/// failed `park_after` times, and any row when `park_now`. Returns whether it was parked.
pub(crate) async fn record_failure(
    conn: &mut PgConnection,
    id: i64,
    error: &str,
    refused: bool,
    park_after: u32,
    park_now: bool,
) -> Result<bool, sqlx::Error> {
    let parked: Option<bool> = sqlx::query_scalar(
        "UPDATE saga_outbox SET attempts = attempts + 1, last_error = $2, \
             parked_at = CASE WHEN ($3 AND attempts + 1 >= $4) OR $5 THEN now() END \
         WHERE id = $1 RETURNING parked_at IS NOT NULL",
    )
    .bind(id)
    .bind(error)
    .bind(refused)
    .bind(i32::try_from(park_after).unwrap_or(i32::MAX))
    .bind(park_now)
    .fetch_optional(conn)
    .await?;
    Ok(parked == Some(true))
}

/// The state of the outbox, for `status` and the backlog gauge.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
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
    /// Events set aside in `saga_outbox_wal_parked` (refused, failing too long, or waiting behind such an
    /// event of their key), not yet published or discarded.
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
    let Some(lag) = saga_runtime::store::wal::slot_lag(pool).await? else {
        return Ok(None);
    };
    let parked: i64 = sqlx::query_scalar(
        "SELECT CASE WHEN to_regclass('saga_outbox_wal_parked') IS NULL THEN 0 \
                ELSE (SELECT count(*) FROM saga_outbox_wal_parked \
                      WHERE published_at IS NULL AND discarded_at IS NULL) END",
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

#[cfg(test)]
mod tests {
    use sqlx::postgres::PgArguments;
    use sqlx::{Arguments, Connection};

    use super::*;

    /// Arguments for a statement, from values of one type each.
    macro_rules! arguments {
        ($($value:expr),+ $(,)?) => {{
            let mut arguments = PgArguments::default();
            $(arguments.add($value).unwrap();)+
            arguments
        }};
    }

    /// The plan of `sql` run with `binds` on `conn` (EXPLAIN ANALYZE, in a transaction rolled back): every
    /// node's type, and the rows the outbox's scans returned.
    async fn plan(conn: &mut PgConnection, sql: &str, binds: PgArguments) -> (Vec<String>, f64) {
        fn walk(node: &serde_json::Value, types: &mut Vec<String>, outbox_rows: &mut f64) {
            let kind = node["Node Type"].as_str().unwrap_or_default().to_owned();
            if node["Relation Name"] == "saga_outbox" && kind != "ModifyTable" {
                *outbox_rows += node["Actual Rows"].as_f64().unwrap_or_default()
                    * node["Actual Loops"].as_f64().unwrap_or(1.0);
            }
            types.push(kind);
            for child in node["Plans"].as_array().into_iter().flatten() {
                walk(child, types, outbox_rows);
            }
        }
        let mut tx = conn.begin().await.unwrap();
        // The statements are this module's constants.
        let text = sqlx::AssertSqlSafe(format!("EXPLAIN (ANALYZE, FORMAT JSON) {sql}"));
        let explained: serde_json::Value = sqlx::query_with(text, binds)
            .fetch_one(&mut *tx)
            .await
            .unwrap()
            .get(0);
        tx.rollback().await.unwrap();
        let (mut types, mut rows) = (Vec::new(), 0.0);
        walk(&explained[0]["Plan"], &mut types, &mut rows);
        (types, rows)
    }

    /// The steady state (100,000 rows published and analyzed), then an outage's backlog of 20,000 rows that
    /// the statistics do not know of (autovacuum is off for the table, as when it has not come round yet).
    /// Left to those statistics, the relay's statements read far beyond the batch; with the pinned plans the
    /// fetch and the mark each touch the batch's 2,000 rows only.
    #[tokio::test]
    async fn the_relays_statements_touch_only_the_batch_when_statistics_are_stale() {
        let db = saga_test_support::TestDb::new("relay_pinned_plans").await;
        sqlx::raw_sql(
            "ALTER TABLE saga_outbox SET (autovacuum_enabled = false); \
             INSERT INTO saga_outbox (tenant_id, topic, partition_key, headers, payload, published_at) \
             SELECT 'default', 'orders', 'key-' || n % 1000, '{a,b}', '\\x00', now() \
             FROM generate_series(1, 100000) AS n; \
             ANALYZE saga_outbox; \
             INSERT INTO saga_outbox (tenant_id, topic, partition_key, headers, payload) \
             SELECT 'default', 'orders', 'key-' || n % 1000, '{a,b}', '\\x00' \
             FROM generate_series(1, 20000) AS n",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        let shards: Vec<i16> = (0..64).collect();
        let none: Vec<String> = Vec::new();
        let fetch = || arguments!(shards.clone(), 2_000_i64, none.clone(), none.clone());
        let ids: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM saga_outbox WHERE published_at IS NULL ORDER BY id LIMIT 2000",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        let (at, partitions, offsets) = (
            vec![Utc::now(); ids.len()],
            vec![0_i32; ids.len()],
            (0..2_000_i64).collect::<Vec<_>>(),
        );
        let mark = || arguments!(ids.clone(), at.clone(), partitions.clone(), offsets.clone());

        let mut plain: PgConnection = db.pool.acquire().await.unwrap().detach();
        let (_, fetched) = plan(&mut plain, FETCH_UNPUBLISHED, fetch()).await;
        let (types, marked) = plan(&mut plain, MARK_PUBLISHED, mark()).await;
        assert!(
            fetched.max(marked) > 20_000.0,
            "the control: left to the statistics, a statement reads beyond the batch \
             (fetch {fetched} rows, mark {marked} rows: {types:?})"
        );

        let mut pinned: PgConnection = db.pool.acquire().await.unwrap().detach();
        pin_plans(&mut pinned).await.unwrap();
        let (types, rows) = plan(&mut pinned, FETCH_UNPUBLISHED, fetch()).await;
        assert!(
            !types
                .iter()
                .any(|t| t == "Sort" || t.contains("Bitmap") || t == "Seq Scan"),
            "the pinned fetch walks the index in order: {types:?}"
        );
        assert_eq!(rows, 2_000.0, "the pinned fetch reads the batch only");
        let (types, rows) = plan(&mut pinned, MARK_PUBLISHED, mark()).await;
        assert!(
            types.iter().any(|t| t == "Nested Loop")
                && !types
                    .iter()
                    .any(|t| t == "Seq Scan" || t.contains("Bitmap") || t.contains("Join")),
            "the pinned mark looks each id up: {types:?}"
        );
        assert_eq!(rows, 2_000.0, "the pinned mark reads the batch's rows only");
    }
}
