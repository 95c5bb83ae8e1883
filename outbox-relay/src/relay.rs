//! The relay loop: own shards, read their unpublished rows in id order, publish, mark, repeat; wake on
//! NOTIFY, poll as a fallback; reconnect after losing the database.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use std::future::Future;
use std::net::SocketAddr;

use saga_runtime::config::ConfigProblem;
use saga_runtime::kafka::KafkaConfig;
use saga_runtime::ops::{Ops, ReadyFlag};
use saga_runtime::store::wal::OutboxMode;
use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::gc::{RetentionPolicy, run_retention};
use crate::settings::{DatabaseArgs, KafkaArgs, OutboxArgs, RelayArgs};

use crate::hooks::PublishHooks;
use crate::metrics::RelayMetrics;
use crate::publisher::{Acked, OrderKey, Publisher, order_key};
use crate::shards::ShardOwner;
use crate::store::{self, AfterPublish};

/// How the relay runs. Build it with [`Relay::builder`] (and [`RelayBuilder::from_env`]). Its `Debug`
/// shows the replication URL without its password.
#[derive(Clone)]
#[non_exhaustive]
pub struct RelaySettings {
    /// The broker (`KAFKA_BROKERS`, required; `KAFKA_PROPERTY_*`).
    pub kafka: Option<KafkaConfig>,
    /// Rows per batch (`RELAY_BATCH_SIZE`, default 2,000).
    pub batch_size: i64,
    /// Fallback poll when no notification comes (`RELAY_POLL_INTERVAL_MS`, default 1 s).
    pub poll_interval: Duration,
    /// The producer's `linger.ms` (`RELAY_LINGER_MS`, default 0: a row goes out as soon as it is read;
    /// rows read together still go in one request, and more gather while requests are in flight).
    pub linger: Duration,
    /// What to do with published rows (`RELAY_DELETE_PUBLISHED`; default: mark them).
    pub after_publish: AfterPublish,
    /// How often shard ownership is rebalanced between instances (default 2 s).
    pub rebalance_interval: Duration,
    /// How often the backlog gauge is sampled (default 10 s).
    pub backlog_interval: Duration,
    /// Failed attempts after which a row the broker refuses for good (too large, not a valid record) is
    /// parked instead of retried (`RELAY_PARK_AFTER_ATTEMPTS`, default 3).
    pub park_after: u32,
    /// Retention: how long published rows and finished keys are kept, run every `retention_interval`.
    pub retention: RetentionPolicy,
    /// How often retention runs (`RELAY_GC_INTERVAL_SECS`, default 60 s; zero: never).
    pub retention_interval: Duration,
    /// Where to serve `/metrics`, `/healthz` and `/readyz` (`RELAY_OPS_ADDR`; off by default).
    pub ops_addr: Option<SocketAddr>,
    /// Where the services write the outbox (`SAGA_OUTBOX_MODE`): rows of `saga_outbox` (the default), or the
    /// write-ahead log, which this relay then reads through the schema's replication slot.
    pub mode: OutboxMode,
    /// WAL mode: the URL of the replication connection (`SAGA_REPLICATION_URL`, else `DATABASE_URL`); its
    /// user needs the `REPLICATION` attribute.
    pub replication_url: Option<String>,
    /// WAL mode: how often a relay standing by (another reads the slot) tries to take the slot over
    /// (default 1 s).
    pub standby_interval: Duration,
    /// WAL mode: how long an event that keeps failing (whatever the error) is tried again before it is
    /// parked with its key's later events, so that the slot moves on for the other keys
    /// (`RELAY_PARK_AFTER_SECS`, default 30 s).
    pub park_after_time: Duration,
    /// WAL mode: a batch is published, at a commit, once the messages read into it take this many bytes
    /// (default 16 MiB, the writers' default largest transaction): what the relay holds at once.
    pub max_batch_bytes: usize,
}

impl std::fmt::Debug for RelaySettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelaySettings")
            .field("kafka", &self.kafka)
            .field("batch_size", &self.batch_size)
            .field("poll_interval", &self.poll_interval)
            .field("linger", &self.linger)
            .field("after_publish", &self.after_publish)
            .field("rebalance_interval", &self.rebalance_interval)
            .field("backlog_interval", &self.backlog_interval)
            .field("park_after", &self.park_after)
            .field("retention", &self.retention)
            .field("retention_interval", &self.retention_interval)
            .field("ops_addr", &self.ops_addr)
            .field("mode", &self.mode)
            .field(
                "replication_url",
                &crate::settings::redacted(self.replication_url.as_deref()),
            )
            .field("standby_interval", &self.standby_interval)
            .field("park_after_time", &self.park_after_time)
            .field("max_batch_bytes", &self.max_batch_bytes)
            .finish()
    }
}

impl Default for RelaySettings {
    /// The defaults of [`RelayArgs`] (declared there, once), without a broker.
    fn default() -> Self {
        RelayArgs::default()
            .settings(None, &OutboxArgs::default(), None)
            .expect("the relay's default settings are valid")
    }
}

impl RelaySettings {
    /// The settings no variable sets; every other field is set by [`RelayArgs::settings`].
    pub(crate) fn internal_defaults() -> Self {
        Self {
            kafka: None,
            batch_size: 1,
            poll_interval: Duration::from_secs(1),
            linger: Duration::ZERO,
            after_publish: AfterPublish::Mark,
            rebalance_interval: Duration::from_secs(2),
            backlog_interval: Duration::from_secs(10),
            park_after: 1,
            retention: RetentionPolicy::default(),
            retention_interval: Duration::ZERO,
            ops_addr: None,
            mode: OutboxMode::Table,
            replication_url: None,
            standby_interval: Duration::from_secs(1),
            park_after_time: Duration::ZERO,
            max_batch_bytes: 0,
        }
    }
}

/// Why the relay did not start or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// A setting keeps it from starting; names the setting and what to do.
    // Not transparent: the cause stays in the error's chain, where `exit_code` finds a
    // configuration problem (exit code 2).
    #[error("{0}")]
    Config(#[from] ConfigProblem),
    /// The Kafka producer could not be created.
    #[error("kafka: {0}")]
    Kafka(String),
    /// The ops endpoint could not listen.
    #[error("ops endpoint: {0}")]
    Ops(#[from] std::io::Error),
}

impl RelayError {
    /// The broker's error, said (crate-private: no rdkafka type in the public API).
    #[allow(clippy::needless_pass_by_value)] // `map_err(Self::kafka)` hands the error over
    pub(crate) fn kafka(e: rdkafka::error::KafkaError) -> Self {
        Self::Kafka(e.to_string())
    }
}

/// When a relay session's periodic work is due next.
struct Maintenance {
    rebalance: Instant,
    backlog: Instant,
}

/// Builds a [`Relay`].
///
/// # Examples
///
/// ```no_run
/// # async fn example(pool: sqlx::PgPool) -> Result<(), outbox_relay::RelayError> {
/// outbox_relay::Relay::builder()
///     .from_env() // KAFKA_BROKERS (required), KAFKA_PROPERTY_*, RELAY_*
///     .pool(pool) // its search_path selects the outbox's schema
///     .build()?
///     .run(async { tokio::signal::ctrl_c().await.ok(); })
///     .await
/// # }
/// ```
#[derive(Debug, Default)]
#[must_use]
pub struct RelayBuilder {
    settings: RelaySettings,
    pool: Option<PgPool>,
    env_error: Option<ConfigProblem>,
    ops: Option<Ops>,
    hooks: PublishHooks,
}

impl RelayBuilder {
    /// Reads the settings from the environment, through their one declaration ([`KafkaArgs`],
    /// [`RelayArgs`] with its retention, [`OutboxArgs`], and `DATABASE_URL` for the replication connection:
    /// the same groups as the `outbox-relay` binary's); later calls override them. A missing
    /// `KAFKA_BROKERS` or a variable that does not parse is reported by [`RelayBuilder::build`].
    pub fn from_env(mut self) -> Self {
        let read = || -> Result<RelaySettings, ConfigProblem> {
            let database = DatabaseArgs::from_env()?;
            KafkaArgs::from_env()?;
            RelayArgs::from_env()?.settings(
                None,
                &OutboxArgs::from_env()?,
                database.database_url.as_deref(),
            )
        };
        match read() {
            Ok(settings) => {
                let kafka = self.settings.kafka.take();
                self.settings = settings;
                self.settings.kafka = kafka;
            }
            Err(e) => {
                self.env_error.get_or_insert(e);
            }
        }
        match KafkaArgs::from_env().and_then(|k| k.config()) {
            Ok(kafka) => self.settings.kafka = Some(kafka),
            Err(e) => {
                self.env_error.get_or_insert(e);
            }
        }
        self
    }

    /// The broker.
    pub fn kafka(mut self, kafka: KafkaConfig) -> Self {
        self.settings.kafka = Some(kafka);
        self
    }

    /// The broker list (`bootstrap.servers`), keeping any librdkafka properties already set.
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        let kafka = self
            .settings
            .kafka
            .get_or_insert_with(|| KafkaConfig::new(""));
        kafka.brokers = brokers.into();
        self
    }

    /// The database; the first schema of its `search_path` holds the outbox.
    pub fn pool(mut self, pool: PgPool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// Rows per batch.
    pub fn batch_size(mut self, rows: i64) -> Self {
        self.settings.batch_size = rows;
        self
    }

    /// Fallback poll interval (notifications wake the relay sooner).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.settings.poll_interval = interval;
        self
    }

    /// The producer's linger.
    pub fn linger(mut self, linger: Duration) -> Self {
        self.settings.linger = linger;
        self
    }

    /// What to do with published rows.
    pub fn after_publish(mut self, after: AfterPublish) -> Self {
        self.settings.after_publish = after;
        self
    }

    /// How often shard ownership is rebalanced between instances.
    pub fn rebalance_interval(mut self, interval: Duration) -> Self {
        self.settings.rebalance_interval = interval;
        self
    }

    /// Failed attempts after which a row the broker refuses for good is parked.
    pub fn park_after(mut self, attempts: u32) -> Self {
        self.settings.park_after = attempts;
        self
    }

    /// WAL mode: how long a failing event is tried again before it is parked with its key's later events.
    pub fn park_after_time(mut self, time: Duration) -> Self {
        self.settings.park_after_time = time;
        self
    }

    /// Retention, run every `every` (zero: never).
    pub fn retention(mut self, policy: RetentionPolicy, every: Duration) -> Self {
        self.settings.retention = policy;
        self.settings.retention_interval = every;
        self
    }

    /// Serves `/metrics`, `/healthz` and `/readyz` on `addr`.
    pub fn ops_addr(mut self, addr: SocketAddr) -> Self {
        self.settings.ops_addr = Some(addr);
        self
    }

    /// WAL mode: a batch is published, at a commit, once the messages read into it take this many bytes
    /// (the writers' `SAGA_OUTBOX_MAX_TRANSACTION_BYTES`).
    pub fn max_batch_bytes(mut self, bytes: usize) -> Self {
        self.settings.max_batch_bytes = bytes;
        self
    }

    /// Replaces every setting at once.
    pub fn settings(mut self, settings: RelaySettings) -> Self {
        self.settings = settings;
        self
    }

    /// Reads the write-ahead log's outbox (`mode` WAL) or `saga_outbox`'s rows (table, the default).
    pub fn mode(mut self, mode: OutboxMode) -> Self {
        self.settings.mode = mode;
        self
    }

    /// WAL mode: the URL of the replication connection (a `postgres://` URL of the pool's database).
    pub fn replication_url(mut self, url: impl Into<String>) -> Self {
        self.settings.replication_url = Some(url.into());
        self
    }

    /// Fault injection for tests (see [`PublishHooks`]).
    pub fn hooks(mut self, hooks: PublishHooks) -> Self {
        self.hooks = hooks;
        self
    }

    /// Shares the ops state of the process (metrics and readiness) with the consumer that embeds this relay.
    #[doc(hidden)]
    pub fn with_ops(mut self, ops: Ops) -> Self {
        self.ops = Some(ops);
        self
    }

    /// Checks the settings and builds the relay.
    pub fn build(self) -> Result<Relay, RelayError> {
        if let Some(e) = self.env_error {
            return Err(e.into());
        }
        let kafka = self.settings.kafka.clone().ok_or_else(|| {
            ConfigProblem::new(
                "KAFKA_BROKERS",
                "the relay has no broker",
                "set KAFKA_BROKERS or call RelayBuilder::brokers",
            )
        })?;
        let pool = self.pool.ok_or_else(|| {
            ConfigProblem::new(
                "DATABASE_URL",
                "the relay has no database pool",
                "pass one with RelayBuilder::pool",
            )
        })?;
        if self.settings.mode == OutboxMode::Wal && self.settings.replication_url.is_none() {
            return Err(ConfigProblem::new(
                "SAGA_REPLICATION_URL",
                "the WAL relay needs a URL for its replication connection",
                "set SAGA_REPLICATION_URL (or DATABASE_URL), or call RelayBuilder::replication_url",
            )
            .into());
        }
        if self.settings.batch_size < 1 {
            return Err(ConfigProblem::new(
                "RELAY_BATCH_SIZE",
                "must be at least 1",
                "set a positive number of rows",
            )
            .into());
        }
        // Embedded in a service, the relay's readiness is its own check, which does not gate the service's:
        // while it stands by or reconnects, the consumers and HTTP entry points carry on.
        let embedded = self.ops.is_some();
        let ops = self.ops.unwrap_or_default();
        let ready = ops.check("relay", !embedded);
        Ok(Relay {
            kafka,
            settings: self.settings,
            pool,
            metrics: RelayMetrics::default(),
            ops,
            ready,
            hooks: self.hooks,
            broker_checked: false,
        })
    }
}

/// An outbox relay for the outbox in the pool's schema.
pub struct Relay {
    kafka: KafkaConfig,
    pub(crate) settings: RelaySettings,
    pub(crate) pool: PgPool,
    pub(crate) metrics: RelayMetrics,
    pub(crate) ops: Ops,
    /// This relay's readiness check (`relay`).
    pub(crate) ready: ReadyFlag,
    hooks: PublishHooks,
    /// Whether the caller checked the broker already (the service that embeds it, the binary).
    broker_checked: bool,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("brokers", &self.kafka.brokers)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// Reads a running relay's counters (for tests, dashboards of one's own, the benchmark).
#[derive(Clone)]
pub struct RelayProbe(RelayMetrics);

impl std::fmt::Debug for RelayProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayProbe")
            .field("published", &self.published())
            .field("owned_shards", &self.owned_shards())
            .field("parked", &self.parked())
            .finish()
    }
}

impl RelayProbe {
    /// Rows the broker acknowledged.
    pub fn published(&self) -> u64 {
        self.0.published.get()
    }

    /// Shards this instance owns.
    pub fn owned_shards(&self) -> i64 {
        self.0.owned_shards.get()
    }

    /// Rows parked because the broker refuses them for good.
    pub fn parked(&self) -> u64 {
        self.0.parked.get()
    }

    /// The `quantile` (0 to 1) of the latest commit-to-acknowledgement latencies (a row's commit, or its
    /// write for the table, to the broker's acknowledgement); `None` before the first.
    pub fn commit_to_ack(&self, quantile: f64) -> Option<Duration> {
        let mut seconds: Vec<f64> = self
            .0
            .latencies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .copied()
            .collect();
        if seconds.is_empty() {
            return None;
        }
        seconds.sort_by(f64::total_cmp);
        let at = ((seconds.len() - 1) as f64 * quantile.clamp(0.0, 1.0)).round() as usize;
        Some(Duration::from_secs_f64(seconds[at].max(0.0)))
    }
}

/// Retry bookkeeping for rows whose publication failed: until its retry is due, a failing row holds its key
/// back, so that none of the key's later rows is published before it.
#[derive(Default)]
struct Retries {
    /// Per failing row: its failures, when its retry is due, its key, when it first failed.
    failures: HashMap<i64, (u32, Instant, OrderKey, Instant)>,
}

impl Retries {
    /// Keys with a failing row whose retry is not due yet: left out of the next fetch.
    fn held(&self) -> Vec<OrderKey> {
        if self.failures.is_empty() {
            return Vec::new();
        }
        let now = Instant::now();
        let held: HashSet<&OrderKey> = self
            .failures
            .values()
            .filter(|(_, due, _, _)| *due > now)
            .map(|(_, _, key, _)| key)
            .collect();
        held.into_iter().cloned().collect()
    }

    fn failed(&mut self, id: i64, key: OrderKey) {
        let now = Instant::now();
        let entry = self.failures.entry(id).or_insert((0, now, key, now));
        entry.0 += 1;
        let wait = Duration::from_millis(100) * 2u32.saturating_pow(entry.0.min(9));
        entry.1 = Instant::now() + wait.min(Duration::from_secs(60));
    }

    fn done(&mut self, id: i64) {
        self.failures.remove(&id);
    }

    /// How long row `id` has been failing.
    fn failing_for(&self, id: i64) -> Duration {
        self.failures
            .get(&id)
            .map_or(Duration::ZERO, |(_, _, _, first)| first.elapsed())
    }
}

/// What [`Relay::run_table`] is to its relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// The table outbox is the service's: its state is the relay's readiness.
    Outbox,
    /// The relay reads the write-ahead log's outbox, whose loop owns the readiness; the table holds rows
    /// from before the switch, and any a writer of an older version adds.
    BesideTheLog,
}

impl Relay {
    /// Starts building a relay.
    pub fn builder() -> RelayBuilder {
        RelayBuilder::default()
    }

    /// Its settings.
    pub fn settings(&self) -> &RelaySettings {
        &self.settings
    }

    /// A handle on the relay's counters, valid after the relay moved into [`Relay::run`].
    pub fn probe(&self) -> RelayProbe {
        RelayProbe(self.metrics.clone())
    }

    /// The caller checked the broker with the same settings already (the service that embeds the relay, the
    /// binary): the relay does not check it again. Not part of the API.
    #[doc(hidden)]
    #[must_use]
    pub fn broker_checked(mut self) -> Self {
        self.broker_checked = true;
        self
    }

    /// Runs until `shutdown` resolves (any future: a signal, a token's `cancelled()`). Database and broker
    /// outages are waited out, never fatal; retention runs beside it when configured. A broker that refuses
    /// the client (its credentials, its certificate, its protocol) is: an error naming the setting.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), RelayError> {
        saga_runtime::shutdown::run_until(shutdown, |token| self.run_until(token)).await
    }

    async fn run_until(self, shutdown: CancellationToken) -> Result<(), RelayError> {
        // A producer the broker refuses (credentials, certificate, protocol) would retry for ever: one line
        // naming the setting instead. A broker that does not answer yet is waited for.
        if !self.broker_checked {
            tokio::select! {
                checked = saga_runtime::kafka::refusal(&self.kafka, "KAFKA_BROKERS") => checked?,
                () = shutdown.cancelled() => return Ok(()),
            }
        }
        self.ops.register(|r| self.metrics.register(r));
        if let Some(addr) = self.settings.ops_addr {
            let bound = self.ops.serve(addr, shutdown.clone()).await?;
            tracing::info!(%bound, "ops endpoint listening");
        }
        if !self.settings.retention_interval.is_zero() {
            let (pool, policy, every, stop) = (
                self.pool.clone(),
                self.settings.retention.clone(),
                self.settings.retention_interval,
                shutdown.clone(),
            );
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(every) => {}
                    }
                    match run_retention(&pool, &policy).await {
                        Ok(report) => tracing::info!(?report, "retention run"),
                        Err(e) => tracing::warn!(error = %e, "retention run failed"),
                    }
                }
            });
        }
        if self.settings.mode == OutboxMode::Wal {
            // The table is published beside the log: rows a table-mode writer left in `saga_outbox` before
            // the switch (the WAL loop reads the slot only once the whole table is published, see
            // `fence`), and rows written late by a writer of an older version.
            // A delivery that never comes back must not hold the slot: both give up after the park bound.
            let bound = self.settings.park_after_time.max(Duration::from_secs(1));
            let mut table_publisher = Publisher::new(
                self.kafka.clone(),
                self.settings.linger,
                bound,
                self.hooks.clone(),
            )
            .map_err(RelayError::kafka)?;
            let mut publisher = Publisher::new(
                self.kafka.clone(),
                self.settings.linger,
                bound,
                self.hooks.clone(),
            )
            .map_err(RelayError::kafka)?;
            let url = self.settings.replication_url.clone().unwrap_or_default();
            // A replication connection its settings refuse stops the table's publishing too.
            let stop = shutdown.child_token();
            let (_, wal) = tokio::join!(
                self.run_table(&mut table_publisher, &stop, Role::BesideTheLog),
                async {
                    let ended = self.run_wal(&mut publisher, &url, &stop).await;
                    stop.cancel();
                    ended
                },
            );
            table_publisher.flush(Duration::from_secs(5));
            publisher.flush(Duration::from_secs(5));
            wal?;
        } else {
            // `message.timeout.ms=0`: the table relay waits for the broker forever rather than fail a row.
            let mut publisher = Publisher::new(
                self.kafka.clone(),
                self.settings.linger,
                Duration::ZERO,
                self.hooks.clone(),
            )
            .map_err(RelayError::kafka)?;
            self.run_table(&mut publisher, &shutdown, Role::Outbox)
                .await;
            publisher.flush(Duration::from_secs(5));
        }
        tracing::info!("relay stopped");
        Ok(())
    }

    /// Publishes the table outbox until shutdown, reconnecting after database failures.
    async fn run_table(&self, publisher: &mut Publisher, shutdown: &CancellationToken, role: Role) {
        let mut owner = ShardOwner::new();
        let mut retries = Retries::default();
        let mut reconnect_wait = Duration::from_millis(200);
        while !shutdown.is_cancelled() {
            match self
                .session(publisher, &mut owner, &mut retries, shutdown, role)
                .await
            {
                Ok(()) => break,
                Err(e) => {
                    owner.forget();
                    if role == Role::Outbox {
                        self.ready.set(false);
                    }
                    self.metrics.owned_shards.set(0);
                    tracing::warn!(error = %e, wait = ?reconnect_wait, "relay lost the database; reconnecting");
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(reconnect_wait) => {}
                    }
                    reconnect_wait = (reconnect_wait * 2).min(Duration::from_secs(10));
                }
            }
        }
    }

    /// One database session: returns `Ok` on shutdown, `Err` when the database failed.
    async fn session(
        &self,
        publisher: &mut Publisher,
        owner: &mut ShardOwner,
        retries: &mut Retries,
        shutdown: &CancellationToken,
        role: Role,
    ) -> Result<(), sqlx::Error> {
        // The work connection holds the shard locks: it is this instance's identity, kept out of the pool.
        let mut conn: PgConnection = self.pool.acquire().await?.detach();
        store::pin_plans(&mut conn).await?;
        let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
            .fetch_one(&mut conn)
            .await?;
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen("saga_outbox").await?;
        owner.join(&mut conn).await?;
        if role == Role::Outbox {
            self.ready.set(true);
        }
        tracing::info!(%schema, "relay connected");
        let mut next = Maintenance {
            rebalance: Instant::now(),
            backlog: Instant::now(),
        };
        loop {
            if shutdown.is_cancelled() {
                owner.leave(&mut conn).await.ok();
                return Ok(());
            }
            self.maintain(&mut conn, owner, &mut next, role).await?;
            let held = retries.held();
            let fetched = Instant::now();
            let rows = self.fetch(&mut conn, &owner.owned(), &held, role).await?;
            let fetched_in = fetched.elapsed();
            if rows.is_empty() {
                self.wait_for_rows(&mut listener, &schema, &held, &next, shutdown)
                    .await?;
                continue;
            }
            let published = Instant::now();
            let Some(outcome) = publisher.publish(&rows, shutdown).await else {
                continue; // shutdown: nothing marked, the rows are published again later
            };
            let published_in = published.elapsed();
            let marked = Instant::now();
            store::mark_published(&mut conn, &outcome.acked, self.settings.after_publish).await?;
            tracing::debug!(
                rows = rows.len(),
                acked = outcome.acked.len(),
                held_back = outcome.held_back,
                ?fetched_in,
                ?published_in,
                marked_in = ?marked.elapsed(),
                "batch"
            );
            for acked in &outcome.acked {
                retries.done(acked.id);
            }
            self.metrics
                .observe_commit_to_ack(outcome.acked.iter().map(Acked::latency_seconds));
            self.metrics.published.inc_by(outcome.acked.len() as u64);
            self.record_failures(&mut conn, publisher, &rows, &outcome, retries, role)
                .await?;
        }
    }

    /// The session's periodic work: rebalancing the shards (and, beside the log, trying parked rows
    /// again), and sampling the backlog.
    async fn maintain(
        &self,
        conn: &mut PgConnection,
        owner: &mut ShardOwner,
        next: &mut Maintenance,
        role: Role,
    ) -> Result<(), sqlx::Error> {
        if Instant::now() >= next.rebalance {
            let change = owner.rebalance(conn).await?;
            if !change.acquired.is_empty() || !change.released.is_empty() {
                tracing::info!(
                    members = change.members,
                    acquired = ?change.acquired,
                    released = ?change.released,
                    owned = owner.owned().len(),
                    "shards rebalanced"
                );
            }
            self.metrics
                .owned_shards
                .set(i64::try_from(owner.owned().len()).unwrap_or(0));
            next.rebalance = Instant::now() + self.settings.rebalance_interval;
            if role == Role::BesideTheLog {
                let unparked = store::unpark_due(conn, &owner.owned()).await?;
                if unparked > 0 {
                    tracing::info!(unparked, "parked outbox rows tried again");
                }
            }
        }
        if Instant::now() >= next.backlog {
            self.sample_backlog().await;
            next.backlog = Instant::now() + self.settings.backlog_interval;
        }
        Ok(())
    }

    /// The next rows of `shards` to publish, leaving out the keys `held` behind a failed row.
    async fn fetch(
        &self,
        conn: &mut PgConnection,
        shards: &[i16],
        held: &[OrderKey],
        role: Role,
    ) -> Result<Vec<store::OutboxRow>, sqlx::Error> {
        if shards.is_empty() {
            return Ok(Vec::new());
        }
        store::fetch_unpublished(
            conn,
            shards,
            held,
            self.settings.batch_size,
            role == Role::BesideTheLog,
        )
        .await
    }

    /// Nothing to publish: waits for a commit's notification (or the fallback poll), or, while rows wait
    /// for a retry, until one may be due.
    async fn wait_for_rows(
        &self,
        listener: &mut PgListener,
        schema: &str,
        held: &[OrderKey],
        next: &Maintenance,
        shutdown: &CancellationToken,
    ) -> Result<(), sqlx::Error> {
        let wait = self
            .settings
            .poll_interval
            .min(next.rebalance.saturating_duration_since(Instant::now()))
            .max(Duration::from_millis(10));
        if held.is_empty() {
            return wait_for_wakeup(listener, schema, wait, shutdown).await;
        }
        // Rows wait for a retry: come back when one may be due; notifications are irrelevant.
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = tokio::time::sleep(wait.min(Duration::from_millis(100))) => {}
        }
        Ok(())
    }

    /// Records the rows whose publication failed: parked after their attempts (or, beside the log, after
    /// failing longer than the park bound: a failing row must not keep the relays off the slot for good),
    /// else retried, holding their keys.
    async fn record_failures(
        &self,
        conn: &mut PgConnection,
        publisher: &Publisher,
        rows: &[store::OutboxRow],
        outcome: &crate::publisher::BatchOutcome,
        retries: &mut Retries,
        role: Role,
    ) -> Result<(), sqlx::Error> {
        let mut broker_answers = None;
        for failed in &outcome.failed {
            let expired = role == Role::BesideTheLog
                && retries.failing_for(failed.id) >= self.settings.park_after_time
                && match broker_answers {
                    Some(answers) => answers,
                    None => *broker_answers.insert(publisher.broker_answers().await),
                };
            let parked = store::record_failure(
                conn,
                failed.id,
                &failed.error,
                failed.refused,
                self.settings.park_after,
                expired,
            )
            .await?;
            if parked {
                tracing::error!(
                    id = failed.id,
                    error = %failed.error,
                    "this outbox row cannot be published; parked (its key's later rows go on)"
                );
                retries.done(failed.id);
                self.metrics.parked.inc();
            } else {
                tracing::warn!(id = failed.id, error = %failed.error, "publication failed; will retry");
                if let Some(row) = rows.iter().find(|r| r.id == failed.id) {
                    retries.failed(failed.id, order_key(row));
                }
            }
        }
        self.metrics.failures.inc_by(outcome.failed.len() as u64);
        Ok(())
    }

    async fn sample_backlog(&self) {
        match store::backlog(&self.pool).await {
            Ok(backlog) => {
                self.metrics.backlog.set(backlog.unpublished);
                self.metrics.parked_rows.set(backlog.parked);
                self.metrics.oldest_age_seconds.set(
                    backlog
                        .oldest_age
                        .map_or(0, |a| i64::try_from(a.as_secs()).unwrap_or(i64::MAX)),
                );
            }
            Err(e) => tracing::debug!(error = %e, "cannot sample the backlog"),
        }
    }
}

/// Waits for a notification for `schema`, for `wait`, or for shutdown. Drains notifications already
/// buffered, so that a burst of commits causes one wake-up.
async fn wait_for_wakeup(
    listener: &mut PgListener,
    schema: &str,
    wait: Duration,
    shutdown: &CancellationToken,
) -> Result<(), sqlx::Error> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let notification = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep_until(deadline) => return Ok(()),
            n = listener.recv() => n?,
        };
        if notification.payload() == schema {
            while listener.next_buffered().is_some() {}
            return Ok(());
        }
    }
}
