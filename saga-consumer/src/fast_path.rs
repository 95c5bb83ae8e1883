//! The optional Redis fast path (feature `redis`): hot keys answered from Redis, PostgreSQL still the
//! source of truth.
//!
//! Three uses, each one an optimisation that PostgreSQL backs:
//!
//! - **In-flight lock** (HTTP layer): `SET NX PX` on `{ns}:lock:{tenant}:{step key}` before any database
//!   connection is taken. A second request with the key gets 409 at once, without a connection. The lock
//!   expires by its TTL, so a process killed while holding it blocks the key for at most that long.
//! - **Replay cache** (HTTP layer): the stored status and body of a completed request, with the request's
//!   fingerprint, under `{ns}:http:{tenant}:{step key}`, written only after the request's transaction
//!   committed. A retry is answered from it without a database round trip.
//! - **Completed step keys** (consumer): `{ns}:step:{tenant}:{step key}`, written only after the batch's
//!   transaction committed. A redelivered message whose key is there is acknowledged without a transaction.
//!
//! What is in Redis is only ever a copy of what PostgreSQL committed, and expires before PostgreSQL may
//! forget it (the TTL may not exceed the key retention). Anything Redis does not answer, or answers with an
//! entry that does not fit (a fingerprint that differs, an entry that does not decode), goes to PostgreSQL,
//! whose claim inside the transaction decides. A lost entry costs a PostgreSQL round trip, never a second
//! effect.
//!
//! Redis being down is not an error: every call that fails or takes longer than the operation timeout is
//! answered "unknown", a warning is logged (once per outage), `saga_redis_available` drops to 0, and
//! reconnection is tried at most once per [`RECONNECT_INTERVAL`]. Everything then runs on PostgreSQL alone.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use redis::aio::MultiplexedConnection;
use saga_core::{StepKey, TenantId};

use saga_config::ConfigProblem;
use saga_runtime::ops::Ops;

use saga_runtime::settings::value;

use crate::settings::{FastPathArgs, RetentionArgs};

/// How often a lost Redis is tried again, at most.
pub const RECONNECT_INTERVAL: Duration = Duration::from_secs(1);

impl FastPathArgs {
    /// The defaults (declared on the fields) for the Redis at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        let mut args = saga_runtime::settings::defaults::<Self>();
        args.redis.redis_url = Some(url.into());
        args
    }

    /// The Redis URL, when one is set: the fast path is on.
    pub fn url(&self) -> Option<&str> {
        self.redis
            .redis_url
            .as_deref()
            .filter(|u| !u.trim().is_empty())
    }

    /// The namespace set (`REDIS_NAMESPACE`), if any: otherwise [`default_namespace`].
    pub fn namespace(&self) -> Option<&str> {
        self.redis.namespace.as_deref().filter(|n| !n.is_empty())
    }

    /// Whether the fast path is on (`REDIS_URL` set), once checked: refuses a URL that is not Redis's, and
    /// a key TTL longer than the key retention (Redis must not remember keys PostgreSQL forgot).
    pub fn enabled(&self, retention: &RetentionArgs) -> Result<bool, ConfigProblem> {
        let Some(url) = self.url() else {
            return Ok(false);
        };
        client(url)?;
        // The declarations' rules again, for values set in code.
        let checks = [
            (
                "REDIS_LOCK_TTL_MS",
                value::positive(self.lock_ttl)
                    .and_then(|d| value::at_most(d, crate::settings::MAX_REDIS_LOCK_TTL)),
            ),
            ("REDIS_KEY_TTL_SECS", value::positive(self.key_ttl)),
            ("REDIS_TIMEOUT_MS", value::positive(self.timeout)),
        ];
        if let Some(problem) = ConfigProblem::all(saga_runtime::settings::failed(checks)) {
            return Err(problem);
        }
        let retention = retention.key_retention()?;
        if self.key_ttl > retention {
            return Err(ConfigProblem::new(
                "REDIS_KEY_TTL_SECS",
                format!(
                    "{} s is longer than the key retention ({} h)",
                    self.key_ttl.as_secs(),
                    retention.as_secs_f64() / 3600.0
                ),
                "lower it: Redis may not remember keys PostgreSQL has forgotten",
            ));
        }
        Ok(true)
    }
}

/// The client of the Redis at `url`, or the problem with `REDIS_URL`.
fn client(url: &str) -> Result<redis::Client, ConfigProblem> {
    redis::Client::open(url).map_err(|e| {
        ConfigProblem::new(
            "REDIS_URL",
            format!("is not a Redis URL: {e}"),
            "use redis://host:port/db",
        )
    })
}

/// Labels of the fast path's hit counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UseLabels {
    /// `replay` (HTTP response from Redis), `in_flight` (409 from Redis), `duplicate` (consumer skip).
    answer: &'static str,
}

#[derive(Clone, Default)]
struct Metrics {
    available: Gauge,
    errors: Counter,
    answered: Family<UseLabels, Counter>,
}

struct Inner {
    client: redis::Client,
    settings: FastPathArgs,
    namespace: String,
    connection: Mutex<Option<MultiplexedConnection>>,
    /// When the last connection attempt failed; none is made again before [`RECONNECT_INTERVAL`].
    failed_at: Mutex<Option<Instant>>,
    connecting: tokio::sync::Mutex<()>,
    /// Whether the outage was logged already.
    down_logged: AtomicBool,
    /// Set when the default namespace no longer names the database it was made for (a promotion or a
    /// restore while the service ran): the fast path is off, the service runs on PostgreSQL alone.
    retired: AtomicBool,
    metrics: Metrics,
}

/// A handle on the Redis fast path, cheap to clone. See the module documentation.
#[derive(Clone)]
pub struct FastPath(Arc<Inner>);

impl std::fmt::Debug for FastPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastPath")
            .field("namespace", &self.0.namespace)
            .field("settings", &self.0.settings)
            .finish_non_exhaustive()
    }
}

/// A held in-flight lock; release it with [`FastPath::unlock`] (or let it expire).
#[derive(Debug)]
pub struct InFlight {
    key: String,
    token: String,
}

/// A response stored in Redis for replay, with the fingerprint of the request that produced it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct CachedResponse {
    /// The request fingerprint (hex).
    pub fingerprint: String,
    /// The stored response, as PostgreSQL stores it.
    pub response: serde_json::Value,
}

/// What Redis says about an in-flight lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LockAnswer {
    /// Taken: this request holds it.
    Acquired,
    /// Another request holds it.
    Held,
    /// Redis did not answer: go on with PostgreSQL alone.
    Unknown,
}

impl FastPath {
    /// A fast path for `settings`, with keys under the namespace from the settings or, when unset,
    /// [`default_namespace`] of `pool`. Redis need not be up: the connection is made on first use and again
    /// after every outage.
    pub async fn new(settings: FastPathArgs, pool: &sqlx::PgPool) -> Result<Self, ConfigProblem> {
        match settings.namespace().map(str::to_owned) {
            Some(namespace) => Self::with_namespace(settings, namespace),
            None => {
                let namespace = default_namespace(pool).await?;
                let fast = Self::with_namespace(settings, namespace.clone())?;
                fast.watch_namespace(pool.clone(), namespace, NAMESPACE_CHECK_INTERVAL);
                Ok(fast)
            }
        }
    }

    /// Reads the default namespace every `every`, for as long as this fast path lives; once it differs
    /// from `made_for` (the database was promoted or restored under the running service: Redis's answers
    /// are about keys the database may have lost), turns the fast path off for good.
    fn watch_namespace(&self, pool: sqlx::PgPool, made_for: String, every: Duration) {
        let inner = Arc::downgrade(&self.0);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(inner) = inner.upgrade() else {
                    return;
                };
                // Unreadable (the database down): read again at the next round.
                let Ok(now) = default_namespace(&pool).await else {
                    continue;
                };
                if now != made_for {
                    inner.retired.store(true, Ordering::Relaxed);
                    *lock(&inner.connection) = None;
                    inner.metrics.available.set(0);
                    tracing::error!(
                        was = %made_for,
                        now = %now,
                        "the database's timeline changed under the service (a promotion or a restore): the \
                         Redis fast path is off, the service runs on PostgreSQL alone; restart it for a fresh \
                         namespace"
                    );
                    return;
                }
            }
        });
    }

    /// Whether the fast path turned itself off because its namespace no longer names its database.
    pub fn is_retired(&self) -> bool {
        self.0.retired.load(Ordering::Relaxed)
    }

    /// The fast path the environment asks for ([`FastPathArgs`] and the key retention it is checked
    /// against): `None` when `REDIS_URL` is unset. Tries Redis once, so that an outage at start is logged
    /// and counted at once; Redis being down is not an error.
    pub async fn from_env(pool: &sqlx::PgPool) -> Result<Option<Self>, ConfigProblem> {
        let settings = FastPathArgs::from_env()?;
        if !settings.enabled(&RetentionArgs::from_env()?)? {
            return Ok(None);
        }
        let fast = Self::new(settings, pool).await?;
        fast.connect().await;
        Ok(Some(fast))
    }

    /// Connects now, if not connected yet, instead of on first use: whether Redis answers. A service
    /// calls it at start (as [`FastPath::from_env`] does), so that its first requests find the connection
    /// made.
    pub async fn connect(&self) -> bool {
        self.connection().await.is_some()
    }

    /// A fast path with keys under `namespace`; refuses settings without a Redis URL.
    pub fn with_namespace(
        settings: FastPathArgs,
        namespace: impl Into<String>,
    ) -> Result<Self, ConfigProblem> {
        install_tls_provider();
        let url = settings.url().ok_or_else(|| {
            ConfigProblem::new("REDIS_URL", "is not set", "set it to turn the fast path on")
        })?;
        let client = client(url)?;
        Ok(Self(Arc::new(Inner {
            client,
            settings,
            namespace: namespace.into(),
            connection: Mutex::new(None),
            failed_at: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            down_logged: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            metrics: Metrics::default(),
        })))
    }

    /// The settings.
    pub fn settings(&self) -> &FastPathArgs {
        &self.0.settings
    }

    /// The prefix of every key this fast path writes.
    pub fn namespace(&self) -> &str {
        &self.0.namespace
    }

    /// Deletes every key of the namespace (what a service must do after its database was restored to an
    /// earlier point: Redis may remember completions the restored database does not have). Returns how
    /// many keys were deleted. Unlike the service's calls, an unreachable Redis is an error here (Redis's
    /// own, kept as the [`Cause`](crate::Cause)).
    pub async fn forget_namespace(&self) -> Result<u64, crate::Cause> {
        self.forget_all().await.map_err(crate::Cause::new)
    }

    /// [`FastPath::forget_namespace`], with Redis's error.
    async fn forget_all(&self) -> Result<u64, redis::RedisError> {
        let mut conn = self.0.client.get_multiplexed_async_connection().await?;
        let pattern = format!("{}:*", glob_escape(&self.0.namespace));
        let mut cursor: u64 = 0;
        let mut deleted = 0;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await?;
            if !keys.is_empty() {
                let removed: u64 = redis::cmd("UNLINK")
                    .arg(&keys)
                    .query_async(&mut conn)
                    .await?;
                deleted += removed;
            }
            if next == 0 {
                return Ok(deleted);
            }
            cursor = next;
        }
    }

    /// Its own metrics (`saga_redis_available`, `saga_redis_errors`, `saga_redis_answered`), read from code:
    /// a handle on them alone, live (a service's `/metrics` serves them with the rest).
    pub fn metrics(&self) -> crate::OpsHandle {
        let ops = Ops::new();
        self.register(&ops);
        crate::OpsHandle::new(ops.handle())
    }

    /// Registers `saga_redis_available`, `saga_redis_errors` and `saga_redis_answered` on `ops` (a
    /// service registers its fast path itself).
    pub(crate) fn register(&self, ops: &Ops) {
        let m = self.0.metrics.clone();
        ops.register(move |registry| {
            let r = registry.sub_registry_with_prefix("saga_redis");
            r.register(
                "available",
                "1 while Redis answers, 0 while everything runs on PostgreSQL alone",
                m.available,
            );
            r.register(
                "errors",
                "Redis calls that failed or timed out (answered from PostgreSQL instead)",
                m.errors,
            );
            r.register(
                "answered",
                "Requests and messages answered from Redis without PostgreSQL, by answer",
                m.answered,
            );
        });
    }

    fn key(&self, kind: &str, tenant: &TenantId, step_key: &StepKey) -> String {
        // Tenants and keys are visible ASCII without spaces; `:` may occur in a step key, never in a
        // tenant, so the split is unambiguous.
        format!("{}:{kind}:{tenant}:{step_key}", self.0.namespace)
    }

    /// What is known without a connection attempt: the connection made (`Some(Some(_))`), or Redis down
    /// since an attempt less than [`RECONNECT_INTERVAL`] ago (`Some(None)`); `None`: an attempt is due.
    fn settled(&self) -> Option<Option<MultiplexedConnection>> {
        if let Some(c) = lock(&self.0.connection).clone() {
            return Some(Some(c));
        }
        lock(&self.0.failed_at)
            .is_some_and(|at| at.elapsed() < RECONNECT_INTERVAL)
            .then_some(None)
    }

    /// A connection, or `None` while Redis is down (no attempt more often than [`RECONNECT_INTERVAL`]).
    async fn connection(&self) -> Option<MultiplexedConnection> {
        if self.0.retired.load(Ordering::Relaxed) {
            return None;
        }
        if let Some(known) = self.settled() {
            return known;
        }
        // One attempt at a time. The others wait for it as long as a call may take, so that many first
        // uses at once share the one connection; past that they go to PostgreSQL.
        let _connecting = tokio::time::timeout(self.0.settings.timeout, self.0.connecting.lock())
            .await
            .ok()?;
        // The attempt waited for may have made the connection, or failed just now.
        if let Some(known) = self.settled() {
            return known;
        }
        let attempt = tokio::time::timeout(
            self.0.settings.timeout.max(Duration::from_millis(500)),
            self.0.client.get_multiplexed_async_connection(),
        )
        .await;
        match attempt {
            Ok(Ok(c)) => {
                *lock(&self.0.connection) = Some(c.clone());
                *lock(&self.0.failed_at) = None;
                self.0.metrics.available.set(1);
                if self.0.down_logged.swap(false, Ordering::Relaxed) {
                    tracing::info!(namespace = %self.0.namespace, "Redis answers again; the fast path is back");
                }
                Some(c)
            }
            Ok(Err(e)) => {
                self.down(&e.to_string());
                None
            }
            Err(_) => {
                self.down("connection timed out");
                None
            }
        }
    }

    fn down(&self, error: &str) {
        *lock(&self.0.connection) = None;
        *lock(&self.0.failed_at) = Some(Instant::now());
        self.0.metrics.available.set(0);
        self.0.metrics.errors.inc();
        if !self.0.down_logged.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                error,
                url = %saga_runtime::config::redact(self.0.settings.url().unwrap_or_default()),
                "Redis is unavailable: running on PostgreSQL alone until it answers again"
            );
        }
    }

    /// Runs `cmd`; `None` if Redis is down, fails or is slower than the timeout.
    async fn run<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Option<T> {
        let mut c = self.connection().await?;
        self.within_timeout(cmd.query_async::<T>(&mut c)).await
    }

    /// Awaits a Redis call for at most the timeout: a failure marks Redis down, a timeout is counted
    /// (slow, not necessarily down: the connection is kept).
    async fn within_timeout<T>(
        &self,
        call: impl Future<Output = redis::RedisResult<T>>,
    ) -> Option<T> {
        match tokio::time::timeout(self.0.settings.timeout, call).await {
            Ok(Ok(v)) => Some(v),
            Ok(Err(e)) => {
                self.down(&e.to_string());
                None
            }
            Err(_) => {
                // Slow, not necessarily down: count it, keep the connection.
                self.0.metrics.errors.inc();
                tracing::debug!("a Redis call timed out; answered from PostgreSQL");
                None
            }
        }
    }

    /// Takes the in-flight lock of `step_key` for `lock_ttl`.
    pub async fn lock(
        &self,
        tenant: &TenantId,
        step_key: &StepKey,
    ) -> (LockAnswer, Option<InFlight>) {
        let key = self.key("lock", tenant, step_key);
        let token = uuid::Uuid::new_v4().simple().to_string();
        let ttl = u64::try_from(self.0.settings.lock_ttl.as_millis()).unwrap_or(u64::MAX);
        let set: Option<Option<String>> = self
            .run(
                redis::cmd("SET")
                    .arg(&key)
                    .arg(&token)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl),
            )
            .await;
        match set {
            Some(Some(_)) => (LockAnswer::Acquired, Some(InFlight { key, token })),
            Some(None) => {
                self.answered("in_flight", 1);
                (LockAnswer::Held, None)
            }
            None => (LockAnswer::Unknown, None),
        }
    }

    /// Releases `lock` if it is still this request's (a lock that expired and was taken by another
    /// request is left alone).
    pub async fn unlock(&self, lock: InFlight) {
        let script = redis::cmd("EVAL")
            .arg("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end")
            .arg(1)
            .arg(&lock.key)
            .arg(&lock.token)
            .to_owned();
        let _: Option<i64> = self.run(&script).await;
    }

    /// The cached response of `step_key`, if Redis has one that decodes.
    pub async fn cached_response(
        &self,
        tenant: &TenantId,
        step_key: &StepKey,
    ) -> Option<CachedResponse> {
        let value: Option<Vec<u8>> = self
            .run(redis::cmd("GET").arg(self.key("http", tenant, step_key)))
            .await?;
        let cached = serde_json::from_slice(&value?).ok();
        if cached.is_none() {
            tracing::debug!(%step_key, "a cached response does not decode; asking PostgreSQL");
        }
        cached
    }

    /// Stores `response` for `step_key`: call only after the transaction that stored it committed.
    pub async fn cache_response(
        &self,
        tenant: &TenantId,
        step_key: &StepKey,
        response: &CachedResponse,
    ) {
        let Ok(value) = serde_json::to_vec(response) else {
            return;
        };
        let _: Option<()> = self
            .run(
                redis::cmd("SET")
                    .arg(self.key("http", tenant, step_key))
                    .arg(value)
                    .arg("PX")
                    .arg(self.key_ttl_ms()),
            )
            .await;
    }

    /// Counts `n` requests or messages answered from Redis (`replay`, `in_flight`, `duplicate`).
    pub fn answered(&self, answer: &'static str, n: u64) {
        if n > 0 {
            self.0
                .metrics
                .answered
                .get_or_create(&UseLabels { answer })
                .inc_by(n);
        }
    }

    /// Which of `keys` Redis knows to be completed: one `MGET`. All `false` when Redis does not answer.
    pub async fn completed(&self, keys: &[(&TenantId, &StepKey)]) -> Vec<bool> {
        if keys.is_empty() {
            return Vec::new();
        }
        let mut cmd = redis::cmd("MGET");
        for (tenant, step_key) in keys {
            cmd.arg(self.key("step", tenant, step_key));
        }
        match self.run::<Vec<Option<Vec<u8>>>>(&cmd).await {
            Some(values) if values.len() == keys.len() => {
                values.iter().map(|v| v.as_deref() == Some(b"c")).collect()
            }
            _ => vec![false; keys.len()],
        }
    }

    /// Records `keys` as completed: call only after the transaction that claimed them committed.
    pub async fn mark_completed(&self, keys: &[(&TenantId, &StepKey)]) {
        if keys.is_empty() {
            return;
        }
        let mut pipe = redis::pipe();
        let ttl = self.key_ttl_ms();
        for (tenant, step_key) in keys {
            pipe.cmd("SET")
                .arg(self.key("step", tenant, step_key))
                .arg("c")
                .arg("PX")
                .arg(ttl)
                .ignore();
        }
        let Some(mut c) = self.connection().await else {
            return;
        };
        let _: Option<()> = self.within_timeout(pipe.query_async(&mut c)).await;
    }

    fn key_ttl_ms(&self) -> u64 {
        u64::try_from(self.0.settings.key_ttl.as_millis()).unwrap_or(u64::MAX)
    }
}

/// How often a fast path with the default namespace reads it again, to notice a promotion or a restore
/// under a running service.
const NAMESPACE_CHECK_INTERVAL: Duration = Duration::from_secs(2);

/// The namespace a service's keys go under when `REDIS_NAMESPACE` is unset:
/// `saga:{system identifier}.{timeline}.{database}.{schema}` of `pool`'s connections. The system identifier
/// (`pg_control_system()`) is set when a cluster is created, so staging and production (or two regions)
/// that share a Redis and name their databases and schemas alike still get namespaces of their own; the
/// timeline (the one WAL is written on) changes when a replica is promoted or a backup is restored to a
/// point in time, so such a copy starts with a namespace of its own, and a fast path made under the old
/// one turns itself off within seconds ([`FastPath::is_retired`]). A copy made with `pg_basebackup` and
/// started as it is keeps both: see [`FastPath::forget_namespace`].
pub async fn default_namespace(pool: &sqlx::PgPool) -> Result<String, ConfigProblem> {
    // The timeline WAL is written on now (a promoted server's, before its first checkpoint records it). A
    // standby gives none: its timeline is the primary's until it is promoted, and a namespace read there
    // would be confirmed under a server that cannot write the keys it stands for.
    let (in_recovery, cluster, timeline, db, schema): (bool, String, Option<i32>, String, String) =
        sqlx::query_as(
            "SELECT pg_is_in_recovery(), (SELECT system_identifier::text FROM pg_control_system()), \
                    CASE WHEN pg_is_in_recovery() THEN NULL \
                         ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int END, \
                    current_database()::text, current_schema()::text",
        )
        .fetch_one(pool)
        .await
        .map_err(|e| {
            ConfigProblem::new(
                "REDIS_NAMESPACE",
                format!("is unset, and the default cannot be read from the database ({e})"),
                "set REDIS_NAMESPACE to a name no other deployment sharing the Redis uses",
            )
        })?;
    let timeline = match timeline {
        Some(timeline) if !in_recovery => timeline,
        _ => {
            return Err(ConfigProblem::new(
                "REDIS_NAMESPACE",
                "is unset, and the default cannot be read from a database in recovery (a standby)",
                "point DATABASE_URL at the primary",
            ));
        }
    };
    Ok(namespace_of(&cluster, timeline, &db, &schema))
}

/// The default namespace of a cluster (`system_identifier`) on `timeline`, for `schema` of `db`. The
/// timeline is what changes when a copy of the cluster becomes a cluster of its own: a replica promoted, a
/// backup restored to a point in time (each ends recovery on a new timeline). So the restored or promoted
/// copy starts with an empty namespace instead of Redis's answers for keys its database lost.
fn namespace_of(cluster: &str, timeline: i32, db: &str, schema: &str) -> String {
    format!("saga:{cluster}.{timeline}.{db}.{schema}")
}

/// `text` with Redis glob characters escaped, for `SCAN MATCH`.
fn glob_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\' | '^') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Makes rustls's ring provider the process's default, for `rediss://` connections: Redis's TLS builds its
/// configuration from the process default, and a build where another crate also turned on rustls's
/// aws-lc provider (crates.io's pgwire-replication does) would otherwise have two and no default. A
/// provider installed before (by the application, say) stays.
fn install_tls_provider() {
    // An error only says that a default is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restored_or_promoted_copy_gets_a_namespace_of_its_own() {
        let original = namespace_of("7431", 1, "orders", "public");
        // Promoted, or restored to a point in time: the same cluster identifier, another timeline.
        assert_ne!(namespace_of("7431", 2, "orders", "public"), original);
        assert_ne!(namespace_of("7432", 1, "orders", "public"), original);
        assert_eq!(
            namespace_of("7431", 1, "orders", "public"),
            original,
            "stable"
        );
    }

    /// A fast path watches its default namespace: while the database still gives the one it was made for,
    /// it stays on; once the database gives another (here: it was made for a namespace the database does
    /// not give, as after a promotion or a restore under it), it turns itself off and answers nothing.
    #[tokio::test]
    async fn a_fast_path_turns_itself_off_when_its_namespace_no_longer_names_its_database() {
        let db = saga_test_support::TestDb::new("fast-path-watch").await;
        let url =
            std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
        let every = Duration::from_millis(50);

        let current = default_namespace(&db.pool).await.unwrap();
        let kept = FastPath::with_namespace(FastPathArgs::new(&url), current.clone()).unwrap();
        kept.watch_namespace(db.pool.clone(), current, every);
        let moved = FastPath::with_namespace(FastPathArgs::new(&url), "saga:1.1.x.y").unwrap();
        moved.watch_namespace(db.pool.clone(), "saga:1.1.x.y".to_owned(), every);
        assert!(moved.connect().await, "Redis answers at {url}");

        saga_test_support::wait_until("the fast path off", Duration::from_secs(10), || async {
            moved.is_retired().then_some(())
        })
        .await;
        assert!(!moved.connect().await, "no Redis once retired");
        assert!(!kept.is_retired());
        assert!(kept.connect().await);
    }
}
