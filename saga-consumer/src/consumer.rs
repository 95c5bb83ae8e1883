//! The public entry point: build a consumer from steps and settings, then run it until shutdown.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use saga_core::{SagaEvent, SagaStep, Topic, TwoPhaseStep};
use saga_runtime::kafka::KafkaConfig;
use saga_runtime::ops::Ops;

use crate::ops::OpsHandle;
use sqlx::PgPool;
use std::future::Future;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower_layer::Layer;

use crate::config::{AssignmentStrategy, ConsumerSettings};
use crate::db_retry::Stopper;
use crate::delivery::Router;
use crate::dlq::DeadLetters;
use crate::error::{ConfigError, ConsumerError};
use crate::executor::Executor;
use crate::fast::FastPath;
use crate::guard::CrashGuard;
use crate::handler::RegisteredStep;
use crate::hold::{HoldLimits, Holds, OrderPolicy};
use crate::hooks::Hooks;
use crate::metrics::ConsumerMetrics;
use crate::offsets::OffsetTracker;
use crate::partition::WorkerShared;
use crate::poll::{Dispatcher, PollContext, poll_loop};
use crate::retry::RetryPolicy;
use crate::service::{
    self, BoxStepService, CatchPanicLayer, HandlerService, InstrumentLayer, StepService,
    TimeoutLayer,
};

type LayerFn = Box<dyn Fn(BoxStepService) -> BoxStepService + Send + Sync>;

/// Builds a [`SagaConsumer`].
///
/// The consumer alone, for a service whose outbox another process publishes (`outbox-relay run`); most
/// services use [`crate::SagaService`], which runs this and the relay together.
///
/// # Examples
///
/// ```no_run
/// # use saga_consumer::{Message, SagaStep, StepContext, StepName, StepOutcome, StepResult, Subscription};
/// # struct RecordPayment;
/// # impl SagaStep for RecordPayment {
/// #     type Payload = serde_json::Value;
/// #     fn name(&self) -> StepName { StepName::from_static("record-payment") }
/// #     fn subscriptions(&self) -> Vec<Subscription> { vec![Subscription::new("payments", "PaymentProcessed")] }
/// #     async fn handle(&self, _: &Message<serde_json::Value>, _: &mut StepContext<'_>) -> StepResult { Ok(StepOutcome::completed()) }
/// # }
/// # async fn example(pool: saga_consumer::sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// saga_consumer::SagaConsumer::builder()
///     .from_env() // KAFKA_BROKERS, SAGA_GROUP_ID, SAGA_*
///     .group_id("payment-service")
///     .pool(pool)
///     .step(RecordPayment)
///     .build()?
///     .run(saga_consumer::shutdown_signal())
///     .await?;
/// # Ok(()) }
/// ```
pub struct SagaConsumerBuilder {
    settings: ConsumerSettings,
    env_error: Option<ConfigError>,
    pool: Option<PgPool>,
    steps: Vec<RegisteredStep>,
    ignored: Vec<(String, String)>,
    strict: Vec<String>,
    layers: Vec<LayerFn>,
    hooks: Hooks,
    ops: Option<Ops>,
    fast_path: Option<FastPath>,
    outbox: crate::Outbox,
    order_by_step: HashMap<String, OrderPolicy>,
    order_by_topic: HashMap<String, OrderPolicy>,
}

impl std::fmt::Debug for SagaConsumerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SagaConsumerBuilder")
            .field("settings", &self.settings)
            .field("steps", &step_names(&self.steps))
            .field("ignored", &self.ignored)
            .field("strict", &self.strict)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for SagaConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SagaConsumer")
            .field("settings", &self.settings)
            .field("steps", &step_names(&self.steps))
            .finish_non_exhaustive()
    }
}

/// The steps' names, for `Debug`.
fn step_names(steps: &[RegisteredStep]) -> Vec<&str> {
    steps.iter().map(|s| s.name.as_str()).collect()
}

impl SagaConsumerBuilder {
    fn new() -> Self {
        Self {
            settings: ConsumerSettings::default(),
            env_error: None,
            pool: None,
            steps: Vec::new(),
            ignored: Vec::new(),
            strict: Vec::new(),
            layers: Vec::new(),
            hooks: Hooks::default(),
            ops: None,
            fast_path: None,
            outbox: crate::Outbox::table(),
            order_by_step: HashMap::new(),
            order_by_topic: HashMap::new(),
        }
    }

    /// Reads settings from the environment (see [`ConsumerSettings::from_env`]); later builder calls
    /// override them. A variable that does not parse is reported by [`SagaConsumerBuilder::build`].
    pub fn from_env(mut self) -> Self {
        match ConsumerSettings::from_env() {
            Ok(settings) => self.settings = settings,
            Err(e) => {
                self.env_error.get_or_insert(ConfigError::Problem(e));
            }
        }
        self
    }

    /// Where its steps write their follow-up events: the service's outbox (a table outbox when not given;
    /// a consumer run by a [`crate::SagaService`] is given the service's). Open it first
    /// ([`crate::setup::use_outbox`]).
    pub fn outbox(mut self, outbox: crate::Outbox) -> Self {
        self.outbox = outbox;
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

    /// The whole Kafka configuration.
    pub fn kafka(mut self, kafka: KafkaConfig) -> Self {
        self.settings.kafka = Some(kafka);
        self
    }

    /// The consumer group.
    pub fn group_id(mut self, group: impl Into<String>) -> Self {
        self.settings.group_id = Some(group.into());
        self
    }

    /// The database (with the framework's migrations applied).
    pub fn pool(mut self, pool: PgPool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// Registers a transactional step.
    pub fn step<S: SagaStep>(mut self, step: S) -> Self {
        self.steps.push(RegisteredStep::transactional(step));
        self
    }

    /// Registers a two-phase step.
    pub fn two_phase_step<S: TwoPhaseStep>(mut self, step: S) -> Self {
        self.steps.push(RegisteredStep::two_phase(step));
        self
    }

    /// Declares that the events `topic` carries are none of this service's business: they are skipped (as
    /// is, by default, any event type no step reads on a topic its steps read; see
    /// [`SagaConsumerBuilder::strict`]).
    pub fn ignore<E: SagaEvent>(mut self, topic: &Topic<E>) -> Self {
        for event_type in E::TYPES {
            self.ignored
                .push((topic.name().to_owned(), (*event_type).to_owned()));
        }
        self
    }

    /// Like [`SagaConsumerBuilder::ignore`], for an event type known only at run time.
    pub fn ignore_type(mut self, topic: impl Into<String>, event_type: impl Into<String>) -> Self {
        self.ignored.push((topic.into(), event_type.into()));
        self
    }

    /// Declares every event type `topic` carries this service's business: one no step reads is
    /// dead-lettered (`unknown-event-type`), not skipped. By default a topic's event types that no step
    /// reads are skipped (counted as `ignored`): a service reading a shared topic through typed views reads
    /// the types it names, and the others are another service's. Declare strict a topic whose every
    /// message is meant for this service (commands sent to it, an orchestrator's replies: the
    /// orchestrator declares its reply topic), where an unknown type is a version this service does not
    /// have yet and must not be lost. A topic whose order policy is [`OrderPolicy::HoldKey`] is strict
    /// without saying so. An event type declared ignored stays skipped. Building refuses a strict topic no
    /// step reads (a typo would otherwise skip). A new event type on a topic that is not strict is skipped
    /// by the consumers that do not read it yet: a producer emits it once every service that must read it
    /// runs the version that does.
    pub fn strict(mut self, topic: impl Into<String>) -> Self {
        self.strict.push(topic.into());
        self
    }

    /// What a dead letter of step `step` does to its key's later messages (see [`OrderPolicy`]; the
    /// default is [`OrderPolicy::SkipAndContinue`]). A step's policy comes before its topic's.
    pub fn order_policy_for_step(mut self, step: impl Into<String>, policy: OrderPolicy) -> Self {
        self.order_by_step.insert(step.into(), policy);
        self
    }

    /// What a dead letter of a message consumed from `topic` does to its key's later messages (see
    /// [`OrderPolicy`]), for the steps that set none, and for messages no step takes (undecodable ones).
    pub fn order_policy_for_topic(mut self, topic: impl Into<String>, policy: OrderPolicy) -> Self {
        self.order_by_topic.insert(topic.into(), policy);
        self
    }

    /// Partitions processed at once.
    pub fn concurrency(mut self, partitions: usize) -> Self {
        self.settings.concurrency = partitions;
        self
    }

    /// Most messages of one partition per transaction.
    pub fn batch_size(mut self, messages: usize) -> Self {
        self.settings.batch_size = messages;
        self
    }

    /// Messages of different keys of one partition that run at once (default 1); a key's messages keep
    /// their order.
    pub fn key_concurrency(mut self, keys: usize) -> Self {
        self.settings.key_concurrency = keys;
        self
    }

    /// The retry policy for transient failures.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.settings.retry = policy;
        self
    }

    /// The dead-letter topic (default `{group}.dlq`).
    pub fn dlq_topic(mut self, topic: impl Into<String>) -> Self {
        self.settings.dlq_topic = Some(topic.into());
        self
    }

    /// The retry topic (default `{group}.retry`), where this group's replayed dead letters arrive.
    pub fn retry_topic(mut self, topic: impl Into<String>) -> Self {
        self.settings.retry_topic = Some(topic.into());
        self
    }

    /// How often finished offsets are committed.
    pub fn commit_interval(mut self, interval: Duration) -> Self {
        self.settings.commit_interval = interval;
        self
    }

    /// How long the broker may hold a fetch that found nothing (librdkafka's `fetch.wait.max.ms`; see
    /// [`ConsumerSettings::fetch_wait`]).
    pub fn fetch_wait(mut self, wait: Duration) -> Self {
        self.settings.fetch_wait = wait;
        self
    }

    /// Longest a handler may run.
    pub fn handler_timeout(mut self, limit: Duration) -> Self {
        self.settings.handler_timeout = limit;
        self
    }

    /// Longest a graceful stop waits for in-flight batches.
    pub fn shutdown_timeout(mut self, limit: Duration) -> Self {
        self.settings.shutdown_timeout = limit;
        self
    }

    /// The partition assignment strategy.
    pub fn assignment(mut self, strategy: AssignmentStrategy) -> Self {
        self.settings.assignment = strategy;
        self
    }

    /// `session.timeout.ms`.
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.settings.session_timeout = timeout;
        self
    }

    /// Deaths tolerated per message before it is dead-lettered as a crash loop (0: off).
    pub fn crash_loop_limit(mut self, deaths: u32) -> Self {
        self.settings.crash_loop_limit = deaths;
        self
    }

    /// Serves `/metrics`, `/healthz` and `/readyz` on `addr`.
    pub fn ops_addr(mut self, addr: std::net::SocketAddr) -> Self {
        self.settings.ops_addr = Some(addr);
        self
    }

    /// Shares the ops state of the process (metrics and readiness) with the relay a service embeds.
    #[doc(hidden)]
    pub fn with_ops(mut self, ops: Ops) -> Self {
        self.ops = Some(ops);
        self
    }

    /// Replaces every setting at once.
    pub fn settings(mut self, settings: ConsumerSettings) -> Self {
        self.settings = settings;
        self
    }

    /// Wraps every handler invocation in `layer`, outside the runtime's own layers (tracing span, panic
    /// catching, timeout).
    pub fn layer<L>(mut self, layer: L) -> Self
    where
        L: Layer<BoxStepService> + Send + Sync + 'static,
        L::Service: StepService,
    {
        self.layers
            .push(Box::new(move |inner| service::apply(&layer, inner)));
        self
    }

    /// Fault-injection and observation hooks.
    pub fn hooks(mut self, hooks: Hooks) -> Self {
        self.hooks = hooks;
        self
    }

    /// Puts the Redis fast path in front of the step-key claims (feature `redis`): a batch's keys are
    /// looked up in Redis first, and a message whose key Redis knows to be completed is acknowledged as a
    /// duplicate without a transaction. `None` leaves it off. See [`crate::fast_path`].
    #[cfg(feature = "redis")]
    pub fn fast_path(mut self, fast_path: Option<crate::fast_path::FastPath>) -> Self {
        self.fast_path = fast_path;
        self
    }

    /// Validates everything and builds the consumer.
    pub fn build(self) -> Result<SagaConsumer, ConfigError> {
        if let Some(e) = self.env_error {
            return Err(e);
        }
        self.settings.validate()?;
        let pool = self.pool.ok_or(ConfigError::Missing("database pool"))?;
        if self.steps.is_empty() {
            return Err(ConfigError::Missing("at least one step"));
        }
        let mut by_event: HashMap<(&str, &str), &str> = HashMap::new();
        let mut names = HashSet::new();
        for step in &self.steps {
            if !names.insert(step.name.as_str()) {
                return Err(ConfigError::DuplicateStepName(step.name.to_string()));
            }
            if step.subscriptions.is_empty() {
                return Err(ConfigError::Invalid {
                    setting: "steps",
                    reason: format!("step {} consumes nothing", step.name),
                });
            }
            for sub in &step.subscriptions {
                let id = (sub.topic(), sub.event_type());
                if let Some(first) = by_event.insert(id, step.name.as_str()) {
                    return Err(ConfigError::DuplicateSubscription {
                        topic: id.0.to_owned(),
                        event_type: id.1.to_owned(),
                        first: first.to_owned(),
                        second: step.name.to_string(),
                    });
                }
            }
        }
        let dlq = self.settings.dlq_topic();
        if self
            .steps
            .iter()
            .flat_map(|s| &s.subscriptions)
            .any(|sub| sub.topic() == dlq)
        {
            return Err(ConfigError::DeadLetterTopicConsumed(dlq));
        }
        let retry = self.settings.retry_topic();
        if self
            .steps
            .iter()
            .flat_map(|s| &s.subscriptions)
            .any(|sub| sub.topic() == retry)
        {
            return Err(ConfigError::RetryTopicSubscribed(retry));
        }
        // Innermost first: the handler, its timeout, panic catching, the span, then the user's layers.
        let mut service: BoxStepService = Arc::new(HandlerService);
        service = service::apply(&TimeoutLayer(self.settings.handler_timeout), service);
        service = service::apply(&CatchPanicLayer, service);
        service = service::apply(&InstrumentLayer, service);
        for layer in &self.layers {
            service = layer(service);
        }
        if let Some(step) = self
            .order_by_step
            .keys()
            .find(|s| !names.contains(s.as_str()))
        {
            return Err(ConfigError::Invalid {
                setting: "order policy",
                reason: format!("no step is named {step}"),
            });
        }
        if let Some(topic) = self.strict.iter().find(|t| {
            !self
                .steps
                .iter()
                .flat_map(|s| &s.subscriptions)
                .any(|sub| sub.topic() == t.as_str())
        }) {
            return Err(ConfigError::Invalid {
                setting: "strict topic",
                reason: format!("no step reads {topic}"),
            });
        }
        // A topic whose keys are held through failures is ordered by key: an event type no step reads
        // there is a version this service lacks, never skipped past (it would run the key's next step).
        let mut strict = self.strict;
        strict.extend(
            self.order_by_topic
                .iter()
                .filter(|(_, p)| **p == OrderPolicy::HoldKey)
                .map(|(t, _)| t.clone()),
        );
        let ops = self.ops.unwrap_or_default();
        // Not ready until partitions are assigned: registered now, before anything can serve `/readyz`.
        ops.check("consumer", true).set(false);
        Ok(SagaConsumer {
            settings: self.settings,
            pool,
            steps: self.steps,
            ignored: self.ignored,
            strict,
            service,
            hooks: self.hooks,
            ops,
            fast_path: self.fast_path,
            outbox: self.outbox,
            order_by_step: self.order_by_step,
            order_by_topic: self.order_by_topic,
            broker_checked: false,
        })
    }
}

/// A saga consumer: it consumes the steps' topics and runs each message's step exactly once in effect,
/// committing a message's offset only after the transaction that recorded its step key committed (or
/// after it was skipped as a duplicate, or dead-lettered).
pub struct SagaConsumer {
    settings: ConsumerSettings,
    pool: PgPool,
    steps: Vec<RegisteredStep>,
    ignored: Vec<(String, String)>,
    strict: Vec<String>,
    service: BoxStepService,
    hooks: Hooks,
    ops: Ops,
    fast_path: Option<FastPath>,
    outbox: crate::Outbox,
    order_by_step: HashMap<String, OrderPolicy>,
    order_by_topic: HashMap<String, OrderPolicy>,
    /// Whether the service that runs it checked the broker already.
    broker_checked: bool,
}

impl SagaConsumer {
    /// Starts building a consumer.
    pub fn builder() -> SagaConsumerBuilder {
        SagaConsumerBuilder::new()
    }

    /// The topics the consumer subscribes to: its steps', and its retry topic.
    pub fn topics(&self) -> Vec<String> {
        let mut topics: Vec<String> = self
            .steps
            .iter()
            .flat_map(|s| s.subscriptions.iter().map(|sub| sub.topic().to_owned()))
            .chain(self.ignored.iter().map(|(t, _)| t.clone()))
            .chain([self.settings.retry_topic()])
            .collect();
        topics.sort();
        topics.dedup();
        topics
    }

    /// The broker configuration.
    pub(crate) fn kafka(&self) -> &KafkaConfig {
        self.settings
            .kafka
            .as_ref()
            .expect("build() checked that the brokers are set")
    }

    /// The dead-letter topic.
    pub fn dlq_topic(&self) -> String {
        self.settings.dlq_topic()
    }

    /// The retry topic, where this group's replayed dead letters arrive.
    pub fn retry_topic(&self) -> String {
        self.settings.retry_topic()
    }

    /// Its settings.
    pub fn settings(&self) -> &ConsumerSettings {
        &self.settings
    }

    /// How long finished step keys are kept.
    pub(crate) fn key_retention(&self) -> std::time::Duration {
        self.settings.key_retention
    }

    /// Whether it has a fast path.
    #[cfg(feature = "redis")]
    pub(crate) fn has_fast_path(&self) -> bool {
        self.fast_path.is_some()
    }

    /// The service that runs it checked the broker already.
    pub(crate) fn set_broker_checked(&mut self) {
        self.broker_checked = true;
    }

    /// Where its steps write their events (before it runs).
    pub(crate) fn set_outbox(&mut self, outbox: crate::Outbox) {
        self.outbox = outbox;
    }

    /// Gives it a fast path (before it runs).
    #[cfg(feature = "redis")]
    pub(crate) fn set_fast_path(&mut self, fast_path: FastPath) {
        self.fast_path = Some(fast_path);
    }

    /// The consumer's metrics (Prometheus text) and readiness, also while it runs.
    pub fn ops(&self) -> OpsHandle {
        OpsHandle::new(self.ops.handle())
    }

    /// The process's ops state, shared with the relay a service embeds.
    #[doc(hidden)]
    pub fn shared_ops(&self) -> Ops {
        self.ops.clone()
    }

    /// Runs until `shutdown` resolves (any future: a signal, a token's `cancelled()`), then stops
    /// gracefully: stops fetching, lets in-flight batches finish within the shutdown timeout, commits, and
    /// leaves the group. Must run on a multi-threaded tokio runtime.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), ConsumerError> {
        saga_runtime::shutdown::run_until(shutdown, |token| self.run_until(token)).await
    }

    async fn run_until(self, shutdown: CancellationToken) -> Result<(), ConsumerError> {
        let topics = self.topics();
        let group = self
            .settings
            .group_id
            .clone()
            .ok_or(ConfigError::Missing("group id"))?;
        let (dlq_topic, retry_topic) = (self.settings.dlq_topic(), self.settings.retry_topic());
        record_group(&self.pool, &group, &dlq_topic, &retry_topic, &topics).await?;
        let metrics = ConsumerMetrics::default();
        self.ops.register(|registry| metrics.register(registry));
        #[cfg(feature = "redis")]
        if let Some(fast) = &self.fast_path {
            fast.register(&self.ops);
        }
        if let Some(addr) = self.settings.ops_addr {
            let bound = self.ops.serve(addr, shutdown.clone()).await?;
            tracing::info!(%bound, "ops endpoint listening");
        }
        let kafka = self
            .settings
            .kafka
            .clone()
            .ok_or(ConfigError::Missing("brokers (KAFKA_BROKERS)"))?;
        // A client the broker refuses (credentials, certificate, protocol) stops the start in one line
        // naming the setting; librdkafka would retry it for ever. A broker that does not answer yet is
        // waited for, as an outage is.
        if !self.broker_checked {
            tokio::select! {
                checked = saga_runtime::kafka::refusal(&kafka, "KAFKA_BROKERS") => {
                    checked.map_err(ConfigError::Problem)?;
                }
                () = shutdown.cancelled() => return Ok(()),
            }
        }
        let producer = saga_runtime::kafka::idempotent_producer(
            &kafka,
            Duration::from_millis(5),
            Duration::from_secs(30),
        )
        .map_err(ConsumerError::kafka)?;
        // A fault that is the operator's (the schema, the role) stops everything below, with the reason.
        let stopper = Stopper::under(&shutdown);
        let stop = stopper.token().clone();
        let holds = self.holds(&group);
        let releaser = tokio::spawn(crate::hold::run_releaser(
            holds.clone(),
            self.pool.clone(),
            producer.clone(),
            retry_topic.clone(),
            metrics.clone(),
            stop.clone(),
        ));
        let settings = self.settings.clone();
        let ops = self.ops.clone();
        let shared = Arc::new(WorkerShared {
            router: Router::new(
                &self.steps,
                &self.ignored,
                &self.strict,
                group.clone(),
                retry_topic,
            ),
            tracker: Arc::new(OffsetTracker::default()),
            permits: Arc::new(Semaphore::new(settings.concurrency)),
            batch_size: settings.batch_size,
            key_concurrency: settings.key_concurrency,
            window: crate::key_lanes::window(settings.batch_size, settings.key_concurrency),
            executor: self.executor(
                &group,
                holds,
                producer,
                dlq_topic.clone(),
                metrics.clone(),
                stopper.clone(),
            ),
        });
        let dispatcher = Arc::new(Dispatcher::new(
            shared,
            tokio::runtime::Handle::current(),
            // Room for a window at least; what is held beyond it grows with the batch, not the window.
            settings
                .batch_size
                .saturating_mul(4)
                .max(64)
                .max(crate::key_lanes::window(
                    settings.batch_size,
                    settings.key_concurrency,
                )),
            settings.revoke_timeout,
            metrics,
            ops,
        ));
        let consumer: BaseConsumer<PollContext> = client_config(&settings, &kafka, &group)
            .create_with_context(PollContext {
                dispatcher: dispatcher.clone(),
            })
            .map_err(ConsumerError::kafka)?;
        let done = spawn_poll_thread(
            consumer, dispatcher, &settings, topics, dlq_topic, group, stop,
        )?;
        let result = done.await.map_err(|_| ConsumerError::PollThreadPanicked);
        releaser.abort();
        let result = result?;
        match stopper.reason() {
            Some(reason) => Err(ConsumerError::Refused {
                reason: reason.to_owned(),
            }),
            None => result,
        }
    }

    /// The group's held keys and paused steps, under this consumer's order policies.
    fn holds(&self, group: &str) -> Holds {
        let settings = &self.settings;
        Holds {
            group: group.to_owned(),
            limits: HoldLimits {
                per_key: settings.hold_max_parked_per_key.into(),
                per_group: settings.hold_max_parked.into(),
                alert_after: settings.hold_alert_after,
            },
            by_step: self.order_by_step.clone(),
            by_topic: self.order_by_topic.clone(),
            kick: Arc::new(tokio::sync::Notify::new()),
            active: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            census_at: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        }
    }

    /// What every partition worker of the group processes messages with.
    fn executor(
        self,
        group: &str,
        holds: Holds,
        producer: rdkafka::producer::FutureProducer,
        dlq_topic: String,
        metrics: ConsumerMetrics,
        stopper: Stopper,
    ) -> Executor {
        let settings = self.settings;
        Executor {
            dead_letters: DeadLetters::new(producer, dlq_topic, group.to_owned()),
            guard: CrashGuard::new(
                self.pool.clone(),
                group.to_owned(),
                settings.crash_loop_limit,
                metrics.database_unreachable.clone(),
                settings.retry.clone(),
                stopper.clone(),
            ),
            retry: settings.retry,
            metrics,
            pool: self.pool,
            service: self.service,
            hooks: self.hooks,
            lease_holder: lease_holder(group),
            fast_path: self.fast_path,
            outbox: self.outbox.runtime().clone(),
            holds,
            stopper,
        }
    }
}

/// The consumer's librdkafka configuration for `group`.
fn client_config(
    settings: &ConsumerSettings,
    kafka: &KafkaConfig,
    group: &str,
) -> rdkafka::ClientConfig {
    let mut config = saga_runtime::kafka::client_config(kafka);
    config
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("enable.partition.eof", "false")
        .set(
            "partition.assignment.strategy",
            settings.assignment.as_str(),
        )
        .set(
            "session.timeout.ms",
            settings.session_timeout.as_millis().to_string(),
        )
        .set(
            "heartbeat.interval.ms",
            (settings.session_timeout.as_millis() / 4)
                .max(100)
                .to_string(),
        )
        .set(
            "fetch.wait.max.ms",
            settings.fetch_wait.as_millis().to_string(),
        )
        // Prefetch at most 16 MB in all, not librdkafka's 64 MB; and when that is reached, fetch again 50 ms
        // later rather than after librdkafka's default of 1 s, which starves fast workers.
        .set("queued.max.messages.kbytes", "16384")
        .set("fetch.queue.backoff.ms", "50")
        .set("statistics.interval.ms", "5000");
    for (name, value) in &kafka.properties {
        config.set(name, value);
    }
    config
}

/// Starts the poll loop on a thread of its own (it owns the rdkafka consumer): the receiver hears how it
/// ended.
fn spawn_poll_thread(
    consumer: BaseConsumer<PollContext>,
    dispatcher: Arc<Dispatcher>,
    settings: &ConsumerSettings,
    topics: Vec<String>,
    dlq_topic: String,
    group: String,
    shutdown: CancellationToken,
) -> Result<tokio::sync::oneshot::Receiver<Result<(), ConsumerError>>, ConsumerError> {
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let (commit_interval, shutdown_timeout) = (settings.commit_interval, settings.shutdown_timeout);
    std::thread::Builder::new()
        .name(format!("saga-poll-{group}"))
        .spawn(move || {
            let result = (|| {
                check_topics(&consumer, &topics, &dlq_topic)?;
                let names: Vec<&str> = topics.iter().map(String::as_str).collect();
                consumer.subscribe(&names).map_err(ConsumerError::kafka)?;
                tracing::info!(?topics, group = %group, dlq = %dlq_topic, "consumer started");
                poll_loop(
                    consumer,
                    &dispatcher,
                    &shutdown,
                    commit_interval,
                    shutdown_timeout,
                )
            })();
            let _ = done_tx.send(result);
        })
        .map_err(ConsumerError::PollThreadStart)?;
    Ok(done_rx)
}

/// Records in the schema that `group` runs here, with its dead-letter and retry topics: `saga dlq replay`
/// reads it to find the group a dead-letter topic belongs to, and replays into that group's retry topic.
async fn record_group(
    pool: &PgPool,
    group: &str,
    dlq_topic: &str,
    retry_topic: &str,
    topics: &[String],
) -> Result<(), ConsumerError> {
    sqlx::query(
        "INSERT INTO saga_consumer_groups (group_id, dlq_topic, retry_topic, topics) \
         VALUES ($1, $2, $3, $4) \
         ON CONFLICT (group_id) DO UPDATE SET dlq_topic = excluded.dlq_topic, \
             retry_topic = excluded.retry_topic, topics = excluded.topics, started_at = now()",
    )
    .bind(group)
    .bind(dlq_topic)
    .bind(retry_topic)
    .bind(topics)
    .execute(pool)
    .await
    .map_err(ConsumerError::RecordGroup)?;
    Ok(())
}

/// This process, as recorded with the two-phase leases it takes: `{group}@{host}/{pid}`.
fn lease_holder(group: &str) -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".to_owned());
    format!("{group}@{host}/{}", std::process::id())
}

/// Fails with the list of topics that do not exist: the framework creates topics explicitly, never by
/// relying on auto-creation.
fn check_topics(
    consumer: &BaseConsumer<PollContext>,
    topics: &[String],
    dlq: &str,
) -> Result<(), ConsumerError> {
    let metadata = consumer
        .fetch_metadata(None, Duration::from_secs(30))
        .map_err(ConsumerError::kafka)?;
    let existing: HashSet<&str> = metadata
        .topics()
        .iter()
        .filter(|t| t.error().is_none())
        .map(|t| t.name())
        .collect();
    let missing: Vec<String> = topics
        .iter()
        .map(String::as_str)
        .chain([dlq])
        .filter(|t| !existing.contains(t))
        .map(str::to_owned)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(ConsumerError::MissingTopics(missing))
    }
}
