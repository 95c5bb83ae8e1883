//! The WAL relay: publishes the outbox that services in WAL mode write to PostgreSQL's write-ahead log (see
//! `saga_runtime::store::wal`).
//!
//! It reads the schema's replication slot through the `pgoutput` plugin with logical messages on, keeps the
//! messages of its schema's prefix, and publishes their events in the order their transactions committed:
//! per-key order holds by construction. The slot's position is confirmed only once every event before it
//! was acknowledged by the broker or parked, so a relay that dies republishes from the last confirmed commit
//! (the consumers' step keys absorb the duplicates) and never skips one.
//!
//! - **The switch from the table.** Before it first reads the slot, a relay waits at the schema's fence
//!   (`saga_runtime::store::wal::fence`): every row of `saga_outbox` published and no table-mode writer
//!   left. It publishes the table meanwhile, and goes on publishing it beside the log (rows a writer of an
//!   older version adds late are still published).
//! - **One relay per slot.** PostgreSQL lets one connection read a slot at a time. A second relay finds it
//!   active, stands by, and tries again every second: when the first dies, its connection ends and the
//!   second takes over where the slot was confirmed.
//! - **A failing key holds back only itself** (`wal_batch`): an event that keeps failing, whatever the
//!   error, is parked after a bounded time (sooner if the broker refuses it for good) with its key's later
//!   events, in `saga_outbox_wal_parked`, so that the slot moves on for every other key; the key is held
//!   (its later events are parked behind it) until its parked events are published again, in order
//!   (`parked`). A message that does not decode is parked whole.
//! - **A lost slot is never made again here.** The relay prepares the slot like any writer
//!   (`saga_runtime::store::wal::prepare`): a recorded slot that is gone or lost is refused, loudly, until an
//!   operator recovers it.
//! - **Idle schemas.** When nothing of its own is pending, the relay confirms the positions the server says
//!   it has read up to, so that another schema's traffic does not keep the write-ahead log from being
//!   recycled.
//! - **Memory.** A batch is published once it holds `RELAY_BATCH_SIZE` events or a writer's largest
//!   transaction (`SAGA_OUTBOX_MAX_TRANSACTION_BYTES`) in bytes, at a commit.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures::FutureExt;
use pgwire_replication::{
    Lsn, PgWireError, ReplicationClient, ReplicationConfig, ReplicationEvent, TlsConfig,
};
use saga_runtime::config::ConfigProblem;
use saga_runtime::store::wal::{self, WalOutbox, fence};
use tokio_util::sync::CancellationToken;

use crate::parked::{self, ToPark};
use crate::publisher::{OrderKey, Publisher, order_key};
use crate::relay::Relay;
use crate::store::OutboxRow;
use crate::wal_batch::{Failure, Holds, WalBatch};

/// How a session with the slot ended.
enum WalEnd {
    /// Another relay reads the slot: stand by.
    Standby(String),
    /// The database or the stream failed: reconnect.
    Failed(String),
    /// The replication connection's settings cannot work (its URL, its TLS, its credentials): waiting
    /// mends nothing, the relay stops with the setting to change.
    Refused(ConfigProblem),
    /// Shutdown.
    Shutdown,
}

/// Where an event read from the slot came from: for parking it, once.
struct Origin {
    tenant: String,
    commit_lsn: Lsn,
    message_lsn: Lsn,
    index: i32,
}

/// How many events of the replication stream the client reads ahead of the relay.
const READ_AHEAD_MESSAGES: usize = 1024;

/// Microseconds between the Unix epoch and PostgreSQL's (2000-01-01).
const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;

fn pg_time(micros: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(micros.saturating_add(PG_EPOCH_MICROS)).unwrap_or_else(Utc::now)
}

/// The replication connection's settings from `url` (a `postgres://` URL), for `slot`.
pub(crate) fn replication_config(
    url: &str,
    slot: &str,
) -> Result<ReplicationConfig, ConfigProblem> {
    let bad = |why: String| {
        ConfigProblem::new(
            "SAGA_REPLICATION_URL",
            why,
            "set it (or DATABASE_URL) to postgres://USER:PASSWORD@HOST:PORT/DATABASE",
        )
    };
    let parsed = url::Url::parse(url).map_err(|e| bad(format!("does not parse ({e})")))?;
    if !matches!(parsed.scheme(), "postgres" | "postgresql") {
        return Err(bad(format!("is a {} URL", parsed.scheme())));
    }
    let query: HashMap<String, String> = parsed.query_pairs().into_owned().collect();
    let host = query
        .get("host")
        .cloned()
        .or_else(|| parsed.host_str().map(str::to_owned))
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned());
    let user = Some(percent_decode(parsed.username()))
        .filter(|u| !u.is_empty())
        .or_else(|| query.get("user").cloned())
        .unwrap_or_else(|| "postgres".to_owned());
    let password = parsed.password().map(percent_decode).unwrap_or_default();
    let database = Some(percent_decode(parsed.path().trim_start_matches('/')))
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| user.clone());
    let mut cfg = ReplicationConfig::new(host, user, password, database, slot, wal::PUBLICATION);
    cfg.port = parsed.port().unwrap_or(5432);
    cfg.tls = replication_tls(&query).map_err(bad)?;
    // Confirmations reach the server within a second: the slot's lag, and the WAL it holds, stay small.
    cfg.status_interval = Duration::from_secs(1);
    cfg.idle_wakeup_interval = Duration::from_secs(1);
    cfg.application_name = Some("saga-outbox-relay".to_owned());
    // What the client reads ahead while a batch is published: at most this many stream events (a
    // transaction is a begin, its messages and a commit; a message is bounded by the writers'
    // SAGA_OUTBOX_MAX_TRANSACTION_BYTES), not the library's 8,192.
    cfg.buffer_events = READ_AHEAD_MESSAGES;
    Ok(cfg)
}

/// The replication connection's TLS, as libpq and the database pool read the URL: `sslmode` (`prefer`, TLS
/// when the server offers it, where the URL says nothing), `sslrootcert` (a private CA; without it, the
/// webpki roots) and `sslcert`/`sslkey` (a client certificate); where the URL does not name one, the
/// variable libpq and the pool read (`PGSSLMODE`, `PGSSLROOTCERT`, `PGSSLCERT`, `PGSSLKEY`).
fn replication_tls(query: &HashMap<String, String>) -> Result<TlsConfig, String> {
    replication_tls_with(query, |var| std::env::var(var).ok())
}

/// [`replication_tls`] with the environment read through `env`.
fn replication_tls_with(
    query: &HashMap<String, String>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<TlsConfig, String> {
    // The URL's parameter under any name the pool reads (sqlx takes `ssl-mode` and the like too), else the
    // variable.
    let value = |names: &[&str], var: &str| {
        names
            .iter()
            .find_map(|name| query.get(*name).cloned())
            .or_else(|| env(var).filter(|v| !v.is_empty()))
    };
    let path = |names: &[&str], var: &str| value(names, var).map(std::path::PathBuf::from);
    let root = path(&["sslrootcert", "ssl-root-cert", "ssl-ca"], "PGSSLROOTCERT");
    let mode = value(&["sslmode", "ssl-mode"], "PGSSLMODE").map(|m| m.to_ascii_lowercase());
    let mut tls = match mode.as_deref() {
        None | Some("prefer") => TlsConfig {
            mode: pgwire_replication::SslMode::Prefer,
            ..TlsConfig::default()
        },
        // `allow` tries plaintext first: the server answers it unless it insists on TLS.
        Some("disable" | "allow") => TlsConfig::disabled(),
        Some("require") => TlsConfig::require(),
        Some("verify-ca") => TlsConfig::verify_ca(root),
        Some("verify-full") => TlsConfig::verify_full(root),
        Some(other) => {
            return Err(format!(
                "has sslmode={other:?} (or PGSSLMODE), which is not disable, allow, prefer, require, \
                 verify-ca or verify-full"
            ));
        }
    };
    tls.client_cert_pem_path = path(&["sslcert", "ssl-cert"], "PGSSLCERT");
    tls.client_key_pem_path = path(&["sslkey", "ssl-key"], "PGSSLKEY");
    Ok(tls)
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(hex) = bytes.get(i + 1..i + 3)
            && let Ok(value) = u8::from_str_radix(std::str::from_utf8(hex).unwrap_or("zz"), 16)
        {
            out.push(value);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// What ended a replication connection: a refusal the URL must fix stops the relay with one line; anything
/// else (a connection lost, a handshake cut short, a server restarting) is retried.
fn classify(e: &PgWireError) -> WalEnd {
    let text = e.to_string();
    // 55006 object_in_use: "replication slot ... is active for PID ...".
    if text.contains("(SQLSTATE 55006)") || text.contains("is active for PID") {
        return WalEnd::Standby(text);
    }
    if refused_for_good(e, &text) {
        return WalEnd::Refused(ConfigProblem::new(
            "SAGA_REPLICATION_URL",
            format!("the replication connection is refused: {text}"),
            "fix its sslmode, sslrootcert, user or password (by default it is DATABASE_URL)",
        ));
    }
    WalEnd::Failed(text)
}

/// A refusal that waiting does not mend: a certificate the CA did not sign or that names another host, a
/// server without TLS where the URL asks for it, a file that does not read, the server's refusal of the
/// client's certificate, credentials refused (SQLSTATE 28000, 28P01). A handshake the network cut short is
/// not one.
fn refused_for_good(e: &PgWireError, text: &str) -> bool {
    const TLS_REFUSALS: [&str; 6] = [
        "invalid peer certificate",
        "TLS config error",
        "server does not support TLS",
        "invalid SNI hostname",
        "received fatal alert",
        "not supported over Unix",
    ];
    match e {
        PgWireError::Tls(_) => TLS_REFUSALS.iter().any(|r| text.contains(r)),
        PgWireError::Auth(_) => true,
        _ => text.contains("(SQLSTATE 28000)") || text.contains("(SQLSTATE 28P01)"),
    }
}

/// The events read from the slot and not yet settled, with what is decided about them (row `i`'s id is
/// `i`).
struct Batch {
    rows: Vec<OutboxRow>,
    origins: Vec<Origin>,
    decisions: WalBatch<OrderKey>,
    /// When the attempt of each event's first failure was sent: its park bound runs from there.
    first_sent: Vec<Option<Instant>>,
    /// Each event's last error.
    errors: Vec<String>,
    /// The size of the messages read into it.
    bytes: usize,
    park_after: u32,
}

impl Batch {
    fn new(park_after: u32) -> Self {
        Self {
            rows: Vec::new(),
            origins: Vec::new(),
            decisions: WalBatch::new(park_after),
            first_sent: Vec::new(),
            errors: Vec::new(),
            bytes: 0,
            park_after,
        }
    }

    fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    fn push(
        &mut self,
        event: wal::WalEvent,
        origin: Origin,
        commit_time: DateTime<Utc>,
        holds: &Holds<OrderKey>,
    ) {
        let row = OutboxRow {
            id: i64::try_from(self.rows.len()).unwrap_or(i64::MAX),
            topic: event.topic,
            partition_key: event.partition_key,
            headers: event.headers,
            payload: Some(event.payload),
            created_at: commit_time,
        };
        self.decisions.push(order_key(&row), holds);
        self.rows.push(row);
        self.origins.push(origin);
        self.first_sent.push(None);
        self.errors.push(String::new());
    }

    fn clear(&mut self) {
        *self = Self::new(self.park_after);
    }
}

/// Topics whose events failed for longer than the park bound while the broker answered (a missing topic, an
/// authorization failure: every key of the topic fails alike). While one is marked, an event of it that
/// fails is parked at once, without waiting the bound again for each of its keys, and the release of its
/// parked events tries one key of it at a time until one goes through.
#[derive(Default)]
struct FailingTopics(HashMap<String, Instant>);

impl FailingTopics {
    /// How long a topic stays marked without a success.
    const MARK: Duration = Duration::from_secs(300);

    fn mark(&mut self, topic: &str) {
        self.0.insert(topic.to_owned(), Instant::now() + Self::MARK);
    }

    fn is_failing(&mut self, topic: &str) -> bool {
        match self.0.get(topic) {
            Some(until) if *until > Instant::now() => true,
            Some(_) => {
                self.0.remove(topic);
                false
            }
            None => false,
        }
    }

    fn succeeded(&mut self, topic: &str) {
        self.0.remove(topic);
    }
}

/// The last position confirmed to the server, to be recorded in the schema (`confirmed_lsn`), at most once a
/// second: where a lost slot's losses begin.
#[derive(Default)]
struct Confirmations {
    /// The position, and the commit time of the transaction that ended there (`None`: the server's clock,
    /// for an idle schema confirmed).
    latest: Option<(Lsn, Option<DateTime<Utc>>)>,
    recorded: Option<Lsn>,
    next: Option<Instant>,
}

impl Confirmations {
    fn note(&mut self, lsn: Lsn, at: Option<DateTime<Utc>>) {
        self.latest = Some((lsn, at));
    }
}

/// Where a session with the slot stands: the batch read and not yet published, the transaction being
/// read, the keys held, what to confirm, and when to look at parked events and the lag again.
struct StreamState {
    batch: Batch,
    holds: Holds<OrderKey>,
    failing: FailingTopics,
    in_transaction: bool,
    commit_time: DateTime<Utc>,
    commit_lsn: Lsn,
    last_commit: Option<(Lsn, DateTime<Utc>)>,
    confirmations: Confirmations,
    started: bool,
    next_lag: Instant,
    next_release: Instant,
}

impl StreamState {
    fn new(park_after: u32) -> Self {
        Self {
            batch: Batch::new(park_after),
            holds: Holds::default(),
            failing: FailingTopics::default(),
            in_transaction: false,
            commit_time: Utc::now(),
            commit_lsn: Lsn::from_u64(0),
            last_commit: None,
            confirmations: Confirmations::default(),
            started: false,
            next_lag: Instant::now(),
            next_release: Instant::now(),
        }
    }

    /// Between transactions, with nothing read and not published.
    fn idle(&self) -> bool {
        self.batch.is_empty() && !self.in_transaction
    }
}

impl Relay {
    /// The WAL relay's loop: sessions with the slot, standing by while another relay reads it, reconnecting
    /// after a failure, until `shutdown`.
    pub(crate) async fn run_wal(
        &self,
        publisher: &mut Publisher,
        url: &str,
        shutdown: &CancellationToken,
    ) -> Result<(), ConfigProblem> {
        let mut wait = Duration::from_millis(200);
        let mut standing_by = false;
        let mut last_failure = String::new();
        // Prepared and past the fence: a relay standing by tries the slot again every second without
        // setting it up again (a failure, such as a slot gone meanwhile, prepares afresh).
        let mut prepared: Option<WalOutbox> = None;
        while !shutdown.is_cancelled() {
            let end = self
                .wal_session(publisher, url, &mut prepared, shutdown)
                .await;
            self.metrics.wal_active.set(0);
            let pause = match end {
                WalEnd::Shutdown => break,
                WalEnd::Refused(problem) => {
                    self.ready.set(false);
                    return Err(problem);
                }
                WalEnd::Standby(holder) => {
                    if !standing_by {
                        tracing::info!(%holder, "another relay reads the outbox's slot; standing by");
                    }
                    standing_by = true;
                    last_failure.clear();
                    // A relay standing by is healthy: it takes over when the other dies.
                    self.ready.set(true);
                    wait = Duration::from_millis(200);
                    self.args.standby_interval
                }
                WalEnd::Failed(e) => {
                    prepared = None;
                    standing_by = false;
                    self.ready.set(false);
                    if e != last_failure {
                        tracing::error!(error = %e, ?wait, "the WAL relay cannot read its slot; trying again");
                        last_failure = e;
                    }
                    let pause = wait;
                    wait = (wait * 2).min(Duration::from_secs(10));
                    pause
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(pause) => {}
            }
        }
        Ok(())
    }

    /// One session with the slot: see the module documentation.
    async fn wal_session(
        &self,
        publisher: &mut Publisher,
        url: &str,
        prepared: &mut Option<WalOutbox>,
        shutdown: &CancellationToken,
    ) -> WalEnd {
        let outbox = match prepared {
            Some(outbox) => outbox.clone(),
            None => {
                let outbox = match wal::prepare(&self.pool).await {
                    Ok(outbox) => outbox,
                    Err(e) => return WalEnd::Failed(e.to_string()),
                };
                match self.wait_at_fence(shutdown).await {
                    Ok(true) => {}
                    Ok(false) => return WalEnd::Shutdown,
                    Err(e) => return WalEnd::Failed(e.to_string()),
                }
                prepared.insert(outbox).clone()
            }
        };
        let cfg = match replication_config(url, &outbox.slot) {
            Ok(cfg) => cfg,
            Err(problem) => return WalEnd::Refused(problem),
        };
        let mut client = match ReplicationClient::connect(cfg).await {
            Ok(client) => client,
            Err(e) => return classify(&e),
        };
        let end = self.stream(&mut client, &outbox, publisher, shutdown).await;
        client.stop();
        end
    }

    /// Waits until the schema's fence lets this relay read the slot (see `fence`): `Ok(false)` on shutdown.
    /// The table outbox is published meanwhile, beside this loop.
    async fn wait_at_fence(&self, shutdown: &CancellationToken) -> Result<bool, sqlx::Error> {
        let mut said = false;
        loop {
            let view = {
                let mut conn = self.pool.acquire().await?;
                fence::pass(&mut conn).await?
            };
            if fence::may_read_slot(&view) {
                self.metrics.wal_fenced.set(0);
                if said {
                    tracing::info!(
                        "the table outbox is drained and no table-mode writer is left: reading the slot"
                    );
                }
                return Ok(true);
            }
            self.metrics.wal_fenced.set(1);
            // Publishing the table is this relay's work meanwhile: it is ready.
            self.ready.set(true);
            if !said {
                tracing::info!(
                    table_writers = view.table_writers,
                    unpublished_rows = view.unpublished_rows,
                    "switching to the WAL outbox: waiting until the table outbox is drained and no table-mode \
                     writer is left before reading the slot"
                );
                said = true;
            }
            tokio::select! {
                () = shutdown.cancelled() => return Ok(false),
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    async fn stream(
        &self,
        client: &mut ReplicationClient,
        outbox: &WalOutbox,
        publisher: &mut Publisher,
        shutdown: &CancellationToken,
    ) -> WalEnd {
        let mut st = StreamState::new(self.args.park_after_attempts);
        match parked::held_keys(&self.pool).await {
            Ok(keys) => st.holds.reset(keys),
            Err(e) => return WalEnd::Failed(e.to_string()),
        }
        self.metrics.wal_held_keys.set(st.holds.len() as i64);
        loop {
            if let Err(end) = self
                .between_transactions(&mut st, outbox, publisher, shutdown)
                .await
            {
                return end;
            }
            let event = match self.receive(&mut st, client, publisher, shutdown).await {
                Ok(Some(event)) => event,
                Ok(None) => continue,
                Err(end) => return end,
            };
            if !st.started {
                st.started = true;
                self.metrics.wal_active.set(1);
                self.ready.set(true);
                tracing::info!(slot = %outbox.slot, schema = %outbox.schema, "the WAL relay reads the outbox's slot");
            }
            if let Err(end) = self
                .on_event(event, &mut st, client, outbox, publisher, shutdown)
                .await
            {
                return end;
            }
            self.sample_lag(&mut st).await;
        }
    }

    /// Between transactions, with nothing pending: parked events that are due (every second while a key
    /// is held; otherwise the held keys are only looked at again every ten seconds, for rows a late
    /// table-mode writer adds), and what to record.
    async fn between_transactions(
        &self,
        st: &mut StreamState,
        outbox: &WalOutbox,
        publisher: &mut Publisher,
        shutdown: &CancellationToken,
    ) -> Result<(), WalEnd> {
        if st.idle() && Instant::now() >= st.next_release {
            self.release(publisher, &mut st.holds, &mut st.failing, shutdown)
                .await?;
            st.next_release = Instant::now()
                + if st.holds.len() > 0 {
                    Duration::from_secs(1)
                } else {
                    Duration::from_secs(10)
                };
            self.record_confirmations(outbox, &mut st.confirmations);
        }
        if st.holds.len() > 0 {
            st.next_release = st.next_release.min(Instant::now() + Duration::from_secs(1));
        }
        Ok(())
    }

    /// The stream's next event. What was read is published once nothing more is waiting (or the batch is
    /// full), at a commit: then `Ok(None)`, and the loop goes on.
    async fn receive(
        &self,
        st: &mut StreamState,
        client: &mut ReplicationClient,
        publisher: &mut Publisher,
        shutdown: &CancellationToken,
    ) -> Result<Option<ReplicationEvent>, WalEnd> {
        // What the stream holds already, without waiting: a zero timeout would wait for the timer's next
        // tick (up to a millisecond) on every commit's way to the broker. Asked only while the stream's
        // worker runs: an ended stream goes to `recv` below, which says how it ended, and its session's
        // batch is not published (the slot gives it to the next session).
        let received = if !st.batch.is_empty() && !st.in_transaction && client.is_running() {
            match client.recv().now_or_never() {
                Some(received) => received,
                None => {
                    self.settle(
                        publisher,
                        &mut st.batch,
                        &mut st.holds,
                        &mut st.failing,
                        shutdown,
                    )
                    .await?;
                    if let Some((lsn, at)) = st.last_commit {
                        client.update_applied_lsn(lsn);
                        st.confirmations.note(lsn, Some(at));
                    }
                    return Ok(None);
                }
            }
        } else if st.idle() {
            tokio::select! {
                () = shutdown.cancelled() => return Err(WalEnd::Shutdown),
                received = client.recv() => received,
                () = tokio::time::sleep_until(st.next_release.into()) => return Ok(None),
            }
        } else {
            tokio::select! {
                () = shutdown.cancelled() => return Err(WalEnd::Shutdown),
                received = client.recv() => received,
            }
        };
        match received {
            Ok(Some(event)) => Ok(Some(event)),
            Ok(None) => Err(WalEnd::Failed("the replication stream ended".into())),
            Err(e) => Err(classify(&e)),
        }
    }

    /// One event of the stream: a transaction's begin, its outbox messages, its commit (publishing a full
    /// batch), a keep-alive (confirming what nothing is owed for).
    async fn on_event(
        &self,
        event: ReplicationEvent,
        st: &mut StreamState,
        client: &mut ReplicationClient,
        outbox: &WalOutbox,
        publisher: &mut Publisher,
        shutdown: &CancellationToken,
    ) -> Result<(), WalEnd> {
        match event {
            ReplicationEvent::Begin {
                final_lsn,
                commit_time_micros,
                ..
            } => {
                st.in_transaction = true;
                st.commit_time = pg_time(commit_time_micros);
                st.commit_lsn = final_lsn;
            }
            ReplicationEvent::Message {
                transactional: true,
                lsn,
                prefix,
                content,
            } if prefix == outbox.prefix => self.on_message(st, lsn, &content).await?,
            ReplicationEvent::Commit { end_lsn, .. } => {
                st.in_transaction = false;
                st.last_commit = Some((end_lsn, st.commit_time));
                let batch_size = usize::try_from(self.args.batch_size).unwrap_or(usize::MAX);
                let full = st.batch.rows.len() >= batch_size
                    || st.batch.bytes >= self.outbox.max_transaction_bytes;
                if st.batch.is_empty() || full {
                    // A full batch is published (settled) first; with nothing of this schema pending,
                    // the transaction is done with.
                    if !st.batch.is_empty() {
                        self.settle(
                            publisher,
                            &mut st.batch,
                            &mut st.holds,
                            &mut st.failing,
                            shutdown,
                        )
                        .await?;
                    }
                    client.update_applied_lsn(end_lsn);
                    st.confirmations.note(end_lsn, Some(st.commit_time));
                }
            }
            // The server read the log up to here, and sent everything it decoded before: with nothing
            // pending, nothing before it is owed.
            ReplicationEvent::KeepAlive { wal_end, .. } if st.idle() => {
                client.update_applied_lsn(wal_end);
                st.confirmations.note(wal_end, None);
            }
            ReplicationEvent::StoppedAt { .. } => {
                return Err(WalEnd::Failed("the replication stream stopped".into()));
            }
            _ => {}
        }
        Ok(())
    }

    /// One transaction's outbox message at `lsn`: its events join the batch; one that does not decode,
    /// or holds what cannot be parked as text, is parked whole as bytes (never held forever).
    async fn on_message(
        &self,
        st: &mut StreamState,
        lsn: Lsn,
        content: &[u8],
    ) -> Result<(), WalEnd> {
        match wal::decode(content).and_then(|events| wal::storable(&events).map(|()| events)) {
            Ok(events) => {
                st.batch.bytes += content.len();
                for (index, event) in events.into_iter().enumerate() {
                    let origin = Origin {
                        tenant: event.tenant.clone(),
                        commit_lsn: st.commit_lsn,
                        message_lsn: lsn,
                        index: i32::try_from(index).unwrap_or(i32::MAX),
                    };
                    st.batch.push(event, origin, st.commit_time, &st.holds);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, lsn = %st.commit_lsn, "an outbox message does not decode; parking it");
                let new = parked::park_undecodable(
                    &self.pool,
                    &st.commit_lsn.to_pg_string(),
                    &lsn.to_pg_string(),
                    content,
                    &e.to_string(),
                )
                .await
                .map_err(|e| WalEnd::Failed(e.to_string()))?;
                self.metrics.parked.inc_by(new);
            }
        }
        Ok(())
    }

    /// The slot's lag, sampled every backlog interval.
    async fn sample_lag(&self, st: &mut StreamState) {
        if Instant::now() < st.next_lag {
            return;
        }
        st.next_lag = Instant::now() + self.args.backlog_interval;
        if let Ok(Some(lag)) = wal::slot_lag(&self.pool).await {
            self.metrics.wal_lag_bytes.set(lag.lag_bytes);
            self.metrics
                .wal_lag_seconds
                .set(lag.lag_seconds.unwrap_or(0.0).round() as i64);
        }
    }

    /// Records the last confirmed position in the schema, at most once a second, beside the stream (best
    /// effort: it only says where a lost slot's losses begin; an older position never overwrites a newer).
    fn record_confirmations(&self, outbox: &WalOutbox, confirmations: &mut Confirmations) {
        let Some((lsn, at)) = confirmations.latest else {
            return;
        };
        if confirmations.recorded == Some(lsn)
            || confirmations.next.is_some_and(|next| Instant::now() < next)
        {
            return;
        }
        confirmations.next = Some(Instant::now() + Duration::from_secs(1));
        confirmations.recorded = Some(lsn);
        let (pool, slot) = (self.pool.clone(), outbox.slot.clone());
        tokio::spawn(async move {
            if let Err(e) = wal::slot::record_confirmed(&pool, &slot, &lsn.to_pg_string(), at).await
            {
                tracing::debug!(error = %e, "cannot record the slot's confirmed position");
            }
        });
    }

    /// Publishes `batch` until every event is acknowledged or parked (see `wal_batch`), then clears it: the
    /// slot may be confirmed past it.
    async fn settle(
        &self,
        publisher: &mut Publisher,
        batch: &mut Batch,
        holds: &mut Holds<OrderKey>,
        failing: &mut FailingTopics,
        shutdown: &CancellationToken,
    ) -> Result<(), WalEnd> {
        let mut round: u32 = 0;
        loop {
            let to_park = batch.decisions.to_park();
            if !to_park.is_empty() {
                self.park(batch, &to_park)
                    .await
                    .map_err(|e| WalEnd::Failed(e.to_string()))?;
                batch.decisions.parked();
            }
            let pending = batch.decisions.pending();
            if pending.is_empty() {
                break;
            }
            let rows: Vec<&OutboxRow> = pending.iter().map(|i| &batch.rows[*i]).collect();
            let sent_at = Instant::now();
            let Some(outcome) = publisher.publish(&rows, shutdown).await else {
                return Err(WalEnd::Shutdown);
            };
            self.metrics.observe_commit_to_ack(
                outcome
                    .acked
                    .iter()
                    .map(crate::publisher::Acked::latency_seconds),
            );
            self.metrics.published.inc_by(outcome.acked.len() as u64);
            for acked in &outcome.acked {
                batch.decisions.acked(index_of(acked.id));
            }
            let now = Instant::now();
            // Asked once per round, and only when a failure would park: a failure while no broker answers
            // is the outage's, and parking every key through an outage would only slow the way back.
            let mut broker_answers = None;
            for failed in &outcome.failed {
                self.metrics.failures.inc();
                let i = index_of(failed.id);
                batch.errors[i].clone_from(&failed.error);
                let first = *batch.first_sent[i].get_or_insert(sent_at);
                let topic_failing = failing.is_failing(&batch.rows[i].topic);
                let expired = (topic_failing
                    || now.duration_since(first) >= self.args.park_after_time)
                    && match broker_answers {
                        Some(answers) => answers,
                        None => *broker_answers.insert(publisher.broker_answers().await),
                    };
                batch.decisions.failed(
                    i,
                    Failure {
                        refused: failed.refused,
                        expired,
                    },
                    holds,
                );
                if expired && !failed.refused && !topic_failing {
                    failing.mark(&batch.rows[i].topic);
                }
                tracing::warn!(
                    topic = %batch.rows[i].topic,
                    error = %failed.error,
                    attempts = batch.decisions.attempts(i),
                    "publishing an outbox event failed; retrying"
                );
            }
            if !outcome.failed.is_empty() && batch.decisions.to_park().is_empty() {
                round += 1;
                let wait = (Duration::from_millis(100) * 2u32.saturating_pow(round.min(4)))
                    .min(Duration::from_secs(1));
                tokio::select! {
                    () = shutdown.cancelled() => return Err(WalEnd::Shutdown),
                    () = tokio::time::sleep(wait) => {}
                }
            }
        }
        debug_assert!(batch.decisions.settled());
        self.metrics.wal_held_keys.set(holds.len() as i64);
        batch.clear();
        Ok(())
    }

    /// Parks events `indices` of `batch`, in order, each with its reason.
    async fn park(&self, batch: &Batch, indices: &[usize]) -> Result<(), sqlx::Error> {
        let events: Vec<ToPark<'_>> = indices
            .iter()
            .map(|&i| {
                let origin = &batch.origins[i];
                let error = if batch.errors[i].is_empty() {
                    "waits behind an earlier event of its key that could not be published"
                        .to_owned()
                } else {
                    batch.errors[i].clone()
                };
                ToPark {
                    row: &batch.rows[i],
                    tenant: &origin.tenant,
                    commit_lsn: origin.commit_lsn.to_pg_string(),
                    message_lsn: origin.message_lsn.to_pg_string(),
                    index: origin.index,
                    error,
                    attempts: batch.decisions.attempts(i),
                }
            })
            .collect();
        let new = parked::park(&self.pool, &events).await?;
        self.metrics.parked.inc_by(new);
        for e in events.iter().filter(|e| e.attempts > 0) {
            tracing::error!(
                topic = %e.row.topic,
                error = %e.error,
                attempts = e.attempts,
                "an outbox event cannot be published; parked with its key's later events (the other keys go on)"
            );
        }
        Ok(())
    }

    /// Publishes the parked events that are due, in order per key, and lets go of the keys whose parked
    /// events are all published or discarded.
    async fn release(
        &self,
        publisher: &mut Publisher,
        holds: &mut Holds<OrderKey>,
        failing: &mut FailingTopics,
        shutdown: &CancellationToken,
    ) -> Result<(), WalEnd> {
        let failed = |e: sqlx::Error| WalEnd::Failed(e.to_string());
        holds.reset(parked::held_keys(&self.pool).await.map_err(failed)?);
        if holds.len() > 0 {
            let mut rows = parked::due(&self.pool, self.args.batch_size)
                .await
                .map_err(failed)?;
            // Of a failing topic, one key at a time (its first due), until one goes through: every key of
            // it fails alike, and each attempt may wait the whole bound.
            let mut probe: HashMap<String, OrderKey> = HashMap::new();
            rows.retain(|row| {
                if !failing.is_failing(&row.topic) {
                    return true;
                }
                let key = order_key(row);
                probe
                    .entry(row.topic.clone())
                    .or_insert_with(|| key.clone())
                    == &key
            });
            if !rows.is_empty() {
                let Some(outcome) = publisher.publish(&rows, shutdown).await else {
                    return Err(WalEnd::Shutdown);
                };
                let ids: Vec<i64> = outcome.acked.iter().map(|a| a.id).collect();
                for row in rows.iter().filter(|r| ids.contains(&r.id)) {
                    failing.succeeded(&row.topic);
                }
                parked::published(&self.pool, &ids).await.map_err(failed)?;
                self.metrics.published.inc_by(ids.len() as u64);
                for f in &outcome.failed {
                    self.metrics.failures.inc();
                    parked::failed_again(&self.pool, f.id, &f.error)
                        .await
                        .map_err(failed)?;
                    tracing::warn!(id = f.id, error = %f.error, "a parked outbox event failed again; its key waits");
                }
                if !ids.is_empty() {
                    tracing::info!(published = ids.len(), "parked outbox events published");
                }
                holds.reset(parked::held_keys(&self.pool).await.map_err(failed)?);
            }
        }
        self.metrics.wal_held_keys.set(holds.len() as i64);
        Ok(())
    }
}

/// The batch index a row id of the WAL relay stands for.
fn index_of(id: i64) -> usize {
    usize::try_from(id).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_of_the_url_stops_the_relay_a_handshake_cut_short_is_retried() {
        let refused = [
            PgWireError::Tls(
                "TLS handshake failed: invalid peer certificate: UnknownIssuer".into(),
            ),
            PgWireError::Tls("server does not support TLS (SSLRequest rejected)".into()),
            PgWireError::Tls(
                "TLS handshake failed: received fatal alert: CertificateRequired".into(),
            ),
            PgWireError::Tls("TLS config error: failed to open CA PEM '/x': not found".into()),
            PgWireError::Auth("SCRAM server error: invalid-proof".into()),
            PgWireError::Server(
                "password authentication failed for user \"x\" (SQLSTATE 28P01)".into(),
            ),
        ];
        for e in &refused {
            assert!(matches!(classify(e), WalEnd::Refused(_)), "{e}");
        }
        let retried = [
            PgWireError::Tls(
                "TLS handshake failed: Connection reset by peer (os error 104)".into(),
            ),
            PgWireError::Tls("TLS handshake failed: unexpected end of file".into()),
            PgWireError::Server("the database system is starting up (SQLSTATE 57P03)".into()),
            // A message that merely holds the digits of a refusal's code.
            PgWireError::Server("relation \"t28000\" does not exist (SQLSTATE 42P01)".into()),
        ];
        for e in &retried {
            assert!(matches!(classify(e), WalEnd::Failed(_)), "{e}");
        }
    }

    #[test]
    fn a_url_gives_the_replication_connection_its_settings() {
        let cfg = replication_config(
            "postgres://us%40er:p%3Ass@db.example:6543/sagas?sslmode=require&options=-c%20search_path%3Dx",
            "slot",
        )
        .unwrap();
        assert_eq!(
            (
                cfg.host.as_str(),
                cfg.port,
                cfg.user.as_str(),
                cfg.password.as_str(),
                cfg.database.as_str()
            ),
            ("db.example", 6543, "us@er", "p:ss", "sagas")
        );
        assert!(cfg.tls.mode.requires_tls());
        let local = replication_config("postgres://postgres@127.0.0.1/test", "slot").unwrap();
        assert_eq!((local.port, local.password.as_str()), (5432, ""));
        assert!(!local.tls.mode.requires_tls());
        assert_eq!(
            local.tls.mode,
            pgwire_replication::SslMode::Prefer,
            "as the pool"
        );
        let verified = replication_config(
            "postgres://x@db/y?sslmode=verify-full&sslrootcert=/ca.pem&sslcert=/c.pem&sslkey=/c.key",
            "slot",
        )
        .unwrap();
        assert_eq!(verified.tls.mode, pgwire_replication::SslMode::VerifyFull);
        assert_eq!(
            verified.tls.ca_pem_path.as_deref(),
            Some(std::path::Path::new("/ca.pem"))
        );
        assert_eq!(
            verified.tls.client_key_pem_path.as_deref(),
            Some(std::path::Path::new("/c.key"))
        );
        let from_env = |var: &str| {
            [
                ("PGSSLMODE", "verify-ca"),
                ("PGSSLROOTCERT", "/env-ca.pem"),
                ("PGSSLKEY", "/env.key"),
            ]
            .iter()
            .find(|(v, _)| *v == var)
            .map(|(_, value)| (*value).to_owned())
        };
        let query = |q: &[(&str, &str)]| -> HashMap<String, String> {
            q.iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        let by_env = replication_tls_with(&query(&[]), from_env).unwrap();
        assert_eq!(by_env.mode, pgwire_replication::SslMode::VerifyCa);
        assert_eq!(
            by_env.ca_pem_path.as_deref(),
            Some(std::path::Path::new("/env-ca.pem"))
        );
        let url_first = replication_tls_with(
            &query(&[("sslmode", "require"), ("sslkey", "/url.key")]),
            from_env,
        )
        .unwrap();
        assert_eq!(url_first.mode, pgwire_replication::SslMode::Require);
        let aliased = replication_tls_with(
            &query(&[
                ("ssl-mode", "VERIFY-FULL"),
                ("ssl-root-cert", "/alias-ca.pem"),
            ]),
            |_| None,
        )
        .unwrap();
        assert_eq!(
            aliased.mode,
            pgwire_replication::SslMode::VerifyFull,
            "the names and the case the pool takes"
        );
        assert_eq!(
            aliased.ca_pem_path.as_deref(),
            Some(std::path::Path::new("/alias-ca.pem"))
        );
        assert_eq!(
            url_first.client_key_pem_path.as_deref(),
            Some(std::path::Path::new("/url.key")),
            "the URL's parameter before the variable, as libpq"
        );
        let refused = replication_config("postgres://x@db/y?sslmode=verify", "slot").unwrap_err();
        assert_eq!(refused.setting, "SAGA_REPLICATION_URL", "{refused}");
        assert!(replication_config("mysql://x@y/z", "slot").is_err());
        assert!(replication_config("not a url", "slot").is_err());
        assert_eq!(pg_time(0).timestamp(), 946_684_800);
    }
}
