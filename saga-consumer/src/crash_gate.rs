//! The first stage a batch meets: the crash-loop gate. Before a batch takes effect, its offset range is
//! recorded (`guard`); a batch that meets the previous, open range without following it means the last run
//! died there, and that range goes one message at a time, each counted, until a message that keeps killing
//! the process is dead-lettered. The happy path records beside the batch's transaction, whose commit waits
//! for the record; other batches record first. Beside is the happy path only once the partition is known
//! clear (the worker's last record said no suspect range is left): the transaction's handlers run before
//! the record is read, so a suspect range's batch recorded beside would run a message that kills the
//! process before learning that it was to go alone, its start uncounted, on every restart.
//!
//! The decisions are pure functions ([`recording`], [`run_of`], [`after_beside`], [`end_of`]); the
//! [`CrashGate`] performs them, and hands each batch to the later stages (`Executor::process`: the hold
//! gate, the batch machine, the step transaction).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use crate::connection::WorkerConnection;
use crate::delivery::Delivery;
use crate::executor::Alone;
use crate::guard::{BatchStart, CommitPermit, PendingStart, Recorded};
use crate::hold;
use crate::key_lanes;
use crate::metrics::observe_since;
use crate::offsets::TopicPartition;
use crate::partition::{WorkerShared, report};

/// How a batch's start is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recording {
    /// Nothing to record: every message is known done (the fast path) or ignored, no transaction runs.
    Skip,
    /// Recorded beside the batch's transaction, whose commit waits for it.
    Beside,
    /// Recorded first, then acted on.
    First,
}

/// How a batch's start is recorded: with the fast path on, `fast_only` says every message needs no claim;
/// beside the transaction where detection is on, the partition is known `clear` and every message is
/// transactional or ignored, unless the batch is a window run `in_lanes` (several transactions: the range
/// is recorded before any starts).
pub(crate) fn recording(
    fast_only: bool,
    guard_enabled: bool,
    clear: bool,
    all_transactional: bool,
    in_lanes: bool,
) -> Recording {
    if fast_only {
        Recording::Skip
    } else if guard_enabled && clear && all_transactional && !in_lanes {
        Recording::Beside
    } else {
        Recording::First
    }
}

/// What runs after a start recorded first.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Run {
    /// The batch, under the shared lock.
    Batch,
    /// The first message alone, isolated (the last run died in its range).
    Isolated,
    /// The first message, dead-lettered alone, with the permit its recorded start gave.
    Alone(Alone, CommitPermit),
}

/// What runs for `start`, and how many messages it takes of a batch of `take`.
pub(crate) fn run_of(start: &BatchStart, take: usize) -> (Run, usize) {
    match start {
        BatchStart::Normal => (Run::Batch, take),
        BatchStart::Isolate => (Run::Isolated, 1),
        BatchStart::DeadLetter(deaths) => (
            Run::Alone(
                Alone::CrashLoop(*deaths),
                CommitPermit::recorded_dead_letter(),
            ),
            1,
        ),
    }
}

/// What follows a batch run beside its record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Beside {
    /// Done: the next batch.
    Next,
    /// Cancelled (revoke or shutdown) after the record: it is ended unfinished, and the worker stops.
    Abandon,
    /// Cancelled before the record was in: the worker stops.
    Stop,
    /// The range is a suspect's (or the record was refused): nothing of the batch took effect; it goes
    /// again as this start says.
    Redo(BatchStart),
}

/// What follows a batch of `take` run beside its record, which said `recorded`, with `done` finished.
pub(crate) fn after_beside(recorded: Option<BatchStart>, done: usize, take: usize) -> Beside {
    match recorded {
        Some(BatchStart::Normal) if done == take => Beside::Next,
        Some(BatchStart::Normal) => Beside::Abandon,
        None => Beside::Stop,
        Some(start) => {
            debug_assert_eq!(done, 0, "nothing takes effect before the start is known");
            Beside::Redo(start)
        }
    }
}

/// How a run recorded first ends its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// A normal batch, finished: the next batch's record closes its range.
    Open,
    /// An isolated or dead-lettered message, finished: its range is closed now.
    Finished,
    /// Not all finished (cancelled): ended unfinished, and the worker stops.
    Abandoned,
}

/// How a run of `start` that finished `done` of `len` messages ends its record.
pub(crate) fn end_of(start: &BatchStart, done: usize, len: usize) -> End {
    if done < len {
        End::Abandoned
    } else if *start == BatchStart::Normal {
        End::Open
    } else {
        End::Finished
    }
}

/// Whether the worker goes on after a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flow {
    /// To the next batch.
    Next,
    /// It stops (cancelled, or its queue closed).
    Stop,
}

/// The crash-loop gate of one partition's worker.
pub(crate) struct CrashGate<'a> {
    shared: &'a WorkerShared,
    tp: &'a TopicPartition,
    generation: u64,
    /// Whether the last record left the partition clear; not known (false) until the worker's first.
    clear: AtomicBool,
    /// The worker's last recorded range, finished and left open (the next record replaces it).
    finished: Mutex<Option<(i64, i64)>>,
}

impl<'a> CrashGate<'a> {
    /// The gate of the worker of `tp` in its assignment's `generation`.
    pub(crate) fn new(shared: &'a WorkerShared, tp: &'a TopicPartition, generation: u64) -> Self {
        Self {
            shared,
            tp,
            generation,
            clear: AtomicBool::new(false),
            finished: Mutex::new(None),
        }
    }

    /// The worker stops: its last range, finished, is closed if the record is still that range (a batch
    /// recorded since, abandoned or not, replaced it), so that a new owner starting behind it (a commit
    /// refused on revoke, offsets reset back) does not take it for one a run died in.
    pub(crate) async fn close(&self, connection: &mut WorkerConnection) {
        let range = self.finished.lock().expect("not poisoned").take();
        if let Some(range) = range {
            let guard = &self.shared.executor.guard;
            guard
                .close(&self.tp.0, self.tp.1, range, &connection.release())
                .await;
        }
    }

    /// The range `first..=last`, recorded, finished and left open.
    fn finished(&self, first: i64, last: i64) {
        *self.finished.lock().expect("not poisoned") = Some((first, last));
    }

    /// Keeps what `recorded` says of the partition (not clear, if the record was cancelled).
    fn learn(&self, recorded: Option<&Recorded>) -> Option<BatchStart> {
        self.clear
            .store(recorded.is_some_and(|r| r.clear), Ordering::Relaxed);
        recorded.map(|r| r.start.clone())
    }

    /// Runs the next batch, of up to `take` messages at the front of `backlog`, through the gate and the
    /// later stages; finished messages are reported and leave the backlog.
    pub(crate) async fn batch(
        &self,
        backlog: &mut VecDeque<Delivery>,
        take: usize,
        connection: &mut WorkerConnection,
        cancel: &CancellationToken,
    ) -> Flow {
        let executor = &self.shared.executor;
        let fast_only = match executor.fast_path.as_ref() {
            Some(fast_path) => {
                let candidates = &mut backlog.make_contiguous()[..take];
                crate::fast::pre_check(Some(fast_path), candidates).await;
                candidates.iter().all(Delivery::needs_no_claim)
            }
            None => false,
        };
        let all_transactional = backlog
            .iter()
            .take(take)
            .all(Delivery::is_transactional_or_ignored);
        let lanes = in_lanes(self.shared, backlog.iter().take(take));
        let guard_enabled = executor.guard.is_enabled();
        let clear = self.clear.load(Ordering::Relaxed);
        match recording(fast_only, guard_enabled, clear, all_transactional, lanes) {
            Recording::Skip => {
                let start = PendingStart::known(BatchStart::Normal);
                self.process(backlog, take, start, connection, cancel).await
            }
            Recording::Beside => match self.beside(backlog, take, connection, cancel).await {
                Ok(flow) => flow,
                Err(start) => {
                    self.recorded(start, backlog, take, connection, cancel)
                        .await
                }
            },
            Recording::First => {
                let (first, last) = range(backlog, take);
                let guarded = Instant::now();
                let start = executor
                    .guard
                    .begin_until_recorded(
                        &self.tp.0,
                        self.tp.1,
                        first,
                        last,
                        &connection.release(),
                        cancel,
                    )
                    .await;
                observe_since(&executor.metrics.phases.guard, guarded);
                match self.learn(start.as_ref()) {
                    Some(start) => {
                        self.recorded(start, backlog, take, connection, cancel)
                            .await
                    }
                    None => Flow::Stop,
                }
            }
        }
    }

    /// The happy path: the batch's transaction runs while its start is recorded (a second connection: a
    /// worker keeping its own leaves one for it); its commit waits for the record. `Err(start)`: the record
    /// said otherwise, and nothing of the batch took effect.
    async fn beside(
        &self,
        backlog: &mut VecDeque<Delivery>,
        take: usize,
        connection: &mut WorkerConnection,
        cancel: &CancellationToken,
    ) -> Result<Flow, BatchStart> {
        let executor = &self.shared.executor;
        let guard = &executor.guard;
        let (first, last) = range(backlog, take);
        connection.make_room(&executor.pool);
        let mut pending =
            PendingStart::record(guard, &self.tp.0, self.tp.1, first, last, cancel).await;
        let shared_lock = match guard.try_shared() {
            Some(lock) => Some(lock),
            None => {
                // An isolated message has the process alone and needs a connection of its own.
                let released = connection.release();
                tokio::select! {
                    biased;
                    () = cancel.cancelled() => None,
                    lock = guard.shared(&released) => Some(lock),
                }
            }
        };
        let done = match shared_lock {
            Some(_lock) => {
                let batch = &mut backlog.make_contiguous()[..take];
                executor
                    .process(batch, cancel, &mut pending, connection)
                    .await
            }
            None => 0,
        };
        report(
            self.shared,
            self.tp,
            self.generation,
            &backlog.make_contiguous()[..done],
        );
        backlog.drain(..done);
        let recorded = pending.recorded().await;
        match after_beside(self.learn(recorded.as_ref()), done, take) {
            Beside::Next => {
                self.finished(first, last);
                Ok(Flow::Next)
            }
            Beside::Abandon => {
                guard
                    .end(&self.tp.0, self.tp.1, first, false, &connection.release())
                    .await;
                Ok(Flow::Stop)
            }
            Beside::Stop => Ok(Flow::Stop),
            Beside::Redo(start) => Err(start),
        }
    }

    /// A batch whose start is recorded as `start`: the batch under the shared lock, its first message
    /// alone (isolated), or dead-lettered alone; then the record's end.
    async fn recorded(
        &self,
        start: BatchStart,
        backlog: &mut VecDeque<Delivery>,
        take: usize,
        connection: &mut WorkerConnection,
        cancel: &CancellationToken,
    ) -> Flow {
        let executor = &self.shared.executor;
        let guard = &executor.guard;
        let first = backlog[0].raw.origin.offset;
        let (run, taken) = run_of(&start, take);
        let mut batch: Vec<Delivery> = backlog.drain(..taken).collect();
        // An ordinary batch shares the process; an isolated message runs alone, so that a death during its
        // attempt is its own (its start counts only from when it has the process alone).
        let mut _shared_lock = None;
        match &run {
            Run::Batch => {
                let released = connection.release();
                _shared_lock = tokio::select! {
                    biased;
                    () = cancel.cancelled() => None,
                    lock = guard.shared(&released) => Some(lock),
                };
            }
            Run::Isolated => {
                batch[0].alone = guard
                    .alone(&self.tp.0, self.tp.1, first, &connection.release(), cancel)
                    .await;
                batch[0].isolated = true;
            }
            Run::Alone(..) => {}
        }
        if cancel.is_cancelled() {
            guard
                .end(&self.tp.0, self.tp.1, first, false, &connection.release())
                .await;
            return Flow::Stop;
        }
        let done = match run {
            Run::Alone(why, permit) => {
                let released = connection.release();
                let letter =
                    executor.dead_letter_alone(&mut batch[0], why, &permit, &released, cancel);
                usize::from(letter.await)
            }
            // A window of several keys: its lanes, each from the recorded start.
            Run::Batch if in_lanes(self.shared, batch.iter()) => {
                let _released = connection.release();
                key_lanes::run(self.shared, self.tp, self.generation, &mut batch, cancel).await
            }
            // The start is recorded and acted on (an isolated message runs alone): what follows may commit.
            Run::Batch | Run::Isolated => {
                let mut known = PendingStart::known(BatchStart::Normal);
                executor
                    .process(&mut batch, cancel, &mut known, connection)
                    .await
            }
        };
        report(self.shared, self.tp, self.generation, &batch[..done]);
        match end_of(&start, done, batch.len()) {
            End::Open => {
                self.finished(first, last_offset(&batch));
                Flow::Next
            }
            End::Finished => {
                // An isolated run's range lies in a suspect range, which covers it: nothing to close.
                *self.finished.lock().expect("not poisoned") = None;
                guard
                    .end(&self.tp.0, self.tp.1, first, true, &connection.release())
                    .await;
                Flow::Next
            }
            End::Abandoned => {
                guard
                    .end(&self.tp.0, self.tp.1, first, false, &connection.release())
                    .await;
                Flow::Stop
            }
        }
    }

    /// A batch without a record (every message known done or ignored): no transaction runs.
    async fn process(
        &self,
        backlog: &mut VecDeque<Delivery>,
        take: usize,
        mut start: PendingStart,
        connection: &mut WorkerConnection,
        cancel: &CancellationToken,
    ) -> Flow {
        let mut batch: Vec<Delivery> = backlog.drain(..take).collect();
        let executor = &self.shared.executor;
        let done = executor
            .process(&mut batch, cancel, &mut start, connection)
            .await;
        report(self.shared, self.tp, self.generation, &batch[..done]);
        if done < batch.len() {
            Flow::Stop
        } else {
            Flow::Next
        }
    }
}

/// Whether `batch` is a window that runs in lanes (see `key_lanes`).
fn in_lanes<'a>(shared: &WorkerShared, batch: impl Iterator<Item = &'a Delivery>) -> bool {
    key_lanes::applies(shared.key_concurrency, batch.map(|d| hold::key_of(&d.raw)))
}

/// The last offset of `batch` (not empty).
fn last_offset(batch: &[Delivery]) -> i64 {
    batch.last().expect("a batch").raw.origin.offset
}

/// The first and last offsets of the batch of `take` at the front of `backlog`.
fn range(backlog: &VecDeque<Delivery>, take: usize) -> (i64, i64) {
    (
        backlog[0].raw.origin.offset,
        backlog[take - 1].raw.origin.offset,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_recorded_beside_its_transaction_only_when_detection_is_on_and_it_is_transactional()
     {
        assert_eq!(recording(true, true, true, true, false), Recording::Skip);
        assert_eq!(recording(false, true, true, true, false), Recording::Beside);
        assert_eq!(recording(false, true, true, false, false), Recording::First);
        assert_eq!(recording(false, false, true, true, false), Recording::First);
        assert_eq!(
            recording(false, true, true, true, true),
            Recording::First,
            "a window in lanes runs several transactions: its range is recorded before any"
        );
        assert_eq!(recording(true, true, true, true, true), Recording::Skip);
        assert_eq!(
            recording(false, true, false, true, false),
            Recording::First,
            "a partition not known clear: its batch may be a suspect's, whose first message must not run \
             before the record says so"
        );
        assert_eq!(recording(true, true, false, true, false), Recording::Skip);
    }

    #[test]
    fn a_suspects_range_goes_one_message_at_a_time_and_a_refused_record_dead_letters_the_first() {
        assert_eq!(run_of(&BatchStart::Normal, 7), (Run::Batch, 7));
        assert_eq!(run_of(&BatchStart::Isolate, 7), (Run::Isolated, 1));
        assert_eq!(
            run_of(&BatchStart::DeadLetter(3), 7),
            (
                Run::Alone(Alone::CrashLoop(3), CommitPermit::recorded_dead_letter()),
                1
            )
        );
    }

    #[test]
    fn a_batch_beside_its_record_goes_on_only_when_the_record_says_normal_and_all_finished() {
        assert_eq!(after_beside(Some(BatchStart::Normal), 3, 3), Beside::Next);
        assert_eq!(
            after_beside(Some(BatchStart::Normal), 1, 3),
            Beside::Abandon
        );
        assert_eq!(after_beside(None, 0, 3), Beside::Stop);
        assert_eq!(
            after_beside(Some(BatchStart::Isolate), 0, 3),
            Beside::Redo(BatchStart::Isolate)
        );
    }

    #[test]
    fn a_records_range_is_closed_after_an_isolated_run_and_abandoned_when_cancelled() {
        assert_eq!(end_of(&BatchStart::Normal, 3, 3), End::Open);
        assert_eq!(end_of(&BatchStart::Isolate, 1, 1), End::Finished);
        assert_eq!(end_of(&BatchStart::DeadLetter(2), 1, 1), End::Finished);
        assert_eq!(end_of(&BatchStart::Normal, 2, 3), End::Abandoned);
    }
}
