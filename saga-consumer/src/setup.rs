//! What a service's `main` needs around its steps: the command line parsed with one-line errors, an exit
//! code a script can act on, PostgreSQL and the broker checked at start with one-line configuration
//! problems, and topics created where the service is told to.
//!
//! - `0`: done; `1`: the process failed while running; `2`: bad input (an argument that does not parse,
//!   a [`ConfigProblem`](crate::ConfigProblem)), never a panic or a backtrace.

use crate::KafkaConfig;
use crate::error::ConsumerError;

pub use saga_runtime::cli::{exit_code, parse, parse_command};
pub use saga_runtime::config::connect_postgres;

/// Checks that a broker answers at `kafka`'s address: a [`ConfigProblem`](crate::ConfigProblem) naming
/// `KAFKA_BROKERS` if none does within the start-up timeout.
pub async fn probe_broker(kafka: &KafkaConfig) -> Result<(), crate::ConfigProblem> {
    saga_runtime::kafka::probe(kafka, "KAFKA_BROKERS").await
}

/// Creates the topics of `topics` that do not exist, with `partitions` partitions and `replication`
/// replicas each. The framework never relies on a broker creating topics by itself.
pub async fn ensure_topics(
    kafka: &KafkaConfig,
    topics: &[&str],
    partitions: i32,
    replication: i32,
) -> Result<(), ConsumerError> {
    saga_runtime::kafka::ensure_topics(kafka, topics, partitions, replication)
        .await
        .map_err(|e| ConsumerError::Kafka(e.to_string()))
}
