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

use std::time::{Duration, Instant};

use saga_core::{ErrorKind, StepError};
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};
use tokio_util::sync::CancellationToken;

use crate::connection::{Released, WorkerConnection};
pub(crate) use crate::db_retry::sleep_or_cancel;
use crate::db_retry::{Budget, Stopper, Tried, with_budget};
use crate::dedup::{
    self, AsNew, BatchError, Checked, ClaimKind, ClaimWay, Failure, ItemOutcome, KeysExist,
};
use crate::delivery::Delivery;
use crate::dlq::{DeadLetter, DeadLetterReason, DeadLetters};
use crate::fast::{self, FastPath};
use crate::guard::{CommitPermit, CrashGuard, PendingStart};
use crate::hold::{
    DeferDecision, DelayedRetry, Holds, OnDeadLetter, OrderPolicy, ParkDecision, Role,
};
use crate::hooks::{CommitInfo, Hooks};
use crate::letters;
use crate::machine::{Action, Event, Fault, Wait};
use crate::metrics::{ConsumerMetrics, DeadLetterLabels, StepOnly, observe_since};
use crate::retry::RetryPolicy;
use crate::service::BoxStepService;
use crate::step_tx::{self, StepTx};

/// Why a batch's first message is dead-lettered alone, before anything of the batch runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Alone {
    /// The consumer died on it this many times.
    CrashLoop(u32),
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
    /// Where the steps' events are written.
    pub outbox: saga_runtime::store::outbox::Outbox,
    /// The group's held keys and paused steps (see `hold`).
    pub holds: Holds,
    /// Stops the consumer on a fault that is the operator's (see `db_retry`).
    pub stopper: Stopper,
}

impl Executor {
    /// Processes one partition's `deliveries` in order. Returns how many, from the front, are finished
    /// (committed, skipped or dead-lettered): all of them unless `cancel` fired.
    ///
    /// The stages after the crash-loop gate: the hold gate (`hold_gate`), then the
    /// [`BatchMachine`](crate::machine::BatchMachine)'s decisions (what runs in one transaction, narrowing,
    /// retries, dead letters), whose actions this loop performs, each by a method of its own; the step
    /// transaction is `step_tx`'s. Nothing commits, and no message is
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
        let Some(mut machine) = self.hold_gate(deliveries, connection, cancel).await else {
            return 0;
        };
        while !cancel.is_cancelled() {
            // The kept connection serves back-to-back transactions only (the next batch's too): every
            // other action releases it first, and takes the proof.
            let event = match machine.next() {
                Action::Done => break,
                Action::Transact { start: from, end } => {
                    self.on_transact(deliveries, from..end, start, connection, cancel)
                        .await
                }
                Action::TwoPhase { index } => {
                    self.on_two_phase(&deliveries[index], index, start, connection, cancel)
                        .await
                }
                Action::DeadLetter {
                    index,
                    reason,
                    error,
                    attempts,
                } => {
                    let delivery = &mut deliveries[index];
                    delivery.attempts = attempts;
                    self.on_dead_letter(delivery, reason, error, start, connection, cancel)
                        .await
                }
                Action::Park { index } => {
                    self.on_park(&mut deliveries[index], start, connection, cancel)
                        .await
                }
                Action::Defer {
                    index,
                    attempts,
                    error,
                } => {
                    let delivery = &mut deliveries[index];
                    delivery.attempts = attempts;
                    self.on_defer(delivery, &error, start, connection, cancel)
                        .await
                }
                Action::Wait { index, wait } => {
                    let reason = machine.retry_reason().unwrap_or_default();
                    self.on_wait(
                        &mut deliveries[index],
                        wait,
                        &reason,
                        start,
                        connection,
                        cancel,
                    )
                    .await
                }
            };
            // None: stop here (cancelled, or the batch may not take effect).
            let Some(event) = event else { break };
            machine.on(event);
        }
        for (i, delivery) in deliveries.iter_mut().enumerate() {
            delivery.attempts = machine.attempts(i);
        }
        // A batch left for a release's bookkeeping was not handed back as committed: not finished.
        machine.finished()
    }

    /// [`Action::Transact`]: one step transaction over `deliveries[range]`.
    async fn on_transact(
        &self,
        deliveries: &[Delivery],
        range: std::ops::Range<usize>,
        start: &mut PendingStart,
        connection: &mut WorkerConnection,
        cancel: &CancellationToken,
    ) -> Option<Event> {
        let (from, len) = (range.start, range.len());
        let batch = &deliveries[range];
        Some(match self.transact(batch, start, connection).await {
            Ok(outcomes) => {
                self.finish_batch(batch, &outcomes);
                if Self::advances_holds(batch)
                    && !self
                        .advance_holds(batch, &connection.release(), cancel)
                        .await
                {
                    return None;
                }
                Event::Committed
            }
            Err(BatchError::Item { index, failure }) => Event::ItemFailed {
                index: from + index,
                fault: fault_of(&failure),
            },
            Err(BatchError::Group) => Event::GroupFailed {
                fault: Fault::Transient("a handler call for several messages failed".into()),
            },
            Err(BatchError::Store(e)) => {
                if !e.is_connection_error() && len > 1 {
                    tracing::debug!(error = %e, messages = len, "a batch statement failed; narrowing down");
                }
                Event::GroupFailed {
                    fault: fault_of(&Failure::Store(e)),
                }
            }
            // The batch may not commit (see `guard::PendingStart`): nothing of it did.
            Err(BatchError::NotStarted) => return None,
        })
    }

    /// [`Action::TwoPhase`]: one attempt of the two-phase step of `delivery` (at `index`).
    async fn on_two_phase(
        &self,
        delivery: &Delivery,
        index: usize,
        start: &mut PendingStart,
        connection: &mut WorkerConnection,
        cancel: &CancellationToken,
    ) -> Option<Event> {
        let released = connection.release();
        let permit = start.permit().await?;
        Some(
            match self.two_phase_attempt(delivery, &permit, &released).await {
                Ok(outcome) => {
                    let one = std::slice::from_ref(delivery);
                    fast::after_commit(self.fast_path.as_ref(), one, &[outcome]);
                    self.finish(delivery, outcome);
                    if !self.advance_holds(one, &released, cancel).await {
                        return None;
                    }
                    Event::Committed
                }
                Err(failure) => Event::ItemFailed {
                    index,
                    fault: fault_of(&failure),
                },
            },
        )
    }

    /// [`Action::DeadLetter`]: `delivery` to the dead-letter topic, for `reason`.
    async fn on_dead_letter(
        &self,
        delivery: &mut Delivery,
        reason: DeadLetterReason,
        error: String,
        start: &mut PendingStart,
        connection: &mut WorkerConnection,
        cancel: &CancellationToken,
    ) -> Option<Event> {
        let released = connection.release();
        let permit = start.permit().await?;
        let error = if error.is_empty() {
            delivery.poison_text()
        } else {
            error
        };
        self.dead_letter(delivery, reason, error, &permit, &released, cancel)
            .await
            .then_some(Event::DeadLettered)
    }

    /// [`Action::Park`]: `delivery` parked behind its key's queue (by the batch's own hold, a dead letter
    /// or a parked message before it, or by the hold gate): a refusal of it is no head and joins no queue.
    async fn on_park(
        &self,
        delivery: &mut Delivery,
        start: &mut PendingStart,
        connection: &mut WorkerConnection,
        cancel: &CancellationToken,
    ) -> Option<Event> {
        let released = connection.release();
        let _permit = start.permit().await?;
        delivery.hold = Role::Park;
        Some(match self.park(delivery, &released, cancel).await? {
            Ok(ParkDecision::Append | ParkDecision::Create) => {
                self.finish(delivery, ItemOutcome::Parked);
                Event::Parked
            }
            Ok(ParkDecision::NotHeld) => {
                delivery.hold = Role::Free;
                Event::NotHeld {
                    kind: delivery.unheld_kind(),
                }
            }
            Ok(ParkDecision::Full(cap)) => Event::ParkRefused {
                reason: DeadLetterReason::HoldQueueFull,
                error: cap.to_string(),
            },
            Err(error) => Event::ParkRefused {
                reason: DeadLetterReason::StoreRefused,
                error,
            },
        })
    }

    /// [`Action::Defer`]: `delivery`, failed transiently with `error`, parked to wait for its next attempt
    /// (the retry policy's backoff, with its jitter), its key held meanwhile; retried where it stands when
    /// it cannot wait parked (see `hold::decide_defer`) or the database refuses it for good (a key too large
    /// for the held keys' index).
    async fn on_defer(
        &self,
        delivery: &mut Delivery,
        error: &str,
        start: &mut PendingStart,
        connection: &mut WorkerConnection,
        cancel: &CancellationToken,
    ) -> Option<Event> {
        let released = connection.release();
        let _permit = start.permit().await?;
        // What a TEXT column takes: no NUL, and a bounded length.
        let error: String = error.replace('\0', "").chars().take(2_000).collect();
        let retry = DelayedRetry {
            attempts: i32::try_from(delivery.attempts).unwrap_or(i32::MAX),
            wait: self.retry.wait_after(delivery.attempts),
            error: &error,
        };
        let parked: &Delivery = delivery;
        let deferred = with_budget(
            "parking it for its delayed retry",
            &self.budget(),
            cancel,
            &released,
            |mut conn| async move {
                let deferred = self
                    .holds
                    .defer(
                        &mut conn,
                        &parked.raw,
                        parked.original(),
                        parked.step_name(),
                        &parked.hold,
                        &retry,
                    )
                    .await;
                (conn, deferred)
            },
        )
        .await;
        Some(match deferred {
            Tried::Done(DeferDecision::Refused) => Event::DeferRefused,
            Tried::Done(_) => {
                let step = delivery.step_name().unwrap_or_default().to_owned();
                self.metrics.retries.get_or_create(&StepOnly { step }).inc();
                tracing::warn!(
                    parent: &delivery.span,
                    attempt = delivery.attempts,
                    error = %error,
                    wait = ?retry.wait,
                    "transient failure; parked for a delayed retry, its key held meanwhile"
                );
                self.finish(delivery, ItemOutcome::Deferred);
                Event::Deferred
            }
            Tried::Refused(refused) => {
                tracing::warn!(
                    parent: &delivery.span,
                    error = %refused,
                    "the database refuses to park this message for its delayed retry; retried where it stands"
                );
                Event::DeferRefused
            }
            Tried::Cancelled => return None,
        })
    }

    /// [`Action::Wait`]: the wait before `delivery`'s next attempt.
    async fn on_wait(
        &self,
        delivery: &mut Delivery,
        wait: Wait,
        reason: &str,
        start: &mut PendingStart,
        connection: &mut WorkerConnection,
        cancel: &CancellationToken,
    ) -> Option<Event> {
        let released = connection.release();
        // A retry may commit: not before the batch's start is recorded.
        start.permit().await?;
        self.wait(delivery, wait, reason, &released, cancel)
            .await
            .then_some(Event::Waited)
    }

    /// Whether `delivery`'s order policy holds its key behind a dead letter of it.
    pub(crate) fn policy_holds(&self, delivery: &Delivery) -> bool {
        self.holds
            .policy(delivery.step_name(), &delivery.original().topic)
            == OrderPolicy::HoldKey
    }

    /// Whether a batch of `deliveries` reads its keys' holds first: something may be held (see
    /// `Holds::active`), or a message came from the retry topic (a release or a replay is always read
    /// against its key).
    pub(crate) fn must_read_holds(&self, deliveries: &[Delivery]) -> bool {
        // With delayed retries a key is held as its message fails: read at once, not when a census says so.
        self.retry.delayed
            || self.holds.is_active()
            || deliveries.iter().any(|d| d.replayed_from.is_some())
    }

    /// The budget of the framework's own statements about a message (see `db_retry`).
    pub(crate) fn budget(&self) -> Budget<'_> {
        Budget {
            pool: &self.pool,
            retry: &self.retry,
            unreachable: &self.metrics.database_unreachable,
            stopper: &self.stopper,
        }
    }

    /// Parks `delivery` (see `hold::Holds::park`): `Some(Ok(decision))`, or `Some(Err(reason))` when the
    /// database refuses it for good (a key too large for the index, a header it cannot store); `None` if
    /// cancelled first.
    async fn park(
        &self,
        delivery: &Delivery,
        released: &Released<'_>,
        cancel: &CancellationToken,
    ) -> Option<Result<ParkDecision, String>> {
        let parked = with_budget(
            "parking it behind its held key",
            &self.budget(),
            cancel,
            released,
            |mut conn| async move {
                let parked = self
                    .holds
                    .park(
                        &mut conn,
                        &delivery.raw,
                        delivery.original(),
                        delivery.step_name(),
                    )
                    .await;
                (conn, parked)
            },
        )
        .await;
        match parked {
            Tried::Done(decision) => Some(Ok(decision)),
            Tried::Refused(error) => Some(Err(error)),
            Tried::Cancelled => None,
        }
    }

    /// Records, for each of `batch` that is a held key's head or release, that it is finished (see
    /// `hold::advance`), waiting out an unavailable database. A record refused for good is logged: the
    /// message took effect, and its key stays listed by `saga keys held` for an operator. `false` if
    /// `cancel` fired before all were recorded: the batch must not be counted finished (its messages come
    /// back, find their step keys done, and record it then).
    async fn advance_holds(
        &self,
        batch: &[Delivery],
        released: &Released<'_>,
        cancel: &CancellationToken,
    ) -> bool {
        for delivery in batch {
            if !matches!(delivery.hold, Role::Head(_) | Role::Release(_)) {
                continue;
            }
            let by = match delivery.raw.headers.get_str(saga_runtime::replay::OPERATOR) {
                Ok(Some(operator)) => format!("replay by {operator}"),
                _ => "replay".to_owned(),
            };
            let advanced = with_budget(
                "recording its held key's release",
                &self.budget(),
                cancel,
                released,
                |mut conn| {
                    let by = &by;
                    async move {
                        let advanced = self
                            .holds
                            .advance(&mut conn, &delivery.raw, &delivery.hold, by)
                            .await;
                        (conn, advanced)
                    }
                },
            )
            .await;
            match advanced {
                Tried::Done(done) => {
                    tracing::info!(parent: &delivery.span, ?done, "held key advanced")
                }
                Tried::Refused(error) => {
                    tracing::error!(parent: &delivery.span, error = %error, "its held key's release cannot be recorded: see `saga keys held`");
                }
                Tried::Cancelled => return false,
            }
        }
        true
    }

    /// Whether `batch` holds a held key's head or release, whose finish is recorded after its commit.
    fn advances_holds(batch: &[Delivery]) -> bool {
        batch
            .iter()
            .any(|d| matches!(d.hold, Role::Head(_) | Role::Release(_)))
    }

    /// Dead-letters the first message of a batch alone, as its start's record says: the consumer died on
    /// it `deaths` times (`crash-loop`), or the record was refused for good (`store-refused`).
    pub(crate) async fn dead_letter_alone(
        &self,
        delivery: &mut Delivery,
        why: Alone,
        permit: &CommitPermit,
        released: &Released<'_>,
        cancel: &CancellationToken,
    ) -> bool {
        // Its part in its key's hold first, as the hold gate reads it: a message of a held key is parked (it
        // never runs), a stale release copy is finished, and a head's or release's letter is the new head.
        let alone = std::slice::from_mut(delivery);
        if self.must_read_holds(alone) {
            let Some(found) = self.read_batch_holds(alone, released, cancel).await else {
                return false;
            };
            self.apply_plan(alone, Some(&found));
        }
        match delivery.hold {
            Role::Stale => {
                self.finish(delivery, ItemOutcome::Duplicate);
                return true;
            }
            Role::Park => match self.park(delivery, released, cancel).await {
                Some(Ok(ParkDecision::Append | ParkDecision::Create)) => {
                    self.finish(delivery, ItemOutcome::Parked);
                    return true;
                }
                Some(Ok(ParkDecision::NotHeld)) => delivery.hold = Role::Free,
                Some(Ok(ParkDecision::Full(_)) | Err(_)) => {}
                None => return false,
            },
            Role::Free | Role::Head(_) | Role::Release(_) => {}
        }
        let (reason, error) = match why {
            Alone::CrashLoop(deaths) => {
                delivery.attempts = deaths;
                (
                    DeadLetterReason::CrashLoop,
                    format!("the consumer died {deaths} times while processing this message"),
                )
            }
        };
        self.dead_letter(delivery, reason, error, permit, released, cancel)
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
                let wait = crate::db_retry::unavailable_backoff().wait_after(times);
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
    /// with a check of each key ([`Checked`]), if the first claimed the keys as new ([`AsNew`]) and one
    /// existed.
    async fn transact(
        &self,
        batch: &[Delivery],
        start: &mut PendingStart,
        connection: &mut WorkerConnection,
    ) -> Result<Vec<ItemOutcome>, BatchError> {
        if connection.claim_kind() == ClaimKind::New {
            match self
                .transact_once::<AsNew>(batch, start, connection)
                .await?
            {
                Ok(outcomes) => return Ok(outcomes),
                Err(KeysExist) => {
                    self.metrics.claims_rerun.inc();
                }
            }
        }
        let checked = self
            .transact_once::<Checked>(batch, start, connection)
            .await?;
        Ok(checked.unwrap_or_else(|never| match never {}))
    }

    /// [`Self::transact`]'s transaction, claiming as `C` says; `Ok(Err(rerun))`: it must run again (nothing
    /// of it took effect).
    async fn transact_once<C: ClaimWay>(
        &self,
        batch: &[Delivery],
        start: &mut PendingStart,
        connection: &mut WorkerConnection,
    ) -> Result<Result<Vec<ItemOutcome>, C::Rerun>, BatchError> {
        if batch.iter().all(Delivery::needs_no_claim) {
            if start.permit().await.is_none() {
                return Err(BatchError::NotStarted);
            }
            // Nothing to claim or handle: no transaction.
            return Ok(Ok(batch
                .iter()
                .map(|d| {
                    if d.known_done {
                        ItemOutcome::Duplicate
                    } else {
                        ItemOutcome::Ignored
                    }
                })
                .collect()));
        }
        let phases = &self.metrics.phases;
        let began = Instant::now();
        // An outbox that may not be written (its WAL slot lost): nothing commits, the batch waits intact.
        step_tx::writable(&self.outbox).map_err(BatchError::Store)?;
        let mut lent = connection.lend(&self.pool).await?;
        let mut tx = StepTx::begin(&self.outbox, lent.begin())
            .await
            .map_err(BatchError::Store)?;
        observe_since(&phases.begin, began);
        let run = match dedup::run_batch::<C>(&*self.service, &mut tx, batch, &self.metrics).await {
            Ok(Ok(run)) => run,
            Ok(Err(rerun)) => {
                // Nothing but the claim ran: the batch runs again at once, checking each key.
                let rolled_back = tx.roll_back().await;
                lent.claimed(true);
                if let Some(settled) = rolled_back {
                    lent.keep(settled);
                }
                return Ok(Err(rerun));
            }
            Err(e) => {
                let _ = tx.roll_back().await;
                if e.is_database_unavailable() {
                    lent.discard();
                }
                return Err(e);
            }
        };
        let recording = Instant::now();
        let Some(permit) = start.permit().await else {
            let _ = tx.roll_back().await;
            return Err(BatchError::NotStarted);
        };
        observe_since(&phases.guard, recording);
        let committing = Instant::now();
        let settled = match tx.commit(&permit).await {
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
        Ok(Ok(run.outcomes))
    }

    /// Tells the commit hooks (fault injection) that `batch` committed.
    pub(crate) fn after_commit(&self, batch: &[Delivery]) {
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

    /// Produces `delivery` to the dead-letter topic. Returns whether it was acknowledged (`false`:
    /// cancelled first).
    async fn dead_letter(
        &self,
        delivery: &mut Delivery,
        reason: DeadLetterReason,
        error: String,
        _permit: &CommitPermit,
        released: &Released<'_>,
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
        // Indexed before the offset may move, with what it does to its key's hold (a head or a release that
        // fails for good is the key's new head whatever the policy, but a delayed retry's spent message
        // under a policy that holds nothing: see `hold::on_dead_letter`): the toolkit finds the letter
        // without reading the topic, and a held key's later messages are parked.
        let holds = self.policy_holds(delivery);
        if !self
            .index_dead_letter(&indexed, Some((&*delivery, holds)), released, cancel)
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

    /// Records `letter` in the schema's dead-letter index, with what it does to its key's hold, waiting out
    /// an unavailable database; `false` if `cancel` fires first (the message is not committed, and comes
    /// back). What the database refuses for good (a schema without the index, a key too large for the held
    /// keys' index, a value a column refuses) must not stop a partition: the letter is in its topic, so
    /// first its index goes (its hold is recorded without it), then, refused again, its hold (the letter is
    /// indexed without it).
    async fn index_dead_letter(
        &self,
        letter: &letters::IndexedLetter,
        hold: Option<(&Delivery, bool)>,
        released: &Released<'_>,
        cancel: &CancellationToken,
    ) -> bool {
        let attempts = match hold {
            Some(_) => &[(true, hold), (false, hold), (true, None)][..],
            None => &[(true, None)][..],
        };
        for &(index, hold) in attempts {
            let recorded = with_budget(
                "indexing its dead letter",
                &self.budget(),
                cancel,
                released,
                |mut conn| async move {
                    let recorded = self
                        .record_dead_letter(&mut conn, letter, hold, index)
                        .await;
                    (conn, recorded)
                },
            )
            .await;
            match recorded {
                Tried::Done(()) => return true,
                Tried::Cancelled => return false,
                Tried::Refused(error) => {
                    let refused = match (index, hold) {
                        (true, Some(_)) => {
                            "the dead-letter index refuses this letter with its hold; its hold is recorded \
                             alone"
                        }
                        (false, _) => {
                            "the held keys' tables refuse this message: its key is not held, and its \
                             letter is indexed alone"
                        }
                        (true, None) => {
                            "the dead-letter index refuses this letter; it stays in its topic, unindexed \
                             (the toolkit indexes what it finds there)"
                        }
                    };
                    tracing::error!(
                        dlq = %letter.dlq_topic,
                        partition = letter.partition,
                        offset = letter.offset,
                        error = %error,
                        "{refused}"
                    );
                }
            }
        }
        true
    }

    /// One transaction on `conn`: what `letter` does to its key's hold (`hold`: its message, and whether
    /// its policy holds keys), and, if `index`, its row in the dead-letter index.
    async fn record_dead_letter(
        &self,
        conn: &mut sqlx::PgConnection,
        letter: &letters::IndexedLetter,
        hold: Option<(&Delivery, bool)>,
        index: bool,
    ) -> Result<(), sqlx::Error> {
        let mut tx = sqlx::Connection::begin(conn).await?;
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

/// Closes `conn` when it is returned instead of giving it back to the pool, if `error` says the database is
/// unavailable: a connection left on a server that shuts down, or that a switchover made read-only, would
/// fail every transaction it is given.
pub(crate) fn discard_if_unavailable(conn: &mut PoolConnection<Postgres>, error: &sqlx::Error) {
    if StepError::is_connection_error(error) {
        conn.close_on_drop();
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
