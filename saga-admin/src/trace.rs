//! One choreographed saga across every service: "where is my order?" answered from what the framework
//! already stores.
//!
//! Given a client's key (and tenant), [`trace`] reads every service schema of the database (those with the
//! framework's key table, or the ones named) and assembles, ordered by time:
//!
//! - each step key derived from the client's key (`{key}:{step}`): its status, attempts, outcome or error,
//!   when it was claimed and when it last changed; a key with a stored request fingerprint is an HTTP
//!   request through the `Idempotency-Key` layer;
//! - the events each step wrote to its outbox (`ce_source` names the step): type, topic, when it was
//!   written, when the relay published it and where the broker put it (partition and offset), or why it
//!   failed;
//! - the dead letters of the key, as each schema's dead-letter index holds them (see [`crate::index`]),
//!   and their replays;
//! - orchestrated instances of the key and their transitions.
//!
//! Each schema is a lane; the page draws one column per lane. Published outbox rows and finished keys
//! leave the database after their retention (7 days by default): older sagas show what is left.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgPool, Row};

use crate::error::AdminError;

/// What a trace event is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum EventKind {
    /// A step key: a step ran (or is running) for the saga.
    Step,
    /// An HTTP request through the `Idempotency-Key` layer.
    Http,
    /// An event a step wrote to its outbox.
    Emitted,
    /// A dead letter of the saga.
    DeadLetter,
    /// A dead letter replayed.
    Replay,
    /// A transition of an orchestrated instance.
    Transition,
}

impl EventKind {
    /// The kind in a word.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Step => "step",
            Self::Http => "http",
            Self::Emitted => "emitted",
            Self::DeadLetter => "dead-letter",
            Self::Replay => "replay",
            Self::Transition => "transition",
        }
    }
}

/// One thing that happened to the saga.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct TraceEvent {
    /// When.
    pub at: DateTime<Utc>,
    /// The service schema (the lane).
    pub lane: String,
    /// What.
    pub kind: EventKind,
    /// The step (or operation, or saga type) concerned.
    pub subject: String,
    /// Its status or outcome, in a word: `completed`, `failed`, `started`, `published`, `unpublished`, ...
    pub status: String,
    /// The rest, for people.
    pub detail: String,
}

/// A saga's timeline.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct SagaTrace {
    /// The client's key.
    pub key: String,
    /// The tenant, if one was named.
    pub tenant: Option<String>,
    /// The lanes, in the order of their first event.
    pub lanes: Vec<String>,
    /// Everything, ordered by time.
    pub events: Vec<TraceEvent>,
    /// What could not be read, with why (a schema without a dead-letter index, a statement past its time):
    /// the trace shows what it read, and says what it could not.
    pub unread: Vec<String>,
    /// Lists cut at [`MOST_PER_LIST`], and schemas left unread past [`MOST_IN_ALL`], in words: the trace shows
    /// the first ones and says so.
    pub cut: Vec<String>,
    /// Lists read without their index (a schema migrated before it, or an index a failed concurrent build
    /// left invalid), in words: such a read costs the table's size, within [`STATEMENT_TIMEOUT`].
    pub unindexed: Vec<String>,
}

/// The most events of one kind a service's lane shows (steps, emitted events, transitions, replays, dead
/// letters): past it the list is cut, and the trace says so.
pub const MOST_PER_LIST: usize = 1_000;

/// The most events a whole trace holds: once a schema brings it there, the schemas after it are not read,
/// and the trace names them.
pub const MOST_IN_ALL: usize = 10_000;

/// How long one statement of a trace may run: past it, the list is left unread and the trace says so (the
/// catalog's read past it fails the trace as [`AdminError::Busy`]).
pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a whole trace may read: the schemas left when it runs out are named, not read.
pub const TRACE_DEADLINE: Duration = Duration::from_secs(15);

/// The client's key a step key was derived from (`{key}:{step}` without its last `:{step}`): the body of
/// `saga_step_owner`, written out so that a schema migrated before the function is read too, and the index
/// on the function (which PostgreSQL inlines) serves it where it exists.
const STEP_OWNER: &str = "left(step_key, length(step_key) - strpos(reverse(step_key), ':'))";

/// The `idempotency-key` header's value: the body of `saga_header(headers, 'idempotency-key')`, written
/// out for the same reason.
const KEY_HEADER: &str = "(CASE \
    WHEN array_position(headers, 'idempotency-key') IS NULL THEN NULL \
    WHEN array_position(headers, 'idempotency-key') % 2 = 1 \
        THEN headers[array_position(headers, 'idempotency-key') + 1] \
    WHEN array_position(headers, 'idempotency-key', array_position(headers, 'idempotency-key') + 1) % 2 = 1 \
        THEN headers[array_position(headers, 'idempotency-key', \
                                    array_position(headers, 'idempotency-key') + 1) + 1] \
    END)";

/// `rows` (read with a limit of one more than [`MOST_PER_LIST`]), cut at the bound, said in `cut`.
fn bounded(mut rows: Vec<PgRow>, schema: &str, what: &str, cut: &mut Vec<String>) -> Vec<PgRow> {
    if rows.len() > MOST_PER_LIST {
        rows.truncate(MOST_PER_LIST);
        cut.push(format!("{schema}: only the first {MOST_PER_LIST} {what}"));
    }
    rows
}

/// The limit of a list's query: one more than is shown, to tell a full list from a cut one.
fn limit() -> i64 {
    i64::try_from(MOST_PER_LIST).unwrap_or(i64::MAX) + 1
}

/// The schemas of `pool`'s database that hold the framework's key table.
pub async fn service_schemas(pool: &PgPool) -> Result<Vec<String>, AdminError> {
    let mut conn = pool.acquire().await?;
    schemas_of(&mut conn).await
}

/// Read from `pg_catalog` rather than `information_schema`, whose views check privileges row by row and
/// cost a trace milliseconds per schema. Unlike those views, it lists a schema whose tables the database
/// user may not read (its lists are then named as not read); other sessions' temporary schemas are not
/// services.
async fn schemas_of(conn: &mut PgConnection) -> Result<Vec<String>, AdminError> {
    sqlx::query_scalar(
        "SELECT n.nspname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE c.relname = 'saga_idempotency_keys' AND c.relkind IN ('r', 'p', 'v', 'm', 'f') \
           AND NOT pg_is_other_temp_schema(n.oid) ORDER BY 1",
    )
    .fetch_all(conn)
    .await
    .map_err(catalog_error)
}

/// A catalog read's error: its statement timeout said as the database being busy.
fn catalog_error(e: sqlx::Error) -> AdminError {
    match e {
        sqlx::Error::Database(d) if d.code().as_deref() == Some("57014") => {
            AdminError::Busy(format!(
                "the service schemas' tables could not be listed within {} s (the database is slow \
                 or busy, or a lock on its catalog held the trace)",
                STATEMENT_TIMEOUT.as_secs()
            ))
        }
        other => other.into(),
    }
}

/// `name` quoted as an SQL identifier.
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// What the catalog says of a schema a trace reads: the tables a service has (those of the crates it
/// uses), those of them the reader cannot read and why, the indexes a list can read through, and whether
/// its outbox has the published position (older schemas lack it).
#[derive(Debug, Default)]
struct Shape {
    tables: BTreeSet<String>,
    /// Tables the database user may not read (no `SELECT` on them, or no `USAGE` on the schema), or that
    /// were dropped while the trace began: said, not read as empty.
    unreadable: BTreeMap<String, &'static str>,
    /// Valid indexes only, as `table.index` (`pg_index.indisvalid`; a failed `CREATE INDEX CONCURRENTLY`
    /// leaves an invalid one under its name).
    indexes: BTreeSet<String>,
    positioned: bool,
}

/// The shapes of `schemas`, in one statement over `pg_catalog` for them all: a trace's cost is its lists,
/// not the number of schemas it looks at. The privilege functions read the current catalog, not the
/// trace's snapshot: a table dropped since answers NULL.
async fn shapes(
    conn: &mut PgConnection,
    schemas: &[String],
) -> Result<BTreeMap<String, Shape>, AdminError> {
    let rows: Vec<(String, String, String, Option<bool>)> = sqlx::query_as(
        "SELECT 'table', n.nspname::text, c.relname::text, \
                has_schema_privilege(n.oid, 'USAGE') AND has_table_privilege(c.oid, 'SELECT') \
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = ANY($1) AND c.relkind IN ('r', 'p', 'v', 'm', 'f') \
         UNION ALL \
         SELECT 'index', n.nspname::text, t.relname || '.' || c.relname, true FROM pg_index x \
         JOIN pg_class c ON c.oid = x.indexrelid JOIN pg_class t ON t.oid = x.indrelid \
         JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = ANY($1) AND x.indisvalid AND x.indisready AND x.indislive \
         UNION ALL \
         SELECT 'positioned', n.nspname::text, '', true FROM pg_attribute a \
         JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = ANY($1) AND c.relname = 'saga_outbox' \
           AND a.attname = 'published_offset' AND NOT a.attisdropped",
    )
    .bind(schemas)
    .fetch_all(conn)
    .await
    .map_err(catalog_error)?;
    let mut shapes: BTreeMap<String, Shape> = BTreeMap::new();
    for (kind, schema, name, readable) in rows {
        let shape = shapes.entry(schema).or_default();
        match kind.as_str() {
            "table" => {
                let why = match readable {
                    Some(true) => None,
                    Some(false) => Some("the database user may not read it"),
                    None => Some("dropped as the trace began"),
                };
                if let Some(why) = why {
                    shape.unreadable.insert(name.clone(), why);
                }
                shape.tables.insert(name);
            }
            "index" => {
                shape.indexes.insert(name);
            }
            _ => shape.positioned = true,
        }
    }
    Ok(shapes)
}

/// A list of a lane: the table it reads, the index that gives a key's rows in its order, and its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum List {
    Steps,
    Emitted,
    Transitions,
    Replays,
    DeadLetters,
}

impl List {
    const ALL: [List; 5] = [
        Self::Steps,
        Self::Emitted,
        Self::Transitions,
        Self::Replays,
        Self::DeadLetters,
    ];

    /// The table the list reads.
    fn table(self) -> &'static str {
        match self {
            Self::Steps => "saga_idempotency_keys",
            Self::Emitted => "saga_outbox",
            Self::Transitions => "saga_instances",
            Self::Replays => "saga_dlq_replay_log",
            Self::DeadLetters => "saga_dead_letters",
        }
    }

    /// The indexes that find one key's rows: the first gives them in the list's order (migrations
    /// `20261128000002` to `..05`); an older one, where a schema has it, finds them to be sorted.
    fn indexes(self) -> &'static [&'static str] {
        match self {
            Self::Steps => &["saga_idempotency_keys_owner"],
            Self::Emitted => &["saga_outbox_key_order", "saga_outbox_idempotency_key"],
            Self::Transitions => &["saga_instances_key"],
            Self::Replays => &["saga_dlq_replay_log_key"],
            Self::DeadLetters => &["saga_dead_letters_key_time", "saga_dead_letters_key"],
        }
    }

    /// The list in words.
    fn what(self) -> &'static str {
        match self {
            Self::Steps => "step keys",
            Self::Emitted => "events emitted",
            Self::Transitions => "transitions",
            Self::Replays => "replays",
            Self::DeadLetters => "dead letters",
        }
    }

    /// The list's statement over `schema`: `$1` the key, `$2` the tenant or NULL, `$3` the limit. Its
    /// `WHERE` and `ORDER BY` are those of the list's first index, so that the key's rows are one index range
    /// read stopped by the limit. A key's step keys are one per step, tenant and HTTP operation, and its
    /// instances one per tenant and saga type: those are sorted after the index found them.
    fn statement(self, schema: &str, positioned: bool) -> String {
        let s = ident(schema);
        let tenant = "($2::text IS NULL OR tenant_id = $2)";
        match self {
            Self::Steps => format!(
                "SELECT tenant_id, step_key, status, attempts, outcome::text, error, created_at, \
                        updated_at, request_hash IS NOT NULL \
                 FROM {s}.saga_idempotency_keys \
                 WHERE {STEP_OWNER} = $1 AND strpos(step_key, ':') > 0 AND {tenant} \
                 ORDER BY created_at, step_key, tenant_id LIMIT $3"
            ),
            Self::Emitted => {
                let position = if positioned {
                    "published_partition, published_offset"
                } else {
                    "NULL::int, NULL::bigint"
                };
                format!(
                    "SELECT topic, partition_key, headers, created_at, published_at, {position}, \
                            last_error, attempts \
                     FROM {s}.saga_outbox WHERE {KEY_HEADER} = $1 AND {tenant} ORDER BY id LIMIT $3"
                )
            }
            // The key's instances in order, each one's transitions in order, both limited.
            Self::Transitions => format!(
                "SELECT i.saga_id::text, i.saga_type, t.version, t.at, t.from_status, t.to_status, t.step, \
                        t.cause \
                 FROM (SELECT saga_id, saga_type, created_at FROM {s}.saga_instances \
                       WHERE idempotency_key = $1 AND {tenant} ORDER BY created_at, saga_id LIMIT $3) i \
                 CROSS JOIN LATERAL (SELECT * FROM {s}.saga_transitions t WHERE t.saga_id = i.saga_id \
                                     ORDER BY t.version LIMIT $3) t \
                 ORDER BY i.created_at, i.saga_id, t.version LIMIT $3"
            ),
            Self::Replays => format!(
                "SELECT sent_at, operator, dlq_topic, dlq_partition, dlq_offset, consumer_group, \
                        retry_topic, retry_partition, retry_offset \
                 FROM {s}.saga_dlq_replay_log WHERE idempotency_key = $1 AND {tenant} \
                 ORDER BY sent_at, id LIMIT $3"
            ),
            Self::DeadLetters => format!(
                "SELECT failed_at, dlq_topic, dlq_partition, dlq_offset, original_topic, \
                        original_partition, original_offset, attempts, error, reason, \
                        coalesce(step, consumer_group) \
                 FROM {s}.saga_dead_letters WHERE idempotency_key = $1 AND {tenant} \
                 ORDER BY failed_at, dlq_topic, dlq_partition, dlq_offset LIMIT $3"
            ),
        }
    }
}

/// The statements a trace runs over `schema` (migrated to the current version), each with its list's name
/// and the index that reads it: for tests that check their plans (`$1` the key, `$2` the tenant or NULL,
/// `$3` the limit).
#[doc(hidden)]
pub fn statements(schema: &str) -> Vec<(&'static str, &'static str, String)> {
    List::ALL
        .iter()
        .map(|l| (l.what(), l.indexes()[0], l.statement(schema, true)))
        .collect()
}

/// The timeline of the saga of client key `key` (of `tenant`, or of every tenant) over `schemas` (every
/// service schema of the database when empty). Dead letters are read from each schema's dead-letter index:
/// no topic is read. One read-only transaction reads it all (one snapshot), each statement within
/// [`STATEMENT_TIMEOUT`], the whole within [`TRACE_DEADLINE`], at most [`MOST_IN_ALL`] events: what it
/// could not read, it names.
pub async fn trace(
    pool: &PgPool,
    key: &str,
    tenant: Option<&str>,
    schemas: &[String],
) -> Result<SagaTrace, AdminError> {
    if key.is_empty() {
        return Err(AdminError::bad_input("the key is empty"));
    }
    if key.contains('\0') || tenant.is_some_and(|t| t.contains('\0')) {
        return Err(AdminError::bad_input(
            "the key or tenant holds a NUL byte, which no stored key can hold",
        ));
    }
    let deadline = Instant::now() + TRACE_DEADLINE;
    let mut tx = tokio::time::timeout(TRACE_DEADLINE, pool.begin())
        .await
        .map_err(|_| sqlx::Error::PoolTimedOut)??;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await?;
    // Every statement of the trace within its time: the catalog's lists too (each list sets its own).
    sqlx::query("SELECT set_config('statement_timeout', $1, true)")
        .bind(format!("{}ms", STATEMENT_TIMEOUT.as_millis()))
        .execute(&mut *tx)
        .await?;
    let schemas = chosen(&mut tx, schemas).await?;
    let shapes = shapes(&mut tx, &schemas).await?;
    let mut found = SagaTrace {
        key: key.to_owned(),
        tenant: tenant.map(str::to_owned),
        lanes: Vec::new(),
        events: Vec::new(),
        unread: Vec::new(),
        cut: Vec::new(),
        unindexed: Vec::new(),
    };
    for (n, schema) in schemas.iter().enumerate() {
        let left = deadline.saturating_duration_since(Instant::now());
        let past = if found.events.len() >= MOST_IN_ALL {
            Some(format!("{MOST_IN_ALL} events in all"))
        } else if left < Duration::from_millis(100) {
            Some(format!("the trace's {} s", TRACE_DEADLINE.as_secs()))
        } else {
            None
        };
        if let Some(past) = past {
            found
                .cut
                .push(format!("{past}: not read: {}", schemas[n..].join(", ")));
            break;
        }
        let Some(shape) = shapes.get(schema) else {
            found.unread.push(format!(
                "{schema}: not read, it was dropped while the trace began"
            ));
            continue;
        };
        let read = Lane::new(schema, shape, key, tenant, deadline);
        lane(&mut tx, read, &mut found).await?;
    }
    tx.rollback().await?;
    found
        .events
        .sort_by(|a, b| a.at.cmp(&b.at).then(a.lane.cmp(&b.lane)));
    if found.events.len() > MOST_IN_ALL {
        found.events.truncate(MOST_IN_ALL);
        found.cut.push(format!(
            "only the first {MOST_IN_ALL} events in all, by time"
        ));
    }
    for e in &found.events {
        if !found.lanes.contains(&e.lane) {
            found.lanes.push(e.lane.clone());
        }
    }
    Ok(found)
}

/// The schemas to read: `schemas`, each a service schema, or every service schema when empty.
async fn chosen(conn: &mut PgConnection, schemas: &[String]) -> Result<Vec<String>, AdminError> {
    let known = schemas_of(conn).await?;
    if schemas.is_empty() {
        return Ok(known);
    }
    for schema in schemas {
        if !known.contains(schema) {
            return Err(AdminError::bad_input(format!(
                "schema {schema} holds no saga keys (the service schemas here: {})",
                known.join(", ")
            )));
        }
    }
    Ok(schemas.to_vec())
}

/// Reads `read`'s lists (of its schema and key) into `found`, in a savepoint rolled back once read (it
/// wrote nothing, and the locks it took on the schema's tables go with it), each list by its deadline (see
/// [`Lane::list`]). A schema dropped while it is read holds nothing now.
async fn lane(
    conn: &mut PgConnection,
    mut read: Lane<'_>,
    found: &mut SagaTrace,
) -> Result<(), AdminError> {
    let schema = read.schema;
    let mut sp = sqlx::Connection::begin(&mut *conn).await?;
    let result = read.all(&mut sp).await;
    sp.rollback().await?;
    match result {
        Ok(()) => {
            found.events.append(&mut read.events);
            found.cut.append(&mut read.cut);
            found.unindexed.append(&mut read.unindexed);
            found.unread.append(&mut read.unread);
            Ok(())
        }
        // A table or the schema dropped while it was read (or a table a list needs missing): said, not
        // shown as an empty lane.
        Err(AdminError::Database(sqlx::Error::Database(e)))
            if matches!(e.code().as_deref(), Some("42P01" | "3F000")) =>
        {
            found.unread.push(format!(
                "{schema}: not read, a table of it is missing ({})",
                e.message()
            ));
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// One schema's lists of one key, as they are read.
struct Lane<'a> {
    schema: &'a str,
    shape: &'a Shape,
    key: &'a str,
    tenant: Option<&'a str>,
    /// When the whole trace must be done.
    deadline: Instant,
    events: Vec<TraceEvent>,
    cut: Vec<String>,
    unindexed: Vec<String>,
    unread: Vec<String>,
}

impl<'a> Lane<'a> {
    fn new(
        schema: &'a str,
        shape: &'a Shape,
        key: &'a str,
        tenant: Option<&'a str>,
        deadline: Instant,
    ) -> Self {
        Self {
            schema,
            shape,
            key,
            tenant,
            deadline,
            events: Vec::new(),
            cut: Vec::new(),
            unindexed: Vec::new(),
            unread: Vec::new(),
        }
    }

    async fn all(
        &mut self,
        conn: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    ) -> Result<(), AdminError> {
        let shape = self.shape;
        for list in List::ALL {
            if !shape.tables.contains(list.table()) {
                if list == List::DeadLetters && shape.tables.contains("saga_consumer_groups") {
                    self.unread.push(format!(
                        "{}: no dead-letter index (its consumer predates it; `saga dlq list` there \
                         indexes its dead-letter topics)",
                        self.schema
                    ));
                }
                continue;
            }
            let unreadable = [list.table()]
                .into_iter()
                .chain((list == List::Transitions).then_some("saga_transitions"))
                .find_map(|t| shape.unreadable.get(t).map(|why| (t, why)));
            if let Some((table, why)) = unreadable {
                self.unread.push(format!(
                    "{}: {} not read: {table}: {why}",
                    self.schema,
                    list.what(),
                ));
                continue;
            }
            let indexed = list
                .indexes()
                .iter()
                .any(|i| shape.indexes.contains(&format!("{}.{i}", list.table())));
            if !indexed {
                self.unindexed.push(format!(
                    "{}: {} read without index {} (migrate the schema, or build an invalid index again)",
                    self.schema,
                    list.what(),
                    list.indexes()[0]
                ));
            }
            let Some(rows) = self.list(conn, list, shape.positioned).await? else {
                continue;
            };
            let rows = bounded(rows, self.schema, list.what(), &mut self.cut);
            for r in rows {
                let event = match list {
                    List::Steps => step(&r, self.key),
                    List::Emitted => emitted(&r, self.key),
                    List::Transitions => transition(&r).map(Some),
                    List::Replays => replay(&r).map(Some),
                    List::DeadLetters => dead_letter(&r).map(Some),
                }?;
                if let Some((at, kind, subject, status, detail)) = event {
                    self.events.push(TraceEvent {
                        at,
                        lane: self.schema.to_owned(),
                        kind,
                        subject,
                        status,
                        detail,
                    });
                }
            }
        }
        Ok(())
    }

    /// `list`'s rows, read in a savepoint of its own within [`STATEMENT_TIMEOUT`] and what is left until
    /// the deadline; `None`, said in `unread`, if it ran past that (the schema's other lists are read all
    /// the same) or no time was left.
    async fn list(
        &mut self,
        conn: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        list: List,
        positioned: bool,
    ) -> Result<Option<Vec<PgRow>>, AdminError> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left < Duration::from_millis(100) {
            self.unread.push(format!(
                "{}: {} not read: the trace's {} s ran out",
                self.schema,
                list.what(),
                TRACE_DEADLINE.as_secs()
            ));
            return Ok(None);
        }
        let timeout = left.min(STATEMENT_TIMEOUT);
        let mut sp = sqlx::Connection::begin(&mut **conn).await?;
        sqlx::query("SELECT set_config('statement_timeout', $1, true)")
            .bind(format!("{}ms", timeout.as_millis().max(1)))
            .execute(&mut *sp)
            .await?;
        let rows = sqlx::query(sqlx::AssertSqlSafe(list.statement(self.schema, positioned)))
            .bind(self.key)
            .bind(self.tenant)
            .bind(limit())
            .fetch_all(&mut *sp)
            .await;
        sp.rollback().await?;
        match rows {
            Ok(rows) => Ok(Some(rows)),
            // Its privileges revoked since the catalog was read, say.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42501") => {
                self.unread.push(format!(
                    "{}: {} not read: {}",
                    self.schema,
                    list.what(),
                    e.message()
                ));
                Ok(None)
            }
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("57014") => {
                self.unread.push(format!(
                    "{}: {} not read: the statement ran past {} ms (the database is slow or busy, \
                     or a lock held it{})",
                    self.schema,
                    list.what(),
                    timeout.as_millis(),
                    if self.unindexed.iter().any(|u| u.contains(list.what())) {
                        "; the list has no index"
                    } else {
                        ""
                    }
                ));
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// An event read from a row: when, what, its subject, status and detail.
type Read = (DateTime<Utc>, EventKind, String, String, String);

fn step(r: &PgRow, key: &str) -> Result<Option<Read>, AdminError> {
    let step_key: String = r.try_get(1)?;
    // Only `{key}:{step}` with the exact key is this saga's (the statement says so too).
    let Some((original, step)) = step_key.rsplit_once(':') else {
        return Ok(None);
    };
    if original != key {
        return Ok(None);
    }
    let tenant: String = r.try_get(0)?;
    let status: String = r.try_get(2)?;
    let attempts: i32 = r.try_get(3)?;
    let outcome: Option<String> = r.try_get(4)?;
    let error: Option<String> = r.try_get(5)?;
    let created: DateTime<Utc> = r.try_get(6)?;
    let updated: DateTime<Utc> = r.try_get(7)?;
    let http: bool = r.try_get(8)?;
    let mut detail = format!(
        "tenant {tenant}, claimed {}",
        created.format("%H:%M:%S%.3f")
    );
    if attempts > 1 {
        detail.push_str(&format!(", {attempts} attempts"));
    }
    if let Some(error) = error {
        detail.push_str(&format!(", error: {error}"));
    } else if http {
        // A stored response may hold what only its client should see: its status alone.
        let status = outcome
            .as_deref()
            .and_then(|o| serde_json::from_str::<serde_json::Value>(o).ok())
            .and_then(|o| o["status"].as_u64());
        if let Some(status) = status {
            detail.push_str(&format!(", answered {status}"));
        }
    } else if let Some(outcome) = outcome.filter(|o| o != "null") {
        detail.push_str(&format!(", outcome: {outcome}"));
    }
    let kind = if http {
        EventKind::Http
    } else {
        EventKind::Step
    };
    Ok(Some((updated, kind, step.to_owned(), status, detail)))
}

/// The value of header `name` in a flat `[name, value, ...]` header array.
fn header<'a>(headers: &'a [String], name: &str) -> Option<&'a str> {
    headers
        .chunks_exact(2)
        .find(|pair| pair[0] == name)
        .map(|pair| pair[1].as_str())
}

fn emitted(r: &PgRow, key: &str) -> Result<Option<Read>, AdminError> {
    let headers: Vec<String> = r.try_get(2)?;
    if header(&headers, "idempotency-key") != Some(key) {
        return Ok(None);
    }
    let topic: String = r.try_get(0)?;
    let partition_key: Option<String> = r.try_get(1)?;
    let created: DateTime<Utc> = r.try_get(3)?;
    let published: Option<DateTime<Utc>> = r.try_get(4)?;
    let partition: Option<i32> = r.try_get(5)?;
    let offset: Option<i64> = r.try_get(6)?;
    let error: Option<String> = r.try_get(7)?;
    let attempts: i32 = r.try_get(8)?;
    let event_type = header(&headers, "ce_type").unwrap_or("?");
    let source = header(&headers, "ce_source").unwrap_or("?");
    let mut detail = format!(
        "{event_type} to {topic} (key {}), written {}",
        partition_key.as_deref().unwrap_or("none"),
        created.format("%H:%M:%S%.3f")
    );
    let status = match published {
        Some(at) => {
            detail.push_str(&format!(", published {}", at.format("%H:%M:%S%.3f")));
            if let (Some(p), Some(o)) = (partition, offset) {
                detail.push_str(&format!(" at {topic}/{p}/{o}"));
            }
            "published"
        }
        None => {
            if let Some(error) = error {
                detail.push_str(&format!(", {attempts} failed attempts: {error}"));
            }
            "unpublished"
        }
    };
    Ok(Some((
        created,
        EventKind::Emitted,
        source.to_owned(),
        status.to_owned(),
        detail,
    )))
}

fn transition(r: &PgRow) -> Result<Read, AdminError> {
    let saga_id: String = r.try_get(0)?;
    let saga_type: String = r.try_get(1)?;
    let version: i32 = r.try_get(2)?;
    let from: Option<String> = r.try_get(4)?;
    let to: String = r.try_get(5)?;
    let step: Option<String> = r.try_get(6)?;
    let cause: String = r.try_get(7)?;
    let detail = format!(
        "saga {saga_id} v{version}: {} → {to} on {cause}{}",
        from.as_deref().unwrap_or("new"),
        step.map(|s| format!(", step {s}")).unwrap_or_default()
    );
    Ok((r.try_get(3)?, EventKind::Transition, saga_type, to, detail))
}

fn replay(r: &PgRow) -> Result<Read, AdminError> {
    let operator: String = r.try_get(1)?;
    let (topic, p, o): (String, i32, i64) = (r.try_get(2)?, r.try_get(3)?, r.try_get(4)?);
    let group: String = r.try_get(5)?;
    let (retry, rp, ro): (String, i32, i64) = (r.try_get(6)?, r.try_get(7)?, r.try_get(8)?);
    Ok((
        r.try_get(0)?,
        EventKind::Replay,
        group,
        "sent".to_owned(),
        format!("{topic}/{p}/{o} replayed by {operator} to {retry}/{rp}/{ro}"),
    ))
}

fn dead_letter(r: &PgRow) -> Result<Read, AdminError> {
    let (topic, partition, offset): (String, i32, i64) =
        (r.try_get(1)?, r.try_get(2)?, r.try_get(3)?);
    let (original, original_partition, original_offset): (String, i32, i64) =
        (r.try_get(4)?, r.try_get(5)?, r.try_get(6)?);
    let (attempts, error): (i32, String) = (r.try_get(7)?, r.try_get(8)?);
    Ok((
        r.try_get(0)?,
        EventKind::DeadLetter,
        r.try_get(10)?,
        r.try_get(9)?,
        format!(
            "{topic}/{partition}/{offset} (from {original}/{original_partition}/{original_offset}), \
             {attempts} attempts: {error}"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted_and_headers_found_by_name() {
        assert_eq!(ident("svc"), "\"svc\"");
        assert_eq!(ident("a\"b"), "\"a\"\"b\"");
        let headers: Vec<String> = ["ce_type", "OrderCreated", "idempotency-key", "k-1"]
            .map(str::to_owned)
            .to_vec();
        assert_eq!(header(&headers, "idempotency-key"), Some("k-1"));
        assert_eq!(header(&headers, "OrderCreated"), None, "names only");
    }
}
