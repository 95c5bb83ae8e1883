//! The replication slot of a schema's WAL outbox: its name, its set-up, what the schema records of it, and
//! its recovery after it was lost.
//!
//! - **Names.** Slots are cluster-wide; schemas are not. A slot is named after the database *and* the
//!   schema ([`slot_name`]), and every query about it is limited to `database = current_database()`: two
//!   services in two databases of one cluster, both on schema `public`, have two slots.
//! - **Record.** `saga_outbox_wal_slot` (one row per schema) holds the slot's name, when it was made, and
//!   how far its relay confirmed. A slot that was recorded and is gone (dropped, a failover to a replica,
//!   a restore) or lost (`wal_status = 'lost'`: it fell behind `max_slot_wal_keep_size`) is never made again
//!   silently: [`prepare`] refuses, the writers' monitor stops them, and [`recover`] (an operator's command)
//!   makes a new one and records what was lost.
//! - **Creation** runs under a session advisory lock of the schema, so that no process sees a slot while it
//!   is still being created (an ephemeral slot, which PostgreSQL drops if its creator fails): a process
//!   finding the lock taken waits until the creator is done.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use saga_config::ConfigProblem;
use sqlx::{Connection, PgConnection, PgPool};

use super::{PUBLICATION, prefix};

/// The advisory lock class under which a schema's slot is set up or recovered (`SOWS`).
const SLOT_LOCK_CLASS: i32 = 0x534F_5753;

/// How long [`prepare`] waits for a slot that another process is creating.
const SLOT_CREATION_WAIT: Duration = Duration::from_secs(120);

/// FNV-1a over `parts` (separated by a zero byte): stable across versions and processes.
fn fnv1a(parts: &[&str]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            // A zero byte between parts.
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        for b in part.bytes() {
            hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// `text` in lower-case letters, digits and `_`.
fn clean(text: &str) -> String {
    text.chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_lowercase() || c.is_ascii_digit() {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The replication slot of `schema`'s outbox in `database`: `saga_outbox_`, a readable part of both names
/// (shortened to fit), and a hash of the two exact names, at most 63 bytes of lower-case letters, digits
/// and `_`. The hash tells apart what the readable part cannot (`a_b` + `c` and `a` + `b_c`, case, names
/// too long to show whole).
pub fn slot_name(database: &str, schema: &str) -> String {
    let hash = fnv1a(&[database, schema]);
    let readable = format!("{}_{}", clean(database), clean(schema));
    // saga_outbox_ (12) + readable + _ (1) + 16 hex digits = at most 63.
    let keep = 63 - 12 - 1 - 16;
    let readable: String = readable.chars().take(keep).collect();
    format!("saga_outbox_{readable}_{hash:016x}")
}

/// The name 0.2 gave `schema`'s slot (from the schema alone): a slot of this name in the current database is
/// taken over by [`prepare`] when the schema has recorded none, so that an upgrade keeps what it holds.
pub fn legacy_slot_name(schema: &str) -> String {
    let cleaned = clean(schema);
    let name = format!("saga_outbox_{cleaned}");
    if name.len() <= 63 && cleaned == schema {
        return name;
    }
    let hash = fnv1a(&[schema]);
    let keep = 63 - 17;
    format!("{}_{hash:016x}", &name[..name.len().min(keep)])
}

/// What [`prepare`] set up: the slot and the prefix of a schema's outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalOutbox {
    /// The database.
    pub database: String,
    /// The schema.
    pub schema: String,
    /// Its replication slot.
    pub slot: String,
    /// The prefix of its messages.
    pub prefix: String,
}

/// Why the WAL outbox cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// A server setting is missing, or the slot is gone, lost or another database's (names it, and what to
    /// do).
    #[error(transparent)]
    Config(#[from] ConfigProblem),
    /// The database failed.
    #[error("preparing the WAL outbox: {0}")]
    Database(#[from] sqlx::Error),
}

/// What the schema records of its slot (`saga_outbox_wal_slot`).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct SlotRecord {
    /// The slot's name.
    pub slot_name: String,
    /// When the schema took it on (created or adopted).
    pub created_at: DateTime<Utc>,
    /// The last position a relay confirmed (everything of the schema before it was published or parked).
    pub confirmed_lsn: Option<String>,
    /// The commit time of the last transaction confirmed (or when an idle schema was confirmed).
    pub confirmed_at: Option<DateTime<Utc>>,
    /// When a relay first read the slot after the table outbox was drained (see `fence`).
    pub switched_at: Option<DateTime<Utc>>,
    /// When a process first saw the slot lost or gone.
    pub lost_at: Option<DateTime<Utc>>,
}

/// A slot as the server lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ServerSlot {
    name: String,
    database: Option<String>,
    plugin: Option<String>,
    wal_status: Option<String>,
    /// It has its start (`confirmed_flush_lsn`): a slot still being created has none.
    decodes: bool,
}

/// What to do about the slot, decided from what the schema recorded and what the server has.
#[derive(Debug, Clone, PartialEq, Eq)]
enum SlotPlan {
    /// The recorded slot is there: use it.
    Use(String),
    /// The schema records none; this slot of the current database is its own (made by another process
    /// without a record, or by 0.2 under the legacy name): record and use it.
    Adopt(String),
    /// The schema has none: create this one and record it.
    Create(String),
    /// A slot to take on is still being created by a process that does not take the schema's lock (an
    /// older version, an operator): wait, then look again.
    Wait(String),
}

/// The state of a schema's slot, for the writers' monitor and `status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotState {
    /// There and usable.
    Healthy,
    /// The schema records none (WAL mode was never set up, or it was retired).
    Unrecorded,
    /// Recorded, but the server has no such slot in this database (dropped, a failover, a restore).
    Gone,
    /// The server dropped what it held (`wal_status = 'lost'`), or a process saw it lost or gone before:
    /// only [`recover`] clears that.
    Lost,
}

fn lost_problem(slot: &str, why: &str, record: Option<&SlotRecord>) -> ConfigProblem {
    let since = match record {
        Some(SlotRecord {
            confirmed_lsn: Some(lsn),
            confirmed_at,
            ..
        }) => format!(
            "events committed after LSN {lsn}{} may never be published",
            confirmed_at.map_or(String::new(), |at| format!(" ({})", at.to_rfc3339()))
        ),
        _ => "events not yet published may never be".to_owned(),
    };
    ConfigProblem::new(
        "SAGA_OUTBOX_MODE",
        format!(
            "is wal, but the WAL outbox's slot {slot} {why}: {since}, and nothing was recreated"
        ),
        "run `saga outbox wal recover` (it makes a new slot and reports what was lost); see the WAL outbox \
         guide on failovers",
    )
}

fn other_database_problem(slot: &str, database: &str, theirs: &str) -> ConfigProblem {
    ConfigProblem::new(
        "SAGA_OUTBOX_MODE",
        format!(
            "is wal, but the replication slot {slot} belongs to database {theirs:?}, not {database:?}: it \
             would never decode this database's events"
        ),
        "drop that slot if it is abandoned, or give this service another schema",
    )
}

/// Decides from the schema's record and the server's slots (of the candidate names, in any database).
fn plan(
    database: &str,
    schema: &str,
    record: Option<&SlotRecord>,
    slots: &[ServerSlot],
) -> Result<SlotPlan, ConfigProblem> {
    let find = |name: &str| slots.iter().find(|s| s.name == name);
    let usable = |slot: &ServerSlot| -> Result<(), ConfigProblem> {
        match slot.database.as_deref() {
            Some(theirs) if theirs != database => {
                return Err(other_database_problem(&slot.name, database, theirs));
            }
            None => {
                return Err(ConfigProblem::new(
                    "SAGA_OUTBOX_MODE",
                    format!("is wal, but {} is a physical replication slot", slot.name),
                    "drop it, or give this service another schema",
                ));
            }
            Some(_) => {}
        }
        if slot.plugin.as_deref() != Some("pgoutput") {
            return Err(ConfigProblem::new(
                "SAGA_OUTBOX_MODE",
                format!(
                    "is wal, but the slot {} decodes with {:?}, not pgoutput",
                    slot.name,
                    slot.plugin.as_deref().unwrap_or("")
                ),
                "drop it; the service makes its own",
            ));
        }
        if slot.wal_status.as_deref() == Some("lost") {
            return Err(lost_problem(&slot.name, "is lost", record));
        }
        Ok(())
    };
    if let Some(record) = record {
        if let Some(theirs) = find(&record.slot_name)
            .and_then(|s| s.database.as_deref())
            .filter(|theirs| *theirs != database)
        {
            // The record came with a copy of another database (a template, a restore beside it).
            return Err(ConfigProblem::new(
                "SAGA_OUTBOX_MODE",
                format!(
                    "is wal, but this schema's record names the slot {} of database {theirs:?}: this \
                     database looks like a copy of that one, and has no slot of its own",
                    record.slot_name
                ),
                "run `saga outbox wal recover` here (it makes this database's own slot), or `saga outbox wal \
                 retire` to use the table",
            ));
        }
        let found = find(&record.slot_name).filter(|s| s.database.as_deref() == Some(database));
        return match (found, record.lost_at) {
            (None, _) => Err(lost_problem(&record.slot_name, "is gone", Some(record))),
            (Some(slot), _) if slot.wal_status.as_deref() == Some("lost") => {
                Err(lost_problem(&slot.name, "is lost", Some(record)))
            }
            // Seen lost or gone before: a slot of that name since made again by anyone else is no cure.
            (Some(slot), Some(at)) => Err(lost_problem(
                &slot.name,
                &format!("was found lost or gone at {}", at.to_rfc3339()),
                Some(record),
            )),
            (Some(slot), None) => usable(slot).map(|()| SlotPlan::Use(slot.name.clone())),
        };
    }
    // Taking a slot on: only once it decodes (one being created elsewhere is not there for good yet).
    let adopt = |slot: &ServerSlot| -> Result<SlotPlan, ConfigProblem> {
        usable(slot)?;
        Ok(if slot.decodes {
            SlotPlan::Adopt(slot.name.clone())
        } else {
            SlotPlan::Wait(slot.name.clone())
        })
    };
    let name = slot_name(database, schema);
    if let Some(slot) = find(&name) {
        return adopt(slot);
    }
    let legacy = legacy_slot_name(schema);
    // A slot of the legacy name in another database is that database's: not ours to take or refuse.
    if let Some(slot) = find(&legacy).filter(|s| s.database.as_deref() == Some(database)) {
        return adopt(slot);
    }
    Ok(SlotPlan::Create(name))
}

/// The schema's record of its slot, if it has one (and the table exists).
pub async fn recorded(conn: &mut PgConnection) -> Result<Option<SlotRecord>, sqlx::Error> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('saga_outbox_wal_slot') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await?;
    if !exists {
        return Ok(None);
    }
    sqlx::query_as(
        "SELECT slot_name, created_at, confirmed_lsn::text AS confirmed_lsn, confirmed_at, switched_at, \
                lost_at FROM saga_outbox_wal_slot",
    )
    .fetch_optional(conn)
    .await
}

async fn server_slots(
    conn: &mut PgConnection,
    names: &[String],
) -> Result<Vec<ServerSlot>, sqlx::Error> {
    /// Name, database, plugin, the log's status, whether it decodes.
    type Row = (String, Option<String>, Option<String>, Option<String>, bool);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT slot_name::text, database::text, plugin::text, wal_status, \
                confirmed_flush_lsn IS NOT NULL FROM pg_replication_slots \
         WHERE slot_name = ANY($1)",
    )
    .bind(names)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(name, database, plugin, wal_status, decodes)| ServerSlot {
            name,
            database,
            plugin,
            wal_status,
            decodes,
        })
        .collect())
}

/// Takes the schema's slot lock on `conn` (a session lock: close or unlock after), waiting while another
/// process holds it, up to [`SLOT_CREATION_WAIT`].
async fn lock_slot(conn: &mut PgConnection, slot: &str) -> Result<(), PrepareError> {
    let deadline = Instant::now() + SLOT_CREATION_WAIT;
    loop {
        let locked: bool =
            sqlx::query_scalar("SELECT pg_try_advisory_lock($1, hashtext(current_schema()::text))")
                .bind(SLOT_LOCK_CLASS)
                .fetch_one(&mut *conn)
                .await?;
        if locked {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(ConfigProblem::new(
                "SAGA_OUTBOX_MODE",
                format!(
                    "is wal, but the slot {slot} is still being created after {}s: PostgreSQL waits for \
                     the transactions that were running when it began to end",
                    SLOT_CREATION_WAIT.as_secs()
                ),
                "end the long-running transactions (pg_stat_activity), then start again",
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn unlock_slot(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_unlock($1, hashtext(current_schema()::text))")
        .bind(SLOT_LOCK_CLASS)
        .execute(conn)
        .await?;
    Ok(())
}

/// Checks that logical decoding is on and sets up what the WAL outbox of `pool`'s schema needs: the
/// publication, and the schema's slot, created and recorded where the schema has none. Safe to run from
/// several processes at once: the slot is created under the schema's lock, so a process returns only once
/// the slot exists for good and decodes. Refuses, with one line naming what to do, a slot that the schema
/// recorded and that is gone or lost, and a slot of its name that belongs to another database.
pub async fn prepare(pool: &PgPool) -> Result<WalOutbox, PrepareError> {
    // The slot lock is a session lock: a connection of its own, closed after, whatever happens.
    let mut conn = pool.acquire().await?.detach();
    let prepared = prepare_on(&mut conn).await;
    conn.close().await.ok();
    prepared
}

async fn prepare_on(conn: &mut PgConnection) -> Result<WalOutbox, PrepareError> {
    let (wal_level, database, schema): (String, String, String) = sqlx::query_as(
        "SELECT current_setting('wal_level'), current_database()::text, current_schema()::text",
    )
    .fetch_one(&mut *conn)
    .await?;
    if wal_level != "logical" {
        return Err(ConfigProblem::new(
            "SAGA_OUTBOX_MODE",
            format!("is wal, but PostgreSQL's wal_level is {wal_level}"),
            "set wal_level = logical (and restart PostgreSQL), or use SAGA_OUTBOX_MODE=table",
        )
        .into());
    }
    let has_table: bool =
        sqlx::query_scalar("SELECT to_regclass('saga_outbox_wal_slot') IS NOT NULL")
            .fetch_one(&mut *conn)
            .await?;
    if !has_table {
        return Err(ConfigProblem::new(
            "SAGA_OUTBOX_MODE",
            format!("is wal, but schema {schema} lacks the framework's tables"),
            "apply the migrations first (a service does at start; `outbox-relay migrate`)",
        )
        .into());
    }
    let has_publication: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
            .bind(PUBLICATION)
            .fetch_one(&mut *conn)
            .await?;
    if !has_publication {
        ignore_duplicate(
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "CREATE PUBLICATION {PUBLICATION}"
            )))
            .execute(&mut *conn)
            .await,
        )?;
    }
    let name = slot_name(&database, &schema);
    let deadline = Instant::now() + SLOT_CREATION_WAIT;
    let slot = loop {
        lock_slot(conn, &name).await?;
        let record = recorded(conn).await?;
        let mut names = vec![name.clone(), legacy_slot_name(&schema)];
        names.extend(record.as_ref().map(|r| r.slot_name.clone()));
        let slots = server_slots(conn, &names).await?;
        match plan(&database, &schema, record.as_ref(), &slots)? {
            SlotPlan::Use(slot) => break slot,
            SlotPlan::Adopt(slot) => {
                record_slot(conn, &slot, None).await?;
                tracing::info!(%schema, %slot, "took on the schema's existing WAL outbox slot");
                break slot;
            }
            SlotPlan::Create(slot) => {
                let lsn: String = sqlx::query_scalar(
                    "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
                )
                .bind(&slot)
                .fetch_one(&mut *conn)
                .await?;
                record_slot(conn, &slot, Some(&lsn)).await?;
                tracing::info!(%schema, %slot, %lsn, "created the WAL outbox's replication slot");
                break slot;
            }
            SlotPlan::Wait(slot) => {
                unlock_slot(conn).await?;
                if Instant::now() >= deadline {
                    return Err(ConfigProblem::new(
                        "SAGA_OUTBOX_MODE",
                        format!(
                            "is wal, but the slot {slot} is still being created after {}s (by a process \
                             that does not take the schema's lock)",
                            SLOT_CREATION_WAIT.as_secs()
                        ),
                        "end the long-running transactions (pg_stat_activity), then start again",
                    )
                    .into());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    unlock_slot(conn).await?;
    Ok(WalOutbox {
        prefix: prefix(&schema),
        database,
        schema,
        slot,
    })
}

async fn record_slot(
    conn: &mut PgConnection,
    slot: &str,
    created_lsn: Option<&str>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO saga_outbox_wal_slot (slot_name, created_lsn) VALUES ($1, $2::pg_lsn) \
         ON CONFLICT (singleton) DO UPDATE SET slot_name = EXCLUDED.slot_name, created_at = now(), \
             created_lsn = EXCLUDED.created_lsn, confirmed_lsn = NULL, confirmed_at = NULL, lost_at = NULL",
    )
    .bind(slot)
    .bind(created_lsn)
    .execute(conn)
    .await?;
    Ok(())
}

/// `result`, with "it exists already" (another process created it meanwhile) as success: whether this call
/// created it.
fn ignore_duplicate(
    result: Result<sqlx::postgres::PgQueryResult, sqlx::Error>,
) -> Result<bool, sqlx::Error> {
    match result {
        Ok(_) => Ok(true),
        Err(sqlx::Error::Database(e)) if matches!(e.code().as_deref(), Some("42710" | "23505")) => {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// The state of the current schema's slot: one statement, for the writers' monitor.
pub async fn state(conn: &mut PgConnection) -> Result<SlotState, sqlx::Error> {
    let row: Option<(Option<String>, bool, bool)> = sqlx::query_as(
        "SELECT s.wal_status, s.slot_name IS NOT NULL, r.lost_at IS NOT NULL \
         FROM saga_outbox_wal_slot r LEFT JOIN pg_replication_slots s \
           ON s.slot_name = r.slot_name AND s.database = current_database()",
    )
    .fetch_optional(conn)
    .await?;
    Ok(match row {
        None => SlotState::Unrecorded,
        Some((_, _, true)) => SlotState::Lost,
        Some((_, false, false)) => SlotState::Gone,
        Some((status, true, false)) if status.as_deref() == Some("lost") => SlotState::Lost,
        Some(_) => SlotState::Healthy,
    })
}

/// Records, once, that the current schema's slot is lost or gone (`lost_at`), if it is, in one statement:
/// a recovery committing meanwhile is seen (the row's new version is checked again), never undone. From
/// then on only [`recover`] makes the schema's outbox writable again, even should a slot of that name
/// reappear.
pub async fn mark_lost(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE saga_outbox_wal_slot r SET lost_at = now() \
         WHERE r.lost_at IS NULL AND NOT EXISTS ( \
             SELECT 1 FROM pg_replication_slots s \
             WHERE s.slot_name = r.slot_name AND s.database = current_database() \
               AND s.wal_status IS DISTINCT FROM 'lost')",
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Records how far the relay confirmed: `lsn`, the end of a transaction committed at `at` (everything of
/// the schema before it is published or parked); `None`: the server's time now (an idle schema confirmed).
pub async fn record_confirmed(
    pool: &PgPool,
    slot: &str,
    lsn: &str,
    at: Option<DateTime<Utc>>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE saga_outbox_wal_slot SET confirmed_lsn = $2::pg_lsn, confirmed_at = coalesce($3, now()) \
         WHERE slot_name = $1 AND lost_at IS NULL \
           AND (confirmed_lsn IS NULL OR confirmed_lsn < $2::pg_lsn)",
    )
    .bind(slot)
    .bind(lsn)
    .bind(at)
    .execute(pool)
    .await?;
    Ok(())
}

/// Drops `schema`'s slot in the current database (the recorded one, or the one its names give) if no relay
/// reads it, and forgets the record: for tests and for taking a schema's WAL outbox down (an abandoned slot
/// keeps the server's write-ahead log from being recycled). Returns whether a slot was dropped.
pub async fn drop_slot(conn: &mut PgConnection, schema: &str) -> Result<bool, sqlx::Error> {
    let database: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&mut *conn)
        .await?;
    let table = format!("\"{}\".saga_outbox_wal_slot", schema.replace('"', "\"\""));
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(&table)
        .fetch_one(&mut *conn)
        .await?;
    let mut names = vec![slot_name(&database, schema), legacy_slot_name(schema)];
    if exists {
        // The table's name is quoted above.
        let recorded: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT slot_name FROM {table}"
        )))
        .fetch_optional(&mut *conn)
        .await?;
        names.extend(recorded);
    }
    let dropped: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_drop_replication_slot(slot_name) IS NOT NULL FROM pg_replication_slots \
         WHERE slot_name = ANY($1) AND database = current_database() AND NOT active",
    )
    .bind(&names)
    .fetch_all(&mut *conn)
    .await?;
    if exists {
        sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM {table}")))
            .execute(&mut *conn)
            .await?;
    }
    Ok(!dropped.is_empty())
}

/// How far a schema's slot is behind, as the server sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotLag {
    /// The slot.
    pub slot: String,
    /// Whether a relay reads it now.
    pub active: bool,
    /// Bytes of write-ahead log between the server's current position and what the relay confirmed.
    pub lag_bytes: i64,
    /// How long ago the last change the relay confirmed was written, while a relay reads it (the server's
    /// `replay_lag`); `None` when the relay is caught up or none reads.
    pub lag_seconds: Option<f64>,
    /// The server's view of the slot's log (`reserved`, `extended`, `unreserved`, or `lost`: the slot fell
    /// behind `max_slot_wal_keep_size` and its unread events are gone); `gone` when the schema recorded a
    /// slot the server no longer has.
    pub wal_status: Option<String>,
}

/// A slot's row: name, active, bytes behind, seconds behind, its log's status.
type SlotRow = (
    String,
    Option<bool>,
    Option<i64>,
    Option<f64>,
    Option<String>,
);

/// The lag of the current schema's slot (the recorded one, else the one its names give, in this database);
/// `None` if it has none.
pub async fn slot_lag(pool: &PgPool) -> Result<Option<SlotLag>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let (database, schema): (String, String) =
        sqlx::query_as("SELECT current_database()::text, current_schema()::text")
            .fetch_one(&mut *conn)
            .await?;
    let record = recorded(&mut conn).await?;
    let names = match &record {
        Some(r) => vec![r.slot_name.clone()],
        None => vec![slot_name(&database, &schema), legacy_slot_name(&schema)],
    };
    let row: Option<SlotRow> = sqlx::query_as(
        "SELECT s.slot_name::text, s.active, \
                pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint, \
                extract(epoch FROM r.replay_lag)::float8, s.wal_status \
         FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid \
         WHERE s.slot_name = ANY($1) AND s.database = current_database() \
         ORDER BY array_position($1, s.slot_name::text) LIMIT 1",
    )
    .bind(&names)
    .fetch_optional(&mut *conn)
    .await?;
    let lost = record.as_ref().is_some_and(|r| r.lost_at.is_some());
    Ok(match (row, record) {
        (Some((slot, active, bytes, seconds, wal_status)), _) => Some(SlotLag {
            slot,
            active: active.unwrap_or(false),
            lag_bytes: bytes.unwrap_or(0).max(0),
            lag_seconds: seconds,
            wal_status: if lost {
                Some("lost".to_owned())
            } else {
                wal_status
            },
        }),
        // Recorded, and the server has no such slot: say so.
        (None, Some(record)) => Some(SlotLag {
            slot: record.slot_name,
            active: false,
            lag_bytes: 0,
            lag_seconds: None,
            wal_status: Some("gone".to_owned()),
        }),
        (None, None) => None,
    })
}

/// How much earlier than the last confirmed commit the step keys of a recovery's window are counted from: a
/// key's time is its transaction's start, and a transaction running when that commit happened may have
/// committed after it.
pub const WINDOW_MARGIN: &str = "1 minute";

/// What [`recover`] did: the slot it made, and what was lost with the old one.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Recovery {
    /// The incident's id (`saga_outbox_wal_incidents`).
    pub incident: i64,
    /// The slot lost and made again.
    pub slot: String,
    /// `lost` (the server dropped what it held) or `gone` (no such slot: dropped, a failover, a restore).
    pub what: String,
    /// Events committed after this position may never have been published (`None`: the relay never
    /// confirmed one: everything since the slot was taken on).
    pub lost_from_lsn: Option<String>,
    /// The commit time of the last transaction the relay confirmed, or when the slot was taken on.
    pub lost_from: DateTime<Utc>,
    /// The new slot's start: events committed after it are published.
    pub lost_to_lsn: String,
    /// When the new slot started.
    pub lost_to: DateTime<Utc>,
    /// Step keys completed in that window (counted from [`WINDOW_MARGIN`] before its start): their events
    /// may never have been published.
    pub steps_in_window: i64,
}

/// Why [`recover`] did nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecoverError {
    /// The slot is there and usable: nothing to recover.
    #[error("the WAL outbox's slot {0} is healthy: nothing to recover")]
    Healthy(String),
    /// The schema has no WAL outbox to recover.
    #[error("schema {0} has no WAL outbox (no slot recorded): nothing to recover")]
    Unrecorded(String),
    /// A relay still reads the lost slot: stop it first.
    #[error("a relay still reads the slot {0}: stop the schema's relays, then recover")]
    Active(String),
    /// The database failed.
    #[error("recovering the WAL outbox: {0}")]
    Database(#[from] sqlx::Error),
    /// The slot's lock could not be taken.
    #[error(transparent)]
    Prepare(#[from] PrepareError),
}

/// Recovers the current schema's WAL outbox after its slot was lost or gone: an operator's explicit act
/// (`saga outbox wal recover`). Under the schema's slot lock: drops what is left of the lost slot, creates a
/// new one, records the incident (what was lost: from the last confirmed position to the new slot's start,
/// and the step keys completed in that window, whose events may never have been published) with
/// `operator`, and makes the schema's outbox writable again.
pub async fn recover(pool: &PgPool, operator: &str) -> Result<Recovery, RecoverError> {
    let mut conn = pool.acquire().await?.detach();
    let recovered = recover_on(&mut conn, operator).await;
    conn.close().await.ok();
    recovered
}

async fn recover_on(conn: &mut PgConnection, operator: &str) -> Result<Recovery, RecoverError> {
    let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(&mut *conn)
        .await?;
    let Some(record) = recorded(conn).await? else {
        return Err(RecoverError::Unrecorded(schema));
    };
    lock_slot(conn, &record.slot_name).await?;
    let slot = record.slot_name.clone();
    let what = match state(conn).await? {
        SlotState::Healthy => return Err(RecoverError::Healthy(slot)),
        SlotState::Unrecorded => return Err(RecoverError::Unrecorded(schema)),
        SlotState::Gone => "gone",
        SlotState::Lost => {
            let exists: Option<bool> = sqlx::query_scalar(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1 \
                 AND database = current_database()",
            )
            .bind(&slot)
            .fetch_optional(&mut *conn)
            .await?;
            match exists {
                Some(true) => return Err(RecoverError::Active(slot)),
                Some(false) => {
                    sqlx::query("SELECT pg_drop_replication_slot($1)")
                        .bind(&slot)
                        .execute(&mut *conn)
                        .await?;
                    "lost"
                }
                None => "gone",
            }
        }
    };
    // The new slot is this database's own: in a copy of another database, the record named that one's.
    let database: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&mut *conn)
        .await?;
    let own = slot_name(&database, &schema);
    let (lsn, now): (String, DateTime<Utc>) = sqlx::query_as(
        "SELECT lsn::text, now() FROM pg_create_logical_replication_slot($1, 'pgoutput')",
    )
    .bind(&own)
    .fetch_one(&mut *conn)
    .await?;
    let lost_from = record.confirmed_at.unwrap_or(record.created_at);
    let has_keys: bool =
        sqlx::query_scalar("SELECT to_regclass('saga_idempotency_keys') IS NOT NULL")
            .fetch_one(&mut *conn)
            .await?;
    let steps_in_window: i64 = if has_keys {
        sqlx::query_scalar(
            "SELECT count(*) FROM saga_idempotency_keys \
             WHERE status <> 'started' AND updated_at >= $1 - $2::interval",
        )
        .bind(lost_from)
        .bind(WINDOW_MARGIN)
        .fetch_one(&mut *conn)
        .await?
    } else {
        0
    };
    let mut tx = conn.begin().await?;
    let incident: i64 = sqlx::query_scalar(
        "INSERT INTO saga_outbox_wal_incidents (slot_name, what, lost_from_lsn, lost_from_time, \
             lost_to_lsn, lost_to_time, steps_in_window, recovered_by) \
         VALUES ($1, $2, $3::pg_lsn, $4, $5::pg_lsn, $6, $7, $8) RETURNING id",
    )
    .bind(&slot)
    .bind(what)
    .bind(&record.confirmed_lsn)
    .bind(lost_from)
    .bind(&lsn)
    .bind(now)
    .bind(steps_in_window)
    .bind(operator)
    .fetch_one(&mut *tx)
    .await?;
    record_slot(&mut tx, &own, Some(&lsn)).await?;
    tx.commit().await?;
    sqlx::query("SELECT pg_advisory_unlock($1, hashtext(current_schema()::text))")
        .bind(SLOT_LOCK_CLASS)
        .execute(&mut *conn)
        .await?;
    tracing::warn!(%slot, what, %lsn, operator, "the WAL outbox's slot was made again after it was lost");
    Ok(Recovery {
        incident,
        slot: own,
        what: what.to_owned(),
        lost_from_lsn: record.confirmed_lsn,
        lost_from,
        lost_to_lsn: lsn,
        lost_to: now,
        steps_in_window,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(name: &str, database: &str) -> ServerSlot {
        ServerSlot {
            name: name.to_owned(),
            database: Some(database.to_owned()),
            plugin: Some("pgoutput".to_owned()),
            wal_status: Some("reserved".to_owned()),
            decodes: true,
        }
    }

    fn record(slot: &str) -> SlotRecord {
        SlotRecord {
            slot_name: slot.to_owned(),
            created_at: Utc::now(),
            confirmed_lsn: Some("0/16B3748".to_owned()),
            confirmed_at: None,
            switched_at: None,
            lost_at: None,
        }
    }

    #[test]
    fn slot_names_are_valid_distinct_and_fit() {
        let long = "s".repeat(80);
        let cases = [
            ("test", "saga_payment"),
            ("prod", "public"),
            ("staging", "public"),
            ("a_b", "c"),
            ("a", "b_c"),
            ("Sagas", "Saga-Payment"),
            ("sagas", "saga_payment"),
            (long.as_str(), long.as_str()),
            ("x", long.as_str()),
        ];
        let mut names = std::collections::BTreeSet::new();
        for (database, schema) in cases {
            let slot = slot_name(database, schema);
            assert!(slot.len() <= 63, "{slot}");
            assert!(
                slot.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
                "{slot}"
            );
            assert!(names.insert(slot.clone()), "{slot} twice");
            assert_eq!(slot, slot_name(database, schema), "stable");
        }
        assert!(slot_name("prod", "public").starts_with("saga_outbox_prod_public_"));
        // Names too long to show whole differ by their hash.
        assert_ne!(slot_name(&long, "a"), slot_name(&long, "b"));
        assert_eq!(legacy_slot_name("saga_payment"), "saga_outbox_saga_payment");
        assert!(legacy_slot_name(&long).len() <= 63);
    }

    #[test]
    fn another_databases_slot_is_never_used_and_the_legacy_name_is_taken_over_only_in_this_one() {
        let ours = slot_name("b", "public");
        // The new name in another database: refused, naming it.
        let refused = plan("b", "public", None, &[server(&ours, "a")]).unwrap_err();
        assert!(
            refused.to_string().contains("belongs to database \"a\""),
            "{refused}"
        );
        // 0.2's name in another database is that database's: ours is created beside it.
        let legacy = legacy_slot_name("public");
        assert_eq!(
            plan("b", "public", None, &[server(&legacy, "a")]).unwrap(),
            SlotPlan::Create(ours.clone())
        );
        // 0.2's name in this database: taken over.
        assert_eq!(
            plan("b", "public", None, &[server(&legacy, "b")]).unwrap(),
            SlotPlan::Adopt(legacy.clone())
        );
        assert_eq!(
            plan("b", "public", None, &[]).unwrap(),
            SlotPlan::Create(ours.clone())
        );
        // One still being created elsewhere (by a process without the schema's lock): waited for.
        let mut creating = server(&ours, "b");
        creating.decodes = false;
        assert_eq!(
            plan("b", "public", None, &[creating]).unwrap(),
            SlotPlan::Wait(ours.clone())
        );
        // A record naming another database's slot: this database is a copy of that one.
        let copied = plan("b", "public", Some(&record(&ours)), &[server(&ours, "a")]).unwrap_err();
        assert!(copied.to_string().contains("looks like a copy"), "{copied}");
    }

    #[test]
    fn a_recorded_slot_that_is_gone_or_lost_is_refused_never_made_again() {
        let ours = slot_name("b", "public");
        let gone = plan("b", "public", Some(&record(&ours)), &[]).unwrap_err();
        assert!(gone.to_string().contains("is gone"), "{gone}");
        assert!(gone.to_string().contains("0/16B3748"), "{gone}");
        assert!(
            gone.to_string().contains("saga outbox wal recover"),
            "{gone}"
        );
        let mut lost = server(&ours, "b");
        lost.wal_status = Some("lost".to_owned());
        let refused = plan("b", "public", Some(&record(&ours)), &[lost]).unwrap_err();
        assert!(refused.to_string().contains("is lost"), "{refused}");
        // Seen lost once: a slot of that name appearing again changes nothing until recovered.
        let mut seen = record(&ours);
        seen.lost_at = Some(Utc::now());
        assert!(plan("b", "public", Some(&seen), &[server(&ours, "b")]).is_err());
        assert_eq!(
            plan("b", "public", Some(&record(&ours)), &[server(&ours, "b")]).unwrap(),
            SlotPlan::Use(ours)
        );
    }
}
