//! The poll loop: one dedicated OS thread owns the rdkafka consumer. It polls, hands each message to its
//! partition's worker, commits finished offsets periodically, and serves rebalances.
//!
//! Rebalance callbacks run inside `poll` on this thread. Because the thread is not one of the async
//! runtime's, the revoke callback may block while the revoked partitions' workers finish their batch (they
//! run on the runtime and never need the consumer), then commit what they finished, then let librdkafka
//! release the partitions.
//!
//! When a partition's worker queue is full, further messages wait in a holding queue. Only when that grows
//! past a limit (the worker is stuck, say retrying a message, or much slower than the fetches) is the
//! partition paused, and it is resumed once the holding queue is down to half the limit. Pausing is kept
//! rare on purpose: librdkafka drops what it prefetched for a paused partition and fetches it again after
//! the resume. Resuming at half the limit, not at empty, gives that fetch the time of half a holding queue
//! of work: resumed at empty, a worker sat idle for the fetch's round trip at every cycle, which on a
//! backlog was a quarter to a half of its time (`saga_consumer_batch_phase_seconds{phase="idle"}`).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::statistics::Statistics;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use saga_core::{Origin, RawMessage};
use saga_runtime::kafka::from_kafka_headers;
use saga_runtime::ops::Ops;
use tokio::sync::mpsc::error::TrySendError;
use tokio_util::sync::CancellationToken;

use crate::error::ConsumerError;
use crate::metrics::{ConsumerMetrics, PartitionLabels};
use crate::offsets::TopicPartition;
use crate::partition::{self, PartitionWorker, WorkerShared};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Messages of one partition waiting for room in its worker's queue.
struct Held {
    queue: VecDeque<RawMessage>,
    paused: bool,
}

/// Messages held per partition before it is paused, at least.
const MIN_HOLD_LIMIT: usize = 10_000;

/// The state the poll loop and its rebalance callbacks share.
pub(crate) struct Dispatcher {
    pub shared: Arc<WorkerShared>,
    pub runtime: tokio::runtime::Handle,
    pub queue_capacity: usize,
    /// Messages held for one partition before it is paused.
    pub hold_limit: usize,
    pub revoke_timeout: Duration,
    pub metrics: ConsumerMetrics,
    pub ops: Ops,
    workers: Mutex<HashMap<TopicPartition, PartitionWorker>>,
    held: Mutex<HashMap<TopicPartition, Held>>,
    assigned: Mutex<HashSet<TopicPartition>>,
    generation: AtomicU64,
}

impl Dispatcher {
    pub(crate) fn new(
        shared: Arc<WorkerShared>,
        runtime: tokio::runtime::Handle,
        queue_capacity: usize,
        revoke_timeout: Duration,
        metrics: ConsumerMetrics,
        ops: Ops,
    ) -> Self {
        // Not ready until partitions are assigned.
        ops.check("consumer", true).set(false);
        Self {
            shared,
            runtime,
            queue_capacity,
            hold_limit: queue_capacity.saturating_mul(25).max(MIN_HOLD_LIMIT),
            revoke_timeout,
            metrics,
            ops,
            workers: Mutex::default(),
            held: Mutex::default(),
            assigned: Mutex::default(),
            generation: AtomicU64::new(0),
        }
    }

    /// Hands `raw` to its partition's worker, pausing the partition if the worker's queue is full.
    fn dispatch(
        &self,
        consumer: &BaseConsumer<PollContext>,
        raw: RawMessage,
    ) -> Result<(), ConsumerError> {
        let tp = (raw.origin.topic.clone(), raw.origin.partition);
        let mut held = lock(&self.held);
        if let Some(h) = held.get_mut(&tp) {
            h.queue.push_back(raw);
            if !h.paused && h.queue.len() >= self.hold_limit {
                set_paused(consumer, &tp, true);
                h.paused = true;
            }
            return Ok(());
        }
        let mut workers = lock(&self.workers);
        let worker = workers.entry(tp.clone()).or_insert_with(|| {
            let generation = self.generation.fetch_add(1, Ordering::Relaxed);
            partition::spawn(
                &self.runtime,
                self.shared.clone(),
                tp.clone(),
                generation,
                self.queue_capacity,
            )
        });
        match worker.sender.try_send(raw) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(raw)) => {
                held.insert(
                    tp,
                    Held {
                        queue: VecDeque::from([raw]),
                        paused: false,
                    },
                );
                Ok(())
            }
            // A worker only stops when told to, or when it panicked (a framework bug, as handler panics
            // are caught). Carrying on would skip the messages it held: stop instead, uncommitted.
            Err(TrySendError::Closed(_)) => Err(ConsumerError::WorkerDied {
                topic: tp.0,
                partition: tp.1,
            }),
        }
    }

    /// Moves held messages into worker queues that have room again, resuming partitions whose holding
    /// queue empties. Returns whether messages are still held; fails if a partition's worker died.
    fn flush_held(&self, consumer: &BaseConsumer<PollContext>) -> Result<bool, ConsumerError> {
        let mut held = lock(&self.held);
        if held.is_empty() {
            return Ok(false);
        }
        let workers = lock(&self.workers);
        let resume = move_held(&mut held, &workers, self.hold_limit / 2)?;
        for tp in &resume {
            set_paused(consumer, tp, false);
        }
        Ok(!held.is_empty())
    }

    /// Stops the workers of `tps` (each finishes the batch it is in, within the revoke timeout), commits
    /// what they finished, and forgets them.
    fn release(
        &self,
        consumer: &BaseConsumer<PollContext>,
        tps: &HashSet<TopicPartition>,
        timeout: Duration,
    ) {
        {
            let mut held = lock(&self.held);
            for tp in tps {
                if held.remove(tp).is_some_and(|h| h.paused) {
                    // Paused partitions stay paused across a rebalance otherwise.
                    set_paused(consumer, tp, false);
                }
            }
        }
        let stopping: Vec<PartitionWorker> = {
            let mut workers = lock(&self.workers);
            tps.iter().filter_map(|tp| workers.remove(tp)).collect()
        };
        for worker in &stopping {
            worker.cancel.cancel();
        }
        let joins = stopping.into_iter().map(|w| w.join);
        let all = futures::future::join_all(joins);
        if self
            .runtime
            .block_on(async { tokio::time::timeout(timeout, all).await })
            .is_err()
        {
            tracing::warn!(
                ?timeout,
                "partition workers did not stop in time; their unfinished messages will be redelivered"
            );
        }
        self.commit(consumer, |tp| tps.contains(tp));
        for tp in tps {
            self.shared.tracker.remove(tp);
            self.metrics.lag.remove(&PartitionLabels {
                topic: tp.0.clone(),
                partition: tp.1,
            });
        }
    }

    /// Commits the finished positions of the partitions `filter` accepts. A refused commit (the partition
    /// is no longer ours) is harmless: the message comes back to the new owner, which skips it by its key.
    fn commit(
        &self,
        consumer: &BaseConsumer<PollContext>,
        filter: impl Fn(&TopicPartition) -> bool,
    ) {
        let pending = self.shared.tracker.pending(filter);
        if pending.is_empty() {
            return;
        }
        let mut tpl = TopicPartitionList::with_capacity(pending.len());
        for ((topic, partition), offset) in &pending {
            if let Err(e) = tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset)) {
                tracing::warn!(error = %e, topic, partition, "cannot build an offset commit");
            }
        }
        match consumer.commit(&tpl, CommitMode::Sync) {
            Ok(()) => {
                for (tp, offset) in &pending {
                    self.shared.tracker.committed(tp, *offset);
                }
                tracing::debug!(?pending, "offsets committed");
            }
            Err(e) => tracing::warn!(error = %e, ?pending, "offset commit refused; will retry"),
        }
    }

    fn all_partitions(&self) -> HashSet<TopicPartition> {
        let mut all: HashSet<_> = lock(&self.workers).keys().cloned().collect();
        all.extend(lock(&self.assigned).iter().cloned());
        all
    }
}

/// Moves `held` messages into their workers' queues while there is room; forgets holding queues that empty.
/// Returns the paused partitions to resume: those whose holding queue is down to `resume_at` messages.
/// A closed queue means the worker died (a framework bug, as handler panics are caught): that is an
/// error, not a full queue, or the poll loop would hold its messages forever.
fn move_held(
    held: &mut HashMap<TopicPartition, Held>,
    workers: &HashMap<TopicPartition, PartitionWorker>,
    resume_at: usize,
) -> Result<Vec<TopicPartition>, ConsumerError> {
    let mut resume = Vec::new();
    let mut died = None;
    held.retain(|tp, h| {
        if died.is_some() {
            return true;
        }
        let Some(worker) = workers.get(tp) else {
            return false;
        };
        while let Some(raw) = h.queue.pop_front() {
            match worker.sender.try_send(raw) {
                Ok(()) => {}
                Err(TrySendError::Full(raw)) => {
                    h.queue.push_front(raw);
                    break;
                }
                Err(TrySendError::Closed(raw)) => {
                    h.queue.push_front(raw);
                    died = Some(tp.clone());
                    return true;
                }
            }
        }
        if h.paused && h.queue.len() <= resume_at {
            // Fetching again while half a holding queue is left: the worker does not wait for it.
            resume.push(tp.clone());
            h.paused = false;
        }
        !h.queue.is_empty()
    });
    match died {
        Some((topic, partition)) => Err(ConsumerError::WorkerDied { topic, partition }),
        None => Ok(resume),
    }
}

fn set_paused(consumer: &BaseConsumer<PollContext>, tp: &TopicPartition, paused: bool) {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(&tp.0, tp.1);
    let result = if paused {
        consumer.pause(&tpl)
    } else {
        consumer.resume(&tpl)
    };
    match result {
        Ok(()) => {
            tracing::debug!(topic = %tp.0, partition = tp.1, paused, "partition paused or resumed")
        }
        Err(e) => {
            tracing::warn!(error = %e, topic = %tp.0, partition = tp.1, paused, "pause/resume failed")
        }
    }
}

fn partitions(tpl: &TopicPartitionList) -> HashSet<TopicPartition> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_owned(), e.partition()))
        .collect()
}

/// The consumer's rdkafka context: rebalance callbacks and statistics.
pub(crate) struct PollContext {
    pub dispatcher: Arc<Dispatcher>,
}

impl ClientContext for PollContext {
    fn stats(&self, statistics: Statistics) {
        let assigned = lock(&self.dispatcher.assigned).clone();
        for (topic, t) in &statistics.topics {
            for (partition, p) in &t.partitions {
                if *partition >= 0 && assigned.contains(&(topic.clone(), *partition)) {
                    self.dispatcher
                        .metrics
                        .lag
                        .get_or_create(&PartitionLabels {
                            topic: topic.clone(),
                            partition: *partition,
                        })
                        .set(p.consumer_lag.max(0));
                }
            }
        }
    }
}

impl ConsumerContext for PollContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => {
                let revoked = partitions(tpl);
                tracing::info!(partitions = ?revoked, "partitions revoked");
                self.dispatcher
                    .release(consumer, &revoked, self.dispatcher.revoke_timeout);
                let mut assigned = lock(&self.dispatcher.assigned);
                assigned.retain(|tp| !revoked.contains(tp));
            }
            Rebalance::Assign(_) => {}
            Rebalance::Error(e) => tracing::error!(error = %e, "rebalance error"),
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            let assigned = partitions(tpl);
            tracing::info!(partitions = ?assigned, "partitions assigned");
            lock(&self.dispatcher.assigned).extend(assigned);
            self.dispatcher.ops.check("consumer", true).set(true);
        }
    }
}

/// Runs the poll loop until `shutdown` fires, then stops the workers within `shutdown_timeout`, commits,
/// and leaves the group (by dropping the consumer).
pub(crate) fn poll_loop(
    consumer: BaseConsumer<PollContext>,
    dispatcher: &Dispatcher,
    shutdown: &CancellationToken,
    commit_interval: Duration,
    shutdown_timeout: Duration,
) -> Result<(), ConsumerError> {
    let mut last_commit = Instant::now();
    let mut result = Ok(());
    while !shutdown.is_cancelled() {
        // While messages wait for room in a worker's queue, come back at once to move them on; otherwise
        // the worker would idle until the next message or the poll timeout.
        let waiting = match dispatcher.flush_held(&consumer) {
            Ok(waiting) => waiting,
            Err(e) => {
                result = Err(e);
                break;
            }
        };
        let timeout = if waiting {
            Duration::from_millis(1)
        } else {
            Duration::from_millis(50)
        };
        match consumer.poll(timeout) {
            Some(Ok(message)) => {
                let raw = RawMessage {
                    origin: Origin {
                        topic: message.topic().to_owned(),
                        partition: message.partition(),
                        offset: message.offset(),
                    },
                    key: message.key().map(<[u8]>::to_vec),
                    payload: message.payload().map(<[u8]>::to_vec),
                    headers: from_kafka_headers(message.headers()),
                    timestamp_ms: message.timestamp().to_millis(),
                };
                drop(message);
                if let Err(e) = dispatcher.dispatch(&consumer, raw) {
                    result = Err(e);
                    break;
                }
            }
            Some(Err(KafkaError::PartitionEOF(_))) | None => {}
            Some(Err(e)) => tracing::warn!(error = %e, "consumer error"),
        }
        if last_commit.elapsed() >= commit_interval {
            dispatcher.commit(&consumer, |_| true);
            last_commit = Instant::now();
        }
    }
    tracing::info!("stopping: draining partition workers");
    dispatcher.ops.check("consumer", true).set(false);
    let all = dispatcher.all_partitions();
    dispatcher.release(&consumer, &all, shutdown_timeout);
    // Dropping the consumer closes it: it leaves the group (its revoke callback finds nothing left to do).
    drop(consumer);
    tracing::info!("consumer stopped");
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use saga_core::{Headers, Origin};

    fn raw(offset: i64) -> RawMessage {
        RawMessage {
            origin: Origin {
                topic: "t".into(),
                partition: 0,
                offset,
            },
            key: None,
            payload: None,
            headers: Headers::new(),
            timestamp_ms: None,
        }
    }

    fn worker(capacity: usize) -> (PartitionWorker, tokio::sync::mpsc::Receiver<RawMessage>) {
        let (sender, receiver) = tokio::sync::mpsc::channel(capacity);
        let worker = PartitionWorker {
            sender,
            cancel: CancellationToken::new(),
            join: tokio::spawn(async {}),
        };
        (worker, receiver)
    }

    fn holding(offsets: std::ops::Range<i64>, paused: bool) -> Held {
        Held {
            queue: offsets.map(raw).collect(),
            paused,
        }
    }

    #[tokio::test]
    async fn held_messages_move_on_as_room_frees_and_the_partition_resumes() {
        let tp: TopicPartition = ("t".into(), 0);
        let (w, mut receiver) = worker(4);
        let workers = HashMap::from([(tp.clone(), w)]);
        let mut held = HashMap::from([(tp.clone(), holding(0..9, true))]);
        assert!(move_held(&mut held, &workers, 2).unwrap().is_empty());
        assert_eq!(held[&tp].queue.len(), 5, "four moved, five wait");
        while receiver.try_recv().is_ok() {}
        assert_eq!(
            move_held(&mut held, &workers, 2).unwrap(),
            vec![tp.clone()],
            "resumed with one message still held: the fetch overlaps the rest"
        );
        assert_eq!(held[&tp].queue.len(), 1);
        assert!(!held[&tp].paused);
        while receiver.try_recv().is_ok() {}
        assert!(move_held(&mut held, &workers, 2).unwrap().is_empty());
        assert!(held.is_empty(), "an emptied holding queue is forgotten");
    }

    #[tokio::test]
    async fn a_dead_worker_is_an_error_not_a_full_queue() {
        let tp: TopicPartition = ("t".into(), 0);
        let (w, receiver) = worker(4);
        drop(receiver); // the worker is gone
        let workers = HashMap::from([(tp.clone(), w)]);
        let mut held = HashMap::from([(tp.clone(), holding(0..3, false))]);
        match move_held(&mut held, &workers, 2) {
            Err(ConsumerError::WorkerDied { topic, partition }) => {
                assert_eq!((topic.as_str(), partition), ("t", 0));
            }
            other => panic!("expected WorkerDied, got {other:?}"),
        }
        assert_eq!(held[&tp].queue.len(), 3, "nothing was lost");
    }
}
