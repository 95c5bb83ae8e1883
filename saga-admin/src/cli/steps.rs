//! `saga steps`: pausing and resuming a step.

use clap::Subcommand;

use super::{Cli, operator_or_os_user};
use crate::audit::{self, Action, Actor, Via};
use crate::holds;
use crate::table::Table;

/// How long a pause takes to take effect, in words (`PAUSE_DELAY`).
fn pause_delay() -> String {
    let delay = saga_consumer::admin::PAUSE_DELAY;
    match delay.as_secs() {
        1 if delay.subsec_nanos() == 0 => "one second".to_owned(),
        s if delay.subsec_nanos() == 0 => format!("{s} seconds"),
        _ => format!("{:.1} seconds", delay.as_secs_f64()),
    }
}

/// `saga steps pause`'s line in the help.
fn pause_about() -> String {
    format!(
        "Pause a step of a consumer group: {} later, each message of the step is parked, holding its \
         key (the key's later messages park behind it), until `saga steps resume`",
        pause_delay()
    )
}

#[derive(Debug, Subcommand)]
pub(super) enum StepsCommand {
    // Its help says the constant's delay (`pause_about`).
    #[command(about = pause_about())]
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

impl Cli {
    /// `saga steps …`.
    pub(super) async fn steps(&self, command: &StepsCommand) -> anyhow::Result<()> {
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
                             order per key, {} from now",
                            pause_delay()
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
}
