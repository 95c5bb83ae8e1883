//! Sharing the outbox between relay instances. The key space is cut into [`SHARDS`] shards (a row's shard
//! is computed from its partition key, so one key is always in one shard). An instance owns a shard while
//! it holds a session-level advisory lock on it; each instance also holds a membership lock, so every
//! instance can count the members and take its fair share. An instance that dies loses its session, its
//! locks with it, and the others take its shards over at their next rebalance.
//!
//! Ownership of a shard is exclusive, and an instance gives a shard up only between batches, after its
//! published rows are marked: so each key has one publisher at a time, which publishes in id order.

use std::collections::BTreeSet;

use sqlx::{PgConnection, Row};

/// The number of shards; fixed by the `shard` column of `saga_outbox`.
pub(crate) const SHARDS: i16 = 64;

/// This instance's shards.
#[derive(Debug)]
pub(crate) struct ShardOwner {
    instance: i32,
    classes: Option<(i32, i32)>,
    owned: BTreeSet<i16>,
}

/// What a rebalance changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Change {
    /// Members counted, this instance included.
    pub members: i64,
    /// Shards taken.
    pub acquired: Vec<i16>,
    /// Shards given up.
    pub released: Vec<i16>,
}

impl Default for ShardOwner {
    fn default() -> Self {
        Self::new()
    }
}

impl ShardOwner {
    /// An instance with a random id, owning nothing yet.
    pub(crate) fn new() -> Self {
        Self {
            instance: rand::random::<i32>() & i32::MAX,
            classes: None,
            owned: BTreeSet::new(),
        }
    }

    /// The shards owned, in order.
    pub(crate) fn owned(&self) -> Vec<i16> {
        self.owned.iter().copied().collect()
    }

    /// Joins the members of the outbox in `conn`'s schema (takes the membership lock). `conn` must stay
    /// this instance's dedicated session: the locks live and die with it.
    pub(crate) async fn join(&mut self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        let row = sqlx::query(
            "SELECT hashtext('saga-outbox-members/' || current_schema()) & 2147483647, \
                    hashtext('saga-outbox-shards/' || current_schema()) & 2147483647",
        )
        .fetch_one(&mut *conn)
        .await?;
        let classes: (i32, i32) = (row.try_get(0)?, row.try_get(1)?);
        loop {
            let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2)")
                .bind(classes.0)
                .bind(self.instance)
                .fetch_one(&mut *conn)
                .await?;
            if got {
                break;
            }
            // Another instance drew the same id.
            self.instance = rand::random::<i32>() & i32::MAX;
        }
        self.classes = Some(classes);
        self.owned.clear();
        Ok(())
    }

    /// Takes or gives up shards until this instance owns its fair share: the number of shards divided by the
    /// number of members, rounded up. Free shards are taken starting from a place that depends on the
    /// instance, so that instances starting together spread out.
    pub(crate) async fn rebalance(
        &mut self,
        conn: &mut PgConnection,
    ) -> Result<Change, sqlx::Error> {
        let (members_class, shards_class) = self.classes.expect("join() before rebalance()");
        let members: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks \
             WHERE locktype = 'advisory' AND granted AND objsubid = 2 AND classid = $1::int4::oid \
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .bind(members_class)
        .fetch_one(&mut *conn)
        .await?;
        let mut change = Change {
            members,
            ..Change::default()
        };
        match plan(&self.owned, members, self.instance, SHARDS) {
            Plan::Keep => {}
            Plan::Release(extra) => {
                release(conn, shards_class, &extra).await?;
                for s in &extra {
                    self.owned.remove(s);
                }
                change.released = extra;
            }
            Plan::Acquire { candidates, want } => {
                // Lazy evaluation: the lock function runs only until LIMIT rows matched (no sort in
                // between).
                let acquired: Vec<i16> = sqlx::query_scalar(
                    "SELECT shard FROM unnest($2::int2[]) AS c(shard) \
                     WHERE pg_try_advisory_lock($1, shard) LIMIT $3",
                )
                .bind(shards_class)
                .bind(&candidates)
                .bind(i64::try_from(want).unwrap_or(0))
                .fetch_all(&mut *conn)
                .await?;
                self.owned.extend(acquired.iter().copied());
                change.acquired = acquired;
            }
        }
        Ok(change)
    }

    /// Gives up every shard and leaves the members (for a graceful stop).
    pub(crate) async fn leave(&mut self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        if self.classes.is_some() {
            sqlx::query("SELECT pg_advisory_unlock_all()")
                .execute(conn)
                .await?;
        }
        self.forget();
        Ok(())
    }

    /// Forgets all ownership (the session is gone, and its locks with it).
    pub(crate) fn forget(&mut self) {
        self.owned.clear();
        self.classes = None;
    }
}

/// What a rebalance does, decided without I/O.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Plan {
    /// The instance owns its fair share.
    Keep,
    /// Give these up (the highest first).
    Release(Vec<i16>),
    /// Try to lock up to `want` of `candidates`, in order.
    Acquire {
        /// Shards the instance does not own, starting from a place that depends on the instance.
        candidates: Vec<i16>,
        /// How many more it should own.
        want: usize,
    },
}

/// The rebalance of an instance (`instance`) owning `owned` of `shards` shards among `members` members:
/// its fair share is the shards divided by the members, rounded up. Free shards are tried starting from a
/// place that depends on the instance, so that instances starting together spread out. The candidates
/// exclude the owned shards: a plan that locked an owned shard again would stack its session lock, and a
/// later release would leave it locked by an instance that no longer publishes it.
pub(crate) fn plan(owned: &BTreeSet<i16>, members: i64, instance: i32, shards: i16) -> Plan {
    let members = usize::try_from(members.max(1)).unwrap_or(1);
    let share = usize::from(shards.unsigned_abs()).div_ceil(members);
    if owned.len() > share {
        Plan::Release(
            owned
                .iter()
                .rev()
                .take(owned.len() - share)
                .copied()
                .collect(),
        )
    } else if owned.len() < share {
        let start = usize::try_from(instance % i32::from(shards)).unwrap_or(0);
        let candidates = (0..shards)
            .cycle()
            .skip(start)
            .take(usize::from(shards.unsigned_abs()))
            .filter(|s| !owned.contains(s))
            .collect();
        Plan::Acquire {
            candidates,
            want: share - owned.len(),
        }
    } else {
        Plan::Keep
    }
}

/// The shards of `shards_class` this session holds, from `pg_locks` (one row per lock, however often it
/// was taken).
async fn held(conn: &mut PgConnection, shards_class: i32) -> Result<Vec<i16>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT objid::int8::int2 FROM pg_locks \
         WHERE locktype = 'advisory' AND granted AND pid = pg_backend_pid() AND objsubid = 2 \
           AND classid = $1::int4::oid ORDER BY 1",
    )
    .bind(shards_class)
    .fetch_all(conn)
    .await
}

/// Releases `shards` completely: a session advisory lock taken n times needs n unlocks, so unlock until
/// `pg_locks` no longer lists it (unlocking a lock not held would only log a warning).
async fn release(
    conn: &mut PgConnection,
    shards_class: i32,
    shards: &[i16],
) -> Result<(), sqlx::Error> {
    let mut still: Vec<i16> = shards.to_vec();
    while !still.is_empty() {
        sqlx::query("SELECT pg_advisory_unlock($1, s) FROM unnest($2::int2[]) AS s")
            .bind(shards_class)
            .bind(&still)
            .execute(&mut *conn)
            .await?;
        let held = held(&mut *conn, shards_class).await?;
        still.retain(|s| held.contains(s));
    }
    Ok(())
}
