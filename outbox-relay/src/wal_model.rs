//! A model of the WAL relays' protocol, checked exhaustively with `stateright`: the switch from the table
//! outbox to the log, two relays sharing one slot (one reads, the other stands by and takes over when it
//! dies), a key whose deliveries keep failing or hang, its table row failing before the switch, parking and
//! release, an operator letting a parked row go, a broker outage, and a relay dying anywhere.
//!
//! The decisions are the code's own: the fence is [`may_read_slot`]; a relay reading the slot collects what
//! it read in a [`WalBatch`] with its [`Holds`], sends each round with [`KeyOrder`] (one event per key in
//! flight, as the publisher does), reports each delivery to the batch (`acked`, `failed` with a
//! [`Failure`]), parks what the batch says, and confirms the slot past the batch only once nothing of it is
//! pending; the release publishes the parked events with [`KeyOrder`] too and resets its holds from the
//! keys the database holds, as `wal.rs` does. The model plays the rest, as the code does it:
//!
//! - **The database**: the table outbox's rows (unpublished, parked or published), the parked table (a row
//!   per event, in id order, added once by the event's place in the log: `ON CONFLICT DO NOTHING`), the
//!   slot's confirmed position, and the switch once recorded. The keys held (`parked::held_keys`) are those
//!   with open parked events and those with a row of the table outbox not yet published, parked or not;
//!   the release (`parked::due`) takes only the parked events of keys without such a row.
//! - **The slot**: one reader at a time. A relay connects from the confirmed position and reads one
//!   transaction at a time; it confirms its position to the server in a later step (the status update),
//!   so a relay dying in between leaves its last batches to be read again.
//! - **The broker**: the topic, in the order the broker appended. One key is broken while the cause is
//!   there (it goes away at most once): its deliveries either fail at once or hang (a partition without a
//!   leader) until the producer gives them up after the park bound (`message.timeout.ms`: "message timed
//!   out"), the slot loop's producer and the table loop's alike. Any other delivery is acknowledged. The
//!   brokers may stop answering for a while, once (an outage): every delivery hangs until it is given up,
//!   and no failure then parks anything (`Publisher::broker_answers`), in the slot loop or the table loop.
//! - **Time**: one step, in which the park bound passes since every failure so far (of the reader's batch
//!   and of the table loops' rows). An event's failure is `expired` once the bound passed since the attempt
//!   of its first failure was sent, as `settle` measures it: a delivery given up (it hung for the bound),
//!   or any failure after the step. A table row is parked once it has failed for longer than the bound
//!   (`Retries::failing_for` counts from its first failure: never at its first failure). Either way only
//!   if a broker answers. Before the bound passes an event (or row) fails at most once, the retries waiting
//!   for time to pass; after it, once more: that failure parks it, and a relay that still retries then
//!   retries forever (the model explores no further). During an outage a failure after the bound is not
//!   explored (it parks nothing and would only count an attempt): such a delivery hangs until the brokers
//!   are back.
//! - **The table loops** beside the log: relay `r`'s owns shard `r`, and forgets its rows' failures when it
//!   dies. A row refused for good (`park_after`) is parked as one failing for too long is: not told apart.
//!   The operator may let a parked row go (clear its `parked_at`) at any time, and does once the cause is
//!   gone; the table loop then publishes it (or it fails, and is parked again).
//! - **Relays** join any time, and one dies, anywhere, losing its session, its batch, the slot and its
//!   table loop's retries.
//!
//! The world: the table row `a1` (key `a`, shard 0, owned by relay 0's table loop; relay 1's shard is
//! empty), then the log's transactions `a2`, `b1`, `a3`, `b2`, each of one event. Seven runs (`WORLDS`):
//! key `a` broken, its deliveries failing at once, with `a1` unpublished or published before the cause
//! came; key `b` broken, its deliveries failing at once or hanging; each with a relay's death; and, with an
//! outage instead of the death, the same but for the run with `a1` published. With key `a` broken
//! and `a1` unpublished, `a1` fails before the switch and is parked after the bound; the fence, which
//! ignores parked rows, then lets a relay read the slot, `a`'s events in the log are parked behind the row,
//! and they are released only after the operator lets the row go and it is published. (Key `a`'s events in
//! the log are then never sent while it is broken, so whether its deliveries hang or fail at once makes no
//! difference there.) The checker explores every state at the default depth (the longest path is shorter).
//!
//! Not modelled: a second row of one key in the table outbox, and rows a writer of an older version adds
//! after the switch; refusals for good in the log (`park_after` never applies); the brokers coming back
//! between a failure and the question whether they answer. A failure is judged with the brokers as they
//! are when it comes, but the relay asks once the round is over (`publish` returned, every delivery of the
//! round back), and the question itself waits up to 5 s for an answer: an outage ending in that window
//! parks every key whose delivery it gave up (the table loop: every row failing for longer than the bound).
//!
//! Old bugs can be put back, each found to break a property: [`WalModel::retry_until_acked`] (a failing key
//! holds the whole batch, so the slot stops for every key), [`WalModel::fence_on_own_shards`] (a relay waits
//! only for its own shards' table rows, so a key's event in the log overtakes its row in another relay's
//! shard; put back with the next one, as the code was then),
//! [`WalModel::hold_only_parked_table_rows`] (a row the operator lets go no longer holds its key: the
//! release publishes the key's parked events before the row), [`WalModel::deliveries_never_time_out`] (a
//! delivery that never comes back keeps the batch, and the slot, from settling for every key; or, for a
//! table row, keeps the fence shut), [`WalModel::table_rows_never_park_beside_the_log`] (a table row
//! failing before the switch keeps the fence shut for every key) and [`WalModel::park_during_outages`] (an
//! outage parks what it catches failing, of healthy keys too).

use std::collections::{BTreeSet, VecDeque};
use std::fmt;

use saga_runtime::store::wal::fence::{FenceView, may_read_slot};
use stateright::{Model, Property};

use crate::key_order::KeyOrder;
use crate::wal_batch::{Failure, Fate, Holds, WalBatch};

/// The rows of the table outbox, written before the switch: (name, key, shard).
const TABLE: [(&str, char, usize); 1] = [("a1", 'a', 0)];
/// The log's transactions (one event each), in commit order after the table's rows: (name, key).
const LOG: [(&str, char); 4] = [("a2", 'a'), ("b1", 'b'), ("a3", 'a'), ("b2", 'b')];
/// Every event, table rows first: an event's number is its place in commit order.
const EVENTS: usize = TABLE.len() + LOG.len();
/// Relay instances; relay `r`'s table loop owns shard `r`.
const RELAYS: usize = 2;
/// Steps explored by default (the CI's run); `SAGA_MODEL_DEPTH` explores deeper.
const DEPTH: usize = 48;

/// A run of the model: what is broken, and what else may happen.
#[derive(Debug, Clone, Copy)]
struct World {
    broken_key: char,
    /// Its deliveries hang until they are given up, rather than failing at once.
    hangs: bool,
    /// The table's rows were published before the cause came.
    rows_published: bool,
    deaths: u8,
    outages: u8,
}

/// The runs (see the module documentation). A death and an outage in one run would multiply its states by
/// five.
const WORLDS: [World; 7] = {
    const fn world(broken_key: char, hangs: bool, rows_published: bool, death: bool) -> World {
        World {
            broken_key,
            hangs,
            rows_published,
            deaths: death as u8,
            outages: !death as u8,
        }
    }
    [
        world('a', false, false, true),
        world('a', false, true, true),
        world('b', false, false, true),
        world('b', true, false, true),
        world('a', false, false, false),
        world('b', false, false, false),
        world('b', true, false, false),
    ]
};

/// The relay's `park_after` (no event is refused for good here: it never applies).
const PARK_AFTER: u32 = 3;

/// An event, by its place in commit order (table rows first); shown by its name.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Event(usize);

impl Event {
    /// The event at `position` in the log.
    fn logged(position: usize) -> Self {
        Self(TABLE.len() + position)
    }

    /// Its place in the log, for an event of the log.
    fn position(self) -> Option<usize> {
        self.0.checked_sub(TABLE.len())
    }

    fn key(self) -> char {
        match self.position() {
            None => TABLE[self.0].1,
            Some(p) => LOG[p].1,
        }
    }

    fn name(self) -> &'static str {
        match self.position() {
            None => TABLE[self.0].0,
            Some(p) => LOG[p].0,
        }
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a failing event of a batch, or row of the table outbox, stands against the park bound.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub(crate) enum Clock {
    /// It has not failed.
    #[default]
    Fresh,
    /// It failed, and the bound has not passed since: it is retried.
    Failing,
    /// The bound passed since its first failure: its next failure parks it, if a broker answers.
    Overdue,
    /// It failed after the bound and was not parked: retried forever, explored no further.
    Spent,
}

/// A round of the batch's publication: its pending events, sent one per key at a time.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Round {
    /// The batch's pending events at the round's start (batch indices), in order.
    pending: Vec<usize>,
    order: KeyOrder<char>,
    /// Batch indices handed to the producer, not yet acknowledged or failed.
    in_flight: Vec<usize>,
}

/// The events a reader read since its last confirmed position, and what is decided about them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Batch {
    /// Batch index `i` is the log's event at the session's `applied + i`.
    events: WalBatch<char>,
    /// Each event's clock (the relay's `first_sent`).
    clocks: Vec<Clock>,
    /// Being published: no more is read into it.
    sealed: bool,
    round: Option<Round>,
}

/// A relay's session with the slot (it holds the slot).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Session {
    holds: Holds<char>,
    /// The position settled (acknowledged or parked) up to, not yet necessarily confirmed to the server.
    applied: usize,
    batch: Option<Batch>,
}

/// A relay process: its table loop (shard `r`) and its WAL loop.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub(crate) struct Relay {
    up: bool,
    session: Option<Session>,
    /// The table loop's `Retries`: the clock of each row of the table outbox.
    retries: [Clock; TABLE.len()],
}

/// A row of the table outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Row {
    Unpublished,
    /// Set aside by the table loop (`parked_at`): failing for longer than the bound, or refused for good.
    Parked,
    Published,
}

/// A row of the parked table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Parked {
    event: Event,
    published: bool,
}

/// The whole system.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct State {
    /// The table outbox's rows.
    table: [Row; TABLE.len()],
    /// A relay passed the fence (the schema's outbox is on the log).
    switched: bool,
    /// The parked table, in id order.
    parked: Vec<Parked>,
    /// The slot's confirmed position: the log's events before it are not read again.
    confirmed: usize,
    /// The topic: events in the order the broker appended them.
    topic: Vec<Event>,
    /// The key whose deliveries fail while `broken`.
    broken_key: char,
    broken: bool,
    /// The broken key's deliveries hang until they are given up, rather than failing at once.
    hangs: bool,
    /// No broker answers: every delivery hangs.
    broker_down: bool,
    outages: u8,
    relays: [Relay; RELAYS],
    deaths: u8,
    /// The relays that have read the slot (both: the standby took over).
    readers: [bool; RELAYS],
    /// A relay parked an event already in the parked table (and added nothing).
    parked_again: bool,
}

/// How a delivery in flight comes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Report {
    /// The broker acknowledged (and appended) it.
    Acked,
    /// It failed at once.
    Failed,
    /// It hung until the producer gave it up, after the bound ("message timed out").
    TimedOut,
}

/// A step of the system.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Step {
    /// A relay starts.
    Join(usize),
    /// A relay dies: its session, its batch, its hold on the slot and its table loop's retries are gone.
    Dies(usize),
    /// A relay's table loop publishes a row of its shard and marks it.
    PublishRow { relay: usize, row: Event },
    /// A relay's table loop fails to publish a row of its shard (at once, or given up after the bound):
    /// parked, beside the log, once it has been failing for longer than the bound and a broker answers.
    RowFails { relay: usize, row: Event },
    /// The operator clears a parked row's `parked_at` (with the cause still there, or not: they may never
    /// while it is): the table loop publishes it again.
    UnparkRow(Event),
    /// A relay passes the fence (recording the switch) and takes the free slot, from its confirmed position,
    /// with the keys held in the database.
    Connect(usize),
    /// The reader reads the next transaction into its batch.
    Read { relay: usize, event: Event },
    /// The reader parks what its batch says, then sends a round of its pending events, or, with none left,
    /// moves its position past the batch.
    Settle(usize),
    /// A delivery of the reader's round comes back.
    Deliver {
        relay: usize,
        event: Event,
        report: Report,
    },
    /// The bound passes since every failure so far.
    TimePasses,
    /// The reader's position reaches the server: the slot is confirmed there.
    Confirm(usize),
    /// The reader, between batches, publishes the parked events again and lets go of the keys the database
    /// no longer holds.
    Release(usize),
    /// The broken key's cause goes away.
    CauseGone,
    /// The brokers stop answering.
    BrokerDown,
    /// The brokers answer again.
    BrokerBack,
}

/// The model, and optionally an old bug put back.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct WalModel {
    /// Before the fix: the batch is retried until every event is acknowledged
    /// ([`WalBatch::retrying_until_acked`]).
    pub retry_until_acked: bool,
    /// Before the fix: a relay's fence counts only the unpublished table rows of its own shards.
    pub fence_on_own_shards: bool,
    /// Before the fix: only parked rows of the table outbox hold their key (`held_keys`) and keep its
    /// parked events back (`due`), so a row the operator lets go no longer does.
    pub hold_only_parked_table_rows: bool,
    /// Before the fix: the producers never give a message up (`message.timeout.ms=0`), so a delivery that
    /// hangs never fails.
    pub deliveries_never_time_out: bool,
    /// Before the fix: beside the log the table loop parks only rows refused for good, so a row failing
    /// otherwise is retried forever.
    pub table_rows_never_park_beside_the_log: bool,
    /// Before the fix: a failure after the bound is `expired` whether a broker answers or not.
    pub park_during_outages: bool,
}

const IN_ORDER: &str = "for one key, the first copy of each event reaches the topic in commit order (the table's \
                        rows before the log's events)";
const CONFIRMED_SETTLED: &str =
    "the slot is never confirmed past an event that is neither acknowledged nor parked";
const NOTHING_LOST: &str = "with nothing left to do, every event is on the topic, or parked while its key is \
                            still broken";
const OTHERS_GO_ON: &str =
    "a broken key never keeps another key's events from the topic (with nothing left to do)";
const PARKED_ONCE: &str = "each event is parked at most once, and only the broken key's (in the log's parked \
                           table or the table outbox)";
const HOLDS_MATCH: &str = "between batches, the reader holds every key the database holds (open parked events, \
                           rows of the table outbox not yet published)";

impl State {
    fn on_topic(&self, event: Event) -> bool {
        self.topic.contains(&event)
    }

    fn all_on_topic(&self) -> bool {
        (0..EVENTS).all(|e| self.on_topic(Event(e)))
    }

    fn is_parked(&self, event: Event) -> bool {
        self.parked.iter().any(|p| p.event == event)
    }

    /// The keys whose rows of the table outbox hold them (`held_keys`) and keep their parked events back
    /// (`due`): rows not yet published, or only parked ones with `only_parked`.
    fn table_holds(&self, only_parked: bool) -> BTreeSet<char> {
        (0..TABLE.len())
            .filter(|row| match self.table[*row] {
                Row::Parked => true,
                Row::Unpublished => !only_parked,
                Row::Published => false,
            })
            .map(|row| Event(row).key())
            .collect()
    }

    /// The keys held (`parked::held_keys`): those with parked events not yet published, and those of
    /// [`State::table_holds`].
    fn held_keys(&self, only_parked: bool) -> BTreeSet<char> {
        self.parked
            .iter()
            .filter(|p| !p.published)
            .map(|p| p.event.key())
            .chain(self.table_holds(only_parked))
            .collect()
    }

    /// Whether `event` waits, parked, for its broken key (in the log's parked table or the table outbox).
    fn waits(&self, event: Event) -> bool {
        self.fails(event.key())
            && match event.position() {
                None => self.table[event.0] == Row::Parked,
                Some(_) => self.parked.iter().any(|p| p.event == event && !p.published),
            }
    }

    fn fails(&self, key: char) -> bool {
        self.broken && key == self.broken_key
    }

    fn reader(&self) -> Option<usize> {
        self.relays.iter().position(|r| r.session.is_some())
    }

    /// What relay `relay` sees at the fence: the schema's unpublished, unparked table rows (only its own
    /// shard's with `own_shards`).
    fn fence(&self, relay: usize, own_shards: bool) -> FenceView {
        FenceView {
            switched: self.switched,
            table_writers: false,
            unpublished_rows: TABLE.iter().enumerate().any(|(row, (_, _, shard))| {
                self.table[row] == Row::Unpublished && (!own_shards || *shard == relay)
            }),
        }
    }

    fn session(&mut self, relay: usize) -> &mut Session {
        self.relays[relay].session.as_mut().expect("a session")
    }

    /// Whether a clock is running: a pending event of a batch, or a row of a table loop, failing.
    fn time_runs(&self) -> bool {
        self.relays.iter().any(|r| {
            r.retries.contains(&Clock::Failing)
                || r.session
                    .as_ref()
                    .and_then(|session| session.batch.as_ref())
                    .is_some_and(|batch| {
                        (0..batch.clocks.len()).any(|i| {
                            batch.clocks[i] == Clock::Failing
                                && batch.events.fate(i) == Fate::Pending
                        })
                    })
        })
    }
}

impl WalModel {
    /// Whether a failure after the bound is `expired`: a broker answers (`Publisher::broker_answers`).
    fn expired(&self, s: &State) -> bool {
        !s.broker_down || self.park_during_outages
    }

    /// How a delivery in flight of `key`, whose event's clock is `clock`, is explored coming back.
    fn reports(&self, s: &State, key: char, clock: Clock) -> Vec<Report> {
        let times_out = !self.deliveries_never_time_out;
        if s.broker_down {
            // Given up after the bound; an event already past it hangs until the brokers are back (failing
            // again would only count an attempt), unless that failure parks it.
            let again = clock == Clock::Overdue && self.park_during_outages;
            return [Report::TimedOut]
                .into_iter()
                .filter(|_| times_out && (matches!(clock, Clock::Fresh | Clock::Failing) || again))
                .collect();
        }
        if !s.fails(key) {
            return vec![Report::Acked];
        }
        match (s.hangs, clock) {
            (_, Clock::Spent) => vec![],
            (true, _) => [Report::TimedOut]
                .into_iter()
                .filter(|_| times_out)
                .collect(),
            (false, Clock::Fresh | Clock::Overdue) => vec![Report::Failed],
            (false, Clock::Failing) => vec![],
        }
    }

    /// Whether a table loop is explored failing to publish a row of `key` whose clock is `clock`.
    fn row_may_fail(&self, s: &State, key: char, clock: Clock) -> bool {
        let comes_back = !self.deliveries_never_time_out;
        if s.broker_down {
            comes_back
                && (clock == Clock::Fresh || (clock == Clock::Overdue && self.park_during_outages))
        } else {
            s.fails(key)
                && (comes_back || !s.hangs)
                && matches!(clock, Clock::Fresh | Clock::Overdue)
        }
    }

    /// Whether nothing is left to do in `s` but what may never happen (deaths, joins, the cause going
    /// away, an outage, the operator letting a row go while its key is broken), with every relay up.
    fn at_rest(&self, s: &State) -> bool {
        let mut next = Vec::new();
        self.actions(s, &mut next);
        s.relays.iter().all(|r| r.up)
            && next.iter().all(|a| {
                matches!(
                    a,
                    Step::Dies(_) | Step::Join(_) | Step::CauseGone | Step::BrokerDown
                ) || matches!(a, Step::UnparkRow(row) if s.fails(row.key()))
            })
    }
}

impl Model for WalModel {
    type State = State;
    type Action = Step;

    fn init_states(&self) -> Vec<State> {
        WORLDS
            .into_iter()
            .map(|world| State {
                table: [if world.rows_published {
                    Row::Published
                } else {
                    Row::Unpublished
                }; TABLE.len()],
                switched: false,
                parked: Vec::new(),
                confirmed: 0,
                topic: (0..TABLE.len())
                    .map(Event)
                    .filter(|_| world.rows_published)
                    .collect(),
                broken_key: world.broken_key,
                broken: true,
                hangs: world.hangs,
                broker_down: false,
                outages: world.outages,
                relays: std::array::from_fn(|_| Relay::default()),
                deaths: world.deaths,
                readers: [false; RELAYS],
                parked_again: false,
            })
            .collect()
    }

    fn actions(&self, s: &State, actions: &mut Vec<Step>) {
        let only_parked = self.hold_only_parked_table_rows;
        for r in 0..RELAYS {
            let relay = &s.relays[r];
            if !relay.up {
                actions.push(Step::Join(r));
                continue;
            }
            for (row, (_, key, shard)) in TABLE.iter().enumerate() {
                if *shard != r || s.table[row] != Row::Unpublished {
                    continue;
                }
                if !s.broker_down && !s.fails(*key) {
                    actions.push(Step::PublishRow {
                        relay: r,
                        row: Event(row),
                    });
                }
                if self.row_may_fail(s, *key, relay.retries[row]) {
                    actions.push(Step::RowFails {
                        relay: r,
                        row: Event(row),
                    });
                }
            }
            match &relay.session {
                None => {
                    if s.reader().is_none() && may_read_slot(&s.fence(r, self.fence_on_own_shards))
                    {
                        actions.push(Step::Connect(r));
                    }
                }
                Some(session) => {
                    if session.applied > s.confirmed {
                        actions.push(Step::Confirm(r));
                    }
                    let read =
                        session.applied + session.batch.as_ref().map_or(0, |b| b.events.len());
                    match &session.batch {
                        None => {
                            if read < LOG.len() {
                                actions.push(Step::Read {
                                    relay: r,
                                    event: Event::logged(read),
                                });
                            }
                            let rows = s.table_holds(only_parked);
                            if !s.broker_down
                                && s.parked.iter().any(|p| {
                                    let key = p.event.key();
                                    !p.published && !s.fails(key) && !rows.contains(&key)
                                })
                            {
                                actions.push(Step::Release(r));
                            }
                        }
                        Some(batch) => {
                            if !batch.sealed && read < LOG.len() {
                                actions.push(Step::Read {
                                    relay: r,
                                    event: Event::logged(read),
                                });
                            }
                            match &batch.round {
                                None => actions.push(Step::Settle(r)),
                                Some(round) => {
                                    for &i in &round.in_flight {
                                        let event = Event::logged(session.applied + i);
                                        for report in
                                            self.reports(s, *batch.events.key(i), batch.clocks[i])
                                        {
                                            actions.push(Step::Deliver {
                                                relay: r,
                                                event,
                                                report,
                                            });
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            if s.deaths > 0 {
                actions.push(Step::Dies(r));
            }
        }
        for row in 0..TABLE.len() {
            if s.table[row] == Row::Parked {
                actions.push(Step::UnparkRow(Event(row)));
            }
        }
        if s.time_runs() {
            actions.push(Step::TimePasses);
        }
        if s.broken {
            actions.push(Step::CauseGone);
        }
        if s.broker_down {
            actions.push(Step::BrokerBack);
        } else if s.outages > 0 {
            actions.push(Step::BrokerDown);
        }
    }

    fn next_state(&self, last: &State, step: Step) -> Option<State> {
        let mut s = last.clone();
        let only_parked = self.hold_only_parked_table_rows;
        match step {
            Step::Join(r) => s.relays[r].up = true,
            Step::Dies(r) => {
                s.deaths -= 1;
                s.relays[r] = Relay::default();
            }
            Step::PublishRow { relay, row } => {
                s.topic.push(row);
                s.table[row.0] = Row::Published;
                s.relays[relay].retries[row.0] = Clock::Fresh;
            }
            Step::RowFails { relay, row } => {
                // `store::record_failure(.., park_now)`: `park_now` once `Retries::failing_for` reached the
                // bound and a broker answers.
                let clock = &mut s.relays[relay].retries[row.0];
                if *clock == Clock::Fresh {
                    *clock = Clock::Failing;
                } else if !self.table_rows_never_park_beside_the_log && self.expired(last) {
                    *clock = Clock::Fresh;
                    s.table[row.0] = Row::Parked;
                } else {
                    *clock = Clock::Spent;
                }
            }
            Step::UnparkRow(row) => s.table[row.0] = Row::Unpublished,
            Step::Connect(r) => {
                // `fence::pass` records the switch; `stream` starts with the keys held in the database.
                s.switched = true;
                s.readers[r] = true;
                let mut holds = Holds::default();
                holds.reset(s.held_keys(only_parked));
                s.relays[r].session = Some(Session {
                    holds,
                    applied: s.confirmed,
                    batch: None,
                });
            }
            Step::Read { relay, event } => {
                let retry_until_acked = self.retry_until_acked;
                let session = s.session(relay);
                let batch = session.batch.get_or_insert_with(|| Batch {
                    events: if retry_until_acked {
                        WalBatch::retrying_until_acked(PARK_AFTER)
                    } else {
                        WalBatch::new(PARK_AFTER)
                    },
                    clocks: Vec::new(),
                    sealed: false,
                    round: None,
                });
                batch.events.push(event.key(), &session.holds);
                batch.clocks.push(Clock::Fresh);
            }
            Step::Settle(r) => {
                let session = s.relays[r].session.as_mut().expect("a session");
                let batch = session.batch.as_mut().expect("a batch");
                let to_park = batch.events.to_park();
                if !to_park.is_empty() {
                    // `parked::park`: in order, each once by its place in the log.
                    for i in to_park {
                        let event = Event::logged(session.applied + i);
                        if s.parked.iter().any(|p| p.event == event) {
                            s.parked_again = true;
                        } else {
                            s.parked.push(Parked {
                                event,
                                published: false,
                            });
                        }
                    }
                    batch.events.parked();
                }
                let pending = batch.events.pending();
                if pending.is_empty() {
                    // Settled: `batch.clear()`, and the position moves past it (`update_applied_lsn`).
                    session.applied += batch.events.len();
                    session.batch = None;
                } else {
                    batch.sealed = true;
                    let mut order = KeyOrder::new();
                    let in_flight = pending
                        .iter()
                        .enumerate()
                        .filter(|(index, i)| order.offer(*index, *batch.events.key(**i)))
                        .map(|(_, i)| *i)
                        .collect();
                    batch.round = Some(Round {
                        pending,
                        order,
                        in_flight,
                    });
                }
            }
            Step::Deliver {
                relay,
                event,
                report,
            } => {
                let expired = self.expired(last);
                let session = s.relays[relay].session.as_mut().expect("a session");
                let i = event.position().expect("a logged event") - session.applied;
                let batch = session.batch.as_mut().expect("a batch");
                let round = batch.round.as_mut().expect("a round");
                round.in_flight.retain(|x| *x != i);
                let key = event.key();
                if report == Report::Acked {
                    s.topic.push(event);
                    batch.events.acked(i);
                    if let Some(next) = round.order.acked(&key) {
                        round.in_flight.push(round.pending[next]);
                    }
                } else {
                    round.order.failed(&key);
                    // `settle`: the bound runs from the send of the attempt of the event's first failure; a
                    // delivery given up has hung for the bound since its send.
                    let clock = &mut batch.clocks[i];
                    let overdue = report == Report::TimedOut || *clock == Clock::Overdue;
                    let failure = Failure {
                        refused: false,
                        expired: overdue && expired,
                    };
                    *clock = match (overdue, last.broker_down) {
                        (false, _) => Clock::Failing,
                        (true, true) => Clock::Overdue,
                        (true, false) => Clock::Spent,
                    };
                    batch.events.failed(i, failure, &mut session.holds);
                }
                if round.in_flight.is_empty() {
                    batch.round = None;
                }
            }
            Step::TimePasses => {
                for relay in &mut s.relays {
                    for clock in &mut relay.retries {
                        if *clock == Clock::Failing {
                            *clock = Clock::Overdue;
                        }
                    }
                    let session = relay.session.as_mut();
                    if let Some(batch) = session.and_then(|session| session.batch.as_mut()) {
                        for clock in &mut batch.clocks {
                            if *clock == Clock::Failing {
                                *clock = Clock::Overdue;
                            }
                        }
                    }
                }
            }
            Step::Confirm(r) => s.confirmed = s.session(r).applied,
            Step::Release(r) => {
                // `parked::due`: every open parked event of a key no row of the table outbox holds, in id
                // order; published one per key at a time.
                let rows = s.table_holds(only_parked);
                let open: Vec<usize> = (0..s.parked.len())
                    .filter(|p| {
                        !s.parked[*p].published && !rows.contains(&s.parked[*p].event.key())
                    })
                    .collect();
                let mut order = KeyOrder::new();
                let mut sent: VecDeque<usize> = (0..open.len())
                    .filter(|index| order.offer(*index, s.parked[open[*index]].event.key()))
                    .collect();
                while let Some(index) = sent.pop_front() {
                    let parked = &mut s.parked[open[index]];
                    let key = parked.event.key();
                    if s.broken && key == s.broken_key {
                        // `parked::failed_again`: its key waits.
                        order.failed(&key);
                    } else {
                        s.topic.push(parked.event);
                        parked.published = true;
                        sent.extend(order.acked(&key));
                    }
                }
                let held = s.held_keys(only_parked);
                s.session(r).holds.reset(held);
            }
            Step::CauseGone => s.broken = false,
            Step::BrokerDown => {
                s.outages -= 1;
                s.broker_down = true;
            }
            Step::BrokerBack => s.broker_down = false,
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(IN_ORDER, |_, s: &State| {
                let first = |event: usize| s.topic.iter().position(|t| t.0 == event);
                (0..EVENTS).all(|later| {
                    (0..later)
                        .filter(|earlier| Event(*earlier).key() == Event(later).key())
                        .all(|earlier| match (first(earlier), first(later)) {
                            (_, None) => true,
                            (Some(e), Some(l)) => e < l,
                            (None, Some(_)) => false,
                        })
                })
            }),
            Property::always(CONFIRMED_SETTLED, |_, s: &State| {
                (0..s.confirmed)
                    .map(Event::logged)
                    .all(|e| s.on_topic(e) || s.is_parked(e))
            }),
            Property::always(NOTHING_LOST, |model: &Self, s: &State| {
                !model.at_rest(s) || (0..EVENTS).map(Event).all(|e| s.on_topic(e) || s.waits(e))
            }),
            Property::always(OTHERS_GO_ON, |model: &Self, s: &State| {
                !model.at_rest(s)
                    || (0..EVENTS)
                        .map(Event)
                        .filter(|e| e.key() != s.broken_key)
                        .all(|e| s.on_topic(e))
            }),
            Property::always(PARKED_ONCE, |_, s: &State| {
                s.parked.iter().all(|p| p.event.key() == s.broken_key)
                    && (0..TABLE.len())
                        .filter(|row| s.table[*row] == Row::Parked)
                        .all(|row| Event(row).key() == s.broken_key)
                    && s.parked
                        .iter()
                        .map(|p| p.event)
                        .collect::<BTreeSet<_>>()
                        .len()
                        == s.parked.len()
            }),
            Property::always(HOLDS_MATCH, |model: &Self, s: &State| {
                s.relays
                    .iter()
                    .filter_map(|r| r.session.as_ref())
                    .filter(|session| session.batch.is_none())
                    .all(|session| {
                        s.held_keys(model.hold_only_parked_table_rows)
                            .iter()
                            .all(|key| session.holds.keys().any(|held| held == key))
                    })
            }),
            Property::sometimes("a relay passes the fence", |_, s: &State| s.switched),
            Property::sometimes(
                "the standby takes over the slot after the reader dies",
                |_, s: &State| s.readers.iter().all(|r| *r),
            ),
            Property::sometimes("a parked event is released to the topic", |_, s: &State| {
                s.parked.iter().any(|p| p.published)
            }),
            Property::sometimes(
                "a relay reading parked events again parks nothing twice",
                |_, s: &State| s.parked_again,
            ),
            Property::sometimes(
                "every event reaches the topic after a takeover and a release",
                |_, s: &State| {
                    s.readers.iter().all(|r| *r)
                        && s.parked.iter().any(|p| p.published)
                        && s.all_on_topic()
                },
            ),
            // `b1` before `a1`: `a1` was not published before the switch, so it was parked for the fence to
            // let the relays read the slot, and published after the operator let it go.
            Property::sometimes(
                "a table row failing before the switch is parked, and every event reaches the topic once \
                 the operator lets it go",
                |_, s: &State| {
                    let at = |name| s.topic.iter().position(|e| e.name() == name);
                    s.broken_key == 'a' && s.all_on_topic() && at("b1") < at("a1")
                },
            ),
            // Key `b` has no table row: its events are parked only when its deliveries are given up.
            Property::sometimes(
                "a delivery that hangs is given up after the bound and parked, and every event reaches the \
                 topic",
                |_, s: &State| {
                    s.hangs && s.broken_key == 'b' && !s.parked.is_empty() && s.all_on_topic()
                },
            ),
            Property::sometimes(
                "every event reaches the topic in a run with an outage, after the switch",
                |_, s: &State| s.outages == 0 && s.switched && s.all_on_topic(),
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use stateright::{Checker, HasDiscoveries};

    use super::*;

    /// The depth explored: `SAGA_MODEL_DEPTH` steps, or the default, which CI runs.
    fn depth() -> usize {
        std::env::var("SAGA_MODEL_DEPTH")
            .ok()
            .and_then(|d| d.parse().ok())
            .unwrap_or(DEPTH)
    }

    /// Checks `model` one step deeper at a time until `property` is found to fail, and prints the
    /// shortest path to it (the checker keeps the last failing path it visits, not the first).
    fn counterexample(model: WalModel, property: &'static str) {
        let started = Instant::now();
        let mut states = 0;
        for depth in 1..=depth() {
            let checker = model
                .checker()
                .target_max_depth(depth)
                .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])))
                .spawn_bfs()
                .join();
            states += checker.state_count();
            if let Some(path) = checker.discovery(property) {
                let topic = path.last_state().topic.clone();
                let (states_on_path, steps): (Vec<State>, Vec<Option<Step>>) =
                    path.into_vec().into_iter().unzip();
                let first = &states_on_path[0];
                let steps: Vec<Step> = steps.into_iter().flatten().collect();
                println!(
                    "{model:?}: {states} states in all, {:?}\ncounterexample ({} steps; key {:?} broken, \
                     hangs {}, table {:?}, deaths {}, outages {}): {steps:?}\ntopic: {topic:?}",
                    started.elapsed(),
                    steps.len(),
                    first.broken_key,
                    first.hangs,
                    first.table,
                    first.deaths,
                    first.outages,
                );
                return;
            }
        }
        panic!("no counterexample to {property:?} within {} steps", depth());
    }

    #[test]
    fn the_wal_relays_protocol_holds_in_every_interleaving() {
        let started = Instant::now();
        let checker = WalModel::default()
            .checker()
            .target_max_depth(depth())
            .spawn_bfs()
            .join();
        println!(
            "WAL relay model: {} states ({} unique), depth {}, {:?}",
            checker.state_count(),
            checker.unique_state_count(),
            checker.max_depth(),
            started.elapsed()
        );
        checker.assert_properties();
        assert!(
            checker.max_depth() < depth(),
            "every state explored: the longest path is shorter than the depth"
        );
    }

    #[test]
    fn retrying_the_whole_batch_until_acked_is_found_to_stop_other_keys() {
        counterexample(
            WalModel {
                retry_until_acked: true,
                ..WalModel::default()
            },
            OTHERS_GO_ON,
        );
    }

    /// As the code was then, when only parked table rows held their key. (Now that every unpublished row
    /// holds its key, a relay reading the log early parks the key's events behind the row instead: a fence
    /// on a relay's own shards alone is found to break only "parked once, and only the broken key's".)
    #[test]
    fn a_fence_on_a_relays_own_shards_is_found_to_reorder_a_key() {
        counterexample(
            WalModel {
                fence_on_own_shards: true,
                hold_only_parked_table_rows: true,
                ..WalModel::default()
            },
            IN_ORDER,
        );
    }

    /// A parked table row held its key in the WAL relay only while it was parked: once the operator cleared
    /// its `parked_at`, the release published the key's parked events (and the reader its later ones)
    /// before the table loop published the row.
    #[test]
    fn holding_only_parked_table_rows_is_found_to_let_a_keys_events_overtake_its_row() {
        counterexample(
            WalModel {
                hold_only_parked_table_rows: true,
                ..WalModel::default()
            },
            IN_ORDER,
        );
    }

    /// `expired` is looked at only when a failure is reported, and a producer with `message.timeout.ms=0`
    /// reports none for a delivery it retries forever (a partition without a leader): the batch never
    /// settles and the slot stops, or the table row never fails and the fence stays shut, for every key.
    #[test]
    fn deliveries_that_never_time_out_are_found_to_stop_other_keys() {
        counterexample(
            WalModel {
                deliveries_never_time_out: true,
                ..WalModel::default()
            },
            OTHERS_GO_ON,
        );
    }

    /// The table loop retried a row that fails (not refused for good) forever, and the fence waits for
    /// every unparked row: the log was never read, for any key.
    #[test]
    fn a_table_row_that_never_parks_beside_the_log_is_found_to_stop_other_keys() {
        counterexample(
            WalModel {
                table_rows_never_park_beside_the_log: true,
                ..WalModel::default()
            },
            OTHERS_GO_ON,
        );
    }

    /// Every delivery of a round in flight when the brokers stop answering is given up after the bound:
    /// judged by time alone, each is `expired`, and every key it catches is parked.
    #[test]
    fn parking_during_an_outage_is_found_to_park_healthy_keys() {
        counterexample(
            WalModel {
                park_during_outages: true,
                ..WalModel::default()
            },
            PARKED_ONCE,
        );
    }
}
