//! The decisions of a partition worker over one batch, as a state machine without I/O: which messages run
//! in one transaction, how a failed batch is narrowed down, when a failing message is retried and when it
//! is dead-lettered, and which messages are finished. The executor drives it: it asks for the next
//! [`Action`], performs it (a transaction, a two-phase attempt, a dead letter, a wait), and hands the
//! outcome back as an [`Event`].
//!
//! The rules:
//!
//! - Consecutive transactional (or ignored, or known-done) messages run as one transaction. Two-phase
//!   messages run one at a time; poison messages are dead-lettered where they stand.
//! - A failure that names its message ([`Event::ItemFailed`]) cuts the batch before it: the messages before
//!   it commit as a smaller batch, then it is retried alone, the failure counting as its first attempt.
//! - A failure that names none ([`Event::GroupFailed`]: a batch handler call, or a statement of the
//!   framework over several messages) makes the range run one message per transaction, so that only the
//!   culprit is retried or dead-lettered; no message's budget is spent meanwhile.
//! - An unavailable database is waited out, never counted against a message; a key leased by another
//!   worker is waited for until the lease ends; a permanent failure dead-letters at once; a transient one
//!   is retried with backoff until the retry budget is spent, then dead-lettered. With delayed retries, a
//!   message that may wait parked ([`BatchMachine::with_defers`]) waits there instead ([`Action::Defer`]):
//!   it is finished here, its key is held, and the batch goes on with the other keys.

use std::time::Duration;

use crate::dlq::DeadLetterReason;

/// How a message of the batch is processed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    /// Claimed, handled and recorded in a transaction, batched with its neighbours of the same kind.
    Transactional,
    /// Needs no claim (ignored, or known done): joins a transactional run, which needs no transaction if
    /// it holds only such messages.
    NoClaim,
    /// Lease, external call, completing transaction: alone.
    TwoPhase,
    /// Can never be handled: dead-lettered with this reason.
    Poison(DeadLetterReason),
    /// Its key is held (see `hold`): parked behind the key's queue, alone.
    Held,
}

impl Kind {
    fn batches(self) -> bool {
        matches!(self, Self::Transactional | Self::NoClaim)
    }
}

/// Why an attempt failed, as far as the decisions go.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Fault {
    /// Retrying cannot help: dead-letter.
    Permanent(String),
    /// Retrying may help: counts against the retry budget.
    Transient(String),
    /// The database is unavailable: waited out, never counted.
    Unavailable(String),
    /// Another worker holds the key's lease for this long.
    Leased(Duration),
}

impl Fault {
    fn text(&self) -> String {
        match self {
            Self::Permanent(e) | Self::Transient(e) | Self::Unavailable(e) => e.clone(),
            Self::Leased(wait) => format!("step key leased by another worker for {wait:?}"),
        }
    }
}

/// How long to wait before the next attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Wait {
    /// The retry policy's backoff after this many counted attempts.
    Backoff(u32),
    /// The database's backoff after this many unavailable attempts in a row.
    Unavailable(u32),
    /// Until another worker's lease on the message's key ends.
    Lease(Duration),
}

/// What the worker does next.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Action {
    /// Runs messages `start..end` in one transaction (none if they all need no claim). Answered by
    /// [`Event::Committed`], [`Event::ItemFailed`], [`Event::GroupFailed`] or [`Event::NotStarted`].
    Transact { start: usize, end: usize },
    /// Runs one attempt of the two-phase step of message `index`. Answered by [`Event::Committed`] or
    /// [`Event::ItemFailed`].
    TwoPhase { index: usize },
    /// Dead-letters message `index` (its attempts as counted). Answered by [`Event::DeadLettered`].
    DeadLetter {
        index: usize,
        reason: DeadLetterReason,
        error: String,
        attempts: u32,
    },
    /// Waits before the next attempt of message `index` (the one being retried). Answered by
    /// [`Event::Waited`].
    Wait { index: usize, wait: Wait },
    /// Parks message `index` behind its held key's queue. Answered by [`Event::Parked`],
    /// [`Event::NotHeld`] or [`Event::ParkRefused`].
    Park { index: usize },
    /// Parks message `index`, which failed transiently (`error`) after `attempts` counted attempts, to run
    /// again after the retry policy's backoff for them, holding its key meanwhile. Answered by
    /// [`Event::Deferred`] or [`Event::DeferRefused`].
    Defer {
        index: usize,
        attempts: u32,
        error: String,
    },
    /// Every message of the batch is finished.
    Done,
}

/// What came of the last action.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Event {
    /// The transaction (or the two-phase attempt) committed: its messages are finished.
    Committed,
    /// Message `index` (absolute) failed; nothing of the attempt committed.
    ItemFailed { index: usize, fault: Fault },
    /// The transaction failed without naming a message; nothing of it committed.
    GroupFailed { fault: Fault },
    /// The dead letter was acknowledged: the message is finished.
    DeadLettered,
    /// The wait is over.
    Waited,
    /// The message is parked: it is finished here (its key's release runs it later).
    Parked,
    /// Its key is no longer held: it runs as a message of `kind`.
    NotHeld { kind: Kind },
    /// The message waits parked for its next attempt: it is finished here, and its key is held.
    Deferred,
    /// It cannot wait parked: it is retried where it stands, after the backoff.
    DeferRefused,
    /// Its key's queue is full: it is dead-lettered with this reason.
    ParkRefused {
        /// Why it is dead-lettered: a cap ([`DeadLetterReason::HoldQueueFull`]) or a refused statement
        /// ([`DeadLetterReason::StoreRefused`]).
        reason: DeadLetterReason,
        /// What refused it.
        error: String,
    },
}

/// A retry of one message that failed: its failure, counted or not.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Retrying {
    index: usize,
    fault: Fault,
}

/// The decisions for one batch of one partition, in offset order. See the module documentation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct BatchMachine {
    kinds: Vec<Kind>,
    attempts: Vec<u32>,
    max_attempts: u32,
    /// Messages before this are finished.
    finished: usize,
    /// A message known to have failed, not retried yet: the run stops before it.
    failed: Option<(usize, Fault)>,
    /// Messages before this run one per transaction: a failure named none of them.
    single_until: usize,
    /// Unavailable attempts in a row, for the database's backoff.
    unavailable: u32,
    /// The message being retried alone, once its wait is over.
    retrying: Option<Retrying>,
    /// A message whose delayed retry was refused: its backoff is waited next, then it is retried alone.
    waiting: Option<(usize, Fault)>,
    /// A batch that failed for an unavailable database: waited for, then run again.
    again: Option<(usize, usize)>,
    /// Whether the wait for `again` is over.
    again_waited: bool,
    /// The action whose event is awaited.
    pending: Option<Action>,
    /// Each message's key (a hash of it; `None`: keyless), and whether its dead letter holds the key: the
    /// key's later messages of the batch are then parked (see `hold`).
    keys: Vec<Option<u64>>,
    holds: Vec<bool>,
    /// Whether a message may wait parked for its next attempt (delayed retries).
    defers: Vec<bool>,
    /// A message whose parking was refused: dead-lettered next, with the reason.
    refused: Option<(usize, DeadLetterReason, String)>,
}

impl BatchMachine {
    /// The machine for messages of `kinds` (in offset order), with `attempts` already made (the crash-loop
    /// guard's count for an isolated message, else zero), dead-lettering after `max_attempts` counted
    /// attempts.
    pub(crate) fn new(kinds: Vec<Kind>, attempts: Vec<u32>, max_attempts: u32) -> Self {
        debug_assert_eq!(kinds.len(), attempts.len());
        Self {
            kinds,
            attempts,
            max_attempts,
            finished: 0,
            failed: None,
            single_until: 0,
            unavailable: 0,
            retrying: None,
            waiting: None,
            again: None,
            again_waited: false,
            pending: None,
            keys: Vec::new(),
            holds: Vec::new(),
            defers: Vec::new(),
            refused: None,
        }
    }

    /// Each message's key (a hash; `None`: keyless) and whether a dead letter of it holds its key: once it
    /// is dead-lettered, the later messages of its key in the batch are parked, not run.
    pub(crate) fn with_holds(mut self, keys: Vec<Option<u64>>, holds: Vec<bool>) -> Self {
        debug_assert_eq!(keys.len(), self.kinds.len());
        debug_assert_eq!(holds.len(), self.kinds.len());
        self.keys = keys;
        self.holds = holds;
        self
    }

    /// Whether each message, failing transiently with attempts left, waits parked for its next attempt
    /// (delayed retries: a keyed message that is free or its key's release) rather than where it stands.
    /// Its key's later messages in the batch are then parked behind it.
    pub(crate) fn with_defers(mut self, defers: Vec<bool>) -> Self {
        debug_assert_eq!(defers.len(), self.kinds.len());
        self.defers = defers;
        self
    }

    /// How many messages, from the front, are finished (committed, skipped or dead-lettered).
    pub(crate) fn finished(&self) -> usize {
        self.finished
    }

    /// Counted attempts of message `index` so far.
    pub(crate) fn attempts(&self, index: usize) -> u32 {
        self.attempts[index]
    }

    /// The next action. Panics if the previous action's event was not handed back.
    pub(crate) fn next(&mut self) -> Action {
        assert!(
            self.pending.is_none(),
            "the event of {:?} was not handed back",
            self.pending
        );
        let action = self.decide();
        if action != Action::Done {
            self.pending = Some(action.clone());
        }
        action
    }

    fn decide(&mut self) -> Action {
        if let Some((index, reason, error)) = self.refused.take() {
            return Action::DeadLetter {
                index,
                reason,
                error,
                attempts: self.attempts[index].max(1),
            };
        }
        if let Some((index, fault)) = self.waiting.take() {
            let wait = Wait::Backoff(self.attempts[index]);
            self.retrying = Some(Retrying { index, fault });
            return Action::Wait { index, wait };
        }
        if let Some((start, end)) = self.again {
            if !self.again_waited {
                self.again_waited = true;
                return Action::Wait {
                    index: start,
                    wait: Wait::Unavailable(self.unavailable),
                };
            }
            self.again = None;
            self.again_waited = false;
            return Action::Transact { start, end };
        }
        if let Some(retrying) = &self.retrying {
            // The wait is over: the failed message runs again, alone.
            let index = retrying.index;
            return match self.kinds[index] {
                Kind::TwoPhase => Action::TwoPhase { index },
                _ => Action::Transact {
                    start: index,
                    end: index + 1,
                },
            };
        }
        let i = self.finished;
        if i >= self.kinds.len() {
            return Action::Done;
        }
        if let Some((at, fault)) = self.failed.take_if(|(at, _)| *at == i) {
            return self.after_failure(at, fault);
        }
        match self.kinds[i] {
            Kind::Poison(reason) => Action::DeadLetter {
                index: i,
                reason,
                error: String::new(),
                attempts: self.attempts[i].max(1),
            },
            Kind::TwoPhase => Action::TwoPhase { index: i },
            Kind::Held => Action::Park { index: i },
            Kind::Transactional | Kind::NoClaim => {
                let run_end = i + self.kinds[i..].iter().take_while(|k| k.batches()).count();
                let limit = self.failed.as_ref().map_or(run_end, |(at, _)| *at);
                let end = if i < self.single_until { i + 1 } else { limit };
                Action::Transact { start: i, end }
            }
        }
    }

    /// Hands back what came of the last action.
    pub(crate) fn on(&mut self, event: Event) {
        let action = self
            .pending
            .take()
            .expect("an event answers the action asked for");
        match (action, event) {
            (Action::Transact { end, .. }, Event::Committed) => {
                self.finished = end;
                self.unavailable = 0;
                self.retrying = None;
            }
            (Action::TwoPhase { index }, Event::Committed) => {
                self.finished = index + 1;
                self.unavailable = 0;
                self.retrying = None;
            }
            (Action::DeadLetter { index, .. }, Event::DeadLettered) => {
                self.finished = index + 1;
                self.retrying = None;
                self.hold_after(index);
            }
            (Action::Park { index }, Event::Parked) => {
                self.finished = index + 1;
                // Its key is held now (a paused step's message holds it): the key's later messages wait.
                self.hold_key_after(index);
            }
            (Action::Park { index }, Event::NotHeld { kind }) => {
                debug_assert_ne!(kind, Kind::Held);
                self.kinds[index] = kind;
            }
            (Action::Park { index }, Event::ParkRefused { reason, error }) => {
                self.refused = Some((index, reason, error));
            }
            (Action::Defer { index, .. }, Event::Deferred) => {
                self.finished = index + 1;
                self.unavailable = 0;
                self.retrying = None;
                self.hold_key_after(index);
            }
            (Action::Defer { index, error, .. }, Event::DeferRefused) => {
                // Retried where it stands: the wait first, then the message alone.
                self.defers[index] = false;
                self.waiting = Some((index, Fault::Transient(error)));
            }
            (Action::Wait { .. }, Event::Waited) => {}
            (Action::Transact { start, end }, Event::ItemFailed { index, fault }) => {
                debug_assert!(
                    (start..end).contains(&index),
                    "{index} is of {start}..{end}"
                );
                self.retrying = None;
                self.failed = Some((index, fault));
            }
            (Action::TwoPhase { index: at }, Event::ItemFailed { index, fault }) => {
                debug_assert_eq!(at, index);
                self.retrying = None;
                self.failed = Some((index, fault));
            }
            (Action::Transact { start, end }, Event::GroupFailed { fault }) => {
                self.retrying = None;
                if end - start == 1 {
                    // One message: the failure is its own.
                    self.failed = Some((start, fault));
                } else if matches!(fault, Fault::Unavailable(_)) {
                    // Nobody's fault: the same batch runs again once the database is back.
                    self.unavailable += 1;
                    self.again = Some((start, end));
                } else {
                    self.single_until = end;
                }
            }
            (action, event) => {
                panic!("{event:?} does not answer {action:?}")
            }
        }
    }

    /// Decides what follows a failure of message `index` (its first or a later attempt): a wait before it
    /// runs again (alone), or its dead letter.
    fn after_failure(&mut self, index: usize, fault: Fault) -> Action {
        let dead_letter = |this: &Self, reason, error: String| Action::DeadLetter {
            index,
            reason,
            error,
            attempts: this.attempts[index].max(1),
        };
        let wait = match &fault {
            Fault::Permanent(e) => {
                self.attempts[index] += 1;
                return dead_letter(self, DeadLetterReason::HandlerFailed, e.clone());
            }
            Fault::Unavailable(_) => {
                self.unavailable += 1;
                Wait::Unavailable(self.unavailable)
            }
            Fault::Leased(until) => Wait::Lease(*until),
            Fault::Transient(e) => {
                self.attempts[index] += 1;
                let attempts = self.attempts[index];
                if attempts >= self.max_attempts {
                    return dead_letter(
                        self,
                        DeadLetterReason::RetriesExhausted,
                        format!("{attempts} attempts failed; last error: {e}"),
                    );
                }
                if self.defers.get(index) == Some(&true) {
                    return Action::Defer {
                        index,
                        attempts,
                        error: e.clone(),
                    };
                }
                Wait::Backoff(attempts)
            }
        };
        self.retrying = Some(Retrying { index, fault });
        Action::Wait { index, wait }
    }

    /// After message `index` was dead-lettered: if its dead letter holds its key, the key's later messages
    /// in the batch are parked.
    fn hold_after(&mut self, index: usize) {
        if self.holds.get(index) == Some(&true) {
            self.hold_key_after(index);
        }
    }

    /// Parks the later messages of message `index`'s key in the batch: its key is held.
    fn hold_key_after(&mut self, index: usize) {
        let Some(Some(key)) = self.keys.get(index) else {
            return;
        };
        let key = *key;
        for j in index + 1..self.kinds.len() {
            if self.keys[j] == Some(key) {
                self.kinds[j] = Kind::Held;
            }
        }
    }

    /// The failure message `index` is being retried for, if any (for logs).
    pub(crate) fn retry_reason(&self) -> Option<String> {
        self.retrying.as_ref().map(|r| r.fault.text())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Kind = Kind::Transactional;

    fn machine(kinds: &[Kind]) -> BatchMachine {
        BatchMachine::new(kinds.to_vec(), vec![0; kinds.len()], 3)
    }

    fn transient(n: u32) -> Fault {
        Fault::Transient(format!("failure {n}"))
    }

    /// The answer of an action that went well.
    fn ok(action: &Action) -> Event {
        match action {
            Action::Transact { .. } | Action::TwoPhase { .. } => Event::Committed,
            Action::DeadLetter { .. } => Event::DeadLettered,
            Action::Wait { .. } => Event::Waited,
            Action::Park { .. } => Event::Parked,
            Action::Defer { .. } => Event::Deferred,
            Action::Done => unreachable!("Done is not answered"),
        }
    }

    /// Drives `m`, answering each action with `answer`; returns the actions taken.
    fn drive(m: &mut BatchMachine, mut answer: impl FnMut(&Action) -> Event) -> Vec<Action> {
        let mut actions = Vec::new();
        loop {
            let action = m.next();
            if action == Action::Done {
                return actions;
            }
            let event = answer(&action);
            actions.push(action);
            m.on(event);
            assert!(actions.len() < 100, "the machine does not end: {actions:?}");
        }
    }

    #[test]
    fn a_transient_failure_waits_parked_and_its_keys_later_messages_park_behind_it() {
        let mut m = BatchMachine::new(vec![T; 4], vec![0; 4], 3)
            .with_holds(vec![Some(1), Some(2), Some(1), Some(2)], vec![false; 4])
            .with_defers(vec![true; 4]);
        let actions = drive(&mut m, |a| match a {
            Action::Transact { start: 0, .. } => Event::ItemFailed {
                index: 0,
                fault: transient(1),
            },
            a => ok(a),
        });
        assert_eq!(
            actions,
            vec![
                Action::Transact { start: 0, end: 4 },
                Action::Defer {
                    index: 0,
                    attempts: 1,
                    error: "failure 1".into()
                },
                // The other key runs; the deferred key's later message parks behind it.
                Action::Transact { start: 1, end: 2 },
                Action::Park { index: 2 },
                Action::Transact { start: 3, end: 4 },
            ]
        );
        assert_eq!(m.finished(), 4);
    }

    #[test]
    fn a_refused_delayed_retry_is_retried_where_it_stands_and_the_last_attempt_dead_letters() {
        let mut m = BatchMachine::new(vec![T], vec![1], 3)
            .with_holds(vec![Some(1)], vec![false])
            .with_defers(vec![true]);
        let actions = drive(&mut m, |a| match a {
            Action::Transact { .. } => Event::ItemFailed {
                index: 0,
                fault: transient(2),
            },
            Action::Defer { .. } => Event::DeferRefused,
            a => ok(a),
        });
        assert_eq!(
            actions,
            vec![
                Action::Transact { start: 0, end: 1 },
                Action::Defer {
                    index: 0,
                    attempts: 2,
                    error: "failure 2".into()
                },
                Action::Wait {
                    index: 0,
                    wait: Wait::Backoff(2)
                },
                Action::Transact { start: 0, end: 1 },
                Action::DeadLetter {
                    index: 0,
                    reason: DeadLetterReason::RetriesExhausted,
                    error: "3 attempts failed; last error: failure 2".into(),
                    attempts: 3
                },
            ]
        );
    }

    #[test]
    fn a_dead_letter_that_holds_its_key_parks_the_keys_later_messages_of_the_batch() {
        let mut m = BatchMachine::new(vec![T; 5], vec![0; 5], 3).with_holds(
            vec![Some(1), Some(2), Some(1), None, Some(1)],
            vec![true; 5],
        );
        let actions = drive(&mut m, |a| match a {
            Action::Transact { start: 0, .. } => Event::ItemFailed {
                index: 0,
                fault: Fault::Permanent("gateway down".into()),
            },
            Action::Park { index: 2 } => Event::Parked,
            // Released meanwhile: it runs after all.
            Action::Park { index: 4 } => Event::NotHeld { kind: T },
            a => ok(a),
        });
        assert_eq!(
            actions,
            [
                Action::Transact { start: 0, end: 5 },
                Action::DeadLetter {
                    index: 0,
                    reason: DeadLetterReason::HandlerFailed,
                    error: "gateway down".into(),
                    attempts: 1
                },
                Action::Transact { start: 1, end: 2 },
                Action::Park { index: 2 },
                Action::Transact { start: 3, end: 4 },
                Action::Park { index: 4 },
                Action::Transact { start: 4, end: 5 },
            ]
        );
        assert_eq!(m.finished(), 5);
    }

    #[test]
    fn a_parked_message_holds_its_keys_later_messages_of_the_batch() {
        // A paused step's message parks and holds its key: the key's cancel after it in the batch waits.
        let mut m = BatchMachine::new(vec![Kind::Held, T, T], vec![0; 3], 3)
            .with_holds(vec![Some(7), Some(7), Some(8)], vec![false; 3]);
        let actions = drive(&mut m, ok);
        assert_eq!(
            actions,
            [
                Action::Park { index: 0 },
                Action::Park { index: 1 },
                Action::Transact { start: 2, end: 3 },
            ]
        );
    }

    #[test]
    fn a_message_its_key_cannot_park_is_dead_lettered_with_the_reason() {
        let mut m = BatchMachine::new(vec![Kind::Held, T], vec![0; 2], 3);
        let actions = drive(&mut m, |a| match a {
            Action::Park { .. } => Event::ParkRefused {
                reason: DeadLetterReason::HoldQueueFull,
                error: "full".into(),
            },
            a => ok(a),
        });
        assert_eq!(
            actions,
            [
                Action::Park { index: 0 },
                Action::DeadLetter {
                    index: 0,
                    reason: DeadLetterReason::HoldQueueFull,
                    error: "full".into(),
                    attempts: 1
                },
                Action::Transact { start: 1, end: 2 },
            ]
        );
    }

    #[test]
    fn a_dead_letter_without_the_policy_holds_nothing() {
        let mut m = BatchMachine::new(vec![T; 2], vec![0; 2], 3)
            .with_holds(vec![Some(1), Some(1)], vec![false; 2]);
        let actions = drive(&mut m, |a| match a {
            Action::Transact { start: 0, .. } => Event::ItemFailed {
                index: 0,
                fault: Fault::Permanent("down".into()),
            },
            a => ok(a),
        });
        assert_eq!(actions.last(), Some(&Action::Transact { start: 1, end: 2 }));
    }

    #[test]
    fn a_run_of_transactional_messages_is_one_transaction() {
        let mut m = machine(&[T, T, Kind::NoClaim, T]);
        let actions = drive(&mut m, ok);
        assert_eq!(actions, [Action::Transact { start: 0, end: 4 }]);
        assert_eq!(m.finished(), 4);
    }

    #[test]
    fn a_named_failure_commits_the_messages_before_it_and_retries_it_alone() {
        let mut m = machine(&[T, T, T, T]);
        let mut failed_once = false;
        let actions = drive(&mut m, |a| match a {
            Action::Transact { start: 0, end: 4 } if !failed_once => {
                failed_once = true;
                Event::ItemFailed {
                    index: 2,
                    fault: transient(1),
                }
            }
            a => ok(a),
        });
        assert_eq!(
            actions,
            [
                Action::Transact { start: 0, end: 4 },
                Action::Transact { start: 0, end: 2 },
                Action::Wait {
                    index: 2,
                    wait: Wait::Backoff(1)
                },
                Action::Transact { start: 2, end: 3 },
                Action::Transact { start: 3, end: 4 },
            ]
        );
        assert_eq!((m.finished(), m.attempts(2), m.attempts(1)), (4, 1, 0));
    }

    #[test]
    fn a_failure_naming_no_message_narrows_the_range_to_one_message_per_transaction() {
        let mut m = machine(&[T, T, T, T]);
        let actions = drive(&mut m, |a| match a {
            Action::Transact { start: 0, end: 4 } => Event::GroupFailed {
                fault: transient(0),
            },
            Action::Transact { start: 2, end: 3 } => Event::ItemFailed {
                index: 2,
                fault: Fault::Permanent("bad".into()),
            },
            a => ok(a),
        });
        assert_eq!(
            actions,
            [
                Action::Transact { start: 0, end: 4 },
                Action::Transact { start: 0, end: 1 },
                Action::Transact { start: 1, end: 2 },
                Action::Transact { start: 2, end: 3 },
                Action::DeadLetter {
                    index: 2,
                    reason: DeadLetterReason::HandlerFailed,
                    error: "bad".into(),
                    attempts: 1
                },
                Action::Transact { start: 3, end: 4 },
            ],
            "only the culprit is dead-lettered"
        );
        assert_eq!(
            (m.attempts(0), m.attempts(1), m.attempts(3)),
            (0, 0, 0),
            "no other message's budget spent"
        );
    }

    #[test]
    fn transient_failures_are_retried_until_the_budget_is_spent_then_dead_lettered() {
        let mut m = machine(&[T]);
        let mut n = 0;
        let actions = drive(&mut m, |a| match a {
            Action::Transact { .. } => {
                n += 1;
                Event::ItemFailed {
                    index: 0,
                    fault: transient(n),
                }
            }
            Action::Wait { .. } => Event::Waited,
            _ => Event::DeadLettered,
        });
        assert_eq!(
            actions.last(),
            Some(&Action::DeadLetter {
                index: 0,
                reason: DeadLetterReason::RetriesExhausted,
                error: "3 attempts failed; last error: failure 3".into(),
                attempts: 3
            })
        );
        let waits: Vec<&Action> = actions
            .iter()
            .filter(|a| matches!(a, Action::Wait { .. }))
            .collect();
        assert_eq!(
            waits,
            [
                &Action::Wait {
                    index: 0,
                    wait: Wait::Backoff(1)
                },
                &Action::Wait {
                    index: 0,
                    wait: Wait::Backoff(2)
                }
            ]
        );
    }

    #[test]
    fn an_unavailable_database_is_waited_out_without_spending_the_budget() {
        let mut m = machine(&[T, T]);
        let mut outages = 0;
        let actions = drive(&mut m, |a| match a {
            Action::Transact { .. } if outages < 5 => {
                outages += 1;
                Event::GroupFailed {
                    fault: Fault::Unavailable("read-only".into()),
                }
            }
            Action::Wait { .. } => Event::Waited,
            a => ok(a),
        });
        assert_eq!(m.finished(), 2);
        assert_eq!((m.attempts(0), m.attempts(1)), (0, 0), "nothing counted");
        assert!(actions.contains(&Action::Wait {
            index: 0,
            wait: Wait::Unavailable(5)
        }));
        assert!(
            !actions
                .iter()
                .any(|a| matches!(a, Action::DeadLetter { .. })),
            "nothing dead-lettered: {actions:?}"
        );
    }

    #[test]
    fn poison_is_dead_lettered_where_it_stands_and_two_phase_steps_run_alone() {
        let poison = Kind::Poison(DeadLetterReason::Undecodable);
        let mut m = machine(&[T, poison, Kind::TwoPhase, T, T]);
        let mut leased = false;
        let actions = drive(&mut m, |a| match a {
            Action::TwoPhase { index } if !leased => {
                leased = true;
                Event::ItemFailed {
                    index: *index,
                    fault: Fault::Leased(Duration::from_secs(2)),
                }
            }
            Action::DeadLetter { .. } => Event::DeadLettered,
            Action::Wait { .. } => Event::Waited,
            a => ok(a),
        });
        assert_eq!(
            actions,
            [
                Action::Transact { start: 0, end: 1 },
                Action::DeadLetter {
                    index: 1,
                    reason: DeadLetterReason::Undecodable,
                    error: String::new(),
                    attempts: 1
                },
                Action::TwoPhase { index: 2 },
                Action::Wait {
                    index: 2,
                    wait: Wait::Lease(Duration::from_secs(2))
                },
                Action::TwoPhase { index: 2 },
                Action::Transact { start: 3, end: 5 },
            ]
        );
        assert_eq!(m.attempts(2), 0, "waiting for a lease is no attempt");
    }

    #[test]
    fn a_group_failure_after_an_item_failure_narrows_only_the_messages_before_it() {
        // The batch names message 3; the smaller batch before it then fails without naming one.
        let mut m = machine(&[T, T, T, T, T]);
        let mut step = 0;
        let actions = drive(&mut m, |a| {
            step += 1;
            match (step, a) {
                (1, _) => Event::ItemFailed {
                    index: 3,
                    fault: Fault::Permanent("bad".into()),
                },
                (2, Action::Transact { start: 0, end: 3 }) => Event::GroupFailed {
                    fault: transient(0),
                },
                (_, Action::DeadLetter { .. }) => Event::DeadLettered,
                (_, a) => ok(a),
            }
        });
        assert_eq!(
            actions,
            [
                Action::Transact { start: 0, end: 5 },
                Action::Transact { start: 0, end: 3 },
                Action::Transact { start: 0, end: 1 },
                Action::Transact { start: 1, end: 2 },
                Action::Transact { start: 2, end: 3 },
                Action::DeadLetter {
                    index: 3,
                    reason: DeadLetterReason::HandlerFailed,
                    error: "bad".into(),
                    attempts: 1
                },
                Action::Transact { start: 4, end: 5 },
            ]
        );
    }

    /// What a message does each time it is attempted, in the exhaustive check below.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Fate {
        Ok,
        Permanent,
        /// Fails transiently this many times, then succeeds.
        Transient(u32),
        /// Finds the database unavailable this many times.
        Unavailable(u32),
        /// Finds its key leased by another worker this many times (two-phase steps only).
        Leased(u32),
    }

    /// One message of a scenario: its kind, its fate, and whether its failures name it (a handler's error
    /// in a batch does; a batch handler's or a batch statement's does not).
    type Scenario = Vec<(Kind, Fate, bool)>;

    const MAX_ATTEMPTS: u32 = 3;

    /// Every message of a kind, with every fate it can meet, named and not.
    fn choices() -> Vec<(Kind, Fate, bool)> {
        let failing = [
            Fate::Permanent,
            Fate::Transient(1),
            Fate::Transient(10),
            Fate::Unavailable(2),
        ];
        let mut all = vec![
            (T, Fate::Ok, true),
            (Kind::NoClaim, Fate::Ok, true),
            (Kind::Poison(DeadLetterReason::Undecodable), Fate::Ok, true),
            (Kind::TwoPhase, Fate::Ok, true),
            (Kind::TwoPhase, Fate::Leased(1), true),
        ];
        for fate in failing {
            all.extend([
                (T, fate, true),
                (T, fate, false),
                (Kind::TwoPhase, fate, true),
            ]);
        }
        all
    }

    /// Drives the machine through `scenario` as the executor would meet it, and checks what must hold
    /// whatever happens: the machine ends; every message is finished once, in order, either committed or
    /// dead-lettered; a message is dead-lettered only for its own failure (never for another's, an outage
    /// or a lease), with the reason of that failure; and only a message's own failures spend its budget.
    fn check(scenario: &Scenario) -> Result<(), String> {
        check_reporting(scenario, |event| event)
    }

    /// [`check`], with each event passed through `report` before the machine sees it (to show that the
    /// check catches an executor that reports wrongly).
    fn check_reporting(scenario: &Scenario, report: impl Fn(Event) -> Event) -> Result<(), String> {
        let n = scenario.len();
        let kinds = scenario.iter().map(|(k, _, _)| *k).collect();
        let mut m = BatchMachine::new(kinds, vec![0; n], MAX_ATTEMPTS);
        let mut failures = vec![0u32; n];
        let mut finished = Vec::new();
        let mut dead: Vec<Option<DeadLetterReason>> = vec![None; n];
        let fault_now = |i: usize, failures: &[u32]| match scenario[i].1 {
            Fate::Permanent => Some(Fault::Permanent(format!("message {i} is bad"))),
            Fate::Transient(k) if failures[i] < k => Some(transient(failures[i])),
            Fate::Unavailable(k) if failures[i] < k => Some(Fault::Unavailable("down".into())),
            Fate::Leased(k) if failures[i] < k => Some(Fault::Leased(Duration::from_millis(5))),
            _ => None,
        };
        for _ in 0..200 {
            let action = m.next();
            let event = match &action {
                Action::Done => {
                    let expected: Vec<usize> = (0..n).collect();
                    if finished != expected || m.finished() != n {
                        return Err(format!("finished {finished:?} (machine: {})", m.finished()));
                    }
                    for (i, (kind, fate, _)) in scenario.iter().enumerate() {
                        let should = match (kind, fate) {
                            (Kind::Poison(reason), _) => Some(*reason),
                            (_, Fate::Permanent) => Some(DeadLetterReason::HandlerFailed),
                            (_, Fate::Transient(k)) if *k > MAX_ATTEMPTS => {
                                Some(DeadLetterReason::RetriesExhausted)
                            }
                            _ => None,
                        };
                        if dead[i] != should {
                            return Err(format!(
                                "message {i}: dead-lettered {:?}, not {should:?}",
                                dead[i]
                            ));
                        }
                        let own = matches!(fate, Fate::Permanent | Fate::Transient(_));
                        if !own && !matches!(kind, Kind::Poison(_)) && m.attempts(i) != 0 {
                            return Err(format!("message {i} spent {} attempts", m.attempts(i)));
                        }
                    }
                    return Ok(());
                }
                Action::Transact { start, end } => {
                    if *start != m.finished() || start >= end || *end > n {
                        return Err(format!("{action:?} with {} finished", m.finished()));
                    }
                    if !scenario[*start..*end].iter().all(|(k, _, _)| k.batches()) {
                        return Err(format!("{action:?} holds a message that does not batch"));
                    }
                    match (*start..*end).find_map(|i| fault_now(i, &failures).map(|f| (i, f))) {
                        None => {
                            finished.extend(*start..*end);
                            Event::Committed
                        }
                        Some((i, fault)) => {
                            failures[i] += 1;
                            if scenario[i].2 {
                                Event::ItemFailed { index: i, fault }
                            } else {
                                Event::GroupFailed { fault }
                            }
                        }
                    }
                }
                Action::TwoPhase { index } => {
                    if *index != m.finished() || scenario[*index].0 != Kind::TwoPhase {
                        return Err(format!("{action:?} with {} finished", m.finished()));
                    }
                    match fault_now(*index, &failures) {
                        None => {
                            finished.push(*index);
                            Event::Committed
                        }
                        Some(fault) => {
                            failures[*index] += 1;
                            Event::ItemFailed {
                                index: *index,
                                fault,
                            }
                        }
                    }
                }
                Action::DeadLetter { index, reason, .. } => {
                    if *index != m.finished() || dead[*index].replace(*reason).is_some() {
                        return Err(format!("{action:?} with {} finished", m.finished()));
                    }
                    finished.push(*index);
                    Event::DeadLettered
                }
                Action::Wait { index, .. } => {
                    if *index != m.finished() {
                        return Err(format!("{action:?} with {} finished", m.finished()));
                    }
                    Event::Waited
                }
                Action::Park { .. } | Action::Defer { .. } => {
                    return Err(format!(
                        "{action:?}: no message of the scenario is held or deferred"
                    ));
                }
            };
            m.on(report(event));
        }
        Err("the machine does not end".into())
    }

    #[test]
    fn every_batch_of_up_to_four_messages_with_every_fate_keeps_the_rules() {
        let choices = choices();
        let mut scenarios: Vec<Scenario> = vec![Vec::new()];
        let mut checked = 0;
        for _ in 0..4 {
            scenarios = scenarios
                .iter()
                .flat_map(|s| {
                    choices.iter().map(move |c| {
                        let mut s = s.clone();
                        s.push(*c);
                        s
                    })
                })
                .collect();
            for scenario in &scenarios {
                if let Err(e) = check(scenario) {
                    panic!("{scenario:?}: {e}");
                }
                checked += 1;
            }
        }
        assert_eq!(
            checked,
            17 + 17usize.pow(2) + 17usize.pow(3) + 17usize.pow(4)
        );
    }

    #[test]
    fn the_exhaustive_check_fails_when_an_outage_is_reported_as_a_transient_failure() {
        // The bug of a failover that spent retry budgets: an unavailable database reported as a transient
        // failure. A message that only met an outage then spends attempts, or is dead-lettered.
        let as_transient = |event| match event {
            Event::ItemFailed {
                index,
                fault: Fault::Unavailable(e),
            } => Event::ItemFailed {
                index,
                fault: Fault::Transient(e),
            },
            Event::GroupFailed {
                fault: Fault::Unavailable(e),
            } => Event::GroupFailed {
                fault: Fault::Transient(e),
            },
            other => other,
        };
        let outage: Scenario = vec![(T, Fate::Ok, true), (T, Fate::Unavailable(2), true)];
        assert!(check(&outage).is_ok());
        let found = check_reporting(&outage, as_transient).unwrap_err();
        assert!(found.contains("spent 2 attempts"), "{found}");
        let long_outage: Scenario = vec![(T, Fate::Unavailable(5), false), (T, Fate::Ok, true)];
        let found = check_reporting(&long_outage, as_transient).unwrap_err();
        assert!(
            found.contains("dead-lettered Some(RetriesExhausted)"),
            "{found}"
        );
    }

    #[test]
    #[should_panic(expected = "was not handed back")]
    fn an_action_must_be_answered_before_the_next() {
        let mut m = machine(&[T]);
        let _ = m.next();
        let _ = m.next();
    }
}
