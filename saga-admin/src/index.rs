//! The dead-letter index (`saga_dead_letters`): what the toolkit reads instead of the dead-letter topics.
//!
//! The consumer indexes each letter once the broker acknowledged it, before the message's offset is
//! committed. Before reading a topic's letters, the toolkit makes sure the index holds every letter the
//! topic still holds ([`sync`]): for each partition it counts, in the index, the letters between how far it
//! made sure last time (`saga_dead_letter_scans`) and the broker's high watermark; only where letters are
//! missing (letters written before the index existed, or by hand) does it read the topic, from the first
//! missing one, in bounded chunks. Letters the topic no longer holds (its retention deleted them) leave the
//! index. Groups, counts, traces and lists are then SQL over the index, with each letter's state (open,
//! replayed, discarded) read from the toolkit's tables in the same query.

use std::collections::BTreeMap;

use chrono::Utc;
use saga_consumer::KafkaConfig;
use saga_consumer::admin::letters::{self, IndexedLetter, LetterFields};
use sqlx::{PgPool, Row};

use crate::dlq::{self, DeadLetter, DlqFilter, Record};
use crate::error::AdminError;
use crate::groups::{FailureGroup, GroupedLetter, LetterState};

/// The most letters read from a topic at once while indexing.
const CHUNK: i64 = 2_000;
/// The most bytes (keys, payloads, headers) read from a topic at once while indexing.
const CHUNK_BYTES: usize = 16 << 20;

/// Whether `pool`'s schema has the dead-letter index (a consumer of this version ran in it).
async fn exists(pool: &PgPool) -> Result<bool, AdminError> {
    Ok(
        sqlx::query_scalar("SELECT to_regclass('saga_dead_letter_scans') IS NOT NULL")
            .fetch_one(pool)
            .await?,
    )
}

/// Applies the consumer's migrations (the index) to `pool`'s schema if its index is missing: a schema no
/// consumer of this version ran in yet. Only an action prepares the index (a replay): a read runs no
/// migration.
pub(crate) async fn prepare(pool: &PgPool) -> Result<(), AdminError> {
    if exists(pool).await? {
        return Ok(());
    }
    saga_consumer::migrate::migrator()
        .run(pool)
        .await
        .map_err(|source| AdminError::Migrations {
            what: "the consumer's migrations",
            source,
        })
}

/// Bad input unless `topic` is a dead-letter topic: one a consumer group of `pool`'s schema writes, or one
/// named as the consumer names them (`….dlq`). Checked before the topic is read.
pub async fn require_dead_letter_topic(pool: &PgPool, topic: &str) -> Result<(), AdminError> {
    if topic.ends_with(".dlq") {
        return Ok(());
    }
    let recorded: bool = sqlx::query_scalar(
        "SELECT to_regclass('saga_consumer_groups') IS NOT NULL \
            AND EXISTS (SELECT 1 FROM saga_consumer_groups WHERE dlq_topic = $1)",
    )
    .bind(topic)
    .fetch_one(pool)
    .await
    .or_else(|e| match &e {
        // No consumer group ever ran in this schema: the table is absent.
        sqlx::Error::Database(d) if d.code().as_deref() == Some("42P01") => Ok(false),
        _ => Err(e),
    })?;
    if recorded {
        Ok(())
    } else {
        Err(AdminError::bad_input(format!(
            "{topic} is not a dead-letter topic: no consumer group of this schema writes it, and its name \
             does not end in .dlq"
        )))
    }
}

/// Makes sure the index of `pool`'s schema holds every letter `topic` holds (see the module
/// documentation). Bad input if the topic does not exist. One sync of a topic runs at a time in a schema
/// (an advisory lock, on a connection of its own: a sync that is dropped midway, its request cancelled,
/// closes it and so lets go of the lock), and it reads the topic's watermarks once it holds it. A sync that
/// finds another running waits for it (it then has little left to do); [`AdminError::Busy`] if the other
/// still runs after [`LOCK_WAIT`].
pub async fn sync(kafka: &KafkaConfig, pool: &PgPool, topic: &str) -> Result<(), AdminError> {
    if !exists(pool).await? {
        return Err(saga_consumer::ConfigProblem::new(
            "SAGA_SCHEMA",
            "names a schema without the dead-letter index (saga_dead_letters): no consumer of this version \
             has run in it",
            "point it at the service's schema, start the service with this version, or replay a letter \
             (a replay prepares the index)",
        )
        .into());
    }
    let Some(mut held) = lock(pool, topic).await? else {
        return Err(AdminError::Busy(format!(
            "another sync of the index of {topic} has run for over {} s",
            LOCK_WAIT.as_secs()
        )));
    };
    let synced = sync_held(kafka, &mut held, topic).await;
    // Closing the connection lets go of the lock.
    let _ = sqlx::Connection::close(held).await;
    synced
}

/// How long a sync waits for another sync of its topic.
pub const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// A connection of its own holding the sync lock of `topic`, or `None` if another sync still holds it
/// after [`LOCK_WAIT`].
async fn lock(pool: &PgPool, topic: &str) -> Result<Option<sqlx::PgConnection>, AdminError> {
    let options = pool.connect_options();
    let mut conn = sqlx::ConnectOptions::connect(&*options).await?;
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    while std::time::Instant::now() < deadline {
        let locked: bool = sqlx::query_scalar(
            "SELECT pg_try_advisory_lock(hashtext('saga_dead_letter_scans'), \
                 hashtext(current_schema() || '/' || $1))",
        )
        .bind(topic)
        .fetch_one(&mut conn)
        .await?;
        if locked {
            return Ok(Some(conn));
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let _ = sqlx::Connection::close(conn).await;
    Ok(None)
}

/// [`sync`], holding its lock on `conn`.
async fn sync_held(
    kafka: &KafkaConfig,
    conn: &mut sqlx::PgConnection,
    topic: &str,
) -> Result<(), AdminError> {
    let partitions = crate::broker::partitions_of(kafka, topic).await?;
    let timed: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema() \
             AND table_name = 'saga_dead_letter_scans' AND column_name = 'synced_at')",
    )
    .fetch_one(&mut *conn)
    .await?;
    for watermarks in partitions {
        sync_partition(kafka, conn, topic, watermarks, timed).await?;
    }
    Ok(())
}

/// Makes sure the index holds every letter of partition `partition` of `topic` between its watermarks
/// (`low`, `high`), and records how far it made sure (and when, where the index has `synced_at`). It
/// writes only what it must: a database user that may only read finds an index that holds every letter
/// up to date, and one that misses letters stale (the insufficient privilege, as the error).
async fn sync_partition(
    kafka: &KafkaConfig,
    conn: &mut sqlx::PgConnection,
    topic: &str,
    (partition, low, high): (i32, i64, i64),
    timed: bool,
) -> Result<(), AdminError> {
    let scanned: Option<i64> = sqlx::query_scalar(
        "SELECT next_offset FROM saga_dead_letter_scans WHERE dlq_topic = $1 AND dlq_partition = $2",
    )
    .bind(topic)
    .bind(partition)
    .fetch_optional(&mut *conn)
    .await?;
    // Below the low watermark, retention deleted the letters. A high watermark below what was made sure
    // of says the topic was recreated (or truncated): what the index holds from there is gone.
    let shrunk = scanned.is_some_and(|n| n > high);
    let gone: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM saga_dead_letters WHERE dlq_topic = $1 AND dlq_partition = $2 \
             AND (dlq_offset < $3 OR ($5 AND dlq_offset >= $4)))",
    )
    .bind(topic)
    .bind(partition)
    .bind(low)
    .bind(high)
    .bind(shrunk)
    .fetch_one(&mut *conn)
    .await?;
    if gone {
        sqlx::query(
            "DELETE FROM saga_dead_letters WHERE dlq_topic = $1 AND dlq_partition = $2 \
             AND (dlq_offset < $3 OR ($5 AND dlq_offset >= $4))",
        )
        .bind(topic)
        .bind(partition)
        .bind(low)
        .bind(high)
        .bind(shrunk)
        .execute(&mut *conn)
        .await?;
    }
    let next = match scanned {
        Some(n) if !shrunk => n.max(low),
        _ => low,
    };
    if next < high {
        index_missing(kafka, conn, topic, partition, (next, high)).await?;
    }
    // Forward only, but after a proven recreation; when, where the index records it (an index an
    // earlier version made does not).
    let sql = if timed {
        "INSERT INTO saga_dead_letter_scans (dlq_topic, dlq_partition, next_offset, synced_at) \
         VALUES ($1, $2, $3, now()) \
         ON CONFLICT (dlq_topic, dlq_partition) DO UPDATE SET synced_at = now(), next_offset = CASE WHEN $4 \
             THEN EXCLUDED.next_offset \
             ELSE GREATEST(saga_dead_letter_scans.next_offset, EXCLUDED.next_offset) END"
    } else {
        "INSERT INTO saga_dead_letter_scans (dlq_topic, dlq_partition, next_offset) VALUES ($1, $2, $3) \
         ON CONFLICT (dlq_topic, dlq_partition) DO UPDATE SET next_offset = CASE WHEN $4 \
             THEN EXCLUDED.next_offset \
             ELSE GREATEST(saga_dead_letter_scans.next_offset, EXCLUDED.next_offset) END"
    };
    let recorded = sqlx::query(sql)
        .bind(topic)
        .bind(partition)
        .bind(high)
        .bind(shrunk)
        .execute(&mut *conn)
        .await;
    match recorded {
        // The index holds every letter (nothing was written above): a user that may only read has
        // nothing to record, and reads it up to date.
        Err(sqlx::Error::Database(d)) if d.code().as_deref() == Some("42501") => {
            tracing::debug!(
                topic,
                partition,
                "the index holds every letter; how far is not recorded"
            );
            Ok(())
        }
        other => Ok(other.map(drop)?),
    }
}

/// Indexes the letters of partition `partition` of `topic` in `[next, high)` that the index misses, reading
/// the topic from the first of them, in bounded chunks.
async fn index_missing(
    kafka: &KafkaConfig,
    conn: &mut sqlx::PgConnection,
    topic: &str,
    partition: i32,
    (next, high): (i64, i64),
) -> Result<(), AdminError> {
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM saga_dead_letters \
         WHERE dlq_topic = $1 AND dlq_partition = $2 AND dlq_offset >= $3 AND dlq_offset < $4",
    )
    .bind(topic)
    .bind(partition)
    .bind(next)
    .bind(high)
    .fetch_one(&mut *conn)
    .await?;
    if held >= high - next {
        return Ok(());
    }
    let first_missing: Option<i64> = sqlx::query_scalar(
        "SELECT min(o) FROM generate_series($3::bigint, $4::bigint - 1) AS o \
         WHERE NOT EXISTS (SELECT 1 FROM saga_dead_letters \
             WHERE dlq_topic = $1 AND dlq_partition = $2 AND dlq_offset = o)",
    )
    .bind(topic)
    .bind(partition)
    .bind(next)
    .bind(high)
    .fetch_one(&mut *conn)
    .await?;
    let mut from = first_missing.unwrap_or(high);
    while from < high {
        let until = (from + CHUNK).min(high);
        let records = dlq::read_bounded(kafka, topic, partition, from, until, CHUNK_BYTES).await?;
        let found: Vec<IndexedLetter> = records.iter().map(|r| indexed(topic, r)).collect();
        index_refusing_none(&mut *conn, &found).await?;
        // The chunk may end early (its bytes, or the partition's end): on from its last one.
        from = records.last().map_or(until, |r| r.offset + 1).max(from + 1);
    }
    Ok(())
}

/// Indexes `found`; should the database refuse one of them for good (a value it cannot hold), the others
/// are indexed one by one and that one is said in the log: one letter never stops the sync of its topic.
async fn index_refusing_none(
    conn: &mut sqlx::PgConnection,
    found: &[IndexedLetter],
) -> Result<(), AdminError> {
    let refused_for_good = |e: &sqlx::Error| {
        matches!(e, sqlx::Error::Database(d)
            if d.code().is_some_and(|c| c.starts_with("22") || c.starts_with("54")))
    };
    match letters::index(&mut *conn, found).await {
        Err(e) if refused_for_good(&e) => {}
        other => return Ok(other?),
    }
    for letter in found {
        match letters::index(&mut *conn, std::slice::from_ref(letter)).await {
            Err(e) if refused_for_good(&e) => tracing::error!(
                topic = %letter.dlq_topic,
                partition = letter.partition,
                offset = letter.offset,
                error = %e,
                "the dead-letter index refuses this letter; it stays in its topic, unindexed"
            ),
            other => other?,
        }
    }
    Ok(())
}

/// `record` of `topic` as the index holds it.
pub(crate) fn indexed(topic: &str, record: &Record) -> IndexedLetter {
    IndexedLetter::of(
        topic,
        (record.partition, record.offset),
        record.key.as_deref(),
        record.payload.as_deref(),
        &record.headers,
        record.timestamp_ms,
    )
}

/// [`sync`] before a read of `topic`'s letters: bad input (the topic does not exist) is the caller's; an
/// index that could not be brought up to date (the broker unreachable or refusing, a database user that
/// may not write the index) must not pass for the topic's letters ("0 dead letters"): the read fails saying
/// how stale the index is, unless it runs in [`crate::freshness::as_indexed`].
pub async fn sync_for_reading(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topic: &str,
) -> Result<(), AdminError> {
    match sync(kafka, pool, topic).await {
        Err(e @ AdminError::BadInput(_)) => Err(e),
        // A schema without the index: the caller's to fix, but a page shows it (under the banner).
        Err(e @ AdminError::Config(_)) if !crate::freshness::reading_as_indexed() => Err(e),
        Err(e) => crate::freshness::stale(pool, topic, &e).await,
        Ok(()) => Ok(()),
    }
}

/// Syncs each of `topics` for reading (see [`sync_for_reading`]): a topic that does not exist holds
/// nothing; one whose index could not be brought up to date fails the read, unless it runs in
/// [`crate::freshness::as_indexed`].
pub async fn sync_all(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topics: &[String],
) -> Result<(), AdminError> {
    for topic in topics {
        match sync_for_reading(kafka, pool, topic).await {
            // Bad input: a topic that does not exist, which holds nothing.
            Err(e @ AdminError::BadInput(_)) => {
                tracing::debug!(topic = %topic, error = %e, "a dead-letter topic holds nothing")
            }
            other => other?,
        }
    }
    Ok(())
}

/// Whether `pool`'s schema has the toolkit's tables of replayed and of discarded letters.
async fn toolkit_tables(pool: &PgPool) -> Result<(bool, bool), AdminError> {
    Ok(sqlx::query_as(
        "SELECT to_regclass('saga_dlq_replays') IS NOT NULL, \
                to_regclass('saga_dlq_discards') IS NOT NULL",
    )
    .fetch_one(pool)
    .await?)
}

/// A letter's state, in SQL over the index row `l`, as the toolkit's tables of `pool`'s schema record it
/// (a schema the toolkit never replayed or discarded in has neither table: every letter is open).
async fn state_sql(pool: &PgPool) -> Result<String, AdminError> {
    let (replays, discards) = toolkit_tables(pool).await?;
    if !replays && !discards {
        return Ok("'open'".to_owned());
    }
    let mut sql = "CASE ".to_owned();
    if replays {
        sql.push_str(
            "WHEN EXISTS (SELECT 1 FROM saga_dlq_replays r WHERE r.dlq_topic = l.dlq_topic \
                AND r.dlq_partition = l.dlq_partition AND r.dlq_offset = l.dlq_offset \
                AND r.replayed_at IS NOT NULL \
                AND (r.letter_hash = l.letter_hash OR (r.letter_hash = '' AND r.replayed_at >= l.failed_at))) \
                THEN 'replayed' ",
        );
    }
    if discards {
        sql.push_str(
            "WHEN EXISTS (SELECT 1 FROM saga_dlq_discards d WHERE d.dlq_topic = l.dlq_topic \
                AND d.dlq_partition = l.dlq_partition AND d.dlq_offset = l.dlq_offset \
                AND d.letter_hash = l.letter_hash AND d.undone_at IS NULL) THEN 'discarded' ",
        );
    }
    sql.push_str("ELSE 'open' END");
    Ok(sql)
}

/// The index's columns of a letter, then its state.
const COLUMNS: &str = "l.dlq_topic, l.dlq_partition, l.dlq_offset, l.letter_hash, l.failure_group, \
    l.consumer_group, l.original_topic, l.original_partition, l.original_offset, l.step, l.reason, l.error, \
    l.attempts, l.failed_at, l.idempotency_key, l.tenant_id, l.truncated, l.replay_count, l.unreadable";

/// Which indexed letters to read.
#[derive(Debug, Clone, Default)]
pub(crate) struct Selection<'a> {
    /// Of these dead-letter topics.
    pub topics: &'a [String],
    /// Of this failure group.
    pub group: Option<&'a str>,
    /// What the filter selects (reason, step, age, position, limit).
    pub filter: Option<&'a DlqFilter>,
    /// Of this saga key (and tenant).
    pub key: Option<(&'a str, Option<&'a str>)>,
    /// After this partition and offset (a page after the one that ended there).
    pub after: Option<(i32, i64)>,
}

/// The indexed letters `selection` selects, by topic, partition and offset, with their state (their
/// records empty: [`dlq::with_records`] reads those).
pub(crate) async fn letters(
    pool: &PgPool,
    selection: &Selection<'_>,
) -> Result<Vec<GroupedLetter>, AdminError> {
    if !exists(pool).await? {
        return Ok(Vec::new());
    }
    let filter = selection.filter.cloned().unwrap_or_default();
    let since = filter
        .since
        .and_then(|s| chrono::Duration::from_std(s).ok())
        .map(|s| Utc::now() - s);
    let limit = filter
        .limit
        .map_or(i64::MAX, |l| i64::try_from(l).unwrap_or(i64::MAX));
    let state = state_sql(pool).await?;
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS}, {state} FROM saga_dead_letters l \
         WHERE l.dlq_topic = ANY($1) AND ($2::text IS NULL OR l.failure_group = $2) \
           AND ($3::text IS NULL OR l.reason = $3) AND ($4::text IS NULL OR l.step = $4) \
           AND ($5::timestamptz IS NULL OR l.failed_at >= $5) \
           AND ($6::int IS NULL OR (l.dlq_partition = $6 AND l.dlq_offset = $7)) \
           AND ($8::text IS NULL OR (l.idempotency_key = $8 AND ($9::text IS NULL OR l.tenant_id = $9))) \
           AND ($11::int IS NULL OR (l.dlq_partition, l.dlq_offset) > ($11, $12)) \
         ORDER BY l.dlq_topic, l.dlq_partition, l.dlq_offset LIMIT $10"
    )))
    .bind(selection.topics)
    .bind(selection.group)
    .bind(filter.reason.as_deref())
    .bind(filter.step.as_deref())
    .bind(since)
    .bind(filter.position.map(|(p, _)| p))
    .bind(filter.position.map_or(0, |(_, o)| o))
    .bind(selection.key.map(|(k, _)| k))
    .bind(selection.key.and_then(|(_, t)| t))
    .bind(limit)
    .bind(selection.after.map(|(p, _)| p))
    .bind(selection.after.map_or(0, |(_, o)| o))
    .fetch_all(pool)
    .await?;
    rows.iter().map(grouped_letter).collect()
}

/// The indexed letters at these positions (topic, partition, offset) with these identities, their records
/// empty: what a discard needs, no topic read. A letter the index no longer holds (its topic's retention
/// deleted it) is left out.
pub(crate) async fn at_positions(
    pool: &PgPool,
    wanted: &[(String, i32, i64, String)],
) -> Result<Vec<DeadLetter>, AdminError> {
    if !exists(pool).await? {
        return Ok(Vec::new());
    }
    let state = state_sql(pool).await?;
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS}, {state} FROM saga_dead_letters l \
         JOIN unnest($2::text[], $3::int[], $4::bigint[], $5::text[]) AS w(t, p, o, h) \
           ON l.dlq_topic = w.t AND l.dlq_partition = w.p AND l.dlq_offset = w.o AND l.letter_hash = w.h \
         WHERE l.dlq_topic = ANY($1)"
    )))
    .bind(
        wanted
            .iter()
            .map(|w| w.0.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect::<Vec<_>>(),
    )
    .bind(wanted.iter().map(|w| w.0.as_str()).collect::<Vec<_>>())
    .bind(wanted.iter().map(|w| w.1).collect::<Vec<_>>())
    .bind(wanted.iter().map(|w| w.2).collect::<Vec<_>>())
    .bind(wanted.iter().map(|w| w.3.as_str()).collect::<Vec<_>>())
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| grouped_letter(r).map(|g| g.letter))
        .collect()
}

/// A row of [`COLUMNS`] and the state.
fn grouped_letter(r: &sqlx::postgres::PgRow) -> Result<GroupedLetter, AdminError> {
    let partition: i32 = r.try_get(1)?;
    let offset: i64 = r.try_get(2)?;
    let attempts: i32 = r.try_get(12)?;
    let replay_count: i32 = r.try_get(17)?;
    let mut fields = LetterFields::read(&[], None);
    fields.original_topic = r.try_get(6)?;
    fields.original_partition = r.try_get(7)?;
    fields.original_offset = r.try_get(8)?;
    fields.group = r.try_get(5)?;
    fields.step = r.try_get(9)?;
    fields.reason = r.try_get(10)?;
    fields.error = r.try_get(11)?;
    fields.attempts = u32::try_from(attempts).unwrap_or_default();
    fields.failed_at = r.try_get(13)?;
    fields.idempotency_key = r.try_get(14)?;
    fields.tenant = r.try_get(15)?;
    fields.truncated = r.try_get(16)?;
    fields.replay_count = u32::try_from(replay_count).unwrap_or_default();
    fields.unreadable = r.try_get(18)?;
    let topic: String = r.try_get(0)?;
    let letter = DeadLetter::from_index(
        &topic,
        (partition, offset),
        fields,
        r.try_get::<String, _>(3)?,
    );
    let state = match r.try_get::<&str, _>(19)? {
        "replayed" => LetterState::Replayed,
        "discarded" => LetterState::Discarded,
        _ => LetterState::Open,
    };
    Ok(GroupedLetter {
        group_id: r.try_get(4)?,
        letter,
        state,
    })
}

/// The letters of `$1`'s topics that are not open (replayed or discarded), one row each with `column` of
/// theirs, in SQL: driven by the toolkit's tables (the few letters acted on), never a check per letter.
async fn closed_sql(pool: &PgPool, column: &str) -> Result<String, AdminError> {
    let (replays, discards) = toolkit_tables(pool).await?;
    let mut parts = Vec::new();
    if replays {
        parts.push(format!(
            "SELECT l.dlq_topic, l.dlq_partition, l.dlq_offset, l.{column} AS k \
             FROM saga_dlq_replays r JOIN saga_dead_letters l USING (dlq_topic, dlq_partition, dlq_offset) \
             WHERE r.dlq_topic = ANY($1) AND r.replayed_at IS NOT NULL \
               AND (r.letter_hash = l.letter_hash OR (r.letter_hash = '' AND r.replayed_at >= l.failed_at))"
        ));
    }
    if discards {
        parts.push(format!(
            "SELECT l.dlq_topic, l.dlq_partition, l.dlq_offset, l.{column} AS k \
             FROM saga_dlq_discards d JOIN saga_dead_letters l USING (dlq_topic, dlq_partition, dlq_offset) \
             WHERE d.dlq_topic = ANY($1) AND d.undone_at IS NULL AND d.letter_hash = l.letter_hash"
        ));
    }
    if parts.is_empty() {
        parts.push(
            "SELECT NULL::text AS dlq_topic, NULL::int AS dlq_partition, NULL::bigint AS dlq_offset, \
             NULL::text AS k WHERE false"
                .to_owned(),
        );
    }
    Ok(format!(
        "SELECT c.dlq_topic, c.k, count(*) AS n FROM ({}) c GROUP BY 1, 2",
        parts.join(" UNION ")
    ))
}

/// The failure groups of `topics`, the most open letters first: counted in the index (an aggregate; the
/// letters acted on counted from the toolkit's tables; each group's latest letter by its index).
pub(crate) async fn groups(
    pool: &PgPool,
    topics: &[String],
) -> Result<Vec<FailureGroup>, AdminError> {
    if !exists(pool).await? {
        return Ok(Vec::new());
    }
    let closed = closed_sql(pool, "failure_group").await?;
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "WITH g AS (SELECT dlq_topic, failure_group, min(consumer_group) AS consumer_group, \
                 min(step) AS step, min(reason) AS reason, min(cause) AS cause, count(*) AS total, \
                 min(failed_at) AS first_seen, max(failed_at) AS last_seen \
             FROM saga_dead_letters WHERE dlq_topic = ANY($1) GROUP BY dlq_topic, failure_group), \
         closed AS ({closed}) \
         SELECT g.failure_group, g.dlq_topic, g.consumer_group, g.step, g.reason, g.cause, \
                g.total - coalesce(closed.n, 0) AS open, g.total, g.first_seen, g.last_seen, \
                e.error, e.dlq_partition, e.dlq_offset \
         FROM g LEFT JOIN closed ON closed.dlq_topic = g.dlq_topic AND closed.k = g.failure_group \
         CROSS JOIN LATERAL (SELECT x.error, x.dlq_partition, x.dlq_offset FROM saga_dead_letters x \
             WHERE x.dlq_topic = g.dlq_topic AND x.failure_group = g.failure_group \
             ORDER BY x.failed_at DESC, x.dlq_partition DESC, x.dlq_offset DESC LIMIT 1) e \
         ORDER BY open DESC, g.last_seen DESC, g.failure_group"
    )))
    .bind(topics)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            let open: i64 = r.try_get(6)?;
            let total: i64 = r.try_get(7)?;
            Ok(FailureGroup {
                id: r.try_get(0)?,
                dlq_topic: r.try_get(1)?,
                consumer_group: r.try_get(2)?,
                step: r.try_get(3)?,
                reason: r.try_get(4)?,
                cause: r.try_get(5)?,
                open: usize::try_from(open).unwrap_or_default(),
                total: usize::try_from(total).unwrap_or_default(),
                first_seen: r.try_get(8)?,
                last_seen: r.try_get(9)?,
                example_error: r.try_get(10)?,
                example_position: (r.try_get(11)?, r.try_get(12)?),
                held_keys: 0,
                parked: 0,
                oldest_held_seconds: None,
            })
        })
        .collect()
}

/// Letters by (dead-letter topic, reason), with how many of them are open, over `topics`.
pub(crate) async fn counts(
    pool: &PgPool,
    topics: &[String],
) -> Result<BTreeMap<(String, String), (usize, usize)>, AdminError> {
    if !exists(pool).await? {
        return Ok(BTreeMap::new());
    }
    let closed = closed_sql(pool, "reason").await?;
    let rows: Vec<(String, String, i64, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "WITH t AS (SELECT dlq_topic, reason, count(*) AS total FROM saga_dead_letters \
             WHERE dlq_topic = ANY($1) GROUP BY dlq_topic, reason), \
         closed AS ({closed}) \
         SELECT t.dlq_topic, t.reason, t.total, t.total - coalesce(closed.n, 0) FROM t \
         LEFT JOIN closed ON closed.dlq_topic = t.dlq_topic AND closed.k = t.reason ORDER BY 1, 2"
    )))
    .bind(topics)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(topic, reason, total, open)| {
            (
                (topic, reason),
                (
                    usize::try_from(total).unwrap_or_default(),
                    usize::try_from(open).unwrap_or_default(),
                ),
            )
        })
        .collect())
}
