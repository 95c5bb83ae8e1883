//! The second stage a batch meets, after the crash-loop gate (`crash_gate`): the hold gate. It reads the
//! holds of the batch's keys and the group's paused steps (when anything may be held, or a message comes
//! from the retry topic), and decides each message's part: it runs, is parked behind its key's queue, is
//! its key's head or release, or is a stale copy of a release; and where a key can be held within the batch,
//! which of the batch's messages share a key, so that the batch machine parks a key's later messages behind
//! a dead letter or a parked message of the batch.
//!
//! [`plan`] is the decision, without I/O (the hold model drives it); [`Executor::hold_gate`] performs it.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

use saga_core::Origin;
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;

use crate::connection::{Released, WorkerConnection};
use crate::db_retry::{Tried, with_budget};
use crate::delivery::Delivery;
use crate::executor::Executor;
use crate::hold::{self, BatchHolds, Mark, Role};
use crate::machine::BatchMachine;

/// What the gate knows of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Facts<'a> {
    /// The key it is held under (empty for a keyless message).
    pub key: &'a [u8],
    /// Whether a dead letter of it can hold a key (it has a non-empty key).
    pub keyed: bool,
    /// What it says of itself (a replay, a release).
    pub mark: Mark,
    /// Where it was first consumed (a replay's original coordinates); borrowed from the delivery.
    pub origin: Cow<'a, Origin>,
    /// Its step, if routed to one.
    pub step: Option<&'a str>,
    /// Whether its order policy holds its key behind a dead letter of it.
    pub policy_holds: bool,
}

impl<'a> Facts<'a> {
    /// The facts of `delivery`, whose order policy holds keys or not.
    pub(crate) fn of(delivery: &'a Delivery, policy_holds: bool) -> Self {
        Self {
            key: hold::key_of(&delivery.raw),
            keyed: hold::key_of_held(&delivery.raw).is_some(),
            mark: hold::mark_of(&delivery.raw, delivery.replayed_from.as_ref()),
            origin: Cow::Borrowed(delivery.original()),
            step: delivery.step_name(),
            policy_holds,
        }
    }
}

/// The gate's decision for a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GatePlan {
    /// Each message's part.
    pub roles: Vec<Role>,
    /// Where a key can be held within the batch: each message's key (a small id, for the messages that run
    /// as any other or park), and whether a dead letter of it holds its key (see
    /// [`BatchMachine::with_holds`]).
    pub machine_holds: Option<(Vec<Option<u64>>, Vec<bool>)>,
    /// With delayed retries: whether each message, failing transiently, may wait parked (a keyed message
    /// that runs as any other, or its key's release; see [`BatchMachine::with_defers`]).
    pub defers: Option<Vec<bool>>,
}

/// Each message's part in its key's hold, as `found` (read for the batch; `None`: nothing was read, as
/// nothing can be held) says; and, where some message can hold its key in the batch (a dead letter, or a
/// delayed retry when `delayed_retries`), the batch machine's keys.
pub(crate) fn plan(
    facts: &[Facts<'_>],
    found: Option<&BatchHolds>,
    delayed_retries: bool,
) -> GatePlan {
    // One release of a parked message per batch: a second copy of it (a resend, or a copy of an earlier
    // turn) read from the same snapshot is stale, whatever the first does (a delayed retry parks it again,
    // due later: the copy must not run before).
    let mut releases: HashSet<(&[u8], i64)> = HashSet::new();
    let roles: Vec<Role> = facts
        .iter()
        .map(|f| match found {
            Some(found) => match role(f, found) {
                Role::Release(seq) if !releases.insert((f.key, seq)) => Role::Stale,
                role => role,
            },
            None => Role::Free,
        })
        .collect();
    let holds: Vec<bool> = facts
        .iter()
        .zip(&roles)
        .map(|(f, r)| matches!(r, Role::Release(_) | Role::Head(_)) || f.policy_holds)
        .collect();
    let defers: Option<Vec<bool>> = delayed_retries.then(|| {
        facts
            .iter()
            .zip(&roles)
            .map(|(f, r)| f.keyed && matches!(r, Role::Free | Role::Release(_)))
            .collect()
    });
    let machine_holds = (holds.iter().any(|h| *h)
        || roles.iter().any(|r| *r != Role::Free)
        || defers.as_ref().is_some_and(|d| d.iter().any(|d| *d)))
    .then(|| {
        let mut ids: HashMap<&[u8], u64> = HashMap::new();
        // Only a message that runs as any other (or parks) follows its key's hold within the batch: a
        // head, a release or a stale copy has its own part, never parked behind a letter of the batch.
        let keys = facts
            .iter()
            .zip(&roles)
            .map(|(f, r)| {
                let next = ids.len() as u64;
                (f.keyed && matches!(r, Role::Free | Role::Park))
                    .then(|| *ids.entry(f.key).or_insert(next))
            })
            .collect();
        (keys, holds)
    });
    GatePlan {
        roles,
        machine_holds,
        defers,
    }
}

/// The attempts a message of role `role` has made, `made` here: a release goes on from the attempts its
/// parked message made (a delayed retry's), as its key's `view` says.
pub(crate) fn attempts_of(role: &Role, view: Option<&hold::HeldView>, made: u32) -> u32 {
    match (role, view) {
        (Role::Release(_), Some(view)) => made.max(view.first_attempts),
        _ => made,
    }
}

/// One message's part, as `found` says.
fn role(facts: &Facts<'_>, found: &BatchHolds) -> Role {
    // A keyless message is held by nothing but its own step's pause (it has no key to order by); a release
    // of one follows the queue of keyless messages.
    let view = match (&facts.mark, facts.keyed) {
        (Mark::Plain | Mark::Replay(_), false) => None,
        _ => found.views.get(facts.key),
    };
    let paused = facts.step.is_some_and(|s| found.paused.contains(s));
    hold::classify(view, &facts.mark, &facts.origin, paused)
}

impl Executor {
    /// The hold gate for `deliveries`: reads their holds when anything may be held (without the kept
    /// connection: another reads them), gives each its part, and starts the batch machine. `None` if
    /// cancelled first.
    pub(crate) async fn hold_gate(
        &self,
        deliveries: &mut [Delivery],
        connection: &mut WorkerConnection,
        cancel: &CancellationToken,
    ) -> Option<BatchMachine> {
        let found = if self.must_read_holds(deliveries) {
            Some(
                self.read_batch_holds(deliveries, &connection.release(), cancel)
                    .await?,
            )
        } else {
            None
        };
        let planned = self.apply_plan(deliveries, found.as_ref());
        let kinds = deliveries.iter().map(Delivery::kind).collect();
        let attempts = deliveries.iter().map(|d| d.attempts).collect();
        let mut machine = BatchMachine::new(kinds, attempts, self.retry.max_attempts);
        if let Some((keys, holds)) = planned.machine_holds {
            machine = machine.with_holds(keys, holds);
        }
        if let Some(defers) = planned.defers {
            machine = machine.with_defers(defers);
        }
        Some(machine)
    }

    /// Gives each of `deliveries` its part as `found` says (see [`plan`]); the plan.
    pub(crate) fn apply_plan(
        &self,
        deliveries: &mut [Delivery],
        found: Option<&BatchHolds>,
    ) -> GatePlan {
        let facts: Vec<Facts<'_>> = deliveries
            .iter()
            .map(|d| Facts::of(d, self.policy_holds(d)))
            .collect();
        let planned = plan(&facts, found, self.retry.delayed);
        for (delivery, role) in deliveries.iter_mut().zip(planned.roles.iter().cloned()) {
            if delivery.store_refused.is_some() {
                continue;
            }
            let view = found.and_then(|f| f.views.get(hold::key_of(&delivery.raw)));
            delivery.attempts = attempts_of(&role, view, delivery.attempts);
            delivery.hold = role;
            if delivery.hold == Role::Stale {
                tracing::info!(parent: &delivery.span, "a release of a held key's message that ran already (or out of turn), or its head letter's message again: skipped");
                delivery.known_done = true;
            } else if delivery.hold == Role::Park {
                tracing::info!(parent: &delivery.span, "its key is held: parked behind its queue");
            }
        }
        planned
    }

    /// Reads the holds of `deliveries`' keys and the group's paused steps, waiting out an unavailable
    /// database. A read refused for good is narrowed to each key alone, and a key whose own read is
    /// refused has its messages marked (`store_refused`): they are dead-lettered (`store-refused`) rather
    /// than run out of their key's order. `None` if cancelled first.
    pub(crate) async fn read_batch_holds(
        &self,
        deliveries: &mut [Delivery],
        released: &Released<'_>,
        cancel: &CancellationToken,
    ) -> Option<BatchHolds> {
        let mut keys: Vec<Vec<u8>> = deliveries
            .iter()
            .map(|d| hold::key_of(&d.raw).to_vec())
            .collect();
        keys.sort_unstable();
        keys.dedup();
        let all: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let refused = match self.read_holds(&all, released, cancel).await {
            Tried::Done(found) => return Some(found),
            Tried::Cancelled => return None,
            Tried::Refused(error) => error,
        };
        tracing::warn!(error = %refused, "reading a batch's holds is refused; reading each key alone");
        let mut found = BatchHolds::default();
        let mut refused: HashMap<&[u8], String> = HashMap::new();
        for key in &all {
            match self.read_holds(&[key], released, cancel).await {
                Tried::Done(read) => {
                    found.paused = read.paused;
                    found.views.extend(read.views);
                }
                Tried::Refused(error) => {
                    refused.insert(key, error);
                }
                Tried::Cancelled => return None,
            }
        }
        for delivery in deliveries.iter_mut() {
            if let Some(error) = refused.get(hold::key_of(&delivery.raw)) {
                tracing::error!(parent: &delivery.span, error = %error, "its key's hold cannot be read");
                delivery.store_refused = Some(error.clone());
            }
        }
        Some(found)
    }

    /// The holds of `keys`, read with the budget of the framework's statements.
    async fn read_holds(
        &self,
        keys: &[&[u8]],
        released: &Released<'_>,
        cancel: &CancellationToken,
    ) -> Tried<BatchHolds> {
        with_budget(
            "reading its key's hold",
            &self.budget(),
            cancel,
            released,
            |mut conn| async move {
                let read = read_or_nothing(&self.holds, &mut conn, keys).await;
                (conn, read)
            },
        )
        .await
    }
}

/// The holds of `keys`; in a schema without the hold tables (the consumer's migrations not applied),
/// nothing held.
async fn read_or_nothing(
    holds: &hold::Holds,
    conn: &mut PgConnection,
    keys: &[&[u8]],
) -> Result<BatchHolds, sqlx::Error> {
    match holds.read(conn, keys).await {
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => {
            Ok(BatchHolds::default())
        }
        read => read,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hold::{HeldView, HoldState};

    fn facts<'a>(key: &'a [u8], mark: Mark, step: &'a str, policy_holds: bool) -> Facts<'a> {
        Facts {
            key,
            keyed: !key.is_empty(),
            mark,
            origin: Cow::Owned(Origin {
                topic: "t".into(),
                partition: 0,
                offset: 0,
            }),
            step: Some(step),
            policy_holds,
        }
    }

    fn held() -> HeldView {
        HeldView {
            state: HoldState::Held,
            head_letter: Some("letter-1".into()),
            head_origin: None,
            first: None,
            parked: 0,
            in_flight: None,
            retrying: false,
            first_due: true,
            first_attempts: 0,
        }
    }

    #[test]
    fn nothing_read_runs_everything_and_holds_keys_only_where_a_policy_does() {
        let batch = [
            facts(b"a", Mark::Plain, "s", false),
            facts(b"b", Mark::Plain, "s", false),
        ];
        assert_eq!(
            plan(&batch, None, false),
            GatePlan {
                roles: vec![Role::Free, Role::Free],
                machine_holds: None,
                defers: None,
            }
        );
        // With delayed retries, a keyed message's transient failure can hold its key within the batch.
        let deferring = plan(&batch, None, true);
        assert_eq!(deferring.defers, Some(vec![true, true]));
        assert_eq!(
            deferring.machine_holds,
            Some((vec![Some(0), Some(1)], vec![false, false]))
        );
        let held_by_policy = [
            facts(b"a", Mark::Plain, "s", true),
            facts(b"a", Mark::Plain, "s", true),
        ];
        assert_eq!(
            plan(&held_by_policy, None, false).machine_holds,
            Some((vec![Some(0), Some(0)], vec![true, true]))
        );
    }

    #[test]
    fn a_held_key_parks_its_messages_a_paused_step_too_and_a_keyless_message_follows_only_its_step()
    {
        let mut found = BatchHolds::default();
        found.views.insert(b"a".to_vec(), held());
        found.paused.insert("paused".into());
        let batch = [
            facts(b"a", Mark::Plain, "s", false),
            facts(b"b", Mark::Plain, "s", false),
            facts(b"c", Mark::Plain, "paused", false),
            facts(b"", Mark::Plain, "s", false),
        ];
        let planned = plan(&batch, Some(&found), false);
        assert_eq!(
            planned.roles,
            [Role::Park, Role::Free, Role::Park, Role::Free]
        );
        let (keys, holds) = planned.machine_holds.expect("a key is held in the batch");
        assert_eq!(keys, [Some(0), Some(1), Some(2), None]);
        assert_eq!(holds, [false; 4]);
    }

    #[test]
    fn a_replay_of_the_head_letter_is_the_head_and_holds_its_key_again_if_it_fails() {
        let mut found = BatchHolds::default();
        found.views.insert(b"a".to_vec(), held());
        let batch = [facts(b"a", Mark::Replay("letter-1".into()), "s", false)];
        let planned = plan(&batch, Some(&found), false);
        assert_eq!(planned.roles, [Role::Head("letter-1".into())]);
        assert_eq!(planned.machine_holds, Some((vec![None], vec![true])));
    }

    #[test]
    fn a_second_copy_of_a_release_in_one_batch_is_stale() {
        let origin = Origin {
            topic: "t".into(),
            partition: 0,
            offset: 3,
        };
        let parked = saga_core::RawMessage {
            origin: origin.clone(),
            key: Some(b"a".to_vec()),
            payload: Some(b"{}".to_vec()),
            headers: saga_core::Headers::new(),
            timestamp_ms: None,
        };
        let release = Mark::Release {
            seq: 7,
            origin: origin.clone(),
            digest: hold::digest(&parked),
        };
        let mut found = BatchHolds::default();
        found.views.insert(
            b"a".to_vec(),
            HeldView {
                state: HoldState::Releasing,
                head_letter: None,
                head_origin: None,
                first: Some((7, origin, hold::digest(&parked))),
                parked: 1,
                in_flight: Some(7),
                retrying: true,
                first_due: true,
                first_attempts: 1,
            },
        );
        let batch = [
            facts(b"a", release.clone(), "s", false),
            facts(b"a", release, "s", false),
        ];
        let planned = plan(&batch, Some(&found), true);
        assert_eq!(planned.roles, [Role::Release(7), Role::Stale]);
    }
}
