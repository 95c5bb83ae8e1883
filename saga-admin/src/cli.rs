//! The `saga` command line.

use std::net::SocketAddr;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use saga_consumer::ConfigProblem;
use saga_consumer::KafkaConfig;
#[cfg(feature = "redis")]
use saga_consumer::settings::RedisArgs;
use saga_consumer::settings::{DatabaseArgs, KafkaArgs, SchemaArgs};
use saga_consumer::toolkit::{connect_postgres, required_postgres_url};
use saga_consumer::toolkit::{printable, printable_json};
use serde::Serialize;
use sqlx::PgPool;

use crate::AdminError;
use crate::audit::{self, Action, Actor, Via};
use crate::dlq::{self, DlqFilter, ReplayOptions};
use crate::duration;
use crate::inspect::{self, InspectOptions};
use crate::table::{Table, one_line};
use crate::{groups, holds, keys, lag, operations, outbox, sagas, trace};

/// The `saga` binary: parses the command line (see `saga --help`), runs the command, and answers bad input
/// or configuration with one line and exit code 2.
pub async fn main() -> ExitCode {
    let _tracing = saga_consumer::toolkit::init_tracing();
    // The inspector's tokens are read from the environment only: on the command line, other users of the
    // machine could read them.
    if token_on_command_line(std::env::args_os().skip(1)) {
        return saga_consumer::toolkit::exit_code(Err(ConfigProblem::new(
            "SAGA_ADMIN_TOKENS",
            "the inspector's tokens are not taken on the command line, where other users of the machine \
             could read them",
            "set SAGA_ADMIN_TOKEN or SAGA_ADMIN_TOKENS in the environment instead",
        )
        .into()));
    }
    let cli: Cli = saga_consumer::toolkit::parse();
    saga_consumer::toolkit::exit_code(cli.run().await)
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

/// Serve the inspector page (`saga inspect`).
#[derive(Debug, Args)]
struct InspectArgs {
    /// Where to listen (localhost by default). Anywhere else needs a token (SAGA_ADMIN_TOKEN, or
    /// SAGA_ADMIN_TOKENS=name:token,…), or --insecure-no-token.
    #[arg(long, default_value = "127.0.0.1:8081")]
    listen: SocketAddr,
    /// A name besides the listening address and localhost that requests may give as Host (the name a
    /// proxy in front serves the page under); repeatable. Needs a token (or --insecure-no-token): the
    /// page is served to others.
    #[arg(long = "public-name")]
    public_names: Vec<String>,
    /// No replay buttons; every POST refused.
    #[arg(long)]
    read_only: bool,
    /// Mark cookies Secure: the page is served over TLS by a proxy in front.
    #[arg(long)]
    secure_cookies: bool,
    /// Listen beyond localhost, or serve under a --public-name, without a token: anyone who reaches the
    /// page may replay dead letters.
    #[arg(long)]
    insecure_no_token: bool,
    /// Dead-letter topics to show (default: the broker's topics ending in `.dlq`).
    #[arg(long = "dlq-topic")]
    dlq_topics: Vec<String>,
    /// Consumer groups to show the lag of (default: those the schema records).
    #[arg(long = "group")]
    groups: Vec<String>,
    /// Unfinished sagas unmoved for this long count as stuck.
    #[arg(long, default_value = "5m")]
    stuck_for: String,
    #[command(flatten)]
    tokens: TokenArgs,
}

/// Replay dead letters (`saga dlq replay`).
#[derive(Debug, Args)]
struct ReplayArgs {
    #[command(flatten)]
    select: Select,
    /// Only the dead letter at this partition (with --offset).
    #[arg(long, requires = "offset", conflicts_with = "group")]
    partition: Option<i32>,
    /// Only the dead letter at this offset (with --partition).
    #[arg(long, requires = "partition")]
    offset: Option<i64>,
    /// Say what would be sent; send nothing.
    #[arg(long)]
    dry_run: bool,
    /// Send again what was replayed already, and messages replayed --max-replays times.
    #[arg(long)]
    force: bool,
    /// Refuse a message replayed this many times already (unless --force).
    #[arg(long, default_value_t = 3)]
    max_replays: u32,
    #[command(flatten)]
    by: ActorArgs,
    /// With --group: do it without asking.
    #[arg(long, requires = "group")]
    yes: bool,
}

/// The inspector's tokens: read from the environment (kept off the command line, where other users of the
/// machine could read them).
#[derive(Debug, Args)]
#[group(id = "saga_admin_tokens")]
struct TokenArgs {
    /// A token every request of the page and its API must present (named `admin`); required to listen
    /// beyond localhost (or SAGA_ADMIN_TOKENS).
    #[arg(
        long = "admin-token",
        env = "SAGA_ADMIN_TOKEN",
        hide = true,
        hide_env_values = true
    )]
    token: Option<String>,
    /// Named tokens, `name:token,…`: the name is recorded as the operator of what its holder does.
    #[arg(
        long = "admin-tokens",
        env = "SAGA_ADMIN_TOKENS",
        hide = true,
        hide_env_values = true
    )]
    tokens: Option<String>,
}

/// The `saga` command, for the configuration page.
#[doc(hidden)]
pub fn command() -> clap::Command {
    <Cli as clap::CommandFactory>::command()
}

#[derive(Debug, Subcommand)]
enum DlqCommand {
    /// List the dead letters of a topic.
    List {
        #[command(flatten)]
        select: Select,
    },
    /// Show one message: every header and the payload.
    Show {
        /// The dead-letter topic.
        #[arg(long)]
        topic: String,
        /// Its partition.
        #[arg(long)]
        partition: i32,
        /// Its offset.
        #[arg(long)]
        offset: i64,
    },
    /// Replay dead letters, once each, to the retry topic of the consumer group that gave up on them.
    Replay(ReplayArgs),
    /// Failure groups: dead letters grouped by a fingerprint of their cause (step, reason, and the error's
    /// first line with numbers, ids and quoted values normalised), the most open letters first.
    Groups {
        /// Only these dead-letter topics (default: every one the schema's consumer groups record).
        #[arg(long = "topic", conflicts_with = "all")]
        topics: Vec<String>,
        /// Every dead-letter topic the schema's consumer groups record (the default).
        #[arg(long)]
        all: bool,
    },
    /// Discard the open dead letters of a failure group: resolved without sending, recorded, reversible
    /// (--undo). Shows what it would do and asks first (--yes for scripts).
    Discard {
        /// The failure group (see `saga dlq groups`).
        #[arg(long, required_unless_present = "undo", conflicts_with = "undo")]
        group: Option<String>,
        /// Make the letters of discard operation N open again.
        #[arg(long, value_name = "OPERATION")]
        undo: Option<i64>,
        /// The dead-letter topics to look in (default: every one the schema's consumer groups record).
        #[arg(long = "topic")]
        topics: Vec<String>,
        /// Show what would be done; do nothing.
        #[arg(long)]
        dry_run: bool,
        /// Do it without asking.
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        by: ActorArgs,
    },
    /// Bulk operations (group replays, discards, undos): list them, show one, cancel or resume one.
    Operations {
        #[command(subcommand)]
        command: Option<OperationsCommand>,
        /// At most this many, newest first (listing).
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// The replays recorded in the schema, newest first: who sent which letter where, and when.
    Replays {
        /// Only those of this dead-letter topic.
        #[arg(long)]
        topic: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
}

/// What to do with a bulk operation.
#[derive(Debug, Subcommand)]
enum OperationsCommand {
    /// One operation and what it did with each letter.
    Show {
        /// The operation.
        id: i64,
    },
    /// Ask a running operation to stop before its next letter.
    Cancel {
        /// The operation.
        id: i64,
        #[command(flatten)]
        by: ActorArgs,
    },
    /// Go on with an operation whose run stopped (the process died): the letters not done yet, none twice.
    Resume {
        /// The operation.
        id: i64,
        #[command(flatten)]
        by: ActorArgs,
    },
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

/// Which dead letters.
#[derive(Debug, Args)]
struct Select {
    /// The dead-letter topic (optional with --group: default, every one the schema's consumer groups
    /// record).
    #[arg(long, required_unless_present = "group")]
    topic: Option<String>,
    /// Only the letters of this failure group (see `saga dlq groups`); a replay of a group runs as a
    /// recorded operation, after showing what it would do and asking.
    #[arg(long, conflicts_with_all = ["reason", "step", "since", "limit"])]
    group: Option<String>,
    /// Only letters of this reason (undecodable, unknown-event-type, handler-failed, retries-exhausted,
    /// crash-loop).
    #[arg(long = "letter-reason")]
    reason: Option<String>,
    /// Only this step.
    #[arg(long)]
    step: Option<String>,
    /// Only those dead-lettered within this long (90s, 15m, 2h, 7d).
    #[arg(long)]
    since: Option<String>,
    /// At most this many (the oldest first).
    #[arg(long)]
    limit: Option<usize>,
}

impl Select {
    /// The letters selected, in a line (for the audit log).
    fn describe(&self, position: Option<(i32, i64)>) -> String {
        let mut said = Vec::new();
        if let Some((partition, offset)) = position {
            said.push(format!("at {partition}/{offset}"));
        }
        for (name, value) in [
            ("reason", &self.reason),
            ("step", &self.step),
            ("since", &self.since),
        ] {
            if let Some(value) = value {
                said.push(format!("{name} {value}"));
            }
        }
        if let Some(limit) = self.limit {
            said.push(format!("at most {limit}"));
        }
        if said.is_empty() {
            "every open letter".to_owned()
        } else {
            said.join(", ")
        }
    }

    fn filter(&self) -> Result<DlqFilter, crate::AdminError> {
        let mut filter = DlqFilter::default();
        filter.reason.clone_from(&self.reason);
        filter.step.clone_from(&self.step);
        filter.since = self.since.as_deref().map(duration::parse).transpose()?;
        filter.limit = self.limit;
        Ok(filter)
    }
}

#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// Every step key derived from a client's key (status, attempts, lease, outcome), the HTTP key too.
    Show {
        /// The client's idempotency key.
        key: String,
        /// Only this tenant's.
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Keys held for a consumer group (a dead letter at their head, or a paused step), oldest first: their
    /// state, what holds them, the messages parked behind them, and for how long.
    Held {
        /// Only this consumer group's.
        #[arg(long)]
        group: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Release a held key by hand: its parked messages run in order, as if its head letter had been
    /// discarded (the letter stays in its topic). For a key whose head cannot be replayed or discarded.
    #[command(group(clap::ArgGroup::new("which").required(true).args(["key", "key_hex"])))]
    Release {
        /// The key, as plain text (its UTF-8 bytes).
        key: Option<String>,
        /// The key's exact bytes in hexadecimal, as `saga keys held --json` gives them (`key_hex`): for a
        /// key that is not plain text (a zero byte, bytes that are not UTF-8).
        #[arg(long = "key-hex", value_parser = parse_key_hex)]
        key_hex: Option<KeyHex>,
        /// The consumer group that holds it.
        #[arg(long)]
        group: String,
        #[command(flatten)]
        by: ActorArgs,
    },
}

#[derive(Debug, Subcommand)]
enum StepsCommand {
    /// Pause a step of a consumer group: three seconds later, each message of the step is parked,
    /// holding its key (the key's later messages park behind it), until `saga steps resume`.
    Pause {
        /// The step.
        step: String,
        /// The consumer group.
        #[arg(long)]
        group: String,
        /// Why (recorded, and shown with the pause).
        #[arg(long)]
        reason: String,
        /// Who pauses (default: the OS user).
        #[arg(long)]
        operator: Option<String>,
    },
    /// Resume a paused step: the keys its messages held are released, their parked messages run in order.
    Resume {
        /// The step.
        step: String,
        /// The consumer group.
        #[arg(long)]
        group: String,
        /// Why (recorded).
        #[arg(long, default_value = "resumed")]
        reason: String,
        /// Who resumes (default: the OS user).
        #[arg(long)]
        operator: Option<String>,
    },
    /// The paused steps, who paused them, why, and the keys they hold.
    Paused {
        /// Only this consumer group's.
        #[arg(long)]
        group: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
enum SagasCommand {
    /// List saga instances.
    List {
        /// Only in this status (running, compensating, completed, compensated).
        #[arg(long)]
        status: Option<String>,
        /// Only stuck ones: marked stuck (their timer found no move), or unfinished and unmoved for 5
        /// minutes (or --stuck-for).
        #[arg(long)]
        stuck: bool,
        /// Only stuck ones, counting those unmoved for this long (90s, 15m, 2h).
        #[arg(long)]
        stuck_for: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// One saga: its state, its keys and its transitions as a timeline.
    Show {
        /// The saga's id.
        id: String,
    },
    /// Send a running or compensating saga's current command again (the same step key), instead of waiting
    /// for its timeout to compensate it: the service's orchestrator sends it at its next timer tick and
    /// records a `retry` transition naming you and the attempt it retries.
    Retry {
        /// The saga's id.
        id: String,
        #[command(flatten)]
        by: ActorArgs,
    },
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

#[derive(Debug, Subcommand)]
enum OutboxCommand {
    /// The relay's backlog: unpublished, failing and parked rows, the oldest one's age.
    Status,
    /// Parked events: those the relay could not publish, and their keys' later events waiting behind them,
    /// of the WAL outbox and of the table outbox (each numbers its own: `outbox` says whose id), oldest
    /// first.
    Parked {
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Publish parked events again at the relay's next round (after fixing the cause): event ID's key, in
    /// order, or every parked key. Asks first.
    Retry {
        /// The parked event whose key to retry (of either outbox: see `saga outbox parked`).
        #[arg(long, required_unless_present = "all", conflicts_with = "all")]
        id: Option<i64>,
        /// The outbox whose event ID is, where both have one of that id (wal or table).
        #[arg(long, requires = "id")]
        outbox: Option<outbox::ParkedIn>,
        /// Every parked key.
        #[arg(long)]
        all: bool,
        /// Do it without asking.
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        by: ActorArgs,
    },
    /// Discard a parked event of the WAL outbox: it is never published, and its key's later events go on.
    /// Asks first. (A parked row of the table outbox is retried, never discarded.)
    Discard {
        /// The parked event.
        #[arg(long)]
        id: i64,
        /// The outbox whose event ID is, where both have one of that id (only wal events are discarded).
        #[arg(long)]
        outbox: Option<outbox::ParkedIn>,
        /// Do it without asking.
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        by: ActorArgs,
    },
    /// The WAL outbox's replication slot.
    #[command(subcommand)]
    Wal(WalCommand),
}

#[derive(Debug, Subcommand)]
enum WalCommand {
    /// After the slot was lost or gone (its writers stopped, services refuse to start): make a new one, and
    /// record and print what was lost and how to re-drive it. Asks first.
    Recover {
        /// Do it without asking.
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        by: ActorArgs,
    },
    /// The recorded losses of the slot; with --keys, the step keys completed in one's window (their
    /// follow-up events may never have been published).
    Incidents {
        /// The incident whose step keys to list.
        #[arg(long, value_name = "INCIDENT")]
        keys: Option<i64>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Take the WAL outbox down, to go back to the table: drop its slot and forget it. Refused while a relay
    /// reads it or it holds unpublished events. Asks first.
    Retire {
        /// Drop it even though it holds unpublished events (they are lost).
        #[arg(long)]
        force: bool,
        /// Do it without asking.
        #[arg(long)]
        yes: bool,
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
        saga_consumer::toolkit::require_schema(&pool, "SAGA_SCHEMA", "name the service's schema")
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
            Command::Leases { expired, limit } => {
                let pool = self.pool().await?;
                let found = keys::leases(&pool, *expired, *limit).await?;
                self.print(&found, || keys_table(&found))
            }
            Command::Lag { group, topics } => {
                let kafka = self.kafka().await?;
                let topics = if topics.is_empty() {
                    lag::known_topics(&self.pool().await?, group).await?
                } else {
                    topics.clone()
                };
                let found = lag::lag(&kafka, group, &topics).await?;
                self.print(&found, || {
                    let mut t =
                        Table::new(["topic", "partition", "committed", "high watermark", "lag"]);
                    for l in &found {
                        t.row([
                            l.topic.clone(),
                            l.partition.to_string(),
                            l.committed
                                .map_or_else(|| "-".to_owned(), |c| c.to_string()),
                            l.high_watermark.to_string(),
                            l.lag.to_string(),
                        ]);
                    }
                    format!(
                        "{}total lag {}",
                        t.render(),
                        found.iter().map(|l| l.lag).sum::<i64>()
                    )
                })
            }
            #[cfg(feature = "redis")]
            Command::Redis(RedisCommand::Forget { redis, by }) => {
                let actor = by.actor()?;
                // Recorded in the audit log of the schema whose services use the namespace.
                let pool = self.pool().await?;
                let (redis_url, namespace) = (&redis.redis_url, &redis.namespace);
                let url = redis_url
                    .as_deref()
                    .filter(|u| !u.is_empty())
                    .ok_or_else(|| {
                        ConfigProblem::new(
                            "REDIS_URL",
                            "is not set",
                            "set it to redis://HOST:PORT/DB",
                        )
                    })?;
                let mut settings = saga_consumer::fast_path::FastPathSettings::new(url);
                settings.namespace = namespace.clone().filter(|n| !n.is_empty());
                let fast = match &settings.namespace {
                    Some(n) => {
                        saga_consumer::fast_path::FastPath::with_namespace(settings.clone(), n)?
                    }
                    None => saga_consumer::fast_path::FastPath::new(settings, &pool).await?,
                };
                let action = Action::new("redis forget").on("namespace", fast.namespace());
                let work = async {
                    fast.forget_namespace().await.map_err(|e| {
                        AdminError::Store(format!("deleting the keys of {}: {e}", fast.namespace()))
                    })
                };
                let deleted =
                    audit::audited(&pool, &actor, action, work, |n| format!("deleted {n} keys"))
                        .await?;
                let report =
                    serde_json::json!({ "namespace": fast.namespace(), "deleted": deleted });
                self.print(&report, || {
                    format!("deleted {deleted} keys of namespace {}", fast.namespace())
                })
            }
            Command::Audit {
                operator,
                action,
                since,
                limit,
            } => {
                let mut filter = audit::AuditFilter::default();
                filter.operator.clone_from(operator);
                filter.action.clone_from(action);
                filter.since = since.as_deref().map(duration::parse).transpose()?;
                filter.limit = *limit;
                let found = audit::list(&self.pool().await?, &filter).await?;
                self.print(&found, || {
                    let mut t = Table::new([
                        "#", "at", "operator", "via", "action", "target", "outcome", "reason",
                        "detail",
                    ]);
                    for e in &found {
                        t.row([
                            e.id.to_string(),
                            e.at.format("%Y-%m-%d %H:%M:%S").to_string(),
                            e.operator.clone(),
                            e.via.clone(),
                            e.action.clone(),
                            e.target_text(),
                            e.outcome.clone(),
                            e.reason.clone().unwrap_or_default(),
                            e.detail.clone().unwrap_or_default(),
                        ]);
                    }
                    format!("{}{} actions", t.render(), found.len())
                })
            }
            Command::Inspect(args) => self.inspect(args).await,
        }
    }

    /// `saga dlq …`.
    async fn dlq(&self, command: &DlqCommand) -> anyhow::Result<()> {
        match command {
            DlqCommand::List { select } => {
                if let Some(group) = &select.group {
                    return self.group_letters(select.topic.as_deref(), group).await;
                }
                let topic = select.topic.as_deref().unwrap_or_default();
                let kafka = self.kafka().await?;
                let letters =
                    dlq::list(&kafka, &self.pool().await?, topic, &select.filter()?).await?;
                self.print(&letters, || {
                    let mut t = Table::new([
                        "dlq offset",
                        "original",
                        "step",
                        "reason",
                        "error",
                        "attempts",
                        "failed at",
                        "key",
                        "tenant",
                    ]);
                    for l in &letters {
                        t.row([
                            format!("{}/{}", l.partition, l.offset),
                            format!(
                                "{}/{}/{}",
                                l.original_topic, l.original_partition, l.original_offset
                            ),
                            l.step.clone().unwrap_or_default(),
                            l.reason.clone(),
                            l.error.clone(),
                            l.attempts.to_string(),
                            l.failed_at.format("%Y-%m-%d %H:%M:%S").to_string(),
                            l.idempotency_key.clone().unwrap_or_default(),
                            l.tenant.clone(),
                        ]);
                    }
                    format!("{}{} dead letters", t.render(), letters.len())
                })
            }
            DlqCommand::Show {
                topic,
                partition,
                offset,
            } => {
                let record = dlq::show(&self.kafka().await?, topic, *partition, *offset).await?;
                let view = RecordView::of(&record);
                self.print(&view, || view.render(topic))
            }
            DlqCommand::Replay(args) => self.replay(args).await,
            DlqCommand::Groups { topics, .. } => self.groups(topics).await,
            DlqCommand::Discard {
                group,
                undo,
                topics,
                dry_run,
                yes,
                by,
            } => {
                let actor = by.actor()?;
                self.bulk_discard(group.as_deref(), *undo, topics, *dry_run, *yes, &actor)
                    .await
            }
            DlqCommand::Operations { command, limit } => {
                self.operations(command.as_ref(), *limit).await
            }
            DlqCommand::Replays { topic, limit } => {
                let pool = self.pool().await?;
                let found = dlq::replays(&pool, topic.as_deref(), *limit).await?;
                self.print(&found, || {
                    let mut t = Table::new([
                        "sent at", "operator", "letter", "group", "to", "key", "tenant", "forced",
                    ]);
                    for r in &found {
                        t.row([
                            r.sent_at.format("%Y-%m-%d %H:%M:%S").to_string(),
                            r.operator.clone(),
                            format!("{}/{}/{}", r.dlq_topic, r.dlq_partition, r.dlq_offset),
                            r.group.clone(),
                            format!("{}/{}/{}", r.retry_topic, r.retry_partition, r.retry_offset),
                            r.idempotency_key.clone().unwrap_or_default(),
                            r.tenant.clone().unwrap_or_default(),
                            if r.forced { "yes" } else { "" }.to_owned(),
                        ]);
                    }
                    format!("{}{} replays", t.render(), found.len())
                })
            }
        }
    }

    /// `saga outbox …`.
    async fn outbox(&self, command: &OutboxCommand) -> anyhow::Result<()> {
        match command {
            OutboxCommand::Wal(command) => self.outbox_wal(command).await,
            OutboxCommand::Status => {
                let pool = self.pool().await?;
                let status = outbox::status(&pool).await?;
                self.print(&status, || {
                    format!(
                        "unpublished rows:        {}\noldest unpublished row:  {}\nfailing rows:            {}\nparked rows:             {}\npublished rows kept:     {}",
                        status.unpublished,
                        status.oldest_age_seconds.map_or_else(|| "-".to_owned(), |a| format!("{a:.1} s old")),
                        status.failing,
                        status.parked,
                        status.published_kept
                    ) + &status.wal.as_ref().map_or_else(String::new, |w| format!(
                        "\nWAL slot:                {} ({}, log {})\nWAL lag:                 {} bytes, {}\nWAL events parked:       {}",
                        w.slot,
                        if w.reading { "read by a relay" } else { "NOT READ: no relay runs" },
                        w.wal_status.as_deref().unwrap_or("-"),
                        w.lag_bytes,
                        w.lag_seconds.map_or_else(|| "caught up".to_owned(), |s| format!("{s:.1} s behind")),
                        w.parked
                    ))
                })
            }
            OutboxCommand::Parked { limit } => {
                let pool = self.pool().await?;
                let found = outbox::parked(&pool, *limit).await?;
                self.print(&found, || parked_table(&found))
            }
            OutboxCommand::Retry {
                id,
                outbox: which,
                all: _,
                yes,
                by,
            } => {
                let actor = by.actor()?;
                let pool = self.pool().await?;
                // Which outbox the id names, found once: the question, the action and the log say it.
                let which = match id {
                    Some(id) => Some(outbox::locate(&pool, *id, *which).await?.outbox),
                    None => None,
                };
                confirmed(&outbox::retry_scope(&pool, *id, which).await?, *yes)?;
                let action = Action::new("outbox retry")
                    .on(
                        "event",
                        id.map_or_else(|| "every parked event".to_owned(), |id| id.to_string()),
                    )
                    .on("outbox", which.map_or("both", outbox::ParkedIn::as_str));
                let work = outbox::retry(&pool, *id, which);
                let n = audit::audited(&pool, &actor, action, work, |n| {
                    format!("{n} parked events to be published again")
                })
                .await?;
                let report = serde_json::json!({ "events": n, "operator": actor.operator });
                self.print(&report, || {
                    format!("{n} parked events to be published again, in order, at the relay's next round")
                })
            }
            OutboxCommand::Discard {
                id,
                outbox: which,
                yes,
                by,
            } => {
                let actor = by.actor()?;
                let operator = &actor.operator;
                let pool = self.pool().await?;
                let event = outbox::locate(&pool, *id, *which).await?;
                confirmed(
                    &format!(
                        "discard {} (it is never published; its key's later events go on)",
                        event.describe()
                    ),
                    *yes,
                )?;
                let action = Action::new("outbox discard")
                    .on("event", id)
                    .on("outbox", event.outbox.as_str());
                let work = outbox::discard(&pool, *id, Some(event.outbox), operator);
                audit::audited(&pool, &actor, action, work, |()| "discarded".to_owned()).await?;
                let report = serde_json::json!({ "discarded": id, "operator": operator });
                self.print(&report, || {
                    format!("parked event {id} discarded by {operator}")
                })
            }
        }
    }

    /// `saga keys …`.
    async fn keys(&self, command: &KeysCommand) -> anyhow::Result<()> {
        match command {
            KeysCommand::Held { group, limit } => {
                let pool = self.pool().await?;
                let found = holds::list(&pool, group.as_deref(), *limit).await?;
                self.print(&found, || {
                    let mut t = Table::new([
                        "group",
                        "key",
                        "state",
                        "held by",
                        "parked",
                        "held for",
                        "head letter",
                    ]);
                    for h in &found {
                        t.row([
                            h.group.clone(),
                            h.key.clone(),
                            h.state.clone(),
                            h.held_by(),
                            h.parked.to_string(),
                            duration::human(std::time::Duration::from_secs(
                                h.age_seconds.max(0) as u64
                            )),
                            h.head
                                .as_ref()
                                .map(|(t, p, o)| format!("{t}/{p}/{o}"))
                                .unwrap_or_default(),
                        ]);
                    }
                    format!(
                        "{}{} held keys (replay or discard a head letter to release its key; \
                         `saga steps resume` releases a paused step's)",
                        t.render(),
                        found.len()
                    )
                })
            }
            KeysCommand::Release {
                key,
                key_hex,
                group,
                by,
            } => {
                let actor = by.actor()?;
                let operator = &actor.operator;
                let pool = self.pool().await?;
                let bytes = key_hex
                    .as_ref()
                    .map(|k| k.0.clone())
                    .or_else(|| key.as_ref().map(|k| k.as_bytes().to_vec()))
                    .unwrap_or_default();
                let action = Action::new("keys release")
                    .on("group", group)
                    .on_bytes("key", &bytes);
                let work = holds::release(&pool, group, &bytes, operator);
                let released = audit::audited(&pool, &actor, action, work, |r| {
                    format!("released; {} parked messages run in order", r.parked)
                })
                .await?;
                self.print(&released, || {
                    format!(
                        "key {} of group {} released by {operator}: its {} parked messages run in order",
                        released.key, released.group, released.parked
                    )
                })
            }
            KeysCommand::Show { key, tenant } => {
                let pool = self.pool().await?;
                let found = keys::show(&pool, key, tenant.as_deref()).await?;
                self.print(&found, || keys_table(&found))
            }
        }
    }

    /// `saga steps …`.
    async fn steps(&self, command: &StepsCommand) -> anyhow::Result<()> {
        match command {
            StepsCommand::Pause {
                step,
                group,
                reason,
                operator,
            } => {
                let actor = Actor::new(
                    operator_or_os_user(operator.as_ref()),
                    Some(reason),
                    Via::Command,
                )?;
                let operator = &actor.operator;
                let pool = self.pool().await?;
                let action = Action::new("steps pause")
                    .on("group", group)
                    .on("step", step);
                let work = holds::pause(&pool, group, step, operator, reason);
                let paused = audit::audited(&pool, &actor, action, work, |paused| {
                    if *paused {
                        "paused"
                    } else {
                        "was paused already"
                    }
                    .to_owned()
                })
                .await?;
                self.print(&paused, || {
                    if paused {
                        format!(
                            "step {step} of group {group} paused by {operator}: its messages are parked, in \
                             order per key, three seconds from now"
                        )
                    } else {
                        format!("step {step} of group {group} was paused already")
                    }
                })
            }
            StepsCommand::Resume {
                step,
                group,
                reason,
                operator,
            } => {
                let actor = Actor::new(
                    operator_or_os_user(operator.as_ref()),
                    Some(reason),
                    Via::Command,
                )?;
                let operator = &actor.operator;
                let pool = self.pool().await?;
                let action = Action::new("steps resume")
                    .on("group", group)
                    .on("step", step);
                let work = holds::resume(&pool, group, step, operator, reason);
                let released = audit::audited(&pool, &actor, action, work, |n| {
                    format!("resumed; {n} held keys released")
                })
                .await?;
                self.print(&released, || {
                    format!(
                        "step {step} of group {group} resumed by {operator}: {released} held keys released, \
                         their parked messages run in order"
                    )
                })
            }
            StepsCommand::Paused { group } => {
                let pool = self.pool().await?;
                let found = holds::paused(&pool, group.as_deref()).await?;
                self.print(&found, || {
                    let mut t = Table::new([
                        "group",
                        "step",
                        "paused by",
                        "reason",
                        "paused at",
                        "held keys",
                        "parked",
                    ]);
                    for p in &found {
                        t.row([
                            p.group.clone(),
                            p.step.clone(),
                            p.paused_by.clone(),
                            p.reason.clone(),
                            p.paused_at.format("%Y-%m-%d %H:%M:%S").to_string(),
                            p.held_keys.to_string(),
                            p.parked.to_string(),
                        ]);
                    }
                    format!("{}{} paused steps", t.render(), found.len())
                })
            }
        }
    }

    /// `saga sagas …`.
    async fn sagas(&self, command: &SagasCommand) -> anyhow::Result<()> {
        match command {
            SagasCommand::Retry { id, by } => {
                let actor = by.actor()?;
                let operator = &actor.operator;
                let pool = self.pool().await?;
                let action = Action::new("sagas retry").on("saga", id);
                let work = sagas::retry(&pool, id, operator);
                let instance = audit::audited(&pool, &actor, action, work, |i| {
                    format!(
                        "retry of step {} attempt {} requested",
                        i.step_index, i.attempt
                    )
                })
                .await?;
                self.print(&instance, || {
                    format!(
                        "retry of saga {} ({} at step {}, attempt {}) requested by {operator}: its service's \
                         orchestrator sends the command again at its next timer tick",
                        instance.saga_id, instance.status, instance.step_index, instance.attempt
                    )
                })
            }
            SagasCommand::List {
                status,
                stuck,
                stuck_for,
                limit,
            } => {
                let status = status.as_deref().map(sagas::parse_status).transpose()?;
                let stuck_for = stuck_for
                    .as_deref()
                    .or(stuck.then_some("5m"))
                    .map(duration::parse)
                    .transpose()?;
                let pool = self.pool().await?;
                let found = sagas::list(&pool, status, stuck_for, *limit).await?;
                self.print(&found, || {
                    let mut t = Table::new([
                        "saga",
                        "type",
                        "tenant",
                        "key",
                        "status",
                        "step",
                        "definition",
                        "updated",
                        "timer failures",
                        "stuck",
                    ]);
                    for s in &found {
                        t.row([
                            s.saga_id.to_string(),
                            s.saga_type.clone(),
                            s.tenant.clone(),
                            s.idempotency_key.clone(),
                            s.status.clone(),
                            s.step_index.to_string(),
                            definition_version(s),
                            s.updated_at.format("%Y-%m-%d %H:%M:%S").to_string(),
                            s.timer_failures.to_string(),
                            s.stuck_reason.clone().unwrap_or_default(),
                        ]);
                    }
                    format!("{}{} sagas", t.render(), found.len())
                })
            }
            SagasCommand::Show { id } => {
                let pool = self.pool().await?;
                let detail = sagas::show(&pool, id).await?;
                self.print(&detail, || {
                    let i = &detail.instance;
                    // What a step or a message wrote stays on its line: no text of theirs starts a line
                    // that would look like the command's own.
                    let flat = |text: &str| one_line(text, usize::MAX);
                    let mut out = format!(
                        "saga {} ({}), key {} of tenant {}: {} at step {} of definition {}, revision {}\n",
                        i.saga_id,
                        flat(&i.saga_type),
                        flat(&i.idempotency_key),
                        flat(&i.tenant),
                        i.status,
                        i.step_index,
                        definition_version(i),
                        i.version
                    );
                    if let Some(failure) = &i.failure {
                        out.push_str(&format!("failure: {}\n", flat(failure)));
                    }
                    if let Some(reason) = &i.stuck_reason {
                        out.push_str(&format!("stuck: {}\n", flat(reason)));
                    }
                    out.push_str(&format!("step keys: {}\n\ntimeline:\n", i.step_keys));
                    let mut t = Table::new(["at", "version", "from", "to", "step", "cause"]);
                    for tr in &detail.timeline {
                        let cause = match (tr.retry_of, &tr.operator) {
                            (Some(of), operator) => format!(
                                "{} (of v{of}, by {})",
                                tr.cause,
                                operator.as_deref().unwrap_or("unknown")
                            ),
                            (None, _) => tr.cause.clone(),
                        };
                        t.row([
                            tr.at.format("%Y-%m-%d %H:%M:%S%.3f").to_string(),
                            tr.version.to_string(),
                            tr.from_status.clone().unwrap_or_default(),
                            tr.to_status.clone(),
                            tr.step.clone().unwrap_or_default(),
                            cause,
                        ]);
                    }
                    out.push_str(&t.render());
                    out
                })
            }
        }
    }

    /// `saga outbox wal …`.
    async fn outbox_wal(&self, command: &WalCommand) -> anyhow::Result<()> {
        match command {
            WalCommand::Recover { yes, by } => {
                let actor = by.actor()?;
                let pool = self.pool().await?;
                confirmed(
                    "make the WAL outbox's slot again (the events its loss took are not brought back)",
                    *yes,
                )?;
                let action = Action::new("outbox wal recover");
                let work = outbox::recover(&pool, &actor.operator);
                let r = audit::audited(&pool, &actor, action, work, |r| {
                    format!(
                        "incident {}: slot {} made again, {} step keys in the lost window",
                        r.incident, r.slot, r.steps_in_window
                    )
                })
                .await?;
                self.print(&r, || recovery_text(&r))
            }
            WalCommand::Incidents { keys, limit } => {
                let pool = self.pool().await?;
                if let Some(id) = keys {
                    let steps = outbox::lost_steps(&pool, *id, *limit).await?;
                    return self.print(&steps, || {
                        let mut t = Table::new(["completed at", "tenant", "step key"]);
                        for s in &steps {
                            t.row([
                                s.completed_at.format("%Y-%m-%d %H:%M:%S").to_string(),
                                s.tenant.clone(),
                                s.step_key.clone(),
                            ]);
                        }
                        format!(
                            "{}{} step keys completed in incident {id}'s window",
                            t.render(),
                            steps.len()
                        )
                    });
                }
                let found = outbox::incidents(&pool, *limit).await?;
                self.print(&found, || {
                    found
                        .iter()
                        .map(recovery_text)
                        .collect::<Vec<_>>()
                        .join("\n\n")
                })
            }
            WalCommand::Retire { force, yes, by } => {
                let actor = by.actor()?;
                let pool = self.pool().await?;
                confirmed(
                    "drop the WAL outbox's slot (services of this schema must then run in table mode)",
                    *yes,
                )?;
                let action = Action::new("outbox wal retire").on("force", force);
                let work = outbox::retire(&pool, *force);
                let r = audit::audited(&pool, &actor, action, work, |r| {
                    format!(
                        "dropped slot {} with {} unpublished events",
                        r.slot, r.unpublished_events
                    )
                })
                .await?;
                self.print(&r, || {
                    format!(
                        "dropped the slot {} ({} unpublished events with it); start the services in table mode",
                        r.slot, r.unpublished_events
                    )
                })
            }
        }
    }

    /// Serve the inspector page (`saga inspect`).
    async fn inspect(&self, args: &InspectArgs) -> anyhow::Result<()> {
        let InspectArgs {
            listen,
            public_names,
            read_only,
            secure_cookies,
            insecure_no_token,
            dlq_topics,
            groups,
            stuck_for,
            tokens,
        } = args;
        let tokens = inspector_tokens(tokens)?;
        // Served to others: listening beyond localhost, or named as a proxy in front serves it.
        let served_to_others = if !listen.ip().is_loopback() {
            Some(format!(
                "the inspector would listen beyond localhost ({listen})"
            ))
        } else {
            (!public_names.is_empty()).then(|| {
                format!(
                    "the inspector would be served to others under --public-name {}",
                    public_names.join(", ")
                )
            })
        };
        if let Some(why) = served_to_others.filter(|_| tokens.is_empty() && !insecure_no_token) {
            return Err(ConfigProblem::new(
                        "SAGA_ADMIN_TOKEN",
                        format!("is not set, and {why}"),
                        "set SAGA_ADMIN_TOKEN (or SAGA_ADMIN_TOKENS=name:token,...), or pass --insecure-no-token",
                    )
                    .into());
        }
        let mut options = InspectOptions::default();
        options.dlq_topics.clone_from(dlq_topics);
        options.groups.clone_from(groups);
        options.stuck_for = duration::parse(stuck_for)?;
        options.tokens = tokens;
        options.public_names.clone_from(public_names);
        options.read_only = *read_only;
        options.secure_cookies = *secure_cookies;
        let (kafka, pool) = (self.kafka().await?, self.pool().await?);
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("listening on {listen}"))?;
        println!("inspector on http://{}/", listener.local_addr()?);
        inspect::serve(
            listener,
            kafka,
            pool,
            options,
            saga_consumer::toolkit::wait_for_signal(),
        )
        .await?;
        Ok(())
    }

    /// Replay dead letters (`saga dlq replay`).
    async fn replay(&self, args: &ReplayArgs) -> anyhow::Result<()> {
        let ReplayArgs {
            select,
            partition,
            offset,
            dry_run,
            force,
            max_replays,
            by,
            yes,
        } = args;
        let actor = by.actor()?;
        refuse_letter_reason_as_why(actor.reason.as_deref())?;
        let mut filter = select.filter()?;
        filter.position = partition.zip(*offset);
        let options = ReplayOptions {
            dry_run: *dry_run,
            force: *force,
            max_replays: *max_replays,
            ..ReplayOptions::default()
        }
        .by(actor.operator.clone());
        if let Some(group) = &select.group {
            let topics: Vec<String> = select.topic.iter().cloned().collect();
            return self
                .bulk_replay(&topics, group, &options, &actor, *yes)
                .await;
        }
        let topic = select.topic.as_deref().unwrap_or_default();
        let kafka = self.kafka().await?;
        let pool = self.pool().await?;
        let work = dlq::replay(&kafka, &pool, topic, &filter, &options);
        let report = if *dry_run {
            work.await?
        } else {
            let action = Action::new("dlq replay")
                .on("topic", topic)
                .on("letters", select.describe(filter.position))
                .on("force", force);
            audit::audited(&pool, &actor, action, work, |r| {
                format!("{} sent to {}", r.sent(), r.retry_topic)
            })
            .await?
        };
        self.print(&report, || {
            let mut t = Table::new(["dlq offset", "from", "key", "outcome"]);
            for l in &report.letters {
                t.row([
                    format!("{}/{}", l.partition, l.offset),
                    format!("{}/{}", l.original_topic, l.original_partition),
                    l.idempotency_key.clone().unwrap_or_default(),
                    l.outcome.describe(),
                ]);
            }
            format!(
                "{}{} sent to {} (group {}) by {}",
                t.render(),
                report.sent(),
                report.retry_topic,
                report.group,
                report.operator
            )
        })
    }

    /// The dead-letter topics to look in: `topics`, or every one the schema's consumer groups record.
    async fn group_topics(&self, pool: &PgPool, topics: &[String]) -> anyhow::Result<Vec<String>> {
        if !topics.is_empty() {
            return Ok(topics.to_vec());
        }
        let recorded = groups::dlq_topics_of(pool).await?;
        if recorded.is_empty() {
            return Err(crate::AdminError::bad_input(
                "no consumer group in this schema records a dead-letter topic: name one with --topic, or \
                 point SAGA_SCHEMA at the service's schema",
            )
            .into());
        }
        Ok(recorded)
    }

    async fn groups(&self, topics: &[String]) -> anyhow::Result<()> {
        let (kafka, pool) = (self.kafka().await?, self.pool().await?);
        let topics = self.group_topics(&pool, topics).await?;
        let found = groups::groups(&kafka, &pool, &topics).await?;
        self.print(&found, || {
            let mut t = Table::new([
                "group",
                "topic",
                "step",
                "reason",
                "cause",
                "open",
                "all",
                "first seen",
                "last seen",
                "held keys",
            ]);
            for g in &found {
                t.row([
                    g.id.clone(),
                    g.dlq_topic.clone(),
                    g.step.clone().unwrap_or_default(),
                    g.reason.clone(),
                    g.cause.clone(),
                    g.open.to_string(),
                    g.total.to_string(),
                    g.first_seen.format("%Y-%m-%d %H:%M:%S").to_string(),
                    g.last_seen.format("%Y-%m-%d %H:%M:%S").to_string(),
                    g.held_summary(),
                ]);
            }
            format!("{}{} failure groups", t.render(), found.len())
        })
    }

    async fn group_letters(&self, topic: Option<&str>, id: &str) -> anyhow::Result<()> {
        let (kafka, pool) = (self.kafka().await?, self.pool().await?);
        let topics: Vec<String> = topic.iter().map(|t| (*t).to_owned()).collect();
        let topics = self.group_topics(&pool, &topics).await?;
        let (group, letters) = groups::find(&kafka, &pool, &topics, id).await?;
        self.print(&letters, || {
            let mut t = Table::new([
                "dlq offset",
                "state",
                "error",
                "attempts",
                "failed at",
                "key",
            ]);
            for l in &letters {
                t.row([
                    format!(
                        "{}/{}/{}",
                        l.letter.topic, l.letter.partition, l.letter.offset
                    ),
                    l.state.as_str().to_owned(),
                    l.letter.error.clone(),
                    l.letter.attempts.to_string(),
                    l.letter.failed_at.format("%Y-%m-%d %H:%M:%S").to_string(),
                    l.letter.idempotency_key.clone().unwrap_or_default(),
                ]);
            }
            format!(
                "{}{} letters of failure group {} ({}: {}), {} open",
                t.render(),
                letters.len(),
                group.id,
                group.reason,
                group.cause,
                group.open
            )
        })
    }

    async fn bulk_replay(
        &self,
        topics: &[String],
        group: &str,
        options: &ReplayOptions,
        actor: &Actor,
        yes: bool,
    ) -> anyhow::Result<()> {
        let (kafka, pool) = (self.kafka().await?, self.pool().await?);
        let topics = self.group_topics(&pool, topics).await?;
        // Planned on an index brought up to date, `--as-indexed` or not: what it shows is what it does.
        let plan = crate::freshness::strict(operations::plan_replay(
            &kafka, &pool, &topics, group, options,
        ))
        .await?;
        self.run_plan(&kafka, &pool, &plan, actor, options.dry_run, yes, options)
            .await
    }

    async fn bulk_discard(
        &self,
        group: Option<&str>,
        undo: Option<i64>,
        topics: &[String],
        dry_run: bool,
        yes: bool,
        actor: &Actor,
    ) -> anyhow::Result<()> {
        let (kafka, pool) = (self.kafka().await?, self.pool().await?);
        let plan = match (group, undo) {
            (_, Some(undo)) => operations::plan_undo(&pool, undo).await?,
            (Some(group), None) => {
                let topics = self.group_topics(&pool, topics).await?;
                crate::freshness::strict(operations::plan_discard(&kafka, &pool, &topics, group))
                    .await?
            }
            (None, None) => unreachable!("clap requires --group or --undo"),
        };
        let options = ReplayOptions::default().by(actor.operator.clone());
        self.run_plan(&kafka, &pool, &plan, actor, dry_run, yes, &options)
            .await
    }

    /// Shows `plan`, asks (unless `yes`), then records and runs it as an operation of `actor`.
    #[allow(clippy::too_many_arguments)]
    async fn run_plan(
        &self,
        kafka: &KafkaConfig,
        pool: &PgPool,
        plan: &operations::Plan,
        actor: &Actor,
        dry_run: bool,
        yes: bool,
        options: &ReplayOptions,
    ) -> anyhow::Result<()> {
        let question = format!("{}, as {}", plan.describe(), actor.operator);
        if dry_run {
            return self.print(plan, || format!("would {question}"));
        }
        if plan.would_act() == 0 {
            return self.print(plan, || format!("nothing to do: {question}"));
        }
        if !confirm(&question, yes)? {
            eprintln!("nothing done");
            return Ok(());
        }
        let work = async {
            let id = operations::start(pool, plan, &actor.operator).await?;
            operations::run(kafka, pool, id, options).await
        };
        let operation =
            audit::audited(pool, actor, plan.audit_action(), work, operation_summary).await?;
        self.print(&operation, || operation_line(&operation))
    }

    async fn operations(
        &self,
        command: Option<&OperationsCommand>,
        limit: i64,
    ) -> anyhow::Result<()> {
        let pool = self.pool().await?;
        match command {
            None => {
                let found = operations::list(&pool, limit).await?;
                self.print(&found, || {
                    let mut t = Table::new([
                        "operation",
                        "kind",
                        "by",
                        "status",
                        "selected",
                        "done",
                        "skipped",
                        "refused",
                        "started",
                        "selection",
                    ]);
                    for o in &found {
                        t.row([
                            o.id.to_string(),
                            o.kind.as_str().to_owned(),
                            o.operator.clone(),
                            o.status.clone(),
                            o.planned.to_string(),
                            format!("{} {}", o.done, o.kind.done_word()),
                            o.skipped.to_string(),
                            o.refused.to_string(),
                            o.created_at.format("%Y-%m-%d %H:%M:%S").to_string(),
                            o.selection.to_string(),
                        ]);
                    }
                    format!("{}{} operations", t.render(), found.len())
                })
            }
            Some(OperationsCommand::Show { id }) => {
                let (operation, letters) = operations::get(&pool, *id).await?;
                let view = serde_json::json!({ "operation": operation, "letters": letters });
                self.print(&view, || {
                    let mut t = Table::new(["#", "letter", "outcome", "what happened"]);
                    for l in &letters {
                        t.row([
                            (l.seq + 1).to_string(),
                            format!("{}/{}/{}", l.dlq_topic, l.partition, l.offset),
                            l.outcome.clone().unwrap_or_else(|| "pending".to_owned()),
                            l.detail.clone().unwrap_or_default(),
                        ]);
                    }
                    format!("{}\n{}", operation_line(&operation), t.render())
                })
            }
            Some(OperationsCommand::Cancel { id, by }) => {
                let actor = by.actor()?;
                let action = Action::new("dlq operations cancel").on("operation", id);
                let work = operations::cancel(&pool, *id, &actor.operator);
                let operation = audit::audited(&pool, &actor, action, work, |o| {
                    format!("operation {}: {}", o.id, o.status)
                })
                .await?;
                self.print(&operation, || operation_line(&operation))
            }
            Some(OperationsCommand::Resume { id, by }) => {
                let actor = by.actor()?;
                let options = ReplayOptions::default().by(actor.operator.clone());
                let kafka = self.kafka().await?;
                let action = Action::new("dlq operations resume").on("operation", id);
                let work = operations::run(&kafka, &pool, *id, &options);
                let operation =
                    audit::audited(&pool, &actor, action, work, operation_summary).await?;
                self.print(&operation, || operation_line(&operation))
            }
        }
    }

    async fn trace(
        &self,
        key: &str,
        tenant: Option<&str>,
        schemas: &[String],
    ) -> anyhow::Result<()> {
        // Every service schema is read by name: the database is enough, no schema needed.
        let url = required_postgres_url("DATABASE_URL", self.database.database_url.as_deref())?;
        let pool = connect_postgres("DATABASE_URL", url, None, 2).await?;
        let found = trace::trace(&pool, key, tenant, schemas).await?;
        self.print(&found, || {
            let mut t = Table::new(["at", "service", "what", "step", "status", "detail"]);
            for e in &found.events {
                t.row([
                    e.at.format("%Y-%m-%d %H:%M:%S%.3f").to_string(),
                    e.lane.clone(),
                    e.kind.as_str().to_owned(),
                    e.subject.clone(),
                    e.status.clone(),
                    e.detail.clone(),
                ]);
            }
            let unread = found
                .unread
                .iter()
                .map(|u| {
                    format!(
                        "\nnot read, so dead letters may be missing: {}",
                        one_line(u, 200)
                    )
                })
                .collect::<String>();
            let cut = found
                .cut
                .iter()
                .map(|c| format!("\ncut: {}", one_line(c, 200)))
                .collect::<String>();
            format!(
                "{}{} events of key {} in {} services{unread}{cut}",
                t.render(),
                found.events.len(),
                found.key,
                found.lanes.len()
            )
        })
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

/// Bad input if `why` (a replay's `--reason`) is a dead letter's reason (`dlq-reason`, or `unreadable`):
/// given to `dlq replay`, it most likely meant to select those letters, as `--reason` did before 0.3, and
/// the replay would otherwise send every letter the other filters select.
fn refuse_letter_reason_as_why(why: Option<&str>) -> Result<(), AdminError> {
    let letter_reason = |r: &str| {
        r == "unreadable"
            || saga_consumer::DeadLetterReason::ALL
                .iter()
                .any(|known| known.as_str() == r)
    };
    match why {
        Some(reason) if letter_reason(reason) => Err(AdminError::bad_input(format!(
            "--reason says why you act, and {reason:?} is a dead letter's reason: select letters by their \
             reason with --letter-reason {reason}"
        ))),
        _ => Ok(()),
    }
}

/// Parked events as a table.
fn parked_table(found: &[outbox::Parked]) -> String {
    let mut t = Table::new([
        "id",
        "outbox",
        "topic",
        "key",
        "attempts",
        "parked at",
        "next try",
        "holds key",
        "bytes",
        "error",
    ]);
    for p in found {
        t.row([
            p.id.to_string(),
            p.outbox.as_str().to_owned(),
            p.topic.clone(),
            p.key.clone().unwrap_or_default(),
            p.attempts.to_string(),
            p.parked_at.format("%Y-%m-%d %H:%M:%S").to_string(),
            if p.outbox == outbox::ParkedIn::Table && !p.holds_key {
                "by hand".to_owned()
            } else {
                p.next_attempt_at.format("%Y-%m-%d %H:%M:%S").to_string()
            },
            if p.holds_key { "yes" } else { "no" }.to_owned(),
            p.payload_bytes.to_string(),
            p.error.clone(),
        ]);
    }
    format!("{}{} parked events", t.render(), found.len())
}

/// What an operation did, for the audit log.
fn operation_summary(o: &operations::Operation) -> String {
    format!(
        "operation {} {}: {} {}, {} skipped, {} refused",
        o.id,
        o.status,
        o.done,
        o.kind.done_word(),
        o.skipped,
        o.refused
    )
}

/// The operator named on the command line, or the OS user.
fn operator_or_os_user(named: Option<&String>) -> String {
    named
        .filter(|o| !o.trim().is_empty())
        .cloned()
        .unwrap_or_else(dlq::os_user)
}

/// Asks `question` (unless `yes`); not confirmed is bad input: nothing was done.
fn confirmed(question: &str, yes: bool) -> Result<(), AdminError> {
    if confirm(question, yes)? {
        Ok(())
    } else {
        Err(AdminError::bad_input("not confirmed: nothing done"))
    }
}

/// What a recovery did and what was lost, for people.
fn recovery_text(r: &outbox::Recovery) -> String {
    format!(
        "incident {}: the slot {} was {}; {} made it again\n\
         lost:     events committed after LSN {} ({}) and before LSN {} ({}) may never have been published\n\
         steps:    {} step keys completed in that window: `saga outbox wal incidents --keys {}` lists them\n\
         re-drive: orchestrated sagas that stopped: `saga sagas list --stuck`, then `saga sagas retry ID`; \
         choreographed steps: re-emit their follow-up events from the listed keys (their steps will not run \
         again); see the WAL outbox guide",
        r.incident,
        r.slot,
        r.what,
        r.recovered_by,
        r.lost_from_lsn.as_deref().unwrap_or("(never confirmed)"),
        r.lost_from.format("%Y-%m-%d %H:%M:%S UTC"),
        r.lost_to_lsn,
        r.lost_to.format("%Y-%m-%d %H:%M:%S UTC"),
        r.steps_in_window,
        r.incident,
    )
}

/// An operation in one line.
fn operation_line(o: &operations::Operation) -> String {
    let resumed: Vec<&str> = o
        .run_by
        .iter()
        .skip(1)
        .map(String::as_str)
        .filter(|r| *r != o.operator)
        .collect();
    let mut who = String::new();
    if !resumed.is_empty() {
        who.push_str(&format!(", resumed by {}", resumed.join(", ")));
    }
    if let Some(by) = &o.cancelled_by {
        who.push_str(&format!(", cancelled by {by}"));
    }
    let stopped = o
        .stopped
        .as_deref()
        .filter(|_| o.status == "running")
        .map_or_else(String::new, |why| {
            format!(
                "\nits last run stopped before its end: {why} (resume it once fixed, or cancel it)"
            )
        });
    format!(
        "operation {}: {} by {}{who}, {} ({} selected: {} {}, {} skipped, {} refused){stopped}",
        o.id,
        o.kind.as_str(),
        o.operator,
        o.status,
        o.planned,
        o.done,
        o.kind.done_word(),
        o.skipped,
        o.refused
    )
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

/// The inspector's tokens: `SAGA_ADMIN_TOKENS` (`name:token,…`) and `SAGA_ADMIN_TOKEN` (named `admin`).
fn inspector_tokens(args: &TokenArgs) -> Result<Vec<inspect::NamedToken>, ConfigProblem> {
    let mut tokens = Vec::new();
    if let Some(list) = &args.tokens {
        tokens = inspect::NamedToken::parse_list(list).map_err(|e| {
            ConfigProblem::new("SAGA_ADMIN_TOKENS", e, "write name:token,name:token")
        })?;
    }
    if let Some(token) = args.token.as_deref()
        && !token.is_empty()
    {
        tokens.push(
            inspect::NamedToken::new("admin", token).map_err(|e| {
                ConfigProblem::new("SAGA_ADMIN_TOKEN", e, "use a longer random token")
            })?,
        );
    }
    Ok(tokens)
}

fn keys_table(found: &[keys::KeyView]) -> String {
    let mut t = Table::new([
        "tenant",
        "step key",
        "status",
        "attempts",
        "lease holder",
        "lease expires",
        "outcome / error",
        "updated",
        "external key",
    ]);
    for k in found {
        t.row([
            k.tenant.clone(),
            k.step_key.clone(),
            if k.lease_expired {
                "started (lease expired)".to_owned()
            } else {
                k.status.clone()
            },
            k.attempts.to_string(),
            k.lease_holder.clone().unwrap_or_default(),
            k.lease_expires_at
                .map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string())
                .unwrap_or_default(),
            k.error
                .clone()
                .or_else(|| k.outcome.as_ref().map(ToString::to_string))
                .unwrap_or_default(),
            k.updated_at.format("%Y-%m-%d %H:%M:%S").to_string(),
            k.external_key.clone(),
        ]);
    }
    format!("{}{} keys", t.render(), found.len())
}

/// A message for people and for JSON: text where it is text, JSON pretty-printed.
#[derive(Debug, Serialize)]
struct RecordView {
    partition: i32,
    offset: i64,
    key: Option<String>,
    headers: Vec<(String, Option<String>)>,
    payload: serde_json::Value,
}

impl RecordView {
    fn of(record: &dlq::Record) -> Self {
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let payload = match record.payload.as_deref() {
            None => serde_json::Value::Null,
            Some(bytes) => serde_json::from_slice(bytes)
                .unwrap_or_else(|_| serde_json::Value::String(text(bytes))),
        };
        Self {
            partition: record.partition,
            offset: record.offset,
            key: record.key.as_deref().map(text),
            headers: record
                .headers
                .iter()
                .map(|(n, v)| (n.clone(), v.as_deref().map(text)))
                .collect(),
            payload,
        }
    }

    fn render(&self, topic: &str) -> String {
        // Every value on one line of its own: a newline in one is shown, not obeyed.
        let mut out = format!(
            "{topic}/{}/{}  key {}\n\nheaders:\n",
            self.partition,
            self.offset,
            self.key
                .as_deref()
                .map_or(std::borrow::Cow::Borrowed("(none)"), |k| printable(
                    k, false
                ))
        );
        let width = self.headers.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
        for (name, value) in &self.headers {
            out.push_str(&format!(
                "  {:<width$}  {}\n",
                printable(name, false),
                value
                    .as_deref()
                    .map_or(std::borrow::Cow::Borrowed("(no value)"), |v| printable(
                        v, false
                    ))
            ));
        }
        out.push_str("\npayload:\n");
        out.push_str(&printable_json(
            &serde_json::to_string_pretty(&self.payload).unwrap_or_default(),
        ));
        out
    }
}

/// The definition version an instance runs, as the toolkit shows it: `v2`, or `v1 (0.2)` for an instance
/// stored by 0.2, which runs version 1.
fn definition_version(instance: &saga_orchestrator::SagaInstance) -> String {
    match instance.definition_version {
        Some(version) => format!("v{version}"),
        None => "v1 (0.2)".to_owned(),
    }
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

/// A key's exact bytes, given in hexadecimal (`--key-hex`).
#[derive(Debug, Clone)]
struct KeyHex(Vec<u8>);

/// `--key-hex`: a key's bytes in hexadecimal.
fn parse_key_hex(text: &str) -> Result<KeyHex, String> {
    // An unset variable must not name the keyless messages' hold: that one is named as the key `''`.
    if text.trim().is_empty() {
        return Err(
            "is empty (the hold of a paused step's messages without a key is released with `saga keys \
             release ''`)"
                .to_owned(),
        );
    }
    saga_consumer::toolkit::parse_hex(text)
        .map(KeyHex)
        .ok_or_else(|| {
            "not hexadecimal (two digits a byte, as `saga keys held --json` gives key_hex)"
                .to_owned()
        })
}
