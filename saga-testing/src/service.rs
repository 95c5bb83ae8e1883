//! A service of the system under test, run as a task of the test process: what its setup is given
//! ([`ServiceSetup`]), and the kit's record of it while it runs (started again after a simulated crash).

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use saga_consumer::settings::ServiceArgs;
use saga_consumer::{OpsHandle, OutboxMode, SagaService, SagaServiceBuilder, ServiceError};
use saga_orchestrator::{Orchestrator, SagaClock, SagaData};
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::KitError;
use crate::cluster::Cluster;
use crate::error::BoxError;

/// How often an orchestrator set up by [`ServiceSetup::orchestrator`] looks for due timers.
const TIMER_INTERVAL: Duration = Duration::from_millis(20);

/// The session timeout of the kit's services.
pub(crate) const SESSION_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a service may take to stop.
const STOP: Duration = Duration::from_secs(30);

/// What a service's setup is given: its PostgreSQL schema and pool, a builder already pointed at the mock
/// cluster with the kit's quick settings, and the test's clock.
#[derive(Clone)]
pub struct ServiceSetup {
    name: String,
    schema: String,
    pool: PgPool,
    args: ServiceArgs,
    clock: SagaClock,
}

impl std::fmt::Debug for ServiceSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the settings: their database URL may hold a password.
        f.debug_struct("ServiceSetup")
            .field("name", &self.name)
            .field("schema", &self.schema)
            .finish_non_exhaustive()
    }
}

impl ServiceSetup {
    /// The service's name in the test.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The service's schema, made for this test (the pool's `search_path`).
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// A pool on the service's schema: the framework's tables and the service's own go there.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The PostgreSQL URL of the test's database.
    pub fn database_url(&self) -> &str {
        self.args
            .database
            .database_url
            .as_deref()
            .unwrap_or_default()
    }

    /// The mock cluster's `bootstrap.servers`.
    pub fn brokers(&self) -> &str {
        self.args.kafka.brokers.as_deref().unwrap_or_default()
    }

    /// The framework's settings the kit runs the service with: the mock cluster, the group
    /// `{test}.{name}`, offsets committed every 20 ms, three attempts 5 ms apart before a dead letter, the
    /// relay's fallback poll every 20 ms. Returned by value for a service that builds from settings of its
    /// own: change them and pass them to [`SagaServiceBuilder::args`].
    pub fn args(&self) -> ServiceArgs {
        self.args.clone()
    }

    /// A service builder with [`ServiceSetup::args`] and [`ServiceSetup::pool`], and a session timeout of
    /// 2 s: add the steps. (After a member leaves, the mock cluster makes the group's next join wait the
    /// session timeout less a second: a service started again waits 1 s, not librdkafka's default 44 s.)
    pub fn builder(&self) -> SagaServiceBuilder {
        SagaService::builder()
            .args(&self.args)
            .pool(self.pool.clone())
    }

    /// The test's clock ([`crate::SagaTest::advance`] moves it).
    pub fn clock(&self) -> &SagaClock {
        &self.clock
    }

    /// `orchestrator` on the test's clock, looking for due timers every 20 ms: a timeout fires as soon as
    /// the test moves the clock past it.
    pub fn orchestrator<D: SagaData>(&self, orchestrator: Orchestrator<D>) -> Orchestrator<D> {
        orchestrator
            .with_clock(&self.clock)
            .with_timer_interval(TIMER_INTERVAL)
    }
}

/// A service's setup: called when the service starts, and again when it starts after a simulated crash.
pub(crate) type Setup = Arc<
    dyn Fn(ServiceSetup) -> BoxFuture<'static, Result<SagaServiceBuilder, BoxError>> + Send + Sync,
>;

/// A service of the test, running or stopped.
pub(crate) struct Running {
    pub(crate) setup: ServiceSetup,
    make: Setup,
    /// Its consumer group.
    pub(crate) group: String,
    /// The topics it consumes.
    pub(crate) topics: Vec<String>,
    /// Its dead-letter topic.
    pub(crate) dlq: String,
    /// How many dead letters of its the test expects ([`crate::SagaTest::expect_dead_letters`]).
    pub(crate) letters_expected: usize,
    stop: CancellationToken,
    task: Option<JoinHandle<Result<(), ServiceError>>>,
    /// How it ended, once it stopped on its own.
    ended: Option<String>,
    /// Its readiness.
    ops: Option<OpsHandle>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("name", &self.setup.name)
            .field("group", &self.group)
            .field("topics", &self.topics)
            .finish_non_exhaustive()
    }
}

impl Running {
    /// Makes the service's schema and pool, builds it with `make` and starts it.
    pub(crate) async fn start(
        name: &str,
        schema: String,
        args: ServiceArgs,
        clock: SagaClock,
        cluster: &Cluster,
        make: Setup,
    ) -> Result<Self, KitError> {
        let url = args.database.database_url.clone().unwrap_or_default();
        let admin = saga_consumer::setup::connect_postgres("DATABASE_URL", &url, None, 1).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA {}",
            quote_ident(&schema)
        )))
        .execute(&admin)
        .await?;
        admin.close().await;
        let pool =
            saga_consumer::setup::connect_postgres("DATABASE_URL", &url, Some(&schema), 8).await?;
        let setup = ServiceSetup {
            name: name.to_owned(),
            schema,
            pool,
            args,
            clock,
        };
        let mut running = Self {
            setup,
            make,
            group: String::new(),
            topics: Vec::new(),
            dlq: String::new(),
            letters_expected: 0,
            stop: CancellationToken::new(),
            task: None,
            ended: None,
            ops: None,
        };
        if let Err(e) = running.run(cluster).await {
            // Nothing of a service that never ran is left behind.
            let _ = drop_schemas(&url, std::slice::from_ref(&running.setup.schema)).await;
            return Err(e);
        }
        Ok(running)
    }

    /// Builds the service again and starts it; a failure is also kept as how the service ended.
    pub(crate) async fn run(&mut self, cluster: &Cluster) -> Result<(), KitError> {
        let started = self.build_and_run(cluster).await;
        if let Err(e) = &started {
            self.ended = Some(format!("it did not start: {e}"));
        }
        started
    }

    async fn build_and_run(&mut self, cluster: &Cluster) -> Result<(), KitError> {
        let failed = |error: BoxError| KitError::Service {
            service: self.setup.name.clone(),
            error,
        };
        let builder = (self.make)(self.setup.clone()).await.map_err(failed)?;
        if builder.outbox().mode() != OutboxMode::Table {
            // The quiet-wait reads the table outbox; a WAL outbox's events would go unseen.
            return Err(failed(
                "the kit runs services with the table outbox (SAGA_OUTBOX_MODE=table); this one writes \
                 another"
                    .into(),
            ));
        }
        let service = builder.build().map_err(|e| failed(e.into()))?;
        self.group = service.group_id().to_owned();
        self.topics = service.topics();
        self.dlq = service.dlq_topic();
        self.ops = Some(service.ops());
        for topic in self.topics.iter().chain([&self.dlq]) {
            cluster.create_topic(topic)?;
        }
        self.stop = CancellationToken::new();
        self.ended = None;
        self.task = Some(tokio::spawn(
            service.run(self.stop.clone().cancelled_owned()),
        ));
        Ok(())
    }

    /// The running service's ops handle.
    pub(crate) fn ops(&self) -> Option<OpsHandle> {
        self.ops.clone()
    }

    /// Whether the service is ready: its migrations applied, its partitions assigned.
    pub(crate) fn is_ready(&self) -> bool {
        self.task.is_some() && self.ops.as_ref().is_some_and(OpsHandle::is_ready)
    }

    /// Why the service stopped on its own, if it did (a service stops only when the test stops it).
    pub(crate) async fn stopped(&mut self) -> Option<String> {
        if self.task.as_ref().is_some_and(JoinHandle::is_finished)
            && let Some(task) = self.task.take()
        {
            self.ended = Some(match task.await {
                Ok(Ok(())) => "it stopped on its own".to_owned(),
                Ok(Err(e)) => format!("it stopped: {e}"),
                Err(e) => format!("it panicked: {e}"),
            });
        }
        match (&self.task, &self.ended) {
            (None, None) => Some("it is not running (a restart failed?)".to_owned()),
            _ => self.ended.clone(),
        }
    }

    /// Stops the service (what it is in, it finishes) and returns how it ended.
    pub(crate) async fn stop(&mut self) -> Result<(), KitError> {
        self.stop.cancel();
        let Some(task) = self.task.take() else {
            return match self.ended.clone() {
                Some(ended) => Err(KitError::Service {
                    service: self.setup.name.clone(),
                    error: ended.into(),
                }),
                None => Ok(()),
            };
        };
        let failed = |error: BoxError| KitError::Service {
            service: self.setup.name.clone(),
            error,
        };
        match tokio::time::timeout(STOP, task).await {
            Err(_) => Err(failed(format!("did not stop within {STOP:?}").into())),
            Ok(Err(e)) => Err(failed(e.to_string().into())),
            Ok(Ok(result)) => result.map_err(|e| failed(e.into())),
        }
    }
}

impl Running {
    /// Stops the service at once, without waiting for it (a test that is being torn down).
    pub(crate) fn abort(&mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // A test that ends without stopping the kit leaves no service running behind it.
        self.stop.cancel();
    }
}

/// Drops `schemas` (waiting at most 10 s for a lock a service's connection may still hold), each even when
/// another could not be; returns the first failure.
pub(crate) async fn drop_schemas(url: &str, schemas: &[String]) -> Result<(), KitError> {
    let admin = saga_consumer::setup::connect_postgres("DATABASE_URL", url, None, 1).await?;
    let mut conn = admin.acquire().await?;
    // A service's transaction cut short (its task aborted while the test's runtime is blocked here) holds
    // its locks until its session ends: the test's own sessions on its own schemas are ended first.
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM (SELECT DISTINCT l.pid FROM pg_locks l \
             JOIN pg_class c ON c.oid = l.relation JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = ANY($1) AND l.pid <> pg_backend_pid()) holders",
    )
    .bind(schemas)
    .execute(&mut *conn)
    .await?;
    sqlx::query("SET lock_timeout = '10s'")
        .execute(&mut *conn)
        .await?;
    let mut first_error = None;
    for schema in schemas {
        let dropped = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {} CASCADE",
            quote_ident(schema)
        )))
        .execute(&mut *conn)
        .await;
        if let Err(e) = dropped {
            first_error.get_or_insert(KitError::from(e));
        }
    }
    drop(conn);
    admin.close().await;
    first_error.map_or(Ok(()), Err)
}

/// Quotes an SQL identifier.
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
