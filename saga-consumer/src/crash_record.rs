//! The crash-loop record of one partition and its decisions, free of I/O: what
//! `saga_consumer_begin_batch`, `saga_consumer_end_batch` and `saga_consumer_close_batch` (the consumer's
//! migrations) do to the row of `saga_consumer_progress`. The SQL performs them in one statement beside the batch (this module is built
//! for tests only); the model (`model.rs`) drives these functions, and a test below holds the SQL to them
//! over every short history of calls and five hundred longer ones.
//!
//! A batch's range stays open from its record until the next batch's record replaces it, or until it is
//! ended unfinished on purpose (a revoke, a shutdown). A batch that meets an open range it did not follow
//! means the run that recorded it died there: the range becomes the suspect range, and the batches that
//! reach it go one message at a time. It meets the range either by overlapping it (the restart's first
//! batch starts inside it) or by lying wholly before it: the committed offset lags the database by up to
//! `SAGA_COMMIT_INTERVAL_MS`, so a restart redelivers the batches before the range first. Those run
//! normally (they are duplicates, and none of them is to blame); the suspect range waits for the batch that
//! reaches it.

/// The record of one partition (a row of `saga_consumer_progress`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Record {
    /// The first offset of the last batch recorded (`batch_offset`).
    pub(crate) first: i64,
    /// Its last offset (`batch_end`); below `first` once the batch was ended unfinished on purpose.
    pub(crate) last: i64,
    /// The range a run died in, gone through one message at a time.
    pub(crate) suspect: Option<Suspect>,
}

/// The offsets a run died in (`suspect_from`, `suspect_until`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Suspect {
    /// Its first offset; `None` reaches down to the partition's start (a record written before the bound
    /// was kept).
    pub(crate) from: Option<i64>,
    /// Its last offset.
    pub(crate) until: i64,
}

impl Record {
    /// Whether the recorded batch's range is open: recorded and not ended unfinished.
    fn open(&self) -> bool {
        self.first <= self.last
    }

    /// Whether the partition is clear (no suspect range left): the batch that follows this one starts
    /// normally, so its worker may record it beside its transaction (the function's `clear`).
    pub(crate) fn clear(&self) -> bool {
        self.suspect.is_none()
    }
}

impl Suspect {
    /// The suspect range grown to cover `first..=last`.
    fn widened(this: Option<Self>, first: i64, last: i64) -> Self {
        match this {
            None => Self {
                from: Some(first),
                until: last,
            },
            Some(s) => Self {
                from: s.from.map(|from| from.min(first)),
                until: s.until.max(last),
            },
        }
    }

    /// Whether the batch `first..=last` reaches into the range.
    fn reaches(&self, first: i64, last: i64) -> bool {
        first <= self.until && self.from.is_none_or(|from| from <= last)
    }
}

/// A batch `first..=last` begins after `prev`: the record it leaves, and whether its first message goes
/// alone (the record then covers that message only).
pub(crate) fn begin(prev: Option<Record>, first: i64, last: i64) -> (Record, bool) {
    let mut suspect = prev.and_then(|p| p.suspect);
    if let Some(p) = prev.filter(Record::open) {
        let overlaps = p.first <= last && first <= p.last;
        let before = last < p.first;
        if overlaps || before {
            suspect = Some(Suspect::widened(suspect, p.first, p.last));
        }
    }
    suspect = suspect.filter(|s| first <= s.until);
    let isolate = suspect.is_some_and(|s| s.reaches(first, last));
    let last = if isolate { first } else { last };
    (
        Record {
            first,
            last,
            suspect,
        },
        isolate,
    )
}

/// The batch starting at `first` ended, `finished` or abandoned on purpose: the record it leaves. An
/// abandoned batch's range is closed (nothing died in it); a finished one's stays open until the next
/// batch's record, as a normal batch's does.
pub(crate) fn end(record: Record, first: i64, finished: bool) -> Record {
    if !finished && record.first == first {
        Record {
            last: first - 1,
            ..record
        }
    } else {
        record
    }
}

/// A worker that stops between batches, its last range `first..=last` finished, closes it
/// (`saga_consumer_close_batch`): only if the record is still that range and clear, so that a record another
/// worker wrote since is left alone.
pub(crate) fn close(record: Record, first: i64, last: i64) -> Record {
    if record.first == first && record.last == last && record.clear() {
        Record {
            last: first - 1,
            ..record
        }
    } else {
        record
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(first: i64, last: i64) -> Record {
        Record {
            first,
            last,
            suspect: None,
        }
    }

    #[test]
    fn a_batch_after_the_recorded_one_replaces_it_and_starts_normally() {
        let (next, isolate) = begin(Some(record(0, 9)), 10, 19);
        assert!(!isolate);
        assert_eq!(next, record(10, 19));
        assert_eq!(begin(None, 0, 9), (record(0, 9), false));
    }

    #[test]
    fn a_restart_inside_the_open_range_isolates_each_message_up_to_its_end() {
        let (next, isolate) = begin(Some(record(10, 19)), 10, 19);
        assert!(isolate);
        assert_eq!(
            next.suspect,
            Some(Suspect {
                from: Some(10),
                until: 19
            })
        );
        assert_eq!((next.first, next.last), (10, 10));
        let (next, isolate) = begin(Some(next), 11, 20);
        assert!(isolate, "still inside");
        let (after, isolate) = begin(Some(next), 20, 29);
        assert!(!isolate, "past the range");
        assert_eq!(after.suspect, None);
    }

    /// The defect this record fixes: a restart whose committed offset lagged redelivered batches before
    /// the range the last run died in, and the first of them replaced the record.
    #[test]
    fn batches_redelivered_before_the_open_range_run_normally_and_the_range_stays_suspect() {
        let died = record(20, 29);
        let (next, isolate) = begin(Some(died), 0, 9);
        assert!(!isolate, "a duplicate before the range is not to blame");
        let (next, isolate) = begin(Some(next), 10, 19);
        assert!(!isolate);
        let (next, isolate) = begin(Some(next), 20, 29);
        assert!(isolate, "the range the last run died in goes one at a time");
        assert_eq!((next.first, next.last), (20, 20));
    }

    #[test]
    fn a_batch_reaching_into_the_suspect_range_from_before_it_goes_alone_from_its_start() {
        let (next, _) = begin(Some(record(20, 29)), 0, 9);
        let (_, isolate) = begin(Some(next), 15, 24);
        assert!(isolate);
    }

    #[test]
    fn an_abandoned_range_is_closed_and_blames_nothing() {
        let ended = end(record(10, 19), 10, false);
        assert_eq!(ended, record(10, 9));
        assert_eq!(begin(Some(ended), 0, 9), (record(0, 9), false));
        assert_eq!(begin(Some(ended), 5, 14), (record(5, 14), false));
        assert_eq!(
            end(record(10, 19), 10, true),
            record(10, 19),
            "finished stays open"
        );
        assert_eq!(
            end(record(10, 19), 3, false),
            record(10, 19),
            "another batch's end"
        );
    }

    #[test]
    fn a_worker_closes_only_its_own_clear_range() {
        assert_eq!(close(record(10, 19), 10, 19), record(10, 9));
        assert_eq!(
            close(record(10, 19), 10, 12),
            record(10, 19),
            "another range"
        );
        let isolated = begin(Some(record(10, 19)), 10, 19).0;
        assert_eq!(
            close(isolated, 10, 10),
            isolated,
            "a suspect's isolated record"
        );
    }

    #[test]
    fn a_suspect_range_without_its_start_reaches_down_to_the_partitions_start() {
        let old = Record {
            suspect: Some(Suspect {
                from: None,
                until: 29,
            }),
            ..record(25, 25)
        };
        assert!(begin(Some(old), 0, 9).1);
    }

    /// A call of the record's functions.
    #[derive(Debug, Clone, Copy)]
    enum Call {
        Begin(i64, i64),
        End(i64, bool),
        Close(i64, i64),
    }

    fn calls() -> Vec<Call> {
        let mut calls = Vec::new();
        for first in 0..6 {
            for last in first..(first + 3).min(7) {
                calls.push(Call::Begin(first, last));
            }
            calls.push(Call::Close(first, first));
            calls.push(Call::Close(first, first + 1));
            calls.push(Call::End(first, false));
            calls.push(Call::End(first, true));
        }
        calls
    }

    /// The records a history may start from: none, an open range, a closed one, and suspect ranges with
    /// and without their start (a row written before `suspect_from` was kept).
    fn starts() -> Vec<Option<Record>> {
        let suspect = |from, until| Some(Suspect { from, until });
        vec![
            None,
            Some(record(2, 3)),
            Some(record(2, 1)),
            Some(Record {
                suspect: suspect(None, 4),
                ..record(3, 3)
            }),
            Some(Record {
                suspect: suspect(Some(3), 4),
                ..record(3, 3)
            }),
        ]
    }

    /// Every history of two calls from each start, and five hundred longer ones.
    fn histories() -> Vec<(Option<Record>, Vec<Call>)> {
        let calls = calls();
        let mut out = Vec::new();
        for start in starts() {
            for a in &calls {
                for b in &calls {
                    out.push((start, vec![*a, *b]));
                }
            }
        }
        // A fixed linear congruential sequence: the same histories on every run.
        let mut seed: u64 = 0x5eed;
        let mut next = |n: usize| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            usize::try_from(seed >> 33).unwrap() % n
        };
        let starts = starts();
        for _ in 0..500 {
            let start = starts[next(starts.len())];
            let history = (0..8).map(|_| calls[next(calls.len())]).collect();
            out.push((start, history));
        }
        out
    }

    async fn row(conn: &mut sqlx::PgConnection, partition: i32) -> Option<Record> {
        let row: Option<(i64, i64, Option<i64>, Option<i64>)> = sqlx::query_as(
            "SELECT batch_offset, batch_end, suspect_from, suspect_until FROM saga_consumer_progress \
             WHERE group_id = 'g' AND topic = 't' AND partition = $1",
        )
        .bind(partition)
        .fetch_optional(conn)
        .await
        .unwrap();
        row.map(|(first, last, from, until)| Record {
            first,
            last,
            suspect: until.map(|until| Suspect { from, until }),
        })
    }

    async fn put(conn: &mut sqlx::PgConnection, partition: i32, start: Record) {
        let suspect = start.suspect;
        sqlx::query(
            "INSERT INTO saga_consumer_progress \
             (group_id, topic, partition, batch_offset, batch_end, suspect_from, suspect_until) \
             VALUES ('g', 't', $1, $2, $3, $4, $5)",
        )
        .bind(partition)
        .bind(start.first)
        .bind(start.last)
        .bind(suspect.and_then(|s| s.from))
        .bind(suspect.map(|s| s.until))
        .execute(conn)
        .await
        .unwrap();
    }

    /// Makes `call` on the SQL side, on `partition`: a begin's answer (isolate, clear).
    async fn call_sql(
        conn: &mut sqlx::PgConnection,
        partition: i32,
        call: Call,
    ) -> Option<(bool, bool)> {
        let statement = match call {
            Call::Begin(first, last) => {
                let said = sqlx::query_as(
                    "SELECT isolate, clear FROM saga_consumer_begin_batch('g', 't', $1, $2, $3)",
                )
                .bind(partition)
                .bind(first)
                .bind(last);
                return Some(said.fetch_one(conn).await.unwrap());
            }
            Call::End(first, finished) => {
                sqlx::query("SELECT saga_consumer_end_batch('g', 't', $1, $2, $3)")
                    .bind(partition)
                    .bind(first)
                    .bind(finished)
            }
            Call::Close(first, last) => {
                sqlx::query("SELECT saga_consumer_close_batch('g', 't', $1, $2, $3)")
                    .bind(partition)
                    .bind(first)
                    .bind(last)
            }
        };
        statement.execute(conn).await.unwrap();
        None
    }

    /// Plays `history` from `start` on `partition`, checking the SQL's answers and row after each call.
    async fn play(
        conn: &mut sqlx::PgConnection,
        partition: i32,
        start: Option<Record>,
        history: &[Call],
    ) {
        if let Some(start) = start {
            put(conn, partition, start).await;
        }
        let mut expected = start;
        for &call in history {
            let (next, answer) = match call {
                Call::Begin(first, last) => {
                    let (next, isolate) = begin(expected, first, last);
                    (Some(next), Some((isolate, next.clear())))
                }
                Call::End(first, finished) => (expected.map(|r| end(r, first, finished)), None),
                Call::Close(first, last) => (expected.map(|r| close(r, first, last)), None),
            };
            let said = call_sql(conn, partition, call).await;
            assert_eq!(said, answer, "{start:?} then {history:?}: at {call:?}");
            expected = next;
            assert_eq!(
                row(conn, partition).await,
                expected,
                "{start:?} then {history:?}: after {call:?}"
            );
        }
    }

    /// The migrations' `saga_consumer_begin_batch`, `saga_consumer_end_batch` and
    /// `saga_consumer_close_batch` decide as [`begin`], [`end`] and [`close`] do, call after call, over
    /// every history of two calls and five hundred of eight (each history on a partition of its own, eight
    /// at once).
    #[tokio::test]
    async fn the_sql_functions_decide_as_the_record_does() {
        use futures::StreamExt;
        let db =
            saga_test_support::TestDb::with("crash-record", &[crate::migrate::migrator()]).await;
        let histories = histories();
        let pool = &db.pool;
        let per = histories.len().div_ceil(8);
        futures::stream::iter(histories.chunks(per).enumerate())
            .for_each_concurrent(None, |(chunk, histories)| async move {
                let mut conn = pool.acquire().await.unwrap();
                for (i, (start, history)) in histories.iter().enumerate() {
                    let partition = i32::try_from(chunk * per + i).unwrap();
                    play(&mut conn, partition, *start, history).await;
                }
            })
            .await;
    }
}
