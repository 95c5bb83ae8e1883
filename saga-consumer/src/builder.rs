//! The one builder of a consumer and of a service ([`SagaBuilder`]): what both take (the broker, the group,
//! the steps, their order policies, the consumer's settings, layers and hooks) is said once, here; a
//! service's builder adds what a service adds ([`ServiceParts`](crate::runner::ServiceParts): the embedded
//! relay, the outbox's mode, topics, migrations, tasks).
//!
//! A setting given in code is checked by the rule its declaration parses the variable with
//! ([`ConsumerArgs::problems`]); every problem found, by any call, is reported by `build`, each naming
//! its variable.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use saga_core::{SagaEvent, SagaStep, Topic, TwoPhaseStep};

use saga_config::ConfigProblem;
use saga_runtime::kafka::KafkaConfig;
use saga_runtime::ops::Ops;
use sqlx::PgPool;
use tower_layer::Layer;

use crate::config::AssignmentStrategy;
use crate::fast::FastPath;
use crate::handler::RegisteredStep;
use crate::hold::OrderPolicy;
use crate::hooks::Hooks;
use crate::retry::RetryPolicy;
use crate::service::{self, BoxStepService, StepService};
use crate::settings::{ConsumerArgs, KafkaArgs, RetentionArgs};

pub(crate) type LayerFn = Box<dyn Fn(BoxStepService) -> BoxStepService + Send + Sync>;

/// Builds a [`SagaConsumer`](crate::SagaConsumer) ([`SagaConsumerBuilder`]) or a
/// [`SagaService`](crate::SagaService) ([`SagaServiceBuilder`](crate::SagaServiceBuilder)): one type, whose
/// methods below both have; `P` holds what the service adds.
#[must_use]
pub struct SagaBuilder<P> {
    pub(crate) args: ConsumerArgs,
    pub(crate) kafka: Option<KafkaConfig>,
    pub(crate) retention: RetentionArgs,
    /// What the calls so far found wrong (a variable that does not parse, say): `build` reports them all.
    pub(crate) problems: Vec<ConfigProblem>,
    /// The settings groups that did not parse (`kafka`, `consumer`, `retention`): their own checks are not
    /// made (what they would have given is not there), the other groups' are.
    pub(crate) unparsed: Vec<&'static str>,
    pub(crate) pool: Option<PgPool>,
    pub(crate) steps: Vec<RegisteredStep>,
    pub(crate) ignored: Vec<(String, String)>,
    pub(crate) strict: Vec<String>,
    pub(crate) layers: Vec<LayerFn>,
    pub(crate) hooks: Hooks,
    pub(crate) ops: Option<Ops>,
    pub(crate) fast_path: Option<FastPath>,
    pub(crate) outbox: crate::Outbox,
    pub(crate) order_by_step: HashMap<String, OrderPolicy>,
    pub(crate) order_by_topic: HashMap<String, OrderPolicy>,
    pub(crate) parts: P,
}

/// What a consumer's builder adds to the common part: nothing.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct ConsumerParts {}

/// Builds a [`SagaConsumer`](crate::SagaConsumer): the consumer alone, for a service whose outbox another
/// process publishes (`outbox-relay run`); most services use [`crate::SagaService`], which runs this and
/// the relay together.
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
pub type SagaConsumerBuilder = SagaBuilder<ConsumerParts>;

impl<P: std::fmt::Debug> std::fmt::Debug for SagaBuilder<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SagaBuilder")
            .field("args", &self.args)
            .field("kafka", &self.kafka)
            .field("steps", &crate::handler::step_names(&self.steps))
            .field("ignored", &self.ignored)
            .field("strict", &self.strict)
            .field("problems", &self.problems)
            .field("parts", &self.parts)
            .finish_non_exhaustive()
    }
}

impl<P> SagaBuilder<P> {
    /// The declarations' defaults, with `parts`.
    pub(crate) fn with_parts(parts: P) -> Self {
        Self {
            args: ConsumerArgs::default(),
            kafka: None,
            retention: RetentionArgs::default(),
            problems: Vec::new(),
            unparsed: Vec::new(),
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
            parts,
        }
    }

    /// Records what a call found wrong, for `build` to report with the rest.
    pub(crate) fn problem(&mut self, problem: ConfigProblem) {
        self.problems.push(problem);
    }

    /// Records that settings `groups` did not parse, and why.
    pub(crate) fn unparsed(&mut self, groups: &[&'static str], problem: ConfigProblem) {
        self.unparsed.extend(groups);
        self.problem(problem);
    }

    /// Takes the broker from its settings: its security settings that cannot work together are a problem
    /// now (never dropped: the client would reach the broker without them). Without a broker list, a
    /// configuration given earlier in code stays as it was; else the settings are kept around an empty
    /// list, for a later call to give one ([`SagaBuilder::brokers`]) with the security settings and
    /// `KAFKA_PROPERTY_*` read here, or for `build` to report it missing.
    pub(crate) fn take_kafka(&mut self, kafka: &KafkaArgs) {
        let listed = kafka
            .brokers
            .as_deref()
            .is_some_and(|b| !b.trim().is_empty());
        match kafka.config_or_unlisted() {
            Ok(_) if !listed && self.kafka.is_some() => {}
            Ok(config) => self.kafka = Some(config),
            Err(problem) => self.unparsed(&["kafka"], problem),
        }
    }

    /// Every consumer setting at once (a binary's command line that flattens
    /// [`ConsumerArgs`], or [`ConsumerArgs::from_env`]); later calls override them.
    pub fn consumer_args(mut self, args: ConsumerArgs) -> Self {
        self.args = args;
        self
    }

    /// The broker list (`bootstrap.servers`), keeping any librdkafka properties already set.
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.kafka
            .get_or_insert_with(|| KafkaConfig::new(""))
            .brokers = brokers.into();
        self
    }

    /// The whole Kafka configuration.
    pub fn kafka(mut self, kafka: KafkaConfig) -> Self {
        self.kafka = Some(kafka);
        self
    }

    /// The consumer group (`SAGA_GROUP_ID`).
    pub fn group_id(mut self, group: impl Into<String>) -> Self {
        self.args.group_id = Some(group.into());
        self
    }

    /// The database (with the framework's migrations applied): its tables live in the first schema of its
    /// `search_path`.
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
    /// [`SagaBuilder::strict`]).
    pub fn ignore<E: SagaEvent>(mut self, topic: &Topic<E>) -> Self {
        for event_type in E::TYPES {
            self.ignored
                .push((topic.name().to_owned(), (*event_type).to_owned()));
        }
        self
    }

    /// Like [`SagaBuilder::ignore`], for an event type known only at run time.
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

    /// Partitions processed at once (`SAGA_CONCURRENCY`).
    pub fn concurrency(mut self, partitions: usize) -> Self {
        self.args.concurrency = partitions;
        self
    }

    /// Most messages of one partition per transaction (`SAGA_BATCH_SIZE`).
    pub fn batch_size(mut self, messages: usize) -> Self {
        self.args.batch_size = messages;
        self
    }

    /// Messages of different keys of one partition that run at once (`SAGA_KEY_CONCURRENCY`); a key's
    /// messages keep their order.
    pub fn key_concurrency(mut self, keys: usize) -> Self {
        self.args.key_concurrency = keys;
        self
    }

    /// The retry policy for transient failures (`SAGA_MAX_ATTEMPTS`, `SAGA_RETRY_*`).
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.args.retry = policy;
        self
    }

    /// The dead-letter topic (`SAGA_DLQ_TOPIC`, default `{group}.dlq`).
    pub fn dlq_topic(mut self, topic: impl Into<String>) -> Self {
        self.args.dlq_topic = Some(topic.into());
        self
    }

    /// The retry topic (`SAGA_RETRY_TOPIC`, default `{group}.retry`), where this group's replayed dead
    /// letters arrive.
    pub fn retry_topic(mut self, topic: impl Into<String>) -> Self {
        self.args.retry_topic = Some(topic.into());
        self
    }

    /// How often finished offsets are committed (`SAGA_COMMIT_INTERVAL_MS`).
    pub fn commit_interval(mut self, interval: Duration) -> Self {
        self.args.commit_interval = interval;
        self
    }

    /// How long the broker may hold a fetch that found nothing (`SAGA_FETCH_WAIT_MS`; see
    /// [`ConsumerArgs::fetch_wait`]).
    pub fn fetch_wait(mut self, wait: Duration) -> Self {
        self.args.fetch_wait = wait;
        self
    }

    /// Longest a handler may run (`SAGA_HANDLER_TIMEOUT_MS`).
    pub fn handler_timeout(mut self, limit: Duration) -> Self {
        self.args.handler_timeout = limit;
        self
    }

    /// Longest a graceful stop waits for in-flight batches (`SAGA_SHUTDOWN_TIMEOUT_MS`).
    pub fn shutdown_timeout(mut self, limit: Duration) -> Self {
        self.args.shutdown_timeout = limit;
        self
    }

    /// The partition assignment strategy (`SAGA_ASSIGNMENT_STRATEGY`).
    pub fn assignment(mut self, strategy: AssignmentStrategy) -> Self {
        self.args.assignment = strategy;
        self
    }

    /// `session.timeout.ms` (`SAGA_SESSION_TIMEOUT_MS`).
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.args.session_timeout = timeout;
        self
    }

    /// Deaths tolerated per message before it is dead-lettered as a crash loop (`SAGA_CRASH_LOOP_LIMIT`;
    /// 0: off).
    pub fn crash_loop_limit(mut self, deaths: u32) -> Self {
        self.args.crash_loop_limit = deaths;
        self
    }

    /// Serves `/metrics`, `/healthz` and `/readyz` on `addr` (`SAGA_OPS_ADDR`; a service's relay's too).
    pub fn ops_addr(mut self, addr: std::net::SocketAddr) -> Self {
        self.args.ops_addr = Some(addr);
        self
    }

    /// Shares the ops state of the process (metrics and readiness) with the relay a service embeds.
    pub(crate) fn with_ops(mut self, ops: Ops) -> Self {
        self.ops = Some(ops);
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
    /// duplicate without a transaction. `None` leaves it off (a service then makes its own from
    /// `REDIS_URL`). See [`crate::fast_path`].
    #[cfg(feature = "redis")]
    pub fn fast_path(mut self, fast_path: Option<crate::fast_path::FastPath>) -> Self {
        self.fast_path = fast_path;
        self
    }

    /// Every problem of the settings given so far, each naming its variable: those the calls recorded (a
    /// group that did not parse, security settings that cannot work together), and the checks of every
    /// group that parsed (the others' would say "not set" of what they would have given).
    pub(crate) fn settings_problems(&self) -> Vec<ConfigProblem> {
        let mut problems = self.problems.clone();
        let parsed = |group: &str| !self.unparsed.contains(&group);
        if parsed("kafka")
            && self
                .kafka
                .as_ref()
                .is_none_or(|k| k.brokers.trim().is_empty())
        {
            problems.push(ConfigProblem::new(
                "KAFKA_BROKERS",
                "is not set",
                "set it to the broker list (host:port, comma-separated)",
            ));
        }
        if parsed("consumer") {
            problems.extend(self.args.problems());
        }
        if parsed("retention")
            && let Err(problem) = self.retention.key_retention()
        {
            problems.push(problem);
        }
        problems
    }

    /// The handler wrapped in the runtime's layers, then the user's (innermost first: the handler, its
    /// timeout, panic catching, the span, then the user's layers).
    pub(crate) fn service(&self) -> BoxStepService {
        let mut service: BoxStepService = Arc::new(service::HandlerService);
        service = service::apply(&service::TimeoutLayer(self.args.handler_timeout), service);
        service = service::apply(&service::CatchPanicLayer, service);
        service = service::apply(&service::InstrumentLayer, service);
        for layer in &self.layers {
            service = layer(service);
        }
        service
    }
}

impl SagaConsumerBuilder {
    pub(crate) fn new() -> Self {
        Self::with_parts(ConsumerParts {})
    }

    /// Reads settings from the environment, through their one declaration ([`KafkaArgs`] and
    /// [`ConsumerArgs`]); later calls override them. A
    /// variable that does not parse is reported by `build`, with every other problem.
    pub fn from_env(mut self) -> Self {
        match KafkaArgs::from_env() {
            Ok(kafka) => self.take_kafka(&kafka),
            Err(problem) => self.unparsed(&["kafka"], problem),
        }
        match ConsumerArgs::from_env() {
            Ok(args) => self.args = args,
            Err(problem) => self.unparsed(&["consumer"], problem),
        }
        self
    }

    /// Where its steps write their follow-up events: the service's outbox (a table outbox when not given;
    /// a consumer run by a [`crate::SagaService`] is given the service's). Open it first
    /// ([`crate::setup::use_outbox`]).
    pub fn with_outbox(mut self, outbox: crate::Outbox) -> Self {
        self.outbox = outbox;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The security settings of the environment stay when the broker list is given in code afterwards.
    #[test]
    fn brokers_given_in_code_keep_the_environments_security_settings() {
        let kafka = KafkaArgs::from_vars(|name| {
            (name == "KAFKA_SECURITY_PROTOCOL").then(|| "ssl".to_owned())
        })
        .unwrap();
        let mut builder = SagaConsumerBuilder::new();
        builder.take_kafka(&kafka);
        let builder = builder.brokers("127.0.0.1:9093");
        let config = builder.kafka.as_ref().unwrap();
        assert_eq!(config.brokers, "127.0.0.1:9093");
        assert!(
            config
                .properties
                .iter()
                .any(|(name, value)| name == "security.protocol" && value == "ssl"),
            "{config:?}"
        );
        assert!(builder.problems.is_empty(), "{:?}", builder.problems);
        assert!(
            builder
                .settings_problems()
                .iter()
                .all(|p| p.setting != "KAFKA_BROKERS")
        );
        // A configuration given in code before stays when the environment names no broker.
        let mut given = SagaConsumerBuilder::new().kafka(KafkaConfig::new("given:9092"));
        given.take_kafka(&kafka);
        assert_eq!(given.kafka.as_ref().unwrap().brokers, "given:9092");
        // Without a broker list from anywhere, `build` says so.
        let mut unset = SagaConsumerBuilder::new();
        unset.take_kafka(&kafka);
        assert!(
            unset
                .settings_problems()
                .iter()
                .any(|p| p.setting == "KAFKA_BROKERS")
        );
    }

    /// A group that did not parse hides its own checks, not the other groups'.
    #[test]
    fn a_group_that_did_not_parse_hides_only_its_own_checks() {
        let mut builder = SagaConsumerBuilder::new();
        builder.unparsed(
            &["kafka"],
            ConfigProblem::new("KAFKA_SASL_MECHANISM", "\"x\" does not parse", "fix it"),
        );
        let builder = builder.batch_size(0);
        let said: Vec<String> = builder
            .settings_problems()
            .into_iter()
            .map(|p| p.setting)
            .collect();
        assert!(
            said.contains(&"KAFKA_SASL_MECHANISM".to_owned()),
            "{said:?}"
        );
        assert!(said.contains(&"SAGA_GROUP_ID".to_owned()), "{said:?}");
        assert!(said.contains(&"SAGA_BATCH_SIZE".to_owned()), "{said:?}");
        assert!(!said.contains(&"KAFKA_BROKERS".to_owned()), "{said:?}");
    }
}
