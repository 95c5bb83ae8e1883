//! Step keys and two-phase leases, as the idempotency store holds them.

use chrono::{DateTime, Utc};
use saga_core::{StepKey, TenantId};
use saga_runtime::store::idempotency;
use saga_runtime::store::idempotency::KeyRecord;
use serde::Serialize;
use sqlx::PgPool;

use crate::error::AdminError;

/// A step key (or an HTTP key, `{key}:{operation}`) and its state.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct KeyView {
    /// The tenant.
    pub tenant: String,
    /// The step key.
    pub step_key: String,
    /// The step (or HTTP operation).
    pub step: String,
    /// The key the step hands to outside systems (a payment provider's idempotency key).
    pub external_key: String,
    /// `started` (leased), `completed` or `failed`.
    pub status: String,
    /// How often it was claimed (a takeover increments it).
    pub attempts: i32,
    /// Who holds (or held) its lease.
    pub lease_holder: Option<String>,
    /// When its lease runs out (for `started`).
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// Whether its lease ran out (a `started` key nobody works on).
    pub lease_expired: bool,
    /// The stored result (or rejection details, or HTTP response).
    pub outcome: Option<serde_json::Value>,
    /// The rejection reason, or why the last attempt let go of its lease.
    pub error: Option<String>,
    /// When it was first claimed.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// Whether it is an HTTP request's key: its outcome is the response stored for the client's retries.
    pub http_request: bool,
    /// Whether the stored response was left out for this viewer ([`KeyView::without_response`]).
    pub response_hidden: bool,
}

impl KeyView {
    /// The key without the response stored with it, if it is an HTTP request's: for a viewer who may not
    /// act (a read-only inspector's), since a response may hold what the client alone should see.
    pub fn without_response(mut self) -> Self {
        if self.http_request && self.outcome.is_some() {
            self.outcome = None;
            self.response_hidden = true;
        }
        self
    }

    fn of(record: KeyRecord, now: DateTime<Utc>) -> Self {
        let step = record
            .step_key
            .rsplit_once(':')
            .map_or("", |(_, s)| s)
            .to_owned();
        let external_key = match (
            TenantId::new(&record.tenant),
            StepKey::new(&record.step_key),
        ) {
            (Ok(tenant), Ok(key)) => key.external(&tenant).to_string(),
            _ => String::new(),
        };
        Self {
            lease_expired: record.status.as_str() == "started"
                && record.lease_expires_at.is_some_and(|at| at <= now),
            status: record.status.as_str().to_owned(),
            tenant: record.tenant,
            step_key: record.step_key,
            step,
            external_key,
            attempts: record.attempts,
            lease_holder: record.lease_holder,
            lease_expires_at: record.lease_expires_at,
            outcome: record.outcome,
            error: record.error,
            created_at: record.created_at,
            updated_at: record.updated_at,
            http_request: record.http_request,
            response_hidden: false,
        }
    }
}

/// The most step keys [`show`] lists: more derive from a key only across many tenants.
pub const MOST_SHOWN: usize = 1_000;

/// Every key derived from the client's key `original` in `pool`'s schema, of `tenant` or of every tenant.
/// More than [`MOST_SHOWN`] is refused as bad input (name a tenant), never a list silently cut.
pub async fn show(
    pool: &PgPool,
    original: &str,
    tenant: Option<&str>,
) -> Result<Vec<KeyView>, AdminError> {
    if original.contains('\0') {
        return Err(AdminError::bad_input(
            "the key holds a NUL byte, which no stored key can hold",
        ));
    }
    let tenant = tenant
        .map(|t| {
            TenantId::new(t).map_err(|e| AdminError::bad_input(format!("bad tenant {t:?}: {e}")))
        })
        .transpose()?;
    let mut conn = pool.acquire().await?;
    let most = i64::try_from(MOST_SHOWN + 1).unwrap_or(i64::MAX);
    let records = idempotency::keys_of(&mut conn, original, tenant.as_ref(), most)
        .await
        .map_err(AdminError::store)?;
    if records.len() > MOST_SHOWN {
        return Err(AdminError::bad_input(format!(
            "more than {MOST_SHOWN} step keys derive from key {original:?}: name its tenant"
        )));
    }
    let now = Utc::now();
    Ok(records.into_iter().map(|r| KeyView::of(r, now)).collect())
}

/// Two-phase leases, only the expired ones if `expired_only` (an external call that never completed):
/// the oldest expiry first, at most `limit`.
pub async fn leases(
    pool: &PgPool,
    expired_only: bool,
    limit: i64,
) -> Result<Vec<KeyView>, AdminError> {
    let mut conn = pool.acquire().await?;
    let records = idempotency::leases(&mut conn, expired_only, limit)
        .await
        .map_err(AdminError::store)?;
    let now = Utc::now();
    Ok(records.into_iter().map(|r| KeyView::of(r, now)).collect())
}
