//! Garbage collection of the idempotency store, in bounded batches so that it never holds many row locks or
//! one long transaction.

use std::time::Duration;

use sqlx::PgPool;

/// What to delete, and how much per statement. No defaults here: the relay's retention settings
/// (`outbox_relay::RetentionArgs`: `SAGA_KEY_RETENTION_HOURS`, `SAGA_ABANDONED_LEASE_HOURS`,
/// `RELAY_GC_BATCH_SIZE`) are the one place they are declared.
#[derive(Debug, Clone)]
pub struct GcPolicy {
    /// Completed and failed keys older than this (by last update) are deleted.
    ///
    /// Must exceed the longest time a message can still be delivered after it took effect: the topic's
    /// retention (`retention.ms`: a consumer group that starts over reads everything still there) plus the
    /// broker's offset retention (`offsets.retention.minutes`, 7 days by default in Kafka: a group idle for
    /// longer loses its committed offsets and, with `auto.offset.reset=earliest`, reads the topic from the
    /// start again). A message older than the key retention that is delivered again runs again.
    pub retention: Duration,
    /// `started` keys whose lease expired longer ago than this are deleted (their worker died and no retry
    /// came back for them).
    pub abandoned_after: Duration,
    /// Rows per DELETE statement.
    pub batch_size: u32,
}

/// What a garbage collection run deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Completed and failed keys deleted.
    pub finished_deleted: u64,
    /// Abandoned `started` keys deleted.
    pub abandoned_deleted: u64,
    /// DELETE statements run (each its own transaction).
    pub batches: u64,
}

/// Deletes old finished keys and long-abandoned leases from `saga_idempotency_keys`, `policy.batch_size` rows
/// per statement, until none is left. Rows locked by running transactions are skipped, not waited for.
pub async fn collect_idempotency_keys(
    pool: &PgPool,
    policy: &GcPolicy,
) -> Result<GcReport, sqlx::Error> {
    let mut report = GcReport::default();
    // A retention shorter than the floor would let the consumers' guard skip messages whose keys it
    // deleted: kept at the floor (the settings refuse less).
    let retention = policy.retention.max(MIN_KEY_RETENTION);
    if retention != policy.retention {
        tracing::warn!(
            asked = ?policy.retention,
            kept = ?retention,
            "a key retention below the floor: keys are kept for the floor"
        );
    }
    // The horizon first, committed before any key below it is deleted; every batch then deletes below
    // this same cutoff, however long the run takes.
    let cutoff: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "INSERT INTO saga_key_gc_horizon (horizon) VALUES (now() - $1 * interval '1 millisecond') \
         ON CONFLICT (singleton) DO UPDATE SET horizon = greatest(saga_key_gc_horizon.horizon, EXCLUDED.horizon) \
         RETURNING now() - $1 * interval '1 millisecond'",
    )
    .bind(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX))
    .fetch_one(pool)
    .await?;
    let finished = "DELETE FROM saga_idempotency_keys WHERE ctid = ANY(ARRAY( \
            SELECT ctid FROM saga_idempotency_keys \
            WHERE status <> 'started' AND updated_at < $1 \
            ORDER BY updated_at LIMIT $2 FOR UPDATE SKIP LOCKED))";
    let abandoned = "DELETE FROM saga_idempotency_keys WHERE ctid = ANY(ARRAY( \
            SELECT ctid FROM saga_idempotency_keys \
            WHERE status = 'started' AND lease_expires_at < now() - $1 * interval '1 millisecond' \
            ORDER BY lease_expires_at LIMIT $2 FOR UPDATE SKIP LOCKED))";
    report.finished_deleted = delete_batches(
        pool,
        finished,
        cutoff,
        policy.batch_size,
        &mut report.batches,
    )
    .await?;
    report.abandoned_deleted = delete_in_batches(
        pool,
        abandoned,
        policy.abandoned_after,
        policy.batch_size,
        &mut report.batches,
    )
    .await?;
    Ok(report)
}

/// Runs `statement` (with `$1` an age in milliseconds and `$2` a row limit) until it deletes fewer rows than
/// the limit. Returns the rows deleted and counts the statements in `batches`.
pub async fn delete_in_batches(
    pool: &PgPool,
    statement: &'static str,
    older_than: Duration,
    batch_size: u32,
    batches: &mut u64,
) -> Result<u64, sqlx::Error> {
    let age_ms = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
    delete_batches(pool, statement, age_ms, batch_size, batches).await
}

/// Runs `statement` (with `$1` bound to `first` and `$2` a row limit) until it deletes fewer rows than the
/// limit.
async fn delete_batches<T>(
    pool: &PgPool,
    statement: &'static str,
    first: T,
    batch_size: u32,
    batches: &mut u64,
) -> Result<u64, sqlx::Error>
where
    T: for<'q> sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Clone + Send,
{
    let limit = i64::from(batch_size.max(1));
    let mut total = 0;
    loop {
        let deleted = sqlx::query(statement)
            .bind(first.clone())
            .bind(limit)
            .execute(pool)
            .await?
            .rows_affected();
        *batches += 1;
        total += deleted;
        if deleted < limit.unsigned_abs() {
            return Ok(total);
        }
    }
}

/// How much a message's timestamp (the producer's clock) and a consumer's clock may be off the database's:
/// a key written when a message was processed is taken to be at most this much older than the message
/// says.
pub const CLOCK_SKEW: Duration = Duration::from_secs(3600);

/// The shortest key retention: `SAGA_KEY_RETENTION_HOURS` refuses less, and retention keeps keys at least
/// this long whatever it is asked. Messages younger than this less twice [`CLOCK_SKEW`]
/// ([`MAY_BE_GONE_AFTER`]) cannot have had their key deleted, whatever the retention of the process that ran
/// retention: a consumer looks at the horizon only for older ones.
pub const MIN_KEY_RETENTION: Duration = Duration::from_secs(4 * 3600);

/// The age (by its timestamp, on the consumer's clock) from which a message's key may have been deleted by
/// some process's retention: [`MIN_KEY_RETENTION`] less twice [`CLOCK_SKEW`] (the producer's clock and the
/// consumer's).
pub const MAY_BE_GONE_AFTER: Duration =
    Duration::from_secs(MIN_KEY_RETENTION.as_secs() - 2 * CLOCK_SKEW.as_secs());

/// The messages among `timestamps_ms` (milliseconds since the epoch) whose new step key (claimed in the
/// caller's transaction) may have been deleted by retention after their step ran: older than the horizon
/// retention has deleted keys up to (less [`CLOCK_SKEW`]). Call it after the claim: a retention run that
/// deleted the key committed before the claim could insert it, and had committed its horizon before that.
/// One answer per timestamp, in order.
pub async fn keys_may_be_gone(
    conn: &mut sqlx::PgConnection,
    timestamps_ms: &[i64],
) -> Result<Vec<bool>, sqlx::Error> {
    let horizon: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT horizon FROM saga_key_gc_horizon")
            .fetch_optional(conn)
            .await?;
    let Some(horizon) = horizon else {
        return Ok(vec![false; timestamps_ms.len()]);
    };
    let limit =
        horizon.timestamp_millis() + i64::try_from(CLOCK_SKEW.as_millis()).unwrap_or(i64::MAX);
    Ok(timestamps_ms.iter().map(|t| *t < limit).collect())
}
