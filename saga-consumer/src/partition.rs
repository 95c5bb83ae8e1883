//! One worker task per assigned partition: it takes the partition's messages from a bounded queue, in
//! order, forms batches (or, with keys in parallel, windows: `key_lanes`) and hands each to the chain of
//! stages (`crash_gate` → `key_lanes` → `hold_gate` → the batch machine → the step transaction), which
//! report how far they got. Workers of different partitions run
//! concurrently, up to the consumer's concurrency limit.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use saga_core::RawMessage;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::connection::{Released, WorkerConnection};
use crate::crash_gate::{CrashGate, Flow};
use crate::delivery::{Delivery, Router};
use crate::executor::Executor;
use crate::hold;
use crate::key_lanes;
use crate::metrics::observe_since;
use crate::offsets::{OffsetTracker, TopicPartition};

/// What all partition workers share.
pub(crate) struct WorkerShared {
    pub executor: Executor,
    pub router: Router,
    pub tracker: Arc<OffsetTracker>,
    pub permits: Arc<Semaphore>,
    pub batch_size: usize,
    /// Messages of different keys of one partition that run at once (`SAGA_KEY_CONCURRENCY`).
    pub key_concurrency: usize,
    /// Most messages a window takes (see `key_lanes::window`): `batch_size` unless keys run in lanes.
    pub window: usize,
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
    let gate = CrashGate::new(&shared, &tp, generation);
    loop {
        if !receive(
            &shared,
            &mut backlog,
            &mut receiver,
            &mut connection,
            &cancel,
        )
        .await
        {
            break;
        }
        let waited = Instant::now();
        let _permit = match shared.permits.clone().try_acquire_owned() {
            Ok(permit) => permit,
            // Other partitions' turn first: no connection is held while waiting for a slot, so a consumer
            // never holds more connections than it has slots.
            Err(_) => match slot(&shared.permits, &cancel, &connection.release()).await {
                Some(permit) => permit,
                None => break,
            },
        };
        observe_since(&shared.executor.metrics.phases.permit, waited);
        let take = key_lanes::take(
            backlog.iter().map(|d| hold::key_of(&d.raw)),
            backlog.len(),
            shared.batch_size,
            shared.window,
            shared.key_concurrency,
        );
        if gate
            .batch(&mut backlog, take, &mut connection, &cancel)
            .await
            == Flow::Stop
        {
            break;
        }
    }
    // However the worker stops: its last finished range, unless a batch recorded since replaced it.
    gate.close(&mut connection).await;
}

/// Fills `backlog` up to a batch from the partition's queue, waiting (with no connection kept) for a
/// first message when it is empty; `false` if `cancel` fired first or the queue closed.
async fn receive(
    shared: &WorkerShared,
    backlog: &mut VecDeque<Delivery>,
    receiver: &mut mpsc::Receiver<RawMessage>,
    connection: &mut WorkerConnection,
    cancel: &CancellationToken,
) -> bool {
    let phases = &shared.executor.metrics.phases;
    if backlog.is_empty() {
        let idle = Instant::now();
        let next = match receiver.try_recv() {
            Ok(raw) => Some(raw),
            // Nothing to do: the connection goes back to the pool while the worker waits.
            Err(_) => next_message(receiver, cancel, &connection.release()).await,
        };
        match next {
            Some(raw) => backlog.push_back(shared.router.route(raw)),
            None => return false,
        }
        observe_since(&phases.idle, idle);
    }
    let routing = Instant::now();
    while backlog.len() < shared.window {
        match receiver.try_recv() {
            Ok(raw) => backlog.push_back(shared.router.route(raw)),
            Err(_) => break,
        }
    }
    observe_since(&phases.route, routing);
    if shared.key_concurrency > 1 && backlog.len() < shared.window {
        gather(shared, backlog, receiver, cancel, &connection.release()).await;
    }
    true
}

/// How long a window of keys in parallel waits for more messages when its partition's queue ran dry: the
/// messages of one fetch reach the queue one after another, and a window formed from the first alone would
/// run its key with no other beside it.
const GATHER: std::time::Duration = std::time::Duration::from_millis(1);

/// Adds to `backlog` what reaches the partition's queue within [`GATHER`], up to a window, with no
/// connection kept.
async fn gather(
    shared: &WorkerShared,
    backlog: &mut VecDeque<Delivery>,
    receiver: &mut mpsc::Receiver<RawMessage>,
    cancel: &CancellationToken,
    _released: &Released<'_>,
) {
    let deadline = tokio::time::sleep(GATHER);
    tokio::pin!(deadline);
    while backlog.len() < shared.window {
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            next = receiver.recv() => match next {
                Some(raw) => backlog.push_back(shared.router.route(raw)),
                None => return,
            },
            () = &mut deadline => return,
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
pub(crate) fn report(
    shared: &WorkerShared,
    tp: &TopicPartition,
    generation: u64,
    finished: &[Delivery],
) {
    if let Some(last) = finished.last() {
        shared
            .tracker
            .finished(tp, generation, last.raw.origin.offset + 1);
    }
}
