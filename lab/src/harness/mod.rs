//! Running the saga with real processes, for the demo and the chaos program: the broker, the supervised
//! service processes, the client, fault injection, and the ledger checks at the end.

pub mod broker;
pub mod client;
pub mod held;
pub mod ledger;
pub mod local;
pub mod processes;
pub mod run;
pub mod summary;

use saga_examples::service::quote_ident;
use sqlx::PgPool;

/// Drops a service's schema and, first, its WAL outbox's replication slot (a slot left behind keeps the
/// server's write-ahead log from being recycled). The slot's relay must have stopped.
pub async fn drop_schema(pool: &PgPool, schema: &str) -> Result<(), sqlx::Error> {
    let mut conn = pool.acquire().await?;
    saga_runtime::store::wal::drop_slot(&mut conn, schema).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {} CASCADE",
        quote_ident(schema)
    )))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

use clap::{Args, Subcommand};

use saga_examples::service::{Service, ServiceArgs};

/// The hidden subcommand with which a harness binary runs one of the services as its own child process.
#[derive(Debug, Subcommand)]
pub enum ChildCommand {
    /// Run one service (used by the harness for its child processes).
    #[command(hide = true)]
    Service(ServiceCommand),
    /// Run the outbox relay of one service's schema (used by the harness for its child processes).
    #[command(hide = true)]
    Relay(ServiceCommand),
}

impl ChildCommand {
    /// Runs the child until SIGTERM, or until the harness that started it is gone.
    pub async fn run(self) -> anyhow::Result<()> {
        let _tracing = saga_runtime::telemetry::init_tracing();
        let shutdown = saga_runtime::shutdown::on_signal();
        stop_when_orphaned(shutdown.clone());
        match self {
            Self::Service(c) => {
                saga_examples::service::run(c.service, c.args, shutdown.cancelled_owned()).await
            }
            Self::Relay(c) => {
                saga_examples::service::run_relay(c.service, c.args, shutdown.cancelled_owned())
                    .await
            }
        }
    }
}

/// The options `saga-demo` and `chaos` share.
#[derive(Debug, Args)]
pub struct RunFlags {
    /// Run the orchestrated saga (the order service orchestrates with commands and replies) instead of
    /// the choreographed one.
    #[arg(long)]
    pub orchestrated: bool,
    /// Keep the run's schemas for inspection.
    #[arg(long)]
    pub keep: bool,
    /// Where the services write their outbox: table (rows) or wal (PostgreSQL's write-ahead log, read
    /// through each schema's replication slot; needs wal_level = logical).
    #[arg(long, default_value = "table", value_parser = parse_outbox_mode)]
    pub outbox: saga_consumer::OutboxMode,
    /// PostgreSQL URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/saga_demo"
    )]
    pub database_url: String,
}

fn parse_outbox_mode(text: &str) -> Result<saga_consumer::OutboxMode, String> {
    saga_consumer::OutboxMode::parse(text).map_err(|p| p.problem)
}

/// A name for one run (its schemas, topics and groups): `{prefix}-{milliseconds since the epoch, in hex}`.
pub fn run_name(prefix: &str) -> String {
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    format!("{prefix}-{millis:x}")
}

/// Which service, with its settings.
#[derive(Debug, Args)]
pub struct ServiceCommand {
    /// The service.
    #[arg(value_enum)]
    pub service: Service,
    /// Its settings.
    #[command(flatten)]
    pub args: ServiceArgs,
}

/// Stops a child whose harness died without stopping it (killed by a test runner's timeout, say): an
/// orphaned service would otherwise keep its port and its consumer group, and serve whoever comes next.
fn stop_when_orphaned(shutdown: tokio_util::sync::CancellationToken) {
    #[cfg(unix)]
    tokio::spawn(async move {
        let parent = std::os::unix::process::parent_id();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(std::time::Duration::from_millis(500)) => {}
            }
            if std::os::unix::process::parent_id() != parent {
                tracing::warn!("the harness that started this service is gone; stopping");
                shutdown.cancel();
                return;
            }
        }
    });
}
