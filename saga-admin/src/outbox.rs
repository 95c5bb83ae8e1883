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
    })
}
