//! The one runner of a service: migrations, topics, the consumer, the embedded outbox relay and any
//! background tasks (the orchestrator's timers, an HTTP server), stopped together.

use std::future::Future;

use futures::future::BoxFuture;
use outbox_relay::{Relay, RelayBuilder, RelayError};
use saga_config::OutboxMode;

use crate::settings::ServiceArgs;
use saga_runtime::config::ConfigProblem;
use saga_runtime::kafka::KafkaConfig;
use saga_runtime::ops::Ops;

use crate::ops::OpsHandle;
use sqlx::PgPool;
use sqlx::migrate::Migrator;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::builder::SagaBuilder;
use crate::consumer::SagaConsumer;
use crate::error::{ConfigError, ConsumerError};

/// An error a background task returns.
pub type TaskError = Box<dyn std::error::Error + Send + Sync + 'static>;

type TaskFn = Box<dyn FnOnce(TaskContext) -> BoxFuture<'static, Result<(), TaskError>> + Send>;

/// Why a service did not start, or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServiceError {
    /// The consumer's settings are incomplete or invalid (names the setting).
    // Not transparent: the cause stays in the error's chain, where `exit_code` finds a
    // configuration problem (exit code 2).
    #[error("{0}")]
    Config(#[from] ConfigError),
    /// The relay's settings are incomplete or invalid, or it failed.
    #[error("relay: {0}")]
    Relay(#[from] RelayError),
    /// The framework's (or the service's) migrations could not be applied.
    #[error("applying migrations: {0}")]
    Migrations(#[source] sqlx::migrate::MigrateError),
    /// The topics could not be created, or their retention read (`doing` says which).
    #[error("{doing}: {source}")]
    Topics {
        /// What was being done with the topics.
        doing: &'static str,
        /// The broker client's error.
        #[source]
        source: crate::error::BrokerError,
    },
    /// The consumer failed.
    // Not transparent: the cause stays in the error's chain, where `exit_code` finds a
    // configuration problem (exit code 2).
    #[error("{0}")]
    Consumer(#[from] ConsumerError),
    /// A background task failed.
    #[error("task {name}: {error}")]
    Task {
        /// The task's name.
        name: String,
        /// Its error.
        error: TaskError,
    },
    /// A part of the service ended on its own before the service was told to stop.
    #[error("{0} stopped unexpectedly")]
    Stopped(String),
}

impl From<ConfigProblem> for ServiceError {
    fn from(problem: ConfigProblem) -> Self {
        Self::Config(ConfigError::Problem(problem))
    }
}

/// What a background task gets: the service's database and the signal to stop.
#[derive(Debug, Clone)]
pub struct TaskContext {
    pool: PgPool,
    shutdown: CancellationToken,
}

impl TaskContext {
    /// The service's database.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Resolves when the service stops (its shutdown future resolved, or another part failed): finish
    /// what you are in and return.
    pub fn shutdown(&self) -> impl Future<Output = ()> + Send + 'static {
        self.shutdown.clone().cancelled_owned()
    }

    /// Whether the service is stopping.
    pub fn is_stopping(&self) -> bool {
        self.shutdown.is_cancelled()
    }
}

/// Something that adds steps, migrations and background tasks to a service, such as an orchestrator
/// (its reply steps, its tables, its timers).
///
/// # Examples
///
/// ```
/// use saga_consumer::{Extension, SagaServiceBuilder};
///
/// /// Sweeps a table of the service's own every minute while the service runs.
/// struct Sweeper;
///
/// impl Extension for Sweeper {
///     fn extend(self, service: SagaServiceBuilder) -> SagaServiceBuilder {
///         service.task("sweeper", |ctx| async move {
///             let mut shutdown = std::pin::pin!(ctx.shutdown());
///             loop {
///                 tokio::select! {
///                     () = &mut shutdown => return Ok(()),
///                     () = tokio::time::sleep(std::time::Duration::from_secs(60)) => {}
///                 }
///                 saga_consumer::sqlx::query("DELETE FROM drafts WHERE created_at < now() - interval '1 day'")
///                     .execute(ctx.pool())
///                     .await?;
///             }
///         })
///     }
/// }
/// # let _ = Sweeper;
/// ```
pub trait Extension {
    /// Adds what it needs to `service`.
    fn extend(self, service: SagaServiceBuilder) -> SagaServiceBuilder;
}

/// Builds a [`SagaService`].
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// use saga_consumer::{RetryPolicy, SagaService};
/// # use saga_consumer::{Message, SagaStep, StepContext, StepName, StepOutcome, StepResult, Subscription};
/// # struct RecordPayment;
/// # impl SagaStep for RecordPayment {
/// #     type Payload = serde_json::Value;
/// #     fn name(&self) -> StepName { StepName::from_static("record-payment") }
/// #     fn subscriptions(&self) -> Vec<Subscription> { vec![Subscription::new("payments", "PaymentProcessed")] }
/// #     async fn handle(&self, _: &Message<serde_json::Value>, _: &mut StepContext<'_>) -> StepResult { Ok(StepOutcome::completed()) }
/// # }
///
/// # fn example(pool: saga_consumer::sqlx::PgPool) -> Result<(), saga_consumer::ServiceError> {
/// let service = SagaService::builder()
///     .brokers("127.0.0.1:9092")
///     .group_id("payment-service")
///     .pool(pool)
///     .step(RecordPayment)
///     .retry(RetryPolicy::default().max_attempts(8))
///     .batch_size(200)
///     .commit_interval(Duration::from_millis(250))
///     .create_topics(6, 3) // partitions, replicas: create the topics it consumes and its DLQ
///     .build()?;
/// # let _ = service; Ok(()) }
/// ```
pub type SagaServiceBuilder = SagaBuilder<ServiceParts>;

/// What a service's builder adds to a consumer's: the embedded relay, the outbox, the topics, migrations
/// and tasks.
#[non_exhaustive]
pub struct ServiceParts {
    relay: RelayBuilder,
    embedded_relay: bool,
    outbox_mode: OutboxMode,
    outbox_max_bytes: usize,
    create_topics: Option<(i32, i32)>,
    accept_key_expiry: bool,
    #[cfg(feature = "redis")]
    fast_path: Option<crate::settings::FastPathArgs>,
    migrators: Vec<Migrator>,
    tasks: Vec<(String, TaskFn)>,
}

impl std::fmt::Debug for ServiceParts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceParts")
            .field("relay", &self.relay)
            .field("embedded_relay", &self.embedded_relay)
            .field("outbox_mode", &self.outbox_mode)
            .field("create_topics", &self.create_topics)
            .field(
                "tasks",
                &self.tasks.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

/// Where settings are read from instead of the environment (`SagaServiceBuilder::read_settings`).
type Vars<'a> = &'a dyn Fn(&str) -> Option<String>;

impl SagaServiceBuilder {
    fn new() -> Self {
        // The defaults are the declarations'.
        let defaults = ServiceArgs::default();
        Self::with_parts(ServiceParts {
            relay: Relay::builder(),
            embedded_relay: defaults.embedded_relay,
            outbox_mode: defaults.outbox.mode,
            outbox_max_bytes: defaults.outbox.max_transaction_bytes,
            create_topics: defaults
                .create_topics
                .map(|p| (p, defaults.topic_replication)),
            accept_key_expiry: defaults.accept_key_expiry,
            #[cfg(feature = "redis")]
            fast_path: None,
            migrators: Vec::new(),
            tasks: Vec::new(),
        })
    }

    /// Reads every setting of a service from the environment, through its one declaration
    /// ([`ServiceArgs`]: the broker, the consumer, the outbox, the embedded relay and its retention, the
    /// topics, the Redis fast path); later calls override them. A variable that does not parse, or a
    /// missing required one, is reported by `build`, naming it, with every other problem.
    pub fn from_env(self) -> Self {
        self.read_settings(None)
    }

    /// [`Self::from_env`]'s reading, of the variables `vars` gives (`None`: the environment). When
    /// [`ServiceArgs`] does not parse (its problem names every variable that does not), the groups whose
    /// checks `build` runs are read one by one, so that one group's bad variable does not hide another's
    /// missing one (`KAFKA_BROKERS`, `SAGA_GROUP_ID`); a group that does not parse on its own is only
    /// marked (its variables are in the problem already).
    fn read_settings(mut self, vars: Option<Vars<'_>>) -> Self {
        macro_rules! read {
            ($group:ty) => {
                match vars {
                    Some(get) => <$group>::from_vars(get),
                    None => <$group>::from_env(),
                }
            };
        }
        let every_bad_variable = match read!(ServiceArgs) {
            Ok(args) => return self.args(&args),
            Err(problem) => problem,
        };
        self.problem(every_bad_variable);
        match read!(outbox_relay::KafkaArgs) {
            Ok(kafka) => self.take_kafka(&kafka),
            Err(_) => self.unparsed.push("kafka"),
        }
        match read!(crate::settings::ConsumerArgs) {
            Ok(args) => self.args = args,
            Err(_) => self.unparsed.push("consumer"),
        }
        match read!(outbox_relay::RetentionArgs) {
            Ok(retention) => {
                self.parts.relay =
                    std::mem::take(&mut self.parts.relay).retention(retention.clone());
                self.retention = retention;
            }
            Err(_) => self.unparsed.push("retention"),
        }
        self
    }

    /// Takes every setting from `args` (a binary's command line that flattens [`ServiceArgs`], or
    /// [`ServiceArgs::from_env`]); later calls override them.
    pub fn args(mut self, args: &ServiceArgs) -> Self {
        self.take_kafka(&args.kafka);
        self.args = args.consumer.clone();
        self.retention = args.relay.retention.clone();
        self.parts.relay = std::mem::take(&mut self.parts.relay).args(
            &args.relay,
            &args.outbox,
            args.database.database_url.as_deref(),
        );
        self.set_outbox(args.outbox.mode, args.outbox.max_transaction_bytes);
        self.parts.embedded_relay = args.embedded_relay;
        self.parts.create_topics = args.create_topics.map(|p| (p, args.topic_replication));
        self.parts.accept_key_expiry = args.accept_key_expiry;
        #[cfg(feature = "redis")]
        match args.fast_path.enabled(&args.relay.retention) {
            Ok(on) => self.parts.fast_path = on.then(|| args.fast_path.clone()),
            Err(e) => self.problem(e),
        }
        self
    }

    /// Runs the outbox relay inside the service (the default), or not (`outbox-relay run` publishes the
    /// outbox then).
    pub fn embedded_relay(mut self, embedded: bool) -> Self {
        self.parts.embedded_relay = embedded;
        self
    }

    /// Where the service writes its outbox (`SAGA_OUTBOX_MODE`): rows of `saga_outbox` (the default), or
    /// PostgreSQL's write-ahead log (`wal_level = logical` needed), which the embedded relay (or
    /// `outbox-relay run` in WAL mode) reads through the schema's replication slot. One mode per process.
    pub fn outbox_mode(mut self, mode: OutboxMode) -> Self {
        self.set_outbox(mode, self.parts.outbox_max_bytes);
        self
    }

    /// Makes the service's outbox one of `mode` and `max_bytes`: every clone handed out already follows
    /// (the outbox is opened, and its settings fixed, when the service starts).
    fn set_outbox(&mut self, mode: OutboxMode, max_bytes: usize) {
        self.parts.outbox_mode = mode;
        self.parts.outbox_max_bytes = max_bytes;
        self.outbox.runtime().reconfigure(mode, max_bytes);
    }

    /// The service's outbox, to hand to its other writers: its HTTP layer
    /// ([`IdempotencyLayer::with_outbox`](crate::http::IdempotencyLayer::with_outbox)), an orchestrator its
    /// routes start sagas with. Its mode and size limit are the service's when it starts, whatever later
    /// calls make them: every clone follows. The service opens it when it starts, and every clone follows
    /// its health.
    pub fn outbox(&self) -> crate::Outbox {
        self.outbox.clone()
    }

    /// The largest size of one write of a transaction's events, in bytes (`SAGA_OUTBOX_MAX_TRANSACTION_BYTES`,
    /// default 16 MiB): a step whose events are larger fails for good (a dead letter saying so). A consumer's
    /// batch writes once, the orchestrator once per transition; the WAL relay's memory is bounded by it.
    pub fn outbox_max_transaction_bytes(mut self, bytes: usize) -> Self {
        self.set_outbox(self.parts.outbox_mode, bytes);
        self
    }

    /// Adjusts the embedded relay's settings (its broker and pool are the service's).
    pub fn relay(mut self, configure: impl FnOnce(RelayBuilder) -> RelayBuilder) -> Self {
        self.parts.relay = configure(std::mem::take(&mut self.parts.relay));
        // One retention: the keys the embedded relay deletes are those the consumer checks messages against
        // (a message older than the keys kept is refused, and the start-up check compares the topics'
        // retention with it).
        self.retention = self.parts.relay.retention_given().clone();
        self
    }

    /// Creates the topics the service consumes, and its dead-letter topic, where missing, with
    /// `partitions` partitions and `replication` replicas. Without it, missing topics keep the service from
    /// starting (the framework never relies on a broker's auto-creation).
    pub fn create_topics(mut self, partitions: i32, replication: i32) -> Self {
        self.parts.create_topics = Some((partitions, replication));
        self
    }

    /// Applies `migrator` at start, after the framework's own (the service's tables, say).
    pub fn migrations(mut self, migrator: Migrator) -> Self {
        self.parts.migrators.push(migrator);
        self
    }

    /// Runs `task` beside the consumer until the service stops; it must return once
    /// [`TaskContext::shutdown`] resolves. Its failure, or its return before that, stops the service.
    pub fn task<F, Fut>(mut self, name: impl Into<String>, task: F) -> Self
    where
        F: FnOnce(TaskContext) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), TaskError>> + Send + 'static,
    {
        self.parts
            .tasks
            .push((name.into(), Box::new(move |ctx| Box::pin(task(ctx)))));
        self
    }

    /// Lets `extension` add its steps, migrations and tasks (an orchestrator, say).
    pub fn with(self, extension: impl Extension) -> Self {
        extension.extend(self)
    }

    /// Checks every setting and builds the service: every problem of the settings is reported at once,
    /// each naming its variable.
    pub fn build(self) -> Result<SagaService, ServiceError> {
        // The embedded relay's problems are said with the consumer's, at once.
        let mut problems = self.settings_problems();
        if self.parts.embedded_relay {
            problems.extend(self.parts.relay.problems());
        }
        // Against the retention as it is now (a later `.relay(|r| r.retention(..))` may have changed it).
        #[cfg(feature = "redis")]
        if let Some(fast_path) = &self.parts.fast_path
            && let Err(problem) = fast_path.enabled(&self.retention)
        {
            problems.push(problem);
        }
        if let Some(problem) = ConfigProblem::all(problems) {
            return Err(ConfigError::Problem(problem).into());
        }
        let pool = self.pool.clone();
        let outbox = self.outbox.clone();
        let ops = Ops::new();
        let (consumer, parts) = self.with_ops(ops.clone()).into_consumer()?;
        let pool = pool.expect("into_consumer checked that the pool is set");
        let kafka = consumer.kafka().clone();
        let relay = if parts.embedded_relay {
            Some(
                parts
                    .relay
                    .kafka(kafka.clone())
                    .pool(pool.clone())
                    .mode(parts.outbox_mode)
                    .max_batch_bytes(parts.outbox_max_bytes)
                    .with_ops(ops.clone())
                    .build()?,
            )
        } else {
            None
        };
        Ok(SagaService {
            consumer,
            relay,
            kafka,
            create_topics: parts.create_topics,
            accept_key_expiry: parts.accept_key_expiry,
            #[cfg(feature = "redis")]
            fast_path: parts.fast_path,
            outbox,
            migrators: parts.migrators,
            tasks: parts.tasks,
            pool,
            ops,
        })
    }
}

/// Refuses to start when a topic the service reads (its steps' topics, its retry and dead-letter topics:
/// a replay comes back through the retry topic) keeps messages longer than finished step keys are kept:
/// a message coming back after its key was deleted would find nothing to say it ran.
async fn check_key_retention(
    kafka: &KafkaConfig,
    topics: &[String],
    keys: std::time::Duration,
) -> Result<(), ServiceError> {
    let names: Vec<&str> = topics.iter().map(String::as_str).collect();
    let retentions = saga_runtime::kafka::topic_retentions(kafka, &names)
        .await
        .map_err(|e| ServiceError::Topics {
            doing: "reading the topics' retention",
            source: crate::error::BrokerError::new(e),
        })?;
    let hours = |d: std::time::Duration| d.as_secs_f64() / 3600.0;
    for (topic, retention) in retentions {
        let kept = match retention {
            Some(None) => "for ever (retention.ms = -1)".to_owned(),
            Some(Some(r)) if r > keys => format!("{} h", hours(r)),
            // Kept no longer than the keys, or the broker does not say (Kafka's default is 7 days).
            _ => continue,
        };
        return Err(ServiceError::Config(ConfigError::Problem(
            ConfigProblem::new(
                "SAGA_KEY_RETENTION_HOURS",
                format!(
                    "step keys are kept {} h, but topic {topic} keeps messages {kept}: a message delivered \
                 again after its key was deleted would be dead-lettered instead of skipped",
                    hours(keys)
                ),
                "raise SAGA_KEY_RETENTION_HOURS above the topics' retention (and the broker's offset \
             retention), lower the topic's retention.ms, or set SAGA_ACCEPT_KEY_EXPIRY=true to accept it",
            ),
        )));
    }
    Ok(())
}

/// A service: its migrations, its topics, its consumer, its embedded outbox relay and its background tasks,
/// run together and stopped together.
///
/// # Examples
///
/// ```no_run
/// use saga_consumer::{Message, SagaService, SagaStep, StepContext, StepName, StepOutcome, StepResult, Subscription};
///
/// struct RecordPayment;
///
/// impl SagaStep for RecordPayment {
///     type Payload = serde_json::Value;
///     fn name(&self) -> StepName { StepName::from_static("record-payment") }
///     fn subscriptions(&self) -> Vec<Subscription> { vec![Subscription::new("payments", "PaymentProcessed")] }
///     async fn handle(&self, _msg: &Message<serde_json::Value>, _ctx: &mut StepContext<'_>) -> StepResult {
///         Ok(StepOutcome::completed())
///     }
/// }
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = saga_consumer::sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
/// SagaService::builder()
///     .from_env() // KAFKA_BROKERS and SAGA_GROUP_ID are required; SAGA_* and RELAY_* tune it
///     .pool(pool)
///     .step(RecordPayment)
///     .build()?
///     .run(saga_consumer::shutdown_signal())
///     .await?;
/// # Ok(()) }
/// ```
pub struct SagaService {
    consumer: SagaConsumer,
    relay: Option<Relay>,
    kafka: KafkaConfig,
    create_topics: Option<(i32, i32)>,
    accept_key_expiry: bool,
    #[cfg(feature = "redis")]
    fast_path: Option<crate::settings::FastPathArgs>,
    outbox: crate::Outbox,
    migrators: Vec<Migrator>,
    tasks: Vec<(String, TaskFn)>,
    pool: PgPool,
    ops: Ops,
}

impl std::fmt::Debug for SagaService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SagaService")
            .field("consumer", &self.consumer)
            .field("relay", &self.relay)
            .field(
                "tasks",
                &self.tasks.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl SagaService {
    /// The embedded relay's settings (`None`: it runs apart), for tests.
    #[doc(hidden)]
    pub fn relay_retention(&self) -> Option<&outbox_relay::RetentionPolicy> {
        self.relay.as_ref().map(Relay::retention)
    }

    /// The consumer's settings, for tests.
    #[doc(hidden)]
    pub fn consumer_args(&self) -> &crate::settings::ConsumerArgs {
        self.consumer.args()
    }

    /// How long its finished step keys are kept (`SAGA_KEY_RETENTION_HOURS`).
    pub fn key_retention(&self) -> std::time::Duration {
        self.consumer.key_retention()
    }

    /// The topics its consumer subscribes to: its steps', the ignored ones, and its retry topic.
    pub fn topics(&self) -> Vec<String> {
        self.consumer.topics()
    }

    /// Its dead-letter topic.
    pub fn dlq_topic(&self) -> String {
        self.consumer.dlq_topic()
    }

    /// Its consumer group.
    pub fn group_id(&self) -> &str {
        self.consumer
            .args()
            .group_id
            .as_deref()
            .expect("build() checked that the group id is set")
    }

    /// Starts building a service.
    pub fn builder() -> SagaServiceBuilder {
        SagaServiceBuilder::new()
    }

    /// The service's metrics (Prometheus text) and readiness, also while it runs.
    pub fn ops(&self) -> OpsHandle {
        OpsHandle::new(self.ops.handle())
    }

    /// Checks the broker (a client it refuses is a [`ConfigProblem`] naming the setting), checks (or creates)
    /// the topics and their retention, applies the migrations, opens the outbox, then
    /// runs the consumer, the embedded relay and the tasks until `shutdown` resolves (any future: [`crate::shutdown_signal`], a token's
    /// `cancelled()`), or until one part fails or ends on its own: then every other part is stopped too
    /// (each finishes what it is in) and the first failure is returned.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), ServiceError> {
        // The broker first, as the service's clients will reach it: a refused password or certificate is
        // one line naming the setting, not a consumer retrying for ever. Once: the consumer and the
        // embedded relay do not check it again. A shutdown while it is checked stops the service.
        tokio::pin!(shutdown);
        tokio::select! {
            checked = saga_runtime::kafka::probe(&self.kafka, "KAFKA_BROKERS") => checked?,
            () = &mut shutdown => return Ok(()),
        }
        // The topics next: a service that refuses to start leaves nothing behind (in WAL mode, a slot).
        if let Some((partitions, replication)) = self.create_topics {
            // The steps' topics, the retry topic and the dead-letter topic.
            let mut topics = self.consumer.topics();
            topics.push(self.consumer.dlq_topic());
            let names: Vec<&str> = topics.iter().map(String::as_str).collect();
            saga_runtime::kafka::ensure_topics(&self.kafka, &names, partitions, replication)
                .await
                .map_err(|e| ServiceError::Topics {
                    doing: "creating topics (SAGA_CREATE_TOPICS)",
                    source: crate::error::BrokerError::new(e),
                })?;
        }
        if !self.accept_key_expiry {
            let mut topics = self.consumer.topics();
            topics.push(self.consumer.dlq_topic());
            check_key_retention(&self.kafka, &topics, self.consumer.key_retention()).await?;
        }
        crate::migrate::migrate(&self.pool)
            .await
            .map_err(ServiceError::Migrations)?;
        for migrator in &self.migrators {
            migrator
                .run(&self.pool)
                .await
                .map_err(ServiceError::Migrations)?;
        }
        // Before anything is written: in WAL mode, the slot must exist before the first event.
        crate::setup::open(&self.pool, &self.outbox).await?;
        // Writers stop when the outbox may not be written (a lost slot): so does readiness.
        let health = self.outbox.runtime().health().clone();
        self.ops.register(|r| health.register(r));
        self.ops.probe("outbox", true, move || health.is_writable());
        let mut consumer = self.consumer;
        consumer.set_broker_checked();
        consumer.set_outbox(self.outbox.clone());
        // REDIS_URL turns the fast path on for the consumer (a service's HTTP layer is given its own).
        #[cfg(feature = "redis")]
        if let Some(settings) = self.fast_path
            && !consumer.has_fast_path()
        {
            let fast = crate::fast_path::FastPath::new(settings, &self.pool).await?;
            fast.connect().await;
            consumer.set_fast_path(fast);
        }

        let stop = CancellationToken::new();
        let mut parts: JoinSet<(String, Result<(), ServiceError>)> = JoinSet::new();
        let consumer_stop = stop.clone().cancelled_owned();
        parts.spawn(async move {
            (
                "the consumer".to_owned(),
                consumer.run(consumer_stop).await.map_err(Into::into),
            )
        });
        if let Some(relay) = self.relay {
            let relay_stop = stop.clone().cancelled_owned();
            parts.spawn(async move {
                (
                    "the relay".to_owned(),
                    relay
                        .broker_checked()
                        .run(relay_stop)
                        .await
                        .map_err(Into::into),
                )
            });
        }
        for (name, task) in self.tasks {
            let ctx = TaskContext {
                pool: self.pool.clone(),
                shutdown: stop.clone(),
            };
            parts.spawn(async move {
                let result = task(ctx).await.map_err(|error| ServiceError::Task {
                    name: name.clone(),
                    error,
                });
                (format!("task {name}"), result)
            });
        }

        supervise(parts, &stop, shutdown).await
    }
}

/// Waits for `parts` until `shutdown` resolves or one of them fails or ends on its own: then `stop` is
/// cancelled, the others finish what they are in, and the first failure is returned.
async fn supervise(
    mut parts: JoinSet<(String, Result<(), ServiceError>)>,
    stop: &CancellationToken,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServiceError> {
    tokio::pin!(shutdown);
    let mut first_error: Option<ServiceError> = None;
    let mut stopping = false;
    loop {
        tokio::select! {
            () = &mut shutdown, if !stopping => {
                tracing::info!("stopping the service");
                stopping = true;
                stop.cancel();
            }
            joined = parts.join_next() => {
                let Some(joined) = joined else { break };
                let (part, result) = match joined {
                    Ok(done) => done,
                    Err(e) => ("a part".to_owned(), Err(ServiceError::Stopped(format!("a part ({e})")))),
                };
                let failure = match result {
                    Err(e) => Some(e),
                    Ok(()) if !stopping => Some(ServiceError::Stopped(part.clone())),
                    Ok(()) => None,
                };
                if let Some(e) = failure {
                    tracing::error!(%part, error = %e, "a part of the service stopped; stopping the others");
                    first_error.get_or_insert(e);
                    stopping = true;
                    stop.cancel();
                }
            }
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// A future that resolves on the first SIGTERM or Ctrl-C: pass it to `run`.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    saga_runtime::shutdown::wait_for_signal()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings_said(vars: Vars<'_>) -> Vec<String> {
        SagaService::builder()
            .read_settings(Some(vars))
            .settings_problems()
            .into_iter()
            .map(|p| p.setting)
            .collect()
    }

    /// A bad variable of one group does not hide what another group lacks: the broker list and the group
    /// are said missing beside it.
    #[test]
    fn a_bad_variable_does_not_hide_a_missing_broker_list_or_group() {
        let said = settings_said(&|name| (name == "SAGA_OUTBOX_MODE").then(|| "disk".to_owned()));
        for setting in ["SAGA_OUTBOX_MODE", "KAFKA_BROKERS", "SAGA_GROUP_ID"] {
            assert!(
                said.iter().any(|s| s == setting),
                "{setting} not in {said:?}"
            );
        }
        // A bad variable of a checked group hides that group's checks only, and is said once.
        let said = settings_said(&|name| (name == "SAGA_BATCH_SIZE").then(|| "many".to_owned()));
        assert_eq!(
            said.iter().filter(|s| *s == "SAGA_BATCH_SIZE").count(),
            1,
            "{said:?}"
        );
        assert!(said.iter().any(|s| s == "KAFKA_BROKERS"), "{said:?}");
        assert!(!said.iter().any(|s| s == "SAGA_GROUP_ID"), "{said:?}");
    }

    /// The consumer checks messages against the key retention the embedded relay deletes by, also when
    /// it is given to the relay alone.
    #[test]
    fn the_relays_key_retention_is_the_consumers() {
        let days = outbox_relay::RetentionArgs::from_vars(|name| {
            (name == "SAGA_KEY_RETENTION_HOURS").then(|| "48".to_owned())
        })
        .expect("parses");
        let builder = SagaService::builder().relay(|r| r.retention(days));
        assert_eq!(
            builder.retention.key_retention().ok(),
            Some(std::time::Duration::from_secs(48 * 3600))
        );
    }
}
