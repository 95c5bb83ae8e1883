//! One worker task per assigned partition: it takes the partition's messages from a bounded queue, in
//! order, forms batches, processes them and reports how far it got. Workers of different partitions run
//! concurrently, up to the consumer's concurrency limit.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use saga_core::RawMessage;
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::delivery::{Delivery, Router};
use crate::executor::{Executor, sleep_or_cancel};
use crate::guard::BatchStart;
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
    loop {
        if backlog.is_empty() {
            let next = tokio::select! {
                biased;
                _ = cancel.cancelled() => return,
                next = receiver.recv() => next,
            };
            match next {
                Some(raw) => backlog.push_back(shared.router.route(raw)),
                None => return,
            }
        }
        while backlog.len() < shared.batch_size {
            match receiver.try_recv() {
                Ok(raw) => backlog.push_back(shared.router.route(raw)),
                Err(_) => break,
            }
        }
        let _permit = tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            permit = shared.permits.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
        };

        let take = backlog.len().min(shared.batch_size);
        let first = backlog[0].raw.origin.offset;
        let last = backlog[take - 1].raw.origin.offset;
        let start = loop {
            match shared.executor.guard.begin(&tp.0, tp.1, first, last).await {
                Ok(start) => break start,
                Err(e) => {
                    tracing::warn!(error = %e, topic = %tp.0, partition = tp.1, "cannot record the batch start; retrying");
                    if !sleep_or_cancel(Duration::from_secs(1), &cancel).await {
                        return;
                    }
                }
            }
        };
        let mut batch: Vec<Delivery> = match start {
            BatchStart::Normal => backlog.drain(..take).collect(),
            BatchStart::Isolate | BatchStart::DeadLetter(_) => backlog.drain(..1).collect(),
        };
        let guard = &shared.executor.guard;
        // An ordinary batch shares the process; an isolated message runs alone, so that a death during its
        // attempt is its own (its start does not count while it waits for the others to finish).
        let mut _shared_lock = None;
        match start {
            BatchStart::Normal => {
                _shared_lock = tokio::select! {
                    biased;
                    _ = cancel.cancelled() => None,
                    lock = guard.shared() => Some(lock),
                };
            }
            BatchStart::Isolate => {
                guard.pause(&tp.0, tp.1, first).await;
                batch[0].alone = tokio::select! {
                    biased;
                    _ = cancel.cancelled() => None,
                    lock = guard.exclusive() => Some(lock),
                };
                guard.resume(&tp.0, tp.1, first).await;
                batch[0].isolated = true;
            }
            BatchStart::DeadLetter(_) => {}
        }
        if cancel.is_cancelled() {
            guard.end(&tp.0, tp.1, first, false).await;
            return;
        }
        let done = if let BatchStart::DeadLetter(deaths) = start {
            usize::from(
                shared
                    .executor
                    .dead_letter_crash_loop(&mut batch[0], deaths, &cancel)
                    .await,
            )
        } else {
            shared.executor.process(&mut batch, &cancel).await
        };
        if done > 0 {
            let next = batch[done - 1].raw.origin.offset + 1;
            shared.tracker.finished(&tp, generation, next);
        }
        if done < batch.len() {
            // Cancelled (revoke or shutdown): the rest comes back to whoever owns the partition next.
            shared.executor.guard.end(&tp.0, tp.1, first, false).await;
            return;
        }
        if start != BatchStart::Normal {
            shared.executor.guard.end(&tp.0, tp.1, first, true).await;
        }
    }
}
