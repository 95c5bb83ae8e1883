//! The audit log (`saga_admin_audit`): every state-changing action of the `saga` command and the inspector
//! page, who took it, why, when, what it touched and how it ended.
//!
//! An action runs inside [`audited`]: its entry is written first (outcome `running`; an action that cannot
//! be recorded does not run), then finished with `done` and what it did, `refused` and why (the input was
//! wrong: nothing was done), or `failed` and the error. An entry left `running` says the process died
//! midway. [`list`] reads the log, newest first; it runs no migration, so a read-only database user can
//! read it.

use std::future::Future;

use chrono::{DateTime, Utc};
use saga_runtime::cli::printable;
use saga_runtime::cli::printable_bytes;
use serde::Serialize;
use sqlx::{PgPool, Row};

use crate::error::AdminError;

/// The longest reason recorded, in characters.
pub const MAX_REASON_CHARS: usize = 1_000;
/// The longest detail (what an action did, or its error) recorded, in characters.
const MAX_DETAIL_CHARS: usize = 2_000;

/// Who takes an action, why, and through what.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Actor {
    /// Who (a token's name on the page; `--operator` or the OS user on the command).
    pub operator: String,
    /// Why, if said (`--reason`, the page's reason field).
    pub reason: Option<String>,
    /// Through what.
    pub via: Via,
}

impl Actor {
    /// `operator` acting through `via`, for `reason` (blank: none). Bad input if the reason is longer than
    /// [`MAX_REASON_CHARS`].
    pub fn new(
        operator: impl Into<String>,
        reason: Option<&str>,
        via: Via,
    ) -> Result<Self, AdminError> {
        let reason = reason.map(str::trim).filter(|r| !r.is_empty());
        if reason.is_some_and(|r| r.chars().count() > MAX_REASON_CHARS) {
            return Err(AdminError::bad_input(format!(
                "the reason is longer than {MAX_REASON_CHARS} characters"
            )));
        }
        Ok(Self {
            operator: operator.into(),
            reason: reason.map(str::to_owned),
            via,
        })
    }
}

/// Through what an action was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Via {
    /// The `saga` command.
    Command,
    /// The inspector page (or its API).
    Page,
}

impl Via {
    fn as_str(self) -> &'static str {
        match self {
            Self::Command => "command",
            Self::Page => "page",
        }
    }
}

/// An action and what it touches, as the log records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Action {
    name: &'static str,
    target: Vec<(&'static str, String)>,
}

impl Action {
    /// The action `name`, as `saga` names it (`dlq replay`, `keys release`).
    pub fn new(name: &'static str) -> Self {
        Self {
            name,
            target: Vec::new(),
        }
    }

    /// What it touches: `what` is `value` (shown as printable text: control characters escaped).
    pub fn on(mut self, what: &'static str, value: impl std::fmt::Display) -> Self {
        self.target
            .push((what, printable(&value.to_string(), false).into_owned()));
        self
    }

    /// What it touches: `what` is the bytes `value` (a key: shown as printable text that tells any two
    /// byte strings apart).
    pub fn on_bytes(mut self, what: &'static str, value: &[u8]) -> Self {
        self.target
            .push((what, printable_bytes(value).into_owned()));
        self
    }

    fn target_json(&self) -> serde_json::Value {
        serde_json::Value::Object(
            self.target
                .iter()
                .map(|(k, v)| ((*k).to_owned(), serde_json::Value::String(v.clone())))
                .collect(),
        )
    }
}

/// Runs `work` as `actor`'s `action`, recorded in the audit log of `pool`'s schema before it runs and
/// finished with its outcome (`summary` says what it did). An action that cannot be recorded does not run.
/// `work` is boxed at once: the future of an action of any size costs its caller a pointer.
pub fn audited<'a, T, F>(
    pool: &'a PgPool,
    actor: &'a Actor,
    action: Action,
    work: F,
    summary: impl FnOnce(&T) -> String + 'a,
) -> impl Future<Output = Result<T, AdminError>> + 'a
where
    F: Future<Output = Result<T, AdminError>> + 'a,
    T: 'a,
{
    let work = Box::pin(work);
    async move {
        let id = begin(pool, actor, &action).await?;
        // An action acts only on a dead-letter index brought up to date, whatever scope it runs in.
        let result = crate::freshness::strict(work).await;
        let (outcome, detail) = match &result {
            Ok(value) => ("done", summary(value)),
            Err(e) if e.is_caller_error() => ("refused", e.to_string()),
            Err(e) => ("failed", e.to_string()),
        };
        if let Err(e) = finish(pool, id, outcome, &detail).await {
            // The action ran (or failed) all the same: its entry stays `running`, and the log line says
            // so.
            tracing::warn!(entry = id, outcome, error = %e, "the audit log's entry could not be finished");
        }
        result
    }
}

/// Writes `action`'s entry as `running`; returns its id.
async fn begin(pool: &PgPool, actor: &Actor, action: &Action) -> Result<i64, AdminError> {
    // The log is made once: a database user that may write rows but not make tables acts once it is there.
    let made: bool = sqlx::query_scalar("SELECT to_regclass('saga_admin_audit') IS NOT NULL")
        .fetch_one(pool)
        .await?;
    if !made {
        crate::dlq::migrator()
            .run(pool)
            .await
            .map_err(|source| AdminError::Migrations {
                what: "the toolkit's migrations",
                source,
            })?;
    }
    let id = sqlx::query_scalar(
        "INSERT INTO saga_admin_audit (operator, reason, via, action, target) \
         VALUES ($1, $2, $3, $4, $5) RETURNING id",
    )
    .bind(printable(&actor.operator, false).as_ref())
    .bind(
        actor
            .reason
            .as_deref()
            .map(|r| printable(r, true).into_owned()),
    )
    .bind(actor.via.as_str())
    .bind(action.name)
    .bind(action.target_json())
    .fetch_one(pool)
    .await?;
    Ok(id)
}

async fn finish(pool: &PgPool, id: i64, outcome: &str, detail: &str) -> Result<(), sqlx::Error> {
    let detail: String = printable(detail, true)
        .chars()
        .take(MAX_DETAIL_CHARS)
        .collect();
    sqlx::query(
        "UPDATE saga_admin_audit SET outcome = $2, detail = $3, finished_at = clock_timestamp() \
         WHERE id = $1",
    )
    .bind(id)
    .bind(outcome)
    .bind(detail)
    .execute(pool)
    .await?;
    Ok(())
}

/// One entry of the audit log.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct AuditEntry {
    /// Its number.
    pub id: i64,
    /// When the action began.
    pub at: DateTime<Utc>,
    /// When it ended (none: it runs, or its process died midway).
    pub finished_at: Option<DateTime<Utc>>,
    /// Who.
    pub operator: String,
    /// Why, if said.
    pub reason: Option<String>,
    /// `command` or `page`.
    pub via: String,
    /// What was done (`dlq replay`, `keys release`, ...).
    pub action: String,
    /// What it touched.
    pub target: serde_json::Value,
    /// `running`, `done`, `refused` or `failed`.
    pub outcome: String,
    /// What it did, or why it was refused or failed.
    pub detail: Option<String>,
}

impl AuditEntry {
    /// What it touched, as `name=value` pairs.
    pub fn target_text(&self) -> String {
        self.target
            .as_object()
            .map(|o| {
                o.iter()
                    .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default()
    }
}

/// Which entries [`list`] reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AuditFilter {
    /// Only this operator's.
    pub operator: Option<String>,
    /// Only this action's (`dlq replay`).
    pub action: Option<String>,
    /// Only those begun within this long.
    pub since: Option<std::time::Duration>,
    /// At most this many (newest first).
    pub limit: i64,
}

/// The entries of `pool`'s schema that `filter` selects, newest first. Runs no migration: a schema where
/// no action was ever taken has none.
pub async fn list(pool: &PgPool, filter: &AuditFilter) -> Result<Vec<AuditEntry>, AdminError> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('saga_admin_audit') IS NOT NULL")
        .fetch_one(pool)
        .await?;
    if !exists {
        return Ok(Vec::new());
    }
    // A span longer than chrono can subtract reaches back to the start of time: no bound.
    let since = filter.since.and_then(|d| {
        chrono::Duration::from_std(d)
            .ok()
            .and_then(|d| Utc::now().checked_sub_signed(d))
    });
    let rows = sqlx::query(
        "SELECT id, at, finished_at, operator, reason, via, action, target, outcome, detail \
         FROM saga_admin_audit \
         WHERE ($1::text IS NULL OR operator = $1) AND ($2::text IS NULL OR action = $2) \
           AND ($3::timestamptz IS NULL OR at >= $3) \
         ORDER BY id DESC LIMIT $4",
    )
    .bind(&filter.operator)
    .bind(&filter.action)
    .bind(since)
    .bind(filter.limit.max(0))
    .fetch_all(pool)
    .await?;
    rows.into_iter()
        .map(|r| {
            Ok(AuditEntry {
                id: r.try_get(0)?,
                at: r.try_get(1)?,
                finished_at: r.try_get(2)?,
                operator: r.try_get(3)?,
                reason: r.try_get(4)?,
                via: r.try_get(5)?,
                action: r.try_get(6)?,
                target: r.try_get(7)?,
                outcome: r.try_get(8)?,
                detail: r.try_get(9)?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(AdminError::from)
}
