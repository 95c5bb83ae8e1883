//! The `outbox-relay` command line: `run`, `gc`, `migrate`, `status`.

use std::net::SocketAddr;
use std::time::Duration;

use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use saga_runtime::config::{
    ConfigProblem, connect_postgres, require_schema, require_tables, required_postgres_url,
};
use saga_runtime::kafka::{KafkaConfig, probe};
use sqlx::PgPool;

use crate::gc::{RetentionPolicy, run_retention};
use crate::relay::Relay;
use crate::store::{AfterPublish, backlog};
use saga_core::OutboxMode;

/// The `outbox-relay` binary: parses the command line (see `outbox-relay --help`), runs the subcommand
/// until it is done or SIGTERM / Ctrl-C, and answers bad input or configuration with one line and exit code
/// 2.
pub async fn main() -> ExitCode {
    let _tracing = saga_runtime::telemetry::init_tracing();
    let cli: Cli = saga_runtime::cli::parse();
    saga_runtime::cli::exit_code(cli.execute().await)
}

/// The setting that chooses the outbox's schema (else DATABASE_URL's search path does).
const SCHEMA_VAR: &str = "SAGA_SCHEMA";

/// Publishes the transactional outbox to Kafka, in per-key commit order, losing nothing.
#[derive(Debug, Parser)]
#[command(name = "outbox-relay", version)]
struct Cli {
    /// PostgreSQL URL.
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
    /// The schema holding the outbox (sets `search_path`); default: the URL's own search path.
    #[arg(long, env = "SAGA_SCHEMA")]
    schema: Option<String>,
    /// What to do.
    #[command(subcommand)]
    command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Publish continuously (and run retention periodically) until SIGTERM or Ctrl-C.
    Run(RunArgs),
    /// Delete published rows and finished idempotency keys past their retention, once.
    Gc(RetentionArgs),
    /// Apply the framework's migrations.
    Migrate,
    /// Print the backlog: unpublished rows, the oldest one's age, failing rows.
    Status,
}

/// Options of `run`.
#[derive(Debug, Args)]
struct RunArgs {
    /// Kafka bootstrap servers (required).
    #[arg(long, env = "KAFKA_BROKERS")]
    brokers: Option<String>,
    /// Rows per batch.
    #[arg(long, env = "RELAY_BATCH_SIZE", default_value_t = 2_000)]
    batch_size: i64,
    /// Fallback poll interval in milliseconds (notifications wake the relay sooner).
    #[arg(long, env = "RELAY_POLL_INTERVAL_MS", default_value_t = 1_000)]
    poll_interval_ms: u64,
    /// The producer's linger in milliseconds (0: send at once; 1-5 trade latency for fuller requests).
    #[arg(long, env = "RELAY_LINGER_MS", default_value_t = 0)]
    linger_ms: u64,
    /// Delete rows once published instead of marking them.
    #[arg(long, env = "RELAY_DELETE_PUBLISHED")]
    delete_published: bool,
    /// Failed attempts after which a row the broker refuses for good is parked.
    #[arg(long, env = "RELAY_PARK_AFTER_ATTEMPTS", default_value_t = 3)]
    park_after_attempts: u32,
    /// WAL mode: seconds a failing event is tried again before it is parked with its key's later events
    /// (the other keys go on meanwhile only once it is).
    #[arg(long, env = "RELAY_PARK_AFTER_SECS", default_value_t = 30)]
    park_after_secs: u64,
    /// Where to serve /metrics and /healthz.
    #[arg(long, env = "RELAY_OPS_ADDR")]
    ops_addr: Option<SocketAddr>,
    /// Seconds between retention runs (0: never).
    #[arg(long, env = "RELAY_GC_INTERVAL_SECS", default_value_t = 60)]
    gc_interval_secs: u64,
    /// Where the services write the outbox: `table` (rows of saga_outbox) or `wal` (PostgreSQL's
    /// write-ahead log, read through the schema's replication slot; one relay reads it, others stand by).
    #[arg(long, env = "SAGA_OUTBOX_MODE", default_value = "table", value_parser = parse_mode)]
    mode: OutboxMode,
    /// WAL mode: the URL of the replication connection (default: --database-url); its user needs the
    /// REPLICATION attribute.
    #[arg(long, env = "SAGA_REPLICATION_URL")]
    replication_url: Option<String>,
    /// Retention settings.
    #[command(flatten)]
    retention: RetentionArgs,
}

fn parse_mode(text: &str) -> Result<OutboxMode, String> {
    OutboxMode::parse(text).map_err(|p| p.problem)
}

/// Retention settings.
#[derive(Debug, Args)]
struct RetentionArgs {
    /// Hours published outbox rows are kept.
    #[arg(long, env = "RELAY_PUBLISHED_RETENTION_HOURS", default_value_t = 168.0)]
    published_retention_hours: f64,
    /// Hours finished idempotency keys are kept.
    #[arg(long, env = "SAGA_KEY_RETENTION_HOURS", default_value_t = 168.0)]
    key_retention_hours: f64,
    /// Hours after which an abandoned two-phase lease is deleted.
    #[arg(long, env = "SAGA_ABANDONED_LEASE_HOURS", default_value_t = 24.0)]
    abandoned_lease_hours: f64,
    /// Rows per DELETE statement.
    #[arg(long, env = "RELAY_GC_BATCH_SIZE", default_value_t = 5_000)]
    gc_batch_size: u32,
}

impl RetentionArgs {
    fn policy(&self) -> Result<RetentionPolicy, ConfigProblem> {
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
            finished_keys: hours(self.key_retention_hours, "SAGA_KEY_RETENTION_HOURS")?,
            abandoned_leases: hours(self.abandoned_lease_hours, "SAGA_ABANDONED_LEASE_HOURS")?,
            batch_size: self.gc_batch_size,
        })
    }
}

impl Cli {
    /// Connects to the database, in the chosen schema. A missing, bad or unreachable `DATABASE_URL` is a
    /// [`ConfigProblem`].
    async fn pool(&self, max_connections: u32) -> Result<PgPool, ConfigProblem> {
        let url = required_postgres_url("DATABASE_URL", self.database_url.as_deref())?;
        connect_postgres("DATABASE_URL", url, self.schema.as_deref(), max_connections).await
    }

    /// Connects, and checks that the schema holds the outbox (a [`ConfigProblem`] naming `SAGA_SCHEMA`
    /// otherwise).
    async fn outbox_pool(&self, max_connections: u32) -> Result<PgPool, ConfigProblem> {
        let pool = self.pool(max_connections).await?;
        require_tables(
            &pool,
            SCHEMA_VAR,
            &["saga_outbox", "saga_idempotency_keys"],
            "run `outbox-relay migrate`",
        )
        .await?;
        Ok(pool)
    }

    /// Runs the chosen subcommand.
    async fn execute(self) -> anyhow::Result<()> {
        match &self.command {
            Command::Migrate => {
                let pool = self.pool(1).await?;
                require_schema(&pool, SCHEMA_VAR, "create it first").await?;
                saga_runtime::store::migrate::migrate(&pool)
                    .await
                    .context("applying migrations")?;
                println!("migrations applied");
            }
            Command::Status => {
                let pool = self.outbox_pool(1).await?;
                let b = backlog(&pool).await.context("reading the outbox")?;
                println!("unpublished rows:        {}", b.unpublished);
                println!(
                    "oldest unpublished row:  {}",
                    b.oldest_age.map_or_else(
                        || "-".to_owned(),
                        |a| format!("{:.1} s old", a.as_secs_f64())
                    )
                );
                println!("failing rows:            {}", b.failing);
                println!("parked rows:             {}", b.parked);
                println!("published rows kept:     {}", b.published_kept);
                if let Some(w) = &b.wal {
                    println!(
                        "WAL slot:                {} ({}, log {})",
                        w.slot,
                        if w.reading {
                            "read by a relay"
                        } else {
                            "NOT READ: no relay runs"
                        },
                        w.wal_status.as_deref().unwrap_or("-")
                    );
                    println!(
                        "WAL lag:                 {} bytes, {}",
                        w.lag_bytes,
                        w.lag.map_or_else(
                            || "caught up".to_owned(),
                            |l| format!("{:.1} s behind", l.as_secs_f64())
                        )
                    );
                    println!("WAL events parked:       {}", w.parked);
                }
            }
            Command::Gc(args) => {
                let policy = args.policy()?;
                let pool = self.outbox_pool(1).await?;
                let report = run_retention(&pool, &policy).await?;
                println!(
                    "deleted {} published outbox rows ({} statements), {} finished keys, {} abandoned leases",
                    report.outbox_deleted,
                    report.outbox_batches,
                    report.finished_keys_deleted,
                    report.abandoned_leases_deleted
                );
            }
            Command::Run(args) => self.run(args).await?,
        }
        Ok(())
    }

    async fn run(&self, args: &RunArgs) -> anyhow::Result<()> {
        let policy = args.retention.policy()?;
        let kafka = KafkaConfig::with_env_properties(args.brokers.clone())?;
        let pool = self.outbox_pool(4).await?;
        probe(&kafka, "KAFKA_BROKERS").await?;
        let mut relay = Relay::builder()
            .kafka(kafka)
            .pool(pool)
            .batch_size(args.batch_size.max(1))
            .poll_interval(Duration::from_millis(args.poll_interval_ms.max(1)))
            .linger(Duration::from_millis(args.linger_ms))
            .park_after(args.park_after_attempts.max(1))
            .park_after_time(Duration::from_secs(args.park_after_secs))
            .after_publish(if args.delete_published {
                AfterPublish::Delete
            } else {
                AfterPublish::Mark
            })
            .retention(policy, Duration::from_secs(args.gc_interval_secs))
            .mode(args.mode);
        if let Some(url) = args
            .replication_url
            .clone()
            .or_else(|| self.database_url.clone())
        {
            relay = relay.replication_url(url);
        }
        if let Some(addr) = args.ops_addr {
            relay = relay.ops_addr(addr);
        }
        relay
            .build()?
            .run(saga_runtime::shutdown::wait_for_signal())
            .await?;
        Ok(())
    }
}
