//! `saga outbox`: the relay's backlog, parked events, the WAL outbox's slot.

use clap::Subcommand;

use super::{ActorArgs, Cli, confirmed};
use crate::audit::{self, Action};
use crate::outbox;
use crate::table::Table;

#[derive(Debug, Subcommand)]
pub(super) enum OutboxCommand {
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
pub(super) enum WalCommand {
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

impl Cli {
    /// `saga outbox …`.
    pub(super) async fn outbox(&self, command: &OutboxCommand) -> anyhow::Result<()> {
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
}
