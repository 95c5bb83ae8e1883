//! Deduplication around the handler, for a batch of one partition's messages inside one step transaction
//! (`step_tx`).
//!
//! All step keys of the batch are claimed with one statement; handlers run only for new keys; the outcomes
//! and the emitted outbox rows are written with one statement each. The caller commits. If any handler
//! fails, the caller rolls everything back: the batch then behaves as if it had never run, which is what
//! keeps per-message semantics (see `executor`).
//!
//! The claim comes in two kinds ([`ClaimWay`]: [`AsNew`], [`Checked`]). Where the worker expects every
//! key to be new, a plain `INSERT` claims them, at about half the cost in PostgreSQL of checking each row
//! for a conflict; should one exist after all, the statement fails, the caller rolls back and runs the
//! batch again with the checking claim, which it keeps using while its batches meet existing keys
//! (redeliveries come in runs: after a crash, a rebalance, a replay).

use std::collections::HashMap;
use std::time::Instant;

use chrono::{DateTime, Utc};
use saga_core::{OutboxMessage, StepError, StepKey, StepOutcome, TenantId};
use saga_runtime::store::idempotency::{Claim, StoreError};

use crate::delivery::{Delivery, Route};
use crate::metrics::{ConsumerMetrics, StepOnly, observe_since};
use crate::service::{StepItem, StepRequest, StepService};
pub(crate) use crate::step_tx::{AsNew, Checked, ClaimKind, ClaimWay, KeysExist};
use crate::step_tx::{KeyMayBeGone, Outcomes, StepTx};

/// How one message of a committed batch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ItemOutcome {
    Completed,
    Rejected,
    Duplicate,
    Ignored,
    /// A two-phase worker lost its lease to another, which finishes the step.
    Superseded,
    DeadLettered,
    /// Its key is held: parked behind the key's queue (see `hold`).
    Parked,
    /// It failed transiently and waits parked for its next attempt (delayed retries), holding its key.
    Deferred,
}

impl ItemOutcome {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::Rejected => "rejected",
            Self::Duplicate => "duplicate",
            Self::Ignored => "ignored",
            Self::Superseded => "superseded",
            Self::DeadLettered => "dead_lettered",
            Self::Parked => "parked",
            Self::Deferred => "deferred",
        }
    }

    pub(crate) fn of(outcome: &StepOutcome) -> Self {
        if outcome.is_completed() {
            Self::Completed
        } else {
            Self::Rejected
        }
    }
}

/// Why a message could not be processed this time.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Its handler failed.
    Handler(StepError),
    /// A two-phase worker holds the key's lease until then.
    Busy(DateTime<Utc>),
    /// The framework's own statements failed.
    Store(StoreError),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Handler(e) => write!(f, "{e}"),
            Self::Busy(until) => write!(f, "step key leased by another worker until {until}"),
            Self::Store(e) => write!(f, "{e}"),
        }
    }
}

/// A batch that must be rolled back.
#[derive(Debug)]
pub(crate) enum BatchError {
    /// The message at `index` of the batch failed.
    Item { index: usize, failure: Failure },
    /// A handler call for several messages failed; which message is to blame is not known.
    Group,
    /// A statement of the framework (claim, outcomes, outbox) failed.
    Store(StoreError),
    /// The batch may not commit: its start was not recorded as normal (see `guard::PendingStart`).
    NotStarted,
}

/// The message at `index`, `what`, that the worker's decisions put in a batch of a transactional step: the
/// framework's mistake, dead-lettered with the reason rather than a panic of the partition's worker.
fn misrouted(index: usize, what: &str) -> BatchError {
    BatchError::Item {
        index,
        failure: Failure::Handler(StepError::permanent(std::io::Error::other(format!(
            "the framework ran {what} in a step's batch"
        )))),
    }
}

/// A batch run whose transaction may commit.
#[derive(Debug)]
pub(crate) struct BatchRun {
    /// How each message ended, in batch order.
    pub outcomes: Vec<ItemOutcome>,
    /// Whether the claim met keys that already existed (duplicates or leased keys).
    pub met_existing_keys: bool,
}

impl Failure {
    /// Whether the failure means the database is unavailable (see `StepError::is_connection_error`):
    /// waited out, never counted against the message.
    pub(crate) fn is_database_unavailable(&self) -> bool {
        match self {
            Self::Handler(e) => e.is_database_unavailable(),
            Self::Store(e) => e.is_connection_error(),
            Self::Busy(_) => false,
        }
    }
}

impl BatchError {
    /// Whether the batch failed because the database is unavailable.
    pub(crate) fn is_database_unavailable(&self) -> bool {
        match self {
            Self::Item { failure, .. } => failure.is_database_unavailable(),
            Self::Store(e) => e.is_connection_error(),
            Self::Group | Self::NotStarted => false,
        }
    }
}

impl From<sqlx::Error> for BatchError {
    fn from(e: sqlx::Error) -> Self {
        Self::Store(StoreError::Database(e))
    }
}

enum Slot {
    Ignored,
    /// Redis knows the key to be completed: a duplicate, not claimed.
    KnownDone,
    /// The first message with this key: index into the claimed keys.
    Key(usize),
    /// A later message of the batch with a key claimed earlier in it.
    Repeat,
}

/// Claims the batch's keys (as `C` says), runs the handlers of new ones through `service`, records
/// outcomes and appends the emitted events, all in `tx` (of which the claim must be the first statement).
/// Every delivery must be routed to a transactional step or ignored. `Ok(Err(rerun))`: the claim said the
/// batch must run again, and nothing else ran.
pub(crate) async fn run_batch<C: ClaimWay>(
    service: &dyn StepService,
    tx: &mut StepTx<'_>,
    deliveries: &[Delivery],
    metrics: &ConsumerMetrics,
) -> Result<Result<BatchRun, C::Rerun>, BatchError> {
    let mut keys: Vec<(TenantId, StepKey)> = Vec::with_capacity(deliveries.len());
    let mut seen: HashMap<(&TenantId, &StepKey), usize> = HashMap::with_capacity(deliveries.len());
    let slots: Vec<Slot> = deliveries
        .iter()
        .enumerate()
        .map(|(index, d)| {
            Ok(match &d.route {
                Route::Step { .. } if d.known_done => Slot::KnownDone,
                Route::Step {
                    step_key, tenant, ..
                } => match seen.entry((tenant, step_key)) {
                    std::collections::hash_map::Entry::Occupied(_) => Slot::Repeat,
                    std::collections::hash_map::Entry::Vacant(slot) => {
                        slot.insert(keys.len());
                        keys.push((tenant.clone(), step_key.clone()));
                        Slot::Key(keys.len() - 1)
                    }
                },
                Route::Ignored => Slot::Ignored,
                Route::Poison(_) => return Err(misrouted(index, "a poison message")),
            })
        })
        .collect::<Result<_, BatchError>>()?;
    let claiming = Instant::now();
    let claims = match C::claim(tx, &keys).await.map_err(BatchError::Store)? {
        Ok(claims) => claims,
        Err(rerun) => return Ok(Err(rerun)),
    };
    observe_since(&metrics.phases.claim, claiming);
    let met_existing_keys = claims.iter().any(|c| !matches!(c, Claim::New));

    let mut results: Vec<Option<ItemOutcome>> = vec![None; deliveries.len()];
    let mut outcomes: Vec<(usize, StepOutcome)> = Vec::new();
    let mut emitted: Vec<OutboxMessage> = Vec::new();
    // The new messages: (index in the batch, key index).
    let mut new: Vec<(usize, usize)> = Vec::new();
    for (index, slot) in slots.iter().enumerate() {
        let new_key = match slot {
            Slot::Ignored => {
                results[index] = Some(ItemOutcome::Ignored);
                None
            }
            Slot::Repeat | Slot::KnownDone => {
                results[index] = Some(ItemOutcome::Duplicate);
                None
            }
            Slot::Key(k) => match &claims[*k] {
                Claim::Duplicate(_) => {
                    results[index] = Some(ItemOutcome::Duplicate);
                    None
                }
                Claim::Busy { until } => {
                    return Err(BatchError::Item {
                        index,
                        failure: Failure::Busy(*until),
                    });
                }
                Claim::New => Some(*k),
            },
        };
        if let Some(key_index) = new_key {
            new.push((index, key_index));
        }
    }
    refuse_keys_maybe_gone(tx, deliveries, &new).await?;
    // Consecutive new messages of one step are handled with one call.
    let handling = Instant::now();
    for group in
        new.chunk_by(|(a, _), (b, _)| deliveries[*a].step_name() == deliveries[*b].step_name())
    {
        handle_group(
            service,
            tx.conn(),
            deliveries,
            group,
            metrics,
            &mut results,
            &mut outcomes,
            &mut emitted,
        )
        .await?;
    }
    observe_since(&metrics.phases.handler, handling);
    let recording = Instant::now();
    let records: Vec<_> = outcomes
        .iter()
        .map(|(k, outcome)| (&keys[*k].0, &keys[*k].1, outcome))
        .collect();
    tx.record(Outcomes::Keys(&records), &emitted)
        .await
        .map_err(BatchError::Store)?;
    observe_since(&metrics.phases.record, recording);
    Ok(Ok(BatchRun {
        outcomes: results
            .into_iter()
            .map(|r| r.expect("every message of the batch has an outcome"))
            .collect(),
        met_existing_keys,
    }))
}

/// A message whose new key (just claimed) may have been deleted by retention after its step ran fails for
/// good, to be dead-lettered, rather than run again silently: see [`KeyMayBeGone`].
async fn refuse_keys_maybe_gone(
    tx: &mut StepTx<'_>,
    deliveries: &[Delivery],
    new: &[(usize, usize)],
) -> Result<(), BatchError> {
    let times: Vec<Option<i64>> = new
        .iter()
        .map(|(index, _)| deliveries[*index].raw.timestamp_ms)
        .collect();
    if let Some(position) = tx.horizon(&times).await.map_err(BatchError::Store)? {
        return Err(BatchError::Item {
            index: new[position].0,
            failure: Failure::Handler(KeyMayBeGone::failure(times[position].unwrap_or_default())),
        });
    }
    Ok(())
}

/// Runs one handler call for `group` (indices into `deliveries`, with their key indices).
#[allow(clippy::too_many_arguments)]
async fn handle_group(
    service: &dyn StepService,
    conn: &mut sqlx::PgConnection,
    deliveries: &[Delivery],
    group: &[(usize, usize)],
    metrics: &ConsumerMetrics,
    results: &mut [Option<ItemOutcome>],
    outcomes: &mut Vec<(usize, StepOutcome)>,
    emitted: &mut Vec<OutboxMessage>,
) -> Result<(), BatchError> {
    let mut items = Vec::with_capacity(group.len());
    let mut step = None;
    for (index, _) in group {
        let Route::Step {
            step: s,
            decoded,
            tenant,
            ..
        } = &deliveries[*index].route
        else {
            return Err(misrouted(*index, "a message routed to no step"));
        };
        step = Some(s);
        items.push(StepItem {
            decoded,
            tenant,
            origin: &deliveries[*index].raw.origin,
            span: &deliveries[*index].span,
        });
    }
    let Some(step) = step else {
        // An empty group: nothing to run.
        return Ok(());
    };
    let started = Instant::now();
    let handled = service
        .call(StepRequest {
            step,
            items,
            response: None,
            conn,
        })
        .await;
    let per_message = started.elapsed().as_secs_f64() / group.len() as f64;
    let histogram = metrics.handler_seconds.get_or_create(&StepOnly {
        step: step.name.to_string(),
    });
    for _ in group {
        histogram.observe(per_message);
    }
    match handled {
        Ok(handled) => {
            for ((index, key_index), outcome) in group.iter().zip(handled.outcomes) {
                results[*index] = Some(ItemOutcome::of(&outcome));
                outcomes.push((*key_index, outcome));
            }
            emitted.extend(handled.emitted);
            Ok(())
        }
        // A lost or read-only database is nobody's fault: the first message waits it out, costing no
        // retry budget, instead of the range going through one message per transaction.
        Err(error) if group.len() == 1 || error.is_database_unavailable() => {
            Err(BatchError::Item {
                index: group[0].0,
                failure: Failure::Handler(error),
            })
        }
        Err(error) if error.message_index().is_some_and(|i| i < group.len()) => {
            let at = error.message_index().unwrap_or(0);
            Err(BatchError::Item {
                index: group[at].0,
                failure: Failure::Handler(error),
            })
        }
        Err(error) => {
            tracing::debug!(%error, messages = group.len(), "a batch handler call failed; narrowing down");
            Err(BatchError::Group)
        }
    }
}
