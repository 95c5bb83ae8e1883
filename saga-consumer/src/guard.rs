//! Poison-pill detection across crashes. A message that kills the process (an abort, an out-of-memory kill)
//! would otherwise be redelivered after the restart and kill it again, forever.
//!
//! Each batch's offset range is recorded before it runs (see the `saga_consumer_progress` migrations). A
//! batch that meets the previous, open range without following it (inside it, or wholly before it after a
//! restart behind the committed offset) means the last run died there: from the batch that reaches it, that
//! range is processed one message at a time, and a message whose isolated processing started more than
//! `limit` times without finishing is dead-lettered. The record's decisions are `crash_record`'s.
//!
//! A death is charged to the isolated messages whose start is counted when it happens. So that it is charged
//! to the one that caused it, an isolated message runs alone in the process and its start counts only
//! while it does: ordinary batches share [`CrashGuard::shared`], an isolated message waits for the process
//! alone and only then counts its start ([`CrashGuard::alone`]), and while it waits for another worker's
//! lease on its key, it lets the process go and its start is taken back ([`CrashGuard::pause`]). Recording a
//! batch's start only decides whether to isolate; it counts nothing, as the batch's transaction may already
//! be running beside other partitions' when the record says "isolate".
//!
//! On the happy path the record costs no wait: a batch of transactional steps starts its transaction while
//! its start is being recorded ([`PendingStart`]), and only its commit waits for the record. Nothing of the
//! batch takes effect before the record is in: should the record say the range is a suspect's, the
//! transaction is rolled back and the batch goes the isolated way.

use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use sqlx::{PgPool, Row};
use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::connection::Released;
use crate::db_retry::{Budget, Stopper, Tried, retrying};
use crate::executor::discard_if_unavailable;
use crate::retry::RetryPolicy;

/// What to do with a batch about to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BatchStart {
    /// Process the batch normally.
    Normal,
    /// The last run died in this range: process the first message alone.
    Isolate,
    /// The first message took the consumer down this many times: dead-letter it.
    DeadLetter(u32),
}

/// How long a stopping worker waits to close its finished range (see [`CrashGuard::close`]).
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// A batch's recorded start, and whether it left the partition clear: no suspect range, so that the next
/// batch following this one starts normally and may be recorded beside its transaction (whose handlers run
/// before the record is read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Recorded {
    /// What to do with the batch.
    pub(crate) start: BatchStart,
    /// Whether the partition is clear.
    pub(crate) clear: bool,
}

/// Records batch starts and ends for one consumer group.
#[derive(Clone)]
pub(crate) struct CrashGuard {
    pool: PgPool,
    group: String,
    limit: u32,
    alone: Arc<RwLock<()>>,
    /// Counts each failed record that an unavailable database caused (it is retried, as in `executor`).
    unreachable: Counter,
    /// The budget of a record that may pass again.
    retry: RetryPolicy,
    /// Stops the consumer when the record is refused for good (the operator's problem).
    stopper: Stopper,
}

impl CrashGuard {
    /// `limit` is the number of deaths tolerated per message; 0 turns detection off. A record that fails
    /// because the database is unavailable is counted in `unreachable` and waited out; one that may pass
    /// again is retried within `retry`.
    pub(crate) fn new(
        pool: PgPool,
        group: String,
        limit: u32,
        unreachable: Counter,
        retry: RetryPolicy,
        stopper: Stopper,
    ) -> Self {
        Self {
            pool,
            group,
            limit,
            alone: Arc::default(),
            unreachable,
            retry,
            stopper,
        }
    }

    /// Held while an ordinary batch runs: isolated messages wait for it. The worker waits for it with no
    /// connection kept.
    pub(crate) async fn shared(&self, _released: &Released<'_>) -> OwnedRwLockReadGuard<()> {
        self.alone.clone().read_owned().await
    }

    /// [`Self::shared`] if no isolated message holds or waits for the process.
    pub(crate) fn try_shared(&self) -> Option<OwnedRwLockReadGuard<()>> {
        self.alone.clone().try_read_owned().ok()
    }

    /// Waits until the isolated message at `offset` has the process alone (nothing else of this consumer
    /// runs while the returned lock is held), then counts its start: a death from then on is its doing.
    /// `None` if `cancel` fired first; nothing was counted then.
    pub(crate) async fn alone(
        &self,
        topic: &str,
        partition: i32,
        offset: i64,
        _released: &Released<'_>,
        cancel: &CancellationToken,
    ) -> Option<OwnedRwLockWriteGuard<()>> {
        let lock = tokio::select! {
            biased;
            _ = cancel.cancelled() => None,
            lock = self.alone.clone().write_owned() => Some(lock),
        }?;
        self.adjust(topic, partition, offset, 1).await;
        Some(lock)
    }

    /// Whether detection is on (a limit above zero).
    pub(crate) fn is_enabled(&self) -> bool {
        self.limit > 0
    }

    /// Records a batch's start (`saga_consumer_begin_batch`), waiting out an unavailable database, retrying what may pass again within the
    /// budget. The record holds nothing of a message, so a refusal is the operator's: the consumer stops
    /// with the reason ([`Stopper`]), and no message is dead-lettered for it. `None` then, or if `cancel`
    /// fired first. The
    /// worker waits for it with no connection kept.
    pub(crate) async fn begin_until_recorded(
        &self,
        topic: &str,
        partition: i32,
        first: i64,
        last: i64,
        _released: &Released<'_>,
        cancel: &CancellationToken,
    ) -> Option<Recorded> {
        self.begin_retrying(topic, partition, first, last, cancel)
            .await
    }

    /// [`CrashGuard::begin_until_recorded`] for a record that runs beside the batch's transaction
    /// ([`PendingStart::record`]: the one wait of a worker beside the connection it keeps, part of its next
    /// transaction).
    async fn begin_retrying(
        &self,
        topic: &str,
        partition: i32,
        first: i64,
        last: i64,
        cancel: &CancellationToken,
    ) -> Option<Recorded> {
        let budget = Budget {
            pool: &self.pool,
            retry: &self.retry,
            unreachable: &self.unreachable,
            stopper: &self.stopper,
        };
        let recorded = retrying(
            "recording the batch's start",
            &budget,
            cancel,
            |mut conn| async move {
                let begun = self
                    .begin_on(&mut conn, topic, partition, first, last)
                    .await;
                (conn, begun)
            },
        )
        .await;
        match recorded {
            Tried::Done(start) => Some(start),
            Tried::Refused(error) => {
                self.stopper.stop(error);
                None
            }
            Tried::Cancelled => None,
        }
    }

    /// Records on `conn` that a batch `first..=last` of `topic`/`partition` begins.
    async fn begin_on(
        &self,
        conn: &mut sqlx::PgConnection,
        topic: &str,
        partition: i32,
        first: i64,
        last: i64,
    ) -> Result<Recorded, sqlx::Error> {
        if self.limit == 0 {
            return Ok(Recorded {
                start: BatchStart::Normal,
                clear: true,
            });
        }
        let row = sqlx::query(
            "SELECT isolate, deaths, clear FROM saga_consumer_begin_batch($1, $2, $3, $4, $5)",
        )
        .bind(&self.group)
        .bind(topic)
        .bind(partition)
        .bind(first)
        .bind(last)
        .fetch_one(conn)
        .await?;
        let isolate: bool = row.try_get(0)?;
        let deaths = u32::try_from(row.try_get::<i32, _>(1)?).unwrap_or(0);
        let start = match (isolate, deaths) {
            (false, _) => BatchStart::Normal,
            (true, d) if d >= self.limit => BatchStart::DeadLetter(d),
            (true, _) => BatchStart::Isolate,
        };
        Ok(Recorded {
            start,
            clear: row.try_get(2)?,
        })
    }

    /// Takes back the start of the isolated message at `offset`, counted by [`CrashGuard::alone`], while
    /// it waits for something outside it (another worker's lease on its key) with the process let go: a
    /// death meanwhile is not its doing. [`CrashGuard::alone`] counts it again when its attempt resumes.
    pub(crate) async fn pause(&self, topic: &str, partition: i32, offset: i64) {
        self.adjust(topic, partition, offset, -1).await;
    }

    async fn adjust(&self, topic: &str, partition: i32, offset: i64, by: i32) {
        if self.limit == 0 {
            return;
        }
        let result = self
            .execute(
                sqlx::query(
                    "UPDATE saga_consumer_suspects SET starts = greatest(starts + $5, 0), updated_at = now() \
                     WHERE group_id = $1 AND topic = $2 AND partition = $3 AND \"offset\" = $4",
                )
                .bind(&self.group)
                .bind(topic)
                .bind(partition)
                .bind(offset)
                .bind(by),
            )
            .await;
        if let Err(e) = result {
            tracing::warn!(error = %e, topic, partition, offset, "could not adjust a suspect's starts");
        }
    }

    /// Records that the batch starting at `first` ended: `finished`, or abandoned on purpose. The worker
    /// waits for it with no connection kept.
    pub(crate) async fn end(
        &self,
        topic: &str,
        partition: i32,
        first: i64,
        finished: bool,
        _released: &Released<'_>,
    ) {
        if self.limit == 0 {
            return;
        }
        let result = self
            .execute(
                sqlx::query("SELECT saga_consumer_end_batch($1, $2, $3, $4, $5)")
                    .bind(&self.group)
                    .bind(topic)
                    .bind(partition)
                    .bind(first)
                    .bind(finished),
            )
            .await;
        if let Err(e) = result {
            tracing::warn!(error = %e, topic, partition, first, "could not record the end of a batch");
        }
    }
}

impl CrashGuard {
    /// Closes the range `first..=last` of `topic`/`partition`, its batch finished, if the record is still
    /// that range and clear (`saga_consumer_close_batch`): its worker stops between batches. Waits at most
    /// [`CLOSE_WAIT`]: a range left open costs a new owner behind it one message at a time over it, a
    /// revoke waiting on an unavailable database costs the whole group.
    pub(crate) async fn close(
        &self,
        topic: &str,
        partition: i32,
        (first, last): (i64, i64),
        _released: &Released<'_>,
    ) {
        if self.limit == 0 {
            return;
        }
        let closing = self.execute(
            sqlx::query("SELECT saga_consumer_close_batch($1, $2, $3, $4, $5)")
                .bind(&self.group)
                .bind(topic)
                .bind(partition)
                .bind(first)
                .bind(last),
        );
        match tokio::time::timeout(CLOSE_WAIT, closing).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, topic, partition, first, "could not close a finished batch's range");
            }
            Err(_) => {
                tracing::warn!(
                    topic,
                    partition,
                    first,
                    "closing a finished batch's range took too long: left open"
                );
            }
        }
    }

    /// Runs `query` on a pooled connection, which is closed instead of given back if the database
    /// turned out unavailable (see `executor::discard_if_unavailable`).
    async fn execute(
        &self,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<(), sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        let done = query.execute(&mut *conn).await;
        if let Err(e) = &done {
            discard_if_unavailable(&mut conn, e);
        }
        done.map(drop)
    }
}

/// Proof that a batch's start is recorded and says "normal": what every effect of a partition worker
/// (a commit, a dead letter, a lease) takes. Only [`PendingStart::permit`] makes one, so nothing takes
/// effect before the crash-loop record allows it; a start recorded as "dead-letter" gives the permit for
/// its first message's letter ([`CommitPermit::recorded_dead_letter`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct CommitPermit(());

impl CommitPermit {
    /// The permit a start recorded as [`BatchStart::DeadLetter`] gives: to dead-letter the batch's first
    /// message alone. Only `crash_gate::run_of` calls it, for a start read from the record (the guard's
    /// answer, or a redo the record said): a permit, like [`PendingStart::permit`]'s, stands for what the
    /// record says.
    pub(crate) fn recorded_dead_letter() -> Self {
        Self(())
    }
}

/// A batch's start: known, or being recorded while the batch's transaction runs. Whatever commits for the
/// batch waits for it first ([`PendingStart::resolve`]).
pub(crate) enum PendingStart {
    /// Being recorded by a task of its own.
    Recording(JoinHandle<Option<Recorded>>),
    /// Recorded (`None`: cancelled before it was).
    Known(Option<Recorded>),
}

impl PendingStart {
    /// Starts recording `first..=last` in the background, on a connection taken before this returns:
    /// the batch's transaction, which waits for the record, must not also wait for the record's
    /// connection, or workers holding the pool's connections would wait for each other.
    pub(crate) async fn record(
        guard: &CrashGuard,
        topic: &str,
        partition: i32,
        first: i64,
        last: i64,
        cancel: &CancellationToken,
    ) -> Self {
        let conn = tokio::select! {
            biased;
            _ = cancel.cancelled() => None,
            conn = guard.pool.acquire() => conn.ok(),
        };
        let (guard, topic, cancel) = (guard.clone(), topic.to_owned(), cancel.clone());
        Self::Recording(tokio::spawn(async move {
            if let Some(mut conn) = conn {
                match guard
                    .begin_on(&mut conn, &topic, partition, first, last)
                    .await
                {
                    Ok(start) => return Some(start),
                    Err(e) => discard_if_unavailable(&mut conn, &e),
                }
            }
            guard
                .begin_retrying(&topic, partition, first, last, &cancel)
                .await
        }))
    }

    /// A start already known (whether the partition is clear is not).
    pub(crate) fn known(start: BatchStart) -> Self {
        Self::Known(Some(Recorded {
            start,
            clear: false,
        }))
    }

    /// Waits for the record; `None` if it was cancelled first.
    pub(crate) async fn resolve(&mut self) -> Option<BatchStart> {
        self.recorded().await.map(|r| r.start)
    }

    /// Waits for the record, with whether it left the partition clear; `None` if it was cancelled first.
    pub(crate) async fn recorded(&mut self) -> Option<Recorded> {
        let recorded = match self {
            Self::Known(recorded) => return recorded.clone(),
            // A panic of the recording task is a framework bug: treat it as a cancellation, which leaves
            // the batch uncommitted for whoever processes the partition next.
            Self::Recording(task) => task.await.ok().flatten(),
        };
        *self = Self::Known(recorded.clone());
        recorded
    }

    /// The permit to commit (or dead-letter, or lease) for this batch, once the record is in and says
    /// "normal"; `None` if it says otherwise or was cancelled.
    pub(crate) async fn permit(&mut self) -> Option<CommitPermit> {
        (self.resolve().await == Some(BatchStart::Normal)).then_some(CommitPermit(()))
    }
}
