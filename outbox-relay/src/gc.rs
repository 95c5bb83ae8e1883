//! Retention: published outbox rows and finished idempotency keys are deleted after their retention, in
//! bounded batches.

use std::time::Duration;

use saga_runtime::store::gc::{GcPolicy, collect_idempotency_keys};
use sqlx::PgPool;

/// What retention deletes, and how much per statement.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RetentionPolicy {
    /// Published outbox rows older than this are deleted (`RELAY_PUBLISHED_RETENTION_HOURS`, default 7
    /// days). Parked rows are kept.
    pub published_rows: Duration,
    /// Completed and failed keys older than this are deleted (`SAGA_KEY_RETENTION_HOURS`, default 7 days).
    /// Must exceed the topics' retention plus the broker's offset retention, or a message delivered again
    /// after its key was deleted runs again.
    pub finished_keys: Duration,
    /// Two-phase leases expired longer ago than this are deleted (`SAGA_ABANDONED_LEASE_HOURS`, default 1
    /// day).
    pub abandoned_leases: Duration,
    /// Rows per DELETE statement (`RELAY_GC_BATCH_SIZE`, default 5,000).
    pub batch_size: u32,
}

impl Default for RetentionPolicy {
    /// The defaults of [`RetentionArgs`](crate::RetentionArgs), declared there once.
    fn default() -> Self {
        crate::settings::RetentionArgs::default()
            .policy()
            .expect("the default retention is valid")
    }
}

/// What a retention run deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetentionReport {
    /// Published outbox rows deleted.
    pub outbox_deleted: u64,
    /// Statements the outbox deletion took.
    pub outbox_batches: u64,
    /// Finished keys deleted.
    pub finished_keys_deleted: u64,
    /// Abandoned leases deleted.
    pub abandoned_leases_deleted: u64,
}

/// Deletes what is past its retention, in the outbox and the key store of the pool's schema.
pub async fn run_retention(
    pool: &PgPool,
    policy: &RetentionPolicy,
) -> Result<RetentionReport, sqlx::Error> {
    let (outbox_deleted, outbox_batches) =
        crate::store::delete_published(pool, policy.published_rows, policy.batch_size).await?;
    let keys = collect_idempotency_keys(
        pool,
        &GcPolicy {
            retention: policy.finished_keys,
            abandoned_after: policy.abandoned_leases,
            batch_size: policy.batch_size,
        },
    )
    .await?;
    Ok(RetentionReport {
        outbox_deleted,
        outbox_batches,
        finished_keys_deleted: keys.finished_deleted,
        abandoned_leases_deleted: keys.abandoned_deleted,
    })
}
