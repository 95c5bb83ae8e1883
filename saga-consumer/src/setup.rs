//! What a service's `main` needs around its steps: the command line parsed with one-line errors, an exit
//! code a script can act on, PostgreSQL and the broker checked at start with one-line configuration
//! problems, and topics created where the service is told to.
//!
//! - `0`: done; `1`: the process failed while running; `2`: bad input (an argument that does not parse,
//!   a [`ConfigProblem`](crate::ConfigProblem)), never a panic or a backtrace.

use crate::KafkaConfig;
use crate::error::ConsumerError;

/// Parses the command line as `C`. `--help` and `--version` print as usual; anything else that does not
/// parse prints one line (naming the variable a refused value came from) and exits with code 2.
pub fn parse<C: clap::Parser>() -> C {
    saga_runtime::cli::parse()
}

/// Like [`parse`], for a command built or adjusted at run time (another name or description).
pub fn parse_command<C: clap::FromArgMatches>(command: clap::Command) -> C {
    saga_runtime::cli::parse_command(command)
}

/// Reports `result` on stderr in one line and turns it into the process's exit code: 2 when a
/// [`ConfigProblem`](crate::ConfigProblem) or [`BadInput`](crate::BadInput) is among its causes, 1 for
/// other errors.
pub fn exit_code(result: anyhow::Result<()>) -> std::process::ExitCode {
    saga_runtime::cli::exit_code(result)
}

/// A pool of `max_connections` on `url` (`var` names the setting it came from), in `schema` when given
/// (its `search_path`), checked at once: a URL that does not parse or a database that does not answer is a
/// [`ConfigProblem`](crate::ConfigProblem) naming `var`.
pub async fn connect_postgres(
    var: &str,
    url: &str,
    schema: Option<&str>,
    max_connections: u32,
) -> Result<sqlx::PgPool, crate::ConfigProblem> {
    saga_runtime::config::connect_postgres(var, url, schema, max_connections).await
}

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
        .map_err(ConsumerError::kafka)
}

/// Opens the outbox of `pool`'s schema in `mode` before its first write, and returns it for the process's
/// writers (a consumer's [`SagaConsumerBuilder::with_outbox`](crate::SagaBuilder::with_outbox), the HTTP
/// layer's [`with_outbox`](crate::http::IdempotencyLayer::with_outbox), an orchestrator's): for
/// [`crate::OutboxMode::Wal`], checks that PostgreSQL decodes its log (`wal_level = logical`), creates the
/// publication and the schema's replication slot where missing (a message written before its slot exists is
/// never read), refuses a slot the schema recorded that is gone or lost, and watches the slot from then on
/// (writers stop within seconds of it being lost); for the table, says that this process writes the table
/// (a relay switching the schema to the log waits for it) for as long as the returned outbox lives.
/// `SagaService` does it at start; a process that runs a `SagaConsumer` on its own calls it first.
#[must_use = "hand the outbox to the writers: one not given it writes an outbox nobody opened"]
pub async fn use_outbox(
    pool: &sqlx::PgPool,
    mode: crate::OutboxMode,
) -> Result<crate::Outbox, ConsumerError> {
    let outbox = crate::Outbox::new(
        mode,
        saga_runtime::store::outbox::DEFAULT_MAX_TRANSACTION_BYTES,
    );
    open(pool, &outbox).await?;
    Ok(outbox)
}

/// Opens `outbox` (see [`use_outbox`]).
pub(crate) async fn open(pool: &sqlx::PgPool, outbox: &crate::Outbox) -> Result<(), ConsumerError> {
    outbox
        .runtime()
        .open(
            pool,
            saga_runtime::store::wal::monitor::DEFAULT_CHECK_INTERVAL,
        )
        .await
        .map_err(|e| match e {
            saga_runtime::store::outbox::OpenError::Config(problem) => {
                ConsumerError::Config(crate::ConfigError::Problem(problem))
            }
            other => ConsumerError::Outbox(crate::error::Cause::new(other)),
        })
}
