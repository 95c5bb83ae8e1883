//! Which offsets may be committed. Partition workers report "finished up to offset N" after their database
//! commit; the poll loop commits those positions to Kafka. An entry belongs to one assignment generation, so
//! a worker that outlives its partition's revocation cannot move the offset of a later assignment.

use std::collections::HashMap;
use std::sync::Mutex;

/// A topic and partition.
pub(crate) type TopicPartition = (String, i32);

#[derive(Debug, Default)]
struct Progress {
    generation: u64,
    /// The next offset to consume: the last finished message's offset + 1.
    finished: Option<i64>,
    committed: Option<i64>,
}

/// Finished and committed positions per partition.
#[derive(Debug, Default)]
pub(crate) struct OffsetTracker {
    partitions: Mutex<HashMap<TopicPartition, Progress>>,
}

impl OffsetTracker {
    /// Starts tracking `tp` for worker generation `generation`, forgetting earlier progress.
    pub(crate) fn start(&self, tp: &TopicPartition, generation: u64) {
        self.lock().insert(
            tp.clone(),
            Progress {
                generation,
                ..Progress::default()
            },
        );
    }

    /// A worker of `generation` finished every message of `tp` before `next_offset`.
    pub(crate) fn finished(&self, tp: &TopicPartition, generation: u64, next_offset: i64) {
        if let Some(p) = self.lock().get_mut(tp)
            && p.generation == generation
            && p.finished.is_none_or(|f| f < next_offset)
        {
            p.finished = Some(next_offset);
        }
    }

    /// Positions finished but not yet committed, for the partitions `filter` accepts.
    pub(crate) fn pending(
        &self,
        filter: impl Fn(&TopicPartition) -> bool,
    ) -> Vec<(TopicPartition, i64)> {
        self.lock()
            .iter()
            .filter(|(tp, _)| filter(tp))
            .filter_map(|(tp, p)| match (p.finished, p.committed) {
                (Some(f), c) if c.is_none_or(|c| c < f) => Some((tp.clone(), f)),
                _ => None,
            })
            .collect()
    }

    /// Records that `offset` of `tp` was committed.
    pub(crate) fn committed(&self, tp: &TopicPartition, offset: i64) {
        if let Some(p) = self.lock().get_mut(tp)
            && p.committed.is_none_or(|c| c < offset)
        {
            p.committed = Some(offset);
        }
    }

    /// Stops tracking `tp`.
    pub(crate) fn remove(&self, tp: &TopicPartition) {
        self.lock().remove(tp);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<TopicPartition, Progress>> {
        self.partitions.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_current_generation_moves_the_position() {
        let tracker = OffsetTracker::default();
        let tp = ("t".to_owned(), 0);
        tracker.start(&tp, 1);
        tracker.finished(&tp, 1, 10);
        assert_eq!(tracker.pending(|_| true), vec![(tp.clone(), 10)]);
        tracker.committed(&tp, 10);
        assert!(tracker.pending(|_| true).is_empty());
        tracker.finished(&tp, 1, 5);
        assert!(
            tracker.pending(|_| true).is_empty(),
            "positions never go back"
        );

        tracker.start(&tp, 2);
        tracker.finished(&tp, 1, 20);
        assert!(
            tracker.pending(|_| true).is_empty(),
            "a stale worker is ignored"
        );
        tracker.finished(&tp, 2, 12);
        assert_eq!(tracker.pending(|_| true), vec![(tp, 12)]);
    }
}
