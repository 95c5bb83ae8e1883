//! Keys in parallel within a partition (`SAGA_KEY_CONCURRENCY`): the stage between the crash-loop gate
//! and the executor for a window of a partition's messages that holds several keys.
//!
//! The window's messages are grouped by key (the Kafka key, as holds are; keyless messages form one group),
//! each group in offset order. Up to the key concurrency groups run at once, each through the executor in
//! chunks of at most `SAGA_BATCH_SIZE` (a key's consecutive messages still share a transaction); a group's
//! messages run one after another, so a key's effects keep their order. The partition's position reported
//! for commit is the low-water mark ([`Watermark`]): the first message not finished, everything below it
//! committed in the database. A crash redelivers what lies above it, finished or not, and the step keys
//! absorb what was finished. The window is recorded as one range by the crash-loop gate before any of it
//! runs, and ends when every group has: a slow key delays the next window, never another key's messages
//! of this one.
//!
//! The decisions ([`applies`], [`take`], [`groups`], [`Watermark`]) are free of I/O; [`run`] performs them.

use std::collections::HashMap;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::connection::WorkerConnection;
use crate::delivery::Delivery;
use crate::guard::{BatchStart, PendingStart};
use crate::hold;
use crate::offsets::TopicPartition;
use crate::partition::WorkerShared;

/// Whether a window of these keys runs in lanes: the key concurrency allows more than one at once and
/// the window holds more than one key.
pub(crate) fn applies<'a>(
    key_concurrency: usize,
    mut keys: impl Iterator<Item = &'a [u8]>,
) -> bool {
    if key_concurrency < 2 {
        return false;
    }
    let Some(first) = keys.next() else {
        return false;
    };
    keys.any(|key| key != first)
}

/// How many of the `waiting` messages the next window takes: up to `window` when they run in lanes,
/// otherwise up to `batch_size` (one transaction holds at most that many).
pub(crate) fn take<'a>(
    keys: impl Iterator<Item = &'a [u8]>,
    waiting: usize,
    batch_size: usize,
    window: usize,
    key_concurrency: usize,
) -> usize {
    if window > batch_size && applies(key_concurrency, keys.take(window)) {
        waiting.min(window)
    } else {
        waiting.min(batch_size)
    }
}

/// The messages a window takes at most with `key_concurrency` keys at once: enough for each lane to have
/// several, so that the window's last, slowest keys leave the others little idle time.
pub(crate) fn window(batch_size: usize, key_concurrency: usize) -> usize {
    if key_concurrency < 2 {
        batch_size
    } else {
        batch_size.max(key_concurrency.saturating_mul(16))
    }
}

/// The window's messages by key: the indices of each key's messages in offset order, one group per key,
/// the groups with most messages first (they take longest: started first, they end the window soonest).
pub(crate) fn groups(keys: &[&[u8]]) -> Vec<Vec<usize>> {
    let mut by_key: HashMap<&[u8], usize> = HashMap::new();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (index, key) in keys.iter().enumerate() {
        let group = *by_key.entry(key).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[group].push(index);
    }
    // Stable: equal lengths keep the order of their first message.
    groups.sort_by_key(|group| std::cmp::Reverse(group.len()));
    groups
}

/// Which of a window's messages are finished, and how many from its front all are: the low-water mark
/// below which the partition's position may move.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Watermark {
    finished: Vec<bool>,
    prefix: usize,
}

impl Watermark {
    /// A window of `len` messages, none finished.
    pub(crate) fn new(len: usize) -> Self {
        Self {
            finished: vec![false; len],
            prefix: 0,
        }
    }

    /// Message `index` finished; whether the mark moved.
    pub(crate) fn finish(&mut self, index: usize) -> bool {
        self.finished[index] = true;
        let before = self.prefix;
        while self.finished.get(self.prefix) == Some(&true) {
            self.prefix += 1;
        }
        self.prefix > before
    }

    /// How many messages from the window's front are all finished.
    pub(crate) fn prefix(&self) -> usize {
        self.prefix
    }
}

/// Runs `batch` (a window of one partition, its range recorded) in lanes, up to the key concurrency at
/// once; reports the low-water mark to the offset tracker as lanes finish. Returns how many from the
/// front are finished: all unless `cancel` fired. `batch` keeps its order.
pub(crate) async fn run(
    shared: &WorkerShared,
    tp: &TopicPartition,
    generation: u64,
    batch: &mut Vec<Delivery>,
    cancel: &CancellationToken,
) -> usize {
    let keys: Vec<&[u8]> = batch.iter().map(|d| hold::key_of(&d.raw)).collect();
    let groups = groups(&keys);
    let offsets: Vec<i64> = batch.iter().map(|d| d.raw.origin.offset).collect();
    let mut slots: Vec<Option<Delivery>> = batch.drain(..).map(Some).collect();
    let lanes: Vec<(Vec<usize>, Vec<Delivery>)> = groups
        .into_iter()
        .map(|indices| {
            let deliveries = indices
                .iter()
                .map(|&i| slots[i].take().expect("a message is in one group"))
                .collect();
            (indices, deliveries)
        })
        .collect();
    let batch_size = shared.batch_size;
    let mut running = futures::stream::iter(
        lanes
            .into_iter()
            .map(|(indices, deliveries)| lane(shared, indices, deliveries, batch_size, cancel)),
    )
    .buffer_unordered(shared.key_concurrency);
    let mut mark = Watermark::new(offsets.len());
    while let Some((indices, deliveries, done)) = running.next().await {
        let mut moved = false;
        for &index in &indices[..done] {
            moved |= mark.finish(index);
        }
        if moved {
            let next = offsets[mark.prefix() - 1] + 1;
            shared.tracker.finished(tp, generation, next);
        }
        for (index, delivery) in indices.into_iter().zip(deliveries) {
            slots[index] = Some(delivery);
        }
    }
    drop(running);
    batch.extend(
        slots
            .into_iter()
            .map(|s| s.expect("every lane gave its messages back")),
    );
    mark.prefix()
}

/// One key's messages of a window, in order, in chunks of at most `batch_size`; how many from the front
/// finished.
async fn lane(
    shared: &WorkerShared,
    indices: Vec<usize>,
    mut deliveries: Vec<Delivery>,
    batch_size: usize,
    cancel: &CancellationToken,
) -> (Vec<usize>, Vec<Delivery>, usize) {
    let mut connection = WorkerConnection::default();
    let mut done = 0;
    while done < deliveries.len() && !cancel.is_cancelled() {
        let end = (done + batch_size).min(deliveries.len());
        // The window's range is recorded as started (normal) before any lane runs.
        let mut start = PendingStart::known(BatchStart::Normal);
        let chunk = &mut deliveries[done..end];
        let len = chunk.len();
        let finished = shared
            .executor
            .process(chunk, cancel, &mut start, &mut connection)
            .await;
        done += finished;
        if finished < len {
            break;
        }
    }
    (indices, deliveries, done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_runs_in_lanes_only_with_two_keys_and_a_concurrency_above_one() {
        let two: [&[u8]; 3] = [b"a", b"a", b"b"];
        let one: [&[u8]; 2] = [b"a", b"a"];
        assert!(applies(4, two.iter().copied()));
        assert!(!applies(1, two.iter().copied()), "one key at a time");
        assert!(!applies(4, one.iter().copied()), "one key: a batch");
        assert!(!applies(4, std::iter::empty()));
    }

    #[test]
    fn a_window_of_one_key_takes_a_batch_and_of_several_keys_a_window() {
        let keys: Vec<&[u8]> = vec![b"a"; 50];
        assert_eq!(take(keys.iter().copied(), 50, 10, 32, 4), 10);
        let mut mixed = keys.clone();
        mixed[40] = b"b";
        assert_eq!(
            take(mixed.iter().copied(), 50, 10, 32, 4),
            10,
            "b lies past the window"
        );
        mixed[20] = b"b";
        assert_eq!(take(mixed.iter().copied(), 50, 10, 32, 4), 32);
        assert_eq!(take(mixed.iter().copied(), 20, 10, 32, 4), 20);
        assert_eq!(take(mixed.iter().copied(), 50, 10, 10, 1), 10);
        assert_eq!(window(100, 1), 100);
        assert_eq!(window(100, 64), 1_024);
        assert_eq!(window(1_000, 4), 1_000);
    }

    #[test]
    fn each_keys_messages_stay_in_offset_order_and_the_longest_group_goes_first() {
        let keys: [&[u8]; 7] = [b"a", b"b", b"a", b"", b"c", b"a", b""];
        assert_eq!(
            groups(&keys),
            vec![vec![0, 2, 5], vec![3, 6], vec![1], vec![4]],
            "keyless messages are one group, in their order"
        );
    }

    #[test]
    fn the_mark_is_the_first_unfinished_message_never_the_highest_finished() {
        let mut mark = Watermark::new(4);
        assert!(
            !mark.finish(2),
            "finished above an unfinished message: no move"
        );
        assert_eq!(mark.prefix(), 0);
        assert!(mark.finish(0));
        assert_eq!(mark.prefix(), 1);
        assert!(mark.finish(1));
        assert_eq!(mark.prefix(), 3, "0, 1 and 2 are finished");
        assert!(mark.finish(3));
        assert_eq!(mark.prefix(), 4);
    }
}
