//! `saga sagas`: orchestrated saga instances.

use clap::Subcommand;

use super::{ActorArgs, Cli};
use crate::audit::{self, Action};
use crate::duration;
use crate::sagas;
use crate::table::{Table, one_line};

#[derive(Debug, Subcommand)]
pub(super) enum SagasCommand {
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

/// The definition version an instance runs, as the toolkit shows it: `v2`, or `v1 (0.2)` for an instance
/// stored by 0.2, which runs version 1.
fn definition_version(instance: &saga_orchestrator::SagaInstance) -> String {
    match instance.definition_version {
        Some(version) => format!("v{version}"),
        None => "v1 (0.2)".to_owned(),
    }
}

impl Cli {
    /// `saga sagas …`.
    pub(super) async fn sagas(&self, command: &SagasCommand) -> anyhow::Result<()> {
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
}
