//! `saga dlq`: dead letters, failure groups, replays, bulk operations.

use clap::{Args, Subcommand};
use saga_consumer::KafkaConfig;
use saga_runtime::cli::printable;
use saga_runtime::cli::printable_json;
use serde::Serialize;
use sqlx::PgPool;

use super::{ActorArgs, Cli, confirm};
use crate::AdminError;
use crate::audit::{self, Action, Actor};
use crate::dlq::{self, DlqFilter, ReplayOptions};
use crate::duration;
use crate::table::Table;
use crate::{groups, operations};

#[derive(Debug, Subcommand)]
pub(super) enum DlqCommand {
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
pub(super) enum OperationsCommand {
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

/// Replay dead letters (`saga dlq replay`).
#[derive(Debug, Args)]
pub(super) struct ReplayArgs {
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

/// Which dead letters.
#[derive(Debug, Args)]
pub(super) struct Select {
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

/// A message for people and for JSON: text where it is text, JSON pretty-printed.
#[derive(Debug, Serialize)]
pub(super) struct RecordView {
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

impl Cli {
    /// `saga dlq …`.
    pub(super) async fn dlq(&self, command: &DlqCommand) -> anyhow::Result<()> {
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
            (None, None) => {
                return Err(AdminError::bad_input(
                    "name a failure group (--group) or an operation to undo (--undo)",
                )
                .into());
            }
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
}
