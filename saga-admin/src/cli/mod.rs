//! The `saga` command line: the arguments and their dispatch here, a module per subcommand beside it
//! (as cargo's `commands/`).

mod audit;
mod dlq;
mod inspect;
mod keys;
mod lag;
mod outbox;
#[cfg(feature = "redis")]
mod redis;
mod sagas;
mod steps;
mod trace;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use saga_consumer::ConfigProblem;
use saga_consumer::KafkaConfig;
#[cfg(feature = "redis")]
use saga_consumer::settings::RedisArgs;
use saga_consumer::settings::{DatabaseArgs, KafkaArgs, SchemaArgs};
use saga_runtime::cli::printable;
use saga_runtime::cli::printable_json;
use saga_runtime::config::connect_postgres;
use saga_runtime::config::required_postgres_url;
use serde::Serialize;
use sqlx::PgPool;

use self::dlq::DlqCommand;
use self::inspect::InspectArgs;
use self::keys::KeysCommand;
use self::outbox::OutboxCommand;
use self::sagas::SagasCommand;
use self::steps::StepsCommand;
use crate::AdminError;
use crate::audit::{Actor, Via};

/// The `saga` binary: parses the command line (see `saga --help`), runs the command, and answers bad input
/// or configuration with one line and exit code 2.
pub async fn main() -> ExitCode {
    let _tracing = saga_runtime::telemetry::init_tracing();
    // The inspector's tokens are read from the environment only: on the command line, other users of the
    // machine could read them.
    if token_on_command_line(std::env::args_os().skip(1)) {
        return saga_runtime::cli::exit_code(Err(ConfigProblem::new(
            "SAGA_ADMIN_TOKENS",
            "the inspector's tokens are not taken on the command line, where other users of the machine \
             could read them",
            "set SAGA_ADMIN_TOKEN or SAGA_ADMIN_TOKENS in the environment instead",
        )
        .into()));
    }
    let cli: Cli = saga_runtime::cli::parse();
    saga_runtime::cli::exit_code(cli.run().await)
}

/// Whether `args` (the command line after the program's name) give the inspector's tokens as flags
/// (`--admin-token`, `--admin-tokens`, alone or with `=value`), before a bare `--` ends the flags.
fn token_on_command_line(args: impl IntoIterator<Item = std::ffi::OsString>) -> bool {
    args.into_iter()
        .map(|a| a.to_string_lossy().into_owned())
        .take_while(|a| a != "--")
        .any(|a| {
            let flag = a.split_once('=').map_or(a.as_str(), |(flag, _)| flag);
            flag == "--admin-token" || flag == "--admin-tokens"
        })
}

/// See and repair sagas: dead letters, step keys, leases, saga instances, consumer lag, the outbox.
#[derive(Debug, Parser)]
#[command(name = "saga", version)]
struct Cli {
    #[command(flatten)]
    database: DatabaseArgs,
    #[command(flatten)]
    schema: SchemaArgs,
    #[command(flatten)]
    kafka: KafkaArgs,
    /// Print JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
    /// Where the dead-letter index cannot be brought up to date (the broker unreachable or refusing, a
    /// database user that may not write it), read it as it is, with a warning that says how stale it is,
    /// instead of failing.
    #[arg(long, global = true)]
    as_indexed: bool,
    /// What to do.
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Dead letters: list, show, replay, and the replays made.
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// Step keys, and keys held behind a dead letter or a paused step.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Pause and resume a step: its messages wait, parked in order per key, while the group's other steps
    /// go on.
    #[command(subcommand)]
    Steps(StepsCommand),
    /// Two-phase leases (`--expired`: external calls that never completed).
    Leases {
        /// Only leases that ran out.
        #[arg(long)]
        expired: bool,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Orchestrated saga instances.
    #[command(subcommand)]
    Sagas(SagasCommand),
    /// A consumer group's committed offset, high watermark and lag per partition.
    Lag {
        /// The consumer group.
        #[arg(long)]
        group: String,
        /// Its topics (default: those the schema records for the group).
        #[arg(long = "topic")]
        topics: Vec<String>,
    },
    /// The outbox.
    #[command(subcommand)]
    Outbox(OutboxCommand),
    /// The Redis fast path's keys.
    #[cfg(feature = "redis")]
    #[command(subcommand)]
    Redis(RedisCommand),
    /// One saga across every service schema of the database: its step keys, the events they wrote (with
    /// where the broker put them), its dead letters and replays, its orchestrated transitions, by time.
    Trace {
        /// The client's idempotency key.
        key: String,
        /// Only this tenant's.
        #[arg(long)]
        tenant: Option<String>,
        /// Only these service schemas (default: every schema with saga keys).
        #[arg(long = "in-schema")]
        schemas: Vec<String>,
    },
    /// The audit log: every state-changing action of the command and the page (who, why, when, what it
    /// touched, its outcome), newest first.
    Audit {
        /// Only this operator's.
        #[arg(long)]
        operator: Option<String>,
        /// Only this action's (`dlq replay`, `keys release`, `outbox retry`, ...).
        #[arg(long)]
        action: Option<String>,
        /// Only those within this long (90s, 15m, 2h, 7d).
        #[arg(long)]
        since: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Serve the inspector page.
    Inspect(InspectArgs),
}

/// The `saga` command, for the configuration page.
#[doc(hidden)]
pub fn command() -> clap::Command {
    <Cli as clap::CommandFactory>::command()
}

/// Who acts and why, recorded in the audit log (`saga audit`) and with what the action writes.
#[derive(Debug, Args)]
struct ActorArgs {
    /// Who acts (default: the OS user).
    #[arg(long)]
    operator: Option<String>,
    /// Why (recorded in the audit log).
    #[arg(long = "reason", id = "why", value_name = "REASON")]
    reason: Option<String>,
}

impl ActorArgs {
    /// The actor these name: the operator named or the OS user, through the command.
    fn actor(&self) -> Result<Actor, AdminError> {
        Actor::new(
            operator_or_os_user(self.operator.as_ref()),
            self.reason.as_deref(),
            Via::Command,
        )
    }
}

#[derive(Debug, Subcommand)]
#[cfg(feature = "redis")]
enum RedisCommand {
    /// Delete every key of the fast path's namespace. Run it after the service's database was restored to
    /// an earlier point (Redis may remember completions the restored database lost), with the services
    /// stopped; or give the services a new REDIS_NAMESPACE instead.
    Forget {
        /// The Redis URL and the namespace (default: the one the schema's services use without
        /// REDIS_NAMESPACE).
        #[command(flatten)]
        redis: RedisArgs,
        #[command(flatten)]
        by: ActorArgs,
    },
}

impl Cli {
    /// The broker, checked: an unreachable broker, or one that refuses the client (credentials, certificate,
    /// protocol), is a [`ConfigProblem`] naming the setting, never an empty answer.
    async fn kafka(&self) -> Result<KafkaConfig, ConfigProblem> {
        let kafka = self.kafka.config()?;
        saga_consumer::setup::probe_broker(&kafka).await?;
        Ok(kafka)
    }

    async fn pool(&self) -> Result<PgPool, ConfigProblem> {
        let url = required_postgres_url("DATABASE_URL", self.database.database_url.as_deref())?;
        let pool = connect_postgres("DATABASE_URL", url, self.schema.schema.as_deref(), 4).await?;
        saga_runtime::config::require_schema(&pool, "SAGA_SCHEMA", "name the service's schema")
            .await?;
        Ok(pool)
    }

    /// Runs the command; with `--as-indexed`, a stale index is read as it is and said on standard error.
    async fn run(self) -> anyhow::Result<()> {
        // Boxed: the command's future is as large as its largest subcommand's.
        let execute = Box::pin(self.execute());
        if !self.as_indexed {
            return execute.await;
        }
        let (done, stale) = crate::freshness::as_indexed(execute).await;
        for s in &stale {
            eprintln!("warning: {}", printable(&s.to_string(), false));
        }
        done
    }

    async fn execute(&self) -> anyhow::Result<()> {
        match &self.command {
            Command::Keys(command) => self.keys(command).await,
            Command::Steps(command) => self.steps(command).await,
            Command::Sagas(command) => self.sagas(command).await,
            Command::Dlq(command) => Box::pin(self.dlq(command)).await,
            Command::Outbox(command) => self.outbox(command).await,
            Command::Trace {
                key,
                tenant,
                schemas,
            } => self.trace(key, tenant.as_deref(), schemas).await,
            Command::Leases { expired, limit } => self.leases(*expired, *limit).await,
            Command::Lag { group, topics } => self.lag(group, topics).await,
            #[cfg(feature = "redis")]
            Command::Redis(RedisCommand::Forget { redis, by }) => {
                self.redis_forget(redis, by).await
            }
            Command::Audit {
                operator,
                action,
                since,
                limit,
            } => self.audit(operator, action, since.as_deref(), *limit).await,
            Command::Inspect(args) => self.inspect(args).await,
        }
    }

    /// Prints `value` as JSON with `--json`, else the text `human` renders.
    fn print<T: Serialize>(&self, value: &T, human: impl FnOnce() -> String) -> anyhow::Result<()> {
        // What is printed may quote messages (keys, headers, payloads): escaped so that it cannot drive
        // the terminal.
        if self.json {
            println!("{}", printable_json(&serde_json::to_string_pretty(value)?));
        } else {
            println!("{}", printable(human().trim_end(), true));
        }
        Ok(())
    }
}

/// The operator named on the command line, or the OS user.
fn operator_or_os_user(named: Option<&String>) -> String {
    named
        .filter(|o| !o.trim().is_empty())
        .cloned()
        .unwrap_or_else(crate::dlq::os_user)
}

/// Asks `question` (unless `yes`); not confirmed is bad input: nothing was done.
fn confirmed(question: &str, yes: bool) -> Result<(), AdminError> {
    if confirm(question, yes)? {
        Ok(())
    } else {
        Err(AdminError::bad_input("not confirmed: nothing done"))
    }
}

/// Asks `question` on the terminal; `yes` answers it. Bad input without a terminal to ask on.
fn confirm(question: &str, yes: bool) -> Result<bool, crate::AdminError> {
    use std::io::{BufRead, IsTerminal, Write};
    if yes {
        return Ok(true);
    }
    if !std::io::stdin().is_terminal() {
        return Err(crate::AdminError::bad_input(format!(
            "not confirmed ({question}): add --yes to do it without a terminal"
        )));
    }
    eprint!("{}? [y/N] ", printable(question, false));
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut answer)
        .map_err(|e| crate::AdminError::bad_input(format!("reading the answer: {e}")))?;
    Ok(matches!(
        answer.trim().to_ascii_lowercase().as_str(),
        "y" | "yes"
    ))
}

#[cfg(test)]
mod tests {
    use super::token_on_command_line;

    fn args(list: &[&str]) -> Vec<std::ffi::OsString> {
        list.iter().map(Into::into).collect()
    }

    #[test]
    fn only_the_token_flags_themselves_are_refused() {
        for refused in [
            &["inspect", "--admin-token", "t"][..],
            &["inspect", "--admin-token=t"],
            &["inspect", "--admin-tokens=a,b"],
        ] {
            assert!(token_on_command_line(args(refused)), "{refused:?}");
        }
        for allowed in [
            &["dlq", "list", "--admin-token-like"][..],
            &["keys", "show", "--", "--admin-token"],
            &["keys", "show", "order-1:--admin-token"],
        ] {
            assert!(!token_on_command_line(args(allowed)), "{allowed:?}");
        }
    }
}
