//! The one loop over the framework's own statements outside a step's transaction (reading held keys,
//! parking, recording a release, indexing a dead letter, recording a batch's start): an unavailable
//! database is waited out without a budget, and the connection that reported it is closed; a statement that
//! may pass again is retried within a budget (the consumer's retry budget, and never fewer than
//! [`MIN_ATTEMPTS`]); a schema or role that is not what the framework needs stops the consumer with the
//! reason ([`Stopper`]: the operator's problem, no message's); anything else ends the loop with the reason,
//! for the message's dead letter (invariant 9). It takes a [`Released`]: the worker keeps no connection
//! while it waits (invariant 18).

use std::future::Future;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use saga_runtime::store::fault::{DbFault, classify, described};
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};
use tokio_util::sync::CancellationToken;

use crate::connection::Released;
use crate::retry::RetryPolicy;

/// Waits between attempts when the database is unreachable; these do not spend a message's retry budget:
/// from 200 ms to at most 10 s, growing and jittered as the declared defaults say.
pub(crate) fn unavailable_backoff() -> RetryPolicy {
    RetryPolicy::default()
        .max_attempts(u32::MAX)
        .backoff(Duration::from_millis(200), Duration::from_secs(10))
}

/// The fewest attempts of a statement that may pass again (a deadlock, a lock timeout), whatever the
/// handlers' retry budget (which may be one: a step that must not be retried says nothing of the
/// framework's own statements).
pub(crate) const MIN_ATTEMPTS: u32 = 5;

/// Stops the consumer, once, with the reason: a fault that is the operator's (the schema, the role), not a
/// message's. The consumer's poll loop watches its token; `run` returns the reason.
#[derive(Clone, Debug, Default)]
pub(crate) struct Stopper {
    token: CancellationToken,
    reason: std::sync::Arc<std::sync::OnceLock<String>>,
}

impl Stopper {
    /// A stopper that also stops when `shutdown` fires.
    pub(crate) fn under(shutdown: &CancellationToken) -> Self {
        Self {
            token: shutdown.child_token(),
            reason: std::sync::Arc::default(),
        }
    }

    /// Stops the consumer for `reason` (the first reason is kept).
    pub(crate) fn stop(&self, reason: String) {
        tracing::error!(reason = %reason, "the database refuses the framework's statements; the consumer stops");
        let _ = self.reason.set(reason);
        self.token.cancel();
    }

    /// What the consumer's loops stop on: the shutdown, or a [`Stopper::stop`].
    pub(crate) fn token(&self) -> &CancellationToken {
        &self.token
    }

    /// Why the consumer was stopped, if it was.
    pub(crate) fn reason(&self) -> Option<&str> {
        self.reason.get().map(String::as_str)
    }
}

/// How a loop of [`with_budget`] ended.
#[derive(Debug)]
pub(crate) enum Tried<T> {
    /// The statements succeeded.
    Done(T),
    /// They failed for good (or still failed when the budget was spent): what and why, on one line.
    Refused(String),
    /// `cancel` fired first, or the consumer is stopping ([`Stopper`]).
    Cancelled,
}

/// What the loop needs besides the statements.
pub(crate) struct Budget<'a> {
    /// Where connections come from.
    pub pool: &'a PgPool,
    /// Attempts and backoff for statements that may pass again.
    pub retry: &'a RetryPolicy,
    /// Counts each wait for an unavailable database.
    pub unreachable: &'a Counter,
    /// Stops the consumer on the operator's problem.
    pub stopper: &'a Stopper,
}

/// A connection of the pool, lent to one attempt and handed back with its result (so that one that
/// reported an unavailable database can be closed).
pub(crate) type Lent = PoolConnection<Postgres>;

/// Runs `attempt` on a connection of `budget.pool` until it succeeds (see the module documentation);
/// `what` says what it does, for the log and the refusal. The worker keeps no connection meanwhile.
pub(crate) async fn with_budget<T, F, Fut>(
    what: &str,
    budget: &Budget<'_>,
    cancel: &CancellationToken,
    _released: &Released<'_>,
    attempt: F,
) -> Tried<T>
where
    F: FnMut(Lent) -> Fut,
    Fut: Future<Output = (Lent, Result<T, sqlx::Error>)>,
{
    retrying(what, budget, cancel, attempt).await
}

/// [`with_budget`] without the proof that a worker keeps no connection: for the crash-loop record, which
/// runs beside the batch's transaction as part of it (invariant 18's one exception).
pub(crate) async fn retrying<T, F, Fut>(
    what: &str,
    budget: &Budget<'_>,
    cancel: &CancellationToken,
    mut attempt: F,
) -> Tried<T>
where
    F: FnMut(Lent) -> Fut,
    Fut: Future<Output = (Lent, Result<T, sqlx::Error>)>,
{
    let (mut unavailable, mut transient) = (0_u32, 0_u32);
    loop {
        if cancel.is_cancelled() {
            return Tried::Cancelled;
        }
        let result = match budget.pool.acquire().await {
            Ok(conn) => {
                let (mut conn, result) = attempt(conn).await;
                // A connection that reported an unavailable database is closed, never reused.
                if let Err(e) = &result
                    && classify(e) == DbFault::Unavailable
                {
                    conn.close_on_drop();
                }
                result
            }
            Err(e) => Err(e),
        };
        let error = match result {
            Ok(done) => return Tried::Done(done),
            Err(error) => error,
        };
        let wait = match classify(&error) {
            DbFault::Unavailable => {
                unavailable = unavailable.saturating_add(1);
                budget.unreachable.inc();
                unavailable_backoff().wait_after(unavailable)
            }
            DbFault::Transient
                if transient.saturating_add(1) < budget.retry.max_attempts.max(MIN_ATTEMPTS) =>
            {
                transient += 1;
                budget.retry.wait_after(transient)
            }
            DbFault::Operator => {
                budget
                    .stopper
                    .stop(format!("{what}: {}", described(&error)));
                return Tried::Cancelled;
            }
            _ => return Tried::Refused(format!("{what}: {}", described(&error))),
        };
        tracing::warn!(error = %error, ?wait, "{what} failed; trying again");
        if !sleep_or_cancel(wait, cancel).await {
            return Tried::Cancelled;
        }
    }
}

/// Sleeps `wait` unless `cancel` fires first; whether it slept.
pub(crate) async fn sleep_or_cancel(wait: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        () = cancel.cancelled() => false,
        () = tokio::time::sleep(wait) => true,
    }
}
