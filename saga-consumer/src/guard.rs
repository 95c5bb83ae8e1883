//! Poison-pill detection across crashes. A message that kills the process (an abort, an out-of-memory kill)
//! would otherwise be redelivered after the restart and kill it again, forever.
//!
//! Each batch's offset range is recorded before it runs (see the `saga_consumer_progress` migration). A
//! batch that starts inside the previous, unfinished range means the last run died there: that range is then
//! processed one message at a time, and a message whose isolated processing started more than `limit` times
//! without finishing is dead-lettered.

use sqlx::{PgPool, Row};

/// What to do with a batch about to start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BatchStart {
    /// Process the batch normally.
    Normal,
    /// The last run died in this range: process the first message alone.
    Isolate,
    /// The first message took the consumer down this many times: dead-letter it.
    DeadLetter(u32),
}

/// Records batch starts and ends for one consumer group.
#[derive(Clone)]
pub(crate) struct CrashGuard {
    pool: PgPool,
    group: String,
    limit: u32,
}

impl CrashGuard {
    /// `limit` is the number of deaths tolerated per message; 0 turns detection off.
    pub fn new(pool: PgPool, group: String, limit: u32) -> Self {
        Self { pool, group, limit }
    }

    /// Records that a batch `first..=last` of `topic`/`partition` begins. A database error goes to the
    /// caller, which retries: processing without the record would blind the detection.
    pub async fn begin(
        &self,
        topic: &str,
        partition: i32,
        first: i64,
        last: i64,
    ) -> Result<BatchStart, sqlx::Error> {
        if self.limit == 0 {
            return Ok(BatchStart::Normal);
        }
        let row = sqlx::query(
            "SELECT isolate, deaths FROM saga_consumer_begin_batch($1, $2, $3, $4, $5)",
        )
        .bind(&self.group)
        .bind(topic)
        .bind(partition)
        .bind(first)
        .bind(last)
        .fetch_one(&self.pool)
        .await?;
        let isolate: bool = row.try_get(0)?;
        let deaths = u32::try_from(row.try_get::<i32, _>(1)?).unwrap_or(0);
        Ok(match (isolate, deaths) {
            (false, _) => BatchStart::Normal,
            (true, d) if d >= self.limit => BatchStart::DeadLetter(d),
            (true, _) => BatchStart::Isolate,
        })
    }

    /// Records that the batch starting at `first` ended: `finished`, or abandoned on purpose.
    pub async fn end(&self, topic: &str, partition: i32, first: i64, finished: bool) {
        if self.limit == 0 {
            return;
        }
        let result = sqlx::query("SELECT saga_consumer_end_batch($1, $2, $3, $4, $5)")
            .bind(&self.group)
            .bind(topic)
            .bind(partition)
            .bind(first)
            .bind(finished)
            .execute(&self.pool)
            .await;
        if let Err(e) = result {
            tracing::warn!(error = %e, topic, partition, first, "could not record the end of a batch");
        }
    }
}
