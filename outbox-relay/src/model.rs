//! A model of the relay's protocol, checked exhaustively with `stateright`: relays joining, rebalancing,
//! publishing, leaving and dying over a shared outbox, with failed deliveries.
//!
//! Stateright, not loom or shuttle: the subject is a protocol between processes (relays, the database's
//! advisory locks, the broker), not in-process concurrency. The decisions are the code's own: each relay
//! plans its rebalance with [`plan`] and sends its batch's rows with [`KeyOrder`]; the model plays the
//! lock table (session locks stack, as PostgreSQL's do), the broker (a delivery is acknowledged and
//! appended, or fails) and the relays' deaths. A relay that stalls is one that takes no step for a while:
//! every interleaving is explored, stalls included.
//!
//! The world: [`ROWS`] outbox rows, two of key `a` (shard 0) and one of key `b` (shard 1), two shards, two
//! relays; at most one failed delivery, one relay death and one graceful leave.

use std::collections::BTreeSet;

use stateright::{Model, Property};

use crate::key_order::KeyOrder;
use crate::shards::{Plan, plan};

/// Rows of the outbox, in id order: (key, shard).
const ROWS: [(char, i16); 3] = [('a', 0), ('a', 0), ('b', 1)];
/// Shards of the model's outbox.
const SHARDS: i16 = 2;
/// Steps explored by default (the CI's run); `SAGA_MODEL_DEPTH` explores deeper.
pub(crate) const DEPTH: usize = 40;
/// Relay instances (each plans with its index as its instance number).
const RELAYS: usize = 2;

/// A relay's batch in progress.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Batch {
    /// The rows fetched, in id order.
    rows: Vec<usize>,
    order: KeyOrder<char>,
    /// Rows handed to the producer, not yet acknowledged or failed.
    in_flight: Vec<usize>,
    /// Rows the broker acknowledged.
    acked: Vec<usize>,
}

/// A relay process.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Relay {
    /// Running, with its session (and its locks).
    up: bool,
    /// The shards it believes it owns.
    owned: BTreeSet<i16>,
    batch: Option<Batch>,
}

/// The whole system.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct State {
    /// Rows marked published.
    published: [bool; ROWS.len()],
    /// The topic: rows in the order the broker appended them.
    topic: Vec<usize>,
    /// Each shard's session lock: its holder and how many times it took it.
    locks: [Option<(usize, u8)>; SHARDS as usize],
    relays: [Relay; RELAYS],
    failures: u8,
    deaths: u8,
    leaves: u8,
}

/// A step of the system.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Step {
    /// A relay starts (its session joins the members).
    Join(usize),
    /// A relay takes or gives up shards.
    Rebalance(usize),
    /// A relay reads its shards' unpublished rows and sends what [`KeyOrder`] lets it.
    Fetch(usize),
    /// The broker acknowledges a row in flight (and appends it), or its delivery fails.
    Deliver { relay: usize, row: usize, ok: bool },
    /// A relay marks the rows acknowledged.
    Mark(usize),
    /// A relay dies: its session, locks and batch are gone.
    Dies(usize),
    /// A relay stops gracefully between batches.
    Leaves(usize),
}

/// The model, and optionally an old bug reintroduced.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RelayModel {
    /// Before the fix: every row of a batch is sent at once.
    pub send_all_at_once: bool,
    /// Before the fix: a rebalance tries to lock shards it owns already (the session lock stacks), and a
    /// release unlocks once.
    pub lock_owned_again: bool,
}

impl State {
    fn members(&self) -> i64 {
        self.relays.iter().filter(|r| r.up).count() as i64
    }

    fn unlock_all(&mut self, relay: usize) {
        for lock in &mut self.locks {
            if lock.is_some_and(|(holder, _)| holder == relay) {
                *lock = None;
            }
        }
    }

    /// The relay's rebalance: what changes, or `None` when nothing would.
    fn rebalanced(&self, relay: usize, lock_owned_again: bool) -> Option<State> {
        let mut s = self.clone();
        let owned = &self.relays[relay].owned;
        match plan(
            owned,
            self.members(),
            i32::try_from(relay).unwrap_or(0),
            SHARDS,
        ) {
            Plan::Keep => return None,
            Plan::Release(extra) => {
                for shard in extra {
                    let lock = &mut s.locks[shard as usize];
                    *lock = match *lock {
                        // The old release: one unlock, which leaves a stacked lock held.
                        Some((holder, n)) if lock_owned_again && holder == relay && n > 1 => {
                            Some((holder, n - 1))
                        }
                        // `release` unlocks until the lock is gone.
                        _ => None,
                    };
                    s.relays[relay].owned.remove(&shard);
                }
            }
            Plan::Acquire {
                mut candidates,
                want,
            } => {
                if lock_owned_again {
                    // The old candidates: every shard from the instance's place, owned ones included.
                    candidates = (0..SHARDS)
                        .cycle()
                        .skip(relay % SHARDS as usize)
                        .take(SHARDS as usize)
                        .collect();
                }
                let mut acquired = 0;
                for shard in candidates {
                    if acquired == want {
                        break;
                    }
                    let lock = &mut s.locks[shard as usize];
                    match *lock {
                        None => *lock = Some((relay, 1)),
                        // A session lock taken again by its holder stacks.
                        Some((holder, n)) if holder == relay => *lock = Some((holder, n + 1)),
                        Some(_) => continue,
                    }
                    acquired += 1;
                    s.relays[relay].owned.insert(shard);
                }
            }
        }
        (s != *self).then_some(s)
    }
}

impl Model for RelayModel {
    type State = State;
    type Action = Step;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            published: [false; ROWS.len()],
            topic: Vec::new(),
            locks: [None; SHARDS as usize],
            relays: std::array::from_fn(|_| Relay {
                up: false,
                owned: BTreeSet::new(),
                batch: None,
            }),
            failures: 1,
            deaths: 1,
            leaves: 1,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Step>) {
        for r in 0..RELAYS {
            let relay = &s.relays[r];
            if !relay.up {
                actions.push(Step::Join(r));
                continue;
            }
            match &relay.batch {
                None => {
                    if s.rebalanced(r, self.lock_owned_again).is_some() {
                        actions.push(Step::Rebalance(r));
                    }
                    if (0..ROWS.len()).any(|i| !s.published[i] && relay.owned.contains(&ROWS[i].1))
                    {
                        actions.push(Step::Fetch(r));
                    }
                    if s.leaves > 0 {
                        actions.push(Step::Leaves(r));
                    }
                }
                Some(batch) if batch.in_flight.is_empty() => actions.push(Step::Mark(r)),
                Some(batch) => {
                    for row in &batch.in_flight {
                        actions.push(Step::Deliver {
                            relay: r,
                            row: *row,
                            ok: true,
                        });
                        if s.failures > 0 {
                            actions.push(Step::Deliver {
                                relay: r,
                                row: *row,
                                ok: false,
                            });
                        }
                    }
                }
            }
            if s.deaths > 0 {
                actions.push(Step::Dies(r));
            }
        }
    }

    fn next_state(&self, last: &State, step: Step) -> Option<State> {
        let mut s = last.clone();
        match step {
            Step::Join(r) => s.relays[r].up = true,
            Step::Rebalance(r) => return last.rebalanced(r, self.lock_owned_again),
            Step::Fetch(r) => {
                let owned = s.relays[r].owned.clone();
                let rows: Vec<usize> = (0..ROWS.len())
                    .filter(|i| !s.published[*i] && owned.contains(&ROWS[*i].1))
                    .collect();
                let mut order = if self.send_all_at_once {
                    KeyOrder::all_at_once()
                } else {
                    KeyOrder::new()
                };
                let in_flight = rows
                    .iter()
                    .enumerate()
                    .filter(|(index, row)| order.offer(*index, ROWS[**row].0))
                    .map(|(_, row)| *row)
                    .collect();
                s.relays[r].batch = Some(Batch {
                    rows,
                    order,
                    in_flight,
                    acked: Vec::new(),
                });
            }
            Step::Deliver { relay, row, ok } => {
                let batch = s.relays[relay].batch.as_mut().expect("a batch");
                batch.in_flight.retain(|r| *r != row);
                let key = ROWS[row].0;
                if ok {
                    s.topic.push(row);
                    batch.acked.push(row);
                    if let Some(next) = batch.order.acked(&key) {
                        batch.in_flight.push(batch.rows[next]);
                    }
                } else {
                    s.failures -= 1;
                    batch.order.failed(&key);
                }
            }
            Step::Mark(r) => {
                let batch = s.relays[r].batch.take().expect("a batch");
                for row in batch.acked {
                    s.published[row] = true;
                }
            }
            Step::Dies(r) => {
                s.deaths -= 1;
                s.unlock_all(r);
                s.relays[r] = Relay {
                    up: false,
                    owned: BTreeSet::new(),
                    batch: None,
                };
            }
            Step::Leaves(r) => {
                s.leaves -= 1;
                s.unlock_all(r);
                s.relays[r].up = false;
                s.relays[r].owned.clear();
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "for one key, rows reach the topic in id order (a later row never before an earlier one)",
                |_, s: &State| {
                    let first = |row: usize| s.topic.iter().position(|r| *r == row);
                    (0..ROWS.len()).all(|later| {
                        (0..later)
                            .filter(|earlier| ROWS[*earlier].0 == ROWS[later].0)
                            .all(|earlier| match (first(earlier), first(later)) {
                                (_, None) => true,
                                (Some(e), Some(l)) => e < l,
                                (None, Some(_)) => false,
                            })
                    })
                },
            ),
            Property::always("no shard is owned by two relays", |_, s: &State| {
                (0..SHARDS).all(|shard| {
                    s.relays
                        .iter()
                        .filter(|r| r.up && r.owned.contains(&shard))
                        .count()
                        <= 1
                })
            }),
            Property::always(
                "a relay never takes a shard's lock twice (session locks stack)",
                |_, s: &State| s.locks.iter().all(|lock| lock.is_none_or(|(_, n)| n == 1)),
            ),
            Property::always(
                "a shard's lock is held only by a relay that knows it owns it",
                |_, s: &State| {
                    s.locks.iter().enumerate().all(|(shard, lock)| {
                        lock.is_none_or(|(holder, _)| {
                            s.relays[holder].owned.contains(&(shard as i16))
                        })
                    })
                },
            ),
            Property::always(
                "with nothing left to do, every row is published and every shard owned",
                |model: &Self, s: &State| {
                    let mut next = Vec::new();
                    model.actions(s, &mut next);
                    // Relays may always die or leave while they can: only a state where they cannot
                    // any more, and nothing else is left, is the end.
                    let only_endings = next
                        .iter()
                        .all(|a| matches!(a, Step::Dies(_) | Step::Leaves(_) | Step::Join(_)));
                    !only_endings
                        || s.relays.iter().any(|r| !r.up)
                        || (s.published.iter().all(|p| *p)
                            && (0..SHARDS)
                                .all(|shard| s.relays.iter().any(|r| r.owned.contains(&shard))))
                },
            ),
            Property::sometimes(
                "a row reaches the topic twice (acknowledged, not marked)",
                |_, s: &State| {
                    (0..ROWS.len()).any(|row| s.topic.iter().filter(|r| **r == row).count() > 1)
                },
            ),
            Property::sometimes(
                "every row is published with both relays sharing the shards",
                |_, s: &State| {
                    s.published.iter().all(|p| *p) && s.relays.iter().all(|r| r.owned.len() == 1)
                },
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use stateright::Checker;

    use super::*;

    /// The depth explored: `SAGA_MODEL_DEPTH` steps, or the default, which CI runs.
    fn depth() -> usize {
        std::env::var("SAGA_MODEL_DEPTH")
            .ok()
            .and_then(|d| d.parse().ok())
            .unwrap_or(DEPTH)
    }

    #[test]
    fn the_relays_protocol_holds_in_every_interleaving() {
        let started = Instant::now();
        let checker = RelayModel::default()
            .checker()
            .target_max_depth(depth())
            .spawn_bfs()
            .join();
        println!(
            "relay model: {} states ({} unique), depth {}, {:?}",
            checker.state_count(),
            checker.unique_state_count(),
            checker.max_depth(),
            started.elapsed()
        );
        checker.assert_properties();
    }

    #[test]
    fn sending_a_keys_rows_at_once_is_found_to_reorder_them() {
        let checker = RelayModel {
            send_all_at_once: true,
            ..RelayModel::default()
        }
        .checker()
        .target_max_depth(depth())
        .spawn_bfs()
        .join();
        let path = checker.assert_any_discovery(
            "for one key, rows reach the topic in id order (a later row never before an earlier one)",
        );
        println!("counterexample: {:?}", path.into_actions());
    }

    #[test]
    fn locking_an_owned_shard_again_is_found_to_stack_its_lock() {
        let checker = RelayModel {
            lock_owned_again: true,
            ..RelayModel::default()
        }
        .checker()
        .target_max_depth(depth())
        .spawn_bfs()
        .join();
        let path = checker
            .assert_any_discovery("a relay never takes a shard's lock twice (session locks stack)");
        println!("counterexample: {:?}", path.into_actions());
    }
}
