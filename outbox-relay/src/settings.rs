//! The relay's settings, each declared once (flag, environment variable, default, doc): the `outbox-relay`
//! binary flattens these groups into its command line, and a relay a service embeds reads the same groups
//! from the environment ([`RelayBuilder::from_env`](crate::RelayBuilder::from_env)), so both read every
//! setting, retention included, the same way. The configuration page is generated from them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use saga_config::{ConfigProblem, KafkaConfig, OutboxMode};
use saga_runtime::settings::value;

use crate::gc::RetentionPolicy;
use crate::kafka_security::{
    SaslMechanism, Secret, Security, SecurityProtocol, parse_readable_file, parse_secret,
};
use crate::store::AfterPublish;

/// The database.
#[derive(Clone, clap::Args)]
#[group(id = "saga_database")]
#[non_exhaustive]
pub struct DatabaseArgs {
    /// The PostgreSQL URL of the service's database.
    #[arg(
        long = "database-url",
        env = "DATABASE_URL",
        hide_env_values = true,
        global = true
    )]
    pub database_url: Option<String>,
}

impl std::fmt::Debug for DatabaseArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabaseArgs")
            .field("database_url", &redacted(self.database_url.as_deref()))
            .finish()
    }
}

/// A URL as `Debug` may show it: without its password.
pub(crate) fn redacted(url: Option<&str>) -> Option<String> {
    url.map(saga_runtime::config::redact)
}
saga_runtime::settings_group!(DatabaseArgs);

/// The schema of a service in its database.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "saga_schema")]
#[non_exhaustive]
pub struct SchemaArgs {
    /// The service's schema (sets `search_path`); default: the URL's own search path.
    #[arg(long = "schema", env = "SAGA_SCHEMA", global = true)]
    pub schema: Option<String>,
}
saga_runtime::settings_group!(SchemaArgs);

/// The broker, and how to reach it when it is secured: TLS and SASL, declared here for every client of the
/// framework (a service's consumer and relay, `outbox-relay`, `saga`, the inspector). Secrets are set through
/// their variables (`--help` never shows their values, nor does any `Debug`).
#[derive(Debug, Clone, clap::Args)]
#[group(id = "saga_kafka")]
#[non_exhaustive]
pub struct KafkaArgs {
    /// Kafka bootstrap servers (required). Any other librdkafka property is set with
    /// `KAFKA_PROPERTY_{NAME}` (`KAFKA_PROPERTY_SSL_ENDPOINT_IDENTIFICATION_ALGORITHM=none` sets
    /// `ssl.endpoint.identification.algorithm`), applied after these settings.
    #[arg(long = "brokers", env = "KAFKA_BROKERS", global = true)]
    pub brokers: Option<String>,
    /// How clients talk to the broker: `plaintext` (the default), `ssl` (TLS; mutual TLS with a client
    /// certificate), `sasl_ssl` (SASL over TLS: managed clusters) or `sasl_plaintext`.
    #[arg(
        long = "kafka-security-protocol",
        env = "KAFKA_SECURITY_PROTOCOL",
        value_enum,
        ignore_case = true,
        global = true
    )]
    pub security_protocol: Option<SecurityProtocol>,
    /// The SASL mechanism: `SCRAM-SHA-512`, `SCRAM-SHA-256`, `PLAIN` (over TLS only) or `OAUTHBEARER`
    /// (librdkafka fetches tokens from `KAFKA_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL`).
    #[arg(
        long = "kafka-sasl-mechanism",
        env = "KAFKA_SASL_MECHANISM",
        value_enum,
        ignore_case = true,
        global = true
    )]
    pub sasl_mechanism: Option<SaslMechanism>,
    /// The SASL user (PLAIN, SCRAM).
    #[arg(
        long = "kafka-sasl-username",
        env = "KAFKA_SASL_USERNAME",
        global = true
    )]
    pub sasl_username: Option<String>,
    /// The SASL user's password (PLAIN, SCRAM): set it in the environment, not on the command line, where
    /// other users of the machine can read it.
    #[arg(long = "kafka-sasl-password", env = "KAFKA_SASL_PASSWORD", hide_env_values = true, value_parser = parse_secret, global = true)]
    pub sasl_password: Option<Secret>,
    /// A PEM file of the CA certificates that signed the broker's certificate (default: the system's).
    #[arg(long = "kafka-ssl-ca-location", env = "KAFKA_SSL_CA_LOCATION", value_parser = parse_readable_file, global = true)]
    pub ssl_ca_location: Option<PathBuf>,
    /// Mutual TLS: the client's certificate (PEM).
    #[arg(long = "kafka-ssl-certificate-location", env = "KAFKA_SSL_CERTIFICATE_LOCATION", value_parser = parse_readable_file, global = true)]
    pub ssl_certificate_location: Option<PathBuf>,
    /// Mutual TLS: the client certificate's private key (PEM).
    #[arg(long = "kafka-ssl-key-location", env = "KAFKA_SSL_KEY_LOCATION", value_parser = parse_readable_file, global = true)]
    pub ssl_key_location: Option<PathBuf>,
    /// The passphrase of an encrypted private key.
    #[arg(long = "kafka-ssl-key-password", env = "KAFKA_SSL_KEY_PASSWORD", hide_env_values = true, value_parser = parse_secret, global = true)]
    pub ssl_key_password: Option<Secret>,
    /// OAUTHBEARER: the OIDC token endpoint librdkafka asks for tokens (client credentials grant).
    #[arg(
        long = "kafka-sasl-oauthbearer-token-endpoint-url",
        env = "KAFKA_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL",
        global = true
    )]
    pub oauthbearer_token_endpoint_url: Option<String>,
    /// OAUTHBEARER: the client id.
    #[arg(
        long = "kafka-sasl-oauthbearer-client-id",
        env = "KAFKA_SASL_OAUTHBEARER_CLIENT_ID",
        global = true
    )]
    pub oauthbearer_client_id: Option<String>,
    /// OAUTHBEARER: the client's secret.
    #[arg(long = "kafka-sasl-oauthbearer-client-secret", env = "KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET", hide_env_values = true, value_parser = parse_secret, global = true)]
    pub oauthbearer_client_secret: Option<Secret>,
    /// OAUTHBEARER: the scope to ask for, if the provider wants one.
    #[arg(
        long = "kafka-sasl-oauthbearer-scope",
        env = "KAFKA_SASL_OAUTHBEARER_SCOPE",
        global = true
    )]
    pub oauthbearer_scope: Option<String>,
}
saga_runtime::settings_group!(KafkaArgs);

impl KafkaArgs {
    /// The client configuration: the brokers (a [`ConfigProblem`] naming `KAFKA_BROKERS` when missing), the
    /// security settings (settings that cannot work together are a [`ConfigProblem`] naming the one to
    /// change), then the `KAFKA_PROPERTY_*` properties.
    pub fn config(&self) -> Result<KafkaConfig, ConfigProblem> {
        let config = KafkaConfig::with_env_properties(self.brokers.clone())?;
        self.security().apply(config)
    }

    /// [`KafkaArgs::config`], or, when `KAFKA_BROKERS` is unset, the same configuration around an empty
    /// broker list, for a builder's later call to give one (its security settings and `KAFKA_PROPERTY_*`
    /// kept: never dropped because the list came from elsewhere).
    pub fn config_or_unlisted(&self) -> Result<KafkaConfig, ConfigProblem> {
        if self
            .brokers
            .as_deref()
            .is_some_and(|b| !b.trim().is_empty())
        {
            return self.config();
        }
        let mut listed = self.clone();
        listed.brokers = Some("unlisted".to_owned());
        let mut config = listed.config()?;
        config.brokers.clear();
        Ok(config)
    }

    /// The security settings alone, added to `config` (a configuration built from another broker list).
    pub fn secure(&self, config: KafkaConfig) -> Result<KafkaConfig, ConfigProblem> {
        self.security().apply(config)
    }

    fn security(&self) -> Security<'_> {
        Security {
            protocol: self.security_protocol,
            mechanism: self.sasl_mechanism,
            username: self.sasl_username.as_deref(),
            password: self.sasl_password.as_ref(),
            ca: self.ssl_ca_location.as_deref(),
            certificate: self.ssl_certificate_location.as_deref(),
            key: self.ssl_key_location.as_deref(),
            key_password: self.ssl_key_password.as_ref(),
            oidc_endpoint: self.oauthbearer_token_endpoint_url.as_deref(),
            oidc_client_id: self.oauthbearer_client_id.as_deref(),
            oidc_client_secret: self.oauthbearer_client_secret.as_ref(),
            oidc_scope: self.oauthbearer_scope.as_deref(),
        }
    }
}

/// The longest linger librdkafka takes (`linger.ms`, `RELAY_LINGER_MS`).
pub(crate) const MAX_LINGER: Duration = Duration::from_millis(900_000);

fn linger(text: &str) -> Result<Duration, String> {
    value::millis(text).and_then(|d| value::at_most(d, MAX_LINGER))
}

/// The longest `RELAY_PARK_AFTER_SECS`: the producer's delivery timeout it bounds is at most `i32::MAX`
/// milliseconds.
pub(crate) const MAX_PARK_AFTER: Duration = Duration::from_secs(2_147_483);

fn park_after(text: &str) -> Result<Duration, String> {
    value::positive_secs(text).and_then(|d| value::at_most(d, MAX_PARK_AFTER))
}

/// Where a service writes its outbox, read by its writers and by the relays of its schema.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "saga_outbox")]
#[non_exhaustive]
pub struct OutboxArgs {
    /// `table`: events are rows of `saga_outbox`; `wal`: one logical message per transaction in the
    /// write-ahead log (needs `wal_level = logical`; see the WAL outbox guide). Every process of a schema
    /// has the same.
    #[arg(long = "outbox-mode", env = "SAGA_OUTBOX_MODE", default_value = "table", value_parser = parse_mode)]
    pub mode: OutboxMode,
    /// The largest size in bytes of one write of a transaction's events, as written to the log, in both
    /// modes: a step writing more fails for good (a dead letter saying so), an HTTP request gets a 500.
    #[arg(
        long = "outbox-max-transaction-bytes",
        env = "SAGA_OUTBOX_MAX_TRANSACTION_BYTES",
        default_value_t = saga_runtime::store::outbox::DEFAULT_MAX_TRANSACTION_BYTES,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..),
    )]
    pub max_transaction_bytes: usize,
}
saga_runtime::settings_group!(OutboxArgs);

fn parse_mode(text: &str) -> Result<OutboxMode, String> {
    OutboxMode::parse(text).map_err(|p| p.problem)
}

/// Retention: what is deleted after how long, by the relay (embedded or not) and `outbox-relay gc`.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "saga_retention")]
#[non_exhaustive]
pub struct RetentionArgs {
    /// How long finished step keys are kept, in hours (at least 4). It must exceed the longest time a
    /// message can come back after it took effect (the topics' retention, and the broker's offset
    /// retention): a service refuses to start when a topic it reads keeps messages longer, unless
    /// `SAGA_ACCEPT_KEY_EXPIRY`.
    #[arg(
        long = "key-retention-hours",
        env = "SAGA_KEY_RETENTION_HOURS",
        default_value_t = 168.0
    )]
    pub key_retention_hours: f64,
    /// How long published outbox rows are kept, in hours (what `saga trace` shows of a step's events).
    #[arg(
        long = "relay-published-retention-hours",
        env = "RELAY_PUBLISHED_RETENTION_HOURS",
        default_value_t = 168.0
    )]
    pub published_retention_hours: f64,
    /// After how many hours an abandoned two-phase lease (its worker died) is deleted.
    #[arg(
        long = "abandoned-lease-hours",
        env = "SAGA_ABANDONED_LEASE_HOURS",
        default_value_t = 24.0
    )]
    pub abandoned_lease_hours: f64,
    /// Rows per DELETE statement of retention (bounded batches: no long locks).
    #[arg(
        long = "relay-gc-batch-size",
        env = "RELAY_GC_BATCH_SIZE",
        default_value_t = 5_000,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub gc_batch_size: u32,
    /// Seconds between retention runs of a running relay (0: never).
    #[arg(long = "relay-gc-interval-secs", env = "RELAY_GC_INTERVAL_SECS", default_value = "60", value_parser = value::secs)]
    pub gc_interval: Duration,
}
saga_runtime::settings_group!(RetentionArgs);

impl RetentionArgs {
    /// The retention policy.
    pub fn policy(&self) -> Result<RetentionPolicy, ConfigProblem> {
        let hours = |h: f64, var: &str| {
            Duration::try_from_secs_f64(h * 3600.0).map_err(|_| {
                ConfigProblem::new(
                    var,
                    format!("{h} is not a number of hours"),
                    "set it to a non-negative number",
                )
            })
        };
        Ok(RetentionPolicy {
            published_rows: hours(
                self.published_retention_hours,
                "RELAY_PUBLISHED_RETENTION_HOURS",
            )?,
            finished_keys: self.key_retention()?,
            abandoned_leases: hours(self.abandoned_lease_hours, "SAGA_ABANDONED_LEASE_HOURS")?,
            batch_size: self.gc_batch_size,
        })
    }

    /// How long finished step keys are kept: at least
    /// [`MIN_KEY_RETENTION`](saga_runtime::store::gc::MIN_KEY_RETENTION).
    pub fn key_retention(&self) -> Result<Duration, ConfigProblem> {
        let min = saga_runtime::store::gc::MIN_KEY_RETENTION;
        let min_hours = min.as_secs() / 3600;
        match Duration::try_from_secs_f64(self.key_retention_hours * 3600.0) {
            Ok(retention) if retention >= min => Ok(retention),
            _ => Err(ConfigProblem::new(
                "SAGA_KEY_RETENTION_HOURS",
                format!(
                    "{} is not a number of hours of at least {min_hours}",
                    self.key_retention_hours
                ),
                format!(
                    "set it to {min_hours} or more: a message's clock may be an hour off, and a step key must \
                     outlive what can bring its message back"
                ),
            )),
        }
    }
}

/// The relay's settings: how it publishes, and its retention. The type the relay takes
/// ([`RelayBuilder::args`](crate::RelayBuilder::args)): each field is declared once, parsed into its type by
/// its rule, and read where it is used.
#[derive(Clone, clap::Args)]
#[group(id = "saga_relay")]
#[non_exhaustive]
pub struct RelayArgs {
    /// Most rows (or WAL events) per batch.
    #[arg(id = "relay_batch_size", long = "relay-batch-size", env = "RELAY_BATCH_SIZE", default_value_t = 2_000, value_parser = clap::value_parser!(i64).range(1..))]
    pub batch_size: i64,
    /// Fallback poll of the table outbox in milliseconds; a commit wakes the relay at once
    /// (`LISTEN`/`NOTIFY`).
    #[arg(long = "relay-poll-interval-ms", env = "RELAY_POLL_INTERVAL_MS", default_value = "1000", value_parser = value::positive_millis)]
    pub poll_interval: Duration,
    /// librdkafka's linger in milliseconds: 0 sends at once (lowest latency); a few ms batch more on a fast
    /// broker. At most 900,000 (librdkafka's limit).
    #[arg(long = "relay-linger-ms", env = "RELAY_LINGER_MS", default_value = "0", value_parser = linger)]
    pub linger: Duration,
    /// Delete rows once published instead of marking them (then `saga trace` shows no publication).
    #[arg(long = "relay-delete-published", env = "RELAY_DELETE_PUBLISHED")]
    pub delete_published: bool,
    /// Failed attempts after which an event the broker refuses for good (too large, invalid) is parked:
    /// set aside with its error, counted, published again once retried.
    #[arg(long = "relay-park-after-attempts", env = "RELAY_PARK_AFTER_ATTEMPTS", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub park_after_attempts: u32,
    /// WAL mode: how long, in seconds, an event that keeps failing (whatever the error) is tried again
    /// before it is parked with its key's later events, so that the slot moves on for the other keys (at
    /// least 1, at most 2,147,483: the producer's delivery timeout is bounded by it).
    #[arg(long = "relay-park-after-secs", env = "RELAY_PARK_AFTER_SECS", default_value = "30", value_parser = park_after)]
    pub park_after_time: Duration,
    /// How often, in milliseconds, the table outbox's shards are shared out again between the relays of a
    /// schema (one that died is replaced within about this); also the longest a relay waits between two
    /// reads of its rows, and how often parked rows due again are looked for.
    #[arg(long = "relay-rebalance-interval-ms", env = "RELAY_REBALANCE_INTERVAL_MS", default_value = "2000", value_parser = value::positive_millis)]
    pub rebalance_interval: Duration,
    /// How often, in milliseconds, the backlog gauges are sampled.
    #[arg(long = "relay-backlog-interval-ms", env = "RELAY_BACKLOG_INTERVAL_MS", default_value = "10000", value_parser = value::positive_millis)]
    pub backlog_interval: Duration,
    /// WAL mode: how often, in milliseconds, a relay standing by (another reads the slot) tries to take
    /// the slot over.
    #[arg(long = "relay-standby-interval-ms", env = "RELAY_STANDBY_INTERVAL_MS", default_value = "1000", value_parser = value::positive_millis)]
    pub standby_interval: Duration,
    /// Where the relay binary serves `/metrics`, `/healthz` and `/readyz` (a relay a service embeds
    /// shares the service's).
    #[arg(id = "relay_ops_addr", long = "relay-ops-addr", env = "RELAY_OPS_ADDR")]
    pub ops_addr: Option<SocketAddr>,
    /// WAL mode: the URL of the replication connection (default: `DATABASE_URL`); its role needs the
    /// `REPLICATION` attribute (`sslmode=require` asks for TLS).
    #[arg(
        long = "replication-url",
        env = "SAGA_REPLICATION_URL",
        hide_env_values = true
    )]
    pub replication_url: Option<String>,
    /// Retention.
    #[command(flatten)]
    pub retention: RetentionArgs,
}
saga_runtime::settings_group!(RelayArgs);

impl std::fmt::Debug for RelayArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayArgs")
            .field("batch_size", &self.batch_size)
            .field("poll_interval", &self.poll_interval)
            .field("linger", &self.linger)
            .field("delete_published", &self.delete_published)
            .field("park_after_attempts", &self.park_after_attempts)
            .field("park_after_time", &self.park_after_time)
            .field("rebalance_interval", &self.rebalance_interval)
            .field("backlog_interval", &self.backlog_interval)
            .field("standby_interval", &self.standby_interval)
            .field("ops_addr", &self.ops_addr)
            .field(
                "replication_url",
                &redacted(self.replication_url.as_deref()),
            )
            .field("retention", &self.retention)
            .finish()
    }
}

impl RelayArgs {
    /// What is wrong with these settings, each naming its variable: the declarations' rules again, for
    /// values set in code.
    pub fn problems(&self) -> Vec<ConfigProblem> {
        let checks = [
            (
                "RELAY_BATCH_SIZE",
                (self.batch_size < 1).then_some("must be at least 1"),
            ),
            (
                "RELAY_POLL_INTERVAL_MS",
                self.poll_interval.is_zero().then_some("must be positive"),
            ),
            (
                "RELAY_PARK_AFTER_ATTEMPTS",
                (self.park_after_attempts < 1).then_some("must be at least 1"),
            ),
            (
                "RELAY_PARK_AFTER_SECS",
                (self.park_after_time < Duration::from_secs(1)).then_some("must be at least 1 s"),
            ),
            (
                "RELAY_PARK_AFTER_SECS",
                (self.park_after_time > MAX_PARK_AFTER)
                    .then_some("must be at most 2147483 s (the producer's delivery timeout)"),
            ),
            (
                "RELAY_LINGER_MS",
                (self.linger > MAX_LINGER).then_some("must be at most 900000 ms (librdkafka's)"),
            ),
            (
                "RELAY_LINGER_MS",
                // (A park bound under 1 s is refused above, on its own.)
                (self.park_after_time >= Duration::from_secs(1) && self.linger >= self.park_after_time)
                    .then_some(
                    "must be shorter than RELAY_PARK_AFTER_SECS (the producer's delivery timeout)",
                ),
            ),
            (
                "RELAY_REBALANCE_INTERVAL_MS",
                self.rebalance_interval
                    .is_zero()
                    .then_some("must be positive"),
            ),
            (
                "RELAY_BACKLOG_INTERVAL_MS",
                self.backlog_interval
                    .is_zero()
                    .then_some("must be positive"),
            ),
            (
                "RELAY_STANDBY_INTERVAL_MS",
                self.standby_interval
                    .is_zero()
                    .then_some("must be positive"),
            ),
            (
                "RELAY_GC_BATCH_SIZE",
                (self.retention.gc_batch_size < 1).then_some("must be at least 1"),
            ),
        ];
        let mut problems: Vec<ConfigProblem> = checks
            .into_iter()
            .filter_map(|(var, why)| why.map(|why| ConfigProblem::new(var, why, "fix its value")))
            .collect();
        if let Err(problem) = self.retention.policy() {
            problems.push(problem);
        }
        problems
    }

    /// What to do with published rows (`RELAY_DELETE_PUBLISHED`).
    pub fn after_publish(&self) -> AfterPublish {
        if self.delete_published {
            AfterPublish::Delete
        } else {
            AfterPublish::Mark
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RetentionArgs;

    fn retention(hours: &str) -> RetentionArgs {
        RetentionArgs::from_vars(|name| {
            (name == "SAGA_KEY_RETENTION_HOURS").then(|| hours.to_owned())
        })
        .unwrap()
    }

    /// Without `KAFKA_BROKERS`, the security settings still make the configuration a builder completes.
    #[test]
    fn a_configuration_without_brokers_keeps_its_security_settings() {
        let kafka = super::KafkaArgs::from_vars(|name| {
            (name == "KAFKA_SECURITY_PROTOCOL").then(|| "ssl".to_owned())
        })
        .unwrap();
        assert_eq!(kafka.config().unwrap_err().setting, "KAFKA_BROKERS");
        let config = kafka.config_or_unlisted().unwrap();
        assert_eq!(config.brokers, "");
        assert!(
            config
                .properties
                .iter()
                .any(|(name, value)| name == "security.protocol" && value == "ssl"),
            "{config:?}"
        );
        let listed = super::KafkaArgs::from_vars(|name| {
            (name == "KAFKA_BROKERS").then(|| "b:9093".to_owned())
        })
        .unwrap();
        assert_eq!(listed.config_or_unlisted().unwrap().brokers, "b:9093");
    }

    #[test]
    fn no_debug_of_the_settings_shows_a_urls_password() {
        const CANARY: &str = "canary-url-secret-9e1";
        let url = format!("postgres://svc:{CANARY}@db.internal/sagas");
        let vars = |name: &str| {
            matches!(name, "DATABASE_URL" | "SAGA_REPLICATION_URL").then(|| url.clone())
        };
        let database = super::DatabaseArgs::from_vars(vars).unwrap();
        let relay = super::RelayArgs::from_vars(vars).unwrap();
        assert_eq!(database.database_url.as_deref(), Some(url.as_str()));
        assert_eq!(relay.replication_url.as_deref(), Some(url.as_str()));
        let builder = crate::Relay::builder().args(&relay, &super::OutboxArgs::default(), None);
        for shown in [
            format!("{database:?}"),
            format!("{relay:?}"),
            format!("{builder:?}"),
        ] {
            assert!(!shown.contains(CANARY), "{shown}");
            assert!(shown.contains("svc:***@db.internal"), "{shown}");
        }
    }

    /// librdkafka refuses a linger not shorter than the delivery timeout the park bound sets.
    #[test]
    fn a_linger_not_shorter_than_the_park_bound_is_refused_naming_it() {
        let pairs = [("RELAY_LINGER_MS", "2000"), ("RELAY_PARK_AFTER_SECS", "1")];
        let get = |name: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        };
        let args = super::RelayArgs::from_vars(get).unwrap();
        let problems: Vec<String> = args.problems().into_iter().map(|p| p.setting).collect();
        assert_eq!(problems, ["RELAY_LINGER_MS"]);
        let ok =
            super::RelayArgs::from_vars(|n: &str| (n == "RELAY_LINGER_MS").then(|| "5".to_owned()))
                .unwrap();
        assert!(ok.problems().is_empty());
    }

    #[test]
    fn a_zero_the_relay_cannot_run_with_is_refused_naming_the_variable_not_clamped() {
        for var in [
            "RELAY_BATCH_SIZE",
            "RELAY_POLL_INTERVAL_MS",
            "RELAY_PARK_AFTER_ATTEMPTS",
            "RELAY_PARK_AFTER_SECS",
            "RELAY_REBALANCE_INTERVAL_MS",
            "RELAY_BACKLOG_INTERVAL_MS",
            "RELAY_STANDBY_INTERVAL_MS",
            "RELAY_GC_BATCH_SIZE",
        ] {
            let zero = |name: &str| (name == var).then(|| "0".to_owned());
            let problem = super::RelayArgs::from_vars(zero).unwrap_err();
            assert!(problem.to_string().contains(var), "{var}: {problem}");
            let one = |name: &str| (name == var).then(|| "1".to_owned());
            let args = super::RelayArgs::from_vars(one).unwrap();
            assert!(args.problems().is_empty(), "{var}=1");
            let taken = match var {
                "RELAY_BATCH_SIZE" => args.batch_size == 1,
                "RELAY_POLL_INTERVAL_MS" => args.poll_interval.as_millis() == 1,
                "RELAY_PARK_AFTER_ATTEMPTS" => args.park_after_attempts == 1,
                "RELAY_PARK_AFTER_SECS" => args.park_after_time.as_secs() == 1,
                "RELAY_REBALANCE_INTERVAL_MS" => args.rebalance_interval.as_millis() == 1,
                "RELAY_BACKLOG_INTERVAL_MS" => args.backlog_interval.as_millis() == 1,
                "RELAY_STANDBY_INTERVAL_MS" => args.standby_interval.as_millis() == 1,
                _ => args.retention.policy().unwrap().batch_size == 1,
            };
            assert!(taken, "{var}=1 is taken as it is");
        }
        // The same rules for values set in code.
        let args = super::RelayArgs {
            batch_size: 0,
            park_after_time: std::time::Duration::ZERO,
            ..super::RelayArgs::default()
        };
        let named: Vec<String> = args.problems().into_iter().map(|p| p.setting).collect();
        assert_eq!(named, ["RELAY_BATCH_SIZE", "RELAY_PARK_AFTER_SECS"]);
    }

    #[test]
    fn a_key_retention_below_the_floor_is_refused_naming_the_variable() {
        for hours in ["1", "3.5", "0", "-4"] {
            let problem = retention(hours).key_retention().unwrap_err();
            assert!(
                problem.to_string().contains("SAGA_KEY_RETENTION_HOURS"),
                "{problem}"
            );
        }
        assert_eq!(
            retention("4").key_retention().unwrap(),
            saga_runtime::store::gc::MIN_KEY_RETENTION
        );
        assert!(retention("4").policy().is_ok());
        assert!(retention("2").policy().is_err());
    }
}
