//! A two-phase step's attempt: the lease (its own transaction, with the key-retention horizon for an old
//! message), the external call outside any transaction, bounded by the lease, and the completion in the
//! step transaction (`step_tx`), fenced by the lease's attempt number so that a worker whose lease was taken
//! over cannot complete (invariant 6).

use std::panic::AssertUnwindSafe;
use std::time::Instant;

use futures::FutureExt;
use saga_core::StepError;
use saga_runtime::store::idempotency::{self, Lease, LeaseClaim, StoreError};
use sqlx::Postgres;
use sqlx::pool::PoolConnection;
use tracing::Instrument;

use crate::connection::Released;
use crate::dedup::{Failure, ItemOutcome};
use crate::delivery::{Delivery, Route};
use crate::executor::Executor;
use crate::guard::CommitPermit;
use crate::handler::{Decoded, ErasedTwoPhaseStep, StepMode};
use crate::metrics::StepOnly;
use crate::service::{HandlerPanicked, HandlerTimedOut, StepItem, StepRequest};
use crate::step_tx::{self, KeyMayBeGone, LeaseClaimed, Outcomes, StepTx};

/// The connections of a two-phase attempt: the lease's, and the completing transaction's.
#[derive(Default)]
struct Connections {
    lease: Option<PoolConnection<Postgres>>,
    completing: Option<PoolConnection<Postgres>>,
}

/// A message the worker's decisions sent to a two-phase attempt though it is `what`: the framework's
/// mistake, dead-lettered with the reason rather than a panic of the partition's worker.
fn misrouted(what: &str) -> Failure {
    Failure::Handler(StepError::permanent(std::io::Error::other(format!(
        "the framework ran {what} as a two-phase step"
    ))))
}

impl Executor {
    /// One attempt of a two-phase step: lease, external call, completing transaction. The connections it
    /// took are closed instead of given back if the database turned out unavailable.
    pub(crate) async fn two_phase_attempt(
        &self,
        delivery: &Delivery,
        permit: &CommitPermit,
        _released: &Released<'_>,
    ) -> Result<ItemOutcome, Failure> {
        // Not even the external call while the outbox may not be written: its completion could not commit.
        step_tx::writable(&self.outbox).map_err(Failure::Store)?;
        let mut held = Connections::default();
        let attempt = self.two_phase_on(delivery, permit, &mut held).await;
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
    async fn two_phase_on(
        &self,
        delivery: &Delivery,
        permit: &CommitPermit,
        held: &mut Connections,
    ) -> Result<ItemOutcome, Failure> {
        let Route::Step {
            step,
            decoded,
            step_key,
            tenant,
        } = &delivery.route
        else {
            return Err(misrouted("a message routed to no step"));
        };
        let StepMode::TwoPhase(two_phase) = &step.mode else {
            return Err(misrouted("a transactional step"));
        };
        let store = |e: sqlx::Error| Failure::Store(StoreError::Database(e));
        let conn = held.lease.insert(self.pool.acquire().await.map_err(store)?);
        let claimed = step_tx::claim_lease(
            &mut *conn,
            tenant,
            step_key,
            two_phase.lease(),
            &self.lease_holder,
            delivery.raw.timestamp_ms,
        )
        .await
        .map_err(Failure::Store)?;
        let lease = match claimed {
            LeaseClaimed::Claim(LeaseClaim::Acquired(lease)) => lease,
            LeaseClaimed::Claim(LeaseClaim::Duplicate(_)) => return Ok(ItemOutcome::Duplicate),
            LeaseClaimed::Claim(LeaseClaim::Busy { until }) => return Err(Failure::Busy(until)),
            LeaseClaimed::MayBeGone(t) => {
                return Err(Failure::Handler(KeyMayBeGone::failure(t)));
            }
        };
        // The lease is a row of its own, committed: no connection is held through the call (a worker waiting
        // on the outside world holds none, however many keys wait at once), nor two at once.
        held.lease = None;
        let response = match call(&**two_phase, delivery, decoded).await {
            Ok(response) => response,
            Err(error) => {
                match self.pool.acquire().await {
                    Ok(mut conn) => release(&mut conn, &lease, &error).await,
                    Err(e) => {
                        tracing::warn!(error = %e, "could not release a lease; it expires on its own");
                    }
                }
                return Err(Failure::Handler(error));
            }
        };
        let completing = held
            .completing
            .insert(self.pool.acquire().await.map_err(store)?);
        let completed = self
            .complete(delivery, &lease, response, completing, permit)
            .await;
        if let Err(Failure::Handler(error)) = &completed {
            release(completing, &lease, error).await;
        }
        completed
    }

    /// Phase three: the step transaction, fenced by the lease's attempt number, in which the handler
    /// completes the step with the external call's `response`.
    async fn complete(
        &self,
        delivery: &Delivery,
        lease: &Lease,
        response: Box<dyn std::any::Any + Send>,
        conn: &mut PoolConnection<Postgres>,
        permit: &CommitPermit,
    ) -> Result<ItemOutcome, Failure> {
        let Route::Step {
            step,
            decoded,
            tenant,
            ..
        } = &delivery.route
        else {
            return Err(misrouted("a message routed to no step"));
        };
        let mut tx = StepTx::begin(&self.outbox, sqlx::Connection::begin(&mut **conn))
            .await
            .map_err(Failure::Store)?;
        if !tx.claim_lease(lease).await.map_err(Failure::Store)? {
            return Ok(ItemOutcome::Superseded);
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
                conn: tx.conn(),
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
                // Rolled back before the lease is released: the transaction holds the lease's row lock.
                let _ = tx.roll_back().await;
                return Err(Failure::Handler(error));
            }
        };
        let Some(outcome) = handled.outcomes.into_iter().next() else {
            let _ = tx.roll_back().await;
            return Err(Failure::Handler(StepError::permanent(
                "the handler returned no outcome",
            )));
        };
        tx.record(Outcomes::Lease(lease, &outcome), &handled.emitted)
            .await
            .map_err(Failure::Store)?;
        tx.commit(permit)
            .await
            .map_err(|e| Failure::Store(StoreError::Database(e)))?;
        self.after_commit(std::slice::from_ref(delivery));
        Ok(ItemOutcome::of(&outcome))
    }
}

/// Phase two: the external call, outside any transaction, bounded by the lease; a timeout is transient, a
/// panic permanent.
async fn call(
    two_phase: &dyn ErasedTwoPhaseStep,
    delivery: &Delivery,
    decoded: &Decoded,
) -> Result<Box<dyn std::any::Any + Send>, StepError> {
    let outcome = AssertUnwindSafe(tokio::time::timeout(
        two_phase.lease(),
        two_phase.call(decoded),
    ))
    .catch_unwind()
    .instrument(delivery.span.clone())
    .await;
    match outcome {
        Ok(Ok(result)) => result,
        Ok(Err(_)) => Err(StepError::transient(HandlerTimedOut(two_phase.lease()))),
        Err(_) => Err(StepError::permanent(HandlerPanicked(
            "the external call of a two-phase step panicked".into(),
        ))),
    }
}

/// Gives up a two-phase lease after a failure, so that the retry can take it over at once.
async fn release(conn: &mut sqlx::PgConnection, lease: &Lease, error: &StepError) {
    if let Err(e) = idempotency::release_lease(conn, lease, &error.to_string()).await {
        tracing::warn!(error = %e, "could not release a lease; it expires on its own");
    }
}
