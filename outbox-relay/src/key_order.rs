//! Which rows of a batch go to the producer when, without I/O: at most one row per key in flight (see
//! [`crate::publisher`]). The publisher offers the batch's rows in row order, then reports each in-flight
//! row's fate; this says which row to send next and counts the rows held back behind a failure. The model
//! of the relay's protocol (`model.rs`) drives the same code.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// The state of one batch's sending, keyed by the rows' order keys. See the module documentation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct KeyOrder<K> {
    /// Keys with a row in flight, each with its rows waiting for it, in row order.
    waiting: BTreeMap<K, VecDeque<usize>>,
    /// Keys whose row failed at enqueueing: their later rows are not sent in this batch.
    failed_keys: BTreeSet<K>,
    /// Rows not sent because an earlier row of their key failed.
    held_back: usize,
    /// Test only: the old behaviour, every row sent at once (a failed row could then leave a later row of
    /// its key on the topic ahead of it).
    #[cfg(test)]
    all_at_once: bool,
}

impl<K: Ord + Clone> KeyOrder<K> {
    /// An empty batch.
    pub(crate) fn new() -> Self {
        Self {
            waiting: BTreeMap::new(),
            failed_keys: BTreeSet::new(),
            held_back: 0,
            #[cfg(test)]
            all_at_once: false,
        }
    }

    /// The relay before the fix: every row is sent at once, whatever its key's earlier rows became.
    #[cfg(test)]
    pub(crate) fn all_at_once() -> Self {
        Self {
            all_at_once: true,
            ..Self::new()
        }
    }

    /// Row `index` of `key`, offered in row order: whether to send it now. If not, it waits behind its
    /// key's row in flight, or is held back behind its key's failure.
    pub(crate) fn offer(&mut self, index: usize, key: K) -> bool {
        #[cfg(test)]
        if self.all_at_once {
            return true;
        }
        if let Some(queue) = self.waiting.get_mut(&key) {
            queue.push_back(index);
            return false;
        }
        if self.failed_keys.contains(&key) {
            self.held_back += 1;
            return false;
        }
        self.waiting.insert(key, VecDeque::new());
        true
    }

    /// The row of `key` just offered and sent could not be enqueued: its key's later rows stay back.
    pub(crate) fn refused_at_send(&mut self, key: &K) {
        if let Some(queue) = self.waiting.remove(key) {
            self.held_back += queue.len();
        }
        self.failed_keys.insert(key.clone());
    }

    /// The broker acknowledged the row of `key` in flight: the key's next row to send, if any (it is in
    /// flight from now on).
    pub(crate) fn acked(&mut self, key: &K) -> Option<usize> {
        let queue = self.waiting.get_mut(key)?;
        let next = queue.pop_front();
        if next.is_none() {
            self.waiting.remove(key);
        }
        next
    }

    /// The row of `key` in flight failed: its key's later rows stay back.
    pub(crate) fn failed(&mut self, key: &K) {
        if let Some(queue) = self.waiting.remove(key) {
            self.held_back += queue.len();
        }
    }

    /// Rows held back behind a failure of their key.
    pub(crate) fn held_back(&self) -> usize {
        self.held_back
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_keys_rows_go_one_at_a_time_and_stay_back_behind_a_failure() {
        let mut order = KeyOrder::new();
        assert!(order.offer(0, 'a'));
        assert!(order.offer(1, 'b'));
        assert!(!order.offer(2, 'a'));
        assert!(!order.offer(3, 'a'));
        assert_eq!(order.acked(&'a'), Some(2));
        order.failed(&'a');
        assert_eq!(order.held_back(), 1, "row 3 stays behind row 2");
        assert_eq!(order.acked(&'b'), None);
        assert_eq!(order.acked(&'a'), None, "nothing of a is in flight");
    }

    #[test]
    fn a_row_refused_at_send_holds_its_keys_later_rows() {
        let mut order = KeyOrder::new();
        assert!(order.offer(0, 'a'));
        order.refused_at_send(&'a');
        assert!(!order.offer(1, 'a'));
        assert!(order.offer(2, 'b'));
        assert_eq!(order.held_back(), 1);
    }
}
