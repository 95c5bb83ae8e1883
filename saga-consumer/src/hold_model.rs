//! A model of per-key order through failures, checked exhaustively with `stateright`: the consumer's
//! protocol around held keys (see `hold`), beside `model`'s protocol of batches.
//!
//! The decisions are the code's own: the model calls [`hold::classify`] (the pre-pass), [`hold::decide_park`]
//! (the park transaction, read again under the key's lock), [`hold::on_dead_letter`] (the transaction that
//! records a dead letter), [`hold::advance`] (the transaction after a head or a release finished) and
//! [`hold::next_release`] (the releaser), and only plays the world around them: the partition, the
//! group's retry topic, the operator replaying letters, the store, crashes.
//!
//! The world: one key, [`MESSAGES`] messages of it on its partition, consumed in order under the hold-key
//! policy, in batches of up to [`BATCH`] that the real [`BatchMachine`] decides (one transaction, narrowed
//! at a failure; a dead letter or a parked message holds the key's later messages of the batch). A script
//! says which fail for good on their first run (a gateway down: their replay succeeds), and whether the
//! second message's step starts paused (an operator resumes it, any time).
//! The consumer process may crash once anywhere (both workers start again from the committed offsets; a
//! head or release whose step committed but whose advance did not comes back and is found done); the
//! releaser may once send a release and die before recording it (a second copy follows). The operator
//! replays every dead letter, any time.

use saga_core::Origin;
use stateright::{Model, Property};

use crate::hold::{
    self, Advance, HeldView, HoldLimits, HoldState, Mark, OnDeadLetter, ParkDecision, ReleaseStep,
    Role,
};
use crate::machine::{Action, BatchMachine, Event, Fault, Kind};

/// Most messages of the partition in one batch.
pub(crate) const BATCH: usize = 2;
/// The message whose step may be paused.
const PAUSABLE: usize = 1;

/// Messages of the key on its partition.
pub(crate) const MESSAGES: usize = 3;

const LIMITS: HoldLimits = HoldLimits {
    per_key: 100,
    per_group: 100,
    alert_after: std::time::Duration::from_secs(3600),
};

/// The key's row and its queue, as the store holds them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Held {
    state: HoldState,
    /// The dead letter at its head (its index among the letters).
    head: Option<usize>,
    /// The parked messages: (sequence number, message).
    parked: Vec<(i64, usize)>,
    in_flight: Option<i64>,
}

fn origin(m: usize) -> Origin {
    Origin {
        topic: "orders".into(),
        partition: 0,
        offset: m as i64,
    }
}

/// Message `m` as consumed.
fn raw(m: usize) -> saga_core::RawMessage {
    saga_core::RawMessage {
        origin: origin(m),
        key: Some(b"k".to_vec()),
        payload: Some(format!("{{\"m\":{m}}}").into_bytes()),
        headers: saga_core::Headers::new(),
        timestamp_ms: None,
    }
}

fn letter_id(letter: usize) -> String {
    format!("letter-{letter}")
}

impl Held {
    fn view(&self) -> HeldView {
        HeldView {
            state: self.state,
            head_letter: self.head.map(letter_id),
            first: self
                .parked
                .first()
                .map(|(s, m)| (*s, origin(*m), hold::digest(&raw(*m)))),
            parked: self.parked.len() as i64,
            in_flight: self.in_flight,
        }
    }
}

/// A worker of one topic: between messages, with the role of its next one read, or with a head or release
/// whose step committed and whose advance is next.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Worker {
    Idle,
    Classified(Role),
    Ran(Role),
}

/// The partition worker's batch: its first message, each message's role, and the machine.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct PartitionBatch {
    base: usize,
    roles: Vec<Role>,
    machine: BatchMachine,
}

/// The world.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct State {
    /// The partition: the next message to consume (finished before it), the committed offset, its batch.
    p_pos: usize,
    p_committed: usize,
    p_batch: Option<PartitionBatch>,
    /// Whether [`PAUSABLE`]'s step is paused.
    paused: bool,
    /// The group's retry topic: what was sent to it, the next to consume, the committed offset, its worker.
    retry: Vec<(usize, Mark)>,
    r_pos: usize,
    r_committed: usize,
    r_worker: Worker,
    held: Option<Held>,
    next_seq: i64,
    /// Effects in commit order, and which step keys are done.
    effects: Vec<usize>,
    done: [bool; MESSAGES],
    /// Dead letters (their messages), and which the operator replayed.
    letters: Vec<usize>,
    replayed: Vec<bool>,
    /// First runs still to fail, per message.
    fails_left: [bool; MESSAGES],
    crashes: u8,
    lost_records: u8,
}

/// What happens next.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Step {
    PartitionReads,
    PartitionActs,
    RetryReads,
    RetryActs,
    RetryAdvances,
    CommitPartition,
    CommitRetry,
    Crash,
    Release,
    ReleaseAndDie,
    Replay(usize),
    Resume,
}

/// The model: its scripts, and whether the releaser is the put-back bug (everything released at once).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct HoldModel {
    pub release_all_at_once: bool,
}

impl State {
    fn paused(&self, m: usize) -> bool {
        self.paused && m == PAUSABLE
    }

    /// Records message `m`'s dead letter and what it does to the hold, for a message of role `role`.
    fn dead_letter(&mut self, m: usize, role: &Role) {
        self.fails_left[m] = false;
        let letter = self.letters.len();
        self.letters.push(m);
        self.replayed.push(false);
        match hold::on_dead_letter(self.view().as_ref(), role, true, true) {
            OnDeadLetter::Nothing => {}
            OnDeadLetter::Queue => {
                let seq = self.next_seq;
                self.next_seq += 1;
                self.held
                    .as_mut()
                    .expect("a view was read")
                    .parked
                    .push((seq, m));
            }
            OnDeadLetter::Hold => {
                if self.held.is_none() {
                    self.held = Some(Held {
                        state: HoldState::Held,
                        head: Some(letter),
                        parked: Vec::new(),
                        in_flight: None,
                    });
                }
            }
            OnDeadLetter::ReHead { drop_seq } => {
                let held = self.held.as_mut().expect("a view was read");
                if let Some(seq) = drop_seq {
                    held.parked.retain(|(s, _)| *s != seq);
                }
                held.state = HoldState::Held;
                held.head = Some(letter);
                held.in_flight = None;
            }
        }
    }

    /// Reads a batch's holds (the pre-pass) and starts its machine.
    fn partition_reads(&mut self) {
        let base = self.p_pos;
        let len = BATCH.min(MESSAGES - base);
        let view = self.view();
        let roles: Vec<Role> = (base..base + len)
            .map(|m| hold::classify(view.as_ref(), &Mark::Plain, self.paused(m)))
            .collect();
        let kinds = roles
            .iter()
            .map(|r| {
                if *r == Role::Park {
                    Kind::Held
                } else {
                    Kind::Transactional
                }
            })
            .collect();
        let machine = BatchMachine::new(kinds, vec![0; len], 1)
            .with_holds(vec![Some(0); len], vec![true; len]);
        self.p_batch = Some(PartitionBatch {
            base,
            roles,
            machine,
        });
    }

    /// One action of the partition worker's machine, performed and answered.
    fn partition_acts(&mut self) {
        let mut batch = self.p_batch.take().expect("a batch in progress");
        let action = batch.machine.next();
        let event = match action {
            Action::Done => {
                self.p_pos = batch.base + batch.machine.finished();
                return;
            }
            Action::Transact { start, end } => {
                // One transaction: the first message that fails rolls it back and is named.
                match (start..end).find(|i| self.fails_left[batch.base + i]) {
                    Some(index) => Event::ItemFailed {
                        index,
                        fault: Fault::Permanent(format!("m{} fails", batch.base + index)),
                    },
                    None => {
                        for i in start..end {
                            let m = batch.base + i;
                            if !self.done[m] {
                                self.done[m] = true;
                                self.effects.push(m);
                            }
                        }
                        Event::Committed
                    }
                }
            }
            Action::DeadLetter { index, .. } => {
                self.dead_letter(batch.base + index, &batch.roles[index]);
                Event::DeadLettered
            }
            Action::Park { index } => match self.park(batch.base + index) {
                ParkDecision::Append | ParkDecision::Create => Event::Parked,
                // As the executor does: it runs as a message of a key not held.
                ParkDecision::NotHeld => {
                    batch.roles[index] = Role::Free;
                    Event::NotHeld {
                        kind: Kind::Transactional,
                    }
                }
                ParkDecision::Full(_) => unreachable!("the caps are out of reach"),
            },
            other => unreachable!("{other:?} has no part in this world"),
        };
        batch.machine.on(event);
        self.p_pos = batch.base + batch.machine.finished();
        self.p_batch = Some(batch);
    }

    fn parked_total(&self) -> i64 {
        self.held.as_ref().map_or(0, |h| h.parked.len() as i64)
    }

    fn view(&self) -> Option<HeldView> {
        self.held.as_ref().map(Held::view)
    }

    /// The transaction of message `m` run with role `role`: its step (or its dead letter, with what that
    /// does to the hold). Whether it committed a step (not a dead letter).
    fn run(&mut self, m: usize, role: &Role) -> bool {
        if self.fails_left[m] {
            self.dead_letter(m, role);
            return false;
        }
        if !self.done[m] {
            self.done[m] = true;
            self.effects.push(m);
        }
        true
    }

    fn park(&mut self, m: usize) -> ParkDecision {
        let decision = hold::decide_park(
            self.view().as_ref(),
            self.paused(m),
            self.parked_total(),
            &LIMITS,
        );
        if decision == ParkDecision::Create {
            // A paused step's message holds its key, with no letter at its head.
            let seq = self.next_seq;
            self.next_seq += 1;
            self.held = Some(Held {
                state: HoldState::Held,
                head: None,
                parked: vec![(seq, m)],
                in_flight: None,
            });
            return decision;
        }
        let held = self.held.as_ref();
        // The store parks a message once (a redelivery of one parked already parks nothing).
        if decision == ParkDecision::Append
            && !held.is_some_and(|h| h.parked.iter().any(|(_, p)| *p == m))
        {
            let seq = self.next_seq;
            self.next_seq += 1;
            self.held
                .as_mut()
                .expect("appended to a held key")
                .parked
                .push((seq, m));
        }
        decision
    }

    fn advance(&mut self, role: &Role) {
        match hold::advance(self.view().as_ref(), role) {
            Advance::Nothing => {}
            Advance::Release => {
                let held = self.held.as_mut().expect("a view was read");
                held.state = HoldState::Releasing;
                held.in_flight = None;
            }
            Advance::LetGo => self.held = None,
            Advance::Next(seq) => {
                let held = self.held.as_mut().expect("a view was read");
                held.parked.retain(|(s, _)| *s != seq);
                held.in_flight = None;
            }
            Advance::Last(_) => self.held = None,
        }
    }

    fn first_parked(&self, seq: i64) -> usize {
        self.held
            .as_ref()
            .and_then(|h| h.parked.iter().find(|(s, _)| *s == seq))
            .map(|(_, m)| *m)
            .expect("the releaser sends a parked message")
    }
}

impl Model for HoldModel {
    type State = State;
    type Action = Step;

    fn init_states(&self) -> Vec<State> {
        // The first message fails once; in a second world, the second too (a release that fails becomes
        // the new head); in a third, the second message's step starts paused; in a fourth, both.
        [
            ([true, false, false], false),
            ([true, true, false], false),
            ([false, false, false], true),
            ([true, false, false], true),
        ]
        .into_iter()
        .map(|(fails_left, paused)| State {
            p_pos: 0,
            p_committed: 0,
            p_batch: None,
            paused,
            retry: Vec::new(),
            r_pos: 0,
            r_committed: 0,
            r_worker: Worker::Idle,
            held: None,
            next_seq: 1,
            effects: Vec::new(),
            done: [false; MESSAGES],
            letters: Vec::new(),
            replayed: Vec::new(),
            fails_left,
            crashes: 0,
            lost_records: 0,
        })
        .collect()
    }

    fn actions(&self, s: &State, actions: &mut Vec<Step>) {
        match s.p_batch {
            None if s.p_pos < MESSAGES => actions.push(Step::PartitionReads),
            Some(_) => actions.push(Step::PartitionActs),
            None => {}
        }
        if s.paused {
            actions.push(Step::Resume);
        }
        match s.r_worker {
            Worker::Idle if s.r_pos < s.retry.len() => actions.push(Step::RetryReads),
            Worker::Classified(_) => actions.push(Step::RetryActs),
            Worker::Ran(_) => actions.push(Step::RetryAdvances),
            Worker::Idle => {}
        }
        if s.p_committed < s.p_pos {
            actions.push(Step::CommitPartition);
        }
        if s.r_committed < s.r_pos {
            actions.push(Step::CommitRetry);
        }
        let busy = s.p_committed < s.p_pos
            || s.r_committed < s.r_pos
            || s.p_batch.is_some()
            || s.r_worker != Worker::Idle;
        if s.crashes == 0 && busy {
            actions.push(Step::Crash);
        }
        if let Some(held) = &s.held {
            let view = held.view();
            if self.release_all_at_once {
                if view.state == HoldState::Releasing {
                    actions.push(Step::Release);
                }
            } else {
                if s.next_release(&view, false) != ReleaseStep::Wait {
                    actions.push(Step::Release);
                }
                if s.lost_records == 0
                    && matches!(s.next_release(&view, true), ReleaseStep::Send(_))
                {
                    actions.push(Step::ReleaseAndDie);
                }
            }
        }
        for (letter, replayed) in s.replayed.iter().enumerate() {
            if !replayed {
                actions.push(Step::Replay(letter));
            }
        }
    }

    fn next_state(&self, last: &State, step: Step) -> Option<State> {
        let mut s = last.clone();
        match step {
            Step::PartitionReads => s.partition_reads(),
            Step::PartitionActs => s.partition_acts(),
            Step::Resume => {
                // `saga steps resume`: the keys the step's messages held are released.
                s.paused = false;
                if let Some(held) = s.held.as_mut().filter(|h| h.head.is_none()) {
                    held.state = HoldState::Releasing;
                    held.in_flight = None;
                }
            }
            Step::RetryReads => {
                let (_, mark) = &s.retry[s.r_pos];
                let m = s.retry[s.r_pos].0;
                s.r_worker =
                    Worker::Classified(hold::classify(s.view().as_ref(), mark, s.paused(m)));
            }
            Step::RetryActs => {
                let Worker::Classified(role) = s.r_worker.clone() else {
                    unreachable!()
                };
                let m = s.retry[s.r_pos].0;
                match role {
                    Role::Stale => {
                        s.r_pos += 1;
                        s.r_worker = Worker::Idle;
                    }
                    Role::Park => match s.park(m) {
                        ParkDecision::Append | ParkDecision::Create => {
                            s.r_pos += 1;
                            s.r_worker = Worker::Idle;
                        }
                        ParkDecision::NotHeld => s.r_worker = Worker::Classified(Role::Free),
                        ParkDecision::Full(_) => unreachable!("the caps are out of reach"),
                    },
                    role @ (Role::Head(_) | Role::Release(_)) => {
                        if s.run(m, &role) {
                            s.r_worker = Worker::Ran(role);
                        } else {
                            s.r_pos += 1;
                            s.r_worker = Worker::Idle;
                        }
                    }
                    role => {
                        s.run(m, &role);
                        s.r_pos += 1;
                        s.r_worker = Worker::Idle;
                    }
                }
            }
            Step::RetryAdvances => {
                let Worker::Ran(role) = s.r_worker.clone() else {
                    unreachable!()
                };
                s.advance(&role);
                s.r_pos += 1;
                s.r_worker = Worker::Idle;
            }
            Step::CommitPartition => s.p_committed = s.p_pos,
            Step::CommitRetry => s.r_committed = s.r_pos,
            Step::Crash => {
                s.crashes += 1;
                s.p_pos = s.p_committed;
                s.r_pos = s.r_committed;
                s.p_batch = None;
                s.r_worker = Worker::Idle;
            }
            Step::Release if self.release_all_at_once => {
                // The put-back bug: every parked message sent at once, and the key let go.
                let held = s.held.take().expect("a held key");
                for (_, m) in held.parked {
                    s.retry.push((m, Mark::Plain));
                }
            }
            Step::Release => {
                let view = s.view().expect("a held key");
                match s.next_release(&view, false) {
                    ReleaseStep::Send(seq) => {
                        let m = s.first_parked(seq);
                        s.retry.push((m, release_mark(seq, m)));
                        s.held.as_mut().expect("a held key").in_flight = Some(seq);
                    }
                    ReleaseStep::LetGo => s.held = None,
                    ReleaseStep::Wait => unreachable!(),
                }
            }
            Step::ReleaseAndDie => {
                let view = s.view().expect("a held key");
                let ReleaseStep::Send(seq) = s.next_release(&view, true) else {
                    unreachable!()
                };
                let m = s.first_parked(seq);
                s.retry.push((m, release_mark(seq, m)));
                s.lost_records += 1;
            }
            Step::Replay(letter) => {
                s.replayed[letter] = true;
                let m = s.letters[letter];
                s.retry.push((m, Mark::Replay(letter_id(letter))));
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "per key, effects happen in offset order, each once",
                |_, s: &State| s.effects.windows(2).all(|w| w[0] < w[1]),
            ),
            Property::always(
                "with nothing left to do, every message took effect and no key is held",
                |model: &Self, s: &State| {
                    let mut next = Vec::new();
                    model.actions(s, &mut next);
                    !next.is_empty() || (s.effects.len() == MESSAGES && s.held.is_none())
                },
            ),
            Property::sometimes("a message is parked", |_, s: &State| s.parked_total() > 0),
            Property::sometimes("a release's copy is sent twice", |_, s: &State| {
                s.lost_records > 0
            }),
        ]
    }
}

impl State {
    /// The releaser's decision for the key (whose first parked message may be of the paused step).
    fn next_release(&self, view: &HeldView, resend_due: bool) -> ReleaseStep {
        let first_paused = self
            .held
            .as_ref()
            .and_then(|h| h.parked.first())
            .is_some_and(|(_, m)| self.paused(*m));
        hold::next_release(view, resend_due, first_paused)
    }
}

fn release_mark(seq: i64, m: usize) -> Mark {
    Mark::Release {
        seq,
        origin: origin(m),
        digest: hold::digest(&raw(m)),
    }
}

#[cfg(test)]
mod tests {
    use stateright::Checker;

    use super::*;

    fn check(model: HoldModel) -> impl Checker<HoldModel> {
        crate::model::explore(&model, None)
    }

    #[test]
    fn held_keys_keep_the_order_run_nothing_twice_and_lose_nothing_in_every_interleaving() {
        check(HoldModel::default()).assert_properties();
    }

    #[test]
    fn releasing_a_queue_all_at_once_is_found_to_reorder() {
        let checker = check(HoldModel {
            release_all_at_once: true,
        });
        let path =
            checker.assert_any_discovery("per key, effects happen in offset order, each once");
        println!("counterexample: {:?}", path.into_actions());
    }
}
