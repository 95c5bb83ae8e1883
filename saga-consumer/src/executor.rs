//! Processing one partition's messages, in order: transactions, batching, retries and dead-lettering.
//!
//! Consecutive messages for transactional steps run as one batch in one transaction (see `dedup`). If a
//! message fails, the whole transaction rolls back; the messages before it are run again as a smaller batch,
//! the failing one is retried alone with backoff, and those after it form the next batch. So a failing
//! message never takes the others' effects down with it, and every message's effects still commit together
//! with its step key, once.
//!
//! Poison messages are dead-lettered where they stand; two-phase steps run one message at a time.

use std::ops::ControlFlow;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use futures::FutureExt;
use saga_core::{ErrorKind, StepError};
use saga_runtime::store::idempotency::{self, LeaseClaim, StoreError};
use saga_runtime::store::outbox;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::connection::WorkerConnection;
use crate::dedup::{self, BatchError, Failure, ItemOutcome};
use crate::delivery::{Delivery, PoisonReason, Route};
use crate::dlq::{DeadLetter, DeadLetterReason, DeadLetters};
use crate::fast::{self, FastPath};
use crate::guard::{CrashGuard, PendingStart};
use crate::handler::StepMode;
use crate::hooks::{CommitInfo, Hooks};
use crate::metrics::{ConsumerMetrics, DeadLetterLabels, StepOnly, observe_since};
use crate::retry::RetryPolicy;
use crate::service::{BoxStepService, HandlerPanicked, HandlerTimedOut, StepItem, StepRequest};

/// Waits between attempts when the database is unreachable; these do not spend a message's retry budget.
const UNAVAILABLE_BACKOFF: RetryPolicy = RetryPolicy {
    max_attempts: u32::MAX,
    initial_backoff: Duration::from_millis(200),
    max_backoff: Duration::from_secs(10),
    multiplier: 2.0,
    jitter: 0.2,
};

/// What to do after a failed attempt.
enum Next {
    /// Try again after this wait.
    Retry(Duration),
    /// Give up: dead-letter the message.
    DeadLetter(DeadLetterReason, String),
}

/// Everything a partition worker needs to process messages.
pub(crate) struct Executor {
    pub pool: PgPool,
    pub service: BoxStepService,
    pub dead_letters: DeadLetters,
    pub retry: RetryPolicy,
    pub metrics: ConsumerMetrics,
    pub hooks: Hooks,
    pub guard: CrashGuard,
    /// Who this worker is, recorded with the leases it takes: `{group}@{host}/{pid}`.
    pub lease_holder: String,
    /// The Redis fast path, if on.
    pub fast_path: Option<FastPath>,
}

impl Executor {
    /// Processes one partition's `deliveries` in order. Returns how many, from the front, are finished
    /// (committed, skipped or dead-lettered): all of them unless `cancel` fired.
    ///
    /// Nothing commits, and no message is dead-lettered or leased, before `start` allows it; if it does
    /// not (the batch's range turned out a suspect's, or the record was cancelled), processing stops there.
    /// Transactions run on `connection`'s kept connection where it has one, and leave theirs there.
    pub(crate) async fn process(
        &self,
        deliveries: &mut [Delivery],
        cancel: &CancellationToken,
        start: &mut PendingStart,
        connection: &mut WorkerConnection,
    ) -> usize {
        let mut i = 0;
        while i < deliveries.len() {
            if cancel.is_cancelled() {
                return i;
            }
            if deliveries[i].is_transactional_or_ignored() {
                let run = deliveries[i..]
                    .iter()
                    .take_while(|d| d.is_transactional_or_ignored())
                    .count();
                let done = self
                    .process_run(&mut deliveries[i..i + run], cancel, start, connection)
                    .await;
                i += done;
                if done < run {
                    return i;
                }
                continue;
            }
            // Dead letters and two-phase steps take connections of their own: hold none meanwhile.
            connection.release();
            if !start.allows_commit().await {
                return i;
            }
            let finished = match &deliveries[i].route {
                Route::Poison(reason) => {
                    let (kind, error) = match reason {
                        PoisonReason::Envelope(e) => (DeadLetterReason::Undecodable, e.to_string()),
                        e @ PoisonReason::UnknownEventType { .. } => {
                            (DeadLetterReason::UnknownEventType, e.to_string())
                        }
                    };
                    self.dead_letter(&mut deliveries[i], kind, error, cancel)
                        .await
                }
                Route::Step { .. } if deliveries[i].known_done => {
                    self.finish(&deliveries[i], ItemOutcome::Duplicate);
                    true
                }
                Route::Step { .. } => self.two_phase(&mut deliveries[i], cancel).await,
                Route::Ignored => unreachable!("ignored messages join transactional runs"),
            };
            if !finished {
                return i;
            }
            i += 1;
        }
        deliveries.len()
    }

    /// Dead-letters `delivery` for `reason`, as the consumer died on it repeatedly.
    pub(crate) async fn dead_letter_crash_loop(
        &self,
        delivery: &mut Delivery,
        deaths: u32,
        cancel: &CancellationToken,
    ) -> bool {
        delivery.attempts = deaths;
        self.dead_letter(
            delivery,
            DeadLetterReason::CrashLoop,
            format!("the consumer died {deaths} times while processing this message"),
            cancel,
        )
        .await
    }

    /// Processes consecutive transactional (or ignored) deliveries. Returns how many are finished.
    ///
    /// A failure whose message is known (`Item`) cuts the batch short before that message; the messages
    /// before it commit as a smaller batch, then it is retried alone with the failure as its first
    /// attempt. A failure that names no message (a `Group` error of a batch handler call, or a statement
    /// of the framework that failed for another reason than a lost connection) makes the runtime process
    /// the range it happened in one message per transaction, so that the culprit is found and only it is
    /// retried or dead-lettered. A lost connection is waited out without touching any retry budget.
    async fn process_run(
        &self,
        run: &mut [Delivery],
        cancel: &CancellationToken,
        batch_start: &mut PendingStart,
        connection: &mut WorkerConnection,
    ) -> usize {
        let mut start = 0;
        // The first message known to have failed, at its index in `run`, with that failure.
        let mut failed: Option<(usize, Failure)> = None;
        // Messages before this index run one per transaction (a failure named none of them).
        let mut single_until = 0;
        let mut unavailable = 0;
        while start < run.len() {
            if failed.as_ref().is_some_and(|(at, _)| *at == start) {
                let (_, failure) = failed.take().expect("checked above");
                if !self
                    .retry_alone(&mut run[start], failure, cancel, batch_start, connection)
                    .await
                {
                    return start;
                }
                start += 1;
                continue;
            }
            if cancel.is_cancelled() {
                return start;
            }
            let limit = failed.as_ref().map_or(run.len(), |(at, _)| *at);
            let end = if start < single_until {
                start + 1
            } else {
                limit
            };
            match self
                .transact(&run[start..end], batch_start, connection)
                .await
            {
                Ok(outcomes) => {
                    for (d, outcome) in run[start..end].iter_mut().zip(outcomes) {
                        self.finish(d, outcome);
                    }
                    unavailable = 0;
                    start = end;
                }
                // Everything rolled back. Commit the messages before the failing one as a smaller batch.
                Err(BatchError::Item { index, failure }) => failed = Some((start + index, failure)),
                // A store error of a single message is that message's failure, with its retry budget.
                Err(BatchError::Store(e)) if end - start == 1 && !e.is_connection_error() => {
                    failed = Some((start, Failure::Store(e)));
                }
                // A handler call for several messages failed, or a statement over several: go through
                // the range one message per transaction, without counting attempts against messages that
                // did nothing wrong.
                Err(BatchError::Group) => single_until = end,
                // The batch may not commit (see `guard::PendingStart`): nothing of it did.
                Err(BatchError::NotStarted) => return start,
                Err(BatchError::KeysExist) => {
                    unreachable!("transact runs such a batch again itself")
                }
                Err(BatchError::Store(e)) if !e.is_connection_error() => {
                    tracing::debug!(error = %e, messages = end - start, "a batch statement failed; narrowing down");
                    single_until = end;
                }
                Err(BatchError::Store(e)) => {
                    self.metrics.database_unreachable.inc();
                    unavailable += 1;
                    let wait = UNAVAILABLE_BACKOFF.wait_after(unavailable);
                    tracing::warn!(error = %e, ?wait, "the database is unreachable; retrying the batch");
                    if !sleep_or_cancel(wait, cancel).await {
                        return start;
                    }
                }
            }
        }
        run.len()
    }

    /// Retries one failed transactional delivery alone until it commits or is dead-lettered. Returns
    /// whether it finished (`false`: cancelled).
    async fn retry_alone(
        &self,
        delivery: &mut Delivery,
        mut failure: Failure,
        cancel: &CancellationToken,
        batch_start: &mut PendingStart,
        connection: &mut WorkerConnection,
    ) -> bool {
        let mut unavailable = 0;
        loop {
            // No connection is held through the backoff (or a dead letter).
            connection.release();
            // A dead letter is an effect too: not before the batch's start is recorded.
            if !batch_start.allows_commit().await {
                return false;
            }
            if let ControlFlow::Break(finished) = self
                .back_off(delivery, &failure, &mut unavailable, cancel)
                .await
            {
                return finished;
            }
            match self
                .transact(std::slice::from_ref(delivery), batch_start, connection)
                .await
            {
                Ok(mut outcomes) => {
                    self.finish(delivery, outcomes.remove(0));
                    return true;
                }
                Err(BatchError::Item { failure: f, .. }) => failure = f,
                Err(BatchError::Store(e)) => failure = Failure::Store(e),
                Err(BatchError::NotStarted) => return false,
                Err(BatchError::Group) => unreachable!("a single message is never a group"),
                Err(BatchError::KeysExist) => {
                    unreachable!("transact runs such a batch again itself")
                }
            }
        }
    }

    /// One transaction over `batch`: claim, handle, record, append, commit. Run a second time, claiming
    /// with a check of each key, if the first claimed the keys as new and one existed.
    async fn transact(
        &self,
        batch: &[Delivery],
        start: &mut PendingStart,
        connection: &mut WorkerConnection,
    ) -> Result<Vec<ItemOutcome>, BatchError> {
        match self.transact_once(batch, start, connection).await {
            Err(BatchError::KeysExist) => {
                self.metrics.claims_rerun.inc();
                self.transact_once(batch, start, connection).await
            }
            other => other,
        }
    }

    /// [`Self::transact`]'s transaction, claiming as `connection` says (see `dedup::ClaimKind`).
    async fn transact_once(
        &self,
        batch: &[Delivery],
        start: &mut PendingStart,
        connection: &mut WorkerConnection,
    ) -> Result<Vec<ItemOutcome>, BatchError> {
        if batch.iter().all(Delivery::needs_no_claim) {
            if !start.allows_commit().await {
                return Err(BatchError::NotStarted);
            }
            // Nothing to claim or handle: no transaction.
            return Ok(batch
                .iter()
                .map(|d| {
                    if d.known_done {
                        ItemOutcome::Duplicate
                    } else {
                        ItemOutcome::Ignored
                    }
                })
                .collect());
        }
        let phases = &self.metrics.phases;
        let began = Instant::now();
        let (mut conn, kept) = connection.take(&self.pool).await?;
        let mut replacement = None;
        let mut tx = match sqlx::Connection::begin(&mut *conn).await {
            Ok(tx) => tx,
            // The kept connection broke since its last commit (the server restarted or ended it): the
            // pool's ping would have caught that; take a tested one instead of waiting out a lost database.
            // (The broken one goes back to the pool, whose ping discards it.)
            Err(e) if kept => {
                tracing::debug!(error = %e, "a kept connection failed to begin; taking another");
                let fresh = replacement.insert(self.pool.acquire().await?);
                sqlx::Connection::begin(&mut **fresh).await?
            }
            Err(e) => return Err(e.into()),
        };
        observe_since(&phases.begin, began);
        let claim = connection.claim_kind();
        let outcomes =
            match dedup::run_batch(&*self.service, &mut tx, batch, &self.metrics, claim).await {
                Ok(run) => {
                    connection.claimed(run.met_existing_keys);
                    run.outcomes
                }
                Err(e) => {
                    // Roll back now: a dropped transaction is rolled back only once the pool takes its
                    // connection back, and until then its claimed keys would hold up the retry.
                    let rolled_back = tx.rollback().await.is_ok();
                    if matches!(e, BatchError::KeysExist) {
                        // Nothing but the claim ran: the batch runs again at once, checking each key.
                        connection.claimed(true);
                        if rolled_back {
                            connection.keep(replacement.unwrap_or(conn));
                        }
                    }
                    return Err(e);
                }
            };
        let recording = Instant::now();
        if !start.allows_commit().await {
            let _ = tx.rollback().await;
            return Err(BatchError::NotStarted);
        }
        observe_since(&phases.guard, recording);
        let committing = Instant::now();
        tx.commit().await?;
        observe_since(&phases.commit, committing);
        connection.keep(replacement.unwrap_or(conn));
        self.metrics.batch_size.observe(batch.len() as f64);
        self.after_commit(batch);
        fast::after_commit(self.fast_path.as_ref(), batch, &outcomes);
        Ok(outcomes)
    }

    fn after_commit(&self, batch: &[Delivery]) {
        if let (Some(first), Some(last)) = (batch.first(), batch.last()) {
            self.hooks.after_db_commit(&CommitInfo {
                topic: first.raw.origin.topic.clone(),
                partition: first.raw.origin.partition,
                first_offset: first.raw.origin.offset,
                last_offset: last.raw.origin.offset,
                messages: batch.len(),
            });
        }
    }

    /// Runs a two-phase step for `delivery` until it finishes or is dead-lettered. Returns whether it
    /// finished (`false`: cancelled).
    async fn two_phase(&self, delivery: &mut Delivery, cancel: &CancellationToken) -> bool {
        let mut unavailable = 0;
        loop {
            if cancel.is_cancelled() {
                return false;
            }
            let failure = match self.two_phase_attempt(delivery).await {
                Ok(outcome) => {
                    fast::after_commit(
                        self.fast_path.as_ref(),
                        std::slice::from_ref(delivery),
                        &[outcome],
                    );
                    self.finish(delivery, outcome);
                    return true;
                }
                Err(failure) => failure,
            };
            if let ControlFlow::Break(finished) = self
                .back_off(delivery, &failure, &mut unavailable, cancel)
                .await
            {
                return finished;
            }
        }
    }

    /// One attempt of a two-phase step: lease, external call, completing transaction.
    async fn two_phase_attempt(&self, delivery: &Delivery) -> Result<ItemOutcome, Failure> {
        let Route::Step {
            step,
            decoded,
            step_key,
            tenant,
        } = &delivery.route
        else {
            unreachable!("only step deliveries run two-phase")
        };
        let StepMode::TwoPhase(two_phase) = &step.mode else {
            unreachable!("only two-phase steps run two-phase")
        };
        let store = |e: sqlx::Error| Failure::Store(StoreError::Database(e));
        let mut conn = self.pool.acquire().await.map_err(store)?;
        let lease = match idempotency::claim_lease(
            &mut conn,
            tenant,
            step_key,
            two_phase.lease(),
            &self.lease_holder,
        )
        .await
        .map_err(Failure::Store)?
        {
            LeaseClaim::Acquired(lease) => lease,
            LeaseClaim::Duplicate(_) => return Ok(ItemOutcome::Duplicate),
            LeaseClaim::Busy { until } => return Err(Failure::Busy(until)),
        };

        // Phase two: the external call, outside any transaction, bounded by the lease.
        let call = AssertUnwindSafe(tokio::time::timeout(
            two_phase.lease(),
            two_phase.call(decoded),
        ))
        .catch_unwind()
        .instrument(delivery.span.clone())
        .await;
        let response = match call {
            Ok(Ok(Ok(response))) => response,
            outcome => {
                let error = match outcome {
                    Ok(Ok(Err(e))) => e,
                    Ok(Err(_)) => StepError::transient(HandlerTimedOut(two_phase.lease())),
                    Err(_) => StepError::permanent(HandlerPanicked(
                        "the external call of a two-phase step panicked".into(),
                    )),
                    Ok(Ok(Ok(_))) => unreachable!(),
                };
                release(&mut conn, &lease, &error).await;
                return Err(Failure::Handler(error));
            }
        };

        // Phase three: complete in a transaction fenced by the lease's attempt number.
        let mut tx = self.pool.begin().await.map_err(store)?;
        match idempotency::lock_lease(&mut tx, &lease).await {
            Ok(()) => {}
            Err(StoreError::Fenced { .. }) => return Ok(ItemOutcome::Superseded),
            Err(e) => return Err(Failure::Store(e)),
        }
        let started = Instant::now();
        let handled = self
            .service
            .call(StepRequest {
                step,
                items: vec![StepItem {
                    decoded,
                    step_key,
                    tenant,
                    origin: &delivery.raw.origin,
                    span: &delivery.span,
                }],
                response: Some(response),
                conn: &mut tx,
            })
            .await;
        self.metrics
            .handler_seconds
            .get_or_create(&StepOnly {
                step: step.name.to_string(),
            })
            .observe(started.elapsed().as_secs_f64());
        let handled = match handled {
            Ok(handled) => handled,
            Err(error) => {
                // Roll back before releasing: the transaction holds the lease's row lock.
                let _ = tx.rollback().await;
                release(&mut conn, &lease, &error).await;
                return Err(Failure::Handler(error));
            }
        };
        let outcome = handled.outcomes.into_iter().next().ok_or_else(|| {
            Failure::Handler(StepError::permanent("the handler returned no outcome"))
        })?;
        idempotency::complete_lease(&mut tx, &lease, &outcome)
            .await
            .map_err(Failure::Store)?;
        outbox::append(&mut tx, &handled.emitted)
            .await
            .map_err(store)?;
        tx.commit().await.map_err(store)?;
        self.after_commit(std::slice::from_ref(delivery));
        Ok(ItemOutcome::of(&outcome))
    }

    /// Acts on a failed attempt: dead-letters the delivery (`Break` with whether that finished it) or waits
    /// out the backoff before the next attempt (`Continue`; `Break(false)` when cancelled meanwhile).
    async fn back_off(
        &self,
        delivery: &mut Delivery,
        failure: &Failure,
        unavailable: &mut u32,
        cancel: &CancellationToken,
    ) -> ControlFlow<bool> {
        match self.next_after(delivery, failure, unavailable) {
            Next::DeadLetter(reason, error) => {
                ControlFlow::Break(self.dead_letter(delivery, reason, error, cancel).await)
            }
            Next::Retry(wait) => {
                // An isolated message waiting for another worker's lease is not being processed: a death
                // meanwhile (another partition's, or the lease holder's) must not count against it.
                let waits_for_lease = delivery.isolated && matches!(failure, Failure::Busy(_));
                let origin = delivery.raw.origin.clone();
                if waits_for_lease {
                    // Let the rest of the consumer run meanwhile.
                    delivery.alone = None;
                    self.guard
                        .pause(&origin.topic, origin.partition, origin.offset)
                        .await;
                }
                let mut slept = sleep_or_cancel(wait, cancel).await;
                if waits_for_lease && slept {
                    delivery.alone = self
                        .guard
                        .alone(&origin.topic, origin.partition, origin.offset, cancel)
                        .await;
                    slept = delivery.alone.is_some();
                }
                if slept {
                    ControlFlow::Continue(())
                } else {
                    ControlFlow::Break(false)
                }
            }
        }
    }

    /// Decides what follows a failed attempt, counting it against the retry budget where it should count.
    fn next_after(
        &self,
        delivery: &mut Delivery,
        failure: &Failure,
        unavailable: &mut u32,
    ) -> Next {
        let step = delivery.step_name().unwrap_or_default().to_owned();
        let counted = match failure {
            Failure::Handler(e) if e.kind() == ErrorKind::Permanent => {
                delivery.attempts += 1;
                return Next::DeadLetter(DeadLetterReason::HandlerFailed, e.to_string());
            }
            Failure::Handler(e) if e.is_database_unavailable() => false,
            Failure::Store(e) if e.is_connection_error() => false,
            Failure::Busy(until) => {
                let wait = (*until - chrono::Utc::now())
                    .to_std()
                    .unwrap_or_default()
                    .clamp(Duration::from_millis(50), Duration::from_secs(60));
                tracing::info!(parent: &delivery.span, ?wait, "step key leased by another worker; waiting");
                return Next::Retry(wait);
            }
            Failure::Handler(_) | Failure::Store(_) => true,
        };
        if !counted {
            self.metrics.database_unreachable.inc();
            *unavailable += 1;
            let wait = UNAVAILABLE_BACKOFF.wait_after(*unavailable);
            tracing::warn!(parent: &delivery.span, error = %failure, ?wait, "database unavailable; waiting");
            return Next::Retry(wait);
        }
        delivery.attempts += 1;
        if !self.retry.may_retry(delivery.attempts) {
            return Next::DeadLetter(
                DeadLetterReason::RetriesExhausted,
                format!(
                    "{} attempts failed; last error: {failure}",
                    delivery.attempts
                ),
            );
        }
        self.metrics.retries.get_or_create(&StepOnly { step }).inc();
        let wait = self.retry.wait_after(delivery.attempts);
        tracing::warn!(
            parent: &delivery.span,
            attempt = delivery.attempts,
            error = %failure,
            ?wait,
            "transient failure; retrying"
        );
        Next::Retry(wait)
    }

    /// Produces `delivery` to the dead-letter topic. Returns whether it was acknowledged (`false`:
    /// cancelled first).
    async fn dead_letter(
        &self,
        delivery: &mut Delivery,
        reason: DeadLetterReason,
        error: String,
        cancel: &CancellationToken,
    ) -> bool {
        let letter = DeadLetter {
            reason,
            step: delivery.step_name().map(str::to_owned),
            error,
            attempts: delivery.attempts.max(1),
        };
        tracing::error!(
            parent: &delivery.span,
            reason = reason.as_str(),
            error = %letter.error,
            attempts = letter.attempts,
            dlq = self.dead_letters.topic(),
            "dead-lettering message"
        );
        if !self.dead_letters.send(&delivery.raw, &letter, cancel).await {
            return false;
        }
        self.metrics
            .dead_lettered
            .get_or_create(&DeadLetterLabels {
                topic: delivery.raw.origin.topic.clone(),
                reason: reason.as_str().to_owned(),
            })
            .inc();
        self.finish(delivery, ItemOutcome::DeadLettered);
        true
    }

    fn finish(&self, delivery: &Delivery, outcome: ItemOutcome) {
        delivery.span.record("saga.outcome", outcome.as_str());
        let step = delivery.step_name();
        if outcome == ItemOutcome::Duplicate {
            self.metrics
                .duplicates
                .get_or_create(&StepOnly {
                    step: step.unwrap_or_default().to_owned(),
                })
                .inc();
        }
        self.metrics.finished(step, outcome.as_str());
        tracing::debug!(parent: &delivery.span, outcome = outcome.as_str(), "message finished");
    }
}

/// Gives up a two-phase lease after a failure, so that the retry can take it over at once.
async fn release(conn: &mut sqlx::PgConnection, lease: &idempotency::Lease, error: &StepError) {
    if let Err(e) = idempotency::release_lease(conn, lease, &error.to_string()).await {
        tracing::warn!(error = %e, "could not release a lease; it expires on its own");
    }
}

/// Sleeps for `wait`; returns `false` if `cancel` fired first.
pub(crate) async fn sleep_or_cancel(wait: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        _ = cancel.cancelled() => false,
        _ = tokio::time::sleep(wait) => true,
    }
}
