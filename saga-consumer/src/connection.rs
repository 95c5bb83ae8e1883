//! A partition worker's database connection, kept from one transaction to the next while the worker has
//! more to do.
//!
//! Taking a connection from the pool costs a round trip: sqlx pings an idle connection before handing it
//! out (`test_before_acquire`, on by default). A worker running batch after batch keeps its connection
//! instead. Two types make the rules hold by construction rather than by each call site:
//!
//! - **A kept connection serves only the worker's next transaction.** Whatever awaits something else (a
//!   backoff, a dead letter, a two-phase step, a crash-loop record, the process alone, a slot, the next
//!   message) takes a [`Released`], which [`WorkerConnection::release`] returns after giving the kept
//!   connection back to the pool and which borrows the [`WorkerConnection`] for as long as it lives: no
//!   connection can be kept while the worker waits elsewhere. So workers keeping connections cannot starve
//!   each other's other statements.
//! - **A connection is kept only after its transaction ended cleanly.** A transaction runs on a [`Lent`]
//!   connection (the kept one, or one from the pool); dropped, a lent connection goes back to the pool, or
//!   is closed if the database turned out unavailable ([`Lent::discard`]). Only [`Lent::keep`] keeps it,
//!   and it takes a [`Settled`], which only a commit (with the batch's `CommitPermit`) or a rollback that
//!   went through makes. A kept connection found broken when its next transaction begins is replaced with
//!   one from the pool at once.
//!
//! The worker also carries from one transaction to the next which claim to run (see `dedup`): the plain
//! claim of new keys while its batches hold none that exist, the checking claim after one did.

use std::marker::PhantomData;

use saga_core::StepError;
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres, Transaction};

use crate::guard::CommitPermit;
use crate::step_tx::ClaimKind;

/// The connection a partition worker keeps between back-to-back transactions.
#[derive(Default)]
pub(crate) struct WorkerConnection {
    kept: Option<PoolConnection<Postgres>>,
    /// Whether the worker's last claim met keys that existed.
    met_existing_keys: bool,
}

/// Proof that the worker keeps no connection, for as long as it lives (it borrows the worker's
/// [`WorkerConnection`]). Everything a worker awaits besides its next transaction takes one.
#[derive(Debug)]
pub(crate) struct Released<'w>(PhantomData<&'w mut WorkerConnection>);

/// Proof that a transaction ended cleanly (committed, or rolled back), so that its connection may serve
/// the next one.
#[derive(Debug)]
pub(crate) struct Settled(());

impl WorkerConnection {
    /// Gives the kept connection back to the pool; see [`Released`].
    pub(crate) fn release(&mut self) -> Released<'_> {
        self.kept = None;
        Released(PhantomData)
    }

    /// Gives the kept connection back if `pool` has no idle connection and may open no more, so that a
    /// statement about to run beside the worker's next transaction finds one.
    pub(crate) fn make_room(&mut self, pool: &PgPool) {
        if pool.num_idle() == 0 && pool.size() >= pool.options().get_max_connections() {
            self.kept = None;
        }
    }

    /// How the worker's next transaction claims its keys: as new, unless its last claim met existing ones.
    pub(crate) fn claim_kind(&self) -> ClaimKind {
        if self.met_existing_keys {
            ClaimKind::Checked
        } else {
            ClaimKind::New
        }
    }

    /// A connection for one transaction: the kept one, or one from `pool`.
    pub(crate) async fn lend<'w>(&'w mut self, pool: &'w PgPool) -> Result<Lent<'w>, sqlx::Error> {
        let (conn, was_kept) = match self.kept.take() {
            Some(conn) => (conn, true),
            None => (pool.acquire().await?, false),
        };
        Ok(Lent {
            worker: self,
            pool,
            conn,
            was_kept,
            replacement: None,
        })
    }
}

/// A connection lent for one transaction; see the module documentation.
pub(crate) struct Lent<'w> {
    worker: &'w mut WorkerConnection,
    pool: &'w PgPool,
    conn: PoolConnection<Postgres>,
    /// Whether `conn` is the kept one, not tested since its last commit.
    was_kept: bool,
    /// A connection from the pool that replaced `conn`, found broken at `BEGIN`.
    replacement: Option<PoolConnection<Postgres>>,
}

impl Lent<'_> {
    /// Begins the transaction. A kept connection that fails to begin broke since its last commit (the
    /// server restarted or ended it): the pool's ping would have caught that, so a tested one from the pool
    /// takes its place instead of the batch waiting out a lost database. Any other failed `BEGIN` is the
    /// caller's (a read-only server takes `BEGIN`: a failure there is a lost connection).
    pub(crate) async fn begin(&mut self) -> Result<Transaction<'_, Postgres>, sqlx::Error> {
        let Self {
            conn,
            was_kept,
            replacement,
            pool,
            ..
        } = self;
        match sqlx::Connection::begin(&mut **conn).await {
            Ok(tx) => Ok(tx),
            Err(e) if *was_kept => {
                tracing::debug!(error = %e, "a kept connection failed to begin; taking another");
                let fresh = replacement.insert(pool.acquire().await?);
                sqlx::Connection::begin(&mut **fresh).await
            }
            Err(e) => Err(e),
        }
    }

    /// Closes the connection when it is dropped instead of giving it back to the pool, if `error` says the
    /// database is unavailable: a connection left on a server that shuts down, or that a switchover made
    /// read-only, would fail every transaction it is given.
    pub(crate) fn discard_if_unavailable(&mut self, error: &sqlx::Error) {
        if StepError::is_connection_error(error) {
            self.discard();
        }
    }

    /// Closes the connection when it is dropped instead of giving it back to the pool.
    pub(crate) fn discard(&mut self) {
        self.replacement
            .as_mut()
            .unwrap_or(&mut self.conn)
            .close_on_drop();
    }

    /// Notes whether this transaction's claim met keys that existed (see
    /// [`WorkerConnection::claim_kind`]).
    pub(crate) fn claimed(&mut self, met_existing_keys: bool) {
        self.worker.met_existing_keys = met_existing_keys;
    }

    /// Keeps the connection for the worker's next transaction, now that this one ended cleanly. A kept
    /// connection replaced at `BEGIN` is closed.
    pub(crate) fn keep(self, _settled: Settled) {
        let Self {
            worker,
            mut conn,
            replacement,
            ..
        } = self;
        worker.kept = Some(match replacement {
            Some(fresh) => {
                conn.close_on_drop();
                fresh
            }
            None => conn,
        });
    }
}

/// Commits a worker's transaction: only with the permit of its batch's start record (see
/// [`CommitPermit`]). The one way a worker commits.
pub(crate) async fn commit(
    tx: Transaction<'_, Postgres>,
    _permit: &CommitPermit,
) -> Result<Settled, sqlx::Error> {
    tx.commit().await.map(|()| Settled(()))
}

/// Rolls a worker's transaction back now (a dropped one is rolled back only when its connection goes back
/// to the pool, and until then its claimed keys would hold up a retry). `None` if the rollback failed.
pub(crate) async fn rollback(tx: Transaction<'_, Postgres>) -> Option<Settled> {
    tx.rollback().await.ok().map(|()| Settled(()))
}
