//! Saga instances in PostgreSQL, and applying a decision: an optimistic-concurrency update
//! (`WHERE saga_id = $1 AND version = $2`), a history row, and the command in the outbox, all in the
//! caller's transaction.

use chrono::{DateTime, Utc};
use saga_core::headers::names;
use saga_core::{Event, IdempotencyKey, Lineage, OutboxMessage, TenantId};
use serde::Serialize;
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use saga_consumer::admin::letters::indexable;

use crate::engine::{Decision, SagaState, SagaStatus};
use crate::error::OrchestratorError;

/// A saga instance as stored.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct SagaInstance {
    /// Its id.
    pub saga_id: Uuid,
    /// Its type.
    pub saga_type: String,
    /// Its tenant.
    pub tenant: String,
    /// The client's idempotency key it was started with.
    pub idempotency_key: String,
    /// `running`, `compensating`, `completed` or `compensated`.
    pub status: String,
    /// The step being run or compensated.
    pub step_index: i32,
    /// Sends of the current command.
    pub attempt: i32,
    /// The step keys issued, by step and compensation name.
    pub step_keys: serde_json::Value,
    /// The saga's data.
    pub data: serde_json::Value,
    /// Why it compensates.
    pub failure: Option<String>,
    /// When the current step times out.
    pub deadline: Option<DateTime<Utc>>,
    /// The optimistic-concurrency version.
    pub version: i32,
    /// Consecutive failures of its timer to fire (0 once a transition lands).
    pub timer_failures: i32,
    /// The last such failure.
    pub last_error: Option<String>,
    /// Why it is stuck: its deadline passed and the definition has no move for it. Cleared by a
    /// transition.
    pub stuck_reason: Option<String>,
    /// Who asked for its current command to be sent again ([`request_retry`]); cleared by a transition.
    pub retry_requested_by: Option<String>,
    /// When it started.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// The version of the definition it runs (the one it started with); `None` for an instance stored by
    /// 0.2, which runs on version 1.
    pub definition_version: Option<i32>,
}

impl SagaInstance {
    /// The state decisions depend on, with the instance's `data` read.
    pub(crate) fn state<D>(&self, data: D) -> Result<SagaState<D>, OrchestratorError> {
        Ok(SagaState {
            status: SagaStatus::parse(&self.status)
                .ok_or_else(|| OrchestratorError::Corrupt(format!("status {:?}", self.status)))?,
            step_index: usize::try_from(self.step_index)
                .map_err(|_| OrchestratorError::Corrupt(format!("step {}", self.step_index)))?,
            attempt: u32::try_from(self.attempt).unwrap_or(1),
            data,
            failure: self.failure.clone(),
        })
    }

    /// Whether 0.2 stored it (its data has the untyped form of 0.2).
    pub fn stored_by_0_2(&self) -> bool {
        self.definition_version.is_none()
    }

    /// The lineage commands of this saga inherit when no message causes them (the start, a timeout).
    pub(crate) fn lineage(&self) -> Result<Lineage, OrchestratorError> {
        Ok(Lineage::root_traced(
            IdempotencyKey::new(&self.idempotency_key)
                .map_err(|e| OrchestratorError::Corrupt(e.to_string()))?,
            TenantId::new(&self.tenant).map_err(|e| OrchestratorError::Corrupt(e.to_string()))?,
            None,
        ))
    }
}

/// One transition of an instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Transition {
    /// The version it produced.
    pub version: i32,
    /// When.
    pub at: DateTime<Utc>,
    /// From which status.
    pub from_status: Option<String>,
    /// To which status.
    pub to_status: String,
    /// The step concerned.
    pub step: Option<String>,
    /// What caused it.
    pub cause: String,
    /// Who asked for it, for a retry (`cause` is `retry`).
    pub operator: Option<String>,
    /// For a retry: the version whose attempt it retries.
    pub retry_of: Option<i32>,
}

const COLUMNS: &str = "saga_id, saga_type, tenant_id, idempotency_key, status, step_index, attempt, step_keys, \
     data, failure, deadline, version, created_at, updated_at, timer_failures, last_error, stuck_reason, \
     retry_requested_by, definition_version";

fn from_row(row: &sqlx::postgres::PgRow) -> Result<SagaInstance, sqlx::Error> {
    Ok(SagaInstance {
        saga_id: row.try_get(0)?,
        saga_type: row.try_get(1)?,
        tenant: row.try_get(2)?,
        idempotency_key: row.try_get(3)?,
        status: row.try_get(4)?,
        step_index: row.try_get(5)?,
        attempt: row.try_get(6)?,
        step_keys: row.try_get(7)?,
        data: row.try_get(8)?,
        failure: row.try_get(9)?,
        deadline: row.try_get(10)?,
        version: row.try_get(11)?,
        created_at: row.try_get(12)?,
        updated_at: row.try_get(13)?,
        timer_failures: row.try_get(14)?,
        last_error: row.try_get(15)?,
        stuck_reason: row.try_get(16)?,
        retry_requested_by: row.try_get(17)?,
        definition_version: row.try_get(18)?,
    })
}

/// Creates an instance of `saga_type` for (`tenant`, `key`), running version `definition_version`, with
/// `data`, or returns the one that exists (the start is idempotent on the client's key). The flag says
/// whether it was created.
pub(crate) async fn insert(
    conn: &mut PgConnection,
    saga_type: &str,
    tenant: &TenantId,
    key: &IdempotencyKey,
    data: &serde_json::Value,
    definition_version: i32,
) -> Result<(SagaInstance, bool), OrchestratorError> {
    let inserted = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO saga_instances (saga_id, saga_type, tenant_id, idempotency_key, status, step_index, data, \
             version, definition_version) \
         VALUES ($1, $2, $3, $4, $5, 0, $6, 0, $7) \
         ON CONFLICT (tenant_id, saga_type, idempotency_key) DO NOTHING RETURNING {COLUMNS}"
    )))
    .bind(Uuid::now_v7())
    .bind(saga_type)
    .bind(tenant.as_str())
    .bind(key.as_str())
    .bind(SagaStatus::Running.as_str())
    .bind(data)
    .bind(definition_version)
    .fetch_optional(&mut *conn)
    .await?;
    if let Some(row) = inserted {
        return Ok((from_row(&row)?, true));
    }
    let existing = by_key(conn, saga_type, tenant.as_str(), key.as_str())
        .await?
        .ok_or_else(|| OrchestratorError::Corrupt("an instance vanished while starting".into()))?;
    Ok((existing, false))
}

/// The instance of `saga_type` started with (`tenant`, `key`).
pub(crate) async fn by_key(
    conn: &mut PgConnection,
    saga_type: &str,
    tenant: &str,
    key: &str,
) -> Result<Option<SagaInstance>, OrchestratorError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM saga_instances WHERE saga_type = $1 AND tenant_id = $2 AND idempotency_key = $3"
    )))
    .bind(saga_type)
    .bind(tenant)
    .bind(key)
    .fetch_optional(conn)
    .await?;
    Ok(row.as_ref().map(from_row).transpose()?)
}

/// The instance `saga_id`.
pub async fn load(pool: &PgPool, saga_id: Uuid) -> Result<Option<SagaInstance>, OrchestratorError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM saga_instances WHERE saga_id = $1"
    )))
    .bind(saga_id)
    .fetch_optional(pool)
    .await?;
    Ok(row.as_ref().map(from_row).transpose()?)
}

/// Which instances [`list`] returns.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct SagaFilter {
    /// Only instances in this status.
    pub status: Option<SagaStatus>,
    /// Only stuck instances: unfinished ones (running or compensating) that have not moved for this long,
    /// and those marked stuck (see [`SagaInstance::stuck_reason`]).
    pub stuck_for: Option<std::time::Duration>,
    /// At most this many (default: 100).
    pub limit: Option<i64>,
}

impl SagaFilter {
    /// Instances in `status`.
    #[must_use]
    pub fn status(mut self, status: SagaStatus) -> Self {
        self.status = Some(status);
        self
    }

    /// Unfinished instances that have not moved for `idle`, and those marked stuck.
    #[must_use]
    pub fn stuck_for(mut self, idle: std::time::Duration) -> Self {
        self.stuck_for = Some(idle);
        self
    }

    /// At most `limit` instances.
    #[must_use]
    pub fn limit(mut self, limit: i64) -> Self {
        self.limit = Some(limit);
        self
    }
}

/// Instances of every type that `filter` selects, the longest unchanged first.
pub async fn list(
    pool: &PgPool,
    filter: &SagaFilter,
) -> Result<Vec<SagaInstance>, OrchestratorError> {
    let idle_ms = filter
        .stuck_for
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM saga_instances \
         WHERE ($1::text IS NULL OR status = $1) \
           AND ($2::bigint IS NULL OR (status IN ('running', 'compensating') \
                                       AND (updated_at < now() - $2 * interval '1 millisecond' \
                                            OR stuck_reason IS NOT NULL))) \
         ORDER BY updated_at LIMIT $3"
    )))
    .bind(filter.status.map(SagaStatus::as_str))
    .bind(idle_ms)
    .bind(filter.limit.unwrap_or(100))
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(from_row)
        .collect::<Result<_, _>>()
        .map_err(Into::into)
}

/// How many instances there are in each status.
pub async fn count_by_status(pool: &PgPool) -> Result<Vec<(String, i64)>, OrchestratorError> {
    Ok(sqlx::query_as(
        "SELECT status, count(*) FROM saga_instances GROUP BY status ORDER BY status",
    )
    .fetch_all(pool)
    .await?)
}

/// The history of instance `saga_id`, oldest first.
pub async fn history(pool: &PgPool, saga_id: Uuid) -> Result<Vec<Transition>, OrchestratorError> {
    let rows = sqlx::query(
        "SELECT version, at, from_status, to_status, step, cause, operator, retry_of FROM saga_transitions \
         WHERE saga_id = $1 ORDER BY version",
    )
    .bind(saga_id)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(Transition {
                version: r.try_get(0)?,
                at: r.try_get(1)?,
                from_status: r.try_get(2)?,
                to_status: r.try_get(3)?,
                step: r.try_get(4)?,
                cause: r.try_get(5)?,
                operator: r.try_get(6)?,
                retry_of: r.try_get(7)?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(Into::into)
}

/// Asks for saga `saga_id`'s current command to be sent again, by `operator`: the instance is made due at
/// once (its stuck mark and timer failures cleared), and the orchestrator of its service re-sends the
/// command with the same step key at its next timer tick, recording a `retry` transition that names the
/// operator and the version it retries. Returns the instance. Fails with
/// [`OrchestratorError::NotRetryable`] if the saga is finished (a compensated saga's completed steps were
/// undone: running one of its steps again would act on undone work; start a new saga instead).
pub async fn request_retry(
    pool: &PgPool,
    saga_id: Uuid,
    operator: &str,
) -> Result<SagaInstance, OrchestratorError> {
    request_retry_at(pool, saga_id, operator, None).await
}

/// [`request_retry`], only if the instance is still at `version` (the revision its requester saw), when
/// given: [`OrchestratorError::VersionConflict`] if it moved on since.
pub async fn request_retry_at(
    pool: &PgPool,
    saga_id: Uuid,
    operator: &str,
    version: Option<i64>,
) -> Result<SagaInstance, OrchestratorError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE saga_instances SET retry_requested_by = $2, retry_requested_at = now(), deadline = now(), \
             stuck_reason = NULL, stuck_at = NULL, timer_failures = 0 \
         WHERE saga_id = $1 AND status IN ('running', 'compensating') \
           AND ($3::bigint IS NULL OR version = $3) RETURNING {COLUMNS}"
    )))
    .bind(saga_id)
    .bind(operator)
    .bind(version)
    .fetch_optional(pool)
    .await?;
    match row {
        Some(row) => Ok(from_row(&row)?),
        None => match load(pool, saga_id).await? {
            Some(instance) if version.is_some_and(|v| v != i64::from(instance.version)) => {
                Err(OrchestratorError::VersionConflict {
                    saga_id,
                    version: version
                        .and_then(|v| i32::try_from(v).ok())
                        .unwrap_or(i32::MAX),
                })
            }
            Some(instance) => Err(OrchestratorError::NotRetryable {
                saga_id,
                status: instance.status,
            }),
            None => Err(OrchestratorError::NoSuchSaga(saga_id)),
        },
    }
}

/// Locks and returns up to `limit` instances of `saga_type` whose deadline passed (by the database's
/// `now()` shifted by `offset_ms`, the orchestrator's clock) and whose definition version is at most
/// `newest` (a 0.2 instance runs version 1), skipping those another transaction holds.
pub(crate) async fn lock_due(
    conn: &mut PgConnection,
    saga_type: &str,
    newest: i32,
    offset_ms: i64,
    limit: i64,
) -> Result<Vec<SagaInstance>, OrchestratorError> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM saga_instances \
         WHERE saga_type = $1 AND deadline <= now() + $4 * interval '1 millisecond' \
           AND coalesce(definition_version, 1) <= $3 \
         ORDER BY deadline LIMIT $2 FOR UPDATE SKIP LOCKED"
    )))
    .bind(saga_type)
    .bind(limit)
    .bind(newest)
    .bind(offset_ms)
    .fetch_all(conn)
    .await?;
    rows.iter()
        .map(from_row)
        .collect::<Result<_, _>>()
        .map_err(Into::into)
}

/// Applies `decision` to `instance` in the caller's transaction: the versioned update (a concurrent
/// transition makes it fail with [`OrchestratorError::VersionConflict`]) writing `data` (the next state's,
/// as JSON) and the definition's version it runs, the history row, and the command in the outbox,
/// inheriting `lineage`.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn apply<D>(
    conn: &mut PgConnection,
    instance: &SagaInstance,
    decision: &Decision<D>,
    data: &serde_json::Value,
    definition_version: i32,
    offset_ms: i64,
    lineage: &Lineage,
    outbox: &saga_consumer::Outbox,
) -> Result<(), OrchestratorError> {
    let next = &decision.next;
    let deadline_ms = decision
        .deadline
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let step_key = decision.send.as_ref().map(|s| {
        (
            s.step.to_string(),
            lineage.idempotency_key().step_key(&s.step).to_string(),
        )
    });
    let updated = sqlx::query(
        "UPDATE saga_instances SET status = $3, step_index = $4, attempt = $5, data = $6, failure = $7, \
             deadline = CASE WHEN $8::bigint IS NULL THEN NULL \
                             ELSE now() + ($12 + $8) * interval '1 millisecond' END, \
             step_keys = CASE WHEN $9::text IS NULL THEN step_keys \
                              ELSE step_keys || jsonb_build_object($9::text, $10::text) END, \
             version = version + 1, updated_at = now(), timer_failures = 0, last_error = NULL, \
             stuck_reason = NULL, stuck_at = NULL, retry_requested_by = NULL, retry_requested_at = NULL, \
             definition_version = $11 \
         WHERE saga_id = $1 AND version = $2",
    )
    .bind(instance.saga_id)
    .bind(instance.version)
    .bind(next.status.as_str())
    .bind(i32::try_from(next.step_index).unwrap_or(i32::MAX))
    .bind(i32::try_from(next.attempt).unwrap_or(i32::MAX))
    .bind(data)
    .bind(&next.failure)
    .bind(deadline_ms)
    .bind(step_key.as_ref().map(|(s, _)| s.as_str()))
    .bind(step_key.as_ref().map(|(_, k)| k.as_str()))
    .bind(definition_version)
    .bind(offset_ms)
    .execute(&mut *conn)
    .await?;
    if updated.rows_affected() == 0 {
        return Err(OrchestratorError::VersionConflict {
            saga_id: instance.saga_id,
            version: instance.version,
        });
    }
    // A retry's transition names who asked for it and the version that sent the attempt it retries.
    let retry = (decision.cause == crate::engine::RETRY_CAUSE).then(|| {
        (
            instance.retry_requested_by.as_deref().unwrap_or("unknown"),
            instance.version,
        )
    });
    record(
        conn,
        instance.saga_id,
        instance.version + 1,
        Some(&instance.status),
        decision,
        retry,
    )
    .await?;
    if let Some(send) = &decision.send {
        let event = Event::new(
            &send.event_type,
            &send.topic,
            instance.saga_id.to_string(),
            &send.payload,
        )
        .map_err(|e| OrchestratorError::Corrupt(e.to_string()))?
        .with_header(names::SAGA_ID, instance.saga_id.to_string())
        .with_header(names::REPLY_TO, send.reply_topic.clone());
        let source = format!("orchestrator/{}", instance.saga_type);
        outbox
            .append(conn, &[OutboxMessage::from_event(event, lineage, &source)])
            .await
            .map_err(OrchestratorError::of_outbox)?;
    }
    Ok(())
}

/// Records that `instance`'s timer failed to fire with `error`, and puts its deadline off (from the
/// orchestrator's clock, `now()` shifted by `offset_ms`) by a backoff that grows with its failures (1 s, 2 s, 4 s, ... up to 5 minutes), so that it is not picked first every time.
pub(crate) async fn timer_failed(
    conn: &mut PgConnection,
    instance: &SagaInstance,
    error: &str,
    offset_ms: i64,
) -> Result<(), OrchestratorError> {
    let error = indexable(error, MAX_REASON_BYTES);
    sqlx::query(
        "UPDATE saga_instances SET timer_failures = timer_failures + 1, last_error = $3, \
             deadline = now() + $4 * interval '1 millisecond' \
                        + least(power(2, least(timer_failures, 9)), 300) * interval '1 second' \
         WHERE saga_id = $1 AND version = $2",
    )
    .bind(instance.saga_id)
    .bind(instance.version)
    .bind(error)
    .bind(offset_ms)
    .execute(conn)
    .await?;
    Ok(())
}

/// Marks `instance` stuck for `reason` and clears its deadline: it is due, and the definition has no move
/// for it, so firing it again could only fail the same way (see `Orchestrator::fire_due`).
pub(crate) async fn mark_stuck(
    conn: &mut PgConnection,
    instance: &SagaInstance,
    reason: &str,
) -> Result<(), OrchestratorError> {
    let reason = indexable(reason, MAX_REASON_BYTES);
    sqlx::query(
        "UPDATE saga_instances SET deadline = NULL, stuck_reason = $3, stuck_at = now(), \
             retry_requested_by = NULL, retry_requested_at = NULL \
         WHERE saga_id = $1 AND version = $2",
    )
    .bind(instance.saga_id)
    .bind(instance.version)
    .bind(reason)
    .execute(conn)
    .await?;
    Ok(())
}

/// Writes the history row of a transition to `version`.
pub(crate) async fn record<D>(
    conn: &mut PgConnection,
    saga_id: Uuid,
    version: i32,
    from: Option<&str>,
    decision: &Decision<D>,
    retry: Option<(&str, i32)>,
) -> Result<(), OrchestratorError> {
    sqlx::query(
        "INSERT INTO saga_transitions (saga_id, version, from_status, to_status, step, cause, operator, \
             retry_of) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(saga_id)
    .bind(version)
    .bind(from)
    .bind(decision.next.status.as_str())
    .bind(&decision.step)
    .bind(&decision.cause)
    .bind(retry.map(|(operator, _)| operator))
    .bind(retry.map(|(_, of)| of))
    .execute(conn)
    .await?;
    Ok(())
}

/// The most of a reason (the user's code may word it) kept with an instance: cut to it, NULs replaced, as
/// the dead-letter index keeps a letter's error.
const MAX_REASON_BYTES: usize = 2048;
