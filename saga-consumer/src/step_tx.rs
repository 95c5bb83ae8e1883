//! The one transaction in which a step takes effect, written once for every caller: a consumer's batch of
//! transactional steps (`dedup`), a two-phase step's completion (`two_phase`) and an HTTP request under the
//! `Idempotency-Key` layer (`http`).
//!
//! In order: the outbox's writable check (nothing runs while its events could not be published), BEGIN, the
//! claim (the batch's keys, the lease's fence, or the request's key) and, for messages old enough, the
//! key-retention horizon; the step's own statements on [`StepTx::conn`]; its outcomes and its events
//! ([`StepTx::record`]); COMMIT, for a worker only with its batch's `CommitPermit` (invariant 1), or a
//! ROLLBACK that is awaited, so that a retry does not wait for the claimed keys.

use std::convert::Infallible;

use saga_core::{OutboxMessage, StepError, StepKey, StepOutcome, TenantId};
use saga_runtime::store::idempotency::{
    self, Claim, Lease, LeaseClaim, NewClaims, StoreError, TryClaim,
};
use saga_runtime::store::outbox::Outbox;
use sqlx::{PgConnection, Postgres, Transaction};

use crate::connection::{self, Settled};
use crate::guard::CommitPermit;

/// The outbox's writable check: `Err(Unwritable)` when its events could not be published (a lost slot).
/// Checked before anything else of a step, a two-phase step's external call included.
pub(crate) fn writable(outbox: &Outbox) -> Result<(), StoreError> {
    outbox.check_writable().map_err(StoreError::from)
}

/// How a worker's next batch claims its keys (see `connection::WorkerConnection::claim_kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClaimKind {
    /// All keys are expected to be new: [`AsNew`].
    New,
    /// Each key is checked: [`Checked`].
    Checked,
}

/// A batch's claim of its keys, as a type: whether it may find a key that exists and must run again is
/// said by [`ClaimWay::Rerun`].
pub(crate) trait ClaimWay {
    /// What the claim answers instead of the keys' claims: [`KeysExist`] for [`AsNew`], nothing
    /// ([`Infallible`]) for [`Checked`].
    type Rerun: Send;

    /// Claims `keys`: the first statement of the transaction.
    fn claim<'t>(
        tx: &'t mut StepTx<'_>,
        keys: &'t [(TenantId, StepKey)],
    ) -> impl Future<Output = Result<Result<Vec<Claim>, Self::Rerun>, StoreError>> + Send + 't;
}

/// All keys are expected to be new: one plain `INSERT`. Should one exist, the claim answers
/// [`KeysExist`], and the transaction must be rolled back and run again [`Checked`].
pub(crate) struct AsNew;

/// Each key is checked: new, duplicate or leased.
pub(crate) struct Checked;

/// [`AsNew`] met an existing key: nothing else ran in the transaction.
#[derive(Debug)]
pub(crate) struct KeysExist;

impl ClaimWay for AsNew {
    type Rerun = KeysExist;

    async fn claim(
        tx: &mut StepTx<'_>,
        keys: &[(TenantId, StepKey)],
    ) -> Result<Result<Vec<Claim>, KeysExist>, StoreError> {
        Ok(
            match idempotency::claim_new_in_transaction(&mut tx.tx, keys).await? {
                NewClaims::Claimed => Ok(vec![Claim::New; keys.len()]),
                NewClaims::SomeExist => Err(KeysExist),
            },
        )
    }
}

impl ClaimWay for Checked {
    type Rerun = Infallible;

    async fn claim(
        tx: &mut StepTx<'_>,
        keys: &[(TenantId, StepKey)],
    ) -> Result<Result<Vec<Claim>, Infallible>, StoreError> {
        Ok(Ok(
            idempotency::claim_in_transaction(&mut tx.tx, keys).await?
        ))
    }
}

/// What a step records before its events.
#[derive(Debug)]
pub(crate) enum Outcomes<'a> {
    /// Each claimed key's outcome.
    Keys(&'a [(&'a TenantId, &'a StepKey, &'a StepOutcome)]),
    /// A two-phase step's lease, completed with its outcome.
    Lease(&'a Lease, &'a StepOutcome),
}

/// A step's open transaction (see the module documentation).
#[derive(Debug)]
pub(crate) struct StepTx<'c> {
    tx: Transaction<'c, Postgres>,
    outbox: Outbox,
}

impl<'c> StepTx<'c> {
    /// The writable check, then the transaction `begin` opens (the worker's kept connection's, a pool's).
    pub(crate) async fn begin(
        outbox: &Outbox,
        begin: impl Future<Output = Result<Transaction<'c, Postgres>, sqlx::Error>>,
    ) -> Result<Self, StoreError> {
        writable(outbox)?;
        Ok(Self {
            tx: begin.await?,
            outbox: outbox.clone(),
        })
    }

    /// Locks a two-phase step's lease, fenced by its attempt number: `false` when another worker took it
    /// over (it completes the step; nothing of this one may).
    pub(crate) async fn claim_lease(&mut self, lease: &Lease) -> Result<bool, StoreError> {
        match idempotency::lock_lease(&mut self.tx, lease).await {
            Ok(()) => Ok(true),
            Err(StoreError::Fenced { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Claims an HTTP request's key, under its advisory lock, with the request's fingerprint `hash`.
    pub(crate) async fn claim_request(
        &mut self,
        tenant: &TenantId,
        key: &StepKey,
        hash: &[u8],
    ) -> Result<TryClaim, StoreError> {
        idempotency::try_claim(&mut self.tx, tenant, key, hash).await
    }

    /// Of messages written at `times` (milliseconds since the epoch) whose keys were just claimed new, the
    /// first that may have had its key deleted by retention after its step ran (see [`KeyMayBeGone`]).
    pub(crate) async fn horizon(
        &mut self,
        times: &[Option<i64>],
    ) -> Result<Option<usize>, StoreError> {
        Ok(keys_maybe_gone(&mut self.tx, times).await?)
    }

    /// The open transaction, for the step's own statements.
    pub(crate) fn conn(&mut self) -> &mut PgConnection {
        &mut self.tx
    }

    /// The step's outcomes, then its events (the outbox's size limit, its refusal of what it cannot
    /// store, and the per-key locks that keep commit order).
    pub(crate) async fn record(
        &mut self,
        outcomes: Outcomes<'_>,
        emitted: &[OutboxMessage],
    ) -> Result<(), StoreError> {
        match outcomes {
            Outcomes::Keys(records) => idempotency::record_outcomes(&mut self.tx, records).await?,
            Outcomes::Lease(lease, outcome) => {
                idempotency::complete_lease(&mut self.tx, lease, outcome).await?;
            }
        }
        self.outbox.append(&mut self.tx, emitted).await?;
        Ok(())
    }

    /// COMMIT, for a partition worker: only with its batch's permit (invariant 1).
    pub(crate) async fn commit(self, permit: &CommitPermit) -> Result<Settled, sqlx::Error> {
        connection::commit(self.tx, permit).await
    }

    /// COMMIT, for an HTTP request (no crash-loop record guards a request).
    pub(crate) async fn commit_request(self) -> Result<(), sqlx::Error> {
        self.tx.commit().await
    }

    /// ROLLBACK now: a dropped transaction is rolled back only when its connection goes back to the pool,
    /// and until then its claimed keys (and their locks) hold up a retry. `None` if it failed.
    pub(crate) async fn roll_back(self) -> Option<Settled> {
        connection::rollback(self.tx).await
    }
}

/// What a two-phase step's lease claim found (its own transaction, before the external call).
#[derive(Debug)]
pub(crate) enum LeaseClaimed {
    /// The claim: acquired, a duplicate, or another worker's lease.
    Claim(LeaseClaim),
    /// A first lease on a key the message's age says may have been deleted after its step ran: rolled
    /// back, and the message is not run (see [`KeyMayBeGone`]).
    MayBeGone(i64),
}

/// Claims a two-phase step's lease on `conn`, as `holder`, for `lease`. A message written at `written_at`
/// old enough for retention to have deleted its key is claimed in a transaction that also reads how far
/// retention deleted: a first lease on such a key is rolled back, never left for a redelivery to take
/// over past the check.
pub(crate) async fn claim_lease(
    conn: &mut PgConnection,
    tenant: &TenantId,
    key: &StepKey,
    lease: std::time::Duration,
    holder: &str,
    written_at: Option<i64>,
) -> Result<LeaseClaimed, StoreError> {
    let Some(t) = written_at.filter(|t| old_enough(*t)) else {
        return Ok(LeaseClaimed::Claim(
            idempotency::claim_lease(conn, tenant, key, lease, holder).await?,
        ));
    };
    let mut tx = sqlx::Connection::begin(conn).await?;
    let claim = idempotency::claim_lease(&mut tx, tenant, key, lease, holder).await?;
    if let LeaseClaim::Acquired(acquired) = &claim
        && acquired.attempt == 1
        && keys_maybe_gone(&mut tx, &[Some(t)]).await?.is_some()
    {
        tx.rollback().await?;
        return Ok(LeaseClaimed::MayBeGone(t));
    }
    tx.commit().await?;
    Ok(LeaseClaimed::Claim(claim))
}

/// Which of the messages written at `times` (milliseconds since the epoch), whose step keys were just
/// claimed as new, may have had their key deleted by retention after their step ran, if any: the first. Only
/// messages older than [`MAY_BE_GONE_AFTER`](saga_runtime::store::gc::MAY_BE_GONE_AFTER) are looked at,
/// against the horizon retention has deleted up to (whatever the retention of the process that ran it).
/// A message without a timestamp is taken as new.
async fn keys_maybe_gone(
    conn: &mut PgConnection,
    times: &[Option<i64>],
) -> Result<Option<usize>, sqlx::Error> {
    let old: Vec<(usize, i64)> = times
        .iter()
        .enumerate()
        .filter_map(|(position, t)| t.filter(|t| old_enough(*t)).map(|t| (position, t)))
        .collect();
    if old.is_empty() {
        return Ok(None);
    }
    let stamps: Vec<i64> = old.iter().map(|(_, t)| *t).collect();
    let gone = saga_runtime::store::gc::keys_may_be_gone(conn, &stamps).await?;
    Ok(old
        .iter()
        .zip(gone)
        .find(|(_, gone)| *gone)
        .map(|((position, _), _)| *position))
}

/// Whether a message written at `t` (milliseconds since the epoch) is old enough for some process's
/// retention to have deleted its key: older than
/// [`MAY_BE_GONE_AFTER`](saga_runtime::store::gc::MAY_BE_GONE_AFTER).
fn old_enough(t: i64) -> bool {
    let oldest_safe = chrono::Utc::now().timestamp_millis()
        - i64::try_from(saga_runtime::store::gc::MAY_BE_GONE_AFTER.as_millis()).unwrap_or(i64::MAX);
    t < oldest_safe
}

/// Why a message whose key may have been deleted by retention is not run.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct KeyMayBeGone(String);

impl KeyMayBeGone {
    /// For a message written at `t` (milliseconds since the epoch).
    pub(crate) fn at(t: i64) -> Self {
        let at = chrono::DateTime::from_timestamp_millis(t).unwrap_or_default();
        Self(format!(
            "the message was written at {} and its step key is not in the store: older than what key \
             retention (SAGA_KEY_RETENTION_HOURS) has deleted, its key may have been deleted after its step \
             ran, so it is not run again; replay it if its step never ran",
            at.to_rfc3339()
        ))
    }

    /// As a step's permanent failure: the message is dead-lettered with it.
    pub(crate) fn failure(t: i64) -> StepError {
        StepError::permanent(Self::at(t))
    }
}
