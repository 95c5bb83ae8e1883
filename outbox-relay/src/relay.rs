//! The relay loop: own shards, read their unpublished rows in id order, publish, mark, repeat; wake on
//! NOTIFY, poll as a fallback; reconnect after losing the database.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use std::future::Future;
use std::net::SocketAddr;

use saga_config::Cause;
use saga_runtime::config::ConfigProblem;
use saga_runtime::kafka::KafkaConfig;
use saga_runtime::ops::{Ops, ReadyFlag};
use saga_runtime::store::wal::OutboxMode;
use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::gc::{RetentionPolicy, run_retention};
use crate::settings::{DatabaseArgs, KafkaArgs, OutboxArgs, RelayArgs, RetentionArgs};

use crate::hooks::PublishHooks;
use crate::metrics::RelayMetrics;
use crate::publisher::{Acked, OrderKey, Publisher, order_key};
use crate::shards::ShardOwner;
use crate::store::{self, AfterPublish};

/// Why the relay did not start or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// A setting keeps it from starting; names the setting and what to do.
    // Not transparent: the cause stays in the error's chain, where `exit_code` finds a
    // configuration problem (exit code 2).
    #[error("{0}")]
    Config(#[from] ConfigProblem),
    /// The Kafka producer could not be created (the client's error kept as the cause).
    #[error("kafka: {0}")]
    Kafka(#[source] Cause),
    /// The ops endpoint could not listen.
    #[error("ops endpoint: {0}")]
    Ops(#[from] std::io::Error),
}

impl RelayError {
    /// The broker's error, kept as the cause (crate-private: no rdkafka type in the public API).
    pub(crate) fn kafka(e: rdkafka::error::KafkaError) -> Self {
        Self::Kafka(Cause::new(e))
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
#[derive(Default)]
#[must_use]
pub struct RelayBuilder {
    args: RelayArgs,
    outbox: OutboxArgs,
    /// `DATABASE_URL`: the replication connection's, unless `SAGA_REPLICATION_URL` says another.
    database_url: Option<String>,
    kafka: Option<KafkaConfig>,
    pool: Option<PgPool>,
    /// What the calls so far found wrong: `build` reports them all.
    problems: Vec<ConfigProblem>,
    /// Whether the relay's own groups (`kafka`, or `relay`: the relay, its outbox and its database) did not
    /// parse: their checks are not made, the other's are.
    unparsed: Vec<&'static str>,
    ops: Option<Ops>,
    hooks: PublishHooks,
}

impl std::fmt::Debug for RelayBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayBuilder")
            .field("args", &self.args)
            .field("outbox", &self.outbox)
            .field(
                "database_url",
                &crate::settings::redacted(self.database_url.as_deref()),
            )
            .field("kafka", &self.kafka)
            .field("problems", &self.problems)
            .finish_non_exhaustive()
    }
}

impl RelayBuilder {
    /// Reads the settings from the environment, through their one declaration ([`KafkaArgs`],
    /// [`RelayArgs`] with its retention, [`OutboxArgs`], and `DATABASE_URL` for the replication connection:
    /// the same groups as the `outbox-relay` binary's); later calls override them. A missing
    /// `KAFKA_BROKERS` or a variable that does not parse is reported by `build`, with every other problem.
    pub fn from_env(mut self) -> Self {
        match (
            DatabaseArgs::from_env(),
            RelayArgs::from_env(),
            OutboxArgs::from_env(),
        ) {
            (Ok(database), Ok(relay), Ok(outbox)) => {
                self = self.args(&relay, &outbox, database.database_url.as_deref());
            }
            (database, relay, outbox) => {
                self.problems.extend(
                    [database.err(), relay.err(), outbox.err()]
                        .into_iter()
                        .flatten(),
                );
                self.unparsed.push("relay");
            }
        }
        match KafkaArgs::from_env().and_then(|k| k.config_or_unlisted()) {
            Ok(kafka) => self.kafka = Some(kafka),
            Err(e) => {
                self.problems.push(e);
                self.unparsed.push("kafka");
            }
        }
        self
    }

    /// Every setting of the relay at once: `relay`, the outbox's mode and size (`outbox`), and
    /// `database_url` for the replication connection when `relay` names none (a binary's command line, or
    /// the groups' `from_env`); later calls override them.
    pub fn args(
        mut self,
        relay: &RelayArgs,
        outbox: &OutboxArgs,
        database_url: Option<&str>,
    ) -> Self {
        self.args = relay.clone();
        self.outbox = outbox.clone();
        self.database_url = database_url.map(str::to_owned);
        self
    }

    /// The broker.
    pub fn kafka(mut self, kafka: KafkaConfig) -> Self {
        self.kafka = Some(kafka);
        self
    }

    /// The broker list (`bootstrap.servers`), keeping any librdkafka properties already set.
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.kafka
            .get_or_insert_with(|| KafkaConfig::new(""))
            .brokers = brokers.into();
        self
    }

    /// The database; the first schema of its `search_path` holds the outbox.
    pub fn pool(mut self, pool: PgPool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// Rows per batch (`RELAY_BATCH_SIZE`).
    pub fn batch_size(mut self, rows: i64) -> Self {
        self.args.batch_size = rows;
        self
    }

    /// Fallback poll interval (`RELAY_POLL_INTERVAL_MS`; notifications wake the relay sooner).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.args.poll_interval = interval;
        self
    }

    /// The producer's linger (`RELAY_LINGER_MS`).
    pub fn linger(mut self, linger: Duration) -> Self {
        self.args.linger = linger;
        self
    }

    /// What to do with published rows (`RELAY_DELETE_PUBLISHED`).
    pub fn after_publish(mut self, after: AfterPublish) -> Self {
        self.args.delete_published = after == AfterPublish::Delete;
        self
    }

    /// How often shard ownership is rebalanced between instances (`RELAY_REBALANCE_INTERVAL_MS`).
    pub fn rebalance_interval(mut self, interval: Duration) -> Self {
        self.args.rebalance_interval = interval;
        self
    }

    /// Failed attempts after which a row the broker refuses for good is parked
    /// (`RELAY_PARK_AFTER_ATTEMPTS`).
    pub fn park_after(mut self, attempts: u32) -> Self {
        self.args.park_after_attempts = attempts;
        self
    }

    /// WAL mode: how long a failing event is tried again before it is parked with its key's later events
    /// (`RELAY_PARK_AFTER_SECS`, at least a second).
    pub fn park_after_time(mut self, time: Duration) -> Self {
        self.args.park_after_time = time;
        self
    }

    /// Retention: how long what is deleted is kept, and how often it runs (`RELAY_GC_INTERVAL_SECS`).
    pub fn retention(mut self, retention: RetentionArgs) -> Self {
        self.args.retention = retention;
        self
    }

    /// The retention given so far: what the relay will delete, and when (a service that embeds the relay
    /// takes its finished keys' retention as the one its consumer checks messages against).
    pub fn retention_given(&self) -> &RetentionArgs {
        &self.args.retention
    }

    /// Serves `/metrics`, `/healthz` and `/readyz` on `addr` (`RELAY_OPS_ADDR`).
    pub fn ops_addr(mut self, addr: SocketAddr) -> Self {
        self.args.ops_addr = Some(addr);
        self
    }

    /// WAL mode: a batch is published, at a commit, once the messages read into it take this many bytes
    /// (the writers' `SAGA_OUTBOX_MAX_TRANSACTION_BYTES`).
    pub fn max_batch_bytes(mut self, bytes: usize) -> Self {
        self.outbox.max_transaction_bytes = bytes;
        self
    }

    /// Reads the write-ahead log's outbox (`mode` WAL) or `saga_outbox`'s rows (table, the default;
    /// `SAGA_OUTBOX_MODE`).
    pub fn mode(mut self, mode: OutboxMode) -> Self {
        self.outbox.mode = mode;
        self
    }

    /// WAL mode: the URL of the replication connection (`SAGA_REPLICATION_URL`; a `postgres://` URL of the
    /// pool's database).
    pub fn replication_url(mut self, url: impl Into<String>) -> Self {
        self.args.replication_url = Some(url.into());
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

    /// The problems of its own settings, each naming its variable: what calls recorded (a group that did
    /// not parse: said alone), else the declarations' rules for the values given (the broker, the pool and
    /// the mode's needs are `build`'s). A service that embeds the relay says them with its consumer's.
    #[doc(hidden)]
    pub fn problems(&self) -> Vec<ConfigProblem> {
        let mut problems = self.problems.clone();
        if self.unparsed.contains(&"relay") {
            return problems;
        }
        problems.extend(self.args.problems());
        if self.outbox.max_transaction_bytes == 0 {
            problems.push(ConfigProblem::new(
                "SAGA_OUTBOX_MAX_TRANSACTION_BYTES",
                "must be at least 1",
                "fix its value",
            ));
        }
        problems
    }

    /// Every problem of the settings given so far, each naming its variable, said at once.
    fn settings_problem(&self) -> Option<ConfigProblem> {
        let mut problems = self.problems();
        if !self.unparsed.contains(&"kafka")
            && self
                .kafka
                .as_ref()
                .is_none_or(|k| k.brokers.trim().is_empty())
        {
            problems.push(ConfigProblem::new(
                "KAFKA_BROKERS",
                "the relay has no broker",
                "set KAFKA_BROKERS or call RelayBuilder::brokers",
            ));
        }
        if self.outbox.mode == OutboxMode::Wal
            && self.args.replication_url.is_none()
            && self.database_url.is_none()
        {
            problems.push(ConfigProblem::new(
                "SAGA_REPLICATION_URL",
                "the WAL relay needs a URL for its replication connection",
                "set SAGA_REPLICATION_URL (or DATABASE_URL), or call RelayBuilder::replication_url",
            ));
        }
        ConfigProblem::all(problems)
    }

    /// Checks the settings and builds the relay: every problem of the settings is reported at once, each
    /// naming its variable.
    pub fn build(mut self) -> Result<Relay, RelayError> {
        if let Some(problem) = self.settings_problem() {
            return Err(problem.into());
        }
        let kafka = self.kafka.take().unwrap_or_else(|| KafkaConfig::new(""));
        let retention = self.args.retention.policy()?;
        let pool = self.pool.ok_or_else(|| {
            ConfigProblem::new(
                "DATABASE_URL",
                "the relay has no database pool",
                "pass one with RelayBuilder::pool",
            )
        })?;
        let mut args = self.args;
        args.replication_url = args.replication_url.or(self.database_url);
        // Embedded in a service, the relay's readiness is its own check, which does not gate the service's:
        // while it stands by or reconnects, the consumers and HTTP entry points carry on.
        let embedded = self.ops.is_some();
        let ops = self.ops.unwrap_or_default();
        let ready = ops.check("relay", !embedded);
        Ok(Relay {
            kafka,
            args,
            outbox: self.outbox,
            retention,
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
    /// Its settings (the replication URL resolved: `SAGA_REPLICATION_URL`, else `DATABASE_URL`).
    pub(crate) args: RelayArgs,
    /// The outbox's mode and largest transaction.
    pub(crate) outbox: OutboxArgs,
    /// The retention its settings say.
    pub(crate) retention: RetentionPolicy,
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
            .field("args", &self.args)
            .field("outbox", &self.outbox)
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
    pub fn args(&self) -> &RelayArgs {
        &self.args
    }

    /// The retention its settings say.
    pub fn retention(&self) -> &RetentionPolicy {
        &self.retention
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
        if let Some(addr) = self.args.ops_addr {
            let bound = self.ops.serve(addr, shutdown.clone()).await?;
            tracing::info!(%bound, "ops endpoint listening");
        }
        if !self.args.retention.gc_interval.is_zero() {
            let (pool, policy, every, stop) = (
                self.pool.clone(),
                self.retention.clone(),
                self.args.retention.gc_interval,
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
        if self.outbox.mode == OutboxMode::Wal {
            // The table is published beside the log: rows a table-mode writer left in `saga_outbox` before
            // the switch (the WAL loop reads the slot only once the whole table is published, see
            // `fence`), and rows written late by a writer of an older version.
            // A delivery that never comes back must not hold the slot: both give up after the park bound.
            let bound = self.args.park_after_time;
            let mut table_publisher = Publisher::new(
                self.kafka.clone(),
                self.args.linger,
                bound,
                self.hooks.clone(),
            )
            .map_err(RelayError::kafka)?;
            let mut publisher = Publisher::new(
                self.kafka.clone(),
                self.args.linger,
                bound,
                self.hooks.clone(),
            )
            .map_err(RelayError::kafka)?;
            let url = self.args.replication_url.clone().unwrap_or_default();
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
                self.args.linger,
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
            store::mark_published(&mut conn, &outcome.acked, self.args.after_publish()).await?;
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
            next.rebalance = Instant::now() + self.args.rebalance_interval;
            if role == Role::BesideTheLog {
                let unparked = store::unpark_due(conn, &owner.owned()).await?;
                if unparked > 0 {
                    tracing::info!(unparked, "parked outbox rows tried again");
                }
            }
        }
        if Instant::now() >= next.backlog {
            self.sample_backlog().await;
            next.backlog = Instant::now() + self.args.backlog_interval;
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
            self.args.batch_size,
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
            .args
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
                && retries.failing_for(failed.id) >= self.args.park_after_time
                && match broker_answers {
                    Some(answers) => answers,
                    None => *broker_answers.insert(publisher.broker_answers().await),
                };
            let parked = store::record_failure(
                conn,
                failed.id,
                &failed.error,
                failed.refused,
                self.args.park_after_attempts,
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
