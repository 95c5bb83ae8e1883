//! What can go wrong in the kit itself (not in the system under test: that is [`crate::Busy`] or a failed
//! assertion).

/// An error of the test's own code (its service setup).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A failure of the kit: the database or the mock cluster refused something, a service could not be built
/// or stopped with an error, or a published message did not decode as the type asked for.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KitError {
    /// PostgreSQL refused a statement of the kit's (creating a schema, reading the outbox).
    #[error("PostgreSQL: {0}")]
    Postgres(#[from] sqlx::Error),
    /// A setting is wrong (`DATABASE_URL` does not parse, the server does not answer).
    #[error("{0}")]
    Config(#[from] saga_consumer::ConfigProblem),
    /// The mock cluster or a client of it failed (the client's error kept as the cause), or did not do
    /// what the kit asked in time.
    #[error("the mock Kafka cluster: {0}")]
    Kafka(#[source] saga_consumer::Cause),
    /// The test's own service setup failed, or the service could not be built or stopped with an error.
    #[error("the {service} service: {error}")]
    Service {
        /// The service's name in the test.
        service: String,
        /// What went wrong.
        error: BoxError,
    },
    /// No service of that name was started in this test.
    #[error("no service named {0:?} runs in this test")]
    NoService(String),
    /// A second service of the same name.
    #[error("a service named {0:?} runs in this test already")]
    DuplicateService(String),
    /// A service name the kit cannot make a schema of.
    #[error(
        "the service name {0:?} is not 1 to 20 lower-case letters, digits, '-' or '_' (it names the \
         service's schema and consumer group)"
    )]
    BadServiceName(String),
    /// The test asked the kit for something it does not do.
    #[error("{0}")]
    Unsupported(String),
    /// An HTTP request to a service's routes could not be made or read.
    #[error("HTTP: {request}: {source}")]
    Http {
        /// The request (its method and path).
        request: String,
        /// Why.
        #[source]
        source: saga_consumer::Cause,
    },
    /// The kit could not start the runtime it drops the test's schemas on.
    #[error("starting a runtime to drop the test's schemas: {0}")]
    Runtime(#[source] std::io::Error),
    /// A message of the asked-for event type does not decode as the type.
    #[error("the message at {topic}/{partition}@{offset} does not decode as {wanted}: {error}")]
    Undecodable {
        /// Its topic.
        topic: String,
        /// Its partition.
        partition: i32,
        /// Its offset.
        offset: i64,
        /// The Rust type asked for.
        wanted: &'static str,
        /// Why.
        #[source]
        error: saga_consumer::Cause,
    },
    /// An event could not be encoded, or its key is not a valid idempotency key.
    #[error("the event to send: {0}")]
    Event(#[source] saga_consumer::Cause),
    /// Reading a topic back did not reach its end in time.
    #[error("reading {topic} back: {detail}")]
    Read {
        /// The topic.
        topic: String,
        /// What was missing.
        detail: String,
    },
    /// The system was not quiet in time: what was still busy.
    #[error("{0}")]
    Busy(#[from] crate::Busy),
    /// A service dead-lettered messages the test did not expect
    /// ([`crate::SagaTest::expect_dead_letters`] says how many it does).
    #[error("{}", unexpected(.service, .expected, .letters))]
    DeadLettered {
        /// The service.
        service: String,
        /// How many messages the test said it would dead-letter.
        expected: usize,
        /// Its letters, one per message (a redelivery's letter, or a kit copy's, left out).
        letters: Vec<crate::DeadLetter>,
    },
    /// A saga's stored data or status does not read as the test asked.
    #[error("the saga {saga_id} of key {key:?}: {error}")]
    SagaUnreadable {
        /// The instance.
        saga_id: uuid::Uuid,
        /// The client's key it was started with.
        key: String,
        /// Why.
        error: String,
    },
    /// The orchestrator's tables could not be read.
    #[error("the saga instances: {0}")]
    Orchestrator(#[from] saga_orchestrator::OrchestratorError),
}

/// A Kafka client's error, as the kit reports it (no rdkafka type in the kit's API).
pub(crate) fn kafka(e: rdkafka::error::KafkaError) -> KitError {
    KitError::Kafka(saga_consumer::Cause::new(e))
}

/// The mock cluster did not do what the kit asked: `what` says how.
pub(crate) fn kafka_said(what: impl Into<String>) -> KitError {
    KitError::Kafka(saga_consumer::Cause::message(what))
}

/// Says how many letters a test did not expect, what they were, and how a test says it does.
fn unexpected(service: &str, expected: &usize, letters: &[crate::DeadLetter]) -> String {
    let listed: Vec<String> = letters
        .iter()
        .take(3)
        .map(|l| {
            let at = match (l.partition, l.offset) {
                (Some(p), Some(o)) => format!("{}/{p}@{o}", l.topic),
                _ => l.topic.clone(),
            };
            format!("{} of {at}: {}", l.reason, l.error)
        })
        .collect();
    let more = letters.len().saturating_sub(listed.len());
    let more = if more > 0 {
        format!("; and {more} more")
    } else {
        String::new()
    };
    format!(
        "the {service} service dead-lettered {} message(s), the test expected {expected} ({}{more}); a \
         test that means it says so with expect_dead_letters({service:?}, n)",
        letters.len(),
        listed.join("; ")
    )
}
