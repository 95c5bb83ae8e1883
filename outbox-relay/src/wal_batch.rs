//! The WAL relay's decisions over the events it read, without I/O: which are published, which are parked
//! behind their key, when an event that keeps failing is parked, and when the slot may be confirmed. The
//! relay (`wal.rs`) performs them; the model of the WAL relays' protocol (`wal_model.rs`) drives the same
//! code.
//!
//! - **A failing key holds back only itself.** An event whose publication keeps failing (refused for good
//!   `park_after` times, or failing for longer than the relay's bound, whatever the error) is parked, and
//!   so is every later event of its key in the batch, in order; the key is then *held*: its events read
//!   later are parked behind it, until the parked ones are published (`release`). The other keys' events
//!   are published meanwhile, and the batch settles, so the slot is confirmed past all of them.
//! - **The slot is confirmed only past settled events**: each acknowledged by the broker or parked (written
//!   to the database).

use std::collections::BTreeSet;

/// What became of an event of the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Fate {
    /// To be published (again).
    Pending,
    /// The broker acknowledged it.
    Acked,
    /// To be parked (not written yet).
    ToPark,
    /// Parked in the database.
    Parked,
}

/// Why an event failed, as far as parking goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Failure {
    /// The broker refuses it for good (too large, not a valid record).
    pub refused: bool,
    /// It has been failing for longer than the relay's bound.
    pub expired: bool,
}

/// The keys held behind parked events (or parked rows of the table outbox).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Holds<K> {
    held: BTreeSet<K>,
}

impl<K: Ord + Clone> Default for Holds<K> {
    fn default() -> Self {
        Self {
            held: BTreeSet::new(),
        }
    }
}

impl<K: Ord + Clone> Holds<K> {
    /// Holds `key`.
    pub(crate) fn hold(&mut self, key: K) {
        self.held.insert(key);
    }

    /// Whether `key` is held.
    pub(crate) fn is_held(&self, key: &K) -> bool {
        self.held.contains(key)
    }

    /// Replaces the held keys with `keys` (read from the database).
    pub(crate) fn reset(&mut self, keys: impl IntoIterator<Item = K>) {
        self.held = keys.into_iter().collect();
    }

    /// The held keys (test only: the model of the WAL relays compares them with the database's).
    #[cfg(test)]
    pub(crate) fn keys(&self) -> impl Iterator<Item = &K> {
        self.held.iter()
    }

    /// How many keys are held.
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }
}

/// A batch of events read from the slot, in commit order, by key. See the module documentation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct WalBatch<K> {
    keys: Vec<K>,
    fates: Vec<Fate>,
    attempts: Vec<u32>,
    /// Failed refused events this many times are parked.
    park_after: u32,
    /// Test only: the relay before the fix, which retried the batch until every event was acknowledged,
    /// parking only events refused for good (and only them, not their key's later events).
    #[cfg(test)]
    retry_until_acked: bool,
}

impl<K: Ord + Clone> WalBatch<K> {
    /// An empty batch; a refused event is parked after `park_after` attempts.
    pub(crate) fn new(park_after: u32) -> Self {
        Self {
            keys: Vec::new(),
            fates: Vec::new(),
            attempts: Vec::new(),
            park_after: park_after.max(1),
            #[cfg(test)]
            retry_until_acked: false,
        }
    }

    /// The relay before the fix (see the field).
    #[cfg(test)]
    pub(crate) fn retrying_until_acked(park_after: u32) -> Self {
        Self {
            retry_until_acked: true,
            ..Self::new(park_after)
        }
    }

    /// Adds an event of `key` read from the slot: pending, or to be parked behind its held key. Returns its
    /// index.
    pub(crate) fn push(&mut self, key: K, holds: &Holds<K>) -> usize {
        let held = {
            #[cfg(test)]
            {
                !self.retry_until_acked && holds.is_held(&key)
            }
            #[cfg(not(test))]
            {
                holds.is_held(&key)
            }
        };
        self.keys.push(key);
        self.fates
            .push(if held { Fate::ToPark } else { Fate::Pending });
        self.attempts.push(0);
        self.keys.len() - 1
    }

    /// How many events it holds (test only: the model of the WAL relays).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }

    /// The fate of event `index` (test only: the model of the WAL relays).
    #[cfg(test)]
    pub(crate) fn fate(&self, index: usize) -> Fate {
        self.fates[index]
    }

    /// The key of event `index` (test only: the model of the WAL relays).
    #[cfg(test)]
    pub(crate) fn key(&self, index: usize) -> &K {
        &self.keys[index]
    }

    /// The failed attempts of event `index`.
    pub(crate) fn attempts(&self, index: usize) -> u32 {
        self.attempts[index]
    }

    /// The events to publish now, in order (the publisher sends one per key at a time).
    pub(crate) fn pending(&self) -> Vec<usize> {
        self.indices(Fate::Pending)
    }

    /// The events to park now, in order.
    pub(crate) fn to_park(&self) -> Vec<usize> {
        self.indices(Fate::ToPark)
    }

    fn indices(&self, fate: Fate) -> Vec<usize> {
        (0..self.fates.len())
            .filter(|i| self.fates[*i] == fate)
            .collect()
    }

    /// The broker acknowledged event `index`.
    pub(crate) fn acked(&mut self, index: usize) {
        self.fates[index] = Fate::Acked;
    }

    /// Event `index` failed: parked (with its key's later pending events, and its key held) when it was
    /// refused `park_after` times or has failed for too long; otherwise it is published again.
    pub(crate) fn failed(&mut self, index: usize, failure: Failure, holds: &mut Holds<K>) {
        self.attempts[index] += 1;
        #[cfg(test)]
        if self.retry_until_acked {
            if failure.refused && self.attempts[index] >= self.park_after {
                self.fates[index] = Fate::ToPark;
            }
            return;
        }
        let park = failure.expired || (failure.refused && self.attempts[index] >= self.park_after);
        if !park {
            return;
        }
        let key = self.keys[index].clone();
        for later in index..self.keys.len() {
            if self.keys[later] == key && self.fates[later] == Fate::Pending {
                self.fates[later] = Fate::ToPark;
            }
        }
        holds.hold(key);
    }

    /// The events to park were written to the database.
    pub(crate) fn parked(&mut self) {
        for fate in &mut self.fates {
            if *fate == Fate::ToPark {
                *fate = Fate::Parked;
            }
        }
    }

    /// Whether every event is acknowledged or parked: the slot may be confirmed past the batch.
    pub(crate) fn settled(&self) -> bool {
        self.fates
            .iter()
            .all(|f| matches!(f, Fate::Acked | Fate::Parked))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAILS: Failure = Failure {
        refused: false,
        expired: false,
    };
    const EXPIRED: Failure = Failure {
        refused: false,
        expired: true,
    };
    const REFUSED: Failure = Failure {
        refused: true,
        expired: false,
    };

    #[test]
    fn a_key_failing_for_too_long_is_parked_with_its_later_events_and_the_others_settle() {
        let mut holds = Holds::default();
        let mut batch = WalBatch::new(3);
        for key in ['a', 'b', 'a', 'c'] {
            batch.push(key, &holds);
        }
        assert_eq!(batch.pending(), [0, 1, 2, 3]);
        batch.acked(1);
        batch.acked(3);
        batch.failed(0, FAILS, &mut holds);
        assert_eq!(batch.pending(), [0, 2], "retried while under the bound");
        assert!(!batch.settled());
        batch.failed(0, EXPIRED, &mut holds);
        assert_eq!(
            batch.to_park(),
            [0, 2],
            "the failing event and its key's later one"
        );
        assert!(holds.is_held(&'a'));
        batch.parked();
        assert!(batch.settled(), "the slot moves on past the other keys");

        // The held key's next events are parked behind it at once.
        let mut next = WalBatch::new(3);
        assert_eq!(next.push('a', &holds), 0);
        next.push('b', &holds);
        assert_eq!((next.to_park(), next.pending()), (vec![0], vec![1]));
        holds.reset([]);
        next.push('a', &holds);
        assert_eq!(next.pending(), [1, 2], "released: published again");
    }

    #[test]
    fn an_event_refused_for_good_is_parked_after_its_attempts() {
        let mut holds = Holds::default();
        let mut batch = WalBatch::new(2);
        batch.push('a', &holds);
        batch.failed(0, REFUSED, &mut holds);
        assert_eq!(batch.pending(), [0]);
        batch.failed(0, REFUSED, &mut holds);
        assert_eq!(batch.to_park(), [0]);
        assert_eq!(batch.attempts(0), 2);
    }

    #[test]
    fn the_old_relay_retried_a_failing_event_forever() {
        let mut holds = Holds::default();
        let mut batch = WalBatch::retrying_until_acked(3);
        batch.push('a', &holds);
        batch.push('b', &holds);
        batch.acked(1);
        for _ in 0..10 {
            batch.failed(0, EXPIRED, &mut holds);
        }
        assert!(!batch.settled(), "the whole batch, and the slot, wait");
    }
}
