//! The outbox on PostgreSQL's write-ahead log: a transaction's events as one transactional logical message
//! (`pg_logical_emit_message`), which logical decoding delivers to the relay at commit, in commit order, with
//! no table, no index, no lock and nothing to delete afterwards.
//!
//! - **Mode.** [`OutboxMode`]: `table` (the default: needs no server setting) or `wal` (`SAGA_OUTBOX_MODE`).
//!   One mode per process: every writer of the framework (steps, the HTTP layer, the orchestrator) goes
//!   through [`super::outbox::append`], which follows [`mode`].
//! - **Write.** [`emit`]: one statement per transaction, `pg_logical_emit_message(true, 'saga-outbox:' ||
//!   current_schema(), batch)`, the batch [`encode`]d by this module.
//! - **Read.** The relay reads the schema's slot ([`slot_name`]) through the `pgoutput` plugin with logical
//!   messages on, keeps the messages of its [`prefix`], and [`decode`]s them.
//! - **Set-up.** [`prepare`]: logical decoding must be on (`wal_level = logical`); the publication
//!   `pgoutput` needs (empty: only messages are read) and the schema's slot are created where missing. A
//!   message written before its slot exists is never decoded, so a service in WAL mode prepares before
//!   its first write.
//!
//! ## The encoding
//!
//! `SOW1`, then the number of events (u32, big-endian), then each event: tenant, topic, key (a flag byte, 1
//! and the text, or 0), the number of headers (u32) and each name and value, the payload. Texts and the
//! payload are a length (u32) and their bytes; texts are UTF-8. [`decode`] refuses anything else, naming
//! what: it reads what the database hands the relay, and must never panic.

use std::sync::atomic::{AtomicU8, Ordering};

use saga_core::{ConfigProblem, OutboxMessage};
use sqlx::{PgConnection, PgPool};

pub use saga_core::OutboxMode;

static MODE: AtomicU8 = AtomicU8::new(0);

/// Sets the process's outbox mode (a service sets it once, at start).
pub fn set_mode(mode: OutboxMode) {
    MODE.store(u8::from(mode == OutboxMode::Wal), Ordering::Relaxed);
}

/// The process's outbox mode.
pub fn mode() -> OutboxMode {
    if MODE.load(Ordering::Relaxed) == 1 {
        OutboxMode::Wal
    } else {
        OutboxMode::Table
    }
}

/// The publication the `pgoutput` plugin is started with: it holds no table (only messages are read).
pub const PUBLICATION: &str = "saga_outbox_wal";

/// The prefix of the logical messages of `schema`'s outbox.
pub fn prefix(schema: &str) -> String {
    format!("saga-outbox:{schema}")
}

/// The replication slot of `schema`'s outbox: `saga_outbox_{schema}`, lower-case letters, digits and `_`
/// only, at most 63 bytes (a schema name that does not fit is shortened and given a hash of itself).
pub fn slot_name(schema: &str) -> String {
    let clean: String = schema
        .chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_lowercase() || c.is_ascii_digit() {
                c
            } else {
                '_'
            }
        })
        .collect();
    let name = format!("saga_outbox_{clean}");
    if name.len() <= 63 && clean == schema {
        return name;
    }
    // FNV-1a: stable across versions and processes.
    let hash = schema.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let keep = 63 - 17;
    format!("{}_{hash:016x}", &name[..name.len().min(keep)])
}

/// A decoded event of the write-ahead log's outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalEvent {
    /// The tenant.
    pub tenant: String,
    /// The topic.
    pub topic: String,
    /// The Kafka key.
    pub partition_key: Option<String>,
    /// The headers, in order.
    pub headers: Vec<(String, String)>,
    /// The payload.
    pub payload: Vec<u8>,
}

const MAGIC: &[u8; 4] = b"SOW1";

/// `messages` in the encoding of the module documentation.
pub fn encode(messages: &[OutboxMessage]) -> Vec<u8> {
    let size: usize = messages
        .iter()
        .map(|m| {
            32 + m.tenant.as_str().len()
                + m.topic.len()
                + m.partition_key.as_ref().map_or(0, String::len)
                + m.headers
                    .iter()
                    .map(|(n, v)| 8 + n.len() + v.len())
                    .sum::<usize>()
                + m.payload.len()
        })
        .sum();
    let mut out = Vec::with_capacity(8 + size);
    out.extend_from_slice(MAGIC);
    put_len(&mut out, messages.len());
    for m in messages {
        put_bytes(&mut out, m.tenant.as_str().as_bytes());
        put_bytes(&mut out, m.topic.as_bytes());
        match &m.partition_key {
            Some(key) => {
                out.push(1);
                put_bytes(&mut out, key.as_bytes());
            }
            None => out.push(0),
        }
        put_len(&mut out, m.headers.len());
        for (name, value) in &m.headers {
            put_bytes(&mut out, name.as_bytes());
            put_bytes(&mut out, value.as_bytes());
        }
        put_bytes(&mut out, &m.payload);
    }
    out
}

fn put_len(out: &mut Vec<u8>, len: usize) {
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_len(out, bytes.len());
    out.extend_from_slice(bytes);
}

/// Why a logical message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("an outbox message of the write-ahead log does not decode: {0}")]
pub struct DecodeError(String);

/// Decodes a batch [`encode`] made. Refuses, naming what, anything else: an unknown version, a length
/// beyond the message, text that is not UTF-8, bytes left over.
pub fn decode(bytes: &[u8]) -> Result<Vec<WalEvent>, DecodeError> {
    let mut r = Reader { bytes, at: 0 };
    if r.take(4, "the version")? != MAGIC {
        return Err(DecodeError("an unknown version (not SOW1)".into()));
    }
    let count = r.len("the number of events")?;
    // Each event takes at least 21 bytes: a count beyond that is a lie.
    if count > bytes.len() / 21 {
        return Err(DecodeError(format!(
            "{count} events do not fit in {} bytes",
            bytes.len()
        )));
    }
    let mut events = Vec::with_capacity(count);
    for _ in 0..count {
        let tenant = r.text("a tenant")?;
        let topic = r.text("a topic")?;
        let partition_key = match r.take(1, "a key's flag")?[0] {
            0 => None,
            1 => Some(r.text("a key")?),
            other => return Err(DecodeError(format!("a key's flag is {other}"))),
        };
        let headers_count = r.len("the number of headers")?;
        if headers_count > (bytes.len() - r.at) / 8 {
            return Err(DecodeError(format!(
                "{headers_count} headers do not fit in what is left"
            )));
        }
        let mut headers = Vec::with_capacity(headers_count);
        for _ in 0..headers_count {
            headers.push((r.text("a header's name")?, r.text("a header's value")?));
        }
        let payload = r.bytes("a payload")?.to_vec();
        events.push(WalEvent {
            tenant,
            topic,
            partition_key,
            headers,
            payload,
        });
    }
    if r.at != bytes.len() {
        return Err(DecodeError(format!(
            "{} bytes are left over",
            bytes.len() - r.at
        )));
    }
    Ok(events)
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|end| *end <= self.bytes.len())
            .ok_or_else(|| DecodeError(format!("{what} runs past the end")))?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }

    fn len(&mut self, what: &str) -> Result<usize, DecodeError> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }

    fn bytes(&mut self, what: &str) -> Result<&'a [u8], DecodeError> {
        let n = self.len(what)?;
        self.take(n, what)
    }

    fn text(&mut self, what: &str) -> Result<String, DecodeError> {
        let b = self.bytes(what)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError(format!("{what} is not UTF-8")))
    }
}

/// Writes `messages` to the write-ahead log in the caller's transaction, as one transactional logical
/// message of the current schema's prefix: decoded for the relay when the transaction commits, never if it
/// rolls back.
pub async fn emit(conn: &mut PgConnection, messages: &[OutboxMessage]) -> Result<(), sqlx::Error> {
    if messages.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "SELECT pg_logical_emit_message(true, 'saga-outbox:' || current_schema(), $1::bytea)",
    )
    .bind(encode(messages))
    .execute(conn)
    .await?;
    Ok(())
}

/// What [`prepare`] set up: the slot and the prefix of a schema's outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalOutbox {
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
    /// A server setting is missing (names it).
    #[error(transparent)]
    Config(#[from] ConfigProblem),
    /// The database failed.
    #[error("preparing the WAL outbox: {0}")]
    Database(#[from] sqlx::Error),
}

/// Checks that logical decoding is on and creates what the WAL outbox of `pool`'s schema needs where missing:
/// the publication and the schema's slot. Safe to run from several processes at once.
pub async fn prepare(pool: &PgPool) -> Result<WalOutbox, PrepareError> {
    let mut conn = pool.acquire().await?;
    let (wal_level, schema): (String, String) =
        sqlx::query_as("SELECT current_setting('wal_level'), current_schema()::text")
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
    let slot = slot_name(&schema);
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
    wait_until_decoding(&mut conn, &schema, &slot).await?;
    Ok(WalOutbox {
        prefix: prefix(&schema),
        schema,
        slot,
    })
}

/// How long [`prepare`] waits for a slot that another process is creating.
const SLOT_CREATION_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// Creates `slot` where missing and waits until it decodes. Another process (a service and its relay start
/// together) may be creating it: a slot exists by name from the start of its creation, while PostgreSQL
/// waits for the transactions running then to end before it decodes anything, and a message written before
/// that point is never decoded. So a process may write only once the slot has its start
/// (`confirmed_flush_lsn`); should the slot vanish meanwhile (its creator died), it creates it itself.
async fn wait_until_decoding(
    conn: &mut PgConnection,
    schema: &str,
    slot: &str,
) -> Result<(), PrepareError> {
    let deadline = std::time::Instant::now() + SLOT_CREATION_WAIT;
    loop {
        let decodes: Option<bool> = sqlx::query_scalar(
            "SELECT confirmed_flush_lsn IS NOT NULL FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(slot)
        .fetch_optional(&mut *conn)
        .await?;
        match decodes {
            Some(true) => return Ok(()),
            None => {
                let created = ignore_duplicate(
                    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
                        .bind(slot)
                        .execute(&mut *conn)
                        .await,
                )?;
                if created {
                    tracing::info!(%schema, %slot, "created the WAL outbox's replication slot");
                }
            }
            Some(false) if std::time::Instant::now() >= deadline => {
                return Err(ConfigProblem::new(
                    "SAGA_OUTBOX_MODE",
                    format!(
                        "is wal, but the slot {slot} is still being created after {}s: PostgreSQL waits \
                         for the transactions that were running when it began to end",
                        SLOT_CREATION_WAIT.as_secs()
                    ),
                    "end the long-running transactions (pg_stat_activity), then start again",
                )
                .into());
            }
            Some(false) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
        }
    }
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

/// Drops `schema`'s slot if it exists and no relay reads it (for tests and for taking a schema down: an
/// abandoned slot keeps the server's write-ahead log from being recycled).
pub async fn drop_slot(conn: &mut PgConnection, schema: &str) -> Result<bool, sqlx::Error> {
    let dropped: Option<bool> = sqlx::query_scalar(
        "SELECT pg_drop_replication_slot(slot_name) IS NOT NULL FROM pg_replication_slots \
         WHERE slot_name = $1 AND NOT active",
    )
    .bind(slot_name(schema))
    .fetch_optional(conn)
    .await?;
    Ok(dropped.is_some())
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
    /// behind `max_slot_wal_keep_size` and its unread events are gone).
    pub wal_status: Option<String>,
}

/// A slot's row: name, active, bytes behind, seconds behind, its log's status.
type SlotRow = (String, bool, Option<i64>, Option<f64>, Option<String>);

/// The lag of `schema`'s slot; `None` if it has none.
pub async fn slot_lag(pool: &PgPool, schema: &str) -> Result<Option<SlotLag>, sqlx::Error> {
    let row: Option<SlotRow> = sqlx::query_as(
        "SELECT s.slot_name::text, s.active, \
                pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint, \
                extract(epoch FROM r.replay_lag)::float8, s.wal_status \
         FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid \
         WHERE s.slot_name = $1",
    )
    .bind(slot_name(schema))
    .fetch_optional(pool)
    .await?;
    Ok(
        row.map(|(slot, active, bytes, seconds, wal_status)| SlotLag {
            slot,
            active,
            lag_bytes: bytes.unwrap_or(0).max(0),
            lag_seconds: seconds,
            wal_status,
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use saga_core::TenantId;

    fn message(
        topic: &str,
        key: Option<&str>,
        headers: &[(&str, &str)],
        payload: &[u8],
    ) -> OutboxMessage {
        OutboxMessage {
            tenant: TenantId::default(),
            topic: topic.to_owned(),
            partition_key: key.map(str::to_owned),
            headers: headers
                .iter()
                .map(|(n, v)| ((*n).to_owned().into(), (*v).to_owned().into()))
                .collect(),
            payload: payload.to_vec(),
        }
    }

    #[test]
    fn a_batch_decodes_to_what_was_encoded() {
        let batch = [
            message(
                "orders",
                Some("k-1"),
                &[("ce_type", "OrderCreated"), ("x", "")],
                b"{\"a\":1}",
            ),
            message("payments", None, &[], b""),
            message("ünïcödé", Some(""), &[("k", "v\"\\\n")], &[0, 255, 10]),
        ];
        let decoded = decode(&encode(&batch)).unwrap();
        assert_eq!(decoded.len(), 3);
        for (d, m) in decoded.iter().zip(&batch) {
            assert_eq!(d.tenant, m.tenant.as_str());
            assert_eq!(d.topic, m.topic);
            assert_eq!(d.partition_key, m.partition_key);
            let sent: Vec<(&str, &str)> = m.headers.iter().map(|(n, v)| (&**n, &**v)).collect();
            let received: Vec<(&str, &str)> = d.headers.iter().map(|(n, v)| (&**n, &**v)).collect();
            assert_eq!(received, sent);
            assert_eq!(d.payload, m.payload);
        }
        assert_eq!(decode(&encode(&[])).unwrap(), []);
    }

    #[test]
    fn anything_else_is_refused_naming_what_never_a_panic() {
        let good = encode(&[message("t", Some("k"), &[("h", "v")], b"p")]);
        // Every truncation, and every single byte changed, decodes or is refused: never a panic.
        for end in 0..good.len() {
            assert!(decode(&good[..end]).is_err(), "truncated at {end}");
        }
        for at in 0..good.len() {
            for value in [0u8, 1, 0x7f, 0xff] {
                let mut bad = good.clone();
                bad[at] = value;
                let _ = decode(&bad);
            }
        }
        let mut extra = good;
        extra.push(0);
        assert_eq!(decode(&extra).unwrap_err().0, "1 bytes are left over");
        assert!(decode(b"SOW2\0\0\0\0").unwrap_err().0.contains("version"));
        // A count that cannot fit is refused before anything is allocated for it.
        let mut huge = b"SOW1".to_vec();
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode(&huge).unwrap_err().0.contains("do not fit"));
        // One event whose tenant is the byte 0xff: a topic "t", no key, no header, an empty payload.
        let mut not_utf8 = b"SOW1\0\0\0\x01\0\0\0\x01\xff\0\0\0\x01t\0".to_vec();
        not_utf8.extend_from_slice(&[0; 8]);
        assert!(
            decode(&not_utf8)
                .unwrap_err()
                .0
                .contains("a tenant is not UTF-8"),
            "{:?}",
            decode(&not_utf8)
        );
    }

    #[test]
    fn slot_names_are_valid_and_distinct() {
        assert_eq!(slot_name("saga_payment"), "saga_outbox_saga_payment");
        let long = "s".repeat(80);
        let odd = "Saga-Payment";
        for schema in [long.as_str(), odd, "t_x_1795601930_a3b84994"] {
            let slot = slot_name(schema);
            assert!(slot.len() <= 63, "{slot}");
            assert!(
                slot.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
                "{slot}"
            );
        }
        assert_ne!(
            slot_name("Saga-Payment"),
            slot_name("saga_payment"),
            "not folded together"
        );
        assert_eq!(OutboxMode::parse("WAL").unwrap(), OutboxMode::Wal);
        assert!(OutboxMode::parse("kafka").is_err());
    }
}
