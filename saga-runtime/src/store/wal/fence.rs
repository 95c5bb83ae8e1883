//! The switch from the table outbox to the log, schema-wide: no relay reads the slot before every row of
//! `saga_outbox` (of every shard, not only its own) is published and no writer in table mode is left, so a
//! key's rows in the table always go out before its events in the log.
//!
//! Both sides see the fence:
//!
//! - **Table-mode writers** say they are there: each process writing the table outbox holds a shared
//!   session lock of the schema ([`enter_table_mode`]) for as long as it runs, and refuses to start, or stops
//!   writing, once the schema has switched (a table row written after the switch would not be ordered with
//!   the log's events of its key).
//! - **Relays in WAL mode** read the slot only once [`may_read_slot`]: the schema switched before, or no
//!   such lock is held and no unpublished row is left ([`pass`], which records the switch, `switched_at`).
//!   Until then they go on publishing the table. Rows that a writer of an older version adds later are still
//!   published: a relay in WAL mode keeps publishing the table beside the log.

use sqlx::{Connection, PgConnection, PgPool};
use tokio::task::JoinHandle;

use crate::store::outbox::OutboxHealth;

/// The advisory lock class of a schema's table-mode writers (`SOWT`): each holds it shared.
const TABLE_WRITER_CLASS: i32 = 0x534F_5754;

/// What a relay in WAL mode sees of the schema before it reads the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FenceView {
    /// A relay passed the fence before (the schema's outbox is on the log).
    pub switched: bool,
    /// A process writing the table outbox is running.
    pub table_writers: bool,
    /// `saga_outbox` holds rows not yet published (parked rows aside, and the rows of their keys behind
    /// them: those keys wait in the WAL relay).
    pub unpublished_rows: bool,
}

/// Whether a relay may read the slot: see the module documentation.
pub fn may_read_slot(view: &FenceView) -> bool {
    view.switched || (!view.table_writers && !view.unpublished_rows)
}

/// Looks at the schema and, when [`may_read_slot`], records the switch, in one transaction holding the
/// schema's slot record: a table-mode writer entering meanwhile waits for it, then sees the switch.
pub async fn pass(conn: &mut PgConnection) -> Result<FenceView, sqlx::Error> {
    // Switched once, switched for good: no lock, no look at the table.
    let switched: Option<bool> =
        sqlx::query_scalar("SELECT switched_at IS NOT NULL FROM saga_outbox_wal_slot")
            .fetch_optional(&mut *conn)
            .await?;
    if switched == Some(true) {
        return Ok(FenceView {
            switched: true,
            table_writers: false,
            unpublished_rows: false,
        });
    }
    let mut tx = conn.begin().await?;
    let switched: Option<bool> =
        sqlx::query_scalar("SELECT switched_at IS NOT NULL FROM saga_outbox_wal_slot FOR UPDATE")
            .fetch_optional(&mut *tx)
            .await?;
    let (table_writers, unpublished_rows): (bool, bool) = sqlx::query_as(
        "SELECT EXISTS (SELECT 1 FROM pg_locks \
                        WHERE locktype = 'advisory' AND granted \
                          AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                          AND classid = $1::oid AND objid = hashtext(current_schema()::text)::oid \
                          AND objsubid = 2), \
                EXISTS (SELECT 1 FROM saga_outbox o WHERE published_at IS NULL AND parked_at IS NULL \
                          AND NOT EXISTS (SELECT 1 FROM saga_outbox p \
                                          WHERE p.parked_at IS NOT NULL AND p.published_at IS NULL \
                                            AND p.id < o.id AND p.topic = o.topic \
                                            AND p.partition_key IS NOT DISTINCT FROM o.partition_key))",
    )
    .bind(TABLE_WRITER_CLASS)
    .fetch_one(&mut *tx)
    .await?;
    let view = FenceView {
        switched: switched.unwrap_or(false),
        table_writers,
        unpublished_rows,
    };
    if !view.switched && may_read_slot(&view) {
        sqlx::query(
            "UPDATE saga_outbox_wal_slot SET switched_at = now() WHERE switched_at IS NULL",
        )
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(view)
}

/// Why a process may not write the table outbox.
#[derive(Debug, thiserror::Error)]
pub enum TableModeError {
    /// The schema's outbox moved to the write-ahead log.
    #[error(
        "the schema's outbox moved to the write-ahead log (a relay read its slot at {0}): table rows written \
         now would not be ordered with the log's events"
    )]
    Switched(String),
    /// The database failed.
    #[error("entering table mode: {0}")]
    Database(#[from] sqlx::Error),
}

/// Says, on `conn` (a session the process keeps for as long as it writes), that this process writes the
/// table outbox: a shared session lock relays in WAL mode wait for. Refuses (and lets go of the lock) when
/// the schema has switched to the log.
pub async fn enter_table_mode(conn: &mut PgConnection) -> Result<(), TableModeError> {
    sqlx::query("SELECT pg_advisory_lock_shared($1, hashtext(current_schema()::text))")
        .bind(TABLE_WRITER_CLASS)
        .execute(&mut *conn)
        .await?;
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('saga_outbox_wal_slot') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await?;
    let switched: Option<Option<String>> = if exists {
        // FOR SHARE waits for a relay passing the fence at this moment, then reads what it wrote.
        sqlx::query_scalar("SELECT switched_at::text FROM saga_outbox_wal_slot FOR SHARE")
            .fetch_optional(&mut *conn)
            .await?
    } else {
        None
    };
    if let Some(Some(at)) = switched {
        sqlx::query("SELECT pg_advisory_unlock_shared($1, hashtext(current_schema()::text))")
            .bind(TABLE_WRITER_CLASS)
            .execute(&mut *conn)
            .await?;
        return Err(TableModeError::Switched(at));
    }
    Ok(())
}

/// For a table write by a writer that holds no table-mode presence (an outbox never opened: an HTTP layer
/// or an orchestrator that was not given its service's outbox), in the writer's transaction: `Err(at)` when
/// the schema's outbox moved to the log. The switch is read `FOR SHARE` and held to the end of the
/// transaction, so a relay passing the fence at this moment waits for it, then sees its rows unpublished
/// and does not switch yet.
pub async fn check_unregistered_table_write(
    conn: &mut PgConnection,
) -> Result<Result<(), String>, sqlx::Error> {
    // A schema whose migrations predate the log outbox has no switch to read: it writes the table.
    let has_switch: bool =
        sqlx::query_scalar("SELECT to_regclass('saga_outbox_wal_slot') IS NOT NULL")
            .fetch_one(&mut *conn)
            .await?;
    if !has_switch {
        return Ok(Ok(()));
    }
    let switched: Option<Option<String>> =
        sqlx::query_scalar("SELECT switched_at::text FROM saga_outbox_wal_slot FOR SHARE")
            .fetch_optional(&mut *conn)
            .await?;
    Ok(match switched {
        Some(Some(at)) => Err(at),
        _ => Ok(()),
    })
}

/// Keeps the process's table-mode presence on `entered` (a connection [`enter_table_mode`] succeeded on),
/// entering again on a new one after it is lost, until the last clone of `health` is dropped. Should the
/// schema have switched meanwhile, the outbox becomes unwritable.
pub fn spawn_table_presence(
    pool: PgPool,
    entered: PgConnection,
    health: &OutboxHealth,
) -> JoinHandle<()> {
    let weak = health.downgrade();
    tokio::spawn(async move {
        let mut conn: Option<PgConnection> = Some(entered);
        loop {
            let Some(health) = OutboxHealth::upgrade(&weak) else {
                if let Some(conn) = conn.take() {
                    conn.close().await.ok();
                }
                return;
            };
            let alive = match conn.as_mut() {
                Some(c) => sqlx::query("SELECT 1").execute(c).await.is_ok(),
                None => false,
            };
            if !alive {
                conn = None;
                match pool.acquire().await {
                    Ok(c) => {
                        let mut c = c.detach();
                        match enter_table_mode(&mut c).await {
                            Ok(()) => conn = Some(c),
                            Err(TableModeError::Switched(at)) => {
                                let problem = format!(
                                    "this process writes the table outbox, but the schema's outbox moved to \
                                     the write-ahead log at {at}: restart it with SAGA_OUTBOX_MODE=wal"
                                );
                                if health.set(Some(problem.clone())) {
                                    tracing::error!(%problem, "the outbox is not writable: writers stop");
                                }
                            }
                            Err(e) => {
                                tracing::debug!(error = %e, "cannot enter table mode; retrying")
                            }
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "cannot enter table mode; retrying"),
                }
            }
            drop(health);
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slot_is_read_only_once_the_whole_table_is_published_and_no_table_writer_is_left() {
        let view = |switched, table_writers, unpublished_rows| FenceView {
            switched,
            table_writers,
            unpublished_rows,
        };
        assert!(may_read_slot(&view(false, false, false)));
        assert!(!may_read_slot(&view(false, true, false)));
        assert!(!may_read_slot(&view(false, false, true)));
        // Once switched, a late writer or row does not stop the log's readers (the row is still published).
        assert!(may_read_slot(&view(true, true, true)));
    }
}
