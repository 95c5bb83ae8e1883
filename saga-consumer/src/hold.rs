//! Per-key order through failures: held keys, parked messages, their release in order, and paused steps.
//!
//! Under [`OrderPolicy::HoldKey`], a message dead-lettered holds its key for the consumer group: the hold is
//! recorded in the transaction that indexes the dead letter, before the offset moves. Every later message of
//! a held key, on any partition the group reads, is **parked** in `saga_parked_messages` (in arrival order)
//! instead of run, and the partition goes on with other keys. A message of a paused step (`saga steps
//! pause`) holds its key the same way.
//!
//! A held key is **released** when its head letter is replayed and succeeds (the consumer recognises the
//! replay by its `saga-replay-letter` header), when the head is discarded, or when its paused step resumes.
//! Its parked messages then go back through the group's retry topic **one at a time**: the releaser sends
//! the first, the consumer runs it like any message (step key, retries, dead letters), and only the
//! transaction that records it done lets the releaser send the next. New messages of the key queue behind
//! them; the key is let go in the transaction that finishes its last parked message, so a new message either
//! parks before that or runs after it. A released message that fails for good becomes the key's new head.
//!
//! Parked messages are kept in a table rather than in the dead-letter topic: the hold, the queue and each
//! release step are then changed in one PostgreSQL transaction, the queue's order and length are read
//! without reading a topic, and caps are counted exactly.
//!
//! The decisions ([`classify`], [`decide_park`], [`on_dead_letter`], [`advance`], [`next_release`]) are pure
//! functions of what the store says, shared by the store's code below and the model (`hold_model`).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use rdkafka::producer::FutureProducer;
use saga_core::{Origin, RawMessage};
use saga_runtime::replay;
use sqlx::{PgConnection, PgPool, Row};
use tokio_util::sync::CancellationToken;

/// What a dead letter does to the later messages of its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OrderPolicy {
    /// The message is dead-lettered and the key's later messages run (the default): nothing stops, and a
    /// replay later runs the letter after them.
    #[default]
    SkipAndContinue,
    /// The message is dead-lettered and its key is held: the key's later messages are parked, in order,
    /// until the letter is replayed and succeeds, or is discarded; then they run in their order.
    HoldKey,
}

/// Bounds on what a consumer group parks, and when a held key is overdue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HoldLimits {
    /// Most parked messages of one key: past it, a message is dead-lettered (`hold-queue-full`).
    pub per_key: i64,
    /// Most parked messages of the group, all keys together: past it, the same.
    pub per_group: i64,
    /// A key held longer than this counts in `saga_consumer_held_keys_overdue`.
    pub alert_after: Duration,
}

/// A message's delayed retry: the attempts it made, how long until its next, and its last error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DelayedRetry<'a> {
    pub attempts: i32,
    pub wait: Duration,
    pub error: &'a str,
}

impl DelayedRetry<'_> {
    fn wait_ms(&self) -> i64 {
        i64::try_from(self.wait.as_millis()).unwrap_or(i64::MAX)
    }
}

/// A held key's state (`saga_held_keys.state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HoldState {
    /// Nothing of it runs.
    Held,
    /// Its parked messages run one at a time, in order.
    Releasing,
}

impl HoldState {
    /// The state's name in the table.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Held => "held",
            Self::Releasing => "releasing",
        }
    }

    /// The state named `text`; a name this version does not know is an error, never another state.
    pub fn parse(text: &str) -> Result<Self, UnknownHold> {
        [Self::Held, Self::Releasing]
            .into_iter()
            .find(|s| s.as_str() == text)
            .ok_or_else(|| UnknownHold::new("state", text))
    }
}

/// Why a key is held (`saga_held_keys.cause`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HoldCause {
    /// A dead letter of the key, at the head of its queue.
    DeadLetter,
    /// A paused step's message of the key.
    Paused,
    /// A message of the key failed transiently and waits, parked at the key's head, for its next attempt
    /// (delayed retries, `SAGA_RETRY_DELAYED`).
    Retrying,
}

impl HoldCause {
    /// The cause's name in the table.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::DeadLetter => "dead-letter",
            Self::Paused => "paused",
            Self::Retrying => "retrying",
        }
    }

    /// The cause named `text`; a name this version does not know is an error.
    pub fn parse(text: &str) -> Result<Self, UnknownHold> {
        [Self::DeadLetter, Self::Paused, Self::Retrying]
            .into_iter()
            .find(|c| c.as_str() == text)
            .ok_or_else(|| UnknownHold::new("cause", text))
    }
}

/// A held key's row names a state or cause this version does not know (a newer consumer wrote it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a held key's {what} is {value:?}, which this version does not know")]
pub struct UnknownHold {
    what: &'static str,
    value: String,
}

impl UnknownHold {
    fn new(what: &'static str, value: &str) -> Self {
        Self {
            what,
            value: value.chars().take(64).collect(),
        }
    }
}

/// The states and causes as the statements name them: one source, [`HoldState::as_str`] and
/// [`HoldCause::as_str`].
const HELD: &str = HoldState::Held.as_str();
const RELEASING: &str = HoldState::Releasing.as_str();
const DEAD_LETTER: &str = HoldCause::DeadLetter.as_str();
const PAUSED: &str = HoldCause::Paused.as_str();
const RETRYING: &str = HoldCause::Retrying.as_str();

/// What the store says of a held key, as the decisions need it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct HeldView {
    pub state: HoldState,
    /// The identity of the dead letter at its head, if a dead letter holds it.
    pub head_letter: Option<String>,
    /// Where the message at its head was first consumed: a plain redelivery of it is stale.
    pub head_origin: Option<Origin>,
    /// The first parked message: its sequence number, where it was first consumed, and its [`digest`].
    pub first: Option<(i64, Origin, String)>,
    /// How many are parked.
    pub parked: i64,
    /// The parked message last sent for release.
    pub in_flight: Option<i64>,
    /// Whether it is held for a delayed retry alone (cause `retrying`: no letter heads it, no step's pause).
    pub retrying: bool,
    /// Whether the first parked message is due (a delayed retry's time has come, or it has none).
    pub first_due: bool,
    /// The attempts the first parked message made (a delayed retry's; none for one parked behind a hold).
    pub first_attempts: u32,
}

/// What a message says of itself (only a message on the group's retry topic can say anything).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Mark {
    /// A message like any other.
    Plain,
    /// A replay of the dead letter of this identity.
    Replay(String),
    /// A release of parked message `seq`, first consumed at `origin`, of this [`digest`].
    Release {
        seq: i64,
        origin: Origin,
        digest: String,
    },
}

/// What the consumer does with a message, given its key's hold.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub(crate) enum Role {
    /// Its key is not held: it runs.
    #[default]
    Free,
    /// Its key is held: it is parked behind the key's queue.
    Park,
    /// The replay of its held key's head letter (of this identity): it runs, and its success releases the key.
    Head(String),
    /// The release of parked message `seq`, the first of its key's queue: it runs, and its success sends
    /// the next.
    Release(i64),
    /// A copy of a release that already ran (or a release out of turn): nothing runs; the parked message,
    /// if still parked, is sent again in its turn.
    Stale,
}

/// What the consumer does with a message of key view `view` (none: not held), marked `mark`, first
/// consumed at `origin`, whose step is paused or not.
pub(crate) fn classify(
    view: Option<&HeldView>,
    mark: &Mark,
    origin: &Origin,
    paused: bool,
) -> Role {
    match (mark, view) {
        (
            Mark::Release {
                seq,
                origin,
                digest,
            },
            Some(v),
        ) if v.state == HoldState::Releasing
            && !paused
            && v.in_flight == Some(*seq)
            && v.first
                .as_ref()
                .is_some_and(|(s, o, d)| s == seq && o == origin && d == digest) =>
        {
            Role::Release(*seq)
        }
        (Mark::Release { .. }, _) => Role::Stale,
        (Mark::Replay(letter), Some(v))
            if v.state == HoldState::Held && v.head_letter.as_deref() == Some(letter) =>
        {
            Role::Head(letter.clone())
        }
        // The head letter's own message again (its offset was not committed when it was dead-lettered): it
        // is the letter's to run, by a replay; parked behind its own key, a discard would run it.
        (Mark::Plain, Some(v)) if v.head_origin.as_ref() == Some(origin) => Role::Stale,
        (_, Some(_)) => Role::Park,
        (_, None) if paused => Role::Park,
        (_, None) => Role::Free,
    }
}

/// What parking a message does.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum ParkDecision {
    /// Appended to its key's queue.
    Append,
    /// Its key is held now (its step is paused), with it as the first of the queue.
    Create,
    /// Its key is no longer held (its queue was released meanwhile), nor its step paused: it runs.
    NotHeld,
    /// A cap is reached: it is dead-lettered (`hold-queue-full`) instead, saying which.
    Full(Cap),
}

/// The cap on parked messages a message met.
#[derive(Debug, Clone, PartialEq, Eq, Hash, thiserror::Error)]
pub(crate) enum Cap {
    /// Its key's (`SAGA_HOLD_MAX_PARKED_PER_KEY`), with this many parked.
    #[error(
        "its key is held and {0} messages of it are parked already (SAGA_HOLD_MAX_PARKED_PER_KEY)"
    )]
    PerKey(i64),
    /// The group's (`SAGA_HOLD_MAX_PARKED`), with this many parked.
    #[error("its key is held and the group has {0} messages parked already (SAGA_HOLD_MAX_PARKED)")]
    PerGroup(i64),
}

/// Whether a message of key view `view` (read under the key's lock), of a step paused or not, is parked,
/// with `group_parked` messages parked in the group already.
pub(crate) fn decide_park(
    view: Option<&HeldView>,
    paused: bool,
    group_parked: i64,
    limits: &HoldLimits,
) -> ParkDecision {
    if view.is_none() && !paused {
        return ParkDecision::NotHeld;
    }
    let parked = view.map_or(0, |v| v.parked);
    if parked >= limits.per_key {
        return ParkDecision::Full(Cap::PerKey(parked));
    }
    if group_parked >= limits.per_group {
        return ParkDecision::Full(Cap::PerGroup(group_parked));
    }
    if view.is_some() {
        ParkDecision::Append
    } else {
        ParkDecision::Create
    }
}

/// What a delayed retry of a message (its transient failure, attempts left) does.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum DeferDecision {
    /// Its key is held now (cause `retrying`), with it parked at the head until it is due.
    Create,
    /// Its key was held meanwhile (from another partition or topic): it is parked behind the queue, due as
    /// it says when its turn comes.
    Append,
    /// It is parked message `seq`, released and failed again: parked again, due later.
    Reschedule(i64),
    /// It cannot wait parked (the head of a held key, a copy out of turn, or a cap reached): it is retried
    /// where it stands, as without delayed retries.
    Refused,
}

/// Whether a message of role `role` that failed transiently, its key's view being `view` (read under the
/// key's lock), waits parked for its next attempt, with `group_parked` messages parked in the group.
pub(crate) fn decide_defer(
    view: Option<&HeldView>,
    role: &Role,
    group_parked: i64,
    limits: &HoldLimits,
) -> DeferDecision {
    match (role, view) {
        (Role::Release(seq), Some(v))
            if v.state == HoldState::Releasing
                && v.in_flight == Some(*seq)
                && v.first.as_ref().is_some_and(|(s, _, _)| s == seq) =>
        {
            DeferDecision::Reschedule(*seq)
        }
        (Role::Free, view) => match decide_park(view, true, group_parked, limits) {
            ParkDecision::Append => DeferDecision::Append,
            ParkDecision::Create => DeferDecision::Create,
            ParkDecision::NotHeld | ParkDecision::Full(_) => DeferDecision::Refused,
        },
        _ => DeferDecision::Refused,
    }
}

/// What a dead letter does to its key's hold.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum OnDeadLetter {
    /// Nothing.
    Nothing,
    /// The key is held now, with the letter at its head.
    Hold,
    /// The letter is the key's new head (the key held again); `drop_seq`, the released message it is, leaves
    /// the queue.
    ReHead { drop_seq: Option<i64> },
    /// The key is held behind another letter already (it was held after this message was read, from
    /// another partition or topic): the message joins the key's queue, to run again in its turn. Its letter
    /// stays in the dead-letter topic for the record; replayed, it finds its step key done or parks.
    Queue,
    /// Released message `seq` of a key held for its delayed retries, its attempts spent, under a policy that
    /// does not hold keys: it leaves the queue (its letter is in the dead-letter topic), and the key's
    /// release goes on with the next, or the key is let go.
    Drop(i64),
}

/// What dead-lettering a message of role `role` does, its key's view being `view`, under a policy that
/// `holds` or not; a keyless message holds nothing.
pub(crate) fn on_dead_letter(
    view: Option<&HeldView>,
    role: &Role,
    holds: bool,
    keyed: bool,
) -> OnDeadLetter {
    match (role, view) {
        // Under a policy that holds nothing, a released message that fails for good leaves its queue when
        // it is a delayed retry (it made attempts), or its key is held for delayed retries alone: a policy
        // that holds nothing does not start holding a key because retries were delayed.
        (Role::Release(seq), Some(v))
            if !holds
                && (v.first_attempts > 0 || v.retrying)
                && v.first.as_ref().is_some_and(|(s, _, _)| s == seq) =>
        {
            OnDeadLetter::Drop(*seq)
        }
        (Role::Release(seq), Some(_)) => OnDeadLetter::ReHead {
            drop_seq: Some(*seq),
        },
        (Role::Release(_), None) => OnDeadLetter::Hold,
        (Role::Head(_), Some(_)) => OnDeadLetter::ReHead { drop_seq: None },
        (Role::Head(_), None) => OnDeadLetter::Hold,
        (Role::Free, None) if holds && keyed => OnDeadLetter::Hold,
        // Held by a pause meanwhile: the letter becomes the head, to be replayed before the rest.
        (Role::Free, Some(v)) if holds && keyed && v.head_letter.is_none() => {
            OnDeadLetter::ReHead { drop_seq: None }
        }
        (Role::Free, Some(_)) if holds && keyed => OnDeadLetter::Queue,
        _ => OnDeadLetter::Nothing,
    }
}

/// What finishing a message of role `role` (committed, or found done) does to its key's hold.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Advance {
    /// Nothing (not a release, or already advanced).
    Nothing,
    /// The head succeeded: the key's queue is released.
    Release,
    /// The head succeeded and nothing is parked: the key is let go.
    LetGo,
    /// Released message `seq` is done: it leaves the queue, and the next may be sent.
    Next(i64),
    /// Released message `seq`, the last parked, is done: it leaves the queue and the key is let go.
    Last(i64),
}

/// See [`Advance`].
pub(crate) fn advance(view: Option<&HeldView>, role: &Role) -> Advance {
    match (role, view) {
        (Role::Head(letter), Some(v))
            if v.state == HoldState::Held && v.head_letter.as_deref() == Some(letter) =>
        {
            if v.parked == 0 {
                Advance::LetGo
            } else {
                Advance::Release
            }
        }
        (Role::Release(seq), Some(v)) if v.first.as_ref().is_some_and(|(s, _, _)| s == seq) => {
            // Only a key still releasing is let go with its last message: one a dead letter heads again
            // meanwhile (a message of it dead-lettered under hold-key while this one ran) stays held.
            if v.parked <= 1 && v.state == HoldState::Releasing {
                Advance::Last(*seq)
            } else {
                Advance::Next(*seq)
            }
        }
        _ => Advance::Nothing,
    }
}

/// What the releaser does for a key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum ReleaseStep {
    /// Nothing now: held, its release in flight, or its first message's step paused.
    Wait,
    /// Sends parked message `seq` (the first) to the retry topic.
    Send(i64),
    /// Releasing with nothing parked: the key is let go.
    LetGo,
}

/// The releaser's decision for a key of view `view`: the first parked message is sent when none is in flight
/// (or the one in flight is due to be sent again, `resend_due`), unless its step is paused.
pub(crate) fn next_release(view: &HeldView, resend_due: bool, first_paused: bool) -> ReleaseStep {
    if view.state != HoldState::Releasing {
        return ReleaseStep::Wait;
    }
    match &view.first {
        None => ReleaseStep::LetGo,
        Some(_) if first_paused || !view.first_due => ReleaseStep::Wait,
        Some((seq, _, _)) if view.in_flight != Some(*seq) || resend_due => ReleaseStep::Send(*seq),
        Some(_) => ReleaseStep::Wait,
    }
}

// ---------------------------------------------------------------------------------------------------------
// The store.

/// The consumer group's holds: what the executor and the releaser share.
#[derive(Clone)]
pub(crate) struct Holds {
    pub group: String,
    pub limits: HoldLimits,
    /// Policies by step name, then by consumed topic; the default is [`OrderPolicy::SkipAndContinue`].
    pub by_step: HashMap<String, OrderPolicy>,
    pub by_topic: HashMap<String, OrderPolicy>,
    /// Wakes the releaser (a key's release may go on).
    pub kick: std::sync::Arc<tokio::sync::Notify>,
    /// Whether a batch must read its keys' holds: some policy holds keys, or the group's last census (every
    /// second) found a held key or a paused step. Without either no key can be held (only a dead letter under
    /// a hold-key policy, or a paused step's message, holds one), so the read is skipped; a pause takes
    /// effect [`PAUSE_DELAY`] after it is written, once every consumer's census counted it.
    pub active: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// When the last census ran, in milliseconds since the epoch: a census older than
    /// [`CENSUS_FRESH`] counts as "active" whatever it found (the releaser may be stalled).
    pub census_at: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// How long a census (which runs about once a second) is believed: past it, every batch reads its holds. A
/// pause takes effect [`PAUSE_DELAY`] after it is written, later than that, so that every consumer of the
/// group reads holds before any of them parks a message for it.
pub(crate) const CENSUS_FRESH: Duration = Duration::from_millis(1_500);

/// How long after `saga steps pause` a pause takes effect: later than a consumer believes its census
/// (`CENSUS_FRESH`). The pause's row says so (`saga_paused_steps.effective_at`).
pub const PAUSE_DELAY: Duration = Duration::from_secs(3);

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What the pre-pass found for a batch: each key's view, and the group's paused steps.
#[derive(Debug, Default)]
pub(crate) struct BatchHolds {
    pub views: HashMap<Vec<u8>, HeldView>,
    pub paused: HashSet<String>,
}

/// The key a message is held under: its Kafka key, or empty (keyless messages of a paused step).
pub(crate) fn key_of(raw: &RawMessage) -> &[u8] {
    raw.key.as_deref().unwrap_or_default()
}

/// The key a dead letter of the message may hold: its Kafka key, unless it has none or an empty one (both
/// are keyless: nothing orders them).
pub(crate) fn key_of_held(raw: &RawMessage) -> Option<&[u8]> {
    raw.key.as_deref().filter(|k| !k.is_empty())
}

/// What a message on the retry topic says of itself (`replayed`: it came from the retry topic).
pub(crate) fn mark_of(raw: &RawMessage, replayed_from: Option<&Origin>) -> Mark {
    let Some(origin) = replayed_from else {
        return Mark::Plain;
    };
    let text = |name| raw.headers.get_str(name).ok().flatten();
    // A replay of a letter is one, whatever else its headers say.
    if let Some(letter) = text(replay::LETTER).filter(|l| !l.is_empty()) {
        return Mark::Replay(letter.to_owned());
    }
    match text(replay::RELEASE).and_then(|s| s.parse().ok()) {
        Some(seq) => Mark::Release {
            seq,
            origin: origin.clone(),
            digest: digest(raw),
        },
        None => Mark::Plain,
    }
}

/// What a release of `raw` must carry to be taken for it: SHA-256 over its key, payload and headers (but a
/// replay's, which a release replaces), in hex. Recorded when the message is parked; a message on the retry
/// topic that names a parked message but differs from it in any of these is not its release.
pub(crate) fn digest(raw: &RawMessage) -> String {
    use sha2::{Digest as _, Sha256};
    let mut hash = Sha256::new();
    let mut field = |bytes: Option<&[u8]>| match bytes {
        None => hash.update([0u8]),
        Some(bytes) => {
            hash.update([1u8]);
            hash.update((bytes.len() as u64).to_be_bytes());
            hash.update(bytes);
        }
    };
    field(raw.key.as_deref());
    field(raw.payload.as_deref());
    for header in raw
        .headers
        .iter()
        .filter(|h| !replay::ALL.contains(&h.name.as_str()))
    {
        field(Some(header.name.as_bytes()));
        field(header.value.as_deref());
    }
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

const VIEW_COLUMNS: &str = "h.state, h.cause, h.head_letter, h.head_origin_topic, h.head_origin_partition, \
     h.head_origin_offset, h.parked, h.in_flight, f.seq, f.topic, f.\"partition\", f.\"offset\", f.digest, \
     (f.due_at IS NULL OR f.due_at <= now()) AS first_due, f.attempts AS first_attempts";
const FIRST_PARKED: &str = "LEFT JOIN LATERAL (SELECT p.seq, p.topic, p.\"partition\", p.\"offset\", p.digest, \
     p.due_at, p.attempts FROM saga_parked_messages p WHERE p.group_id = h.group_id AND p.key = h.key ORDER BY p.seq LIMIT 1) f \
     ON true";

/// Whether the first parked message of held key `h` (its [`FIRST_PARKED`] `f`) waits for a paused step.
const FIRST_PAUSED: &str = "EXISTS (SELECT 1 FROM saga_paused_steps s, saga_parked_messages p \
     WHERE p.group_id = h.group_id AND p.key = h.key AND p.seq = f.seq \
       AND s.group_id = h.group_id AND s.step = p.step AND s.effective_at <= now())";

/// How many keys group `group` is releasing whose next parked message does not wait for a paused step:
/// the releaser's work still to do (a test kit's quiet-wait counts it as busy).
pub async fn releasing_keys(pool: &PgPool, group: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM saga_held_keys h {FIRST_PARKED} \
         WHERE h.group_id = $1 AND h.state = '{RELEASING}' AND NOT {FIRST_PAUSED}"
    )))
    .bind(group)
    .fetch_one(pool)
    .await
}

fn view_of(row: &sqlx::postgres::PgRow) -> Result<HeldView, sqlx::Error> {
    let seq: Option<i64> = row.try_get("seq")?;
    let first = match seq {
        Some(seq) => Some((
            seq,
            Origin {
                topic: row.try_get("topic")?,
                partition: row.try_get("partition")?,
                offset: row.try_get("offset")?,
            },
            row.try_get("digest")?,
        )),
        None => None,
    };
    Ok(HeldView {
        state: HoldState::parse(row.try_get::<&str, _>("state")?)
            .map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
        head_letter: row.try_get("head_letter")?,
        head_origin: match (
            row.try_get::<Option<String>, _>("head_origin_topic")?,
            row.try_get::<Option<i32>, _>("head_origin_partition")?,
            row.try_get::<Option<i64>, _>("head_origin_offset")?,
        ) {
            (Some(topic), Some(partition), Some(offset)) => Some(Origin {
                topic,
                partition,
                offset,
            }),
            _ => None,
        },
        first,
        parked: row.try_get("parked")?,
        in_flight: row.try_get("in_flight")?,
        retrying: row.try_get::<&str, _>("cause")? == RETRYING,
        first_due: row.try_get::<Option<bool>, _>("first_due")?.unwrap_or(true),
        first_attempts: row
            .try_get::<Option<i32>, _>("first_attempts")?
            .map_or(0, |a| u32::try_from(a).unwrap_or(0)),
    })
}

/// What a transaction that decides on a key's hold locks first (see `Holds::lock`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyLock {
    /// The key itself (a transaction advisory lock on its bytes), held or not: every transaction on the key
    /// waits for the one before.
    Key,
    /// Only its row, which exists only while the key is held: two transactions on a key that is not held
    /// both go on (the defect the model finds: a dead letter lost from its key's order).
    #[cfg_attr(not(test), allow(dead_code))]
    RowOnly,
}

/// What `Holds::lock` takes; the model of holding keys (`hold_model.rs`) checks the same value.
pub(crate) const KEY_LOCK: KeyLock = KeyLock::Key;

impl KeyLock {
    /// Whether a transaction that takes this lock on a key (`held` or not) waits for another on the key.
    pub(crate) fn serializes(self, held: bool) -> bool {
        match self {
            Self::Key => true,
            Self::RowOnly => held,
        }
    }
}

impl Holds {
    /// Whether some policy of this consumer holds keys.
    pub(crate) fn any_policy_holds(&self) -> bool {
        self.by_step
            .values()
            .chain(self.by_topic.values())
            .any(|p| *p == OrderPolicy::HoldKey)
    }

    /// Whether a batch must read its keys' holds (see [`Holds::active`]).
    pub(crate) fn is_active(&self) -> bool {
        let census_at = self.census_at.load(std::sync::atomic::Ordering::Acquire);
        self.active.load(std::sync::atomic::Ordering::Acquire)
            || now_ms().saturating_sub(census_at) > CENSUS_FRESH.as_millis() as u64
    }

    /// The policy of a message of `step` (if routed to one) consumed from `topic`.
    pub(crate) fn policy(&self, step: Option<&str>, topic: &str) -> OrderPolicy {
        step.and_then(|s| self.by_step.get(s))
            .or_else(|| self.by_topic.get(topic))
            .copied()
            .unwrap_or_default()
    }

    /// The views of `keys` and the group's paused steps, in one statement.
    pub(crate) async fn read(
        &self,
        conn: &mut PgConnection,
        keys: &[&[u8]],
    ) -> Result<BatchHolds, sqlx::Error> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "WITH paused AS (SELECT coalesce(array_agg(step), '{{}}') AS steps FROM saga_paused_steps \
                 WHERE group_id = $1 AND effective_at <= now()) \
             SELECT paused.steps, h.key, {VIEW_COLUMNS} FROM paused \
             LEFT JOIN saga_held_keys h ON h.group_id = $1 AND h.key = ANY($2) {FIRST_PARKED}"
        )))
        .bind(&self.group)
        .bind(keys)
        .fetch_all(conn)
        .await?;
        let mut holds = BatchHolds::default();
        for row in &rows {
            if holds.paused.is_empty() {
                holds.paused = row
                    .try_get::<Vec<String>, _>("steps")?
                    .into_iter()
                    .collect();
            }
            if let Some(key) = row.try_get::<Option<Vec<u8>>, _>("key")? {
                holds.views.insert(key, view_of(row)?);
            }
        }
        Ok(holds)
    }

    /// Locks `key`'s row until `conn`'s transaction ends, as `locking` (a `FOR UPDATE` clause) says:
    /// whether it is held (and, skipping locked rows, not locked by another transaction).
    async fn lock_row(
        &self,
        conn: &mut PgConnection,
        key: &[u8],
        locking: &'static str,
    ) -> Result<bool, sqlx::Error> {
        let locked: Option<i32> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT 1 FROM saga_held_keys WHERE group_id = $1 AND key = $2 {locking}"
        )))
        .bind(&self.group)
        .bind(key)
        .fetch_optional(conn)
        .await?;
        Ok(locked.is_some())
    }

    /// The view of `key`, locked until `conn`'s transaction ends (waiting for the lock): the key itself
    /// first ([`KEY_LOCK`]), then its row, then its first parked message read.
    ///
    /// The key's lock is what makes a decision on a key that is not held safe: `FOR UPDATE` on a row that
    /// does not exist locks nothing, so two transactions (two partitions' dead letters of one key) would
    /// both find it free and both hold it, and one letter would be neither head nor queued. A
    /// transaction-scoped advisory lock on the key serializes them: the second reads, in a statement of its
    /// own (a new snapshot), what the first committed. Every transaction that decides on a key's hold
    /// (parking, a dead letter, advancing) comes through here.
    async fn lock(
        &self,
        conn: &mut PgConnection,
        key: &[u8],
    ) -> Result<Option<HeldView>, sqlx::Error> {
        // The key's own lock, where the choice serializes transactions on a key that is not held.
        if KEY_LOCK.serializes(false) {
            sqlx::query(
                "SELECT pg_advisory_xact_lock(hashtextextended('saga_held_keys'::regclass::oid::text \
                     || '/' || $1 || '/' || encode(sha256($2), 'hex'), 0))",
            )
            .bind(&self.group)
            .bind(key)
            .execute(&mut *conn)
            .await?;
        }
        if !self.lock_row(conn, key, "FOR UPDATE").await? {
            return Ok(None);
        }
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {VIEW_COLUMNS} FROM saga_held_keys h {FIRST_PARKED} \
             WHERE h.group_id = $1 AND h.key = $2"
        )))
        .bind(&self.group)
        .bind(key)
        .fetch_optional(conn)
        .await?;
        row.as_ref().map(view_of).transpose()
    }

    /// Parks `raw` (first consumed at `original`, routed to `step`) behind its key's queue, in a transaction
    /// of its own, unless its key was let go meanwhile or a cap is reached (see [`decide_park`]).
    pub(crate) async fn park(
        &self,
        conn: &mut PgConnection,
        raw: &RawMessage,
        original: &Origin,
        step: Option<&str>,
    ) -> Result<ParkDecision, sqlx::Error> {
        let key = key_of(raw);
        let mut tx = sqlx::Connection::begin(conn).await?;
        let view = self.lock(&mut tx, key).await?;
        let paused: bool = match step {
            Some(step) => sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM saga_paused_steps WHERE group_id = $1 AND step = $2 \
                 AND effective_at <= now())",
            )
            .bind(&self.group)
            .bind(step)
            .fetch_one(&mut *tx)
            .await?,
            None => false,
        };
        let group_parked: i64 = sqlx::query_scalar(
            "SELECT coalesce(sum(parked), 0)::bigint FROM saga_held_keys WHERE group_id = $1",
        )
        .bind(&self.group)
        .fetch_one(&mut *tx)
        .await?;
        let decision = decide_park(view.as_ref(), paused, group_parked, &self.limits);
        match &decision {
            ParkDecision::Create => {
                // No conflict is possible: the key's lock is held, and it was not held (`lock`). A
                // conflict here is a defect, and fails loudly rather than losing the message's place.
                sqlx::query(
                    "INSERT INTO saga_held_keys (group_id, key, cause, paused_step) VALUES ($1, $2, $3, $4)",
                )
                .bind(&self.group)
                .bind(key)
                .bind(PAUSED)
                .bind(step)
                .execute(&mut *tx)
                .await?;
                self.append(&mut tx, raw, original, step, None).await?;
            }
            ParkDecision::Append => self.append(&mut tx, raw, original, step, None).await?,
            ParkDecision::NotHeld | ParkDecision::Full(_) => {}
        }
        tx.commit().await?;
        Ok(decision)
    }

    /// Appends `raw` to its key's queue (nothing if it is parked already), with its delayed retry if it
    /// waits for one.
    async fn append(
        &self,
        tx: &mut PgConnection,
        raw: &RawMessage,
        original: &Origin,
        step: Option<&str>,
        retry: Option<&DelayedRetry<'_>>,
    ) -> Result<(), sqlx::Error> {
        let names: Vec<&str> = raw.headers.iter().map(|h| h.name.as_str()).collect();
        let values: Vec<Option<&[u8]>> = raw.headers.iter().map(|h| h.value.as_deref()).collect();
        let appended = sqlx::query(
            "INSERT INTO saga_parked_messages (group_id, key, topic, \"partition\", \"offset\", step, \
                 message_key, payload, header_names, header_values, timestamp_ms, digest, attempts, due_at, \
                 last_error) \
             SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, \
                 CASE WHEN $14::bigint IS NULL THEN NULL \
                      ELSE now() + make_interval(secs => $14::bigint / 1000.0) END, $15 \
             WHERE NOT EXISTS (SELECT 1 FROM saga_parked_messages WHERE group_id = $1 AND key = $2 \
                 AND topic = $3 AND \"partition\" = $4 AND \"offset\" = $5)",
        )
        .bind(&self.group)
        .bind(key_of(raw))
        .bind(&original.topic)
        .bind(original.partition)
        .bind(original.offset)
        .bind(step)
        .bind(raw.key.as_deref())
        .bind(raw.payload.as_deref())
        .bind(names)
        .bind(values)
        .bind(raw.timestamp_ms)
        .bind(digest(raw))
        .bind(retry.map_or(0, |r| r.attempts))
        .bind(retry.map(|r| r.wait_ms()))
        .bind(retry.map(|r| r.error))
        .execute(&mut *tx)
        .await?
        .rows_affected() as i64;
        // A redelivery of a message parked already (its offset not committed before a crash) parks nothing.
        sqlx::query(
            "UPDATE saga_held_keys SET parked = parked + $3 WHERE group_id = $1 AND key = $2",
        )
        .bind(&self.group)
        .bind(key_of(raw))
        .bind(appended)
        .execute(tx)
        .await?;
        Ok(())
    }

    /// Records in `tx` (the transaction that indexes the dead letter `letter` of `raw`) what the letter does
    /// to its key's hold (see [`on_dead_letter`]); `holds`: the message's policy holds keys.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn on_dead_letter(
        &self,
        tx: &mut PgConnection,
        raw: &RawMessage,
        original: &Origin,
        step: Option<&str>,
        role: &Role,
        holds: bool,
        letter: &crate::letters::IndexedLetter,
    ) -> Result<OnDeadLetter, sqlx::Error> {
        let key = key_of(raw);
        let view = self.lock(tx, key).await?;
        let decision = on_dead_letter(view.as_ref(), role, holds, key_of_held(raw).is_some());
        let head = |sql: &'static str| {
            sqlx::query(sql)
                .bind(&self.group)
                .bind(key)
                .bind(&letter.letter_hash)
                .bind(&letter.dlq_topic)
                .bind(letter.partition)
                .bind(letter.offset)
                .bind(&letter.fields.reason)
                .bind(HELD)
                .bind(DEAD_LETTER)
                .bind(&original.topic)
                .bind(original.partition)
                .bind(original.offset)
        };
        match &decision {
            OnDeadLetter::Nothing => {}
            OnDeadLetter::Queue => self.append(tx, raw, original, step, None).await?,
            OnDeadLetter::Drop(seq) => self.drop_released(tx, key, *seq).await?,
            OnDeadLetter::Hold => {
                // No conflict is possible: the key's lock is held, and it was not held (`lock`).
                head(
                    "INSERT INTO saga_held_keys (group_id, key, state, cause, head_letter, head_topic, \
                         head_partition, head_offset, head_reason, head_origin_topic, \
                         head_origin_partition, head_origin_offset) \
                     VALUES ($1, $2, $8, $9, $3, $4, $5, $6, $7, $10, $11, $12)",
                )
                .execute(&mut *tx)
                .await?;
            }
            OnDeadLetter::ReHead { drop_seq } => {
                if let Some(seq) = drop_seq {
                    let dropped = sqlx::query(
                        "DELETE FROM saga_parked_messages WHERE group_id = $1 AND key = $2 AND seq = $3",
                    )
                    .bind(&self.group)
                    .bind(key)
                    .bind(seq)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected() as i64;
                    sqlx::query(
                        "UPDATE saga_held_keys SET parked = parked - $3 WHERE group_id = $1 AND key = $2",
                    )
                    .bind(&self.group)
                    .bind(key)
                    .bind(dropped)
                    .execute(&mut *tx)
                    .await?;
                }
                head(
                    "UPDATE saga_held_keys SET state = $8, cause = $9, head_letter = $3, \
                         head_topic = $4, head_partition = $5, head_offset = $6, head_reason = $7, \
                         head_origin_topic = $10, head_origin_partition = $11, head_origin_offset = $12, \
                         in_flight = NULL, in_flight_at = NULL, held_at = now() \
                     WHERE group_id = $1 AND key = $2",
                )
                .execute(&mut *tx)
                .await?;
            }
        }
        Ok(decision)
    }

    /// [`OnDeadLetter::Drop`]: released message `seq` leaves its key's queue; the key is let go if nothing
    /// else is parked, else its release goes on with the next.
    async fn drop_released(
        &self,
        tx: &mut PgConnection,
        key: &[u8],
        seq: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "WITH dropped AS (DELETE FROM saga_parked_messages WHERE group_id = $1 AND key = $2 AND seq = $3 \
                 RETURNING 1) \
             UPDATE saga_held_keys SET parked = parked - (SELECT count(*) FROM dropped), \
                 in_flight_at = CASE WHEN in_flight = $3 THEN NULL ELSE in_flight_at END, \
                 in_flight = CASE WHEN in_flight = $3 THEN NULL ELSE in_flight END \
             WHERE group_id = $1 AND key = $2",
        )
        .bind(&self.group)
        .bind(key)
        .bind(seq)
        .execute(&mut *tx)
        .await?;
        // A key a dead letter heads stays held with nothing parked (its replay lets it go).
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DELETE FROM saga_held_keys WHERE group_id = $1 AND key = $2 AND parked <= 0 \
             AND state = '{RELEASING}'"
        )))
        .bind(&self.group)
        .bind(key)
        .execute(&mut *tx)
        .await?;
        self.kick.notify_one();
        Ok(())
    }

    /// Parks `raw` (first consumed at `original`, routed to `step`, of role `role`), which failed
    /// transiently, to wait for its next attempt (see [`decide_defer`]), in a transaction of its own: its
    /// key is held (cause `retrying`) until it runs again and succeeds or is dead-lettered.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn defer(
        &self,
        conn: &mut PgConnection,
        raw: &RawMessage,
        original: &Origin,
        step: Option<&str>,
        role: &Role,
        retry: &DelayedRetry<'_>,
    ) -> Result<DeferDecision, sqlx::Error> {
        let key = key_of(raw);
        let mut tx = sqlx::Connection::begin(conn).await?;
        let view = self.lock(&mut tx, key).await?;
        let group_parked: i64 = sqlx::query_scalar(
            "SELECT coalesce(sum(parked), 0)::bigint FROM saga_held_keys WHERE group_id = $1",
        )
        .bind(&self.group)
        .fetch_one(&mut *tx)
        .await?;
        let decision = decide_defer(view.as_ref(), role, group_parked, &self.limits);
        match &decision {
            DeferDecision::Create => {
                // Its own redelivery (its offset not committed before a crash) is recognised by its origin.
                sqlx::query(
                    "INSERT INTO saga_held_keys (group_id, key, state, cause, head_origin_topic, \
                         head_origin_partition, head_origin_offset) VALUES ($1, $2, $3, $4, $5, $6, $7)",
                )
                .bind(&self.group)
                .bind(key)
                .bind(RELEASING)
                .bind(RETRYING)
                .bind(&original.topic)
                .bind(original.partition)
                .bind(original.offset)
                .execute(&mut *tx)
                .await?;
                self.append(&mut tx, raw, original, step, Some(retry))
                    .await?;
            }
            DeferDecision::Append => {
                self.append(&mut tx, raw, original, step, Some(retry))
                    .await?
            }
            DeferDecision::Reschedule(seq) => {
                sqlx::query(
                    "WITH again AS (UPDATE saga_parked_messages SET attempts = $4, \
                         due_at = now() + make_interval(secs => $5::bigint / 1000.0), last_error = $6 \
                         WHERE group_id = $1 AND key = $2 AND seq = $3 RETURNING 1) \
                     UPDATE saga_held_keys SET in_flight = NULL, in_flight_at = NULL \
                     WHERE group_id = $1 AND key = $2 AND EXISTS (SELECT 1 FROM again)",
                )
                .bind(&self.group)
                .bind(key)
                .bind(seq)
                .bind(retry.attempts)
                .bind(retry.wait_ms())
                .bind(retry.error)
                .execute(&mut *tx)
                .await?;
            }
            DeferDecision::Refused => {}
        }
        tx.commit().await?;
        if decision != DeferDecision::Refused {
            self.kick.notify_one();
        }
        Ok(decision)
    }

    /// Records that a message of `raw`'s key, of role `role`, is finished (see [`advance`]), in a
    /// transaction of its own; wakes the releaser if the key's release may go on.
    pub(crate) async fn advance(
        &self,
        conn: &mut PgConnection,
        raw: &RawMessage,
        role: &Role,
        by: &str,
    ) -> Result<Advance, sqlx::Error> {
        let key = key_of(raw);
        let mut tx = sqlx::Connection::begin(conn).await?;
        let view = self.lock(&mut tx, key).await?;
        let decision = advance(view.as_ref(), role);
        let delete_seq = |seq: i64| {
            sqlx::query(
                "DELETE FROM saga_parked_messages WHERE group_id = $1 AND key = $2 AND seq = $3",
            )
            .bind(&self.group)
            .bind(key)
            .bind(seq)
        };
        let let_go = sqlx::query("DELETE FROM saga_held_keys WHERE group_id = $1 AND key = $2")
            .bind(&self.group)
            .bind(key);
        match decision {
            Advance::Nothing => {}
            Advance::Release => {
                release(&mut tx, &self.group, Released::Key(key), by).await?;
            }
            Advance::LetGo => {
                let_go.execute(&mut *tx).await?;
            }
            Advance::Next(seq) => {
                delete_seq(seq).execute(&mut *tx).await?;
                sqlx::query(
                    "UPDATE saga_held_keys SET parked = parked - 1, in_flight = NULL, in_flight_at = NULL \
                     WHERE group_id = $1 AND key = $2",
                )
                .bind(&self.group)
                .bind(key)
                .execute(&mut *tx)
                .await?;
            }
            Advance::Last(seq) => {
                delete_seq(seq).execute(&mut *tx).await?;
                let_go.execute(&mut *tx).await?;
            }
        }
        tx.commit().await?;
        if matches!(decision, Advance::Release | Advance::Next(_)) {
            self.kick.notify_one();
        }
        Ok(decision)
    }

    /// One round of the releaser: for each releasing key of the group (that no other releaser holds), sends
    /// its first parked message to `retry_topic` when [`next_release`] says so, or lets the key go. Returns
    /// how many messages it sent.
    pub(crate) async fn release_round(
        &self,
        pool: &PgPool,
        producer: &FutureProducer,
        retry_topic: &str,
        resend_after: Duration,
    ) -> Result<usize, ReleaseError> {
        // Keys a paused step held whose step is no longer paused (a message parked as the step resumed):
        // released like the others.
        release(
            &mut *pool.acquire().await?,
            &self.group,
            Released::PauseGone,
            "resume",
        )
        .await?;
        // Only keys with something to do now, so that keys that wait (a paused step's message first, a
        // release in flight) never crowd out the others. Each send is recorded, then made, outside the
        // transaction: a send that fails is made again once `resend_after` passed.
        let mut tx = pool.begin().await?;
        let candidates = |key: Option<&[u8]>| {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT * FROM (SELECT h.key, h.held_at, {VIEW_COLUMNS}, \
                     (h.in_flight_at IS NULL OR h.in_flight_at < now() - make_interval(secs => $2)) AS resend_due, \
                     {FIRST_PAUSED} AS first_paused \
                 FROM saga_held_keys h {FIRST_PARKED} \
                 WHERE h.group_id = $1 AND h.state = '{RELEASING}' AND ($3::bytea IS NULL OR h.key = $3)) k \
                 WHERE k.seq IS NULL OR (NOT k.first_paused AND k.first_due \
                     AND (k.in_flight IS DISTINCT FROM k.seq OR k.resend_due)) \
                 ORDER BY k.held_at LIMIT 64"
            )))
            .bind(&self.group)
            .bind(resend_after.as_secs_f64())
            .bind(key.map(<[u8]>::to_vec))
        };
        let keys: Vec<Vec<u8>> = candidates(None)
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(|r| r.try_get("key"))
            .collect::<Result<_, _>>()?;
        let mut sends = Vec::new();
        for key in keys {
            // The key's row locked (skipped if another releaser holds it), and all it is decided on read
            // again under the lock.
            if !self
                .lock_row(&mut tx, &key, "FOR UPDATE SKIP LOCKED")
                .await?
            {
                continue;
            }
            let Some(row) = candidates(Some(&key)).fetch_optional(&mut *tx).await? else {
                continue;
            };
            let view = view_of(&row)?;
            match next_release(
                &view,
                row.try_get("resend_due")?,
                row.try_get("first_paused")?,
            ) {
                ReleaseStep::Wait => {}
                ReleaseStep::LetGo => {
                    sqlx::query("DELETE FROM saga_held_keys WHERE group_id = $1 AND key = $2")
                        .bind(&self.group)
                        .bind(&key)
                        .execute(&mut *tx)
                        .await?;
                }
                ReleaseStep::Send(seq) => {
                    let Some(parked) = sqlx::query(
                        "SELECT topic, \"partition\", \"offset\", message_key, payload, header_names, \
                             header_values FROM saga_parked_messages WHERE group_id = $1 AND key = $2 AND seq = $3",
                    )
                    .bind(&self.group)
                    .bind(&key)
                    .bind(seq)
                    .fetch_optional(&mut *tx)
                    .await?
                    else {
                        continue;
                    };
                    sqlx::query(
                        "UPDATE saga_held_keys SET in_flight = $3, in_flight_at = now() \
                         WHERE group_id = $1 AND key = $2",
                    )
                    .bind(&self.group)
                    .bind(&key)
                    .bind(seq)
                    .execute(&mut *tx)
                    .await?;
                    sends.push((key.clone(), seq, parked));
                }
            }
        }
        tx.commit().await?;
        let mut sent = 0;
        for (key, seq, parked) in &sends {
            match send_release(producer, retry_topic, *seq, parked).await {
                Ok(()) => sent += 1,
                Err(e) => {
                    // Sent again at the next round, not after `resend_after`.
                    tracing::warn!(error = %e, seq, "sending a release failed; sending it again");
                    sqlx::query(
                        "UPDATE saga_held_keys SET in_flight = NULL, in_flight_at = NULL \
                         WHERE group_id = $1 AND key = $2 AND in_flight = $3",
                    )
                    .bind(&self.group)
                    .bind(key)
                    .bind(seq)
                    .execute(pool)
                    .await?;
                }
            }
        }
        Ok(sent)
    }

    /// The group's holds, for the gauges: held keys, parked messages, the oldest hold's age, keys held
    /// longer than the alert threshold, paused steps.
    pub(crate) async fn census(&self, pool: &PgPool) -> Result<Census, sqlx::Error> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT count(*)::bigint AS keys, coalesce(sum(parked), 0)::bigint AS parked, \
                 coalesce(extract(epoch FROM now() - min(held_at)), 0)::float8 AS oldest, \
                 (count(*) FILTER (WHERE held_at < now() - make_interval(secs => $2)))::bigint AS overdue, \
                 (SELECT count(*) FROM saga_paused_steps WHERE group_id = $1)::bigint AS paused, \
                 (SELECT count(DISTINCT p.key) FROM saga_parked_messages p WHERE p.group_id = $1 \
                     AND p.attempts > 0 AND p.seq = (SELECT min(q.seq) FROM saga_parked_messages q \
                         WHERE q.group_id = p.group_id AND q.key = p.key))::bigint AS retrying, \
                 coalesce((SELECT extract(epoch FROM now() - min(p.due_at)) FROM saga_parked_messages p \
                     JOIN saga_held_keys h USING (group_id, key) WHERE p.group_id = $1 AND p.due_at <= now() \
                     AND h.state = '{RELEASING}' AND h.in_flight IS DISTINCT FROM p.seq \
                     AND p.seq = (SELECT min(q.seq) FROM saga_parked_messages q \
                         WHERE q.group_id = p.group_id AND q.key = p.key)), 0)::float8 AS retry_lag \
             FROM saga_held_keys WHERE group_id = $1"
        )))
        .bind(&self.group)
        .bind(self.limits.alert_after.as_secs_f64())
        .fetch_one(pool)
        .await?;
        Ok(Census {
            keys: row.try_get("keys")?,
            parked: row.try_get("parked")?,
            oldest_seconds: row.try_get("oldest")?,
            overdue: row.try_get("overdue")?,
            paused_steps: row.try_get("paused")?,
            retrying: row.try_get("retrying")?,
            retry_lag_seconds: row.try_get("retry_lag")?,
        })
    }
}

/// Which held keys of a group [`release`] (public as `admin::release_held`) lets go of.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Released<'a> {
    /// This key: its head succeeded, or an operator releases it by hand.
    Key(&'a [u8]),
    /// The key whose head is the dead letter of this identity: the letter was discarded.
    BehindLetter(&'a str),
    /// The keys this paused step's messages held: the step resumed.
    PausedStep(&'a str),
    /// The keys whose paused step is no longer paused (a message parked as its step resumed).
    PauseGone,
}

/// Marks the keys of `group` that `which` selects, and that are `held`, releasing: their parked messages
/// run in order. Recorded as released `by`. The number of keys released.
pub async fn release(
    conn: &mut PgConnection,
    group: &str,
    which: Released<'_>,
    by: &str,
) -> Result<u64, sqlx::Error> {
    let (condition, key, text) = match which {
        Released::Key(key) => ("h.key = $3".to_owned(), Some(key), None),
        Released::BehindLetter(letter) => ("h.head_letter = $4".to_owned(), None, Some(letter)),
        Released::PausedStep(step) => (
            format!("h.cause = '{PAUSED}' AND h.paused_step = $4"),
            None,
            Some(step),
        ),
        Released::PauseGone => (
            format!(
                "h.cause = '{PAUSED}' AND NOT EXISTS (SELECT 1 FROM saga_paused_steps s \
                 WHERE s.group_id = h.group_id AND s.step = h.paused_step)"
            ),
            None,
            None,
        ),
    };
    let released = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE saga_held_keys h SET state = '{RELEASING}', released_by = $2, released_at = now(), \
             in_flight = NULL, in_flight_at = NULL \
         WHERE h.group_id = $1 AND h.state = '{HELD}' AND {condition}"
    )))
    .bind(group)
    .bind(by)
    .bind(key)
    .bind(text)
    .execute(conn)
    .await?;
    Ok(released.rows_affected())
}

/// A group's holds at a glance.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Census {
    pub keys: i64,
    pub parked: i64,
    pub oldest_seconds: f64,
    pub overdue: i64,
    pub paused_steps: i64,
    /// Keys whose first parked message is a delayed retry.
    pub retrying: i64,
    /// How long past its due time the most overdue delayed retry waits to be sent (0: none).
    pub retry_lag_seconds: f64,
}

/// Why a release round failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReleaseError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error("sending a parked message to the retry topic: {0}")]
    Kafka(String),
}

/// Sends parked message `seq` (its row `parked`) to `retry_topic`: its key, payload and headers (but a
/// replay's), the replay headers naming where it was first consumed, and the release's sequence number.
async fn send_release(
    producer: &FutureProducer,
    retry_topic: &str,
    seq: i64,
    parked: &sqlx::postgres::PgRow,
) -> Result<(), ReleaseError> {
    let names: Vec<String> = parked.try_get("header_names")?;
    let values: Vec<Option<Vec<u8>>> = parked.try_get("header_values")?;
    let key: Option<Vec<u8>> = parked.try_get("message_key")?;
    let payload: Option<Vec<u8>> = parked.try_get("payload")?;
    let topic: String = parked.try_get("topic")?;
    let partition = parked.try_get::<i32, _>("partition")?.to_string();
    let offset = parked.try_get::<i64, _>("offset")?.to_string();
    let seq = seq.to_string();
    replay::send(
        producer,
        replay::RetryMessage {
            retry_topic,
            key: key.as_deref(),
            payload: payload.as_deref(),
        },
        names
            .iter()
            .map(String::as_str)
            .zip(values.iter().map(Option::as_deref)),
        // A replay's count stays (its replay limit still applies); the rest of a replay's headers go.
        |name| name == replay::REPLAY_COUNT || !replay::ALL.contains(&name),
        &[
            (replay::ORIGINAL_TOPIC, topic.as_str()),
            (replay::ORIGINAL_PARTITION, partition.as_str()),
            (replay::ORIGINAL_OFFSET, offset.as_str()),
            (replay::RELEASE, seq.as_str()),
        ],
    )
    .await
    .map_err(|e| ReleaseError::Kafka(e.to_string()))?;
    Ok(())
}

/// The releaser: a round whenever a release may go on (kicked), and every second for what other instances
/// of the group released; the gauges follow. Runs until `cancel`.
pub(crate) async fn run_releaser(
    holds: Holds,
    pool: PgPool,
    producer: FutureProducer,
    retry_topic: String,
    metrics: crate::metrics::ConsumerMetrics,
    cancel: CancellationToken,
) {
    /// A release sent and not finished after this long is sent again (the copy that comes second is stale).
    const RESEND_AFTER: Duration = Duration::from_secs(60);
    loop {
        // The census first: it keeps the batches' gate fresh, and a group that holds no key has nothing to
        // release (a round then costs nothing).
        let holds_keys = match holds.census(&pool).await {
            Ok(census) => {
                metrics.held(&census);
                let active = holds.any_policy_holds() || census.keys > 0 || census.paused_steps > 0;
                holds
                    .active
                    .store(active, std::sync::atomic::Ordering::Release);
                holds
                    .census_at
                    .store(now_ms(), std::sync::atomic::Ordering::Release);
                census.keys > 0
            }
            // Not known: every batch reads its holds, and the round runs.
            Err(_) => {
                holds
                    .active
                    .store(true, std::sync::atomic::Ordering::Release);
                true
            }
        };
        if holds_keys {
            match holds
                .release_round(&pool, &producer, &retry_topic, RESEND_AFTER)
                .await
            {
                Ok(_) => {}
                Err(ReleaseError::Database(sqlx::Error::Database(e)))
                    if e.code().as_deref() == Some("42P01") => {}
                Err(e) => tracing::warn!(error = %e, "releasing held keys failed; trying again"),
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = holds.kick.notified() => {}
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn origin(offset: i64) -> Origin {
        Origin {
            topic: "orders".into(),
            partition: 0,
            offset,
        }
    }

    fn raw(payload: &[u8]) -> RawMessage {
        RawMessage {
            origin: origin(3),
            key: Some(b"order-7".to_vec()),
            payload: Some(payload.to_vec()),
            headers: saga_core::Headers::new().with("idempotency-key", "order-7"),
            timestamp_ms: None,
        }
    }

    #[test]
    fn a_release_carries_its_parked_messages_key_payload_and_headers_but_not_a_replays() {
        let parked = raw(b"{}");
        let mut released = parked.clone();
        released.headers = parked
            .headers
            .clone()
            .with(replay::RELEASE, "7")
            .with(replay::ORIGINAL_TOPIC, "orders");
        assert_eq!(digest(&released), digest(&parked));
        let mut forged = parked.clone();
        forged.headers = saga_core::Headers::new().with("idempotency-key", "order-8");
        assert_ne!(digest(&forged), digest(&parked), "another saga's key");
        let mut rekeyed = parked.clone();
        rekeyed.key = None;
        assert_ne!(digest(&rekeyed), digest(&parked));
    }

    fn view(state: HoldState, parked: i64) -> HeldView {
        HeldView {
            state,
            head_letter: Some("letter".into()),
            head_origin: Some(origin(1)),
            first: (parked > 0).then(|| (7, origin(3), digest(&raw(b"{}")))),
            parked,
            in_flight: None,
            retrying: false,
            first_due: true,
            first_attempts: 0,
        }
    }

    const LIMITS: HoldLimits = HoldLimits {
        per_key: 2,
        per_group: 3,
        alert_after: Duration::from_secs(60),
    };

    #[test]
    fn a_message_runs_parks_or_releases_as_its_key_is_held() {
        let held = view(HoldState::Held, 1);
        let mut releasing = view(HoldState::Releasing, 1);
        releasing.in_flight = Some(7);
        assert_eq!(classify(None, &Mark::Plain, &origin(9), false), Role::Free);
        assert_eq!(classify(None, &Mark::Plain, &origin(9), true), Role::Park);
        assert_eq!(
            classify(Some(&held), &Mark::Plain, &origin(9), false),
            Role::Park
        );
        assert_eq!(
            classify(Some(&held), &Mark::Plain, &origin(1), false),
            Role::Stale,
            "the head letter's own message, redelivered, is the letter's to run: never parked behind"
        );
        let head = Mark::Replay("letter".into());
        assert_eq!(
            classify(Some(&held), &head, &origin(9), false),
            Role::Head("letter".into())
        );
        assert_eq!(
            classify(
                Some(&held),
                &Mark::Replay("another".into()),
                &origin(9),
                false
            ),
            Role::Park,
            "a replay of another letter of a held key waits behind it"
        );
        let release = Mark::Release {
            seq: 7,
            origin: origin(3),
            digest: digest(&raw(b"{}")),
        };
        assert_eq!(
            classify(Some(&releasing), &release, &origin(9), false),
            Role::Release(7)
        );
        assert_eq!(
            classify(Some(&held), &release, &origin(9), false),
            Role::Stale
        );
        assert_eq!(classify(None, &release, &origin(9), false), Role::Stale);
        let not_sent = HeldView {
            in_flight: None,
            ..releasing.clone()
        };
        assert_eq!(
            classify(Some(&not_sent), &release, &origin(9), false),
            Role::Stale,
            "a copy the releaser did not send for (a delayed retry parked again) does not run"
        );
        let forged = Mark::Release {
            seq: 7,
            origin: origin(4),
            digest: digest(&raw(b"{}")),
        };
        assert_eq!(
            classify(Some(&releasing), &forged, &origin(9), false),
            Role::Stale,
            "a release names the parked message's own position"
        );
        let forged = Mark::Release {
            seq: 7,
            origin: origin(3),
            digest: digest(&raw(b"{\"amount\":1}")),
        };
        assert_eq!(
            classify(Some(&releasing), &forged, &origin(9), false),
            Role::Stale,
            "and carries its payload"
        );
    }

    #[test]
    fn parking_is_bounded_per_key_and_per_group() {
        let one = view(HoldState::Held, 1);
        let two = view(HoldState::Held, 2);
        assert_eq!(
            decide_park(Some(&one), false, 1, &LIMITS),
            ParkDecision::Append
        );
        assert!(matches!(
            decide_park(Some(&two), false, 2, &LIMITS),
            ParkDecision::Full(_)
        ));
        assert!(matches!(
            decide_park(Some(&one), false, 3, &LIMITS),
            ParkDecision::Full(_)
        ));
        assert_eq!(decide_park(None, false, 0, &LIMITS), ParkDecision::NotHeld);
        assert_eq!(decide_park(None, true, 0, &LIMITS), ParkDecision::Create);
    }

    #[test]
    fn the_release_goes_one_message_at_a_time_and_lets_the_key_go_after_the_last() {
        let held = view(HoldState::Held, 2);
        assert_eq!(
            advance(Some(&held), &Role::Head("letter".into())),
            Advance::Release
        );
        assert_eq!(
            advance(
                Some(&view(HoldState::Held, 0)),
                &Role::Head("letter".into())
            ),
            Advance::LetGo
        );
        let mut releasing = view(HoldState::Releasing, 2);
        assert_eq!(next_release(&releasing, false, false), ReleaseStep::Send(7));
        releasing.in_flight = Some(7);
        assert_eq!(next_release(&releasing, false, false), ReleaseStep::Wait);
        assert_eq!(next_release(&releasing, true, false), ReleaseStep::Send(7));
        assert_eq!(next_release(&releasing, false, true), ReleaseStep::Wait);
        let not_due = HeldView {
            in_flight: None,
            first_due: false,
            ..releasing.clone()
        };
        assert_eq!(
            next_release(&not_due, true, false),
            ReleaseStep::Wait,
            "a delayed retry is sent when it is due, not before"
        );
        assert_eq!(
            advance(Some(&releasing), &Role::Release(7)),
            Advance::Next(7)
        );
        assert_eq!(
            advance(Some(&releasing), &Role::Release(8)),
            Advance::Nothing,
            "advancing twice is nothing"
        );
        assert_eq!(
            advance(Some(&view(HoldState::Releasing, 1)), &Role::Release(7)),
            Advance::Last(7)
        );
        assert_eq!(
            advance(Some(&view(HoldState::Held, 1)), &Role::Release(7)),
            Advance::Next(7),
            "a key a letter heads again meanwhile stays held when its last released message finishes"
        );
        assert_eq!(
            next_release(&view(HoldState::Releasing, 0), false, false),
            ReleaseStep::LetGo
        );
    }

    #[test]
    fn a_released_message_that_fails_for_good_is_the_new_head() {
        let releasing = view(HoldState::Releasing, 2);
        let retrying = HeldView {
            first_attempts: 2,
            ..releasing.clone()
        };
        assert_eq!(
            on_dead_letter(Some(&retrying), &Role::Release(7), false, true),
            OnDeadLetter::Drop(7),
            "a delayed retry spent, under a policy that holds nothing, leaves its queue"
        );
        assert_eq!(
            on_dead_letter(Some(&retrying), &Role::Release(7), true, true),
            OnDeadLetter::ReHead { drop_seq: Some(7) }
        );
        let behind_a_retry = HeldView {
            retrying: true,
            ..releasing.clone()
        };
        assert_eq!(
            on_dead_letter(Some(&behind_a_retry), &Role::Release(7), false, true),
            OnDeadLetter::Drop(7),
            "a message parked behind a delayed retry, failing for good under a policy that holds nothing, \
             does not start holding its key"
        );
        assert_eq!(
            on_dead_letter(Some(&releasing), &Role::Release(7), false, true),
            OnDeadLetter::ReHead { drop_seq: Some(7) }
        );
        assert_eq!(
            on_dead_letter(None, &Role::Free, true, true),
            OnDeadLetter::Hold
        );
        assert_eq!(
            on_dead_letter(None, &Role::Free, true, false),
            OnDeadLetter::Nothing,
            "a keyless message holds nothing"
        );
        assert_eq!(
            on_dead_letter(None, &Role::Free, false, true),
            OnDeadLetter::Nothing
        );
        assert_eq!(
            on_dead_letter(Some(&releasing), &Role::Free, true, true),
            OnDeadLetter::Queue,
            "held behind another letter meanwhile: it joins the queue"
        );
    }

    #[test]
    fn a_transient_failure_waits_parked_where_its_key_can_hold_it() {
        let free = decide_defer(None, &Role::Free, 0, &LIMITS);
        assert_eq!(free, DeferDecision::Create, "its key is held for it");
        let held = view(HoldState::Held, 1);
        assert_eq!(
            decide_defer(Some(&held), &Role::Free, 1, &LIMITS),
            DeferDecision::Append,
            "held meanwhile: behind the queue"
        );
        assert_eq!(
            decide_defer(Some(&view(HoldState::Held, 2)), &Role::Free, 2, &LIMITS),
            DeferDecision::Refused,
            "a full queue: retried where it stands"
        );
        assert_eq!(
            decide_defer(None, &Role::Free, 3, &LIMITS),
            DeferDecision::Refused,
            "the group's cap"
        );
        let mut releasing = view(HoldState::Releasing, 2);
        releasing.in_flight = Some(7);
        assert_eq!(
            decide_defer(Some(&releasing), &Role::Release(7), 2, &LIMITS),
            DeferDecision::Reschedule(7),
            "a released message that fails again waits again, whatever the caps"
        );
        releasing.in_flight = None;
        assert_eq!(
            decide_defer(Some(&releasing), &Role::Release(7), 2, &LIMITS),
            DeferDecision::Refused,
            "a copy out of turn does not move the due time"
        );
        assert_eq!(
            decide_defer(Some(&held), &Role::Head("letter".into()), 1, &LIMITS),
            DeferDecision::Refused,
            "a replayed head letter is retried where it stands"
        );
    }
}
