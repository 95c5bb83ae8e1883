//! The outbox writer: events written into the caller's transaction, published by `outbox-relay` after
//! commit.
//!
//! An [`Outbox`] is what a process writes with: its mode (rows of `saga_outbox`, or one logical message on
//! the write-ahead log), the largest transaction it accepts, and its health, which the process's monitor
//! keeps (in WAL mode, a lost slot makes the outbox unwritable within seconds: nothing is committed whose
//! events would never be published). It is a value, handed to each writer (the consumer, the HTTP layer,
//! the orchestrator): a service makes one, opens it at start, and gives its clones to its writers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use sqlx::PgConnection;

use saga_core::OutboxMessage;

use saga_config::OutboxMode;

use super::wal;

/// The default of [`Outbox::max_transaction_bytes`]: 16 MiB, sixteen of the broker's default largest
/// messages. What a relay holds in memory at once is bounded by it.
pub const DEFAULT_MAX_TRANSACTION_BYTES: usize = 16 * 1024 * 1024;

/// Why events could not be written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The database failed.
    #[error("writing the outbox: {0}")]
    Database(#[from] sqlx::Error),
    /// The outbox may not be written now (in WAL mode: its slot is lost or gone): committing would lose the
    /// events. Waited out like an unavailable database, never dead-lettered.
    #[error("the outbox is not writable: {0}")]
    Unwritable(String),
    /// An event holds a NUL character (in its topic, key or a header), which the outbox cannot store as
    /// text: refused at write in both modes, as the table refuses it, never written to the log to fail
    /// where it is parked.
    #[error("an event's {what} holds a NUL character, which the outbox cannot store")]
    Refused {
        /// Which part of which event, such as `header "x-note" value`.
        what: String,
    },
    /// A transaction's events are larger than the outbox accepts.
    #[error(
        "the transaction's events take {bytes} bytes, over the outbox's limit of {limit} \
         (SAGA_OUTBOX_MAX_TRANSACTION_BYTES)"
    )]
    TooLarge {
        /// Their size, as written.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
}

impl OutboxError {
    /// Whether the error is the database's or the outbox's unavailability (to be waited out), rather than
    /// something wrong with the events.
    pub fn is_unavailable(&self) -> bool {
        match self {
            Self::Database(e) => saga_core::StepError::is_connection_error(e),
            Self::Unwritable(_) => true,
            Self::TooLarge { .. } | Self::Refused { .. } => false,
        }
    }
}

/// Whether a process's outbox may be written, shared by its writers and kept by its monitor: an atomic
/// read per transaction, no query.
#[derive(Clone, Debug)]
pub struct OutboxHealth(Arc<HealthState>);

#[derive(Debug)]
pub(crate) struct HealthState {
    writable: AtomicBool,
    problem: Mutex<Option<String>>,
    gauge: Gauge,
}

impl Default for OutboxHealth {
    fn default() -> Self {
        let gauge = Gauge::default();
        gauge.set(1);
        Self(Arc::new(HealthState {
            writable: AtomicBool::new(true),
            problem: Mutex::new(None),
            gauge,
        }))
    }
}

impl OutboxHealth {
    /// Whether writers may commit events.
    pub fn is_writable(&self) -> bool {
        self.0.writable.load(Ordering::Acquire)
    }

    /// Why not, when not.
    pub fn problem(&self) -> Option<String> {
        self.0
            .problem
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Sets the state: writable, or not because of `problem`. Returns whether it changed.
    pub fn set(&self, problem: Option<String>) -> bool {
        let writable = problem.is_none();
        *self
            .0
            .problem
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = problem;
        self.0.gauge.set(i64::from(writable));
        self.0.writable.swap(writable, Ordering::AcqRel) != writable
    }

    /// Registers the gauge `saga_outbox_writable` (1: writable; 0: writers are stopped).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "saga_outbox_writable",
            "Whether this process may write its outbox (0: the WAL outbox's slot is lost or gone, or the \
             schema's outbox moved; writers are stopped)",
            self.0.gauge.clone(),
        );
    }

    /// A handle that does not keep the state alive (for the monitor, which ends with the last writer).
    pub(crate) fn downgrade(&self) -> std::sync::Weak<HealthState> {
        Arc::downgrade(&self.0)
    }

    pub(crate) fn upgrade(weak: &std::sync::Weak<HealthState>) -> Option<Self> {
        weak.upgrade().map(Self)
    }
}

/// The health of an outbox of `mode` not opened yet: a WAL outbox may not be written before its slot exists.
fn unopened(mode: OutboxMode) -> Option<String> {
    (mode == OutboxMode::Wal).then(|| {
        "the WAL outbox is not opened yet (its slot is set up when the service starts)".to_owned()
    })
}

/// What a process writes its outbox with. See the module documentation.
#[derive(Clone, Debug)]
pub struct Outbox {
    /// Its mode and largest write, shared by the clones: a service's builder may still make them (see
    /// [`Outbox::reconfigure`]) after it handed the outbox to other writers, which follow.
    settings: Arc<std::sync::RwLock<(OutboxMode, usize)>>,
    health: OutboxHealth,
    /// Set once a table outbox is opened: its process then holds the table-mode presence relays wait
    /// for, and its writes need no check of the switch (shared by the clones).
    registered: Arc<AtomicBool>,
}

impl Default for Outbox {
    fn default() -> Self {
        Self::new(OutboxMode::Table)
    }
}

impl Outbox {
    /// An outbox of `mode`, with the default size limit. A table outbox is writable at once; a WAL outbox
    /// only once [`Outbox::open`]ed (an event written before its slot exists would never be read).
    pub fn new(mode: OutboxMode) -> Self {
        let outbox = Self {
            settings: Arc::new(std::sync::RwLock::new((
                mode,
                DEFAULT_MAX_TRANSACTION_BYTES,
            ))),
            health: OutboxHealth::default(),
            registered: Arc::new(AtomicBool::new(false)),
        };
        outbox.health.set(unopened(mode));
        outbox
    }

    /// The largest size of one write's events (as [`wal::encoded_len`] measures them, in both modes).
    #[must_use]
    pub fn with_max_transaction_bytes(self, bytes: usize) -> Self {
        let mode = self.mode();
        self.reconfigure(mode, bytes);
        self
    }

    /// Makes this outbox, and every clone of it, one of `mode` whose writes are at most `max_bytes`: what a
    /// service's builder does until the service is built, whoever was handed the outbox meanwhile. A WAL
    /// outbox is not writable until opened; a table outbox is at once. Its health changes only with its
    /// mode: a new size limit leaves it as it was (an opened outbox's, as its watch set it).
    pub fn reconfigure(&self, mode: OutboxMode, max_bytes: usize) {
        // Unwritable before the mode says the log; writable only after it says the table.
        if mode == OutboxMode::Wal && self.mode() != OutboxMode::Wal {
            self.health.set(unopened(mode));
        }
        let before = std::mem::replace(
            &mut *self
                .settings
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
            (mode, max_bytes),
        );
        if before.0 != mode {
            self.health.set(unopened(mode));
        }
    }

    fn settings(&self) -> (OutboxMode, usize) {
        *self
            .settings
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Where it writes.
    pub fn mode(&self) -> OutboxMode {
        self.settings().0
    }

    /// The largest size of one write's events.
    pub fn max_transaction_bytes(&self) -> usize {
        self.settings().1
    }

    /// Its health, shared with the process's monitor.
    pub fn health(&self) -> &OutboxHealth {
        &self.health
    }

    /// `Err(Unwritable)` when the outbox may not be written now: writers check before they start work.
    pub fn check_writable(&self) -> Result<(), OutboxError> {
        if self.health.is_writable() {
            Ok(())
        } else {
            Err(OutboxError::Unwritable(
                self.health
                    .problem()
                    .unwrap_or_else(|| "its monitor says so".to_owned()),
            ))
        }
    }

    /// Writes `messages` in the caller's transaction, in order: rows of `saga_outbox` ([`append_rows`],
    /// returning their ids), or one logical message on the write-ahead log ([`wal::emit`], returning no
    /// ids). Refuses when the outbox is not writable, and events larger than the limit.
    ///
    /// Write a transaction's events with one call where possible: in table mode, two calls that lock keys
    /// in opposite orders can deadlock with another transaction doing the same (PostgreSQL then aborts one,
    /// a transient error).
    pub async fn append(
        &self,
        conn: &mut PgConnection,
        messages: &[OutboxMessage],
    ) -> Result<Vec<i64>, OutboxError> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        // The settings first, then the health: a switch to the log marks the outbox unwritable before
        // it changes the mode (see `reconfigure`), so a writer never writes the log of a slot not set up.
        let (mode, limit) = self.settings();
        self.check_writable()?;
        storable(messages)?;
        let bytes = wal::encoded_len(messages);
        if bytes > limit {
            return Err(OutboxError::TooLarge { bytes, limit });
        }
        if mode == OutboxMode::Wal {
            wal::emit(conn, messages).await?;
            return Ok(Vec::new());
        }
        // A writer never opened (not given its service's outbox) holds no table-mode presence: it checks,
        // in its transaction, that the schema still writes the table.
        if !self.registered.load(Ordering::Acquire)
            && let Err(at) = wal::fence::check_unregistered_table_write(conn).await?
        {
            return Err(OutboxError::Unwritable(format!(
                "this writer's outbox is the table, but the schema's outbox moved to the write-ahead log (a \
                 relay read its slot at {at}): give it the service's outbox (IdempotencyLayer::with_outbox, \
                 Orchestrator::with_outbox, SagaConsumerBuilder::with_outbox)"
            )));
        }
        Ok(append_rows(conn, messages).await?)
    }
}

/// Refuses events that hold a NUL character where the outbox keeps text (the topic, the key, a header's
/// name or value): the table's `text` columns refuse it, and the log's parked events are text too.
pub fn storable(messages: &[OutboxMessage]) -> Result<(), OutboxError> {
    let nul = |text: &str| text.contains('\0');
    for message in messages {
        let what = if nul(&message.topic) {
            Some("topic".to_owned())
        } else if message.partition_key.as_deref().is_some_and(nul) {
            Some("key".to_owned())
        } else {
            message.headers.iter().find_map(|(name, value)| {
                if nul(name) {
                    Some(format!("header name {name:?}"))
                } else {
                    nul(value).then(|| format!("header {name:?} value"))
                }
            })
        };
        if let Some(what) = what {
            return Err(OutboxError::Refused { what });
        }
    }
    Ok(())
}

/// Why a process's outbox could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// A setting, the slot's state or the schema's switch keeps it from starting (names what to do).
    // Not transparent: the cause stays in the error's chain, where `exit_code` finds a
    // configuration problem (exit code 2).
    #[error("{0}")]
    Config(#[from] saga_config::ConfigProblem),
    /// The database failed.
    #[error("opening the outbox: {0}")]
    Database(#[from] sqlx::Error),
}

impl Outbox {
    /// Opens this outbox on `pool`'s schema, before its first write, with its watch:
    ///
    /// - **WAL**: checks that PostgreSQL decodes its log and sets up the publication and the schema's slot
    ///   ([`wal::prepare`]: a message written before its slot exists is never read), then checks the slot
    ///   every `check_every` ([`wal::monitor`]): the outbox turns unwritable within seconds of the slot being
    ///   lost. Writable from now on, until then.
    /// - **Table**: says that this process writes the table ([`wal::fence::enter_table_mode`], which relays
    ///   in WAL mode wait for) for as long as this outbox (or a clone) lives; refuses when the schema's
    ///   outbox moved to the log.
    pub async fn open(
        &self,
        pool: &sqlx::PgPool,
        check_every: std::time::Duration,
    ) -> Result<(), OpenError> {
        match self.mode() {
            OutboxMode::Wal => {
                let prepared = wal::prepare(pool).await.map_err(|e| match e {
                    wal::PrepareError::Config(problem) => OpenError::Config(problem),
                    wal::PrepareError::Database(e) => OpenError::Database(e),
                })?;
                self.health.set(None);
                wal::monitor::spawn(pool.clone(), prepared.slot, &self.health, check_every);
            }
            _ => {
                let mut conn = pool.acquire().await?.detach();
                match wal::fence::enter_table_mode(&mut conn).await {
                    Ok(()) => {
                        wal::fence::spawn_table_presence(pool.clone(), conn, &self.health);
                        self.registered.store(true, Ordering::Release);
                    }
                    Err(wal::fence::TableModeError::Switched(at)) => {
                        return Err(saga_config::ConfigProblem::new(
                            "SAGA_OUTBOX_MODE",
                            format!(
                                "is table, but this schema's outbox moved to the write-ahead log (a relay \
                                 read its slot at {at}): table rows written now would not be ordered with \
                                 its events"
                            ),
                            "set SAGA_OUTBOX_MODE=wal, or take the WAL outbox down first (`saga outbox wal \
                             retire`, after it is drained)",
                        )
                        .into());
                    }
                    Err(wal::fence::TableModeError::Database(e)) => return Err(e.into()),
                }
            }
        }
        Ok(())
    }
}

/// An outbox of `mode` on `pool`'s schema, opened (see [`Outbox::open`]).
pub async fn open(
    pool: &sqlx::PgPool,
    mode: OutboxMode,
    max_transaction_bytes: usize,
    check_every: std::time::Duration,
) -> Result<Outbox, OpenError> {
    let outbox = Outbox::new(mode).with_max_transaction_bytes(max_transaction_bytes);
    outbox.open(pool, check_every).await?;
    Ok(outbox)
}

/// Appends `messages` to `saga_outbox` in the caller's transaction, in order, with one statement.
///
/// The statement first locks each partition key for the rest of the transaction, so rows of one key get ids
/// in the order their transactions commit; the relay publishes each key's rows in id order. An insert
/// notifies the relay (`NOTIFY saga_outbox`) when the transaction commits. Returns the new rows' ids.
pub async fn append_rows(
    conn: &mut PgConnection,
    messages: &[OutboxMessage],
) -> Result<Vec<i64>, sqlx::Error> {
    if messages.is_empty() {
        return Ok(Vec::new());
    }
    let mut tenants = Vec::with_capacity(messages.len());
    let mut topics = Vec::with_capacity(messages.len());
    let mut keys = Vec::with_capacity(messages.len());
    let mut headers = Vec::with_capacity(messages.len());
    let mut payloads = Vec::with_capacity(messages.len());
    for m in messages {
        tenants.push(m.tenant.as_str());
        topics.push(m.topic.as_str());
        keys.push(m.partition_key.as_deref());
        headers.push(headers_literal(&m.headers));
        payloads.push(m.payload.as_slice());
    }
    sqlx::query_scalar(
        "SELECT saga_outbox_append($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[])",
    )
    .bind(&tenants)
    .bind(&topics)
    .bind(&keys)
    .bind(&headers)
    .bind(&payloads)
    .fetch_all(conn)
    .await
}

/// The headers as a PostgreSQL array literal, flattened: `{"name","value",...}`.
pub fn headers_literal<N: AsRef<str>, V: AsRef<str>>(headers: &[(N, V)]) -> String {
    let mut literal = String::with_capacity(16 + headers.len() * 48);
    literal.push('{');
    for (i, value) in headers
        .iter()
        .flat_map(|(n, v)| [n.as_ref(), v.as_ref()])
        .enumerate()
    {
        if i > 0 {
            literal.push(',');
        }
        literal.push('"');
        if value.contains(['"', '\\']) {
            for c in value.chars() {
                if c == '"' || c == '\\' {
                    literal.push('\\');
                }
                literal.push(c);
            }
        } else {
            literal.push_str(value);
        }
        literal.push('"');
    }
    literal.push('}');
    literal
}

/// Pairs the `headers` column (name, value, name, value, ...) back up. A trailing odd element is ignored.
pub fn headers_from_array(flat: Vec<String>) -> Vec<(String, String)> {
    let mut pairs = Vec::with_capacity(flat.len() / 2);
    let mut items = flat.into_iter();
    while let (Some(name), Some(value)) = (items.next(), items.next()) {
        pairs.push((name, value));
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_literals_escape_quotes_and_backslashes() {
        let headers = vec![
            ("a".to_owned(), "plain".to_owned()),
            ("b".to_owned(), r#"say "hi" \ bye"#.to_owned()),
            ("c".to_owned(), String::new()),
        ];
        assert_eq!(
            headers_literal(&headers),
            r#"{"a","plain","b","say \"hi\" \\ bye","c",""}"#
        );
    }
}
