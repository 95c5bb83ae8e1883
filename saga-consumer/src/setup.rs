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

/// Sets where this process writes its outbox (every writer: steps, the HTTP layer, the orchestrator), and,
/// for [`crate::OutboxMode::Wal`], checks that PostgreSQL decodes its log (`wal_level = logical`) and
/// creates the publication and `pool`'s schema's replication slot where missing: before the process's first
/// write, since a message written before its slot exists is never read. `SagaService` calls it at start
/// with `SAGA_OUTBOX_MODE`; a process that runs a `SagaConsumer` on its own calls it first.
pub async fn use_outbox(pool: &sqlx::PgPool, mode: crate::OutboxMode) -> Result<(), ConsumerError> {
    if mode == crate::OutboxMode::Wal {
        saga_runtime::store::wal::prepare(pool)
            .await
            .map_err(|e| match e {
                saga_runtime::store::wal::PrepareError::Config(problem) => {
                    ConsumerError::Config(crate::ConfigError::Problem(problem))
                }
                other => ConsumerError::Database(other.to_string()),
            })?;
    }
    saga_runtime::store::wal::set_mode(mode);
    Ok(())
}
