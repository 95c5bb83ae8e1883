//! The consumer's errors.

use rdkafka::error::KafkaError;

/// A configuration the consumer refuses to start with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A required setting is missing.
    #[error("missing setting: {0}")]
    Missing(&'static str),
    /// A setting has a value that cannot work.
    #[error("invalid setting {setting}: {reason}")]
    Invalid {
        /// The setting.
        setting: &'static str,
        /// Why.
        reason: String,
    },
    /// Two steps consume the same event type on the same topic.
    #[error("steps {first} and {second} both consume {event_type:?} on topic {topic:?}")]
    DuplicateSubscription {
        /// The topic.
        topic: String,
        /// The event type.
        event_type: String,
        /// One step.
        first: String,
        /// The other.
        second: String,
    },
    /// Two steps share a name, so their step keys would collide.
    #[error(
        "two steps are named {0:?}; step names must be unique, they are part of every step key"
    )]
    DuplicateStepName(String),
    /// A setting is missing or does not parse; names it and what to do.
    // Not transparent: the cause stays in the error's chain, where `exit_code` finds a
    // configuration problem (exit code 2).
    #[error("{0}")]
    Problem(#[from] saga_runtime::config::ConfigProblem),
    /// The dead-letter topic is one the consumer reads.
    #[error("the dead-letter topic {0:?} is also consumed; dead letters would come back")]
    DeadLetterTopicConsumed(String),
    /// A step subscribes to the retry topic, which the consumer reads for every step.
    #[error(
        "a step subscribes to the retry topic {0:?}; replays arrive there for every step, routed by their original topic"
    )]
    RetryTopicSubscribed(String),
}

/// Why the consumer stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The configuration is invalid.
    // Not transparent: the cause stays in the error's chain, where `exit_code` finds a
    // configuration problem (exit code 2).
    #[error("{0}")]
    Config(#[from] ConfigError),
    /// The Kafka client failed to start, to subscribe or to create topics.
    #[error("kafka: {0}")]
    Kafka(#[source] BrokerError),
    /// Topics the consumer needs do not exist (create them first, or let the service create them with
    /// `SAGA_CREATE_TOPICS`: the framework never relies on a broker's auto-creation).
    #[error(
        "topics do not exist: {0:?}; create them, or set SAGA_CREATE_TOPICS to a partition count"
    )]
    MissingTopics(Vec<String>),
    /// A partition worker died (a bug); the consumer stopped without committing its unfinished messages.
    #[error("the worker of {topic}/{partition} stopped unexpectedly")]
    WorkerDied {
        /// The topic.
        topic: String,
        /// The partition.
        partition: i32,
    },
    /// The ops endpoint could not listen.
    #[error("ops endpoint: {0}")]
    Ops(#[from] std::io::Error),
    /// The poll thread could not be started.
    #[error("starting the poll thread: {0}")]
    PollThreadStart(#[source] std::io::Error),
    /// The poll thread panicked (a framework bug); nothing past the unfinished messages was committed.
    #[error("the poll thread panicked")]
    PollThreadPanicked,
    /// The consumer could not record its group in the schema at start.
    #[error(
        "recording the consumer group in saga_consumer_groups (are the consumer's migrations applied?): {0}"
    )]
    RecordGroup(#[source] sqlx::Error),
    /// The outbox could not be opened (see [`crate::setup::use_outbox`]).
    #[error("opening the outbox: {0}")]
    Outbox(#[source] Cause),
    /// The database refused the framework's own statements while the consumer ran (the schema, the
    /// role's privileges): it stopped, with the reason.
    #[error(
        "the database refuses the framework's statements ({reason}); run the migrations of this version \
         and check the role's privileges"
    )]
    Refused {
        /// The statement refused and the database's answer, on one line.
        reason: String,
    },
}

impl ConsumerError {
    /// A Kafka client's failure.
    pub(crate) fn kafka(e: KafkaError) -> Self {
        Self::Kafka(BrokerError::new(e))
    }
}

/// An error of the Kafka client, kept as the cause (the client's own type is not part of this API).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct BrokerError(Box<dyn std::error::Error + Send + Sync>);

impl BrokerError {
    pub(crate) fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Box::new(e))
    }
}

pub use saga_config::Cause;
