//! The PostgreSQL idempotency store: one row per (tenant, step key) in `saga_idempotency_keys`.
//!
//! - Transactional mode: [`claim_in_transaction`] inserts the keys inside the caller's transaction with
//!   `INSERT .. ON CONFLICT DO NOTHING`. A concurrent claimant of the same key blocks on the unique index
//!   until the first transaction ends, then sees the key done (or wins it, if the first rolled back). There
//!   is no SELECT-then-INSERT window. [`try_claim`] is the same for one key, but answers "busy" instead of
//!   waiting (HTTP entry points reply 409); it guards its keys with an advisory lock.
//!   [`claim_new_in_transaction`] is the cheaper claim of keys expected to be new: a plain `INSERT` that
//!   fails, aborting the transaction, where one of them exists.
//! - Two-phase mode: [`claim_lease`] commits a `started` row with a lease; [`complete_lease`] finishes it in
//!   a later transaction, fenced by the attempt number that a takeover increments.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Row};

use saga_core::StepOutcome;
use saga_core::{StepKey, TenantId};

/// The state of a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyStatus {
    /// Leased by a two-phase worker.
    Started,
    /// The step took effect.
    Completed,
    /// The step was rejected (a permanent business failure).
    Failed,
}

impl KeyStatus {
    /// The value stored in the `status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Started => "started",
            Self::Completed => "completed",
            Self::Failed => "failed",
        }
    }

    fn parse(value: &str) -> Result<Self, StoreError> {
        match value {
            "started" => Ok(Self::Started),
            "completed" => Ok(Self::Completed),
            "failed" => Ok(Self::Failed),
            other => Err(StoreError::UnknownStatus(other.to_owned())),
        }
    }
}

/// What the store remembers of a finished step; duplicates are reported with it.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredOutcome {
    /// `Completed` or `Failed`.
    pub status: KeyStatus,
    /// The stored result (or rejection details).
    pub outcome: Option<serde_json::Value>,
    /// The rejection reason, for `Failed`.
    pub error: Option<String>,
}

/// The result of claiming a key.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// The caller owns the key: run the step.
    New,
    /// The step already finished: skip it.
    Duplicate(StoredOutcome),
    /// A two-phase worker holds a live lease: try again later, after `until` at the latest.
    Busy {
        /// When the lease expires.
        until: DateTime<Utc>,
    },
}

/// A failure of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database failed.
    #[error("idempotency store: {0}")]
    Database(#[from] sqlx::Error),
    /// A two-phase worker's lease was taken over by another worker; its work must be rolled back.
    #[error("lease on {key} (attempt {attempt}) was taken over by another worker")]
    Fenced {
        /// The step key.
        key: String,
        /// The attempt number the worker held.
        attempt: i32,
    },
    /// The row holds a status this version does not know.
    #[error("idempotency store: unknown status {0:?}")]
    UnknownStatus(String),
    /// The outbox refused the transaction's events (not writable now, or too large).
    #[error(transparent)]
    Outbox(#[from] super::outbox::OutboxError),
}

impl StoreError {
    /// Whether the error means the database is unreachable, or the outbox may not be written now (as
    /// opposed to a failed statement): waited out, never counted against a message.
    pub fn is_connection_error(&self) -> bool {
        match self {
            Self::Database(e) => saga_core::StepError::is_connection_error(e),
            Self::Outbox(e) => e.is_unavailable(),
            Self::Fenced { .. } | Self::UnknownStatus(_) => false,
        }
    }

    /// Whether running the same work again cannot succeed (events larger than the outbox accepts, or
    /// holding what it cannot store).
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            Self::Outbox(
                super::outbox::OutboxError::TooLarge { .. }
                    | super::outbox::OutboxError::Refused { .. }
            )
        )
    }
}

/// A key as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyRecord {
    /// The tenant.
    pub tenant: String,
    /// The step key.
    pub step_key: String,
    /// Its status.
    pub status: KeyStatus,
    /// How often it was claimed.
    pub attempts: i32,
    /// For `Started`: until when the lease runs.
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// For `Started`: who holds (or held) the lease: `{group}@{host}/{pid}`.
    pub lease_holder: Option<String>,
    /// The stored outcome.
    pub outcome: Option<serde_json::Value>,
    /// The stored error.
    pub error: Option<String>,
    /// When the key was first claimed.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// Whether it is an HTTP request's key (the `Idempotency-Key` layer's): its outcome is the stored
    /// response.
    pub http_request: bool,
}

/// The statement both transactional claims start with: the keys `$1`/`$2` inserted as `completed`, sorted,
/// so that two transactions claiming overlapping batches, with either claim, lock keys in the same order.
macro_rules! insert_completed_keys_sorted {
    () => {
        "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status) \
         SELECT t, k, 'completed' FROM unnest($1::text[], $2::text[]) AS u(t, k) ORDER BY t, k"
    };
}

fn columns(keys: &[(TenantId, StepKey)]) -> (Vec<String>, Vec<String>) {
    keys.iter()
        .map(|(t, k)| (t.to_string(), k.to_string()))
        .unzip()
}

/// Claims `keys` inside the caller's open transaction (transactional mode), one claim per key, in order.
///
/// A new key is written in its final `completed` state: it becomes visible only if the transaction commits,
/// together with the step's effects, and disappears if it rolls back. Call [`record_outcomes`] for steps that
/// store a result or were rejected. A key whose two-phase lease expired is taken over.
///
/// The keys must be distinct. Blocks while another transaction holds an uncommitted claim of one of them.
pub async fn claim_in_transaction(
    conn: &mut PgConnection,
    keys: &[(TenantId, StepKey)],
) -> Result<Vec<Claim>, StoreError> {
    debug_assert_eq!(
        keys.iter().collect::<HashSet<_>>().len(),
        keys.len(),
        "claim_in_transaction needs distinct keys"
    );
    let mut claims: HashMap<(String, String), Claim> = HashMap::with_capacity(keys.len());
    let (mut tenants, mut step_keys) = columns(keys);
    // A key deleted by garbage collection between the INSERT and the SELECT is claimed again; a second pass
    // always settles it, the loop bound is only a guard.
    for _ in 0..3 {
        if tenants.is_empty() {
            break;
        }
        let inserted = sqlx::query(concat!(
            insert_completed_keys_sorted!(),
            " ON CONFLICT (tenant_id, step_key) DO NOTHING RETURNING tenant_id, step_key",
        ))
        .bind(&tenants)
        .bind(&step_keys)
        .fetch_all(&mut *conn)
        .await?;
        for row in inserted {
            claims.insert((row.try_get(0)?, row.try_get(1)?), Claim::New);
        }
        let (rest_t, rest_k): (Vec<String>, Vec<String>) = tenants
            .into_iter()
            .zip(step_keys)
            .filter(|(t, k)| !claims.contains_key(&(t.clone(), k.clone())))
            .unzip();
        if rest_t.is_empty() {
            break;
        }
        let existing = sqlx::query(
            "SELECT k.tenant_id, k.step_key, k.status, k.outcome, k.error, k.lease_expires_at, \
                    k.lease_expires_at <= now() AS expired \
             FROM saga_idempotency_keys k \
             JOIN unnest($1::text[], $2::text[]) AS u(t, key) ON k.tenant_id = u.t AND k.step_key = u.key \
             ORDER BY k.tenant_id, k.step_key \
             FOR UPDATE OF k",
        )
        .bind(&rest_t)
        .bind(&rest_k)
        .fetch_all(&mut *conn)
        .await?;
        let (mut takeover_t, mut takeover_k) = (Vec::new(), Vec::new());
        for row in existing {
            let id: (String, String) = (row.try_get(0)?, row.try_get(1)?);
            let status = KeyStatus::parse(row.try_get(2)?)?;
            let claim = match status {
                KeyStatus::Completed | KeyStatus::Failed => Claim::Duplicate(StoredOutcome {
                    status,
                    outcome: row.try_get(3)?,
                    error: row.try_get(4)?,
                }),
                KeyStatus::Started if row.try_get::<Option<bool>, _>(6)?.unwrap_or(true) => {
                    takeover_t.push(id.0.clone());
                    takeover_k.push(id.1.clone());
                    Claim::New
                }
                KeyStatus::Started => Claim::Busy {
                    until: row
                        .try_get::<Option<DateTime<Utc>>, _>(5)?
                        .unwrap_or_else(Utc::now),
                },
            };
            claims.insert(id, claim);
        }
        if !takeover_t.is_empty() {
            sqlx::query(
                "UPDATE saga_idempotency_keys k \
                 SET status = 'completed', attempts = k.attempts + 1, lease_expires_at = NULL, \
                     error = NULL, updated_at = now() \
                 FROM unnest($1::text[], $2::text[]) AS u(t, key) \
                 WHERE k.tenant_id = u.t AND k.step_key = u.key",
            )
            .bind(&takeover_t)
            .bind(&takeover_k)
            .execute(&mut *conn)
            .await?;
        }
        (tenants, step_keys) = rest_t
            .into_iter()
            .zip(rest_k)
            .filter(|(t, k)| !claims.contains_key(&(t.clone(), k.clone())))
            .unzip();
    }
    keys.iter()
        .map(|(t, k)| {
            claims
                .remove(&(t.to_string(), k.to_string()))
                .ok_or_else(|| {
                    StoreError::Database(sqlx::Error::Protocol(format!(
                        "key {k} of tenant {t} was neither inserted nor found"
                    )))
                })
        })
        .collect()
}

/// What [`claim_new_in_transaction`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NewClaims {
    /// Every key was new: all of them are claimed, as [`Claim::New`] would have them.
    Claimed,
    /// A key existed, or another transaction claimed one first. The statement failed, and with it the
    /// caller's transaction: roll it back, then claim the keys with [`claim_in_transaction`].
    SomeExist,
}

/// Claims `keys` inside the caller's open transaction on the assumption that none of them exists yet:
/// one plain `INSERT`, in the same order as [`claim_in_transaction`], without the per-row conflict check
/// of `ON CONFLICT`, which costs PostgreSQL about as much again as the insert itself.
///
/// Where every key is new (the common case: Kafka redelivers rarely) the keys are claimed exactly as
/// [`claim_in_transaction`] claims them. Where one exists, the statement fails with a unique violation,
/// which aborts the caller's transaction: [`NewClaims::SomeExist`] says so, and nothing of the transaction
/// may be kept. A claim of another transaction that has not ended yet is waited for, as with
/// [`claim_in_transaction`]. The keys must be distinct.
pub async fn claim_new_in_transaction(
    conn: &mut PgConnection,
    keys: &[(TenantId, StepKey)],
) -> Result<NewClaims, StoreError> {
    let tenants: Vec<&str> = keys.iter().map(|(t, _)| t.as_str()).collect();
    let step_keys: Vec<&str> = keys.iter().map(|(_, k)| k.as_str()).collect();
    let inserted = sqlx::query(insert_completed_keys_sorted!())
        .bind(&tenants)
        .bind(&step_keys)
        .execute(conn)
        .await;
    match inserted {
        Ok(_) => Ok(NewClaims::Claimed),
        Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Ok(NewClaims::SomeExist),
        Err(e) => Err(e.into()),
    }
}

/// The status, outcome and error columns for a finished step.
fn outcome_columns(
    outcome: &StepOutcome,
) -> (KeyStatus, Option<serde_json::Value>, Option<String>) {
    let status = if outcome.is_completed() {
        KeyStatus::Completed
    } else {
        KeyStatus::Failed
    };
    (
        status,
        outcome.stored().cloned(),
        outcome.rejection_reason().map(str::to_owned),
    )
}

/// Records the outcomes of keys claimed with [`claim_in_transaction`] in the same transaction, in one
/// statement. Plain completions without a result need no call: the claim already wrote them.
pub async fn record_outcomes(
    conn: &mut PgConnection,
    outcomes: &[(&TenantId, &StepKey, &StepOutcome)],
) -> Result<(), StoreError> {
    let needed: Vec<_> = outcomes
        .iter()
        .filter(|(_, _, o)| !(o.is_completed() && o.stored().is_none()))
        .collect();
    if needed.is_empty() {
        return Ok(());
    }
    let mut tenants = Vec::with_capacity(needed.len());
    let mut keys = Vec::with_capacity(needed.len());
    let mut statuses = Vec::with_capacity(needed.len());
    let mut values = Vec::with_capacity(needed.len());
    let mut errors = Vec::with_capacity(needed.len());
    for (tenant, key, outcome) in needed {
        let (status, value, error) = outcome_columns(outcome);
        tenants.push(tenant.to_string());
        keys.push(key.to_string());
        statuses.push(status.as_str());
        values.push(value);
        errors.push(error);
    }
    sqlx::query(
        "UPDATE saga_idempotency_keys k \
         SET status = u.status, outcome = u.outcome, error = u.error, updated_at = now() \
         FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[], $5::text[]) \
              AS u(t, key, status, outcome, error) \
         WHERE k.tenant_id = u.t AND k.step_key = u.key",
    )
    .bind(&tenants)
    .bind(&keys)
    .bind(&statuses)
    .bind(&values)
    .bind(&errors)
    .execute(conn)
    .await?;
    Ok(())
}

/// The result of [`try_claim`].
#[derive(Debug, Clone, PartialEq)]
pub enum TryClaim {
    /// The caller owns the key (written `completed` in its transaction).
    Claimed,
    /// Another transaction holds an uncommitted claim, or a two-phase worker a live lease.
    Busy,
    /// The key exists.
    Existing {
        /// Its outcome.
        stored: StoredOutcome,
        /// The fingerprint of the request that claimed it.
        request_hash: Option<Vec<u8>>,
    },
}

/// Claims one key in the caller's transaction like [`claim_in_transaction`], but answers
/// [`TryClaim::Busy`] at once while another transaction holds it, instead of waiting. Stores
/// `request_hash` with a new key. Keys claimed this way must only ever be claimed this way.
pub async fn try_claim(
    conn: &mut PgConnection,
    tenant: &TenantId,
    key: &StepKey,
    request_hash: &[u8],
) -> Result<TryClaim, StoreError> {
    let row = sqlx::query(
        "SELECT claimed, busy, status, outcome, error, request_hash FROM saga_try_claim_key($1, $2, $3)",
    )
    .bind(tenant.as_str())
    .bind(key.as_str())
    .bind(request_hash)
    .fetch_optional(conn)
    .await?;
    let Some(row) = row else {
        // The key vanished between the conflict and the lookup (garbage collection): it is free, but this
        // transaction did not write it; the caller retries.
        return Ok(TryClaim::Busy);
    };
    if row.try_get::<bool, _>(0)? {
        return Ok(TryClaim::Claimed);
    }
    if row.try_get::<bool, _>(1)? {
        return Ok(TryClaim::Busy);
    }
    let status = KeyStatus::parse(row.try_get(2)?)?;
    if status == KeyStatus::Started {
        return Ok(TryClaim::Busy);
    }
    Ok(TryClaim::Existing {
        stored: StoredOutcome {
            status,
            outcome: row.try_get(3)?,
            error: row.try_get(4)?,
        },
        request_hash: row.try_get(5)?,
    })
}

/// A two-phase worker's hold on a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The tenant.
    pub tenant: TenantId,
    /// The step key.
    pub key: StepKey,
    /// The fencing token: a takeover increments it.
    pub attempt: i32,
    /// When the lease expires.
    pub expires_at: DateTime<Utc>,
}

/// The result of [`claim_lease`].
#[derive(Debug, Clone, PartialEq)]
pub enum LeaseClaim {
    /// The caller holds the lease (a new key, or one whose previous lease expired).
    Acquired(Lease),
    /// The step already finished.
    Duplicate(StoredOutcome),
    /// Another worker holds a live lease until `until`: retry later, it is not a failure.
    Busy {
        /// When that lease expires.
        until: DateTime<Utc>,
    },
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Phase one of two-phase mode: leases `key` as `started` for `lease`, in its own statement (commit it
/// before calling out: pass a pool connection outside any transaction).
///
/// Whether a lease has expired is decided by the database's clock alone, so a client whose clock runs ahead
/// of the database's gets [`LeaseClaim::Busy`], never a loop.
pub async fn claim_lease(
    conn: &mut PgConnection,
    tenant: &TenantId,
    key: &StepKey,
    lease: Duration,
    holder: &str,
) -> Result<LeaseClaim, StoreError> {
    // A row deleted or expired between the two statements is claimed again; the bound is only a guard.
    for _ in 0..3 {
        let acquired = sqlx::query(
            "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status, lease_expires_at, lease_holder) \
             VALUES ($1, $2, 'started', now() + $3 * interval '1 millisecond', $4) \
             ON CONFLICT (tenant_id, step_key) DO UPDATE \
                 SET attempts = saga_idempotency_keys.attempts + 1, \
                     lease_expires_at = excluded.lease_expires_at, lease_holder = excluded.lease_holder, \
                     updated_at = now() \
                 WHERE saga_idempotency_keys.status = 'started' \
                   AND saga_idempotency_keys.lease_expires_at <= now() \
             RETURNING attempts, lease_expires_at",
        )
        .bind(tenant.as_str())
        .bind(key.as_str())
        .bind(millis(lease))
        .bind(holder)
        .fetch_optional(&mut *conn)
        .await?;
        if let Some(row) = acquired {
            return Ok(LeaseClaim::Acquired(Lease {
                tenant: tenant.clone(),
                key: key.clone(),
                attempt: row.try_get(0)?,
                expires_at: row.try_get(1)?,
            }));
        }
        let existing = sqlx::query(
            "SELECT status, outcome, error, lease_expires_at, lease_expires_at <= now() \
             FROM saga_idempotency_keys WHERE tenant_id = $1 AND step_key = $2",
        )
        .bind(tenant.as_str())
        .bind(key.as_str())
        .fetch_optional(&mut *conn)
        .await?;
        let Some(row) = existing else {
            continue; // deleted in between: claim again
        };
        let status = KeyStatus::parse(row.try_get(0)?)?;
        match status {
            KeyStatus::Completed | KeyStatus::Failed => {
                return Ok(LeaseClaim::Duplicate(StoredOutcome {
                    status,
                    outcome: row.try_get(1)?,
                    error: row.try_get(2)?,
                }));
            }
            KeyStatus::Started if row.try_get::<Option<bool>, _>(4)? == Some(true) => continue,
            KeyStatus::Started => {
                return Ok(LeaseClaim::Busy {
                    until: row
                        .try_get::<Option<DateTime<Utc>>, _>(3)?
                        .unwrap_or_else(Utc::now),
                });
            }
        }
    }
    // Expired, then taken by another claimant, three times over: someone else holds it now.
    Ok(LeaseClaim::Busy { until: Utc::now() })
}

/// Phase two of two-phase mode: marks the leased key finished with `outcome`, inside the caller's
/// transaction (the one that also writes the business rows and the outbox). Call it first in that
/// transaction: it locks the key, so a takeover waits for this transaction to end.
///
/// Fails with [`StoreError::Fenced`] if the lease was taken over; the caller must then roll back.
pub async fn complete_lease(
    conn: &mut PgConnection,
    lease: &Lease,
    outcome: &StepOutcome,
) -> Result<(), StoreError> {
    let (status, value, error) = outcome_columns(outcome);
    let updated = sqlx::query(
        "UPDATE saga_idempotency_keys \
         SET status = $4, outcome = $5, error = $6, lease_expires_at = NULL, updated_at = now() \
         WHERE tenant_id = $1 AND step_key = $2 AND status = 'started' AND attempts = $3",
    )
    .bind(lease.tenant.as_str())
    .bind(lease.key.as_str())
    .bind(lease.attempt)
    .bind(status.as_str())
    .bind(value)
    .bind(error)
    .execute(conn)
    .await?;
    if updated.rows_affected() == 0 {
        return Err(StoreError::Fenced {
            key: lease.key.to_string(),
            attempt: lease.attempt,
        });
    }
    Ok(())
}

/// Locks a leased key in the caller's transaction, checking that the lease is still the caller's. Call it
/// first in the completing transaction: from then on a takeover waits for this transaction to end. Fails
/// with [`StoreError::Fenced`] if the lease was taken over.
///
/// A key whose row is gone (garbage collection deleted it as an abandoned lease while the external call
/// ran long) is not "taken over": nobody else holds it, and the external call happened. The row is written
/// back, still `started` under the caller's attempt number, so that the completion that follows records it.
pub async fn lock_lease(conn: &mut PgConnection, lease: &Lease) -> Result<(), StoreError> {
    let held = sqlx::query_scalar::<_, i32>(
        "SELECT attempts FROM saga_idempotency_keys \
         WHERE tenant_id = $1 AND step_key = $2 AND status = 'started' FOR UPDATE",
    )
    .bind(lease.tenant.as_str())
    .bind(lease.key.as_str())
    .fetch_optional(&mut *conn)
    .await?;
    let fenced = || StoreError::Fenced {
        key: lease.key.to_string(),
        attempt: lease.attempt,
    };
    match held {
        Some(attempt) if attempt == lease.attempt => Ok(()),
        Some(_) => Err(fenced()),
        None => {
            // Gone, or finished by someone else. Write it back if gone; a concurrent claimant's insert makes
            // this one conflict, and then the lease is not ours any more.
            let restored = sqlx::query(
                "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status, attempts, lease_expires_at) \
                 VALUES ($1, $2, 'started', $3, now()) ON CONFLICT (tenant_id, step_key) DO NOTHING",
            )
            .bind(lease.tenant.as_str())
            .bind(lease.key.as_str())
            .bind(lease.attempt)
            .execute(&mut *conn)
            .await?;
            if restored.rows_affected() == 1 {
                Ok(())
            } else {
                Err(fenced())
            }
        }
    }
}

/// Gives up a lease after a failed attempt so that a retry may take the key over at once. Returns whether
/// the lease was still held.
pub async fn release_lease(
    conn: &mut PgConnection,
    lease: &Lease,
    error: &str,
) -> Result<bool, StoreError> {
    let updated = sqlx::query(
        "UPDATE saga_idempotency_keys SET lease_expires_at = now(), error = $4, updated_at = now() \
         WHERE tenant_id = $1 AND step_key = $2 AND status = 'started' AND attempts = $3",
    )
    .bind(lease.tenant.as_str())
    .bind(lease.key.as_str())
    .bind(lease.attempt)
    .bind(error)
    .execute(conn)
    .await?;
    Ok(updated.rows_affected() == 1)
}

const KEY_COLUMNS: &str = "tenant_id, step_key, status, attempts, lease_expires_at, lease_holder, outcome, \
     error, created_at, updated_at, request_hash IS NOT NULL";

fn key_record(row: &sqlx::postgres::PgRow) -> Result<KeyRecord, StoreError> {
    Ok(KeyRecord {
        tenant: row.try_get(0)?,
        step_key: row.try_get(1)?,
        status: KeyStatus::parse(row.try_get(2)?)?,
        attempts: row.try_get(3)?,
        lease_expires_at: row.try_get(4)?,
        lease_holder: row.try_get(5)?,
        outcome: row.try_get(6)?,
        error: row.try_get(7)?,
        created_at: row.try_get(8)?,
        updated_at: row.try_get(9)?,
        http_request: row.try_get(10)?,
    })
}

/// Reads a key.
pub async fn lookup(
    conn: &mut PgConnection,
    tenant: &TenantId,
    key: &StepKey,
) -> Result<Option<KeyRecord>, StoreError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {KEY_COLUMNS} FROM saga_idempotency_keys WHERE tenant_id = $1 AND step_key = $2"
    )))
    .bind(tenant.as_str())
    .bind(key.as_str())
    .fetch_optional(conn)
    .await?;
    row.as_ref().map(key_record).transpose()
}

/// Every step key derived from the original key `original` (`{original}:{step}`), of `tenant` or of every
/// tenant, HTTP keys (`{original}:{operation}`) included; by tenant, then first claim; the first `limit`.
/// Exact: the keys of a longer key that `original` prefixes (`order:1:ship` for `order`) are not its own.
/// Found through the index `saga_idempotency_keys_owner` (on `saga_step_owner(step_key)`, whose body
/// this is, written out so that a schema migrated before it is read too).
pub async fn keys_of(
    conn: &mut PgConnection,
    original: &str,
    tenant: Option<&TenantId>,
    limit: i64,
) -> Result<Vec<KeyRecord>, StoreError> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {KEY_COLUMNS} FROM saga_idempotency_keys \
         WHERE left(step_key, length(step_key) - strpos(reverse(step_key), ':')) = $1 \
           AND strpos(step_key, ':') > 0 \
           AND ($2::text IS NULL OR tenant_id = $2) \
         ORDER BY tenant_id, created_at, step_key LIMIT $3"
    )))
    .bind(original)
    .bind(tenant.map(TenantId::as_str))
    .bind(limit)
    .fetch_all(conn)
    .await?;
    rows.iter().map(key_record).collect()
}

/// Two-phase leases (`started` keys), the ones whose lease ran out only if `expired_only`; oldest expiry
/// first, at most `limit`.
pub async fn leases(
    conn: &mut PgConnection,
    expired_only: bool,
    limit: i64,
) -> Result<Vec<KeyRecord>, StoreError> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {KEY_COLUMNS} FROM saga_idempotency_keys \
         WHERE status = 'started' AND (NOT $1 OR lease_expires_at <= now()) \
         ORDER BY lease_expires_at LIMIT $2"
    )))
    .bind(expired_only)
    .bind(limit)
    .fetch_all(conn)
    .await?;
    rows.iter().map(key_record).collect()
}
