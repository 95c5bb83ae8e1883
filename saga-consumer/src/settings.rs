//! Every setting of a service, each declared once (flag, environment variable, default, doc), in groups a
//! binary flattens into its command line ([`ServiceArgs`] is a whole service's) and that
//! [`SagaServiceBuilder::from_env`](crate::SagaServiceBuilder::from_env) reads from the environment through
//! the same declarations. The relay's groups are `outbox-relay`'s, so a service's embedded relay and the
//! `outbox-relay` binary read the same settings, retention included. The configuration page is generated
//! from these declarations.
//!
//! ```
//! use clap::Parser;
//!
//! /// A service of one's own: the framework's settings, and its own.
//! #[derive(Parser)]
//! struct Cli {
//!     #[command(flatten)]
//!     saga: saga_consumer::settings::ServiceArgs,
//!     /// Where the service's HTTP API listens.
//!     #[arg(long, env = "HTTP_ADDR", default_value = "127.0.0.1:8080")]
//!     http_addr: std::net::SocketAddr,
//! }
//!
//! let cli = Cli::parse_from(["my-service", "--group-id", "orders", "--batch-size", "50"]);
//! assert_eq!(cli.saga.consumer.batch_size, 50);
//! assert_eq!(cli.saga.relay.batch_size, 2_000, "the relay's own batch size, another setting");
//! ```

use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::time::Duration;

use clap::builder::RangedU64ValueParser;
use saga_config::ConfigProblem;
use saga_runtime::settings::value;

pub use outbox_relay::{
    DatabaseArgs, KafkaArgs, OutboxArgs, RelayArgs, RetentionArgs, SaslMechanism, SchemaArgs,
    Secret, SecurityProtocol,
};

use crate::config::AssignmentStrategy;
use crate::retry::RetryPolicy;

/// Partitions processed at once (`SAGA_CONCURRENCY`).
pub const CONCURRENCY: RangeInclusive<u64> = 1..=tokio::sync::Semaphore::MAX_PERMITS as u64;
/// Messages of a partition in one transaction (`SAGA_BATCH_SIZE`).
pub const BATCH_SIZE: RangeInclusive<u64> = 1..=10_000;
/// Keys of a partition run at once (`SAGA_KEY_CONCURRENCY`).
pub const KEY_CONCURRENCY: RangeInclusive<u64> = 1..=1_024;
/// Messages parked behind held keys (`SAGA_HOLD_MAX_PARKED_PER_KEY`, `SAGA_HOLD_MAX_PARKED`).
pub const PARKED: RangeInclusive<u64> = 1..=u32::MAX as u64;
/// The longest fetch wait (`SAGA_FETCH_WAIT_MS`).
pub const MAX_FETCH_WAIT: Duration = Duration::from_secs(300);

fn fetch_wait(text: &str) -> Result<Duration, String> {
    value::millis(text).and_then(|d| value::at_most(d, MAX_FETCH_WAIT))
}

/// The longest session timeout (`SAGA_SESSION_TIMEOUT_MS`): librdkafka refuses one longer than
/// `max.poll.interval.ms`, 300,000 unless a `KAFKA_PROPERTY_MAX_POLL_INTERVAL_MS` raises it.
pub const MAX_SESSION_TIMEOUT: Duration = Duration::from_secs(300);

fn session_timeout(text: &str) -> Result<Duration, String> {
    value::positive_millis(text).and_then(|d| value::at_most(d, MAX_SESSION_TIMEOUT))
}

/// The longest life of the fast path's in-flight lock (`REDIS_LOCK_TTL_MS`): a day.
#[cfg(feature = "redis")]
pub const MAX_REDIS_LOCK_TTL: Duration = Duration::from_secs(24 * 3_600);

#[cfg(feature = "redis")]
fn redis_lock_ttl(text: &str) -> Result<Duration, String> {
    value::positive_millis(text).and_then(|d| value::at_most(d, MAX_REDIS_LOCK_TTL))
}

/// The longest a key may be held before it counts as overdue (`SAGA_HOLD_ALERT_AFTER_SECS`): a year.
pub const MAX_HOLD_ALERT_AFTER: Duration = Duration::from_secs(366 * 24 * 3_600);

fn hold_alert_after(text: &str) -> Result<Duration, String> {
    value::positive_secs(text).and_then(|d| value::at_most(d, MAX_HOLD_ALERT_AFTER))
}

/// The consumer's settings: its group, how it batches, retries, dead-letters and commits. The type the
/// consumer takes ([`SagaBuilder::consumer_args`](crate::SagaBuilder::consumer_args)): each field is declared
/// once, parsed into its type by its rule, and read where it is used.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "saga_consumer")]
#[non_exhaustive]
pub struct ConsumerArgs {
    /// The consumer group (required; at most 249 bytes, no control characters).
    #[arg(long = "group-id", env = "SAGA_GROUP_ID", value_parser = value::group)]
    pub group_id: Option<String>,
    /// Partitions processed at once.
    #[arg(long = "concurrency", env = "SAGA_CONCURRENCY", default_value_t = 4, value_parser = RangedU64ValueParser::<usize>::new().range(CONCURRENCY))]
    pub concurrency: usize,
    /// Most messages of a partition in one transaction.
    #[arg(long = "batch-size", env = "SAGA_BATCH_SIZE", default_value_t = 100, value_parser = RangedU64ValueParser::<usize>::new().range(BATCH_SIZE))]
    pub batch_size: usize,
    /// Messages of different keys of one partition that run at once (1: a partition's messages run one
    /// batch after another). Raise it for slow steps (an outside call per message); a key's messages still
    /// run in their order. See the guide's page on slow steps.
    #[arg(long = "key-concurrency", env = "SAGA_KEY_CONCURRENCY", default_value_t = 1, value_parser = RangedU64ValueParser::<usize>::new().range(KEY_CONCURRENCY))]
    pub key_concurrency: usize,
    /// Retries of transient failures.
    #[command(flatten)]
    pub retry: RetryPolicy,
    /// The dead-letter topic (default: `{group}.dlq`); a Kafka topic name (letters, digits, `.`, `_`, `-`;
    /// at most 249), which a group named otherwise must set.
    #[arg(long = "dlq-topic", env = "SAGA_DLQ_TOPIC", value_parser = value::topic)]
    pub dlq_topic: Option<String>,
    /// Where `saga dlq replay` sends this group's dead letters (default: `{group}.retry`; a Kafka topic
    /// name, which a group named otherwise must set); the consumer reads it with its steps. It must exist, like the dead-letter topic (`SAGA_CREATE_TOPICS` makes both).
    #[arg(long = "retry-topic", env = "SAGA_RETRY_TOPIC", value_parser = value::topic)]
    pub retry_topic: Option<String>,
    /// How often finished offsets are committed, in milliseconds (no effect on latency: the step key
    /// decides, offsets are bookkeeping).
    #[arg(long = "commit-interval-ms", env = "SAGA_COMMIT_INTERVAL_MS", default_value = "1000", value_parser = value::positive_millis)]
    pub commit_interval: Duration,
    /// librdkafka's `fetch.wait.max.ms`, in milliseconds (at most 300000): how long the broker may hold a
    /// fetch that found nothing. Kafka answers a waiting fetch as soon as a message arrives; a broker that
    /// does not adds up to this at every hop. Lower costs more fetch requests while idle.
    #[arg(long = "fetch-wait-ms", env = "SAGA_FETCH_WAIT_MS", default_value = "10", value_parser = fetch_wait)]
    pub fetch_wait: Duration,
    /// Longest a handler may run, in milliseconds, before it fails transiently.
    #[arg(long = "handler-timeout-ms", env = "SAGA_HANDLER_TIMEOUT_MS", default_value = "30000", value_parser = value::positive_millis)]
    pub handler_timeout: Duration,
    /// Drain deadline on SIGTERM, in milliseconds.
    #[arg(long = "shutdown-timeout-ms", env = "SAGA_SHUTDOWN_TIMEOUT_MS", default_value = "30000", value_parser = value::millis)]
    pub shutdown_timeout: Duration,
    /// Longest a rebalance waits for the revoked partitions' batches in flight, in milliseconds.
    #[arg(long = "revoke-timeout-ms", env = "SAGA_REVOKE_TIMEOUT_MS", default_value = "10000", value_parser = value::millis)]
    pub revoke_timeout: Duration,
    /// librdkafka's `session.timeout.ms`, in milliseconds: how soon the group notices a dead member (the
    /// broker bounds it, by its `group.min.session.timeout.ms` and `group.max.session.timeout.ms`); at most
    /// 300,000 (librdkafka's `max.poll.interval.ms`, which it may not exceed).
    #[arg(long = "session-timeout-ms", env = "SAGA_SESSION_TIMEOUT_MS", default_value = "10000", value_parser = session_timeout)]
    pub session_timeout: Duration,
    /// `range`, `roundrobin` or `cooperative-sticky` (the last has upstream problems with manual commits).
    #[arg(
        long = "assignment-strategy",
        env = "SAGA_ASSIGNMENT_STRATEGY",
        default_value = "roundrobin"
    )]
    pub assignment: AssignmentStrategy,
    /// Deaths tolerated per message before it is dead-lettered as `crash-loop` (0: off).
    #[arg(
        long = "crash-loop-limit",
        env = "SAGA_CRASH_LOOP_LIMIT",
        default_value_t = 3
    )]
    pub crash_loop_limit: u32,
    /// Where to serve `/metrics`, `/healthz` and `/readyz` (the consumer's and the outbox's checks;
    /// `/readyz/relay` is the embedded relay's, which does not gate `/readyz`).
    #[arg(long = "ops-addr", env = "SAGA_OPS_ADDR")]
    pub ops_addr: Option<SocketAddr>,
    /// Most messages parked behind one held key; past it a message of the key is dead-lettered
    /// (`hold-queue-full`) rather than parked.
    #[arg(long = "hold-max-parked-per-key", env = "SAGA_HOLD_MAX_PARKED_PER_KEY", default_value_t = 10_000, value_parser = RangedU64ValueParser::<u32>::new().range(PARKED))]
    pub hold_max_parked_per_key: u32,
    /// Most messages parked behind the group's held keys together; past it, the same.
    #[arg(long = "hold-max-parked", env = "SAGA_HOLD_MAX_PARKED", default_value_t = 100_000, value_parser = RangedU64ValueParser::<u32>::new().range(PARKED))]
    pub hold_max_parked: u32,
    /// A key held longer than this, in seconds, counts in `saga_consumer_held_keys_overdue` (the alert); at
    /// most a year.
    #[arg(long = "hold-alert-after-secs", env = "SAGA_HOLD_ALERT_AFTER_SECS", default_value = "3600", value_parser = hold_alert_after)]
    pub hold_alert_after: Duration,
}
saga_runtime::settings_group!(ConsumerArgs);

impl ConsumerArgs {
    /// The retry topic: the configured one, or `{group}.retry`.
    pub fn retry_topic(&self) -> String {
        self.retry_topic
            .clone()
            .unwrap_or_else(|| format!("{}.retry", self.group_id.as_deref().unwrap_or("saga")))
    }

    /// The dead-letter topic: the configured one, or `{group}.dlq`.
    pub fn dlq_topic(&self) -> String {
        self.dlq_topic
            .clone()
            .unwrap_or_else(|| format!("{}.dlq", self.group_id.as_deref().unwrap_or("saga")))
    }

    /// What is wrong with these settings, each naming its variable: the declarations' rules again (a value
    /// set in code was not parsed), the group that must be chosen, and the rules between two settings.
    pub fn problems(&self) -> Vec<ConfigProblem> {
        // A topic set, or the one named after the group: Kafka's rule either way.
        let topic = |t: String| value::topic(&t).map(drop).map_err(|e| format!("{t:?} {e}"));
        let checks = [
            (
                "SAGA_GROUP_ID",
                match &self.group_id {
                    None => Err("is not set: the consumer group must be chosen".to_owned()),
                    Some(g) => value::group(g).map(drop),
                },
            ),
            (
                "SAGA_CONCURRENCY",
                value::within(self.concurrency, &CONCURRENCY).map(drop),
            ),
            (
                "SAGA_BATCH_SIZE",
                value::within(self.batch_size, &BATCH_SIZE).map(drop),
            ),
            (
                "SAGA_KEY_CONCURRENCY",
                value::within(self.key_concurrency, &KEY_CONCURRENCY).map(drop),
            ),
            ("SAGA_DLQ_TOPIC", topic(self.dlq_topic())),
            ("SAGA_RETRY_TOPIC", topic(self.retry_topic())),
            (
                "SAGA_RETRY_TOPIC",
                if self.retry_topic() == self.dlq_topic() {
                    Err("is the dead-letter topic (SAGA_DLQ_TOPIC)".to_owned())
                } else {
                    Ok(())
                },
            ),
            (
                "SAGA_COMMIT_INTERVAL_MS",
                value::positive(self.commit_interval).map(drop),
            ),
            (
                "SAGA_FETCH_WAIT_MS",
                value::at_most(self.fetch_wait, MAX_FETCH_WAIT).map(drop),
            ),
            (
                "SAGA_HANDLER_TIMEOUT_MS",
                value::positive(self.handler_timeout).map(drop),
            ),
            (
                "SAGA_SESSION_TIMEOUT_MS",
                value::positive(self.session_timeout)
                    .and_then(|d| value::at_most(d, MAX_SESSION_TIMEOUT))
                    .map(drop),
            ),
            (
                "SAGA_HOLD_MAX_PARKED_PER_KEY",
                value::within(self.hold_max_parked_per_key, &PARKED).map(drop),
            ),
            (
                "SAGA_HOLD_MAX_PARKED",
                value::within(self.hold_max_parked, &PARKED).map(drop),
            ),
            (
                "SAGA_HOLD_ALERT_AFTER_SECS",
                value::positive(self.hold_alert_after)
                    .and_then(|d| value::at_most(d, MAX_HOLD_ALERT_AFTER))
                    .map(drop),
            ),
        ];
        let mut problems = saga_runtime::settings::failed(checks);
        problems.extend(self.retry.problems());
        problems
    }
}

/// Redis: where, and the namespace of the keys (feature `redis`).
#[cfg(feature = "redis")]
#[derive(Clone, clap::Args)]
#[group(id = "saga_redis")]
#[non_exhaustive]
pub struct RedisArgs {
    /// Turns the Redis fast path on: `redis://HOST:PORT/DB`.
    #[arg(long = "redis-url", env = "REDIS_URL", hide_env_values = true)]
    pub redis_url: Option<String>,
    /// Prefix of every key (default: `saga:` and the cluster's system identifier, its current timeline, the
    /// database and the schema: deployments sharing a Redis differ, a copy restored or promoted gets a
    /// fresh one, and a service that sees its timeline change turns the fast path off until it restarts).
    #[arg(long = "redis-namespace", env = "REDIS_NAMESPACE")]
    pub namespace: Option<String>,
}

#[cfg(feature = "redis")]
impl std::fmt::Debug for RedisArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisArgs")
            .field(
                "redis_url",
                &self.redis_url.as_deref().map(saga_runtime::config::redact),
            )
            .field("namespace", &self.namespace)
            .finish()
    }
}
#[cfg(feature = "redis")]
saga_runtime::settings_group!(RedisArgs);

/// The Redis fast path (feature `redis`): on when `REDIS_URL` is set.
#[cfg(feature = "redis")]
#[derive(Debug, Clone, clap::Args)]
#[group(id = "saga_fast_path")]
#[non_exhaustive]
pub struct FastPathArgs {
    /// Where, and the keys' namespace.
    #[command(flatten)]
    pub redis: RedisArgs,
    /// Life of an HTTP in-flight lock whose holder died, in milliseconds: the longest a killed process
    /// keeps a key's retries at 409. Longer than the slowest request, or a slow request's key is opened to
    /// a second attempt (which PostgreSQL still refuses). At most a day.
    #[arg(long = "redis-lock-ttl-ms", env = "REDIS_LOCK_TTL_MS", default_value = "30000", value_parser = redis_lock_ttl)]
    pub lock_ttl: Duration,
    /// Life of cached responses and completed keys, in seconds; refused if longer than
    /// `SAGA_KEY_RETENTION_HOURS` (Redis could answer for a key PostgreSQL has forgotten).
    #[arg(long = "redis-key-ttl-secs", env = "REDIS_KEY_TTL_SECS", default_value = "3600", value_parser = value::positive_secs)]
    pub key_ttl: Duration,
    /// A slower Redis call, in milliseconds, is answered from PostgreSQL (also the longest a call waits for
    /// a connection another call is making).
    #[arg(long = "redis-timeout-ms", env = "REDIS_TIMEOUT_MS", default_value = "50", value_parser = value::positive_millis)]
    pub timeout: Duration,
}
#[cfg(feature = "redis")]
saga_runtime::settings_group!(FastPathArgs);

/// A whole service: its broker, consumer, outbox, embedded relay (and its retention), topics, and fast
/// path. What [`SagaServiceBuilder::from_env`](crate::SagaServiceBuilder::from_env) reads; a service's
/// binary flattens it into its command line.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "saga_service")]
#[non_exhaustive]
pub struct ServiceArgs {
    /// The database (the embedded relay's replication connection, unless `SAGA_REPLICATION_URL`).
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// The broker.
    #[command(flatten)]
    pub kafka: KafkaArgs,
    /// The consumer.
    #[command(flatten)]
    pub consumer: ConsumerArgs,
    /// The outbox.
    #[command(flatten)]
    pub outbox: OutboxArgs,
    /// The embedded relay, and retention.
    #[command(flatten)]
    pub relay: RelayArgs,
    /// Run the outbox relay inside the service (false: `outbox-relay run` publishes the outbox).
    #[arg(long = "embedded-relay", env = "SAGA_EMBEDDED_RELAY", default_value_t = true, action = clap::ArgAction::Set)]
    pub embedded_relay: bool,
    /// Create the service's topics, its dead-letter and retry topics where missing, with this many
    /// partitions (unset: only check that they exist).
    #[arg(long = "create-topics", env = "SAGA_CREATE_TOPICS", value_parser = clap::value_parser!(i32).range(1..))]
    pub create_topics: Option<i32>,
    /// Replicas of the topics `SAGA_CREATE_TOPICS` creates.
    #[arg(long = "topic-replication", env = "SAGA_TOPIC_REPLICATION", default_value_t = 1, value_parser = clap::value_parser!(i32).range(1..))]
    pub topic_replication: i32,
    /// Start although a topic the service reads keeps messages longer than `SAGA_KEY_RETENTION_HOURS`
    /// (a message coming back after its key was deleted would otherwise run its step again; the consumer
    /// still dead-letters such a message rather than run it).
    #[arg(long = "accept-key-expiry", env = "SAGA_ACCEPT_KEY_EXPIRY")]
    pub accept_key_expiry: bool,
    /// The Redis fast path.
    #[cfg(feature = "redis")]
    #[command(flatten)]
    pub fast_path: FastPathArgs,
}
saga_runtime::settings_group!(ServiceArgs);
