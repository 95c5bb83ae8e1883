//! A model of the consumer's protocol, checked exhaustively with `stateright` (breadth first, every
//! interleaving up to the model's bounds).
//!
//! Stateright, not loom or shuttle: the subject is a distributed protocol (two consumer processes, the
//! group's assignment and committed offset, the database's step keys and crash-loop record, the dead-letter
//! topic), whose steps are whole messages and transactions, not an in-process data structure whose atomics
//! interleave. The decisions within a batch are the code's own: each process drives the real
//! [`BatchMachine`], and the model only plays the world around it (the transaction's claim and outcome,
//! crashes, rebalances, the database going away, the guard's record). The crash-loop record's decisions
//! are `crash_record`'s (which the SQL is held to) and the choice to record a batch beside its transaction
//! is the crash gate's `recording`: a batch recorded beside runs its handlers (and may die) before its record
//! is in, and commits or dead-letters nothing until it is. Batches take at most [`BATCH`] messages, so a
//! restart behind the committed offset redelivers whole batches before the range its last run died in.
//!
//! The world: one partition of [`MESSAGES`] messages, each with a script (it succeeds, fails once, fails
//! for good, or kills the process that handles it); two consumer processes of one group; at most one random
//! crash, one rebalance and one database outage, anywhere. A consumer that loses the partition (a zombie)
//! may still finish its batch: its transactions can commit, its offset commits are refused. A claimed step
//! key is locked until its transaction ends; the claim waits for a key another transaction holds.

use stateright::{Model, Property};

use crate::crash_record::{self, Record, Suspect};
use crate::dlq::DeadLetterReason;
use crate::machine::{Action, BatchMachine, Event, Fault, Kind};

/// Messages in the partition.
pub(crate) const MESSAGES: usize = 3;
/// Messages a batch takes at most: fewer than the partition holds, so that a restart behind the committed
/// offset redelivers whole batches before the range its last run died in.
const BATCH: usize = 2;
/// Consumer processes in the group.
const CONSUMERS: usize = 2;
/// Counted attempts before a transiently failing message is dead-lettered.
const MAX_ATTEMPTS: u32 = 2;
/// Steps explored by default (the CI's run); `SAGA_MODEL_DEPTH` explores deeper. Three messages through a
/// failure, a death, a rebalance and an outage take about twenty steps, a death loop more; the world with a zombie beside
/// the new owner is explored to [`EVICTION_DEPTH`] (its states grow faster).
pub(crate) const DEPTH: usize = 60;
/// Steps explored by default in the world with an eviction.
pub(crate) const EVICTION_DEPTH: usize = 24;
/// Isolated starts without a finish after which a message is dead-lettered as `crash-loop`.
const CRASH_LOOP_LIMIT: u8 = 2;
/// The property that a message killing every process handling it is dead-lettered. Before it is, in the
/// model's whole batches, it kills at most: one process in a batch whose record it outran (recorded beside
/// the transaction, the record not in when the handler killed; the restart then blames the batch before
/// it, whose range was the last recorded), one in the next batch, recorded first, and one per isolated start
/// up to the limit. (A real batch takes what is queued: a short batch recorded first may end before the
/// killer and say "clear", and the killer's batch, recorded beside, may outrun its record again. Each such
/// death moves the record forward, so the deaths stay bounded by the batches before the killer. Once it is
/// dead-lettered, a death before its offset commits redelivers it and its count starts again: bounded by
/// those deaths, not checked here.)
const KILLER_STOPPED: &str = "a message that kills the process is dead-lettered before it kills more \
                              processes than the crash-loop limit and two";

/// What handling a message does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Script {
    /// Succeeds.
    Succeeds,
    /// Fails transiently once, then succeeds.
    FailsOnce,
    /// Fails for good.
    Fails,
    /// Kills the process handling it, every time.
    Kills,
}

/// A consumer process.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Worker {
    /// Dead, not restarted yet.
    Down,
    /// Between batches: `position` is the next message it reads.
    Idle { position: usize },
    /// In a batch of messages `base..base + len`.
    Batch(Box<Batch>),
}

/// A batch in progress.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Batch {
    base: usize,
    len: usize,
    /// Whether the crash-loop guard isolated it.
    isolated: bool,
    machine: BatchMachine,
    /// The machine's action being performed.
    pending: Option<Action>,
    /// For a transaction: the messages whose step keys it claimed (new ones; the others were done).
    claimed: Option<Vec<usize>>,
    /// Its record is being written beside it: its handlers run (and may kill the process) before the
    /// record is in; nothing of it commits or is dead-lettered until it is.
    beside: bool,
    /// Its record, written beside it, said the range is a suspect's: its handlers go on (and may kill the
    /// process), nothing of it takes effect, and it goes again with its first message alone.
    refused: bool,
}

/// A consumer process and the assignment it believes it holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Consumer {
    worker: Worker,
    /// The group generation of its assignment (offset commits carry it).
    generation: Option<u8>,
    /// Whether its last record left the partition clear (the crash gate's `clear`).
    clear: bool,
}

/// The whole system.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct State {
    scripts: [Script; MESSAGES],
    // The broker.
    committed: usize,
    owner: usize,
    generation: u8,
    dead_letters: Vec<(usize, DeadLetterReason, String)>,
    // The database.
    done: [bool; MESSAGES],
    effects: [u8; MESSAGES],
    claims: [Option<usize>; MESSAGES],
    fails_left: [u8; MESSAGES],
    record: Option<Record>,
    deaths: [u8; MESSAGES],
    /// How many processes each message's handler killed.
    kills: [u8; MESSAGES],
    // The processes.
    consumers: [Consumer; CONSUMERS],
    // What may still go wrong.
    crashes: u8,
    rebalances: u8,
    evictions: u8,
    outages: u8,
}

/// A step of the system.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Step {
    /// The assigned consumer starts a batch (after the crash-loop guard's check).
    Fetch(usize),
    /// The record written beside a consumer's batch is in.
    RecordLands(usize),
    /// A batch whose record said its range is a suspect's goes again, its first message alone.
    Redo(usize),
    /// A consumer asks its machine what to do next.
    Decide(usize),
    /// The transaction claims its messages' step keys.
    Claim(usize),
    /// The transaction commits.
    Commit(usize),
    /// Message `.1`'s handler fails.
    ItemFails(usize, usize),
    /// A statement over the batch fails, naming no message.
    GroupFails(usize),
    /// The database is unavailable.
    Outage(usize),
    /// A handler kills the process.
    Dies(usize),
    /// The wait is over, or the dead letter is acknowledged.
    Finish(usize),
    /// The consumer commits its finished offset.
    CommitOffset(usize),
    /// The process dies at a random moment.
    Crash(usize),
    /// The process starts again.
    Restart(usize),
    /// The partition moves to the other consumer once the owner's revoke callback drained it: its batch
    /// finished, its offset committed.
    Rebalance,
    /// The group evicts the owner (stalled past its session): the partition moves at once, the owner
    /// finishes its batch as a zombie.
    Evict,
}

/// The model: the checked protocol, the world's bounds, and optionally a bug reintroduced in the world's
/// reports.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ConsumerModel {
    /// The executor's old bug: a failure of a statement over several messages reported as the first
    /// message's own (a healthy message dead-lettered with another's error).
    pub blame_the_first: bool,
    /// How many times the group may evict a stalled owner: it loses the partition without its revoke
    /// callback having drained it, and finishes its batch as a zombie.
    pub evictions: u8,
    /// The crash-loop record's old rule: a batch wholly before the recorded range replaced it, so a restart
    /// behind the committed offset forgot the range its last run died in.
    pub forget_a_rewound_range: bool,
    /// The crash gate's old rule: every batch recorded beside its transaction, the partition known clear or
    /// not, so a suspect range's first message ran before the record said it was to go alone.
    pub beside_always: bool,
}

/// `saga_consumer_begin_batch` before the rewind was kept: only a batch overlapping the recorded range
/// made it suspect, and the suspect range reached down to the partition's start.
fn begin_forgetting(prev: Option<Record>, first: i64, last: i64) -> (Record, bool) {
    let mut until = prev.and_then(|p| p.suspect).map(|s| s.until);
    if let Some(p) = prev.filter(|p| p.first <= last && first <= p.last) {
        until = Some(until.unwrap_or(p.last).max(p.last));
    }
    let until = until.filter(|u| first <= *u);
    let isolate = until.is_some();
    let record = Record {
        first,
        last: if isolate { first } else { last },
        suspect: until.map(|until| Suspect { from: None, until }),
    };
    (record, isolate)
}

/// What consumer `c`'s batch `b` may do next.
fn batch_actions(s: &State, c: usize, b: &Batch, actions: &mut Vec<Step>) {
    match (&b.pending, &b.claimed) {
        (None, _) => actions.push(Step::Decide(c)),
        (Some(Action::Transact { start, end }), None) => {
            let mut range = b.base + start..b.base + end;
            if range.all(|m| s.claims[m].is_none_or(|o| o == c)) {
                actions.push(Step::Claim(c));
            }
        }
        (Some(Action::Transact { start, end }), Some(claimed)) => {
            if claimed.iter().any(|m| s.scripts[*m] == Script::Kills) {
                actions.push(Step::Dies(c));
            } else {
                let failing: Vec<usize> = claimed
                    .iter()
                    .copied()
                    .filter(|m| fault_of(s.scripts[*m], s.fails_left[*m], *m).is_some())
                    .collect();
                // Its commit waits for its record (and one refused never comes).
                if failing.is_empty() && !b.beside && !b.refused {
                    actions.push(Step::Commit(c));
                }
                for m in &failing {
                    actions.push(Step::ItemFails(c, *m));
                }
                if end - start > 1 && !failing.is_empty() {
                    actions.push(Step::GroupFails(c));
                }
                if s.outages > 0 {
                    actions.push(Step::Outage(c));
                }
            }
        }
        // A wait or a dead letter waits for its record too.
        (Some(_), _) if !b.beside && !b.refused => actions.push(Step::Finish(c)),
        (Some(_), _) => {}
    }
}

impl ConsumerModel {
    /// Consumer `c` records a batch of `len` from `position` (`saga_consumer_begin_batch`): whether it is
    /// a suspect's. The consumer learns whether the partition is clear.
    fn record(&self, s: &mut State, c: usize, position: usize, len: usize) -> bool {
        let begin = if self.forget_a_rewound_range {
            begin_forgetting
        } else {
            crash_record::begin
        };
        let (record, suspect) = begin(s.record, offset(position), offset(position + len - 1));
        s.record = Some(record);
        s.consumers[c].clear = record.clear();
        suspect
    }
}

fn offset(m: usize) -> i64 {
    i64::try_from(m).expect("a model's offset")
}

fn all_scripts() -> Vec<[Script; MESSAGES]> {
    let each = [
        Script::Succeeds,
        Script::FailsOnce,
        Script::Fails,
        Script::Kills,
    ];
    let mut out = Vec::new();
    for a in each {
        for b in each {
            for c in each {
                out.push([a, b, c]);
            }
        }
    }
    out
}

fn fault_of(script: Script, fails_left: u8, m: usize) -> Option<Fault> {
    match script {
        Script::Fails => Some(Fault::Permanent(format!("m{m}"))),
        Script::FailsOnce if fails_left > 0 => Some(Fault::Transient(format!("m{m}"))),
        _ => None,
    }
}

impl State {
    fn batch(&self, c: usize) -> Option<&Batch> {
        match &self.consumers[c].worker {
            Worker::Batch(b) => Some(b),
            _ => None,
        }
    }

    fn batch_mut(&mut self, c: usize) -> &mut Batch {
        match &mut self.consumers[c].worker {
            Worker::Batch(b) => b,
            w => panic!("consumer {c} is not in a batch: {w:?}"),
        }
    }

    fn holds_assignment(&self, c: usize) -> bool {
        self.owner == c && self.consumers[c].generation == Some(self.generation)
    }

    /// Everything before the returned offset is finished by consumer `c`.
    fn finished_upto(&self, c: usize) -> usize {
        match &self.consumers[c].worker {
            Worker::Down => 0,
            Worker::Idle { position } => *position,
            Worker::Batch(b) => b.base + b.machine.finished(),
        }
    }

    fn release_claims(&mut self, c: usize) {
        for claim in &mut self.claims {
            if *claim == Some(c) {
                *claim = None;
            }
        }
    }

    fn kill(&mut self, c: usize) {
        self.release_claims(c);
        self.consumers[c] = Consumer {
            worker: Worker::Down,
            generation: None,
            clear: false,
        };
        if self.owner == c {
            // The group notices: a new generation, which the dead process's commits no longer match.
            self.generation += 1;
        }
    }

    /// Consumer `c` starts a batch of up to `wanted` messages from `position`, its record in: alone if
    /// `suspect` (its start counted, or dead-lettered as a crash loop past the limit).
    fn start(&mut self, c: usize, position: usize, wanted: usize, suspect: bool) {
        let (len, kinds, attempts) = if suspect {
            if self.deaths[position] >= CRASH_LOOP_LIMIT {
                (
                    1,
                    vec![Kind::Poison(DeadLetterReason::CrashLoop)],
                    vec![u32::from(self.deaths[position])],
                )
            } else {
                self.deaths[position] += 1;
                (1, vec![Kind::Transactional], vec![0])
            }
        } else {
            (wanted, vec![Kind::Transactional; wanted], vec![0; wanted])
        };
        self.consumers[c].worker = Worker::Batch(Box::new(Batch {
            base: position,
            len,
            isolated: suspect,
            machine: BatchMachine::new(kinds, attempts, MAX_ATTEMPTS),
            pending: None,
            claimed: None,
            beside: false,
            refused: false,
        }));
    }

    fn dead_lettered(&self, m: usize) -> bool {
        self.dead_letters.iter().any(|(n, _, _)| *n == m)
    }

    /// The transaction's outcome is handed to the machine; the claims end with it.
    fn answer(&mut self, c: usize, event: Event) {
        self.release_claims(c);
        let batch = self.batch_mut(c);
        batch.claimed = None;
        batch.pending = None;
        batch.machine.on(event);
    }
}

impl Model for ConsumerModel {
    type State = State;
    type Action = Step;

    fn init_states(&self) -> Vec<State> {
        all_scripts()
            .into_iter()
            .map(|scripts| State {
                scripts,
                committed: 0,
                owner: 0,
                generation: 0,
                dead_letters: Vec::new(),
                done: [false; MESSAGES],
                effects: [0; MESSAGES],
                claims: [None; MESSAGES],
                fails_left: scripts.map(|s| u8::from(s == Script::FailsOnce)),
                record: None,
                deaths: [0; MESSAGES],
                kills: [0; MESSAGES],
                consumers: std::array::from_fn(|_| Consumer {
                    worker: Worker::Idle { position: 0 },
                    generation: None,
                    clear: false,
                }),
                crashes: 1,
                rebalances: 1,
                evictions: self.evictions,
                outages: 1,
            })
            .collect()
    }

    fn actions(&self, s: &State, actions: &mut Vec<Step>) {
        for c in 0..CONSUMERS {
            match &s.consumers[c].worker {
                Worker::Down => actions.push(Step::Restart(c)),
                Worker::Idle { position } => {
                    let position = if s.consumers[c].generation == Some(s.generation) {
                        *position
                    } else {
                        s.committed
                    };
                    if s.owner == c && position < MESSAGES {
                        actions.push(Step::Fetch(c));
                    }
                }
                Worker::Batch(b) => {
                    if b.beside {
                        // Its record is being written beside it: it may land at any moment.
                        actions.push(Step::RecordLands(c));
                    }
                    if b.refused {
                        actions.push(Step::Redo(c));
                    }
                    batch_actions(s, c, b, actions);
                }
            }
            if !matches!(s.consumers[c].worker, Worker::Down) {
                if s.holds_assignment(c) && s.finished_upto(c) > s.committed {
                    actions.push(Step::CommitOffset(c));
                }
                if s.crashes > 0 {
                    actions.push(Step::Crash(c));
                }
            }
        }
        // The revoke callback waits for the owner's batch (a dead owner has none).
        if s.rebalances > 0 && s.batch(s.owner).is_none() {
            actions.push(Step::Rebalance);
        }
        if s.evictions > 0 {
            actions.push(Step::Evict);
        }
    }

    fn next_state(&self, last: &State, step: Step) -> Option<State> {
        let mut s = last.clone();
        match step {
            Step::Restart(c) => {
                s.consumers[c].worker = Worker::Idle { position: 0 };
            }
            Step::Rebalance => {
                s.rebalances -= 1;
                if s.holds_assignment(s.owner) {
                    s.committed = s.committed.max(s.finished_upto(s.owner));
                }
                s.owner = 1 - s.owner;
                s.generation += 1;
            }
            Step::Evict => {
                s.evictions -= 1;
                s.owner = 1 - s.owner;
                s.generation += 1;
            }
            Step::Crash(c) => {
                s.crashes -= 1;
                s.kill(c);
            }
            Step::Dies(c) => {
                let claimed = s.batch(c).and_then(|b| b.claimed.clone());
                let killer = claimed
                    .unwrap_or_default()
                    .into_iter()
                    .find(|m| s.scripts[*m] == Script::Kills)
                    .expect("a killing message");
                s.kills[killer] += 1;
                s.kill(c);
            }
            Step::CommitOffset(c) => s.committed = s.finished_upto(c),
            Step::Fetch(c) => {
                let Worker::Idle { mut position } = s.consumers[c].worker else {
                    unreachable!()
                };
                if s.consumers[c].generation != Some(s.generation) {
                    // A new assignment starts from the committed offset, its partition not known clear.
                    s.consumers[c].generation = Some(s.generation);
                    s.consumers[c].clear = false;
                    position = s.committed;
                }
                let wanted = BATCH.min(MESSAGES - position);
                let beside = crate::crash_gate::recording(
                    false,
                    true,
                    s.consumers[c].clear || self.beside_always,
                    true,
                    false,
                ) == crate::crash_gate::Recording::Beside;
                if beside {
                    s.consumers[c].worker = Worker::Batch(Box::new(Batch {
                        base: position,
                        len: wanted,
                        isolated: false,
                        machine: BatchMachine::new(
                            vec![Kind::Transactional; wanted],
                            vec![0; wanted],
                            MAX_ATTEMPTS,
                        ),
                        pending: None,
                        claimed: None,
                        beside: true,
                        refused: false,
                    }));
                } else {
                    let suspect = self.record(&mut s, c, position, wanted);
                    s.start(c, position, wanted, suspect);
                }
            }
            Step::RecordLands(c) => {
                let b = s.batch(c).expect("in a batch");
                let (base, len) = (b.base, b.len);
                // A suspect's range: the handlers go on until the batch would commit (and a killer among
                // them dies first, its isolated start uncounted); then it goes again (`Redo`).
                let refused = self.record(&mut s, c, base, len);
                let b = s.batch_mut(c);
                b.beside = false;
                b.refused = refused;
            }
            Step::Redo(c) => {
                // Nothing of the batch took effect; its first message goes alone, its start counted.
                let base = s.batch(c).expect("in a batch").base;
                s.release_claims(c);
                s.start(c, base, 1, true);
            }
            Step::Decide(c) => {
                let batch = s.batch_mut(c);
                let action = batch.machine.next();
                if action == Action::Done {
                    let (base, len, isolated) = (batch.base, batch.len, batch.isolated);
                    s.consumers[c].worker = Worker::Idle {
                        position: base + len,
                    };
                    if isolated {
                        // Its end: the suspect's count goes; a normal batch's range stays open.
                        s.deaths[base] = 0;
                        s.record = s.record.map(|r| crash_record::end(r, offset(base), true));
                    }
                } else {
                    batch.pending = Some(action);
                }
            }
            Step::Claim(c) => {
                let b = s.batch(c).expect("in a batch");
                let Some(Action::Transact { start, end }) = b.pending else {
                    unreachable!()
                };
                let range = b.base + start..b.base + end;
                let claimed: Vec<usize> = range.filter(|m| !s.done[*m]).collect();
                for m in &claimed {
                    s.claims[*m] = Some(c);
                }
                s.batch_mut(c).claimed = Some(claimed);
            }
            Step::Commit(c) => {
                let claimed = s
                    .batch(c)
                    .and_then(|b| b.claimed.clone())
                    .unwrap_or_default();
                for m in claimed {
                    s.done[m] = true;
                    s.effects[m] += 1;
                }
                s.answer(c, Event::Committed);
            }
            Step::ItemFails(c, m) => {
                let fault = fault_of(s.scripts[m], s.fails_left[m], m).expect("a failing message");
                s.fails_left[m] = s.fails_left[m].saturating_sub(1);
                let index = m - s.batch(c).expect("in a batch").base;
                s.answer(c, Event::ItemFailed { index, fault });
            }
            Step::GroupFails(c) => {
                let b = s.batch(c).expect("in a batch");
                let claimed = b.claimed.clone().unwrap_or_default();
                let culprit = claimed
                    .into_iter()
                    .find(|m| fault_of(s.scripts[*m], s.fails_left[*m], *m).is_some())
                    .expect("a failing message");
                let fault = fault_of(s.scripts[culprit], s.fails_left[culprit], culprit)
                    .expect("a failing message");
                let event = if self.blame_the_first {
                    let Some(Action::Transact { start, .. }) = b.pending else {
                        unreachable!()
                    };
                    Event::ItemFailed {
                        index: start,
                        fault,
                    }
                } else {
                    Event::GroupFailed { fault }
                };
                s.answer(c, event);
            }
            Step::Outage(c) => {
                s.outages -= 1;
                let b = s.batch(c).expect("in a batch");
                let Some(Action::Transact { start, end }) = b.pending else {
                    unreachable!()
                };
                let fault = Fault::Unavailable("the database is unavailable".into());
                let event = if end - start > 1 {
                    Event::GroupFailed { fault }
                } else {
                    Event::ItemFailed {
                        index: start,
                        fault,
                    }
                };
                s.answer(c, event);
            }
            Step::Finish(c) => {
                let b = s.batch_mut(c);
                let base = b.base;
                match b.pending.take() {
                    Some(Action::Wait { .. }) => b.machine.on(Event::Waited),
                    Some(Action::DeadLetter {
                        index,
                        reason,
                        error,
                        ..
                    }) => {
                        b.machine.on(Event::DeadLettered);
                        s.dead_letters.push((base + index, reason, error));
                    }
                    other => unreachable!("{other:?} is not finished this way"),
                }
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
                "an offset is committed only after its message's transaction or dead letter",
                |_, s: &State| (0..s.committed).all(|m| s.done[m] || s.dead_lettered(m)),
            ),
            Property::always(
                "a message is dead-lettered only for its own failure",
                |_, s: &State| {
                    s.dead_letters.iter().all(|(m, reason, error)| {
                        let others_named = (0..MESSAGES)
                            .filter(|j| j != m)
                            .any(|j| error.contains(&format!("m{j}")));
                        let own = match reason {
                            DeadLetterReason::CrashLoop => true,
                            DeadLetterReason::HandlerFailed => s.scripts[*m] == Script::Fails,
                            DeadLetterReason::RetriesExhausted => {
                                matches!(s.scripts[*m], Script::Fails | Script::FailsOnce)
                            }
                            _ => false,
                        };
                        own && !others_named
                    })
                },
            ),
            Property::always(
                "a message is dead-lettered as a crash loop only if it kills the process",
                |_, s: &State| {
                    s.dead_letters.iter().all(|(m, reason, _)| {
                        *reason != DeadLetterReason::CrashLoop || s.scripts[*m] == Script::Kills
                    })
                },
            ),
            Property::always(
                "with nothing left to do, every message took effect once or was dead-lettered, and the \
                 offset passed them all",
                |model: &Self, s: &State| {
                    has_next(model, s)
                        || (s.committed == MESSAGES
                            && (0..MESSAGES).all(|m| match s.scripts[m] {
                                Script::Succeeds => s.effects[m] == 1 && !s.dead_lettered(m),
                                Script::FailsOnce => (s.effects[m] == 1) != s.dead_lettered(m),
                                Script::Fails | Script::Kills => {
                                    s.effects[m] == 0 && s.dead_lettered(m)
                                }
                            }))
                },
            ),
            Property::always(KILLER_STOPPED, |_, s: &State| {
                (0..MESSAGES).all(|m| s.dead_lettered(m) || s.kills[m] <= CRASH_LOOP_LIMIT + 2)
            }),
            Property::sometimes(
                "a message's step committed while the offset is still before it",
                |_, s: &State| (0..MESSAGES).any(|m| s.done[m] && s.committed <= m),
            ),
            Property::sometimes(
                "a message is dead-lettered as a crash loop",
                |_, s: &State| {
                    s.dead_letters
                        .iter()
                        .any(|(_, reason, _)| *reason == DeadLetterReason::CrashLoop)
                },
            ),
        ]
    }
}

/// Whether `model` can take a step from `s`: the "with nothing left to do" properties of the crate's
/// models hold their end state to account only where it cannot.
/// A message's kind in the batch machine as its hold role says, as a delivery's kind does (the models of
/// held keys use it): a parked message is held, a stale one (a copy that ran, or its head letter's message
/// again) known done, the others run in the step's transaction.
pub(crate) fn kind_of(role: &crate::hold::Role) -> Kind {
    match role {
        crate::hold::Role::Park => Kind::Held,
        crate::hold::Role::Stale => Kind::NoClaim,
        _ => Kind::Transactional,
    }
}

pub(crate) fn has_next<M: Model>(model: &M, s: &M::State) -> bool {
    let mut next = Vec::new();
    model.actions(s, &mut next);
    !next.is_empty()
}

/// Explores `model` breadth first on every core, to `depth` steps if given (else to its end), and prints what
/// it explored: the one way each of the crate's models is checked.
pub(crate) fn explore<M>(model: &M, depth: Option<usize>) -> impl stateright::Checker<M> + use<M>
where
    M: Model + std::fmt::Debug + Clone + Send + Sync + 'static,
    M::State: std::fmt::Debug + std::hash::Hash + Clone + Eq + Send + Sync,
    M::Action: std::fmt::Debug + Clone + PartialEq + Send + Sync,
{
    explore_until(model, depth, stateright::HasDiscoveries::All)
}

/// Explores `model` as [`explore`] does, until `property` is found to fail (a defect put back), or to the
/// end: the one way a model's defect is shown found without exploring what lies past it.
pub(crate) fn find<M>(model: &M, property: &'static str) -> impl stateright::Checker<M> + use<M>
where
    M: Model + std::fmt::Debug + Clone + Send + Sync + 'static,
    M::State: std::fmt::Debug + std::hash::Hash + Clone + Eq + Send + Sync,
    M::Action: std::fmt::Debug + Clone + PartialEq + Send + Sync,
{
    let property = std::collections::BTreeSet::from([property]);
    explore_until(model, None, stateright::HasDiscoveries::AnyOf(property))
}

fn explore_until<M>(
    model: &M,
    depth: Option<usize>,
    until: stateright::HasDiscoveries,
) -> impl stateright::Checker<M> + use<M>
where
    M: Model + std::fmt::Debug + Clone + Send + Sync + 'static,
    M::State: std::fmt::Debug + std::hash::Hash + Clone + Eq + Send + Sync,
    M::Action: std::fmt::Debug + Clone + PartialEq + Send + Sync,
{
    use stateright::Checker;
    let started = std::time::Instant::now();
    let mut builder = model
        .clone()
        .checker()
        .threads(std::thread::available_parallelism().map_or(1, |n| n.get()))
        .finish_when(until);
    if let Some(depth) = depth {
        builder = builder.target_max_depth(depth);
    }
    let checker = builder.spawn_bfs().join();
    println!(
        "{model:?}: {} states ({} unique) to depth {}, {:?}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    checker
}

#[cfg(test)]
mod tests {
    use stateright::Checker;

    use super::*;

    /// The depth explored: `SAGA_MODEL_DEPTH` steps, or `default`, which CI runs.
    fn depth(default: usize) -> usize {
        std::env::var("SAGA_MODEL_DEPTH")
            .ok()
            .and_then(|d| d.parse().ok())
            .unwrap_or(default)
    }

    /// Runs `model` to the depth; prints what it explored.
    fn check(model: ConsumerModel) -> impl Checker<ConsumerModel> {
        let default = if model.evictions > 0 {
            EVICTION_DEPTH
        } else {
            DEPTH
        };
        explore(&model, Some(depth(default)))
    }

    #[test]
    fn the_consumers_protocol_holds_in_every_interleaving() {
        check(ConsumerModel::default()).assert_properties();
    }

    /// A stalled owner evicted mid-batch finishes it as a zombie beside the new owner: effects stay
    /// once, offsets behind their transactions, failures with their messages. One limit is known and
    /// shown here: an isolated start the zombie has not finished counts as a death for the new owner, so
    /// with one more (random) death a message that never killed anything reaches the crash-loop limit.
    /// ([`KILLER_STOPPED`] is not asserted here: a killer's deaths past its bound lie deeper than this
    /// world's depth; the default world checks it.)
    #[test]
    fn an_evicted_owner_finishing_its_batch_as_a_zombie_keeps_the_guarantees() {
        let checker = check(ConsumerModel {
            evictions: 1,
            ..ConsumerModel::default()
        });
        for property in [
            "a step's effect happens at most once",
            "an offset is committed only after its message's transaction or dead letter",
            "a message is dead-lettered only for its own failure",
        ] {
            checker.assert_no_discovery(property);
        }
        let known = checker.assert_any_discovery(
            "a message is dead-lettered as a crash loop only if it kills the process",
        );
        println!("known limit: {:?}", known.into_actions());
    }

    /// The crash-loop record's old rule: a restart behind the committed offset redelivers a batch before
    /// the range its last run died in, which replaced the record: the killer is never isolated.
    #[test]
    fn forgetting_a_rewound_range_is_found() {
        assert_killer_loops(ConsumerModel {
            forget_a_rewound_range: true,
            ..ConsumerModel::default()
        });
    }

    /// The crash gate's old rule: a suspect range's batch recorded beside its transaction runs its first
    /// message before the record says it goes alone; a message that kills the process then dies uncounted,
    /// restart after restart.
    #[test]
    fn recording_beside_a_partition_not_known_clear_is_found() {
        assert_killer_loops(ConsumerModel {
            beside_always: true,
            ..ConsumerModel::default()
        });
    }

    /// The checker finds, in `model` (an old crash-loop rule put back), a killer that is not stopped.
    fn assert_killer_loops(model: ConsumerModel) {
        let path = find(&model, KILLER_STOPPED).assert_any_discovery(KILLER_STOPPED);
        println!("counterexample: {:?}", path.into_actions());
    }

    #[test]
    fn blaming_a_batch_failure_on_its_first_message_is_found() {
        let checker = check(ConsumerModel {
            blame_the_first: true,
            ..ConsumerModel::default()
        });
        let path =
            checker.assert_any_discovery("a message is dead-lettered only for its own failure");
        println!("counterexample: {:?}", path.into_actions());
    }
}
