//! A model of keys in parallel within a partition (`key_lanes`), checked exhaustively with `stateright`.
//!
//! The world: one partition of four messages of three keys (`a b c a`), two consumer processes of one
//! group, each running a window's groups two at a time (a third starts when one ends, as `buffer_unordered`
//! starts them); at most one crash, one revoke (the owner's lanes are cancelled between messages, what they
//! finished is reported and committed, the partition moves) and one eviction (the owner loses the partition
//! at once and finishes its window as a zombie, its offset commits refused). A message's transaction is one
//! step: it claims the step key, or skips a key already done. A lane reports its messages finished when it
//! ends (all run, or cancelled), as `key_lanes::run` does. The decisions are the code's own:
//! [`key_lanes::groups`] forms the lanes, [`Watermark`] says how far the partition is finished. A model
//! flag puts back the old mistake of committing past the highest finished message; the checker must find
//! it.

use stateright::{Model, Property};

use crate::model::has_next;

use crate::key_lanes::{self, Watermark};

/// The partition's messages' keys.
const KEYS: [&[u8]; 4] = [b"a", b"b", b"c", b"a"];
/// Messages in the partition.
const MESSAGES: usize = KEYS.len();
/// Groups of a window run at once.
const KEY_CONCURRENCY: usize = 2;

/// A window in progress: its first offset, each lane's messages (window indices) and how many of them
/// ran, and what is finished.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Window {
    base: usize,
    lanes: Vec<(Vec<usize>, usize)>,
    mark: Watermark,
    /// The highest finished index + 1 (what the mistake would report).
    highest: usize,
}

/// A consumer process.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Worker {
    /// Dead, not restarted yet.
    Down,
    /// Between windows: the next offset it reads.
    Idle(usize),
    /// In a window.
    Running(Window),
}

/// A consumer: its worker, the generation of the assignment it believes it holds, the position it
/// reported for commit.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Consumer {
    worker: Worker,
    assigned: Option<u8>,
    reported: Option<usize>,
}

/// The whole system.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct State {
    committed: usize,
    owner: usize,
    generation: u8,
    done: [bool; MESSAGES],
    effects: [u8; MESSAGES],
    /// Messages in the order their effects happened.
    order: Vec<usize>,
    consumers: [Consumer; 2],
    crashes: u8,
    revokes: u8,
    evictions: u8,
}

/// A step of the system.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Step {
    /// The consumer takes a window from its position to the partition's end.
    Fetch(usize),
    /// Lane `.1` of the consumer's window runs its next message.
    Run(usize, usize),
    /// The consumer's window has no message left to run: it moves on.
    EndWindow(usize),
    /// The consumer commits the position it reported.
    Commit(usize),
    /// The process dies at any moment.
    Crash(usize),
    /// It starts again, and rejoins.
    Restart(usize),
    /// The partition moves to the other consumer: the owner's lanes stop between messages, what they
    /// finished is reported and committed.
    Revoke,
    /// The group evicts the owner: the partition moves at once, the owner goes on as a zombie.
    Evict,
}

/// The model: the checked protocol, and optionally the old mistake.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct LanesModel {
    /// Report the highest finished message's position, not the first unfinished one's.
    pub highest_finished: bool,
}

impl State {
    fn running(&self, c: usize) -> Option<&Window> {
        match &self.consumers[c].worker {
            Worker::Running(w) => Some(w),
            _ => None,
        }
    }

    fn owns(&self, c: usize) -> bool {
        self.owner == c && self.consumers[c].assigned == Some(self.generation)
    }

    /// Gives the partition to `to` under a new generation, from the committed offset.
    fn assign(&mut self, to: usize) {
        self.generation += 1;
        self.owner = to;
        let consumer = &mut self.consumers[to];
        if consumer.worker != Worker::Down {
            consumer.assigned = Some(self.generation);
            consumer.reported = None;
            consumer.worker = Worker::Idle(self.committed);
        }
    }
}

/// The lanes of `w` that may run their next message: of the lanes started (the first `KEY_CONCURRENCY`,
/// and one more for each that ended), those not ended.
fn started(w: &Window) -> Vec<usize> {
    let ended = w.lanes.iter().filter(|(m, ran)| *ran == m.len()).count();
    let started = (KEY_CONCURRENCY + ended).min(w.lanes.len());
    (0..started)
        .filter(|&lane| w.lanes[lane].1 < w.lanes[lane].0.len())
        .collect()
}

impl LanesModel {
    /// A lane of consumer `c`'s window ended having finished `finished` (window indices): the mark moves,
    /// and the position is reported, as `key_lanes::run` does (or, with the mistake, the highest).
    fn lane_ended(&self, s: &mut State, c: usize, finished: &[usize]) {
        let Worker::Running(w) = &mut s.consumers[c].worker else {
            return;
        };
        for &index in finished {
            w.mark.finish(index);
            w.highest = w.highest.max(index + 1);
        }
        let reported = if self.highest_finished {
            w.highest
        } else {
            w.mark.prefix()
        };
        if reported > 0 {
            s.consumers[c].reported = Some(w.base + reported);
        }
    }
}

impl Model for LanesModel {
    type State = State;
    type Action = Step;

    fn init_states(&self) -> Vec<State> {
        let idle = |assigned| Consumer {
            worker: Worker::Idle(0),
            assigned,
            reported: None,
        };
        vec![State {
            committed: 0,
            owner: 0,
            generation: 0,
            done: [false; MESSAGES],
            effects: [0; MESSAGES],
            order: Vec::new(),
            consumers: [idle(Some(0)), idle(None)],
            crashes: 1,
            revokes: 1,
            evictions: 1,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Step>) {
        for c in 0..2 {
            let consumer = &s.consumers[c];
            match &consumer.worker {
                Worker::Down => actions.push(Step::Restart(c)),
                Worker::Idle(position) => {
                    if s.owns(c) && *position < MESSAGES {
                        actions.push(Step::Fetch(c));
                    }
                }
                Worker::Running(w) => {
                    for lane in started(w) {
                        actions.push(Step::Run(c, lane));
                    }
                    if w.lanes.iter().all(|(messages, ran)| *ran == messages.len()) {
                        actions.push(Step::EndWindow(c));
                    }
                }
            }
            if consumer.reported.is_some_and(|r| r != s.committed) && consumer.assigned.is_some() {
                actions.push(Step::Commit(c));
            }
            if s.crashes > 0 && consumer.worker != Worker::Down {
                actions.push(Step::Crash(c));
            }
        }
        if s.revokes > 0 {
            actions.push(Step::Revoke);
        }
        if s.evictions > 0 && s.running(s.owner).is_some() {
            actions.push(Step::Evict);
        }
    }

    fn next_state(&self, last: &State, step: Step) -> Option<State> {
        let mut s = last.clone();
        match step {
            Step::Fetch(c) => {
                let Worker::Idle(base) = s.consumers[c].worker else {
                    return None;
                };
                let keys = &KEYS[base..];
                // A window of one key would be a batch; the lanes' decision covers it as one group.
                let lanes = key_lanes::groups(keys)
                    .into_iter()
                    .map(|g| (g, 0))
                    .collect();
                s.consumers[c].worker = Worker::Running(Window {
                    base,
                    lanes,
                    mark: Watermark::new(keys.len()),
                    highest: 0,
                });
            }
            Step::Run(c, lane) => {
                let Worker::Running(w) = &mut s.consumers[c].worker else {
                    return None;
                };
                let (messages, ran) = &mut w.lanes[lane];
                let index = messages[*ran];
                *ran += 1;
                let m = w.base + index;
                if !s.done[m] {
                    s.done[m] = true;
                    s.effects[m] += 1;
                    s.order.push(m);
                }
                if *ran == messages.len() {
                    let ended = messages.clone();
                    self.lane_ended(&mut s, c, &ended);
                }
            }
            Step::EndWindow(c) => {
                let Worker::Running(w) = &s.consumers[c].worker else {
                    return None;
                };
                s.consumers[c].worker = Worker::Idle(w.base + w.mark.prefix());
            }
            Step::Commit(c) => {
                let consumer = &s.consumers[c];
                // A commit of an assignment the group moved on from is refused.
                if s.owns(c) {
                    s.committed = consumer.reported.expect("a commit of a reported position");
                }
                s.consumers[c].reported = None;
            }
            Step::Crash(c) => {
                s.crashes -= 1;
                s.consumers[c] = Consumer {
                    worker: Worker::Down,
                    assigned: None,
                    reported: None,
                };
            }
            Step::Restart(c) => {
                s.consumers[c].worker = Worker::Idle(s.committed);
                if s.owner == c {
                    // Rejoining, it gets the partition back under a new generation.
                    s.assign(c);
                }
            }
            Step::Revoke => {
                s.revokes -= 1;
                let from = s.owner;
                // The lanes stop between messages; each reports what it ran.
                if let Worker::Running(w) = &s.consumers[from].worker {
                    let ran: Vec<usize> = w
                        .lanes
                        .iter()
                        .flat_map(|(messages, ran)| messages[..*ran].to_vec())
                        .collect();
                    self.lane_ended(&mut s, from, &ran);
                }
                if s.consumers[from].worker != Worker::Down {
                    if let Some(reported) = s.consumers[from].reported.take()
                        && s.owns(from)
                    {
                        s.committed = reported;
                    }
                    s.consumers[from].worker = Worker::Idle(s.committed);
                }
                s.consumers[from].assigned = None;
                s.assign(1 - from);
            }
            Step::Evict => {
                s.evictions -= 1;
                s.assign(1 - s.owner);
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("a step's effect happens at most once", |_, s: &State| {
                s.effects.iter().all(|e| *e <= 1)
            }),
            Property::always(
                "the committed offset is never past an unfinished message",
                |_, s: &State| (0..s.committed).all(|m| s.done[m]),
            ),
            Property::always(
                "each key's effects happen in offset order",
                |_, s: &State| {
                    KEYS.iter().all(|key| {
                        let of_key: Vec<usize> = s
                            .order
                            .iter()
                            .copied()
                            .filter(|m| KEYS[*m] == *key)
                            .collect();
                        of_key.windows(2).all(|pair| pair[0] < pair[1])
                    })
                },
            ),
            Property::always(
                "with nothing left to do, every message took effect once and the offset passed them all",
                |model: &Self, s: &State| {
                    has_next(model, s) || (s.committed == MESSAGES && s.effects == [1; MESSAGES])
                },
            ),
            Property::sometimes(
                "two keys' messages ran while an earlier one of the window was unfinished",
                |_, s: &State| {
                    s.consumers.iter().any(|c| match &c.worker {
                        Worker::Running(w) => w.mark.prefix() == 0 && w.highest > 1,
                        _ => false,
                    })
                },
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use stateright::Checker;

    use super::*;
    use crate::model::{explore, find};

    #[test]
    fn keys_in_parallel_keep_effects_once_in_key_order_and_commits_behind_unfinished_messages() {
        explore(&LanesModel::default(), None).assert_properties();
    }

    #[test]
    fn committing_past_the_highest_finished_message_is_found() {
        const PAST: &str = "the committed offset is never past an unfinished message";
        let checker = find(
            &LanesModel {
                highest_finished: true,
            },
            PAST,
        );
        let path = checker.assert_any_discovery(PAST);
        println!("counterexample: {:?}", path.into_actions());
    }
}
