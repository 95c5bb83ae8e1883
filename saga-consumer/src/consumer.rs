//! The public entry point: build a consumer from steps and settings, then run it until shutdown.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use saga_config::ConfigProblem;
use saga_runtime::kafka::KafkaConfig;
use saga_runtime::ops::Ops;
use sqlx::PgPool;
use std::future::Future;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::builder::{SagaBuilder, SagaConsumerBuilder};
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
use crate::ops::OpsHandle;
use crate::partition::WorkerShared;
use crate::poll::{Dispatcher, PollContext, poll_loop};
use crate::service::BoxStepService;
use crate::settings::ConsumerArgs;

impl SagaConsumerBuilder {
    /// Checks everything and builds the consumer: every problem of the settings is reported at once, each
    /// naming its variable.
    pub fn build(self) -> Result<SagaConsumer, ConfigError> {
        self.into_consumer().map(|(consumer, _)| consumer)
    }
}

impl<P> SagaBuilder<P> {
    /// Checks everything and builds the consumer, handing back what the service adds.
    pub(crate) fn into_consumer(self) -> Result<(SagaConsumer, P), ConfigError> {
        if let Some(problem) = ConfigProblem::all(self.settings_problems()) {
            return Err(ConfigError::Problem(problem));
        }
        let key_retention = self.retention.key_retention()?;
        let kafka = self
            .kafka
            .clone()
            .ok_or(ConfigError::Missing("brokers (KAFKA_BROKERS)"))?;
        let service = self.service();
        let pool = self.pool.ok_or(ConfigError::Missing("database pool"))?;
        check_steps(&self.steps, &self.args, &self.order_by_step, &self.strict)?;
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
        let consumer = SagaConsumer {
            args: self.args,
            kafka,
            key_retention,
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
        };
        Ok((consumer, self.parts))
    }
}

/// Refuses steps that cannot run together: a name twice, a step that consumes nothing, an event type two
/// steps consume, a step reading the dead-letter or retry topic, a policy or strict topic naming no step's.
fn check_steps(
    steps: &[RegisteredStep],
    args: &ConsumerArgs,
    order_by_step: &HashMap<String, OrderPolicy>,
    strict: &[String],
) -> Result<(), ConfigError> {
    if steps.is_empty() {
        return Err(ConfigError::Missing("at least one step"));
    }
    let mut by_event: HashMap<(&str, &str), &str> = HashMap::new();
    let mut names = HashSet::new();
    for step in steps {
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
    let read = |topic: &str| {
        steps
            .iter()
            .flat_map(|s| &s.subscriptions)
            .any(|sub| sub.topic() == topic)
    };
    let dlq = args.dlq_topic();
    if read(&dlq) {
        return Err(ConfigError::DeadLetterTopicConsumed(dlq));
    }
    let retry = args.retry_topic();
    if read(&retry) {
        return Err(ConfigError::RetryTopicSubscribed(retry));
    }
    if let Some(step) = order_by_step.keys().find(|s| !names.contains(s.as_str())) {
        return Err(ConfigError::Invalid {
            setting: "order policy",
            reason: format!("no step is named {step}"),
        });
    }
    if let Some(topic) = strict.iter().find(|t| !read(t)) {
        return Err(ConfigError::Invalid {
            setting: "strict topic",
            reason: format!("no step reads {topic}"),
        });
    }
    Ok(())
}

/// A saga consumer: it consumes the steps' topics and runs each message's step exactly once in effect,
/// committing a message's offset only after the transaction that recorded its step key committed (or
/// after it was skipped as a duplicate, or dead-lettered).
pub struct SagaConsumer {
    args: ConsumerArgs,
    kafka: KafkaConfig,
    key_retention: Duration,
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

impl std::fmt::Debug for SagaConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SagaConsumer")
            .field("args", &self.args)
            .field("steps", &crate::handler::step_names(&self.steps))
            .finish_non_exhaustive()
    }
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
            .chain([self.args.retry_topic()])
            .collect();
        topics.sort();
        topics.dedup();
        topics
    }

    /// The broker configuration.
    pub(crate) fn kafka(&self) -> &KafkaConfig {
        &self.kafka
    }

    /// The dead-letter topic.
    pub fn dlq_topic(&self) -> String {
        self.args.dlq_topic()
    }

    /// The retry topic, where this group's replayed dead letters arrive.
    pub fn retry_topic(&self) -> String {
        self.args.retry_topic()
    }

    /// Its settings.
    pub fn args(&self) -> &ConsumerArgs {
        &self.args
    }

    /// How long finished step keys are kept.
    pub(crate) fn key_retention(&self) -> std::time::Duration {
        self.key_retention
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

    /// Runs until `shutdown` resolves (any future: a signal, a token's `cancelled()`), then stops
    /// gracefully: stops fetching, lets in-flight batches finish within the shutdown timeout, commits, and
    /// leaves the group. Must run on a multi-threaded tokio runtime.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), ConsumerError> {
        saga_runtime::shutdown::run_until(shutdown, |token| self.run_until(token)).await
    }

    async fn run_until(self, shutdown: CancellationToken) -> Result<(), ConsumerError> {
        let topics = self.topics();
        let group = self
            .args
            .group_id
            .clone()
            .ok_or(ConfigError::Missing("group id (SAGA_GROUP_ID)"))?;
        let (dlq_topic, retry_topic) = (self.args.dlq_topic(), self.args.retry_topic());
        record_group(&self.pool, &group, &dlq_topic, &retry_topic, &topics).await?;
        let metrics = ConsumerMetrics::default();
        self.ops.register(|registry| metrics.register(registry));
        #[cfg(feature = "redis")]
        if let Some(fast) = &self.fast_path {
            fast.register(&self.ops);
        }
        if let Some(addr) = self.args.ops_addr {
            let bound = self.ops.serve(addr, shutdown.clone()).await?;
            tracing::info!(%bound, "ops endpoint listening");
        }
        let kafka = self.kafka.clone();
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
        let settings = self.args.clone();
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
        let settings = &self.args;
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
        let settings = self.args;
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
    settings: &ConsumerArgs,
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
    settings: &ConsumerArgs,
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
