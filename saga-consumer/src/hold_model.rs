//! A model of per-key order through failures, checked exhaustively with `stateright`: the consumer's
//! protocol around held keys (see `hold`), beside `model`'s protocol of batches.
//!
//! The decisions are the code's own: the model runs each batch through the hold gate's plan
//! ([`hold_gate::plan`]: each message's part, and the keys the batch machine holds within the batch), the
//! real [`BatchMachine`], and the store's decisions: [`hold::decide_park`] (the park transaction, read again
//! under the key's lock), [`hold::on_dead_letter`] (the transaction that records a dead letter),
//! [`hold::advance`] (the transaction after a head or a release finished) and [`hold::next_release`] (the
//! releaser); it only plays the world around them: the partitions, the group's retry topic, the operator
//! replaying letters, the store and its locks, crashes.
//!
//! The worlds: one key, its messages on one partition or on two partitions of one group, consumed in order
//! under the hold-key policy, in batches of up to [`BATCH`]. A script says which fail for good on their
//! first run (a gateway down: their replay succeeds), and whether the second message's step starts paused
//! (an operator resumes it, any time). On two partitions both first messages fail at once: their two dead
//! letters race. A dead letter's transaction is two steps around the key's lock: it locks and reads the
//! key, then records what the letter does to the hold and commits; every other transaction on the key waits
//! for the lock, as `hold::KEY_LOCK` (the lock `Holds::lock` takes) says. With `KeyLock::RowOnly` (the
//! defect put back), a transaction on a key that is not held locks nothing (a `FOR UPDATE` on a row that
//! does not exist), so two letters both find the key free.
//! The consumer process may crash once anywhere in the one-partition worlds (both workers start again from
//! the committed offsets; a head or release whose step committed but whose advance did not comes back and is
//! found done); the releaser may once send a release and die before recording it (a second copy follows).
//! The operator replays every dead letter, any time.
//!
//! With delayed retries ([`HoldModel::delayed_retries`]), other worlds: a message fails transiently (its
//! first runs, as a script says) and waits parked for its next attempt ([`hold::decide_defer`], under the
//! key's lock), its key held; time passes (a tick makes its due time come); the releaser sends it only when
//! due; the retry worker runs it with its attempts, and a new failure parks it again or, its attempts
//! spent, dead-letters it (dropped from its queue under the skip policy, the key's head under hold-key). On
//! two partitions both first messages fail at once and race for the key. The checker also proves that a
//! retry never runs before its due time, and finds it does when the release's classification ignores which
//! copy the releaser sent last ([`HoldModel::ignore_in_flight`], the defect put back).

use saga_core::Origin;
use stateright::{Model, Property};

use crate::model::{has_next, kind_of};

use crate::hold::{
    self, Advance, BatchHolds, DeferDecision, HeldView, HoldLimits, HoldState, Mark, OnDeadLetter,
    ParkDecision, ReleaseStep, Role,
};
use crate::hold_gate::{self, Facts};
use crate::machine::{Action, BatchMachine, Event, Fault, Kind};

/// Most messages of the partition in one batch.
pub(crate) const BATCH: usize = 2;
/// The message whose step may be paused.
const PAUSABLE: usize = 1;

/// Most messages of the key, on its partitions.
pub(crate) const MESSAGES: usize = 4;

/// The partitions of the group.
const PARTITIONS: usize = 2;

/// The step the pausable message belongs to (every other message's step is its own).
const PAUSED_STEP: &str = "paused-step";

/// The key's bytes.
const KEY: &[u8] = b"k";

/// Attempts before a transiently failing message is dead-lettered, in the delayed retries' worlds.
const MAX_ATTEMPTS: u32 = 3;

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
    /// The parked messages waiting for their delayed retries: (sequence number, attempts made, due).
    retries: Vec<(i64, u32, bool)>,
    /// The message whose delayed retry holds the key (its plain redelivery is stale), if one does.
    retrying: Option<usize>,
}

/// Where the messages are: how many of them each partition holds, in order (message `m` is the
/// `m - first(p)`th of its partition).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Layout([usize; PARTITIONS]);

impl Layout {
    fn first(self, p: usize) -> usize {
        self.0[..p].iter().sum()
    }

    fn len(self, p: usize) -> usize {
        self.0[p]
    }

    fn messages(self) -> usize {
        self.0.iter().sum()
    }

    fn partition_of(self, m: usize) -> usize {
        (0..PARTITIONS)
            .find(|p| m < self.first(*p) + self.len(*p))
            .expect("a message of the world")
    }
}

fn origin(layout: Layout, m: usize) -> Origin {
    let p = layout.partition_of(m);
    Origin {
        topic: "orders".into(),
        partition: p as i32,
        offset: (m - layout.first(p)) as i64,
    }
}

/// Message `m` as consumed.
fn raw(layout: Layout, m: usize) -> saga_core::RawMessage {
    saga_core::RawMessage {
        origin: origin(layout, m),
        key: Some(KEY.to_vec()),
        payload: Some(format!("{{\"m\":{m}}}").into_bytes()),
        headers: saga_core::Headers::new(),
        timestamp_ms: None,
    }
}

fn letter_id(letter: usize) -> String {
    format!("letter-{letter}")
}

impl Held {
    /// The store's view of it; `letters` says which message each dead letter is of.
    fn view(&self, layout: Layout, letters: &[usize]) -> HeldView {
        HeldView {
            state: self.state,
            head_letter: self.head.map(letter_id),
            head_origin: self
                .head
                .map(|letter| origin(layout, letters[letter]))
                .or_else(|| self.retrying.map(|m| origin(layout, m))),
            first: self
                .parked
                .first()
                .map(|(s, m)| (*s, origin(layout, *m), hold::digest(&raw(layout, *m)))),
            parked: self.parked.len() as i64,
            in_flight: self.in_flight,
            retrying: self.retrying.is_some(),
            first_due: self.first_retry().is_none_or(|(_, _, due)| due),
            first_attempts: self.first_retry().map_or(0, |(_, attempts, _)| attempts),
        }
    }

    /// The first parked message's delayed retry, if it waits for one.
    fn first_retry(&self) -> Option<(i64, u32, bool)> {
        let (seq, _) = self.parked.first()?;
        self.retries.iter().find(|(s, _, _)| s == seq).copied()
    }
}

/// A worker of the retry topic: between messages, with the role of its next one read, or with a head or
/// release whose step committed and whose advance is next.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Worker {
    Idle,
    Classified(Role),
    Ran(Role),
}

/// A partition worker's batch: its first message, each message's role, the machine, and the dead letter
/// whose transaction is open (the message's index in the batch, and the key's view once it is read).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct PartitionBatch {
    base: usize,
    roles: Vec<Role>,
    machine: BatchMachine,
    letter: Option<(usize, Option<Option<HeldView>>)>,
}

/// A partition of the group: the next message to consume (finished before it), the committed offset, its
/// batch.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub(crate) struct Partition {
    pos: usize,
    committed: usize,
    batch: Option<PartitionBatch>,
}

/// The world.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct State {
    layout: Layout,
    partitions: [Partition; PARTITIONS],
    /// Whether [`PAUSABLE`]'s step is paused.
    paused: bool,
    /// The group's retry topic: what was sent to it, the next to consume, the committed offset, its worker.
    retry: Vec<(usize, Mark)>,
    r_pos: usize,
    r_committed: usize,
    r_worker: Worker,
    held: Option<Held>,
    next_seq: i64,
    /// The partition whose dead letter's transaction holds the key's lock.
    key_lock: Option<usize>,
    /// Effects in commit order, and which step keys are done.
    effects: Vec<usize>,
    done: [bool; MESSAGES],
    /// Dead letters (their messages), and which the operator replayed.
    letters: Vec<usize>,
    replayed: Vec<bool>,
    /// First runs still to fail, per message.
    fails_left: [bool; MESSAGES],
    /// Transient failures still to come, per message (delayed retries' worlds).
    transient_left: [u8; MESSAGES],
    /// Whether delayed retries are on, and whether the messages' policy holds keys.
    delayed: bool,
    policy_holds: bool,
    /// Whether a delayed retry ran before its due time.
    early: bool,
    /// Whether a released message left its queue by its dead letter (`OnDeadLetter::Drop`).
    dropped: bool,
    crashes: u8,
    lost_records: u8,
}

/// What happens next.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Step {
    PartitionReads(usize),
    PartitionActs(usize),
    /// A partition's dead letter's transaction locks its key (waiting for the lock) and reads it.
    LetterLocks(usize),
    /// It records what the letter does to the hold, and commits (releasing the lock).
    LetterCommits(usize),
    RetryReads,
    RetryActs,
    RetryAdvances,
    CommitPartition(usize),
    CommitRetry,
    Crash,
    Release,
    ReleaseAndDie,
    Replay(usize),
    Resume,
    /// Time passes: the first parked message's delayed retry is due.
    Tick,
}

/// The model: whether the releaser is the put-back bug (everything released at once), and what a
/// transaction on the key locks (production's `hold::KEY_LOCK`, or the other put-back bug).
#[derive(Debug, Clone, Copy)]
pub(crate) struct HoldModel {
    pub release_all_at_once: bool,
    pub key_lock: hold::KeyLock,
    /// The delayed retries' worlds instead of the dead letters' and pauses'.
    pub delayed_retries: bool,
    /// The defect: a release classified as its key's first parked message whatever copy the releaser sent
    /// last (`in_flight` not checked).
    pub ignore_in_flight: bool,
}

impl Default for HoldModel {
    fn default() -> Self {
        Self {
            release_all_at_once: false,
            key_lock: hold::KEY_LOCK,
            delayed_retries: false,
            ignore_in_flight: false,
        }
    }
}

impl State {
    /// A world at its start: messages laid out as `layout`, their scripted failures, the policy; nothing
    /// paused, delayed retries off. The two-partition worlds do not crash: the one-partition worlds cover
    /// crashes, and the two-partition ones' interleavings are the keys'.
    fn world(
        layout: Layout,
        fails_left: [bool; MESSAGES],
        transient_left: [u8; MESSAGES],
        policy_holds: bool,
    ) -> Self {
        Self {
            layout,
            partitions: Default::default(),
            paused: false,
            retry: Vec::new(),
            r_pos: 0,
            r_committed: 0,
            r_worker: Worker::Idle,
            held: None,
            next_seq: 1,
            key_lock: None,
            effects: Vec::new(),
            done: [false; MESSAGES],
            letters: Vec::new(),
            replayed: Vec::new(),
            fails_left,
            transient_left,
            delayed: false,
            policy_holds,
            early: false,
            dropped: false,
            crashes: u8::from(layout.len(1) > 0),
            lost_records: 0,
        }
    }

    fn paused(&self, m: usize) -> bool {
        self.paused && m == PAUSABLE
    }

    /// What the hold gate knows of message `m`, marked `mark`.
    fn facts(&self, m: usize, mark: Mark) -> Facts<'static> {
        Facts {
            key: KEY,
            keyed: true,
            mark,
            origin: std::borrow::Cow::Owned(origin(self.layout, m)),
            step: Some(if m == PAUSABLE { PAUSED_STEP } else { "a-step" }),
            policy_holds: self.policy_holds,
        }
    }

    /// What the gate reads for a batch: the key's view and the paused steps.
    fn found(&self) -> BatchHolds {
        let mut found = BatchHolds::default();
        if let Some(view) = self.view() {
            found.views.insert(KEY.to_vec(), view);
        }
        if self.paused {
            found.paused.insert(PAUSED_STEP.to_owned());
        }
        found
    }

    /// Records message `m`'s dead letter and what it does to the hold, decided on `view` (read under the
    /// key's lock, or, with the defect, without one), for a message of role `role`.
    fn dead_letter(&mut self, m: usize, role: &Role, view: Option<&HeldView>) {
        self.fails_left[m] = false;
        let letter = self.letters.len();
        self.letters.push(m);
        self.replayed.push(false);
        match hold::on_dead_letter(view, role, self.policy_holds, true) {
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
            // The insert: a key held meanwhile (only possible without the key's lock) takes no head.
            OnDeadLetter::Hold => {
                if self.held.is_none() {
                    self.held = Some(Held {
                        state: HoldState::Held,
                        head: Some(letter),
                        parked: Vec::new(),
                        in_flight: None,
                        retries: Vec::new(),
                        retrying: None,
                    });
                }
            }
            OnDeadLetter::ReHead { drop_seq } => {
                let held = self.held.as_mut().expect("a view was read");
                if let Some(seq) = drop_seq {
                    held.parked.retain(|(s, _)| *s != seq);
                    held.retries.retain(|(s, _, _)| *s != seq);
                }
                held.state = HoldState::Held;
                held.head = Some(letter);
                held.in_flight = None;
                // Held by a letter now, no longer for delayed retries alone.
                held.retrying = None;
            }
            // A spent delayed retry (or a message behind one, under the skip policy) leaves its queue.
            OnDeadLetter::Drop(seq) => {
                self.dropped = true;
                let held = self.held.as_mut().expect("a view was read");
                held.parked.retain(|(s, _)| *s != seq);
                held.retries.retain(|(s, _, _)| *s != seq);
                if held.in_flight == Some(seq) {
                    held.in_flight = None;
                }
                if held.parked.is_empty() && held.state == HoldState::Releasing {
                    self.held = None;
                }
            }
        }
    }

    /// Reads partition `p`'s next batch's holds (the hold gate) and starts its machine.
    fn partition_reads(&mut self, p: usize) {
        let base = self.layout.first(p) + self.partitions[p].pos;
        let end = self.layout.first(p) + self.layout.len(p);
        let len = BATCH.min(end - base);
        let facts: Vec<Facts<'_>> = (base..base + len)
            .map(|m| self.facts(m, Mark::Plain))
            .collect();
        let plan = hold_gate::plan(&facts, Some(&self.found()), self.delayed);
        let kinds = plan.roles.iter().map(kind_of).collect();
        let max_attempts = if self.delayed { MAX_ATTEMPTS } else { 1 };
        let mut machine = BatchMachine::new(kinds, vec![0; len], max_attempts);
        if let Some((keys, holds)) = plan.machine_holds {
            machine = machine.with_holds(keys, holds);
        }
        if let Some(defers) = plan.defers {
            machine = machine.with_defers(defers);
        }
        self.partitions[p].batch = Some(PartitionBatch {
            base,
            roles: plan.roles,
            machine,
            letter: None,
        });
    }

    /// One action of partition `p`'s machine, performed and answered (a dead letter opens its transaction,
    /// answered when it commits).
    fn partition_acts(&mut self, p: usize) {
        let mut batch = self.partitions[p]
            .batch
            .take()
            .expect("a batch in progress");
        let action = batch.machine.next();
        let event = match action {
            Action::Done => {
                self.partitions[p].pos =
                    batch.base + batch.machine.finished() - self.layout.first(p);
                return;
            }
            Action::Transact { start, end } => {
                // One transaction: the first message that fails rolls it back and is named; a stale one
                // claims nothing and runs nothing.
                let runs = |i: &usize| batch.roles[*i] != Role::Stale;
                match (start..end).filter(runs).find(|i| {
                    self.fails_left[batch.base + i] || self.transient_left[batch.base + i] > 0
                }) {
                    Some(index) if self.fails_left[batch.base + index] => Event::ItemFailed {
                        index,
                        fault: Fault::Permanent(format!("m{} fails", batch.base + index)),
                    },
                    Some(index) => {
                        self.transient_left[batch.base + index] -= 1;
                        Event::ItemFailed {
                            index,
                            fault: Fault::Transient(format!("m{} fails", batch.base + index)),
                        }
                    }
                    None => {
                        for i in (start..end).filter(runs) {
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
                batch.letter = Some((index, None));
                self.partitions[p].batch = Some(batch);
                return;
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
            Action::Defer {
                index, attempts, ..
            } => {
                let role = batch.roles[index].clone();
                match self.defer(batch.base + index, &role, attempts) {
                    DeferDecision::Refused => Event::DeferRefused,
                    _ => Event::Deferred,
                }
            }
            Action::Wait { .. } => Event::Waited,
            other => unreachable!("{other:?} has no part in this world"),
        };
        batch.machine.on(event);
        self.partitions[p].pos = batch.base + batch.machine.finished() - self.layout.first(p);
        self.partitions[p].batch = Some(batch);
    }

    /// Partition `p`'s dead letter's transaction locks the key as `lock` says and reads it.
    fn letter_locks(&mut self, p: usize, lock: hold::KeyLock) {
        let view = self.view();
        if lock.serializes(view.is_some()) {
            self.key_lock = Some(p);
        }
        let batch = self.partitions[p]
            .batch
            .as_mut()
            .expect("a batch in progress");
        let letter = batch.letter.as_mut().expect("a letter in progress");
        letter.1 = Some(view);
    }

    /// Partition `p`'s dead letter's transaction records its letter and commits.
    fn letter_commits(&mut self, p: usize) {
        let mut batch = self.partitions[p]
            .batch
            .take()
            .expect("a batch in progress");
        let (index, view) = batch.letter.take().expect("a letter in progress");
        let view = view.expect("the key was read");
        let role = batch.roles[index].clone();
        self.dead_letter(batch.base + index, &role, view.as_ref());
        if self.key_lock == Some(p) {
            self.key_lock = None;
        }
        batch.machine.on(Event::DeadLettered);
        self.partitions[p].pos = batch.base + batch.machine.finished() - self.layout.first(p);
        self.partitions[p].batch = Some(batch);
    }

    fn parked_total(&self) -> i64 {
        self.held.as_ref().map_or(0, |h| h.parked.len() as i64)
    }

    fn view(&self) -> Option<HeldView> {
        self.held
            .as_ref()
            .map(|h| h.view(self.layout, &self.letters))
    }

    /// The transaction of message `m` run with role `role` by the retry worker: its step (or its dead
    /// letter, with what that does to the hold, in one transaction under the key's lock). Whether it
    /// committed a step (not a dead letter).
    fn run(&mut self, m: usize, role: &Role) -> bool {
        if let (Role::Release(seq), Some(held)) = (role, &self.held)
            && held.retries.iter().any(|(s, _, due)| s == seq && !due)
        {
            self.early = true;
        }
        if self.fails_left[m] {
            let view = self.view();
            self.dead_letter(m, role, view.as_ref());
            return false;
        }
        if self.transient_left[m] > 0 {
            // As the executor does: attempts from the parked message's, then parked again or, spent, a dead
            // letter (or, where it may not wait parked, a retry in place: the next failure or its success).
            self.transient_left[m] -= 1;
            let view = self.view();
            let attempts = view.as_ref().map_or(0, |v| v.first_attempts) + 1;
            if attempts >= MAX_ATTEMPTS {
                self.dead_letter(m, role, view.as_ref());
                return false;
            }
            if self.defer(m, role, attempts) != DeferDecision::Refused {
                return false;
            }
            return self.run(m, role);
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
                retries: Vec::new(),
                retrying: None,
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

    /// The delayed retry of message `m` (of role `role`, after `attempts`), under the key's lock.
    fn defer(&mut self, m: usize, role: &Role, attempts: u32) -> DeferDecision {
        let decision = hold::decide_defer(self.view().as_ref(), role, self.parked_total(), &LIMITS);
        match decision {
            DeferDecision::Create => {
                let seq = self.next_seq;
                self.next_seq += 1;
                self.held = Some(Held {
                    state: HoldState::Releasing,
                    head: None,
                    parked: vec![(seq, m)],
                    in_flight: None,
                    retries: vec![(seq, attempts, false)],
                    retrying: Some(m),
                });
            }
            DeferDecision::Append => {
                let held = self.held.as_mut().expect("appended to a held key");
                if !held.parked.iter().any(|(_, p)| *p == m) {
                    let seq = self.next_seq;
                    self.next_seq += 1;
                    held.parked.push((seq, m));
                    held.retries.push((seq, attempts, false));
                }
            }
            DeferDecision::Reschedule(seq) => {
                let held = self.held.as_mut().expect("a released message's key");
                held.retries.retain(|(s, _, _)| *s != seq);
                held.retries.push((seq, attempts, false));
                held.in_flight = None;
            }
            DeferDecision::Refused => {}
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
                held.retries.retain(|(s, _, _)| *s != seq);
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

    /// Whether nothing of the world is under way (every offset committed, no batch, no worker busy).
    fn busy(&self) -> bool {
        self.partitions
            .iter()
            .any(|p| p.committed < p.pos || p.batch.is_some())
            || self.r_committed < self.r_pos
            || self.r_worker != Worker::Idle
    }
}

impl HoldModel {
    /// The actions of the partitions: reading a batch, its machine's next action, its dead letter's two
    /// steps, committing its offset.
    fn partition_actions(&self, s: &State, actions: &mut Vec<Step>) {
        let free = s.key_lock.is_none();
        for (p, part) in s.partitions.iter().enumerate() {
            match &part.batch {
                None if part.pos < s.layout.len(p) => actions.push(Step::PartitionReads(p)),
                // A park is a transaction on the key: it waits for the key's lock.
                Some(batch) => match &batch.letter {
                    None if free || !next_parks(batch) => actions.push(Step::PartitionActs(p)),
                    None => {}
                    Some((_, None)) if free => actions.push(Step::LetterLocks(p)),
                    Some((_, None)) => {}
                    Some((_, Some(_))) => actions.push(Step::LetterCommits(p)),
                },
                None => {}
            }
            if part.committed < part.pos {
                actions.push(Step::CommitPartition(p));
            }
        }
    }
}

/// Whether `batch`'s machine parks a message next (a transaction on the key).
fn next_parks(batch: &PartitionBatch) -> bool {
    matches!(
        batch.machine.clone().next(),
        Action::Park { .. } | Action::Defer { .. }
    )
}

impl Model for HoldModel {
    type State = State;
    type Action = Step;

    fn init_states(&self) -> Vec<State> {
        if self.delayed_retries {
            return delayed_worlds();
        }
        // On one partition: the first message fails once; in a second world, the second too (a release
        // that fails becomes the new head); in a third, the second message's step starts paused; in a
        // fourth, both. On two partitions: both first messages fail at once.
        [
            (Layout([3, 0]), [true, false, false, false], false),
            (Layout([3, 0]), [true, true, false, false], false),
            (Layout([3, 0]), [false, false, false, false], true),
            (Layout([3, 0]), [true, false, false, false], true),
            (Layout([2, 2]), [true, false, true, false], false),
        ]
        .into_iter()
        .map(|(layout, fails_left, paused)| {
            let mut world = State::world(layout, fails_left, [0; MESSAGES], true);
            world.paused = paused;
            world
        })
        .collect()
    }

    fn actions(&self, s: &State, actions: &mut Vec<Step>) {
        self.partition_actions(s, actions);
        let free = s.key_lock.is_none();
        if s.paused && free {
            actions.push(Step::Resume);
        }
        match s.r_worker {
            Worker::Idle if s.r_pos < s.retry.len() => actions.push(Step::RetryReads),
            Worker::Classified(_) | Worker::Ran(_) if !free => {}
            Worker::Classified(_) => actions.push(Step::RetryActs),
            Worker::Ran(_) => actions.push(Step::RetryAdvances),
            Worker::Idle => {}
        }
        if s.r_committed < s.r_pos {
            actions.push(Step::CommitRetry);
        }
        if s.crashes == 0 && s.busy() {
            actions.push(Step::Crash);
        }
        if let Some(held) = &s.held
            && free
        {
            let view = held.view(s.layout, &s.letters);
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
        if s.held
            .as_ref()
            .and_then(Held::first_retry)
            .is_some_and(|(_, _, due)| !due)
        {
            actions.push(Step::Tick);
        }
    }

    fn next_state(&self, last: &State, step: Step) -> Option<State> {
        let mut s = last.clone();
        match step {
            Step::PartitionReads(p) => s.partition_reads(p),
            Step::PartitionActs(p) => s.partition_acts(p),
            Step::LetterLocks(p) => s.letter_locks(p, self.key_lock),
            Step::LetterCommits(p) => s.letter_commits(p),
            Step::Resume => {
                // `saga steps resume`: the keys the step's messages held are released.
                s.paused = false;
                if let Some(held) = s.held.as_mut().filter(|h| h.head.is_none()) {
                    held.state = HoldState::Releasing;
                    held.in_flight = None;
                }
            }
            Step::RetryReads => {
                let (m, mark) = s.retry[s.r_pos].clone();
                let mut found = s.found();
                // The defect: any copy of the first parked message passes for the one sent last.
                if let (true, Mark::Release { seq, .. }, Some(view)) =
                    (self.ignore_in_flight, &mark, found.views.get_mut(KEY))
                {
                    view.in_flight = Some(*seq);
                }
                let facts = [s.facts(m, mark)];
                let role = hold_gate::plan(&facts, Some(&found), s.delayed)
                    .roles
                    .remove(0);
                s.r_worker = Worker::Classified(role);
            }
            Step::Tick => {
                let held = s.held.as_mut().expect("a held key");
                let first = held.parked.first().map(|(seq, _)| *seq);
                for retry in &mut held.retries {
                    if Some(retry.0) == first {
                        retry.2 = true;
                    }
                }
            }
            Step::RetryActs => retry_acts(&mut s),
            Step::RetryAdvances => {
                let Worker::Ran(role) = s.r_worker.clone() else {
                    unreachable!()
                };
                s.advance(&role);
                s.r_pos += 1;
                s.r_worker = Worker::Idle;
            }
            Step::CommitPartition(p) => s.partitions[p].committed = s.partitions[p].pos,
            Step::CommitRetry => s.r_committed = s.r_pos,
            Step::Crash => {
                s.crashes += 1;
                for part in &mut s.partitions {
                    part.pos = part.committed;
                    part.batch = None;
                }
                // Open transactions roll back.
                s.key_lock = None;
                s.r_pos = s.r_committed;
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
                        let mark = release_mark(s.layout, seq, m);
                        s.retry.push((m, mark));
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
                let mark = release_mark(s.layout, seq, m);
                s.retry.push((m, mark));
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
                "per partition, effects happen in offset order, each once",
                |_, s: &State| {
                    let once = s
                        .effects
                        .iter()
                        .enumerate()
                        .all(|(i, m)| !s.effects[..i].contains(m));
                    // Under the skip policy a dead-lettered message keeps no place (its replay runs it when
                    // it comes): the others keep theirs.
                    let kept = |m: &usize| s.policy_holds || !s.letters.contains(m);
                    once && (0..PARTITIONS).all(|p| {
                        let mine: Vec<usize> = s
                            .effects
                            .iter()
                            .copied()
                            .filter(|m| s.layout.partition_of(*m) == p && kept(m))
                            .collect();
                        mine.windows(2).all(|w| w[0] < w[1])
                    })
                },
            ),
            Property::always(
                "with nothing left to do, every message took effect and no key is held",
                |model: &Self, s: &State| {
                    has_next(model, s)
                        || (s.effects.len() == s.layout.messages()
                            && s.held.is_none()
                            && s.key_lock.is_none())
                },
            ),
            Property::always("a delayed retry runs only once due", |_, s: &State| {
                !s.early
            }),
            Property::always(
                "under the skip policy, no dead letter heads a key",
                |_, s: &State| s.policy_holds || s.held.as_ref().is_none_or(|h| h.head.is_none()),
            ),
            Property::sometimes("a message is parked", |_, s: &State| s.parked_total() > 0),
            Property::sometimes("a release's copy is sent twice", |_, s: &State| {
                s.lost_records > 0
            }),
            if self.delayed_retries {
                Property::sometimes(
                    "two messages of the key wait for their delayed retries",
                    |_, s: &State| s.held.as_ref().is_some_and(|h| h.retries.len() == 2),
                )
            } else {
                Property::sometimes("a message is parked", |_, s: &State| s.parked_total() > 0)
            },
            if self.delayed_retries {
                Property::sometimes(
                    "a released message leaves its queue by its dead letter",
                    |_, s: &State| s.dropped,
                )
            } else {
                Property::sometimes(
                    "two dead letters of the key are in their transactions at once",
                    |_, s: &State| {
                        s.partitions
                            .iter()
                            .all(|p| p.batch.as_ref().is_some_and(|b| b.letter.is_some()))
                    },
                )
            },
        ]
    }
}

/// The delayed retries' worlds: on one partition, the first message fails transiently twice (its third
/// attempt succeeds; the skip policy), or three times (its attempts spent: under hold-key, its letter heads
/// the key until the operator replays it; under skip, it leaves its queue), or once while the second, parked
/// behind it, fails for good (under skip: it leaves the queue, the key is not held for it); on two
/// partitions, both first messages fail once at once.
fn delayed_worlds() -> Vec<State> {
    const NONE: [bool; MESSAGES] = [false; MESSAGES];
    [
        (Layout([3, 0]), [2, 0, 0, 0], NONE, false),
        (Layout([3, 0]), [3, 0, 0, 0], NONE, true),
        (Layout([3, 0]), [3, 0, 0, 0], NONE, false),
        (
            Layout([3, 0]),
            [1, 0, 0, 0],
            [false, true, false, false],
            false,
        ),
        (Layout([2, 2]), [1, 0, 1, 0], NONE, false),
    ]
    .into_iter()
    .map(|(layout, transient_left, fails_left, policy_holds)| {
        let mut world = State::world(layout, fails_left, transient_left, policy_holds);
        world.delayed = true;
        world
    })
    .collect()
}

/// The retry worker performs what its message's role says.
fn retry_acts(s: &mut State) {
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

fn release_mark(layout: Layout, seq: i64, m: usize) -> Mark {
    Mark::Release {
        seq,
        origin: origin(layout, m),
        digest: hold::digest(&raw(layout, m)),
    }
}

#[cfg(test)]
mod tests {
    use stateright::Checker;

    use super::*;

    /// The property the put-back reorders break.
    const ORDER: &str = "per partition, effects happen in offset order, each once";

    fn check(model: HoldModel) -> impl Checker<HoldModel> {
        crate::model::explore(&model, None)
    }

    #[test]
    fn held_keys_keep_the_order_run_nothing_twice_and_lose_nothing_in_every_interleaving() {
        check(HoldModel::default()).assert_properties();
    }

    #[test]
    fn delayed_retries_keep_the_order_run_once_due_and_lose_nothing_in_every_interleaving() {
        check(HoldModel {
            delayed_retries: true,
            ..HoldModel::default()
        })
        .assert_properties();
    }

    /// Explores `model` until `property` fails (a defect put back).
    fn find(model: HoldModel, property: &'static str) -> impl Checker<HoldModel> {
        crate::model::find(&model, property)
    }

    #[test]
    fn a_release_classified_whatever_copy_was_sent_last_is_found_to_run_a_retry_early() {
        const EARLY: &str = "a delayed retry runs only once due";
        let checker = find(
            HoldModel {
                delayed_retries: true,
                ignore_in_flight: true,
                ..HoldModel::default()
            },
            EARLY,
        );
        let path = checker.assert_any_discovery(EARLY);
        println!("counterexample: {:?}", path.into_actions());
    }

    #[test]
    fn releasing_a_queue_all_at_once_is_found_to_reorder() {
        let checker = find(
            HoldModel {
                release_all_at_once: true,
                ..HoldModel::default()
            },
            ORDER,
        );
        let path = checker.assert_any_discovery(ORDER);
        println!("counterexample: {:?}", path.into_actions());
    }

    #[test]
    fn a_key_locked_only_when_held_is_found_to_lose_a_letter_and_its_partitions_order() {
        let checker = find(
            HoldModel {
                key_lock: hold::KeyLock::RowOnly,
                ..HoldModel::default()
            },
            ORDER,
        );
        let path = checker.assert_any_discovery(ORDER);
        println!("counterexample: {:?}", path.into_actions());
    }
}
