//! Processing one partition's messages, in order: transactions, batching, retries and dead-lettering.
//!
//! Consecutive messages for transactional steps run as one batch in one transaction (see `dedup`). If a
//! message fails, the whole transaction rolls back; the messages before it are run again as a smaller batch,
//! the failing one is retried alone with backoff, and those after it form the next batch. So a failing
//! message never takes the others' effects down with it, and every message's effects still commit together
//! with its step key, once.
//!
//! Poison messages are dead-lettered where they stand; two-phase steps run one message at a time. The
//! decisions are the `machine`'s; this module performs them.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use futures::FutureExt;
use saga_core::{ErrorKind, StepError};
use saga_runtime::store::idempotency::{self, LeaseClaim, StoreError};
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::connection::{Released, WorkerConnection, commit, rollback};
use crate::dedup::{self, BatchError, Failure, ItemOutcome};
use crate::delivery::{Delivery, Route};
use crate::dlq::{DeadLetter, DeadLetterReason, DeadLetters};
use crate::fast::{self, FastPath};
use crate::guard::{CommitPermit, CrashGuard, PendingStart};
use crate::handler::StepMode;
use crate::hold::{self, Holds, OnDeadLetter, OrderPolicy, ParkDecision, Role};
use crate::hooks::{CommitInfo, Hooks};
use crate::letters;
use crate::machine::{Action, BatchMachine, Event, Fault, Wait};
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
    /// Where the steps' events are written.
    pub outbox: saga_runtime::store::outbox::Outbox,
    /// The group's held keys and paused steps (see `hold`).
    pub holds: Holds,
}

impl Executor {
    /// Processes one partition's `deliveries` in order. Returns how many, from the front, are finished
    /// (committed, skipped or dead-lettered): all of them unless `cancel` fired.
    ///
    /// The decisions (what runs in one transaction, narrowing, retries, dead letters) are the
    /// [`BatchMachine`]'s; this loop performs its actions. Nothing commits, and no message is
    /// dead-lettered or leased, without a [`CommitPermit`] from `start`; if it gives none (the batch's range
    /// turned out a suspect's, or the record was cancelled), processing stops there. Transactions run on
    /// `connection`'s kept connection where it has one; every other action gives it back first.
    pub(crate) async fn process(
        &self,
        deliveries: &mut [Delivery],
        cancel: &CancellationToken,
        start: &mut PendingStart,
        connection: &mut WorkerConnection,
    ) -> usize {
        // Each message's part in its key's hold, read before anything of the batch runs.
        if !self.classify(deliveries, cancel).await {
            return 0;
        }
        let kinds = deliveries.iter().map(Delivery::kind).collect();
        let attempts = deliveries.iter().map(|d| d.attempts).collect();
        let mut machine = BatchMachine::new(kinds, attempts, self.retry.max_attempts);
        // Where a key can be held in this batch (a policy holds keys, or the pre-pass found a hold): each
        // message's key, so that a dead letter or a parked message holds the rest of its key's batch.
        if self.holds.any_policy_holds() || deliveries.iter().any(|d| d.hold != Role::Free) {
            let mut ids: HashMap<&[u8], u64> = HashMap::new();
            // Only a message that runs as any other (or parks) follows its key's hold within the batch: a
            // head, a release or a stale copy has its own part, never parked behind a letter of the batch.
            let keys = deliveries
                .iter()
                .map(|d| {
                    let next = ids.len() as u64;
                    hold::key_of_held(&d.raw)
                        .filter(|_| matches!(d.hold, Role::Free | Role::Park))
                        .map(|k| *ids.entry(k).or_insert(next))
                })
                .collect();
            let holds = deliveries.iter().map(|d| self.holds_key(d)).collect();
            machine = machine.with_holds(keys, holds);
        }
        while !cancel.is_cancelled() {
            // The kept connection serves back-to-back transactions only (the next batch's too): every
            // other action releases it first, and takes the proof.
            let event = match machine.next() {
                Action::Done => break,
                Action::Transact { start: from, end } => {
                    match self
                        .transact(&deliveries[from..end], start, connection)
                        .await
                    {
                        Ok(outcomes) => {
                            self.finish_batch(&deliveries[from..end], &outcomes);
                            if !self.advance_holds(&deliveries[from..end], cancel).await {
                                break;
                            }
                            Event::Committed
                        }
                        Err(BatchError::Item { index, failure }) => Event::ItemFailed {
                            index: from + index,
                            fault: fault_of(&failure),
                        },
                        Err(BatchError::Group) => Event::GroupFailed {
                            fault: Fault::Transient(
                                "a handler call for several messages failed".into(),
                            ),
                        },
                        Err(BatchError::Store(e)) => {
                            if !e.is_connection_error() && end - from > 1 {
                                tracing::debug!(error = %e, messages = end - from, "a batch statement failed; narrowing down");
                            }
                            Event::GroupFailed {
                                fault: fault_of(&Failure::Store(e)),
                            }
                        }
                        // The batch may not commit (see `guard::PendingStart`): nothing of it did.
                        Err(BatchError::NotStarted) => break,
                        Err(BatchError::KeysExist) => {
                            unreachable!("transact runs such a batch again itself")
                        }
                    }
                }
                Action::TwoPhase { index } => {
                    let released = connection.release();
                    let Some(permit) = start.permit().await else {
                        break;
                    };
                    match self
                        .two_phase_attempt(&deliveries[index], &permit, &released)
                        .await
                    {
                        Ok(outcome) => {
                            fast::after_commit(
                                self.fast_path.as_ref(),
                                std::slice::from_ref(&deliveries[index]),
                                &[outcome],
                            );
                            self.finish(&deliveries[index], outcome);
                            if !self
                                .advance_holds(std::slice::from_ref(&deliveries[index]), cancel)
                                .await
                            {
                                break;
                            }
                            Event::Committed
                        }
                        Err(failure) => Event::ItemFailed {
                            index,
                            fault: fault_of(&failure),
                        },
                    }
                }
                Action::DeadLetter {
                    index,
                    reason,
                    error,
                    attempts,
                } => {
                    let released = connection.release();
                    let Some(permit) = start.permit().await else {
                        break;
                    };
                    let delivery = &mut deliveries[index];
                    delivery.attempts = attempts;
                    let error = if error.is_empty() {
                        delivery.poison_text()
                    } else {
                        error
                    };
                    if !self
                        .dead_letter(delivery, reason, error, &permit, &released, cancel)
                        .await
                    {
                        break;
                    }
                    Event::DeadLettered
                }
                Action::Park { index } => {
                    let _released = connection.release();
                    let Some(_permit) = start.permit().await else {
                        break;
                    };
                    // Parked by the batch's own hold (a dead letter or a parked message before it) or by the
                    // pre-pass: a refusal of it is no head and joins no queue.
                    deliveries[index].hold = Role::Park;
                    match self.park(&deliveries[index], cancel).await {
                        Some(ParkDecision::Append | ParkDecision::Create) => {
                            self.finish(&deliveries[index], ItemOutcome::Parked);
                            Event::Parked
                        }
                        Some(ParkDecision::NotHeld) => {
                            deliveries[index].hold = Role::Free;
                            Event::NotHeld {
                                kind: deliveries[index].unheld_kind(),
                            }
                        }
                        Some(ParkDecision::Full(reason)) => Event::ParkRefused { reason },
                        None => break,
                    }
                }
                Action::Wait { index, wait } => {
                    let released = connection.release();
                    // A retry may commit: not before the batch's start is recorded.
                    if start.permit().await.is_none() {
                        break;
                    }
                    let reason = machine.retry_reason().unwrap_or_default();
                    if !self
                        .wait(&mut deliveries[index], wait, &reason, &released, cancel)
                        .await
                    {
                        break;
                    }
                    Event::Waited
                }
            };
            machine.on(event);
        }
        for (i, delivery) in deliveries.iter_mut().enumerate() {
            delivery.attempts = machine.attempts(i);
        }
        // A batch left for a release's bookkeeping was not handed back as committed: not finished.
        machine.finished()
    }

    /// Whether a dead letter of `delivery` holds its key: its policy says so, or it is its key's head or
    /// release (which fails again: the new head).
    fn holds_key(&self, delivery: &Delivery) -> bool {
        matches!(delivery.hold, Role::Release(_) | Role::Head(_))
            || self
                .holds
                .policy(delivery.step_name(), &delivery.original().topic)
                == OrderPolicy::HoldKey
    }

    /// Reads the holds of `deliveries`' keys and the group's paused steps, and gives each its role;
    /// waits out an unavailable database. `false` if cancelled first.
    async fn classify(&self, deliveries: &mut [Delivery], cancel: &CancellationToken) -> bool {
        // Nothing can be held (see `Holds::active`), unless a message came from the retry topic (a
        // release or a replay is always read against its key).
        if !self.holds.is_active() && deliveries.iter().all(|d| d.replayed_from.is_none()) {
            return true;
        }
        let mut keys: Vec<&[u8]> = deliveries.iter().map(|d| hold::key_of(&d.raw)).collect();
        keys.sort_unstable();
        keys.dedup();
        let read = until_done("reading held keys", cancel, || async {
            match self
                .holds
                .read(&mut *self.pool.acquire().await?, &keys)
                .await
            {
                // A schema without the hold tables (the consumer's migrations not applied): nothing held.
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => Ok(None),
                read => read.map(Some),
            }
        });
        let found = match read.await {
            Some(Some(found)) => found,
            Some(None) => return true,
            None => return false,
        };
        for delivery in deliveries.iter_mut() {
            let mark = hold::mark_of(&delivery.raw, delivery.replayed_from.as_ref());
            // A keyless message is held by nothing but its own step's pause (it has no key to order by); a
            // release of one follows the queue of keyless messages.
            let view = match (&mark, hold::key_of_held(&delivery.raw)) {
                (hold::Mark::Plain | hold::Mark::Replay(_), None) => None,
                _ => found.views.get(hold::key_of(&delivery.raw)),
            };
            let paused = delivery
                .step_name()
                .is_some_and(|s| found.paused.contains(s));
            delivery.hold = hold::classify(view, &mark, paused);
            if delivery.hold == Role::Stale {
                tracing::info!(parent: &delivery.span, "a release of a held key's message that ran already (or out of turn): skipped");
                delivery.known_done = true;
            } else if delivery.hold == Role::Park {
                tracing::info!(parent: &delivery.span, paused, "its key is held: parked behind its queue");
            }
        }
        true
    }

    /// Parks `delivery` (see `hold::Holds::park`), retrying while the database is unavailable; `None` if
    /// cancelled first.
    async fn park(&self, delivery: &Delivery, cancel: &CancellationToken) -> Option<ParkDecision> {
        until_done("parking a message", cancel, || {
            self.holds.park(
                &self.pool,
                &delivery.raw,
                delivery.original(),
                delivery.step_name(),
            )
        })
        .await
    }

    /// Records, for each of `batch` that is a held key's head or release, that it is finished (see
    /// `hold::advance`), retrying while the database is unavailable. `false` if `cancel` fired before all
    /// were recorded: the batch must not be committed (its messages come back, find their step keys done,
    /// and record it then).
    async fn advance_holds(&self, batch: &[Delivery], cancel: &CancellationToken) -> bool {
        for delivery in batch {
            if !matches!(delivery.hold, Role::Head(_) | Role::Release(_)) {
                continue;
            }
            let by = match delivery.raw.headers.get_str(saga_runtime::replay::OPERATOR) {
                Ok(Some(operator)) => format!("replay by {operator}"),
                _ => "replay".to_owned(),
            };
            let advanced = until_done("recording a release", cancel, || {
                self.holds
                    .advance(&self.pool, &delivery.raw, &delivery.hold, &by)
            })
            .await;
            match advanced {
                Some(done) => tracing::info!(parent: &delivery.span, ?done, "held key advanced"),
                None => return false,
            }
        }
        true
    }

    /// Dead-letters `delivery` for `reason`, as the consumer died on it repeatedly.
    pub(crate) async fn dead_letter_crash_loop(
        &self,
        delivery: &mut Delivery,
        deaths: u32,
        permit: &CommitPermit,
        released: &Released<'_>,
        cancel: &CancellationToken,
    ) -> bool {
        // Its part in its key's hold first, as `process` reads it: a message of a held key is parked (it
        // never runs), a stale release copy is finished, and a head's or release's letter is the new head.
        if !self.classify(std::slice::from_mut(delivery), cancel).await {
            return false;
        }
        match delivery.hold {
            Role::Stale => {
                self.finish(delivery, ItemOutcome::Duplicate);
                return true;
            }
            Role::Park => match self.park(delivery, cancel).await {
                Some(ParkDecision::Append | ParkDecision::Create) => {
                    self.finish(delivery, ItemOutcome::Parked);
                    return true;
                }
                Some(ParkDecision::NotHeld) => delivery.hold = Role::Free,
                Some(ParkDecision::Full(_)) => {}
                None => return false,
            },
            Role::Free | Role::Head(_) | Role::Release(_) => {}
        }
        delivery.attempts = deaths;
        self.dead_letter(
            delivery,
            DeadLetterReason::CrashLoop,
            format!("the consumer died {deaths} times while processing this message"),
            permit,
            released,
            cancel,
        )
        .await
    }

    /// Waits before the next attempt of `delivery` as the machine says; returns `false` if cancelled first.
    /// An isolated message waiting for another worker's lease lets the process go meanwhile.
    async fn wait(
        &self,
        delivery: &mut Delivery,
        wait: Wait,
        reason: &str,
        released: &Released<'_>,
        cancel: &CancellationToken,
    ) -> bool {
        let step = delivery.step_name().unwrap_or_default().to_owned();
        let duration = match wait {
            Wait::Backoff(attempts) => {
                self.metrics.retries.get_or_create(&StepOnly { step }).inc();
                let wait = self.retry.wait_after(attempts);
                tracing::warn!(parent: &delivery.span, attempt = attempts, error = %reason, ?wait, "transient failure; retrying");
                wait
            }
            Wait::Unavailable(times) => {
                self.metrics.database_unreachable.inc();
                let wait = UNAVAILABLE_BACKOFF.wait_after(times);
                tracing::warn!(parent: &delivery.span, error = %reason, ?wait, "database unavailable; waiting");
                wait
            }
            Wait::Lease(left) => {
                let wait = left.clamp(Duration::from_millis(50), Duration::from_secs(60));
                tracing::info!(parent: &delivery.span, ?wait, "step key leased by another worker; waiting");
                wait
            }
        };
        // An isolated message waiting for another worker's lease is not being processed: a death meanwhile
        // (another partition's, or the lease holder's) must not count against it.
        let waits_for_lease = delivery.isolated && matches!(wait, Wait::Lease(_));
        let origin = delivery.raw.origin.clone();
        if waits_for_lease {
            delivery.alone = None;
            self.guard
                .pause(&origin.topic, origin.partition, origin.offset)
                .await;
        }
        let mut slept = sleep_or_cancel(duration, cancel).await;
        if waits_for_lease && slept {
            delivery.alone = self
                .guard
                .alone(
                    &origin.topic,
                    origin.partition,
                    origin.offset,
                    released,
                    cancel,
                )
                .await;
            slept = delivery.alone.is_some();
        }
        slept
    }

    /// One transaction over `batch`: claim, handle, record, append, commit. Run a second time, claiming
    /// with a check of each key, if the first claimed the keys as new and one existed.
    async fn transact(
        &self,
        batch: &[Delivery],
        start: &mut PendingStart,
        connection: &mut WorkerConnection,
    ) -> Result<Vec<ItemOutcome>, BatchError> {
        // An outbox that may not be written (its WAL slot lost): nothing commits, the batch waits intact.
        self.outbox
            .check_writable()
            .map_err(|e| BatchError::Store(e.into()))?;
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
            if start.permit().await.is_none() {
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
        let claim = connection.claim_kind();
        let mut lent = connection.lend(&self.pool).await?;
        let mut tx = lent.begin().await?;
        observe_since(&phases.begin, began);
        let run = match dedup::run_batch(
            &*self.service,
            &mut tx,
            batch,
            &self.metrics,
            claim,
            &self.outbox,
        )
        .await
        {
            Ok(run) => run,
            Err(e) => {
                let rolled_back = rollback(tx).await;
                if matches!(e, BatchError::KeysExist) {
                    // Nothing but the claim ran: the batch runs again at once, checking each key.
                    lent.claimed(true);
                    if let Some(settled) = rolled_back {
                        lent.keep(settled);
                    }
                } else if e.is_database_unavailable() {
                    lent.discard();
                }
                return Err(e);
            }
        };
        let recording = Instant::now();
        let Some(permit) = start.permit().await else {
            let _ = rollback(tx).await;
            return Err(BatchError::NotStarted);
        };
        observe_since(&phases.guard, recording);
        let committing = Instant::now();
        let settled = match commit(tx, &permit).await {
            Ok(settled) => settled,
            Err(e) => {
                lent.discard_if_unavailable(&e);
                return Err(e.into());
            }
        };
        observe_since(&phases.commit, committing);
        lent.claimed(run.met_existing_keys);
        lent.keep(settled);
        self.metrics.batch_size.observe(batch.len() as f64);
        self.after_commit(batch);
        fast::after_commit(self.fast_path.as_ref(), batch, &run.outcomes);
        Ok(run.outcomes)
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

    /// One attempt of a two-phase step: lease, external call, completing transaction. The connections it
    /// took are closed instead of given back if the database turned out unavailable.
    async fn two_phase_attempt(
        &self,
        delivery: &Delivery,
        permit: &CommitPermit,
        _released: &Released<'_>,
    ) -> Result<ItemOutcome, Failure> {
        // Not even the external call while the outbox may not be written: its completion could not commit.
        self.outbox
            .check_writable()
            .map_err(|e| Failure::Store(e.into()))?;
        let mut held = TwoPhaseConnections::default();
        let attempt = self.two_phase_attempt_on(delivery, permit, &mut held).await;
        if let Err(failure) = &attempt
            && failure.is_database_unavailable()
        {
            held.lease
                .iter_mut()
                .for_each(PoolConnection::close_on_drop);
            held.completing
                .iter_mut()
                .for_each(PoolConnection::close_on_drop);
        }
        attempt
    }

    /// [`Self::two_phase_attempt`], on connections it keeps in `held`.
    async fn two_phase_attempt_on(
        &self,
        delivery: &Delivery,
        permit: &CommitPermit,
        held: &mut TwoPhaseConnections,
    ) -> Result<ItemOutcome, Failure> {
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
        let conn = held.lease.insert(self.pool.acquire().await.map_err(store)?);
        // A message old enough for retention to have deleted its key (after its call was made) is claimed
        // in a transaction that also reads how far retention deleted: a first lease on such a key is rolled
        // back, never left behind for a redelivery to take over past the check.
        let old = delivery.raw.timestamp_ms.filter(|t| dedup::old_enough(*t));
        let claim = match old {
            Some(t) => {
                let mut tx = sqlx::Connection::begin(&mut **conn).await.map_err(store)?;
                let claim = idempotency::claim_lease(
                    &mut tx,
                    tenant,
                    step_key,
                    two_phase.lease(),
                    &self.lease_holder,
                )
                .await
                .map_err(Failure::Store)?;
                if let LeaseClaim::Acquired(lease) = &claim
                    && lease.attempt == 1
                    && dedup::keys_maybe_gone(&mut tx, &[Some(t)])
                        .await
                        .map_err(store)?
                        .is_some()
                {
                    tx.rollback().await.map_err(store)?;
                    return Err(Failure::Handler(StepError::permanent(
                        dedup::KeyMayBeGone::at(t),
                    )));
                }
                tx.commit().await.map_err(store)?;
                claim
            }
            None => idempotency::claim_lease(
                conn,
                tenant,
                step_key,
                two_phase.lease(),
                &self.lease_holder,
            )
            .await
            .map_err(Failure::Store)?,
        };
        let lease = match claim {
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
                release(conn, &lease, &error).await;
                return Err(Failure::Handler(error));
            }
        };

        // Phase three: complete in a transaction fenced by the lease's attempt number.
        let completing = held
            .completing
            .insert(self.pool.acquire().await.map_err(store)?);
        let mut tx = sqlx::Connection::begin(&mut **completing)
            .await
            .map_err(store)?;
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
                release(conn, &lease, &error).await;
                return Err(Failure::Handler(error));
            }
        };
        let outcome = handled.outcomes.into_iter().next().ok_or_else(|| {
            Failure::Handler(StepError::permanent("the handler returned no outcome"))
        })?;
        idempotency::complete_lease(&mut tx, &lease, &outcome)
            .await
            .map_err(Failure::Store)?;
        self.outbox
            .append(&mut tx, &handled.emitted)
            .await
            .map_err(|e| Failure::Store(e.into()))?;
        commit(tx, permit).await.map_err(store)?;
        self.after_commit(std::slice::from_ref(delivery));
        Ok(ItemOutcome::of(&outcome))
    }

    /// Produces `delivery` to the dead-letter topic. Returns whether it was acknowledged (`false`:
    /// cancelled first).
    async fn dead_letter(
        &self,
        delivery: &mut Delivery,
        reason: DeadLetterReason,
        error: String,
        _permit: &CommitPermit,
        _released: &Released<'_>,
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
        let Some(indexed) = self
            .dead_letters
            .send(&delivery.raw, delivery.original(), &letter, cancel)
            .await
        else {
            return false;
        };
        // Indexed before the offset may move, with what it does to its key's hold: the toolkit finds the
        // letter without reading the topic, and a held key's later messages are parked.
        let holds = self.holds_key(delivery);
        if !self
            .index_dead_letter(&indexed, Some((&*delivery, holds)), cancel)
            .await
        {
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

    /// Records `letter` in the schema's dead-letter index, retrying while the database is unavailable;
    /// `false` if `cancel` fires first (the message is not committed, and comes back). A schema without the
    /// index (its migrations not applied) is said once per letter and left to the toolkit, which indexes
    /// what it finds in the topic: a dead letter is never held back for its index.
    async fn index_dead_letter(
        &self,
        letter: &letters::IndexedLetter,
        hold: Option<(&Delivery, bool)>,
        cancel: &CancellationToken,
    ) -> bool {
        let mut wait = Duration::from_millis(100);
        let mut index = true;
        loop {
            match self.record_dead_letter(letter, hold, index).await {
                Ok(()) => return true,
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => {
                    tracing::warn!(
                        dlq = %letter.dlq_topic,
                        "the schema has no dead-letter index (saga_dead_letters): apply the consumer's \
                         migrations; the toolkit indexes the letter when it reads the topic"
                    );
                    return true;
                }
                // A value the database refuses for good (data exceptions, program limits): retrying cannot
                // help, and a partition must not stop for it. The letter is in its topic: first its index
                // goes (its hold, if any, is recorded without it), then, refused again, its hold.
                Err(sqlx::Error::Database(e))
                    if e.code()
                        .is_some_and(|c| c.starts_with("22") || c.starts_with("54")) =>
                {
                    let refused = if index {
                        "the dead-letter index refuses this letter; it stays in its topic, unindexed"
                    } else {
                        "the held keys' tables refuse this message; its letter is in its topic, its key \
                         not held"
                    };
                    tracing::error!(
                        dlq = %letter.dlq_topic,
                        partition = letter.partition,
                        offset = letter.offset,
                        error = %e,
                        "{refused}"
                    );
                    if !index || hold.is_none() {
                        return true;
                    }
                    index = false;
                }
                Err(e) => {
                    tracing::warn!(error = %e, ?wait, "indexing a dead letter failed; retrying");
                    if !sleep_or_cancel(wait, cancel).await {
                        return false;
                    }
                    wait = (wait * 2).min(Duration::from_secs(10));
                }
            }
        }
    }

    /// One transaction: what `letter` does to its key's hold (`hold`: its message, and whether its policy
    /// holds keys), and, if `index`, its row in the dead-letter index.
    async fn record_dead_letter(
        &self,
        letter: &letters::IndexedLetter,
        hold: Option<(&Delivery, bool)>,
        index: bool,
    ) -> Result<(), sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        if let Some((delivery, holds)) = hold {
            let done = self
                .holds
                .on_dead_letter(
                    &mut tx,
                    &delivery.raw,
                    delivery.original(),
                    delivery.step_name(),
                    &delivery.hold,
                    holds,
                    letter,
                )
                .await?;
            if done != OnDeadLetter::Nothing {
                tracing::warn!(parent: &delivery.span, ?done, "its key is held behind this dead letter");
            }
        }
        if index {
            letters::index(&mut tx, std::slice::from_ref(letter)).await?;
        }
        tx.commit().await
    }

    fn finish(&self, delivery: &Delivery, outcome: ItemOutcome) {
        self.finish_batch(std::slice::from_ref(delivery), &[outcome]);
    }

    /// Records how each of `batch` ended: on its span, in its log line, and in the counters, which are
    /// counted once per step and outcome of the batch rather than once per message.
    fn finish_batch(&self, batch: &[Delivery], outcomes: &[ItemOutcome]) {
        let mut counts: Vec<(Option<&str>, ItemOutcome, u64)> = Vec::new();
        for (delivery, &outcome) in batch.iter().zip(outcomes) {
            delivery.span.record("saga.outcome", outcome.as_str());
            tracing::debug!(parent: &delivery.span, outcome = outcome.as_str(), "message finished");
            let step = delivery.step_name();
            match counts
                .iter_mut()
                .find(|(s, o, _)| *s == step && *o == outcome)
            {
                Some((_, _, n)) => *n += 1,
                None => counts.push((step, outcome, 1)),
            }
        }
        for (step, outcome, n) in counts {
            if outcome == ItemOutcome::Duplicate {
                self.metrics
                    .duplicates
                    .get_or_create(&StepOnly {
                        step: step.unwrap_or_default().to_owned(),
                    })
                    .inc_by(n);
            }
            self.metrics.finished(step, outcome.as_str(), n);
        }
    }
}

/// The connections of a two-phase attempt: the lease's, and the completing transaction's.
#[derive(Default)]
struct TwoPhaseConnections {
    lease: Option<PoolConnection<Postgres>>,
    completing: Option<PoolConnection<Postgres>>,
}

/// Gives up a two-phase lease after a failure, so that the retry can take it over at once.
async fn release(conn: &mut sqlx::PgConnection, lease: &idempotency::Lease, error: &StepError) {
    if let Err(e) = idempotency::release_lease(conn, lease, &error.to_string()).await {
        tracing::warn!(error = %e, "could not release a lease; it expires on its own");
    }
}

/// Closes `conn` when it is returned instead of giving it back to the pool, if `error` says the database is
/// unavailable: a connection left on a server that shuts down, or that a switchover made read-only, would
/// fail every transaction it is given.
pub(crate) fn discard_if_unavailable(conn: &mut PoolConnection<Postgres>, error: &sqlx::Error) {
    if StepError::is_connection_error(error) {
        conn.close_on_drop();
    }
}

/// Runs `attempt` until it succeeds, waiting out its failures with the database's backoff (`what` names it in
/// the log); `None` if `cancel` fires first.
async fn until_done<T, F, Fut>(what: &str, cancel: &CancellationToken, mut attempt: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let mut times = 0;
    loop {
        match attempt().await {
            Ok(done) => return Some(done),
            Err(e) => {
                times += 1;
                let wait = UNAVAILABLE_BACKOFF.wait_after(times);
                tracing::warn!(error = %e, ?wait, "{what} failed; retrying");
                if !sleep_or_cancel(wait, cancel).await {
                    return None;
                }
            }
        }
    }
}

/// Sleeps for `wait`; returns `false` if `cancel` fired first.
pub(crate) async fn sleep_or_cancel(wait: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        _ = cancel.cancelled() => false,
        _ = tokio::time::sleep(wait) => true,
    }
}

/// What the machine needs to know of a failure.
fn fault_of(failure: &Failure) -> Fault {
    match failure {
        _ if failure.is_database_unavailable() => Fault::Unavailable(failure.to_string()),
        Failure::Handler(e) if e.kind() == ErrorKind::Permanent => Fault::Permanent(e.to_string()),
        Failure::Store(e) if e.is_permanent() => Fault::Permanent(e.to_string()),
        Failure::Busy(until) => {
            Fault::Leased((*until - chrono::Utc::now()).to_std().unwrap_or_default())
        }
        Failure::Handler(_) | Failure::Store(_) => Fault::Transient(failure.to_string()),
    }
}
