//! Running the saga with real processes, for the demo and the chaos program: the broker, the supervised
//! service processes, the client, fault injection, and the ledger checks at the end.

pub mod broker;
pub mod client;
pub mod duplicator;
pub mod ledger;
pub mod processes;
pub mod run;
pub mod summary;

use clap::{Args, Subcommand};

use crate::service::{Service, ServiceArgs};

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
        saga_runtime::telemetry::init_tracing();
        let shutdown = saga_runtime::shutdown::on_signal();
        stop_when_orphaned(shutdown.clone());
        match self {
            Self::Service(c) => crate::service::run(c.service, c.args, shutdown).await,
            Self::Relay(c) => crate::service::run_relay(c.service, c.args, shutdown).await,
        }
    }
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
