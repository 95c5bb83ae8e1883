//! A model of keys in parallel within a partition together with delayed retries, checked exhaustively
//! with `stateright`: the two stages as they run together (`key_lanes`, and in each lane the hold gate and
//! the batch machine, with `SAGA_RETRY_DELAYED` on).
//!
//! The world: two partitions of one group, each owned by one of two consumer processes: the topic's
//! partition of three messages of two keys (`a b a`), and the group's retry topic's partition, which grows
//! as the releaser sends. Each partition's owner takes a window of what it holds and runs the window's key
//! groups in lanes ([`key_lanes::groups`]), both at once; a lane's messages go through the hold gate's plan
//! ([`hold_gate::plan`], the holds read when the lane's batch starts; one release of a key per batch) and
//! the real [`BatchMachine`], in batches of two; a release goes on from its parked message's attempts
//! ([`hold_gate::attempts_of`]). A transient failure waits parked for its delayed retry
//! ([`hold::decide_defer`]), its key held, and the key's later messages park behind it
//! ([`hold::decide_park`]), in the lane or in a later window; the position reported is the window's
//! low-water mark ([`Watermark`]). The releaser ([`hold::next_release`]) sends a key's first parked message
//! once due (time passing and the releaser's look are one step: nothing else reads a due time), and may
//! once send a copy it does not record (a resend after a minute without an answer: a second copy). A release that committed advances its
//! key ([`hold::advance`]) in a transaction of its own; a retry whose attempts are spent is dead-lettered
//! and leaves its queue ([`hold::on_dead_letter`], the skip policy). In each world ([`World`]) a process may crash while it works (its partitions start again from
//! their committed offsets) and a partition may move, while its owner works, to the other process (a
//! rebalance: its lanes stop between transactions, what they finished is reported and committed), as the
//! world allows; a world may end without either. The worlds: both keys retrying through a rebalance, the
//! same through a crash, and a spent retry with a release's second copy through a crash and a rebalance
//! (each world on its own: together, their states outgrow what a test can explore).
//!
//! Each transaction on the store is one step (the key's lock serializes them; `hold_model` checks the
//! lock's races), and so is a dead letter with what it does to its key's hold (production sends the letter,
//! then records it: a crash between sends it again). The checker proves: each step's effect at most once;
//! each key's effects in offset order (under the skip policy a dead-lettered message keeps no place: run
//! again by its redelivery or replay, it runs when it comes); each partition's committed offset never past
//! a message that is neither finished, parked nor dead-lettered; a delayed retry never run before it is
//! due; and, with nothing left to do, every message took effect or was dead-lettered, the offsets passed
//! them all and no key is held. Putting back "commit the highest finished offset"
//! ([`RetryLanesModel::highest_finished`]) is found.

use saga_core::Origin;
use stateright::{Model, Property};

use crate::hold::{
    self, Advance, BatchHolds, DeferDecision, HeldView, HoldLimits, HoldState, Mark, OnDeadLetter,
    ParkDecision, ReleaseStep, Role,
};
use crate::hold_gate::{self, Facts};
use crate::key_lanes::{self, Watermark};
use crate::machine::{Action, BatchMachine, Event, Fault, Kind};
use crate::model::{has_next, kind_of};

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
/// The partitions: the topic's, and the group's retry topic's.
const ORDERS: usize = 0;
const RETRY: usize = 1;

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

    /// The key once its first parked message's delayed retry is due.
    fn due(&self) -> Self {
        let mut due = self.clone();
        let first = due.parked.first().map(|(seq, _)| *seq);
        for retry in &mut due.retries {
            if Some(retry.0) == first {
                retry.2 = true;
            }
        }
        due
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

/// A lane: its messages (window indices), how many of them finished, the batch in progress.
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

/// A process's worker of a partition.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Worker {
    /// Between windows: the next offset it reads.
    Idle(usize),
    /// In a window.
    Running(Window),
}

/// A consumer process: whether it runs, and per partition its worker, the generation of the assignment it
/// believes it holds and the position it reported for commit.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Consumer {
    up: bool,
    workers: [Worker; 2],
    assigned: [Option<u8>; 2],
    reported: [Option<usize>; 2],
}

/// A partition of the group: its committed offset, its owner, the assignment's generation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Partition {
    committed: usize,
    owner: usize,
    generation: u8,
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
    partitions: [Partition; 2],
    consumers: [Consumer; 2],
    /// The retry topic's partition: what was sent to it (a message and its mark).
    retry: Vec<(usize, Mark)>,
    crashes: u8,
    revokes: u8,
    lost_records: u8,
    /// Whether two keys' releases ran in lanes of one window of the retry topic.
    released_in_lanes: bool,
    /// Whether a release failed again and waits parked, due later.
    rescheduled: bool,
    /// Messages in the order they were first settled for good: their effect or their dead letter.
    first_settled: Vec<usize>,
    /// Attempts before a transiently failing message is dead-lettered.
    max_attempts: u32,
}

/// A step of the system.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Step {
    /// Consumer `.0` takes a window of partition `.1`, from its position to the partition's end.
    Fetch(usize, usize),
    /// Lane `.2` of the window reads its batch's holds and starts the batch.
    LaneReads(usize, usize, usize),
    /// Lane `.2`'s machine acts (one transaction), or, a release committed, advances its key.
    LaneActs(usize, usize, usize),
    /// The window has no message left to run: the worker moves on.
    EndWindow(usize, usize),
    /// The consumer commits the position it reported for the partition.
    Commit(usize, usize),
    /// The releaser sends key `.0`'s first parked message (or lets the key go).
    Release(usize),
    /// It sends a copy it does not record (a resend after a minute without an answer).
    ReleaseAndDie(usize),
    Crash(usize),
    Restart(usize),
    /// Partition `.0` moves to the other process.
    Revoke(usize),
}

/// A world: each message's transient failures, and what may befall it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct World {
    /// Transient failures per message.
    pub transient: [u8; MESSAGES],
    /// Crashes of a process (either, while it works).
    pub crashes: u8,
    /// Rebalances (either partition, while its owner works).
    pub revokes: u8,
    /// Whether the releaser may once send a copy it does not record (a resend after a minute without an
    /// answer): a second copy of a release.
    pub lost_record: bool,
    /// Attempts before a transiently failing message is dead-lettered.
    pub max_attempts: u32,
}

impl World {
    /// Both keys' first messages fail once: two keys wait for their retries at once, and their releases
    /// may share a window of the retry topic.
    const TWO_KEYS_RETRYING: [u8; MESSAGES] = [1, 1, 0];
    /// `a`'s first message fails three times: its release fails again (parked again, due later), then
    /// its attempts (three) are spent: it is dead-lettered and leaves its key's queue; `a`'s second
    /// message, parked behind it, runs.
    const SPENT: [u8; MESSAGES] = [3, 0, 0];
}

/// The model of one world, and optionally the old mistake.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RetryLanesModel {
    pub world: World,
    /// Report the highest finished message's position, not the first unfinished one's.
    pub highest_finished: bool,
}

impl State {
    fn world(world: World) -> Self {
        let consumer = |owned: usize| Consumer {
            up: true,
            workers: [Worker::Idle(0), Worker::Idle(0)],
            assigned: std::array::from_fn(|p| (p == owned).then_some(0)),
            reported: [None, None],
        };
        let partition = |owner| Partition {
            committed: 0,
            owner,
            generation: 0,
        };
        Self {
            transient_left: world.transient,
            done: [false; MESSAGES],
            order: Vec::new(),
            effects: [0; MESSAGES],
            letters: Vec::new(),
            held: [None, None],
            next_seq: 1,
            early: false,
            partitions: [partition(0), partition(1)],
            consumers: [consumer(ORDERS), consumer(RETRY)],
            retry: Vec::new(),
            crashes: world.crashes,
            revokes: world.revokes,
            lost_records: u8::from(!world.lost_record),
            released_in_lanes: false,
            rescheduled: false,
            first_settled: Vec::new(),
            max_attempts: world.max_attempts,
        }
    }

    fn owns(&self, c: usize, p: usize) -> bool {
        self.partitions[p].owner == c
            && self.consumers[c].assigned[p] == Some(self.partitions[p].generation)
    }

    /// Partition `p`'s messages so far, and their marks.
    fn len(&self, p: usize) -> usize {
        if p == ORDERS {
            MESSAGES
        } else {
            self.retry.len()
        }
    }

    fn message(&self, p: usize, offset: usize) -> (usize, Mark) {
        if p == ORDERS {
            (offset, Mark::Plain)
        } else {
            self.retry[offset].clone()
        }
    }

    /// Gives partition `p` to `to` under a new generation, from the committed offset.
    fn assign(&mut self, p: usize, to: usize) {
        let part = &mut self.partitions[p];
        part.generation += 1;
        part.owner = to;
        let (generation, committed) = (part.generation, part.committed);
        let consumer = &mut self.consumers[to];
        if consumer.up {
            consumer.assigned[p] = Some(generation);
            consumer.reported[p] = None;
            consumer.workers[p] = Worker::Idle(committed);
        }
    }

    /// Whether consumer `c` is at work: in a window, or with a position to commit.
    fn busy(&self, c: usize) -> bool {
        let consumer = &self.consumers[c];
        consumer.up
            && (0..2).any(|p| {
                matches!(consumer.workers[p], Worker::Running(_)) || consumer.reported[p].is_some()
            })
    }

    fn window(&mut self, c: usize, p: usize) -> &mut Window {
        match &mut self.consumers[c].workers[p] {
            Worker::Running(w) => w,
            Worker::Idle(_) => unreachable!("a lane of a running window"),
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
        let kinds = plan.roles.iter().map(kind_of).collect();
        let attempts = messages
            .iter()
            .zip(&plan.roles)
            .map(|(&m, role)| hold_gate::attempts_of(role, found.views.get(KEYS[m]), 0))
            .collect();
        let mut machine = BatchMachine::new(kinds, attempts, self.max_attempts);
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
                if !self.first_settled.contains(&m) {
                    self.first_settled.push(m);
                }
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
                self.rescheduled = true;
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
        if !self.first_settled.contains(&m) {
            self.first_settled.push(m);
        }
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
        let due = self.held[k].as_ref().expect("a held key").due();
        let held = self.held[k].insert(due).clone();
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

/// Whether each key's messages of `sequence` that `kept` keeps come in offset order.
fn in_key_order(sequence: &[usize], kept: impl Fn(usize) -> bool) -> bool {
    (0..KEY_COUNT).all(|k| {
        let of_key: Vec<usize> = sequence
            .iter()
            .copied()
            .filter(|m| key_id(*m) == k && kept(*m))
            .collect();
        of_key.windows(2).all(|pair| pair[0] < pair[1])
    })
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
    /// Window indices `finished` of consumer `c`'s window of partition `p` are finished: the mark moves,
    /// and the position is reported, as `key_lanes::run` does (or, with the mistake, the highest).
    fn report(&self, s: &mut State, c: usize, p: usize, finished: &[usize]) {
        let w = s.window(c, p);
        for &index in finished {
            w.mark.finish(index);
            w.highest = w.highest.max(index + 1);
        }
        let reported = if self.highest_finished {
            w.highest
        } else {
            w.mark.prefix()
        };
        let position = w.base + reported;
        if reported > 0 {
            s.consumers[c].reported[p] = Some(position);
        }
    }

    fn fetch(s: &mut State, c: usize, p: usize) {
        let Worker::Idle(base) = s.consumers[c].workers[p] else {
            unreachable!("a fetch between windows")
        };
        let keys: Vec<&[u8]> = (base..s.len(p))
            .map(|offset| KEYS[s.message(p, offset).0])
            .collect();
        let lanes = key_lanes::groups(&keys)
            .into_iter()
            .map(|messages| Lane {
                messages,
                finished: 0,
                chunk: None,
            })
            .collect();
        s.consumers[c].workers[p] = Worker::Running(Window {
            base,
            lanes,
            mark: Watermark::new(keys.len()),
            highest: 0,
        });
    }

    fn lane_reads(s: &mut State, c: usize, p: usize, lane: usize) {
        let w = s.window(c, p).clone();
        let l = &w.lanes[lane];
        let (messages, marks): (Vec<usize>, Vec<Mark>) = l.messages[l.finished..]
            .iter()
            .take(BATCH)
            .map(|index| s.message(p, w.base + index))
            .unzip();
        let chunk = s.gate(messages, &marks);
        let releases = |l: &Lane| {
            l.chunk
                .as_ref()
                .is_some_and(|c| c.roles.iter().any(|r| matches!(r, Role::Release(_))))
        };
        let w = s.window(c, p);
        w.lanes[lane].chunk = Some(chunk);
        if w.lanes.iter().filter(|l| releases(l)).count() == 2 {
            s.released_in_lanes = true;
        }
    }

    fn lane_acts(&self, s: &mut State, c: usize, p: usize, lane: usize) {
        let mut chunk = s.window(c, p).lanes[lane]
            .chunk
            .take()
            .expect("a batch in progress");
        let done = if chunk.advance.is_some() {
            s.advance(&mut chunk);
            false
        } else {
            s.act(&mut chunk)
        };
        let l = &mut s.window(c, p).lanes[lane];
        if !done {
            l.chunk = Some(chunk);
            return;
        }
        l.finished += chunk.machine.finished();
        // A lane reports its messages when it ends, as `key_lanes::run` does.
        if l.ended() {
            let finished = l.messages.clone();
            self.report(s, c, p, &finished);
        }
    }

    /// Partition `p` moves from its owner: its lanes stop between transactions, what they finished is
    /// reported and committed.
    fn revoke(&self, s: &mut State, p: usize) {
        s.revokes -= 1;
        let from = s.partitions[p].owner;
        if let Worker::Running(w) = &s.consumers[from].workers[p] {
            let finished: Vec<usize> = w
                .lanes
                .iter()
                .flat_map(|l| {
                    // A release whose advance is not recorded yet is not finished.
                    let batch = l.chunk.as_ref().map_or(0, |c| c.machine.finished());
                    l.messages[..l.finished + batch].to_vec()
                })
                .collect();
            self.report(s, from, p, &finished);
        }
        if let Some(reported) = s.consumers[from].reported[p].take()
            && s.owns(from, p)
        {
            s.partitions[p].committed = reported;
        }
        let consumer = &mut s.consumers[from];
        consumer.workers[p] = Worker::Idle(0);
        consumer.assigned[p] = None;
        s.assign(p, 1 - from);
    }

    fn worker_actions(s: &State, c: usize, p: usize, actions: &mut Vec<Step>) {
        let consumer = &s.consumers[c];
        match &consumer.workers[p] {
            Worker::Idle(position) => {
                if s.owns(c, p) && *position < s.len(p) {
                    actions.push(Step::Fetch(c, p));
                }
            }
            Worker::Running(w) => {
                for lane in started(w) {
                    actions.push(match w.lanes[lane].chunk {
                        None => Step::LaneReads(c, p, lane),
                        Some(_) => Step::LaneActs(c, p, lane),
                    });
                }
                if w.lanes.iter().all(Lane::ended) {
                    actions.push(Step::EndWindow(c, p));
                }
            }
        }
        if consumer.reported[p].is_some_and(|r| r != s.partitions[p].committed)
            && consumer.assigned[p].is_some()
        {
            actions.push(Step::Commit(c, p));
        }
    }

    fn releaser_actions(s: &State, actions: &mut Vec<Step>) {
        for (k, held) in s.held.iter().enumerate() {
            let Some(held) = held else { continue };
            // The releaser acts once the time has come: time passing and its look are one step here
            // (nothing but the releaser reads a retry's due time).
            let view = held.due().view();
            if hold::next_release(&view, false, false) != ReleaseStep::Wait {
                actions.push(Step::Release(k));
            }
            if s.lost_records == 0
                && matches!(hold::next_release(&view, true, false), ReleaseStep::Send(_))
            {
                actions.push(Step::ReleaseAndDie(k));
            }
        }
    }
}

impl Model for RetryLanesModel {
    type State = State;
    type Action = Step;

    fn init_states(&self) -> Vec<State> {
        vec![State::world(self.world)]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Step>) {
        for c in 0..2 {
            if !s.consumers[c].up {
                actions.push(Step::Restart(c));
                continue;
            }
            for p in 0..2 {
                Self::worker_actions(s, c, p, actions);
            }
            if s.crashes > 0 && s.busy(c) {
                actions.push(Step::Crash(c));
            }
        }
        for p in 0..2 {
            let owner = s.partitions[p].owner;
            if s.revokes > 0 && matches!(s.consumers[owner].workers[p], Worker::Running(_)) {
                actions.push(Step::Revoke(p));
            }
        }
        Self::releaser_actions(s, actions);
    }

    fn next_state(&self, last: &State, step: Step) -> Option<State> {
        let mut s = last.clone();
        match step {
            Step::Fetch(c, p) => Self::fetch(&mut s, c, p),
            Step::LaneReads(c, p, lane) => Self::lane_reads(&mut s, c, p, lane),
            Step::LaneActs(c, p, lane) => self.lane_acts(&mut s, c, p, lane),
            Step::EndWindow(c, p) => {
                let w = s.window(c, p);
                let next = w.base + w.mark.prefix();
                s.consumers[c].workers[p] = Worker::Idle(next);
            }
            Step::Commit(c, p) => {
                // A commit of an assignment the group moved on from is refused.
                if s.owns(c, p) {
                    s.partitions[p].committed =
                        s.consumers[c].reported[p].expect("a reported position");
                }
                s.consumers[c].reported[p] = None;
            }
            Step::Release(k) => s.release(k, false),
            Step::ReleaseAndDie(k) => s.release(k, true),
            Step::Crash(c) => {
                s.crashes -= 1;
                s.consumers[c] = Consumer {
                    up: false,
                    workers: [Worker::Idle(0), Worker::Idle(0)],
                    assigned: [None, None],
                    reported: [None, None],
                };
            }
            Step::Restart(c) => {
                s.consumers[c].up = true;
                for p in 0..2 {
                    s.consumers[c].workers[p] = Worker::Idle(s.partitions[p].committed);
                    if s.partitions[p].owner == c {
                        // Rejoining, it gets its partition back under a new generation.
                        s.assign(p, c);
                    }
                }
            }
            Step::Revoke(p) => self.revoke(&mut s, p),
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
                |_, s: &State| {
                    (0..s.partitions[ORDERS].committed).all(|m| s.settled(m))
                        && s.retry[..s.partitions[RETRY].committed]
                            .iter()
                            .all(|(m, _)| s.settled(*m))
                },
            ),
            Property::always(
                "each key's effects happen in offset order",
                |_, s: &State| in_key_order(&s.order, |m| !s.letters.contains(&m)),
            ),
            Property::always(
                "each key's messages are first settled (their effect or their dead letter) in offset order",
                |_, s: &State| in_key_order(&s.first_settled, |_| true),
            ),
            Property::always(
                "a release in flight has a copy the retry partition has not committed past",
                |_, s: &State| {
                    let uncommitted = &s.retry[s.partitions[RETRY].committed..];
                    s.held.iter().flatten().all(|h| {
                        h.in_flight.is_none_or(|seq| {
                            uncommitted.iter().any(
                                |(_, mark)| matches!(mark, Mark::Release { seq: q, .. } if *q == seq),
                            )
                        })
                    })
                },
            ),
            Property::always("a delayed retry runs only once due", |_, s: &State| {
                !s.early
            }),
            Property::always(
                "with nothing left to do, every message took effect or was dead-lettered, the offsets \
                 passed them all and no key is held",
                |model: &Self, s: &State| {
                    has_next(model, s)
                        || ((0..2).all(|p| s.partitions[p].committed == s.len(p))
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
                "two keys' releases run in lanes of one window of the retry topic",
                |_, s: &State| s.released_in_lanes,
            ),
            Property::sometimes(
                "a release's second copy is in its first's batch",
                |_, s: &State| {
                    s.consumers.iter().any(|c| match &c.workers[RETRY] {
                        Worker::Running(w) => w.lanes.iter().any(|l| {
                            l.chunk.as_ref().is_some_and(|c| {
                                c.messages.len() == 2 && c.messages[0] == c.messages[1]
                            })
                        }),
                        Worker::Idle(_) => false,
                    })
                },
            ),
            Property::sometimes("a spent retry is dead-lettered", |_, s: &State| {
                !s.letters.is_empty()
            }),
            Property::sometimes(
                "a release failed again and waits parked, due later",
                |_, s: &State| s.rescheduled,
            ),
            Property::sometimes(
                "everything finished after a crash or a rebalance",
                |model: &Self, s: &State| {
                    (s.crashes < model.world.crashes || s.revokes < model.world.revokes)
                        && !has_next(model, s)
                },
            ),
            Property::sometimes(
                "everything finished without a crash or a rebalance",
                |model: &Self, s: &State| {
                    s.crashes == model.world.crashes
                        && s.revokes == model.world.revokes
                        && !has_next(model, s)
                },
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use stateright::{Checker, Expectation};

    use super::*;
    use crate::model::{explore, find};

    /// Explores `world` whole: no property the model says always holds fails, and each of `seen` happens
    /// in some run.
    fn check(world: World, seen: &[&'static str]) {
        let model = RetryLanesModel {
            world,
            highest_finished: false,
        };
        let checker = explore(&model, None);
        for property in model.properties() {
            if matches!(property.expectation, Expectation::Always) {
                checker.assert_no_discovery(property.name);
            }
        }
        let names: Vec<&str> = model.properties().iter().map(|p| p.name).collect();
        for property in seen {
            assert!(names.contains(property), "{property:?} is not a property");
            checker.assert_any_discovery(property);
        }
    }

    /// Both keys' first messages fail once.
    fn two_keys_retrying(crashes: u8, revokes: u8) -> World {
        World {
            transient: World::TWO_KEYS_RETRYING,
            crashes,
            revokes,
            lost_record: false,
            max_attempts: 2,
        }
    }

    #[test]
    fn two_keys_retrying_in_parallel_through_a_rebalance_keep_effects_once_in_order_and_commits_behind()
     {
        check(
            two_keys_retrying(0, 1),
            &[
                "both keys wait for their delayed retries at once",
                "a message waits parked behind its key's delayed retry",
                "a window's later key ran while an earlier message waited for its retry",
                "two keys' releases run in lanes of one window of the retry topic",
                "everything finished without a crash or a rebalance",
                "everything finished after a crash or a rebalance",
            ],
        );
    }

    #[test]
    fn two_keys_retrying_in_parallel_through_a_crash_keep_effects_once_in_order_and_commits_behind()
    {
        check(
            two_keys_retrying(1, 0),
            &[
                "both keys wait for their delayed retries at once",
                "two keys' releases run in lanes of one window of the retry topic",
                "everything finished after a crash or a rebalance",
            ],
        );
    }

    #[test]
    fn a_retry_failing_again_then_spent_with_a_second_copy_through_a_crash_and_a_rebalance_keeps_order()
     {
        check(
            World {
                transient: World::SPENT,
                crashes: 1,
                revokes: 1,
                lost_record: true,
                max_attempts: 3,
            },
            &[
                "a message waits parked behind its key's delayed retry",
                "a release failed again and waits parked, due later",
                "a release's second copy is in its first's batch",
                "a spent retry is dead-lettered",
                "everything finished after a crash or a rebalance",
            ],
        );
    }

    #[test]
    fn committing_the_highest_finished_offset_with_delayed_retries_is_found() {
        const PAST: &str = "the committed offset is never past an unfinished message";
        let checker = find(
            &RetryLanesModel {
                world: two_keys_retrying(0, 1),
                highest_finished: true,
            },
            PAST,
        );
        let path = checker.assert_any_discovery(PAST);
        println!("counterexample: {:?}", path.into_actions());
    }
}
