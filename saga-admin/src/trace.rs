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

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgPool, Row};

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
    /// Schemas whose dead letters could not be read (no dead-letter index), with why: the trace shows what
    /// it read, and says what it could not.
    pub unread: Vec<String>,
    /// Lists cut at [`MOST_PER_LIST`], in words: the trace shows the first ones and says so.
    pub cut: Vec<String>,
}

/// The most events of one kind a service's lane shows (steps, emitted events, transitions, replays, dead
/// letters): past it the list is cut, and the trace says so.
pub const MOST_PER_LIST: usize = 1_000;

/// `rows` (read with a limit of one more than [`MOST_PER_LIST`]), cut at the bound, said in `cut`.
fn bounded(
    mut rows: Vec<sqlx::postgres::PgRow>,
    schema: &str,
    what: &str,
    cut: &mut Vec<String>,
) -> Vec<sqlx::postgres::PgRow> {
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
    Ok(sqlx::query_scalar(
        "SELECT table_schema::text FROM information_schema.tables \
         WHERE table_name = 'saga_idempotency_keys' ORDER BY 1",
    )
    .fetch_all(pool)
    .await?)
}

/// `name` quoted as an SQL identifier.
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The tables of `schema` (a service has those of the crates it uses).
async fn tables_of(pool: &PgPool, schema: &str) -> Result<BTreeSet<String>, AdminError> {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = $1",
    )
    .bind(schema)
    .fetch_all(pool)
    .await?;
    Ok(tables.into_iter().collect())
}

/// The timeline of the saga of client key `key` (of `tenant`, or of every tenant) over `schemas` (every
/// service schema of the database when empty). Dead letters are read from each schema's dead-letter index:
/// no topic is read.
pub async fn trace(
    pool: &PgPool,
    key: &str,
    tenant: Option<&str>,
    schemas: &[String],
) -> Result<SagaTrace, AdminError> {
    if key.is_empty() {
        return Err(AdminError::bad_input("the key is empty"));
    }
    let known = service_schemas(pool).await?;
    let schemas: Vec<String> = if schemas.is_empty() {
        known
    } else {
        for schema in schemas {
            if !known.contains(schema) {
                return Err(AdminError::bad_input(format!(
                    "schema {schema} holds no saga keys (the service schemas here: {})",
                    known.join(", ")
                )));
            }
        }
        schemas.to_vec()
    };
    let mut events = Vec::new();
    let mut unread = Vec::new();
    let mut cut = Vec::new();
    for schema in &schemas {
        let mut of_schema = Vec::new();
        let mut cut_of_schema = Vec::new();
        let c = &mut cut_of_schema;
        let read = async {
            let tables = tables_of(pool, schema).await?;
            steps(pool, schema, key, tenant, &mut of_schema, c).await?;
            if tables.contains("saga_outbox") {
                emitted(pool, schema, key, tenant, &mut of_schema, c).await?;
            }
            if tables.contains("saga_instances") {
                transitions(pool, schema, key, tenant, &mut of_schema, c).await?;
            }
            if tables.contains("saga_dlq_replay_log") {
                replays(pool, schema, key, tenant, &mut of_schema, c).await?;
            }
            if tables.contains("saga_dead_letters") {
                dead_letters(pool, schema, key, tenant, &mut of_schema, c).await?;
            } else if tables.contains("saga_consumer_groups") {
                unread.push(format!(
                    "{schema}: no dead-letter index (its consumer predates it; `saga dlq list` there \
                     indexes its dead-letter topics)"
                ));
            }
            Ok(())
        }
        .await;
        match read {
            Ok(()) => {
                events.append(&mut of_schema);
                cut.append(&mut cut_of_schema);
            }
            // A schema dropped while it was read (undefined table or schema): it holds nothing now.
            Err(AdminError::Database(sqlx::Error::Database(e)))
                if matches!(e.code().as_deref(), Some("42P01" | "3F000")) =>
            {
                tracing::debug!(schema, "a schema went away while it was traced");
            }
            Err(e) => return Err(e),
        }
    }
    events.sort_by(|a, b| a.at.cmp(&b.at).then(a.lane.cmp(&b.lane)));
    let mut lanes: Vec<String> = Vec::new();
    for e in &events {
        if !lanes.contains(&e.lane) {
            lanes.push(e.lane.clone());
        }
    }
    Ok(SagaTrace {
        key: key.to_owned(),
        tenant: tenant.map(str::to_owned),
        lanes,
        events,
        unread,
        cut,
    })
}

/// `LIKE` pattern of the step keys of `key`.
fn keys_pattern(key: &str) -> String {
    let escaped = key
        .replace('\\', "\\\\")
        .replace('%', "\\%")
        .replace('_', "\\_");
    format!("{escaped}:%")
}

/// Ends a trace query's inner select: `OFFSET 0` keeps PostgreSQL from flattening it, so that the key's
/// rows are found through the key's index and only then ordered and cut. Flattened, `ORDER BY id LIMIT n`
/// over the primary key looked attractive, and a key with few rows (or none) walked the whole table in
/// id order (1.7 s over 100,000 outbox rows, measured).
const FENCE: &str = "OFFSET 0";

async fn steps(
    pool: &PgPool,
    schema: &str,
    key: &str,
    tenant: Option<&str>,
    events: &mut Vec<TraceEvent>,
    cut: &mut Vec<String>,
) -> Result<(), AdminError> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT tenant_id, step_key, status, attempts, outcome::text, error, created_at, updated_at, \
                request_hash IS NOT NULL \
         FROM (SELECT * FROM {}.saga_idempotency_keys \
               WHERE step_key ~>=~ $4 AND step_key ~<~ $5 AND step_key LIKE $1 ESCAPE '\\' \
                 AND strpos(substr(step_key, char_length($6) + 2), ':') = 0 \
                 AND ($2::text IS NULL OR tenant_id = $2) {FENCE}) m \
         ORDER BY created_at LIMIT $3",
        ident(schema)
    )))
    .bind(keys_pattern(key))
    .bind(tenant)
    .bind(limit())
    // `{key}:` up to `{key};` byte-wise: the step keys of `key`, found through the index
    // `saga_idempotency_keys_step_key` (text_pattern_ops) whatever the database's collation.
    .bind(format!("{key}:"))
    .bind(format!("{key};"))
    // Exactly `{key}:{step}` before the cut (a step's name holds no ':'): the step keys of a longer key
    // that `key` prefixes (`cust-1:order-7:charge` for `cust-1`) neither fill the list nor cut it.
    .bind(key)
    .fetch_all(pool)
    .await?;
    for r in bounded(rows, schema, "step keys", cut) {
        let step_key: String = r.try_get(1)?;
        // A key may itself hold ':'; only `{key}:{step}` with the exact key is this saga's.
        let Some((original, step)) = step_key.rsplit_once(':') else {
            continue;
        };
        if original != key {
            continue;
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
        events.push(TraceEvent {
            at: updated,
            lane: schema.to_owned(),
            kind: if http {
                EventKind::Http
            } else {
                EventKind::Step
            },
            subject: step.to_owned(),
            status,
            detail,
        });
    }
    Ok(())
}

/// The value of header `name` in a flat `[name, value, ...]` header array.
fn header<'a>(headers: &'a [String], name: &str) -> Option<&'a str> {
    headers
        .chunks_exact(2)
        .find(|pair| pair[0] == name)
        .map(|pair| pair[1].as_str())
}

async fn emitted(
    pool: &PgPool,
    schema: &str,
    key: &str,
    tenant: Option<&str>,
    events: &mut Vec<TraceEvent>,
    cut: &mut Vec<String>,
) -> Result<(), AdminError> {
    // Older schemas lack the published position: read it where it is.
    let positioned: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.columns \
         WHERE table_schema = $1 AND table_name = 'saga_outbox' AND column_name = 'published_offset')",
    )
    .bind(schema)
    .fetch_one(pool)
    .await?;
    let position = if positioned {
        "published_partition, published_offset"
    } else {
        "NULL::int, NULL::bigint"
    };
    // Through the index on the header (`saga_outbox_idempotency_key`) where the schema has it; older
    // schemas are scanned.
    let indexed: bool = sqlx::query_scalar(
        "SELECT to_regprocedure(quote_ident($1) || '.saga_header(text[], text)') IS NOT NULL",
    )
    .bind(schema)
    .fetch_one(pool)
    .await?;
    let matches = if indexed {
        format!(
            "{}.saga_header(headers, 'idempotency-key') = $1",
            ident(schema)
        )
    } else {
        "headers @> ARRAY['idempotency-key', $1]::text[] \
         AND EXISTS (SELECT 1 FROM generate_subscripts(headers, 1) AS i \
                     WHERE i % 2 = 1 AND headers[i] = 'idempotency-key' AND headers[i + 1] = $1)"
            .to_owned()
    };
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT topic, partition_key, headers, created_at, published_at, {position}, last_error, attempts \
         FROM (SELECT * FROM {}.saga_outbox \
               WHERE {matches} AND ($2::text IS NULL OR tenant_id = $2) {FENCE}) m \
         ORDER BY id LIMIT $3",
        ident(schema)
    )))
    .bind(key)
    .bind(tenant)
    .bind(limit())
    .fetch_all(pool)
    .await?;
    for r in bounded(rows, schema, "events emitted", cut) {
        let headers: Vec<String> = r.try_get(2)?;
        if header(&headers, "idempotency-key") != Some(key) {
            continue;
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
        events.push(TraceEvent {
            at: created,
            lane: schema.to_owned(),
            kind: EventKind::Emitted,
            subject: source.to_owned(),
            status: status.to_owned(),
            detail,
        });
    }
    Ok(())
}

async fn transitions(
    pool: &PgPool,
    schema: &str,
    key: &str,
    tenant: Option<&str>,
    events: &mut Vec<TraceEvent>,
    cut: &mut Vec<String>,
) -> Result<(), AdminError> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT saga_id::text, saga_type, version, at, from_status, to_status, step, cause \
         FROM (SELECT i.saga_id, i.saga_type, t.version, t.at, t.from_status, t.to_status, t.step, t.cause \
               FROM {s}.saga_instances i JOIN {s}.saga_transitions t USING (saga_id) \
               WHERE i.idempotency_key = $1 AND ($2::text IS NULL OR i.tenant_id = $2) {FENCE}) m \
         ORDER BY at, version LIMIT $3",
        s = ident(schema)
    )))
    .bind(key)
    .bind(tenant)
    .bind(limit())
    .fetch_all(pool)
    .await?;
    for r in bounded(rows, schema, "transitions", cut) {
        let saga_id: String = r.try_get(0)?;
        let saga_type: String = r.try_get(1)?;
        let version: i32 = r.try_get(2)?;
        let from: Option<String> = r.try_get(4)?;
        let to: String = r.try_get(5)?;
        let step: Option<String> = r.try_get(6)?;
        let cause: String = r.try_get(7)?;
        events.push(TraceEvent {
            at: r.try_get(3)?,
            lane: schema.to_owned(),
            kind: EventKind::Transition,
            subject: saga_type,
            status: to.clone(),
            detail: format!(
                "saga {saga_id} v{version}: {} → {to} on {cause}{}",
                from.as_deref().unwrap_or("new"),
                step.map(|s| format!(", step {s}")).unwrap_or_default()
            ),
        });
    }
    Ok(())
}

async fn replays(
    pool: &PgPool,
    schema: &str,
    key: &str,
    tenant: Option<&str>,
    events: &mut Vec<TraceEvent>,
    cut: &mut Vec<String>,
) -> Result<(), AdminError> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT sent_at, operator, dlq_topic, dlq_partition, dlq_offset, consumer_group, retry_topic, \
                retry_partition, retry_offset \
         FROM (SELECT * FROM {}.saga_dlq_replay_log \
               WHERE idempotency_key = $1 AND ($2::text IS NULL OR tenant_id = $2) {FENCE}) m \
         ORDER BY sent_at LIMIT $3",
        ident(schema)
    )))
    .bind(key)
    .bind(tenant)
    .bind(limit())
    .fetch_all(pool)
    .await?;
    for r in bounded(rows, schema, "replays", cut) {
        let operator: String = r.try_get(1)?;
        let (topic, p, o): (String, i32, i64) = (r.try_get(2)?, r.try_get(3)?, r.try_get(4)?);
        let group: String = r.try_get(5)?;
        let (retry, rp, ro): (String, i32, i64) = (r.try_get(6)?, r.try_get(7)?, r.try_get(8)?);
        events.push(TraceEvent {
            at: r.try_get(0)?,
            lane: schema.to_owned(),
            kind: EventKind::Replay,
            subject: group,
            status: "sent".to_owned(),
            detail: format!("{topic}/{p}/{o} replayed by {operator} to {retry}/{rp}/{ro}"),
        });
    }
    Ok(())
}

async fn dead_letters(
    pool: &PgPool,
    schema: &str,
    key: &str,
    tenant: Option<&str>,
    events: &mut Vec<TraceEvent>,
    cut: &mut Vec<String>,
) -> Result<(), AdminError> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT failed_at, dlq_topic, dlq_partition, dlq_offset, original_topic, original_partition, \
                original_offset, attempts, error, reason, coalesce(step, consumer_group) \
         FROM (SELECT * FROM {}.saga_dead_letters \
               WHERE idempotency_key = $1 AND ($2::text IS NULL OR tenant_id = $2) {FENCE}) m \
         ORDER BY failed_at LIMIT $3",
        ident(schema)
    )))
    .bind(key)
    .bind(tenant)
    .bind(limit())
    .fetch_all(pool)
    .await?;
    for r in bounded(rows, schema, "dead letters", cut) {
        let (topic, partition, offset): (String, i32, i64) =
            (r.try_get(1)?, r.try_get(2)?, r.try_get(3)?);
        let (original, original_partition, original_offset): (String, i32, i64) =
            (r.try_get(4)?, r.try_get(5)?, r.try_get(6)?);
        let (attempts, error): (i32, String) = (r.try_get(7)?, r.try_get(8)?);
        events.push(TraceEvent {
            at: r.try_get(0)?,
            lane: schema.to_owned(),
            kind: EventKind::DeadLetter,
            subject: r.try_get(10)?,
            status: r.try_get(9)?,
            detail: format!(
                "{topic}/{partition}/{offset} (from {original}/{original_partition}/{original_offset}), \
                 {attempts} attempts: {error}"
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted_and_patterns_escaped() {
        assert_eq!(ident("svc"), "\"svc\"");
        assert_eq!(ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(keys_pattern("order_1%"), "order\\_1\\%:%");
        let headers: Vec<String> = ["ce_type", "OrderCreated", "idempotency-key", "k-1"]
            .map(str::to_owned)
            .to_vec();
        assert_eq!(header(&headers, "idempotency-key"), Some("k-1"));
        assert_eq!(header(&headers, "OrderCreated"), None, "names only");
    }
}
