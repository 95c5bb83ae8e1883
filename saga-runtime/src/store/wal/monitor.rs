//! The process's watch over its WAL outbox's slot: one statement every couple of seconds, shared by every
//! writer of the process through its [`OutboxHealth`] (an atomic read per transaction, no query).
//!
//! When the slot is lost (`wal_status = 'lost'`: it fell behind `max_slot_wal_keep_size`) or gone (dropped,
//! a failover to a replica, a restore), a transaction that commits events now commits them to a log nobody
//! will read: the step's key says done, its events are never published. So from the first check that finds
//! it so, the outbox is unwritable: writers refuse (the consumer waits, as for an unavailable database;
//! HTTP entry points answer 503), readiness fails, `saga_outbox_writable` drops to 0, and the schema
//! records the loss (`lost_at`), which only `saga outbox wal recover` clears.

use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::task::JoinHandle;

use super::slot::{self, SlotState};
use crate::store::outbox::OutboxHealth;

/// How often the slot is checked by default.
pub const DEFAULT_CHECK_INTERVAL: Duration = Duration::from_secs(2);

/// The longest one check may take, the connection's acquisition included. Past it the connection is
/// dropped and the outbox is unwritable until a check answers: a connection whose peer vanished without a
/// reset (an unplanned failover) would otherwise block the check for the kernel's retransmission timeout,
/// about 15 minutes, while writers commit events to a log nobody may read.
pub const CHECK_DEADLINE: Duration = Duration::from_secs(5);

/// What makes the outbox unwritable in `state`, for `slot`; `None` when it is usable.
fn problem(state: &SlotState, slot: &str) -> Option<String> {
    let why = match state {
        SlotState::Healthy => return None,
        SlotState::Unrecorded => {
            "is no longer recorded by the schema (its WAL outbox was taken down)"
        }
        SlotState::Gone => "is gone (dropped, a failover or a restore)",
        SlotState::Lost => {
            "is lost (it fell behind max_slot_wal_keep_size, or was found lost before)"
        }
    };
    Some(format!(
        "the WAL outbox's slot {slot} {why}: events committed now would never be published; \
         run `saga outbox wal recover`"
    ))
}

/// Checks the current schema's slot once and sets `health` from it (writable again once it is healthy,
/// whatever stopped the writers before); records a loss in the schema. A database error leaves `health`
/// as it was; [`spawn`] stops the writers once no check has answered for its deadline.
pub async fn check(
    conn: &mut sqlx::PgConnection,
    slot: &str,
    health: &OutboxHealth,
) -> Result<(), sqlx::Error> {
    // Marked in one statement that sees a recovery committing meanwhile; then read.
    slot::mark_lost(conn).await?;
    let state = slot::state(conn).await?;
    let problem = problem(&state, slot);
    if health.set(problem.clone()) {
        match problem {
            Some(problem) => {
                tracing::error!(%slot, %problem, "the outbox is not writable: writers stop")
            }
            None => tracing::info!(%slot, "the WAL outbox's slot is usable again: writers go on"),
        }
    }
    Ok(())
}

/// Checks `slot` every `every` (see [`check`]) on a connection of its own, opened with the pool's options
/// but outside it (a busy pool must not delay it), each check within [`CHECK_DEADLINE`] (or `every`, if
/// longer), until the last clone of `health` is dropped. Once no check has answered for that long, whatever
/// the reason (a check that hangs, one the database refuses, a connection that cannot be opened), the
/// outbox is unwritable until one answers.
pub fn spawn(pool: PgPool, slot: String, health: &OutboxHealth, every: Duration) -> JoinHandle<()> {
    let weak = health.downgrade();
    let deadline = CHECK_DEADLINE.max(every);
    tokio::spawn(async move {
        let mut conn: Option<sqlx::PgConnection> = None;
        let mut answered = Instant::now();
        loop {
            tokio::time::sleep(every).await;
            let Some(health) = OutboxHealth::upgrade(&weak) else {
                if let Some(conn) = conn.take() {
                    sqlx::Connection::close(conn).await.ok();
                }
                return;
            };
            let checked = tokio::time::timeout(deadline, async {
                let c = match conn.as_mut() {
                    Some(c) => c,
                    None => conn.insert(
                        sqlx::ConnectOptions::connect(pool.connect_options().as_ref()).await?,
                    ),
                };
                check(c, &slot, &health).await
            })
            .await;
            let why = match checked {
                Ok(Ok(())) => {
                    answered = Instant::now();
                    continue;
                }
                Ok(Err(e)) => {
                    tracing::warn!(%slot, error = %e, "cannot check the WAL outbox's slot");
                    e.to_string()
                }
                Err(_) => format!("the database does not answer within {deadline:?}"),
            };
            // Dropped, not closed: a connection that does not answer would block its close too.
            conn = None;
            if answered.elapsed() >= deadline {
                let problem = format!(
                    "the WAL outbox's slot {slot} could not be checked for {:?} ({why}): writers stop until \
                     a check answers",
                    answered.elapsed()
                );
                if health.set(Some(problem)) {
                    tracing::error!(%slot, "the outbox is not writable: its slot cannot be checked");
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_healthy_slot_leaves_the_outbox_writable() {
        assert_eq!(problem(&SlotState::Healthy, "s"), None);
        for state in [SlotState::Unrecorded, SlotState::Gone, SlotState::Lost] {
            let problem = problem(&state, "s").unwrap();
            assert!(problem.contains("saga outbox wal recover"), "{problem}");
        }
    }
}
