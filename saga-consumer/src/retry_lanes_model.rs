//! A model of keys in parallel within a partition together with delayed retries, checked exhaustively
//! with `stateright`: the two stages as they run together (`key_lanes`, and in each lane the hold gate and
//! the batch machine, with `SAGA_RETRY_DELAYED` on).
//!
//! The world: one partition of three messages of two keys (`a b a`), two consumer processes of one group.
//! The partition's owner takes a window and runs its key groups in lanes ([`key_lanes::groups`]), both at
//! once; a lane's messages go through the hold gate's plan ([`hold_gate::plan`], the holds read when the
//! lane starts) and the real [`BatchMachine`]. A transient failure waits parked for its delayed retry
//! ([`hold::decide_defer`]), its key held, and the key's later messages park behind it
//! ([`hold::decide_park`]), in the lane or in a later window; the position reported is the window's
//! low-water mark ([`Watermark`]). The group's retry topic has one partition, consumed by the second
//! process in batches of two through the same plan and machine (a release goes on from its parked
//! message's attempts, [`hold_gate::attempts_of`]; one release of a key per batch). The releaser
//! ([`hold::next_release`]) sends a key's first parked message once due, and may once die before recording
//! what it sent (a second copy follows); time passes key by key. A release that committed advances its key
//! ([`hold::advance`]) in a transaction of its own; a retry whose attempts are spent is dead-lettered and
//! leaves its queue ([`hold::on_dead_letter`], the skip policy). Either process may crash once, anywhere
//! (its workers start again from their committed offsets), and the partition may move once to the other
//! process (a rebalance: its lanes stop between messages, what they finished is reported and committed).
//!
//! Each transaction on the store is one step (the key's lock serializes them; `hold_model` checks the
//! lock's races). The checker proves: each step's effect at most once; each key's effects in offset order
//! (a dead-lettered message's place excepted); the committed offset never past a message that is neither
//! finished, parked nor dead-lettered; a delayed retry never run before it is due; and, with nothing left
//! to do, every message took effect or was dead-lettered, the offset passed them all and no key is held.
//! Putting back "commit the highest finished offset" ([`RetryLanesModel::highest_finished`]) is found.

use saga_core::Origin;
use stateright::{Model, Property};

use crate::hold::{
    self, Advance, BatchHolds, DeferDecision, HeldView, HoldLimits, HoldState, Mark, OnDeadLetter,
    ParkDecision, ReleaseStep, Role,
};
use crate::hold_gate::{self, Facts};
use crate::key_lanes::{self, Watermark};
use crate::machine::{Action, BatchMachine, Event, Fault, Kind};
use crate::model::has_next;

/// The partition's messages' keys.
const KEYS: [&[u8]; 3] = [b"a", b"b", b"a"];
/// Messages in the partition.
const MESSAGES: usize = KEYS.len();
/// The keys.
const KEY_COUNT: usize = 2;
/// Lanes of a window run at once.
const KEY_CONCURRENCY: usize = 2;
/// Most messages of one transaction's batch (a lane's chunk, a batch of the retry topic).
const BATCH: usize = 2;
/// Attempts before a transiently failing message is dead-lettered.
const MAX_ATTEMPTS: u32 = 2;
/// The process that consumes the retry topic's partition.
const RETRY_PROCESS: usize = 1;

const LIMITS: HoldLimits = HoldLimits {
    per_key: 100,
    per_group: 100,
    alert_after: std::time::Duration::from_secs(3600),
};

fn key_id(m: usize) -> usize {
    usize::from(KEYS[m] != KEYS[0])
}

fn origin(m: usize) -> Origin {
    Origin {
        topic: "orders".into(),
        partition: 0,
        offset: m as i64,
    }
}

fn raw(m: usize) -> saga_core::RawMessage {
    saga_core::RawMessage {
        origin: origin(m),
        key: Some(KEYS[m].to_vec()),
        payload: Some(format!("{{\"m\":{m}}}").into_bytes()),
        headers: saga_core::Headers::new(),
        timestamp_ms: None,
    }
}

/// A key held for its delayed retries, as the store holds it (always releasing: under the skip policy
/// only a delayed retry holds a key).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Held {
    /// The message whose delayed retry took the hold (its plain redelivery is stale).
    head: usize,
    /// The parked messages: (sequence number, message).
    parked: Vec<(i64, usize)>,
    in_flight: Option<i64>,
    /// The parked messages waiting for their delayed retries: (sequence number, attempts made, due).
    retries: Vec<(i64, u32, bool)>,
}

impl Held {
    fn view(&self) -> HeldView {
        let first_retry = self.first_retry();
        HeldView {
            state: HoldState::Releasing,
            head_letter: None,
            head_origin: Some(origin(self.head)),
            first: self
                .parked
                .first()
                .map(|(s, m)| (*s, origin(*m), hold::digest(&raw(*m)))),
            parked: self.parked.len() as i64,
            in_flight: self.in_flight,
            retrying: true,
            first_due: first_retry.is_none_or(|(_, _, due)| due),
            first_attempts: first_retry.map_or(0, |(_, attempts, _)| attempts),
        }
    }

    fn first_retry(&self) -> Option<(i64, u32, bool)> {
        let (seq, _) = self.parked.first()?;
        self.retries.iter().find(|(s, _, _)| s == seq).copied()
    }
}

/// A batch in one transaction's hands: its messages, each one's part, the machine, and a release's
/// committed range whose advance is next.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Chunk {
    messages: Vec<usize>,
    roles: Vec<Role>,
    machine: BatchMachine,
    advance: Option<(usize, usize)>,
}

/// A lane: its messages (window indices), how many of them finished, the chunk in progress.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Lane {
    messages: Vec<usize>,
    finished: usize,
    chunk: Option<Chunk>,
}

impl Lane {
    fn ended(&self) -> bool {
        self.finished == self.messages.len()
    }
}

/// A window in progress: its first offset, its lanes, what is finished.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Window {
    base: usize,
    lanes: Vec<Lane>,
    mark: Watermark,
    /// The highest finished index + 1 (what the mistake would report).
    highest: usize,
}

/// A process's worker of the partition.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Worker {
    /// The process is dead, not restarted yet.
    Down,
    /// Between windows: the next offset it reads.
    Idle(usize),
    /// In a window.
    Running(Window),
}

/// A consumer process: its worker, the generation of the assignment it believes it holds, the position it
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
    /// Transient failures still to come, per message.
    transient_left: [u8; MESSAGES],
    done: [bool; MESSAGES],
    /// Messages in the order their effects happened.
    order: Vec<usize>,
    effects: [u8; MESSAGES],
    letters: Vec<usize>,
    held: [Option<Held>; KEY_COUNT],
    next_seq: i64,
    /// Whether a delayed retry ran before it was due.
    early: bool,
    /// The partition: its committed offset, its owner and the assignment's generation.
    committed: usize,
    owner: usize,
    generation: u8,
    consumers: [Consumer; 2],
    /// The group's retry topic: what was sent to it, the next to consume, the committed offset, the batch
    /// in progress.
    retry: Vec<(usize, Mark)>,
    r_pos: usize,
    r_committed: usize,
    r_batch: Option<Chunk>,
    crashes: u8,
    revokes: u8,
    lost_records: u8,
}

/// A step of the system.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Step {
    /// The consumer takes a window from its position to the partition's end.
    Fetch(usize),
    /// Lane `.1` of the consumer's window reads its holds and starts its chunk.
    LaneReads(usize, usize),
    /// Lane `.1`'s machine acts (one transaction).
    LaneActs(usize, usize),
    /// The consumer's window has no message left to run: it moves on.
    EndWindow(usize),
    /// The consumer commits the position it reported.
    Commit(usize),
    RetryReads,
    RetryActs,
    /// The released messages that committed advance their keys.
    RetryAdvances,
    CommitRetry,
    /// The releaser sends key `.0`'s first parked message (or lets the key go).
    Release(usize),
    /// It sends it and dies before recording it.
    ReleaseAndDie(usize),
    /// Time passes: key `.0`'s first parked message's delayed retry is due.
    Tick(usize),
    Crash(usize),
    Restart(usize),
    /// The partition moves to the other process.
    Revoke,
}

/// The model, and optionally the old mistake.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RetryLanesModel {
    /// Report the highest finished message's position, not the first unfinished one's.
    pub highest_finished: bool,
}

impl State {
    fn world(transient_left: [u8; MESSAGES]) -> Self {
        let idle = |assigned| Consumer {
            worker: Worker::Idle(0),
            assigned,
            reported: None,
        };
        Self {
            transient_left,
            done: [false; MESSAGES],
            order: Vec::new(),
            effects: [0; MESSAGES],
            letters: Vec::new(),
            held: [None, None],
            next_seq: 1,
            early: false,
            committed: 0,
            owner: 0,
            generation: 0,
            consumers: [idle(Some(0)), idle(None)],
            retry: Vec::new(),
            r_pos: 0,
            r_committed: 0,
            r_batch: None,
            crashes: 1,
            revokes: 1,
            lost_records: 0,
        }
    }

    fn owns(&self, c: usize) -> bool {
        self.owner == c && self.consumers[c].assigned == Some(self.generation)
    }

    fn up(&self, c: usize) -> bool {
        self.consumers[c].worker != Worker::Down
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

    fn view(&self, m: usize) -> Option<HeldView> {
        self.held[key_id(m)].as_ref().map(Held::view)
    }

    fn parked_total(&self) -> i64 {
        self.held
            .iter()
            .flatten()
            .map(|h| h.parked.len() as i64)
            .sum()
    }

    /// Whether message `m` is settled: its effect happened, it waits parked, or it was dead-lettered.
    fn settled(&self, m: usize) -> bool {
        self.done[m]
            || self.letters.contains(&m)
            || self
                .held
                .iter()
                .flatten()
                .any(|h| h.parked.iter().any(|(_, p)| *p == m))
    }

    /// The hold gate for `messages` marked `marks`: the plan over the holds read now, and the machine,
    /// started from the attempts each has made.
    fn gate(&self, messages: Vec<usize>, marks: &[Mark]) -> Chunk {
        let facts: Vec<Facts<'static>> = messages
            .iter()
            .zip(marks)
            .map(|(&m, mark)| Facts {
                key: KEYS[m],
                keyed: true,
                mark: mark.clone(),
                origin: std::borrow::Cow::Owned(origin(m)),
                step: Some("a-step"),
                policy_holds: false,
            })
            .collect();
        let mut found = BatchHolds::default();
        for &m in &messages {
            if let Some(view) = self.view(m) {
                found.views.insert(KEYS[m].to_vec(), view);
            }
        }
        let plan = hold_gate::plan(&facts, Some(&found), true);
        let kinds = plan
            .roles
            .iter()
            .map(|r| match r {
                Role::Park => Kind::Held,
                Role::Stale => Kind::NoClaim,
                _ => Kind::Transactional,
            })
            .collect();
        let attempts = messages
            .iter()
            .zip(&plan.roles)
            .map(|(&m, role)| hold_gate::attempts_of(role, found.views.get(KEYS[m]), 0))
            .collect();
        let mut machine = BatchMachine::new(kinds, attempts, MAX_ATTEMPTS);
        if let Some((keys, holds)) = plan.machine_holds {
            machine = machine.with_holds(keys, holds);
        }
        if let Some(defers) = plan.defers {
            machine = machine.with_defers(defers);
        }
        Chunk {
            messages,
            roles: plan.roles,
            machine,
            advance: None,
        }
    }

    /// One action of `chunk`'s machine, performed and answered (a release's commit is answered once its
    /// advance is recorded). Whether the machine is done.
    fn act(&mut self, chunk: &mut Chunk) -> bool {
        let event = match chunk.machine.next() {
            Action::Done => return true,
            Action::Transact { start, end } => match self.transact(chunk, start, end) {
                Some(event) => event,
                None => return false,
            },
            Action::Defer {
                index, attempts, ..
            } => match self.defer(chunk.messages[index], &chunk.roles[index], attempts) {
                DeferDecision::Refused => Event::DeferRefused,
                _ => Event::Deferred,
            },
            Action::Park { index } => match self.park(chunk.messages[index]) {
                ParkDecision::Append => Event::Parked,
                ParkDecision::NotHeld => {
                    chunk.roles[index] = Role::Free;
                    Event::NotHeld {
                        kind: Kind::Transactional,
                    }
                }
                other => unreachable!("{other:?}: no pause, the caps out of reach"),
            },
            Action::DeadLetter { index, .. } => {
                self.dead_letter(chunk.messages[index], &chunk.roles[index]);
                Event::DeadLettered
            }
            Action::Wait { .. } => Event::Waited,
            other => unreachable!("{other:?} has no part in this world"),
        };
        chunk.machine.on(event);
        false
    }

    /// The step transaction over `chunk`'s messages `start..end`: the first that fails rolls it back; a
    /// stale copy claims and runs nothing; a message whose step key is done has no effect again. `None`
    /// when it committed releases, whose advance is next.
    fn transact(&mut self, chunk: &mut Chunk, start: usize, end: usize) -> Option<Event> {
        let runs = |i: &usize| chunk.roles[*i] != Role::Stale;
        for i in (start..end).filter(runs) {
            let m = chunk.messages[i];
            if let (Role::Release(seq), Some(held)) = (&chunk.roles[i], &self.held[key_id(m)])
                && held.retries.iter().any(|(s, _, due)| s == seq && !due)
            {
                self.early = true;
            }
        }
        if let Some(index) = (start..end)
            .filter(runs)
            .find(|i| self.transient_left[chunk.messages[*i]] > 0)
        {
            let m = chunk.messages[index];
            self.transient_left[m] -= 1;
            return Some(Event::ItemFailed {
                index,
                fault: Fault::Transient(format!("m{m} fails")),
            });
        }
        for i in (start..end).filter(runs) {
            let m = chunk.messages[i];
            if !self.done[m] {
                self.done[m] = true;
                self.effects[m] += 1;
                self.order.push(m);
            }
        }
        if (start..end).any(|i| matches!(chunk.roles[i], Role::Release(_))) {
            chunk.advance = Some((start, end));
            return None;
        }
        Some(Event::Committed)
    }

    /// The advance of `chunk`'s committed releases, and the machine told.
    fn advance(&mut self, chunk: &mut Chunk) {
        let (start, end) = chunk.advance.take().expect("a committed release");
        for i in start..end {
            let m = chunk.messages[i];
            let k = key_id(m);
            match hold::advance(self.view(m).as_ref(), &chunk.roles[i]) {
                Advance::Nothing => {}
                Advance::Next(seq) => {
                    let held = self.held[k].as_mut().expect("a view was read");
                    held.parked.retain(|(s, _)| *s != seq);
                    held.retries.retain(|(s, _, _)| *s != seq);
                    held.in_flight = None;
                }
                Advance::Last(_) => self.held[k] = None,
                other => unreachable!("{other:?}: only releases advance here"),
            }
        }
        chunk.machine.on(Event::Committed);
    }

    fn park(&mut self, m: usize) -> ParkDecision {
        let decision =
            hold::decide_park(self.view(m).as_ref(), false, self.parked_total(), &LIMITS);
        if decision == ParkDecision::Append {
            let seq = self.next_seq;
            let held = self.held[key_id(m)]
                .as_mut()
                .expect("appended to a held key");
            // The store parks a message once (a redelivery of one parked already parks nothing).
            if !held.parked.iter().any(|(_, p)| *p == m) {
                held.parked.push((seq, m));
                self.next_seq += 1;
            }
        }
        decision
    }

    /// The delayed retry of message `m` (of role `role`, after `attempts`), under the key's lock.
    fn defer(&mut self, m: usize, role: &Role, attempts: u32) -> DeferDecision {
        let k = key_id(m);
        let decision =
            hold::decide_defer(self.view(m).as_ref(), role, self.parked_total(), &LIMITS);
        let seq = self.next_seq;
        match decision {
            DeferDecision::Create => {
                self.next_seq += 1;
                self.held[k] = Some(Held {
                    head: m,
                    parked: vec![(seq, m)],
                    in_flight: None,
                    retries: vec![(seq, attempts, false)],
                });
            }
            DeferDecision::Append => {
                let held = self.held[k].as_mut().expect("appended to a held key");
                if !held.parked.iter().any(|(_, p)| *p == m) {
                    self.next_seq += 1;
                    held.parked.push((seq, m));
                    held.retries.push((seq, attempts, false));
                }
            }
            DeferDecision::Reschedule(seq) => {
                let held = self.held[k].as_mut().expect("a released message's key");
                held.retries.retain(|(s, _, _)| *s != seq);
                held.retries.push((seq, attempts, false));
                held.in_flight = None;
            }
            DeferDecision::Refused => {}
        }
        decision
    }

    /// Message `m`'s dead letter (of role `role`), and what it does to its key's hold.
    fn dead_letter(&mut self, m: usize, role: &Role) {
        let k = key_id(m);
        self.letters.push(m);
        match hold::on_dead_letter(self.view(m).as_ref(), role, false, true) {
            OnDeadLetter::Nothing => {}
            OnDeadLetter::Drop(seq) => {
                let held = self.held[k].as_mut().expect("a view was read");
                held.parked.retain(|(s, _)| *s != seq);
                held.retries.retain(|(s, _, _)| *s != seq);
                if held.in_flight == Some(seq) {
                    held.in_flight = None;
                }
                if held.parked.is_empty() {
                    self.held[k] = None;
                }
            }
            other => unreachable!("{other:?}: the skip policy holds no key by a letter"),
        }
    }

    /// The releaser's step for key `k`: sends its first parked message (recording it unless `die`), or
    /// lets the key go.
    fn release(&mut self, k: usize, die: bool) {
        let held = self.held[k].as_ref().expect("a held key");
        match hold::next_release(&held.view(), die, false) {
            ReleaseStep::Send(seq) => {
                let m = held
                    .parked
                    .iter()
                    .find(|(s, _)| *s == seq)
                    .map(|(_, m)| *m)
                    .expect("the releaser sends a parked message");
                self.retry.push((
                    m,
                    Mark::Release {
                        seq,
                        origin: origin(m),
                        digest: hold::digest(&raw(m)),
                    },
                ));
                if die {
                    self.lost_records += 1;
                } else {
                    self.held[k].as_mut().expect("a held key").in_flight = Some(seq);
                }
            }
            ReleaseStep::LetGo => self.held[k] = None,
            ReleaseStep::Wait => unreachable!("the releaser acts only when it may"),
        }
    }
}

/// The lanes of `w` that may act: of those started (the first `KEY_CONCURRENCY`, and one more for each
/// that ended), those not ended.
fn started(w: &Window) -> Vec<usize> {
    let ended = w.lanes.iter().filter(|l| l.ended()).count();
    let started = (KEY_CONCURRENCY + ended).min(w.lanes.len());
    (0..started)
        .filter(|&lane| !w.lanes[lane].ended())
        .collect()
}

impl RetryLanesModel {
    /// Window indices `finished` of consumer `c`'s window are finished: the mark moves, and the position
    /// is reported, as `key_lanes::run` does (or, with the mistake, the highest).
    fn report(&self, s: &mut State, c: usize, finished: &[usize]) {
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

    fn lane_reads(s: &mut State, c: usize, lane: usize) {
        let Worker::Running(w) = &s.consumers[c].worker else {
            unreachable!("a lane of a running window")
        };
        let l = &w.lanes[lane];
        let messages: Vec<usize> = l.messages[l.finished..]
            .iter()
            .take(BATCH)
            .map(|index| w.base + index)
            .collect();
        let marks = vec![Mark::Plain; messages.len()];
        let chunk = s.gate(messages, &marks);
        let Worker::Running(w) = &mut s.consumers[c].worker else {
            unreachable!()
        };
        w.lanes[lane].chunk = Some(chunk);
    }

    fn lane_acts(&self, s: &mut State, c: usize, lane: usize) {
        let Worker::Running(w) = &mut s.consumers[c].worker else {
            unreachable!("a lane of a running window")
        };
        let mut chunk = w.lanes[lane].chunk.take().expect("a chunk in progress");
        let done = s.act(&mut chunk);
        let Worker::Running(w) = &mut s.consumers[c].worker else {
            unreachable!()
        };
        let l = &mut w.lanes[lane];
        if !done {
            l.chunk = Some(chunk);
            return;
        }
        let from = l.finished;
        l.finished += chunk.machine.finished();
        // A lane reports its messages when it ends, as `key_lanes::run` does.
        if l.ended() {
            let finished = l.messages[..l.finished].to_vec();
            debug_assert!(from <= finished.len());
            self.report(s, c, &finished);
        }
    }

    /// The partition moves from its owner: its lanes stop between transactions, what they finished is
    /// reported and committed.
    fn revoke(&self, s: &mut State) {
        s.revokes -= 1;
        let from = s.owner;
        if let Worker::Running(w) = &s.consumers[from].worker {
            let finished: Vec<usize> = w
                .lanes
                .iter()
                .flat_map(|l| {
                    let n = l.finished + l.chunk.as_ref().map_or(0, |c| c.machine.finished());
                    l.messages[..n].to_vec()
                })
                .collect();
            self.report(s, from, &finished);
        }
        if s.up(from) {
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

    fn partition_actions(s: &State, actions: &mut Vec<Step>) {
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
                        actions.push(match w.lanes[lane].chunk {
                            None => Step::LaneReads(c, lane),
                            Some(_) => Step::LaneActs(c, lane),
                        });
                    }
                    if w.lanes.iter().all(Lane::ended) {
                        actions.push(Step::EndWindow(c));
                    }
                }
            }
            if consumer.reported.is_some_and(|r| r != s.committed) && consumer.assigned.is_some() {
                actions.push(Step::Commit(c));
            }
            if s.crashes > 0 && s.up(c) {
                actions.push(Step::Crash(c));
            }
        }
        if s.revokes > 0 {
            actions.push(Step::Revoke);
        }
    }

    fn retry_actions(s: &State, actions: &mut Vec<Step>) {
        if s.up(RETRY_PROCESS) {
            match &s.r_batch {
                None if s.r_pos < s.retry.len() => actions.push(Step::RetryReads),
                None => {}
                Some(chunk) if chunk.advance.is_some() => actions.push(Step::RetryAdvances),
                Some(_) => actions.push(Step::RetryActs),
            }
            if s.r_committed < s.r_pos {
                actions.push(Step::CommitRetry);
            }
        }
        for (k, held) in s.held.iter().enumerate() {
            let Some(held) = held else { continue };
            let view = held.view();
            if hold::next_release(&view, false, false) != ReleaseStep::Wait {
                actions.push(Step::Release(k));
            }
            if s.lost_records == 0
                && matches!(hold::next_release(&view, true, false), ReleaseStep::Send(_))
            {
                actions.push(Step::ReleaseAndDie(k));
            }
            if held.first_retry().is_some_and(|(_, _, due)| !due) {
                actions.push(Step::Tick(k));
            }
        }
    }
}

impl Model for RetryLanesModel {
    type State = State;
    type Action = Step;

    /// The worlds: both first messages of the keys fail once (two keys wait for their retries at once,
    /// their releases may share a batch), or the first message of `a` fails twice (its attempts spent: it is
    /// dead-lettered and leaves its key's queue; `a`'s second message, parked behind it, runs).
    fn init_states(&self) -> Vec<State> {
        vec![State::world([1, 1, 0]), State::world([2, 0, 0])]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Step>) {
        Self::partition_actions(s, actions);
        Self::retry_actions(s, actions);
    }

    fn next_state(&self, last: &State, step: Step) -> Option<State> {
        let mut s = last.clone();
        match step {
            Step::Fetch(c) => {
                let Worker::Idle(base) = s.consumers[c].worker else {
                    return None;
                };
                let lanes = key_lanes::groups(&KEYS[base..])
                    .into_iter()
                    .map(|messages| Lane {
                        messages,
                        finished: 0,
                        chunk: None,
                    })
                    .collect();
                s.consumers[c].worker = Worker::Running(Window {
                    base,
                    lanes,
                    mark: Watermark::new(MESSAGES - base),
                    highest: 0,
                });
            }
            Step::LaneReads(c, lane) => Self::lane_reads(&mut s, c, lane),
            Step::LaneActs(c, lane) => self.lane_acts(&mut s, c, lane),
            Step::EndWindow(c) => {
                let Worker::Running(w) = &s.consumers[c].worker else {
                    return None;
                };
                s.consumers[c].worker = Worker::Idle(w.base + w.mark.prefix());
            }
            Step::Commit(c) => {
                // A commit of an assignment the group moved on from is refused.
                if s.owns(c) {
                    s.committed = s.consumers[c].reported.expect("a reported position");
                }
                s.consumers[c].reported = None;
            }
            Step::RetryReads => {
                let batch: Vec<(usize, Mark)> =
                    s.retry[s.r_pos..].iter().take(BATCH).cloned().collect();
                let (messages, marks): (Vec<usize>, Vec<Mark>) = batch.into_iter().unzip();
                s.r_batch = Some(s.gate(messages, &marks));
            }
            Step::RetryActs => {
                let mut chunk = s.r_batch.take().expect("a batch in progress");
                if s.act(&mut chunk) {
                    s.r_pos += chunk.messages.len();
                } else {
                    s.r_batch = Some(chunk);
                }
            }
            Step::RetryAdvances => {
                let mut chunk = s.r_batch.take().expect("a batch in progress");
                s.advance(&mut chunk);
                s.r_batch = Some(chunk);
            }
            Step::CommitRetry => s.r_committed = s.r_pos,
            Step::Release(k) => s.release(k, false),
            Step::ReleaseAndDie(k) => s.release(k, true),
            Step::Tick(k) => {
                let held = s.held[k].as_mut().expect("a held key");
                let first = held.parked.first().map(|(seq, _)| *seq);
                for retry in &mut held.retries {
                    if Some(retry.0) == first {
                        retry.2 = true;
                    }
                }
            }
            Step::Crash(c) => {
                s.crashes -= 1;
                s.consumers[c] = Consumer {
                    worker: Worker::Down,
                    assigned: None,
                    reported: None,
                };
                if c == RETRY_PROCESS {
                    s.r_batch = None;
                    s.r_pos = s.r_committed;
                }
            }
            Step::Restart(c) => {
                s.consumers[c].worker = Worker::Idle(s.committed);
                if s.owner == c {
                    // Rejoining, it gets the partition back under a new generation.
                    s.assign(c);
                }
            }
            Step::Revoke => self.revoke(&mut s),
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
                |_, s: &State| (0..s.committed).all(|m| s.settled(m)),
            ),
            Property::always(
                "each key's effects happen in offset order",
                |_, s: &State| {
                    (0..KEY_COUNT).all(|k| {
                        let of_key: Vec<usize> = s
                            .order
                            .iter()
                            .copied()
                            .filter(|m| key_id(*m) == k && !s.letters.contains(m))
                            .collect();
                        of_key.windows(2).all(|pair| pair[0] < pair[1])
                    })
                },
            ),
            Property::always("a delayed retry runs only once due", |_, s: &State| {
                !s.early
            }),
            Property::always(
                "with nothing left to do, every message took effect or was dead-lettered, the offset passed \
                 them all and no key is held",
                |model: &Self, s: &State| {
                    has_next(model, s)
                        || (s.committed == MESSAGES
                            && (0..MESSAGES).all(|m| s.done[m] || s.letters.contains(&m))
                            && s.held.iter().all(Option::is_none))
                },
            ),
            Property::sometimes(
                "both keys wait for their delayed retries at once",
                |_, s: &State| s.held.iter().all(Option::is_some),
            ),
            Property::sometimes(
                "a message waits parked behind its key's delayed retry",
                |_, s: &State| s.held.iter().flatten().any(|h| h.parked.len() > 1),
            ),
            Property::sometimes(
                "a window's later key ran while an earlier message waited for its retry",
                |_, s: &State| s.held[0].is_some() && s.done[1],
            ),
            Property::sometimes(
                "two releases share a batch of the retry topic",
                |_, s: &State| {
                    s.r_batch.as_ref().is_some_and(|c| {
                        c.roles
                            .iter()
                            .filter(|r| matches!(r, Role::Release(_)))
                            .count()
                            == 2
                    })
                },
            ),
            Property::sometimes(
                "a release's second copy is read in its first's batch",
                |_, s: &State| {
                    s.r_batch
                        .as_ref()
                        .is_some_and(|c| c.messages.len() == 2 && c.messages[0] == c.messages[1])
                },
            ),
            Property::sometimes("a spent retry is dead-lettered", |_, s: &State| {
                !s.letters.is_empty()
            }),
        ]
    }
}

#[cfg(test)]
mod tests {
    use stateright::Checker;

    use super::*;
    use crate::model::{explore, find};

    #[test]
    fn keys_in_parallel_with_delayed_retries_keep_effects_once_in_key_order_and_commits_behind_unfinished_messages()
     {
        explore(&RetryLanesModel::default(), None).assert_properties();
    }

    #[test]
    fn committing_the_highest_finished_offset_with_delayed_retries_is_found() {
        const PAST: &str = "the committed offset is never past an unfinished message";
        let checker = find(
            &RetryLanesModel {
                highest_finished: true,
            },
            PAST,
        );
        let path = checker.assert_any_discovery(PAST);
        println!("counterexample: {:?}", path.into_actions());
    }
}
