//! Whether a read of the dead-letter index is up to date, and what a read does when it cannot be.
//!
//! Before a read, the toolkit brings the index of each topic it reads up to date ([`crate::index::sync`]).
//! When it cannot (the broker unreachable or refusing, a database user that may not write the index,
//! another sync that does not end), an answer read from the index as it is could pass for the topic's
//! letters ("0 dead letters"). So such a read fails with [`AdminError::Stale`], saying how stale the index
//! is, unless it runs inside [`as_indexed`]: then it reads the index as it is and the staleness is handed
//! back with the answer (the `saga` command's `--as-indexed` prints it; the inspector's pages show it as a
//! banner). An action runs [`strict`]: it acts only on an index brought up to date.

use std::future::Future;
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::error::AdminError;

/// The index of a topic that could not be brought up to date: why, and how stale it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Staleness {
    /// The dead-letter topic.
    pub topic: String,
    /// Why it could not be brought up to date, in words that quote no server's error (the log line
    /// has it).
    pub cause: String,
    /// When the toolkit last brought it up to date (every partition), if it recorded it.
    pub last_synced_at: Option<DateTime<Utc>>,
    /// When the index last took in a letter of the topic (none: it holds none).
    pub newest_indexed_at: Option<DateTime<Utc>>,
    /// What the reader can do: read it as it is (a read), or act again once the cause is fixed (an action).
    pub hint: String,
}

impl std::fmt::Display for Staleness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let when = |at: DateTime<Utc>| {
            format!(
                "{} ({} ago)",
                at.format("%Y-%m-%d %H:%M:%S UTC"),
                crate::duration::human((Utc::now() - at).to_std().unwrap_or_default())
            )
        };
        write!(
            f,
            "the dead-letter index of {} could not be brought up to date ({}); ",
            self.topic, self.cause
        )?;
        match self.last_synced_at {
            Some(at) => write!(f, "it was last brought up to date at {}", when(at))?,
            None => write!(f, "the toolkit never recorded bringing it up to date")?,
        }
        match self.newest_indexed_at {
            Some(at) => write!(
                f,
                ", and the newest letter it holds was indexed at {}: letters since may be missing",
                when(at)
            )?,
            None => write!(f, ", and it holds no letter of the topic")?,
        }
        write!(f, "; {}", self.hint)
    }
}

/// Why an index could not be brought up to date, in words that quote no server's error.
fn cause_of(e: &AdminError) -> String {
    match e {
        AdminError::Kafka(_) => "the broker failed, or refused this user".to_owned(),
        AdminError::Database(sqlx::Error::Database(d)) if d.code().as_deref() == Some("42501") => {
            "this database user may not write the index: permission denied".to_owned()
        }
        AdminError::Database(_) => "the database failed".to_owned(),
        AdminError::Busy(why) => why.clone(),
        AdminError::Config(problem) => problem.to_string(),
        _ => "the index could not be prepared".to_owned(),
    }
}

/// What a read met, and whether it reads a stale index as it is ([`as_indexed`]) or not ([`strict`]).
struct Scope {
    as_indexed: bool,
    stale: Mutex<Vec<Staleness>>,
}

tokio::task_local! {
    static SCOPE: Scope;
}

/// Runs `read` reading the index as it is where it cannot be brought up to date; returns its answer and
/// each topic whose index was read stale. Outside such a scope, a stale read fails ([`AdminError::Stale`]).
pub async fn as_indexed<F: Future>(read: F) -> (F::Output, Vec<Staleness>) {
    let scope = Scope {
        as_indexed: true,
        stale: Mutex::new(Vec::new()),
    };
    SCOPE
        .scope(scope, async {
            let answer = read.await;
            (answer, SCOPE.with(|s| std::mem::take(&mut *lock(&s.stale))))
        })
        .await
}

/// Runs `work` reading no stale index, even inside [`as_indexed`]: an action acts only on an index brought
/// up to date.
pub async fn strict<F: Future>(work: F) -> F::Output {
    let scope = Scope {
        as_indexed: false,
        stale: Mutex::new(Vec::new()),
    };
    SCOPE.scope(scope, work).await
}

/// Whether this runs inside [`as_indexed`] (and not in a [`strict`] inside it).
pub fn reading_as_indexed() -> bool {
    SCOPE.try_with(|s| s.as_indexed).unwrap_or(false)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What a read does with `topic`'s index, which could not be brought up to date because of `cause`: in
/// [`as_indexed`], go on with it as it is (handed back, and said in the log); else fail, saying how stale.
pub(crate) async fn stale(
    pool: &PgPool,
    topic: &str,
    cause: &AdminError,
) -> Result<(), AdminError> {
    tracing::warn!(topic, error = %cause, "the dead-letter index could not be brought up to date");
    let newest_indexed_at: Option<DateTime<Utc>> =
        sqlx::query_scalar("SELECT max(indexed_at) FROM saga_dead_letters WHERE dlq_topic = $1")
            .bind(topic)
            .fetch_one(pool)
            .await
            .unwrap_or(None);
    // Recorded by the syncs of this version; an index an earlier version made has no such column.
    let last_synced_at: Option<DateTime<Utc>> = sqlx::query_scalar(
        "SELECT CASE WHEN bool_and(s ->> 'synced_at' IS NOT NULL) \
                THEN min((s ->> 'synced_at')::timestamptz) END \
         FROM (SELECT to_jsonb(t) AS s FROM saga_dead_letter_scans t WHERE dlq_topic = $1) AS scans",
    )
    .bind(topic)
    .fetch_one(pool)
    .await
    .unwrap_or(None);
    // Inside `as_indexed` (read as it is), `strict` (an action) or neither (a read that fails).
    let scope = SCOPE.try_with(|s| s.as_indexed).ok();
    let staleness = Staleness {
        topic: topic.to_owned(),
        cause: cause_of(cause),
        last_synced_at,
        newest_indexed_at,
        hint: match scope {
            Some(true) => "read as it is",
            Some(false) => {
                "an action acts only on an index brought up to date: act again once the cause is fixed"
            }
            None => "read it as it is with --as-indexed (the command) or ?as_indexed=1 (the API)",
        }
        .to_owned(),
    };
    let kept = SCOPE
        .try_with(|s| {
            s.as_indexed
                .then(|| lock(&s.stale).push(staleness.clone()))
                .is_some()
        })
        .unwrap_or(false);
    if kept {
        Ok(())
    } else {
        Err(AdminError::Stale(staleness))
    }
}
