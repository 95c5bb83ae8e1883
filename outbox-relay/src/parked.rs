//! Parked events of the WAL outbox (`saga_outbox_wal_parked`): what the WAL relay could not publish, set
//! aside with the reason so that the slot moves on, together with every later event of their key, in commit
//! order. They are published again, in order, by the relay (automatically, with a growing pause between
//! attempts, and at once after `saga outbox retry`), or discarded by an operator (`saga outbox discard`),
//! which lets the key's later events go.
//!
//! Each event is parked once, by its place in the log (the message's LSN and the event's index in it): a
//! relay that reads the same events again after a crash, before it confirmed them, parks nothing twice.

use chrono::{DateTime, Utc};
use sqlx::{PgPool, Row};

use crate::publisher::OrderKey;
use crate::store::OutboxRow;

/// An event to park.
#[derive(Debug, Clone)]
pub(crate) struct ToPark<'a> {
    /// The event.
    pub row: &'a OutboxRow,
    /// Its tenant.
    pub tenant: &'a str,
    /// The end of its transaction's commit record, as text.
    pub commit_lsn: String,
    /// Its logical message's position, as text.
    pub message_lsn: String,
    /// Its index in that message.
    pub index: i32,
    /// Why.
    pub error: String,
    /// Failed attempts so far.
    pub attempts: u32,
}

/// Parks `events` in order, each once (by its place in the log). Returns how many were new.
pub(crate) async fn park(pool: &PgPool, events: &[ToPark<'_>]) -> Result<u64, sqlx::Error> {
    if events.is_empty() {
        return Ok(0);
    }
    let mut commit_lsns = Vec::with_capacity(events.len());
    let mut message_lsns = Vec::with_capacity(events.len());
    let mut indices = Vec::with_capacity(events.len());
    let mut tenants = Vec::with_capacity(events.len());
    let mut topics = Vec::with_capacity(events.len());
    let mut keys = Vec::with_capacity(events.len());
    let mut headers = Vec::with_capacity(events.len());
    let mut payloads = Vec::with_capacity(events.len());
    let mut errors = Vec::with_capacity(events.len());
    let mut attempts = Vec::with_capacity(events.len());
    for e in events {
        commit_lsns.push(e.commit_lsn.as_str());
        message_lsns.push(e.message_lsn.as_str());
        indices.push(e.index);
        tenants.push(e.tenant);
        topics.push(e.row.topic.as_str());
        keys.push(e.row.partition_key.as_deref());
        headers.push(saga_runtime::store::outbox::headers_literal(&e.row.headers));
        payloads.push(e.row.payload.as_deref());
        errors.push(e.error.as_str());
        attempts.push(i32::try_from(e.attempts).unwrap_or(i32::MAX));
    }
    let done = sqlx::query(
        "INSERT INTO saga_outbox_wal_parked (commit_lsn, message_lsn, event_index, tenant_id, topic, \
             partition_key, headers, payload, error, attempts, holds_key) \
         SELECT e.commit_lsn, e.message_lsn::pg_lsn, e.idx, e.tenant, e.topic, e.key, e.headers::text[], \
                e.payload, e.error, e.attempts, true \
         FROM unnest($1::text[], $2::text[], $3::int[], $4::text[], $5::text[], $6::text[], $7::text[], \
                     $8::bytea[], $9::text[], $10::int[]) WITH ORDINALITY \
              AS e(commit_lsn, message_lsn, idx, tenant, topic, key, headers, payload, error, attempts, ord) \
         ORDER BY e.ord \
         ON CONFLICT (message_lsn, event_index) DO NOTHING",
    )
    .bind(&commit_lsns)
    .bind(&message_lsns)
    .bind(&indices)
    .bind(&tenants)
    .bind(&topics)
    .bind(&keys)
    .bind(&headers)
    .bind(&payloads)
    .bind(&errors)
    .bind(&attempts)
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

/// Parks a logical message that does not decode, whole, once: it holds no key (it has none to hold).
pub(crate) async fn park_undecodable(
    pool: &PgPool,
    commit_lsn: &str,
    message_lsn: &str,
    content: &[u8],
    error: &str,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO saga_outbox_wal_parked (commit_lsn, message_lsn, event_index, tenant_id, topic, payload, \
             error, attempts, holds_key) \
         VALUES ($1, $2::pg_lsn, -1, '', '', $3, $4, 0, false) \
         ON CONFLICT (message_lsn, event_index) DO NOTHING",
    )
    .bind(commit_lsn)
    .bind(message_lsn)
    .bind(content)
    .bind(error)
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

/// The keys held: those with parked events not yet published or discarded, and those with rows of the
/// table outbox not yet published, parked or not (their events in the log must not overtake them: a parked
/// row an operator lets go is published by the table's loop, after which its key's events follow).
pub(crate) async fn held_keys(pool: &PgPool) -> Result<Vec<OrderKey>, sqlx::Error> {
    sqlx::query_as(
        "SELECT topic, partition_key FROM saga_outbox_wal_parked \
         WHERE published_at IS NULL AND discarded_at IS NULL AND holds_key \
         UNION \
         SELECT topic, partition_key FROM saga_outbox WHERE parked_at IS NOT NULL AND published_at IS NULL \
         UNION \
         SELECT topic, partition_key FROM saga_outbox WHERE published_at IS NULL AND parked_at IS NULL",
    )
    .fetch_all(pool)
    .await
}

/// Up to `limit` parked events to publish again, in order: every open event of each key whose next attempt
/// is due and that no unpublished row of the table outbox holds. A row's id is its id in the table.
pub(crate) async fn due(pool: &PgPool, limit: i64) -> Result<Vec<OutboxRow>, sqlx::Error> {
    let rows = sqlx::query(
        "WITH due AS ( \
             SELECT topic, partition_key FROM saga_outbox_wal_parked \
             WHERE published_at IS NULL AND discarded_at IS NULL AND holds_key \
             GROUP BY topic, partition_key HAVING min(next_attempt_at) <= now()) \
         SELECT o.id, o.topic, o.partition_key, o.headers, o.payload, o.parked_at \
         FROM saga_outbox_wal_parked o \
         JOIN due d ON d.topic = o.topic AND d.partition_key IS NOT DISTINCT FROM o.partition_key \
         WHERE o.published_at IS NULL AND o.discarded_at IS NULL AND o.holds_key \
           AND NOT EXISTS (SELECT 1 FROM saga_outbox t \
                           WHERE t.published_at IS NULL AND t.parked_at IS NULL \
                             AND t.topic = o.topic AND t.partition_key IS NOT DISTINCT FROM o.partition_key) \
           AND NOT EXISTS (SELECT 1 FROM saga_outbox t \
                           WHERE t.parked_at IS NOT NULL AND t.published_at IS NULL \
                             AND t.topic = o.topic AND t.partition_key IS NOT DISTINCT FROM o.partition_key) \
         ORDER BY o.id LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await?;
    rows.iter().map(OutboxRow::read).collect()
}

/// Marks parked events `ids` published.
pub(crate) async fn published(pool: &PgPool, ids: &[i64]) -> Result<(), sqlx::Error> {
    if ids.is_empty() {
        return Ok(());
    }
    sqlx::query("UPDATE saga_outbox_wal_parked SET published_at = now() WHERE id = ANY($1)")
        .bind(ids)
        .execute(pool)
        .await?;
    Ok(())
}

/// Parked event `id` failed again with `error`: its key's next attempt waits (1 s, doubling with its
/// attempts, up to 5 minutes).
pub(crate) async fn failed_again(pool: &PgPool, id: i64, error: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "WITH head AS ( \
             UPDATE saga_outbox_wal_parked SET attempts = attempts + 1, error = $2 WHERE id = $1 \
             RETURNING topic, partition_key, attempts) \
         UPDATE saga_outbox_wal_parked p \
         SET next_attempt_at = now() + least(interval '1 second' * power(2, least(h.attempts, 12)), \
                                             interval '5 minutes') \
         FROM head h \
         WHERE p.topic = h.topic AND p.partition_key IS NOT DISTINCT FROM h.partition_key \
           AND p.published_at IS NULL AND p.discarded_at IS NULL",
    )
    .bind(id)
    .bind(error)
    .execute(pool)
    .await?;
    Ok(())
}

/// A parked event of the WAL outbox, as operators see it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ParkedEvent {
    /// Its id (`saga outbox retry --id`, `saga outbox discard --id`).
    pub id: i64,
    /// The topic.
    pub topic: String,
    /// The Kafka key.
    pub partition_key: Option<String>,
    /// Why it was parked (the broker's error, or that it waits behind an earlier event of its key).
    pub error: String,
    /// Failed attempts.
    pub attempts: i32,
    /// When it was parked.
    pub parked_at: DateTime<Utc>,
    /// When the relay tries it again.
    pub next_attempt_at: DateTime<Utc>,
    /// Its transaction's commit position.
    pub commit_lsn: String,
    /// Whether it holds its key (events parked before 0.3 do not).
    pub holds_key: bool,
    /// The payload's size in bytes.
    pub payload_bytes: i64,
}

/// The parked events not yet published or discarded, oldest first, at most `limit`.
pub async fn parked_events(pool: &PgPool, limit: i64) -> Result<Vec<ParkedEvent>, sqlx::Error> {
    let exists: bool =
        sqlx::query_scalar("SELECT to_regclass('saga_outbox_wal_parked') IS NOT NULL")
            .fetch_one(pool)
            .await?;
    if !exists {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(
        "SELECT id, topic, partition_key, error, attempts, parked_at, next_attempt_at, commit_lsn, \
                coalesce(holds_key, false), coalesce(octet_length(payload), 0)::bigint \
         FROM saga_outbox_wal_parked WHERE published_at IS NULL AND discarded_at IS NULL \
         ORDER BY id LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await?;
    rows.into_iter()
        .map(|r| {
            Ok(ParkedEvent {
                id: r.try_get(0)?,
                topic: r.try_get(1)?,
                partition_key: r.try_get(2)?,
                error: r.try_get(3)?,
                attempts: r.try_get(4)?,
                parked_at: r.try_get(5)?,
                next_attempt_at: r.try_get(6)?,
                commit_lsn: r.try_get(7)?,
                holds_key: r.try_get(8)?,
                payload_bytes: r.try_get(9)?,
            })
        })
        .collect()
}

/// Asks the relay to publish parked events again at its next round (within a second or so): event `id`'s
/// key, or every key with `None`, with the parked rows of the table outbox of the same keys (unparked: a
/// relay publishes them at its next fetch). Events parked before 0.3, which hold no key, are made to (their
/// key's later events then wait for them). Returns the events and rows concerned.
pub async fn retry_parked(pool: &PgPool, id: Option<i64>) -> Result<u64, sqlx::Error> {
    let rows = sqlx::query(
        "UPDATE saga_outbox t SET parked_at = NULL \
         WHERE t.parked_at IS NOT NULL AND t.published_at IS NULL \
           AND ($1::bigint IS NULL OR EXISTS ( \
                SELECT 1 FROM saga_outbox_wal_parked h WHERE h.id = $1 \
                  AND h.topic = t.topic AND h.partition_key IS NOT DISTINCT FROM t.partition_key))",
    )
    .bind(id)
    .execute(pool)
    .await?;
    let done = sqlx::query(
        "UPDATE saga_outbox_wal_parked p SET next_attempt_at = now(), holds_key = true \
         WHERE p.published_at IS NULL AND p.discarded_at IS NULL AND p.event_index IS DISTINCT FROM -1 \
           AND ($1::bigint IS NULL OR EXISTS ( \
                SELECT 1 FROM saga_outbox_wal_parked h WHERE h.id = $1 \
                  AND h.topic = p.topic AND h.partition_key IS NOT DISTINCT FROM p.partition_key))",
    )
    .bind(id)
    .execute(pool)
    .await?;
    Ok(done.rows_affected() + rows.rows_affected())
}

/// Discards parked event `id` (never published; recorded with `operator`): its key's later events go on.
/// Returns whether it was an open parked event.
pub async fn discard_parked(pool: &PgPool, id: i64, operator: &str) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE saga_outbox_wal_parked SET discarded_at = now(), discarded_by = $2 \
         WHERE id = $1 AND published_at IS NULL AND discarded_at IS NULL",
    )
    .bind(id)
    .bind(operator)
    .execute(pool)
    .await?;
    Ok(done.rows_affected() == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(key: &str) -> OutboxRow {
        OutboxRow {
            id: 0,
            topic: "orders".to_owned(),
            partition_key: Some(key.to_owned()),
            headers: vec![("ce_type".to_owned(), "X".to_owned())],
            payload: Some(b"{}".to_vec()),
            created_at: Utc::now(),
        }
    }

    /// A relay that parked events and died before confirming the slot reads them again: parking them again
    /// adds nothing, and what it parks after them comes after them.
    #[tokio::test]
    async fn parking_the_same_events_again_after_a_crash_adds_nothing() {
        let db = saga_test_support::TestDb::new("relay-park-once").await;
        let (first, second, third) = (row("k"), row("k"), row("k"));
        let event = |row, message_lsn: &str, index| ToPark {
            row,
            tenant: "default",
            commit_lsn: "0/100".to_owned(),
            message_lsn: message_lsn.to_owned(),
            index,
            error: "refused".to_owned(),
            attempts: 1,
        };
        let before_crash = [event(&first, "0/10", 0), event(&second, "0/10", 1)];
        assert_eq!(park(&db.pool, &before_crash).await.unwrap(), 2);
        // Read again after the crash, with the key's next event.
        let after = [
            event(&first, "0/10", 0),
            event(&second, "0/10", 1),
            event(&third, "0/20", 0),
        ];
        assert_eq!(park(&db.pool, &after).await.unwrap(), 1, "only the new one");
        let positions: Vec<(String, i32)> = sqlx::query_as(
            "SELECT message_lsn::text, event_index FROM saga_outbox_wal_parked ORDER BY id",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            positions,
            [
                ("0/10".to_owned(), 0),
                ("0/10".to_owned(), 1),
                ("0/20".to_owned(), 0)
            ],
            "each once, in commit order"
        );
        assert_eq!(
            held_keys(&db.pool).await.unwrap(),
            [("orders".to_owned(), Some("k".to_owned()))]
        );
        assert_eq!(
            park_undecodable(&db.pool, "0/100", "0/30", b"junk", "bad")
                .await
                .unwrap()
                + park_undecodable(&db.pool, "0/100", "0/30", b"junk", "bad")
                    .await
                    .unwrap(),
            1
        );
    }
}
