//! Orchestrated saga instances: which are where, which are stuck, and one's timeline.

use std::time::Duration;

use saga_orchestrator::store::{self, SagaFilter};
use saga_orchestrator::{SagaInstance, SagaStatus, Transition};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::error::AdminError;
use crate::keys::{self, KeyView};

/// One saga with its history and its keys in this schema.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct SagaDetail {
    /// The instance.
    pub instance: SagaInstance,
    /// Its transitions, oldest first.
    pub timeline: Vec<Transition>,
    /// The keys of its key in this schema (the orchestrator's reply steps; the participants' step keys live
    /// in their own schemas, named in `instance.step_keys`).
    pub keys: Vec<KeyView>,
}

/// Parses a status name (`running`, `compensating`, `completed`, `compensated`).
pub fn parse_status(text: &str) -> Result<SagaStatus, AdminError> {
    SagaStatus::parse(text).ok_or_else(|| {
        AdminError::bad_input(format!(
            "unknown saga status {text:?}: use running, compensating, completed or compensated"
        ))
    })
}

/// Instances of every type in `status` (if given), or unfinished and unmoved for `stuck_for` (if given),
/// the longest unchanged first, at most `limit`.
pub async fn list(
    pool: &PgPool,
    status: Option<SagaStatus>,
    stuck_for: Option<Duration>,
    limit: i64,
) -> Result<Vec<SagaInstance>, AdminError> {
    require_sagas(pool).await?;
    let mut filter = SagaFilter::default().limit(limit);
    if let Some(status) = status {
        filter = filter.status(status);
    }
    if let Some(idle) = stuck_for {
        filter = filter.stuck_for(idle);
    }
    Ok(store::list(pool, &filter).await?)
}

/// How many instances are in each status.
pub async fn counts(pool: &PgPool) -> Result<Vec<(String, i64)>, AdminError> {
    require_sagas(pool).await?;
    Ok(store::count_by_status(pool).await?)
}

/// The saga `id` (a UUID) with its timeline; bad input if `id` is not a UUID or names no saga.
pub async fn show(pool: &PgPool, id: &str) -> Result<SagaDetail, AdminError> {
    let saga_id = Uuid::parse_str(id)
        .map_err(|_| AdminError::bad_input(format!("{id:?} is not a saga id (a UUID)")))?;
    require_sagas(pool).await?;
    let instance = store::load(pool, saga_id).await?.ok_or_else(|| {
        AdminError::bad_input(format!("no saga {saga_id} in this schema (SAGA_SCHEMA)"))
    })?;
    let timeline = store::history(pool, saga_id).await?;
    let keys = keys::show(pool, &instance.idempotency_key, Some(&instance.tenant)).await?;
    Ok(SagaDetail {
        instance,
        timeline,
        keys,
    })
}

/// Asks for saga `id`'s current command to be sent again, by `operator` (see
/// [`saga_orchestrator::store::request_retry`]): the orchestrator of the saga's service re-sends it, with
/// the same step key, at its next timer tick, and records a `retry` transition naming the operator and the
/// version it retries. Bad input if `id` names no saga here, or a finished one.
pub async fn retry(pool: &PgPool, id: &str, operator: &str) -> Result<SagaInstance, AdminError> {
    let saga_id = Uuid::parse_str(id)
        .map_err(|_| AdminError::bad_input(format!("{id:?} is not a saga id (a UUID)")))?;
    require_sagas(pool).await?;
    match store::request_retry(pool, saga_id, operator).await {
        Ok(instance) => Ok(instance),
        Err(
            e @ (saga_orchestrator::OrchestratorError::NotRetryable { .. }
            | saga_orchestrator::OrchestratorError::NoSuchSaga(_)),
        ) => Err(AdminError::bad_input(e.to_string())),
        Err(e) => Err(e.into()),
    }
}

/// [`retry`], pinned to `version` (the revision the operator saw), if given: a saga that moved on since
/// is bad input, "changed since the preview", and nothing is requested.
pub async fn retry_pinned(
    pool: &PgPool,
    id: &str,
    operator: &str,
    version: Option<i64>,
) -> Result<SagaInstance, AdminError> {
    let saga_id = Uuid::parse_str(id)
        .map_err(|_| AdminError::bad_input(format!("{id:?} is not a saga id (a UUID)")))?;
    require_sagas(pool).await?;
    match store::request_retry_at(pool, saga_id, operator, version).await {
        Ok(instance) => Ok(instance),
        Err(saga_orchestrator::OrchestratorError::VersionConflict { version, .. }) => {
            Err(AdminError::bad_input(format!(
                "saga {saga_id} changed since the preview (it showed revision {version}): nothing was done; \
                 open it again"
            )))
        }
        Err(
            e @ (saga_orchestrator::OrchestratorError::NotRetryable { .. }
            | saga_orchestrator::OrchestratorError::NoSuchSaga(_)),
        ) => Err(AdminError::bad_input(e.to_string())),
        Err(e) => Err(e.into()),
    }
}

/// Stuck sagas by type: marked stuck by their timer, or unfinished and unmoved for `stuck_for`. Empty if
/// the schema keeps no sagas.
pub async fn stuck_by_type(
    pool: &PgPool,
    stuck_for: Duration,
) -> Result<Vec<(String, i64)>, AdminError> {
    if require_sagas(pool).await.is_err() {
        return Ok(Vec::new());
    }
    Ok(sqlx::query_as(
        "SELECT saga_type, count(*) FROM saga_instances \
         WHERE stuck_reason IS NOT NULL \
            OR (status IN ('running', 'compensating') \
                AND updated_at < now() - $1 * interval '1 millisecond') \
         GROUP BY saga_type ORDER BY saga_type",
    )
    .bind(i64::try_from(stuck_for.as_millis()).unwrap_or(i64::MAX))
    .fetch_all(pool)
    .await?)
}

/// Bad input, saying where sagas are kept, if the schema holds none.
async fn require_sagas(pool: &PgPool) -> Result<(), AdminError> {
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.tables \
         WHERE table_schema = current_schema() AND table_name = 'saga_instances')",
    )
    .fetch_one(pool)
    .await?;
    if exists {
        Ok(())
    } else {
        Err(AdminError::bad_input(
            "this schema has no saga_instances table: orchestrated sagas are kept in the orchestrating \
             service's schema; point SAGA_SCHEMA at it",
        ))
    }
}
