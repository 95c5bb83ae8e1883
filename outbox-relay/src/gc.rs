//! Retention: published outbox rows and finished idempotency keys are deleted after their retention, in
//! bounded batches.

use std::time::Duration;

use saga_core::gc::{GcPolicy, GcReport, collect_idempotency_keys};
use sqlx::PgPool;

/// What to delete.
#[derive(Debug, Clone)]
pub struct RetentionPolicy {
    /// Published outbox rows older than this are deleted (default 7 days).
    pub published_retention: Duration,
    /// The idempotency store's policy.
    pub keys: GcPolicy,
}

impl Default for RetentionPolicy {
    fn default() -> Self {
        Self {
            published_retention: Duration::from_secs(7 * 24 * 3600),
            keys: GcPolicy::default(),
        }
    }
}

/// What a run deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetentionReport {
    /// Published outbox rows deleted.
    pub outbox_deleted: u64,
    /// Statements the outbox deletion took.
    pub outbox_batches: u64,
    /// The idempotency store's part.
    pub keys: GcReport,
}

/// Deletes what is past its retention.
pub async fn run_retention(
    pool: &PgPool,
    policy: &RetentionPolicy,
) -> Result<RetentionReport, sqlx::Error> {
    let (outbox_deleted, outbox_batches) =
        crate::store::delete_published(pool, policy.published_retention, policy.keys.batch_size)
            .await?;
    let keys = collect_idempotency_keys(pool, &policy.keys).await?;
    Ok(RetentionReport {
        outbox_deleted,
        outbox_batches,
        keys,
    })
}
