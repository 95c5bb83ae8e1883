//! One worker task per assigned partition: it takes the partition's messages from a bounded queue, in
//! order, forms batches, processes them and reports how far it got. Workers of different partitions run
//! concurrently, up to the consumer's concurrency limit.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use saga_core::RawMessage;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::connection::{Released, WorkerConnection};
use crate::delivery::{Delivery, Router};
use crate::executor::Executor;
use crate::guard::{BatchStart, PendingStart};
use crate::metrics::observe_since;
use crate::offsets::{OffsetTracker, TopicPartition};

/// What all partition workers share.
pub(crate) struct WorkerShared {
    pub executor: Executor,
    pub router: Router,
    pub tracker: Arc<OffsetTracker>,
    pub permits: Arc<Semaphore>,
    pub batch_size: usize,
}

/// The poll loop's handle on a worker.
pub(crate) struct PartitionWorker {
    pub sender: mpsc::Sender<RawMessage>,
    pub cancel: CancellationToken,
    pub join: JoinHandle<()>,
}

/// Starts a worker for `tp`, reporting progress under `generation`.
pub(crate) fn spawn(
    runtime: &tokio::runtime::Handle,
    shared: Arc<WorkerShared>,
    tp: TopicPartition,
    generation: u64,
    capacity: usize,
) -> PartitionWorker {
    let (sender, receiver) = mpsc::channel(capacity);
    let cancel = CancellationToken::new();
    shared.tracker.start(&tp, generation);
    let join = runtime.spawn(run(shared, tp, generation, receiver, cancel.clone()));
    PartitionWorker {
        sender,
        cancel,
        join,
    }
}

async fn run(
    shared: Arc<WorkerShared>,
    tp: TopicPartition,
    generation: u64,
    mut receiver: mpsc::Receiver<RawMessage>,
    cancel: CancellationToken,
) {
    // Messages received but not yet processed, in offset order.
    let mut backlog: VecDeque<Delivery> = VecDeque::new();
    // Kept only while the worker goes from one batch straight to the next.
    let mut connection = WorkerConnection::default();
    loop {
        let phases = &shared.executor.metrics.phases;
        if backlog.is_empty() {
            let idle = Instant::now();
            let next = match receiver.try_recv() {
                Ok(raw) => Some(raw),
                // Nothing to do: the connection goes back to the pool while the worker waits.
                Err(_) => next_message(&mut receiver, &cancel, &connection.release()).await,
            };
            match next {
                Some(raw) => backlog.push_back(shared.router.route(raw)),
                None => return,
            }
            observe_since(&phases.idle, idle);
        }
        let routing = Instant::now();
        while backlog.len() < shared.batch_size {
            match receiver.try_recv() {
                Ok(raw) => backlog.push_back(shared.router.route(raw)),
                Err(_) => break,
            }
        }
        observe_since(&phases.route, routing);
        let waited = Instant::now();
        let _permit = match shared.permits.clone().try_acquire_owned() {
            Ok(permit) => permit,
            // Other partitions' turn first: no connection is held while waiting for a slot, so a consumer
            // never holds more connections than it has slots.
            Err(_) => match slot(&shared.permits, &cancel, &connection.release()).await {
                Some(permit) => permit,
                None => return,
            },
        };

        observe_since(&phases.permit, waited);

        let take = backlog.len().min(shared.batch_size);
        let fast_path = shared.executor.fast_path.as_ref();
        if fast_path.is_some() {
            let candidates = &mut backlog.make_contiguous()[..take];
            crate::fast::pre_check(fast_path, candidates).await;
            if candidates.iter().all(Delivery::needs_no_claim) {
                // Duplicates Redis knows and ignored messages: no crash-loop record, no transaction.
                let mut batch: Vec<Delivery> = backlog.drain(..take).collect();
                let mut known = PendingStart::known(BatchStart::Normal);
                let done = shared
                    .executor
                    .process(&mut batch, &cancel, &mut known, &mut connection)
                    .await;
                report(&shared, &tp, generation, &batch[..done]);
                if done < batch.len() {
                    return;
                }
                continue;
            }
        }
        let first = backlog[0].raw.origin.offset;
        let last = backlog[take - 1].raw.origin.offset;
        let guard = &shared.executor.guard;
        let overlap = guard.is_enabled()
            && backlog
                .iter()
                .take(take)
                .all(Delivery::is_transactional_or_ignored);
        let start = if overlap {
            // The happy path: the transaction runs while the start is recorded; its commit waits for it.
            // Recording takes a second connection: workers keeping theirs must leave one for it.
            connection.make_room(&shared.executor.pool);
            let mut pending = PendingStart::record(guard, &tp.0, tp.1, first, last, &cancel).await;
            let _shared_lock = match guard.try_shared() {
                Some(lock) => Some(lock),
                None => {
                    // An isolated message has the process alone and needs a connection of its own.
                    let released = connection.release();
                    tokio::select! {
                        biased;
                        _ = cancel.cancelled() => None,
                        lock = guard.shared(&released) => Some(lock),
                    }
                }
            };
            let done = if _shared_lock.is_some() {
                let batch = &mut backlog.make_contiguous()[..take];
                shared
                    .executor
                    .process(batch, &cancel, &mut pending, &mut connection)
                    .await
            } else {
                0
            };
            report(&shared, &tp, generation, &backlog.make_contiguous()[..done]);
            backlog.drain(..done);
            match pending.resolve().await {
                Some(BatchStart::Normal) if done == take => continue,
                // Cancelled (revoke or shutdown): the rest comes back to whoever owns the partition next.
                Some(BatchStart::Normal) => {
                    guard
                        .end(&tp.0, tp.1, first, false, &connection.release())
                        .await;
                    return;
                }
                None => return,
                // The range is a suspect's: nothing of the batch committed; its first message goes alone.
                Some(start) => {
                    debug_assert_eq!(done, 0, "nothing commits before the start is known");
                    start
                }
            }
        } else {
            let released = connection.release();
            let guarded = Instant::now();
            let Some(start) = guard
                .begin_until_recorded(&tp.0, tp.1, first, last, &released, &cancel)
                .await
            else {
                return;
            };
            observe_since(&phases.guard, guarded);
            start
        };
        let mut batch: Vec<Delivery> = match start {
            BatchStart::Normal => backlog.drain(..take).collect(),
            BatchStart::Isolate | BatchStart::DeadLetter(_) => backlog.drain(..1).collect(),
        };
        // An ordinary batch shares the process; an isolated message runs alone, so that a death during its
        // attempt is its own (its start counts only from when it has the process alone).
        let mut _shared_lock = None;
        match start {
            BatchStart::Normal => {
                let released = connection.release();
                _shared_lock = tokio::select! {
                    biased;
                    _ = cancel.cancelled() => None,
                    lock = guard.shared(&released) => Some(lock),
                };
            }
            BatchStart::Isolate => {
                batch[0].alone = guard
                    .alone(&tp.0, tp.1, first, &connection.release(), &cancel)
                    .await;
                batch[0].isolated = true;
            }
            BatchStart::DeadLetter(_) => {}
        }
        if cancel.is_cancelled() {
            guard
                .end(&tp.0, tp.1, first, false, &connection.release())
                .await;
            return;
        }
        let done = if let BatchStart::DeadLetter(_) = start {
            let mut recorded = PendingStart::known(start);
            match recorded.crash_loop_permit().await {
                Some((permit, deaths)) => usize::from(
                    shared
                        .executor
                        .dead_letter_crash_loop(
                            &mut batch[0],
                            deaths,
                            &permit,
                            &connection.release(),
                            &cancel,
                        )
                        .await,
                ),
                None => unreachable!("the record said: dead-letter"),
            }
        } else {
            // The start is recorded and acted on (an isolated message runs alone): what follows may commit.
            let mut known = PendingStart::known(BatchStart::Normal);
            shared
                .executor
                .process(&mut batch, &cancel, &mut known, &mut connection)
                .await
        };
        report(&shared, &tp, generation, &batch[..done]);
        if done < batch.len() {
            // Cancelled (revoke or shutdown): the rest comes back to whoever owns the partition next.
            guard
                .end(&tp.0, tp.1, first, false, &connection.release())
                .await;
            return;
        }
        if start != BatchStart::Normal {
            guard
                .end(&tp.0, tp.1, first, true, &connection.release())
                .await;
        }
    }
}

/// The partition's next message, waited for with no connection kept; `None` if `cancel` fired first or
/// the queue closed.
async fn next_message(
    receiver: &mut mpsc::Receiver<RawMessage>,
    cancel: &CancellationToken,
    _released: &Released<'_>,
) -> Option<RawMessage> {
    tokio::select! {
        biased;
        _ = cancel.cancelled() => None,
        next = receiver.recv() => next,
    }
}

/// A processing slot, waited for with no connection kept; `None` if `cancel` fired first.
async fn slot(
    permits: &Arc<Semaphore>,
    cancel: &CancellationToken,
    _released: &Released<'_>,
) -> Option<OwnedSemaphorePermit> {
    tokio::select! {
        biased;
        _ = cancel.cancelled() => None,
        permit = permits.clone().acquire_owned() => Some(permit.expect("the semaphore is never closed")),
    }
}

/// Reports the `finished` deliveries (a prefix of the partition's messages, in order) to the offset
/// tracker: the partition is done up to the last one.
fn report(shared: &WorkerShared, tp: &TopicPartition, generation: u64, finished: &[Delivery]) {
    if let Some(last) = finished.last() {
        shared
            .tracker
            .finished(tp, generation, last.raw.origin.offset + 1);
    }
}
