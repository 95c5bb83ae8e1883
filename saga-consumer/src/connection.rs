//! A partition worker's database connection, kept from one transaction to the next while the worker has
//! more to do.
//!
//! Taking a connection from the pool costs a round trip: sqlx pings an idle connection before handing it
//! out (`test_before_acquire`, on by default). A worker running batch after batch keeps its connection
//! instead, and gives it back to the pool before anything else that could make it wait (see `partition`
//! and `executor`): its queue running dry, waiting for a slot or for an isolated message, recording a batch's
//! end, backing off before a retry, dead-lettering, a two-phase step, or a crash-loop record when the pool
//! has no idle connection left. So it never holds a connection it is not about to use, and workers keeping
//! connections cannot starve each other's other statements. A kept connection that turns out to be broken
//! when its next transaction begins is replaced with one from the pool at once.
//!
//! The worker also carries from one transaction to the next which claim to run (see `dedup`): the plain
//! claim of new keys while its batches hold none that exist, the checking claim after one did.

use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};

use crate::dedup::ClaimKind;

/// The connection a partition worker keeps between back-to-back transactions.
#[derive(Default)]
pub(crate) struct WorkerConnection {
    kept: Option<PoolConnection<Postgres>>,
    /// Whether the worker's last claim met keys that existed.
    met_existing_keys: bool,
}

impl WorkerConnection {
    /// A connection for the next transaction: the kept one (`true`: not tested since its last commit),
    /// or one from `pool`.
    pub(crate) async fn take(
        &mut self,
        pool: &PgPool,
    ) -> Result<(PoolConnection<Postgres>, bool), sqlx::Error> {
        match self.kept.take() {
            Some(conn) => Ok((conn, true)),
            None => Ok((pool.acquire().await?, false)),
        }
    }

    /// Keeps `conn`, whose transaction committed, for the worker's next transaction.
    pub(crate) fn keep(&mut self, conn: PoolConnection<Postgres>) {
        self.kept = Some(conn);
    }

    /// How the worker's next transaction claims its keys: as new, unless its last claim met existing ones.
    pub(crate) fn claim_kind(&self) -> ClaimKind {
        if self.met_existing_keys {
            ClaimKind::Checked
        } else {
            ClaimKind::New
        }
    }

    /// Notes whether the worker's last claim met keys that existed.
    pub(crate) fn claimed(&mut self, met_existing_keys: bool) {
        self.met_existing_keys = met_existing_keys;
    }

    /// Gives the kept connection back to the pool.
    pub(crate) fn release(&mut self) {
        self.kept = None;
    }

    /// Gives the kept connection back if `pool` has no idle connection and may open no more, so that a
    /// statement about to run beside the worker's next transaction finds one.
    pub(crate) fn make_room(&mut self, pool: &PgPool) {
        if pool.num_idle() == 0 && pool.size() >= pool.options().get_max_connections() {
            self.release();
        }
    }
}
