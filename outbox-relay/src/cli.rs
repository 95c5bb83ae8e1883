//! The `outbox-relay` command line: `run`, `gc`, `migrate`, `status`.

use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use saga_runtime::config::{
    ConfigProblem, connect_postgres, require_schema, require_tables, required_postgres_url,
};
use sqlx::PgPool;

use crate::gc::run_retention;
use crate::relay::Relay;
use crate::settings::{DatabaseArgs, KafkaArgs, OutboxArgs, RelayArgs, RetentionArgs, SchemaArgs};
use crate::store::backlog;

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
    #[command(flatten)]
    database: DatabaseArgs,
    #[command(flatten)]
    schema: SchemaArgs,
    /// What to do.
    #[command(subcommand)]
    command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Publish continuously (and run retention periodically) until SIGTERM or Ctrl-C.
    Run(Box<RunArgs>),
    /// Delete published rows and finished idempotency keys past their retention, once.
    Gc(RetentionArgs),
    /// Apply the framework's migrations.
    Migrate,
    /// Print the backlog: unpublished rows, the oldest one's age, failing rows.
    Status,
}

/// Options of `run`: the same groups a relay embedded in a service reads from the environment.
#[derive(Debug, Args)]
struct RunArgs {
    #[command(flatten)]
    kafka: KafkaArgs,
    #[command(flatten)]
    relay: RelayArgs,
    #[command(flatten)]
    outbox: OutboxArgs,
}

/// The `outbox-relay` command, for the configuration page.
#[doc(hidden)]
pub fn command() -> clap::Command {
    <Cli as clap::CommandFactory>::command()
}

impl Cli {
    /// Connects to the database, in the chosen schema. A missing, bad or unreachable `DATABASE_URL` is a
    /// [`ConfigProblem`].
    async fn pool(&self, max_connections: u32) -> Result<PgPool, ConfigProblem> {
        let url = required_postgres_url("DATABASE_URL", self.database.database_url.as_deref())?;
        connect_postgres(
            "DATABASE_URL",
            url,
            self.schema.schema.as_deref(),
            max_connections,
        )
        .await
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
        let kafka = args.kafka.config()?;
        // The settings' problems before any connection: none hides behind a database or broker not there.
        if let Some(problem) = ConfigProblem::all(args.relay.problems()) {
            return Err(problem.into());
        }
        let pool = self.outbox_pool(4).await?;
        // At start, a broker that refuses the client or does not answer is one line naming the setting.
        saga_runtime::kafka::probe(&kafka, "KAFKA_BROKERS").await?;
        Relay::builder()
            .args(
                &args.relay,
                &args.outbox,
                self.database.database_url.as_deref(),
            )
            .kafka(kafka)
            .pool(pool)
            .build()?
            .broker_checked()
            .run(saga_runtime::shutdown::wait_for_signal())
            .await?;
        Ok(())
    }
}
