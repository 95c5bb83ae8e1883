//! Dead letters: read a dead-letter topic, select by reason, step and age, show one, and replay them to the
//! consumer group that gave up on them, once.
//!
//! A dead-letter topic belongs to one consumer group, as the group's consumer recorded it in the schema
//! (`saga_consumer_groups`). A replay re-produces a dead letter's key, value and headers (the `dlq-*`
//! headers dropped, the replay headers of the runtime's replay module set: the count raised, the original
//! topic, partition and offset, the operator) to **that group's retry topic**, never to the original topic:
//! no other group reading the original topic sees a replay. The group's consumer routes it by the original
//! topic to the same step, whose step key absorbs it if it had taken effect.
//!
//! Each letter is claimed before it is sent: its record in `saga_dlq_replays`, keyed by its position and
//! its identity ([`DeadLetter::identity`]: a new letter at a reused position is a new letter), is locked
//! until the broker acknowledged the send and the send is recorded (with the operator, in
//! `saga_dlq_replay_log`). Two replays of the same letters started together send each letter once; running
//! a replay again sends nothing. A letter that names another group than the topic's (a forged letter), a
//! copy without its payload, a letter whose `dlq-*` headers cannot be read ([`UNREADABLE`]), or a message
//! replayed [`ReplayOptions::max_replays`] times already, is refused.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use saga_consumer::KafkaConfig;
use saga_consumer::admin::letters::{self, LetterFields};
use saga_runtime::replay;
use serde::Serialize;
use sqlx::migrate::Migrator;
use sqlx::{PgPool, Row};

use crate::error::AdminError;

/// The header counting how often a message was replayed from a dead-letter topic.
pub const REPLAY_COUNT_HEADER: &str = replay::REPLAY_COUNT;

/// The prefix of the `dlq-*` headers the consumer writes on a dead letter.
mod names {
    pub(super) const PREFIX: &str = "dlq-";
}

/// A message as read from a topic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Record {
    /// Its partition.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
    /// Its key.
    pub key: Option<Vec<u8>>,
    /// Its payload.
    pub payload: Option<Vec<u8>>,
    /// Its headers, in order.
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    /// Its timestamp, in milliseconds since the epoch.
    pub timestamp_ms: Option<i64>,
}

impl Record {
    /// A message at `partition` and `offset` with `headers` and `payload`, without key or timestamp.
    pub fn new(
        partition: i32,
        offset: i64,
        headers: Vec<(String, Option<Vec<u8>>)>,
        payload: Option<Vec<u8>>,
    ) -> Self {
        Self {
            partition,
            offset,
            key: None,
            payload,
            headers,
            timestamp_ms: None,
        }
    }

    /// The text value of header `name` (the first with a value).
    pub fn header(&self, name: &str) -> Option<&str> {
        letters::header(&self.headers, name)
    }
}

/// A dead letter: where it sits in the dead-letter topic, where it came from, and why it is there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The dead-letter topic.
    pub topic: String,
    /// Its partition in the dead-letter topic.
    pub partition: i32,
    /// Its offset in the dead-letter topic.
    pub offset: i64,
    /// The topic it was consumed from.
    pub original_topic: String,
    /// Its partition there.
    pub original_partition: i32,
    /// Its offset there.
    pub original_offset: i64,
    /// The consumer group that gave up on it.
    pub group: String,
    /// The step it was meant for, if one was found.
    pub step: Option<String>,
    /// Why: `undecodable`, `unknown-event-type`, `handler-failed`, `retries-exhausted`, `crash-loop`.
    pub reason: String,
    /// The error, for people.
    pub error: String,
    /// How many attempts were made.
    pub attempts: u32,
    /// When it was dead-lettered.
    pub failed_at: DateTime<Utc>,
    /// The saga's idempotency key, if the message carries one.
    pub idempotency_key: Option<String>,
    /// The tenant (`default` when the message names none).
    pub tenant: String,
    /// Whether the dead-letter topic kept only a copy without the payload.
    pub truncated: bool,
    /// How often this message had been replayed before it was dead-lettered this time.
    pub replay_count: u32,
    /// What is wrong with a letter whose `dlq-*` headers cannot be read (its reason is [`UNREADABLE`]):
    /// see [`DeadLetter::read`]. `None` for a letter read whole.
    pub unreadable: Option<String>,
    /// Its identity (see [`DeadLetter::identity`]).
    #[serde(skip)]
    pub letter_hash: String,
    /// The whole message: empty for a letter read from the index, until [`with_records`] reads it.
    #[serde(skip)]
    pub record: Record,
}

/// The `reason` of a letter whose `dlq-*` headers cannot be read ([`DeadLetter::read`]).
pub const UNREADABLE: &str = letters::UNREADABLE;

impl DeadLetter {
    /// Reads the dead letter in `record` of `topic`; fails, naming the header, where a `dlq-*` header is
    /// missing or malformed.
    pub fn parse(topic: &str, record: Record) -> Result<Self, AdminError> {
        match LetterFields::parse(&record.headers) {
            Ok(fields) => Ok(Self::of_record(topic, fields, record)),
            Err(problem) => Err(AdminError::bad_input(format!(
                "dead letter {topic}/{}/{}: {problem}",
                record.partition, record.offset
            ))),
        }
    }

    /// Reads the dead letter in `record` of `topic`, whatever its headers hold: a letter whose `dlq-*`
    /// headers are missing or malformed (a message written to the topic by hand, or carrying a header the
    /// framework reads with a value it cannot) is an [`UNREADABLE`] letter, with what is wrong in
    /// [`unreadable`](Self::unreadable) and [`error`](Self::error), and what could be read of the rest. It can
    /// be listed, counted and discarded, never replayed, and it hides no other letter.
    pub fn read(topic: &str, record: Record) -> Self {
        let fields = LetterFields::read(&record.headers, record.timestamp_ms);
        Self::of_record(topic, fields, record)
    }

    fn of_record(topic: &str, fields: LetterFields, record: Record) -> Self {
        let letter_hash = letters::identity(
            &fields,
            record.key.as_deref(),
            record.payload.as_deref(),
            &record.headers,
        );
        let position = (record.partition, record.offset);
        Self {
            record,
            ..Self::from_index(topic, position, fields, letter_hash)
        }
    }

    /// The letter the index holds at `position` of `topic`, without its record.
    pub(crate) fn from_index(
        topic: &str,
        (partition, offset): (i32, i64),
        fields: LetterFields,
        letter_hash: String,
    ) -> Self {
        Self {
            topic: topic.to_owned(),
            partition,
            offset,
            original_topic: fields.original_topic,
            original_partition: fields.original_partition,
            original_offset: fields.original_offset,
            group: fields.group,
            step: fields.step,
            reason: fields.reason,
            error: fields.error,
            attempts: fields.attempts,
            failed_at: fields.failed_at,
            idempotency_key: fields.idempotency_key,
            tenant: fields.tenant,
            truncated: fields.truncated,
            replay_count: fields.replay_count,
            unreadable: fields.unreadable,
            letter_hash,
            record: Record::new(partition, offset, Vec::new(), None),
        }
    }

    /// What the letter's headers say.
    pub fn fields(&self) -> LetterFields {
        let mut fields = LetterFields::read(&[], None);
        fields.original_topic.clone_from(&self.original_topic);
        fields.original_partition = self.original_partition;
        fields.original_offset = self.original_offset;
        fields.group.clone_from(&self.group);
        fields.step.clone_from(&self.step);
        fields.reason.clone_from(&self.reason);
        fields.error.clone_from(&self.error);
        fields.attempts = self.attempts;
        fields.failed_at = self.failed_at;
        fields.idempotency_key.clone_from(&self.idempotency_key);
        fields.tenant.clone_from(&self.tenant);
        fields.truncated = self.truncated;
        fields.replay_count = self.replay_count;
        fields.unreadable.clone_from(&self.unreadable);
        fields
    }

    /// The letter's identity: a hash of its original coordinates, key, value and headers (the `dlq-*` ones
    /// too, so two letters of one message dead-lettered twice differ). A replay is recorded under its
    /// position and this, so that a new letter at a reused position (the topic deleted and recreated) is a
    /// new letter.
    pub fn identity(&self) -> String {
        self.letter_hash.clone()
    }
}

/// Which dead letters to select. Empty: all of them.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct DlqFilter {
    /// Only this `dlq-reason`.
    pub reason: Option<String>,
    /// Only this step.
    pub step: Option<String>,
    /// Only those dead-lettered within this long.
    pub since: Option<Duration>,
    /// Only the one at this partition and offset of the dead-letter topic.
    pub position: Option<(i32, i64)>,
    /// At most this many (the oldest first, by partition and offset).
    pub limit: Option<usize>,
}

impl DlqFilter {
    /// Only the dead letter at `partition` and `offset` of the dead-letter topic.
    pub fn at(partition: i32, offset: i64) -> Self {
        Self {
            position: Some((partition, offset)),
            ..Self::default()
        }
    }

    /// Whether `letter` is one the filter selects (its limit aside), at `now`.
    fn accepts(&self, letter: &DeadLetter, now: DateTime<Utc>) -> bool {
        self.reason.as_ref().is_none_or(|r| *r == letter.reason)
            && self
                .step
                .as_ref()
                .is_none_or(|s| letter.step.as_deref() == Some(s))
            && self.since.is_none_or(|since| {
                chrono::Duration::from_std(since).is_ok_and(|since| letter.failed_at >= now - since)
            })
            && self
                .position
                .is_none_or(|(p, o)| letter.partition == p && letter.offset == o)
    }
}

/// The dead letters of `topic` that `filter` selects, oldest first (by partition and offset), as the
/// dead-letter index of `pool`'s schema holds them (their records empty: [`with_records`] reads those).
/// A letter whose `dlq-*` headers cannot be read is listed as an [`UNREADABLE`] one
/// ([`DeadLetter::read`]): it hides no other.
///
/// Fails with bad input, before reading anything, if the topic is not a dead-letter topic (see
/// [`crate::index::require_dead_letter_topic`]), or if it does not exist.
pub async fn list(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topic: &str,
    filter: &DlqFilter,
) -> Result<Vec<DeadLetter>, AdminError> {
    crate::index::require_dead_letter_topic(pool, topic).await?;
    crate::index::sync_for_reading(kafka, pool, topic).await?;
    let topics = [topic.to_owned()];
    let selection = crate::index::Selection {
        topics: &topics,
        filter: Some(filter),
        ..crate::index::Selection::default()
    };
    Ok(crate::index::letters(pool, &selection)
        .await?
        .into_iter()
        .map(|l| l.letter)
        .collect())
}

/// The most bytes of messages [`with_records`] reads from a topic at once.
const READ_BYTES: usize = 16 << 20;

/// `letters` with their records read from their topics; a letter whose position now holds another letter
/// (its topic deleted and recreated) is that other letter, indexed again; one the topic no longer holds
/// (its retention deleted it) is left out.
pub async fn with_records(
    kafka: &KafkaConfig,
    pool: &PgPool,
    letters: Vec<DeadLetter>,
) -> Result<Vec<DeadLetter>, AdminError> {
    let mut wanted: BTreeMap<(String, i32), Vec<i64>> = BTreeMap::new();
    for l in &letters {
        wanted
            .entry((l.topic.clone(), l.partition))
            .or_default()
            .push(l.offset);
    }
    let mut records: BTreeMap<(String, i32, i64), Record> = BTreeMap::new();
    for ((topic, partition), mut offsets) in wanted {
        offsets.sort_unstable();
        offsets.dedup();
        let kept: std::collections::HashSet<i64> = offsets.iter().copied().collect();
        // Runs of nearby offsets, each read at once.
        let mut runs: Vec<(i64, i64)> = Vec::new();
        for offset in offsets {
            match runs.last_mut() {
                Some((_, until)) if offset - *until < 64 => {
                    *until = offset + 1;
                }
                _ => runs.push((offset, offset + 1)),
            }
        }
        let held = crate::broker::partitions_of(kafka, &topic).await?;
        let Some((_, low, high)) = held.into_iter().find(|(p, _, _)| *p == partition) else {
            continue;
        };
        for (from, until) in runs {
            let (from, until) = (from.max(low), until.min(high));
            if from >= until {
                continue;
            }
            // In reads of bounded size, keeping only the letters asked for (a run's other messages may
            // be other groups' letters, of any size).
            let mut at = from;
            while at < until {
                let read = read_bounded(kafka, &topic, partition, at, until, READ_BYTES).await?;
                let Some(last) = read.last().map(|r| r.offset) else {
                    break;
                };
                for record in read.into_iter().filter(|r| kept.contains(&r.offset)) {
                    records.insert((topic.clone(), record.partition, record.offset), record);
                }
                at = last + 1;
            }
        }
    }
    let mut found = Vec::with_capacity(letters.len());
    let mut reindex = Vec::new();
    for l in letters {
        let Some(record) = records.remove(&(l.topic.clone(), l.partition, l.offset)) else {
            continue;
        };
        let read = DeadLetter::read(&l.topic, record);
        if read.letter_hash != l.letter_hash {
            reindex.push(crate::index::indexed(&read.topic, &read.record));
        }
        found.push(read);
    }
    if !reindex.is_empty() {
        let mut conn = pool.acquire().await?;
        letters::index(&mut conn, &reindex).await?;
    }
    Ok(found)
}

/// Dead letters by (dead-letter topic, reason): how many, over `topics`, as the index of `pool`'s schema
/// holds them. Topics that do not exist count nothing.
pub async fn counts(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topics: &[String],
) -> Result<BTreeMap<(String, String), usize>, AdminError> {
    crate::index::sync_all(kafka, pool, topics).await?;
    Ok(crate::index::counts(pool, topics)
        .await?
        .into_iter()
        .map(|(k, (total, _))| (k, total))
        .collect())
}

/// The message at `partition` and `offset` of `topic`, as it is (any message, dead letter or not).
pub async fn show(
    kafka: &KafkaConfig,
    topic: &str,
    partition: i32,
    offset: i64,
) -> Result<Record, AdminError> {
    let partitions = crate::broker::partitions_of(kafka, topic).await?;
    let Some((_, low, high)) = partitions.iter().find(|(p, _, _)| *p == partition) else {
        return Err(AdminError::bad_input(format!(
            "{topic} has no partition {partition} (it has {})",
            partitions.len()
        )));
    };
    if offset < *low || offset >= *high {
        return Err(AdminError::bad_input(format!(
            "{topic}/{partition} has no message at offset {offset} (it holds {low}..{high})"
        )));
    }
    let records = read(
        kafka,
        topic,
        vec![(partition, offset, offset + 1)],
        usize::MAX,
    )
    .await?;
    records.into_iter().next().ok_or_else(|| {
        AdminError::kafka_said(format!("{topic}/{partition}/{offset} could not be read"))
    })
}

/// The topics of the broker whose name ends in `.dlq` (the consumer's default dead-letter topics).
pub async fn discover_topics(kafka: &KafkaConfig) -> Result<Vec<String>, AdminError> {
    let config = saga_runtime::kafka::client_config(kafka);
    tokio::task::spawn_blocking(move || {
        let client: BaseConsumer = config.create().map_err(AdminError::kafka)?;
        let metadata = client
            .fetch_metadata(None, Duration::from_secs(10))
            .map_err(AdminError::kafka)?;
        let mut topics: Vec<String> = metadata
            .topics()
            .iter()
            .map(|t| t.name().to_owned())
            .filter(|n| n.ends_with(".dlq"))
            .collect();
        topics.sort();
        Ok(topics)
    })
    .await
    .map_err(|e| AdminError::Kafka(saga_config::Cause::new(e)))?
}

/// How a replay runs.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ReplayOptions {
    /// Report what would be sent; send and record nothing.
    pub dry_run: bool,
    /// Send again dead letters replayed already, and messages replayed `max_replays` times.
    pub force: bool,
    /// A message replayed this many times already (and dead-lettered again each time) is refused unless
    /// forced (default 3).
    pub max_replays: u32,
    /// Who replays, recorded with each send (default: the OS user, see [`os_user`]).
    pub operator: String,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            dry_run: false,
            force: false,
            max_replays: 3,
            operator: os_user(),
        }
    }
}

impl ReplayOptions {
    /// The options, recording `operator` as who replays.
    #[must_use]
    pub fn by(mut self, operator: impl Into<String>) -> Self {
        self.operator = operator.into();
        self
    }
}

/// The user running this process, as the environment names it (`USER`, `LOGNAME`, `USERNAME`), or
/// `unknown`.
pub fn os_user() -> String {
    ["USER", "LOGNAME", "USERNAME"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|u| !u.trim().is_empty()))
        .unwrap_or_else(|| "unknown".to_owned())
}

/// What a replay did with one dead letter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum ReplayOutcome {
    /// Sent to the group's retry topic; the broker acknowledged it there.
    Sent {
        /// The retry topic.
        topic: String,
        /// Its partition there.
        partition: i32,
        /// Its offset there.
        offset: i64,
    },
    /// A dry run would send it.
    WouldSend,
    /// Replayed by an earlier run (or by a run going on now, which sends it): not sent again.
    AlreadyReplayed,
    /// Replayed too often already (dead-lettered again each time): not sent.
    RefusedReplayLimit {
        /// How often it was replayed.
        replays: u32,
    },
    /// The dead-letter topic kept only a copy without its payload: there is nothing to replay.
    RefusedTruncated,
    /// The letter's `dlq-*` headers cannot be read ([`DeadLetter::read`]): where to send it is not known.
    /// Discard it.
    RefusedUnreadable {
        /// What is wrong with it.
        problem: String,
    },
    /// The letter says another consumer group gave up on it than the one the dead-letter topic belongs to
    /// (or says none): it was not written by this topic's consumer, and is not replayed.
    RefusedForeignGroup {
        /// The group the letter names (empty: none).
        group: String,
    },
}

impl ReplayOutcome {
    /// The outcome in words, for tables and pages.
    pub fn describe(&self) -> String {
        match self {
            Self::Sent {
                topic,
                partition,
                offset,
            } => format!("sent to {topic}/{partition} at offset {offset}"),
            Self::WouldSend => "would send (dry run)".to_owned(),
            Self::AlreadyReplayed => "already replayed: not sent again".to_owned(),
            Self::RefusedReplayLimit { replays } => {
                format!("refused: replayed {replays} times already (--force)")
            }
            Self::RefusedTruncated => "refused: the dead letter kept no payload".to_owned(),
            Self::RefusedUnreadable { problem } => {
                format!("refused: the dead letter cannot be read ({problem}); discard it")
            }
            Self::RefusedForeignGroup { group } if group.is_empty() => {
                "refused: the letter names no consumer group".to_owned()
            }
            Self::RefusedForeignGroup { group } => {
                format!("refused: the letter names another consumer group ({group})")
            }
        }
    }
}

/// One dead letter of a replay and what happened to it.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Replayed {
    /// Its partition in the dead-letter topic.
    pub partition: i32,
    /// Its offset in the dead-letter topic.
    pub offset: i64,
    /// Where it was first consumed.
    pub original_topic: String,
    /// The original partition.
    pub original_partition: i32,
    /// The saga's key.
    pub idempotency_key: Option<String>,
    /// What happened.
    pub outcome: ReplayOutcome,
}

/// What a replay did.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct ReplayReport {
    /// The consumer group the dead-letter topic belongs to.
    pub group: String,
    /// That group's retry topic, where the letters were sent.
    pub retry_topic: String,
    /// Who replayed.
    pub operator: String,
    /// Every selected dead letter, in order.
    pub letters: Vec<Replayed>,
}

impl ReplayReport {
    /// How many were sent.
    pub fn sent(&self) -> usize {
        self.letters
            .iter()
            .filter(|l| matches!(l.outcome, ReplayOutcome::Sent { .. }))
            .count()
    }
}

/// The toolkit's tables (`saga_dlq_replays`, `saga_dlq_replay_log`), recorded in `_saga_admin_migrations`.
pub fn migrator() -> Migrator {
    saga_runtime::store::migrate::owned_by(sqlx::migrate!("./migrations"), "_saga_admin_migrations")
}

/// The consumer group a dead-letter topic belongs to, as the group's consumer recorded it in the schema
/// (`saga_consumer_groups`), with its retry topic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DlqOwner {
    /// The consumer group.
    pub group: String,
    /// Its retry topic.
    pub retry_topic: String,
}

/// The group `dlq_topic` belongs to in `pool`'s schema. Bad input if no group there records it, or more
/// than one does.
pub async fn owner_of(pool: &PgPool, dlq_topic: &str) -> Result<DlqOwner, AdminError> {
    let recorded: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.tables \
         WHERE table_schema = current_schema() AND table_name = 'saga_consumer_groups')",
    )
    .fetch_one(pool)
    .await?;
    let owners: Vec<(String, String)> = if recorded {
        sqlx::query_as(
            "SELECT group_id, retry_topic FROM saga_consumer_groups WHERE dlq_topic = $1 ORDER BY 1",
        )
        .bind(dlq_topic)
        .fetch_all(pool)
        .await?
    } else {
        Vec::new()
    };
    match owners.as_slice() {
        [(group, retry_topic)] => Ok(DlqOwner {
            group: group.clone(),
            retry_topic: retry_topic.clone(),
        }),
        [] => Err(AdminError::bad_input(format!(
            "no consumer group in this schema writes dead-letter topic {dlq_topic}: replay against the \
             schema of the service that owns it (SAGA_SCHEMA), after its consumer has run with this version"
        ))),
        many => Err(AdminError::bad_input(format!(
            "several consumer groups in this schema write dead-letter topic {dlq_topic} ({}): give each \
             group a dead-letter topic of its own",
            many.iter()
                .map(|(g, _)| g.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// Replays the dead letters of `topic` that `filter` selects into the retry topic of the consumer group
/// the dead-letter topic belongs to, recording each in `pool`'s schema (see the module documentation).
pub async fn replay(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topic: &str,
    filter: &DlqFilter,
    options: &ReplayOptions,
) -> Result<ReplayReport, AdminError> {
    // As the topic holds them now: a letter found in place of the indexed one (its topic recreated) is
    // replayed only if the filter selects it too.
    let now = Utc::now();
    if !options.dry_run {
        // An action: it may make the index a schema no consumer of this version ran in lacks.
        crate::index::prepare(pool).await?;
    }
    let mut letters = with_records(kafka, pool, list(kafka, pool, topic, filter).await?).await?;
    letters.retain(|l| filter.accepts(l, now));
    if let Some(position) = filter.position
        && letters.is_empty()
    {
        return Err(AdminError::bad_input(format!(
            "{topic} has no dead letter at partition {} offset {} (that the filters select)",
            position.0, position.1
        )));
    }
    let owner = owner_of(pool, topic).await?;
    if !options.dry_run {
        migrator()
            .run(pool)
            .await
            .map_err(|source| AdminError::Migrations {
                what: "the toolkit's migrations",
                source,
            })?;
    }
    let producer = saga_runtime::kafka::idempotent_producer(
        kafka,
        Duration::from_millis(1),
        Duration::from_secs(30),
    )
    .map_err(AdminError::kafka)?;
    let mut report = ReplayReport {
        group: owner.group.clone(),
        retry_topic: owner.retry_topic.clone(),
        operator: options.operator.clone(),
        letters: Vec::new(),
    };
    for letter in letters {
        let outcome = replay_one(&producer, pool, &owner, &letter, options, None).await?;
        report.letters.push(Replayed {
            partition: letter.partition,
            offset: letter.offset,
            original_topic: letter.original_topic.clone(),
            original_partition: letter.original_partition,
            idempotency_key: letter.idempotency_key.clone(),
            outcome,
        });
    }
    Ok(report)
}

/// Why a replay by `options` to `owner`'s retry topic would refuse `letter`, if it would: a copy without
/// its payload, a letter of another group (a forged letter), or one replayed too often.
pub(crate) fn refusal(
    owner: &DlqOwner,
    letter: &DeadLetter,
    options: &ReplayOptions,
) -> Option<ReplayOutcome> {
    if let Some(problem) = &letter.unreadable {
        return Some(ReplayOutcome::RefusedUnreadable {
            problem: problem.clone(),
        });
    }
    if letter.truncated {
        return Some(ReplayOutcome::RefusedTruncated);
    }
    if letter.group != owner.group {
        return Some(ReplayOutcome::RefusedForeignGroup {
            group: letter.group.clone(),
        });
    }
    if letter.replay_count >= options.max_replays && !options.force {
        return Some(ReplayOutcome::RefusedReplayLimit {
            replays: letter.replay_count,
        });
    }
    None
}

/// Replays one letter (see [`replay`]). With `item`, the letter of a bulk operation (its id and the
/// letter's place in it), a send is recorded there in the transaction that records the replay, so that a
/// run that dies leaves both or neither.
pub(crate) async fn replay_one(
    producer: &rdkafka::producer::FutureProducer,
    pool: &PgPool,
    owner: &DlqOwner,
    letter: &DeadLetter,
    options: &ReplayOptions,
    item: Option<(i64, i32)>,
) -> Result<ReplayOutcome, AdminError> {
    if let Some(refused) = refusal(owner, letter, options) {
        return Ok(refused);
    }
    let identity = letter.identity();
    if options.dry_run {
        // Nothing is created: the table may not exist yet, and then nothing was replayed.
        let mut conn = pool.acquire().await?;
        let replayed = replayed_already(&mut conn, letter, &identity, false)
            .await
            .unwrap_or(false);
        return Ok(if replayed && !options.force {
            ReplayOutcome::AlreadyReplayed
        } else {
            ReplayOutcome::WouldSend
        });
    }
    // The claim: the letter's record, locked until the send is acknowledged and recorded. A run replaying
    // the same letter meanwhile waits for the lock, then finds it replayed. A run that dies between the
    // broker's acknowledgement and its commit leaves no record: a bulk operation, resumed, finds the letter
    // in the retry topic by its headers and records it instead of sending it again (`record_found`); a
    // single replay sends it again later, and its step key absorbs the duplicate.
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO saga_dlq_replays (dlq_topic, dlq_partition, dlq_offset, letter_hash, consumer_group, \
             original_topic, original_partition, original_offset) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
    )
    .bind(&letter.topic)
    .bind(letter.partition)
    .bind(letter.offset)
    .bind(&identity)
    .bind(&owner.group)
    .bind(&letter.original_topic)
    .bind(letter.original_partition)
    .bind(letter.original_offset)
    .execute(&mut *tx)
    .await?;
    if replayed_already(&mut tx, letter, &identity, true).await? && !options.force {
        tx.commit().await?;
        return Ok(ReplayOutcome::AlreadyReplayed);
    }
    let (partition, offset) = send(
        producer,
        owner,
        letter,
        &options.operator,
        &identity,
        item.map(|(operation, _)| operation),
    )
    .await?;
    let outcome = record_sent(
        &mut tx,
        owner,
        letter,
        &identity,
        options,
        (partition, offset),
    )
    .await?;
    if let Some((operation, seq)) = item {
        crate::operations::record_item(&mut tx, operation, seq, &outcome).await?;
    }
    tx.commit().await?;
    Ok(outcome)
}

/// Records in `tx` that `letter` (of identity `identity`) was sent to `owner`'s retry topic at `at`
/// (partition, offset): its claim marked replayed, the send logged with its operator. The claim row exists
/// (see [`replay_one`]).
pub(crate) async fn record_sent(
    tx: &mut sqlx::PgConnection,
    owner: &DlqOwner,
    letter: &DeadLetter,
    identity: &str,
    options: &ReplayOptions,
    (partition, offset): (i32, i64),
) -> Result<ReplayOutcome, AdminError> {
    sqlx::query(
        "UPDATE saga_dlq_replays SET replays = replays + 1, replayed_at = now(), replayed_by = $5 \
         WHERE dlq_topic = $1 AND dlq_partition = $2 AND dlq_offset = $3 AND letter_hash = $4",
    )
    .bind(&letter.topic)
    .bind(letter.partition)
    .bind(letter.offset)
    .bind(identity)
    .bind(&options.operator)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO saga_dlq_replay_log (dlq_topic, dlq_partition, dlq_offset, letter_hash, consumer_group, \
             operator, forced, retry_topic, retry_partition, retry_offset, idempotency_key, tenant_id) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
    )
    .bind(&letter.topic)
    .bind(letter.partition)
    .bind(letter.offset)
    .bind(identity)
    .bind(&owner.group)
    .bind(&options.operator)
    .bind(options.force)
    .bind(&owner.retry_topic)
    .bind(partition)
    .bind(offset)
    // As the index keeps them (a letter's key is whatever its message carried: a NUL, or more than an
    // index row holds, must not fail the record of a send already made).
    .bind(indexed_key(letter.idempotency_key.as_deref()))
    .bind(indexed_name(&letter.tenant))
    .execute(&mut *tx)
    .await?;
    Ok(ReplayOutcome::Sent {
        topic: owner.retry_topic.clone(),
        partition,
        offset,
    })
}

/// A letter's key as the index keeps it: see [`letters::indexable`].
pub(crate) fn indexed_key(name: Option<&str>) -> Option<String> {
    name.map(indexed_name)
}

/// A letter's name (its tenant, its key) as the index keeps it.
pub(crate) fn indexed_name(name: &str) -> String {
    letters::indexable(name, letters::MAX_INDEXED_NAME)
}

/// Records that `letter` reached `owner`'s retry topic at `at` (partition, offset) in a run of operation
/// `item.0` that died before recording it: claimed and recorded now, as [`replay_one`] would have, without
/// sending it again. `None` if another run recorded it meanwhile.
pub(crate) async fn record_found(
    pool: &PgPool,
    owner: &DlqOwner,
    letter: &DeadLetter,
    options: &ReplayOptions,
    at: (i32, i64),
    item: (i64, i32),
) -> Result<Option<ReplayOutcome>, AdminError> {
    let identity = letter.identity();
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO saga_dlq_replays (dlq_topic, dlq_partition, dlq_offset, letter_hash, consumer_group, \
             original_topic, original_partition, original_offset) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
    )
    .bind(&letter.topic)
    .bind(letter.partition)
    .bind(letter.offset)
    .bind(&identity)
    .bind(&owner.group)
    .bind(&letter.original_topic)
    .bind(letter.original_partition)
    .bind(letter.original_offset)
    .execute(&mut *tx)
    .await?;
    if replayed_already(&mut tx, letter, &identity, true).await? {
        tx.commit().await?;
        return Ok(None);
    }
    let outcome = record_sent(&mut tx, owner, letter, &identity, options, at).await?;
    crate::operations::record_item(&mut tx, item.0, item.1, &outcome).await?;
    tx.commit().await?;
    Ok(Some(outcome))
}

/// Whether `letter` was replayed: its own record says so (locked with `lock`), or a record written
/// before letters had an identity, at its position, of a replay after the letter was dead-lettered.
async fn replayed_already(
    conn: &mut sqlx::PgConnection,
    letter: &DeadLetter,
    identity: &str,
    lock: bool,
) -> Result<bool, sqlx::Error> {
    let own: Option<bool> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT replayed_at IS NOT NULL FROM saga_dlq_replays \
         WHERE dlq_topic = $1 AND dlq_partition = $2 AND dlq_offset = $3 AND letter_hash = $4{}",
        if lock { " FOR UPDATE" } else { "" }
    )))
    .bind(&letter.topic)
    .bind(letter.partition)
    .bind(letter.offset)
    .bind(identity)
    .fetch_optional(&mut *conn)
    .await?;
    if own == Some(true) {
        return Ok(true);
    }
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM saga_dlq_replays \
         WHERE dlq_topic = $1 AND dlq_partition = $2 AND dlq_offset = $3 AND letter_hash = '' \
           AND replayed_at >= $4)",
    )
    .bind(&letter.topic)
    .bind(letter.partition)
    .bind(letter.offset)
    .bind(letter.failed_at)
    .fetch_one(conn)
    .await
}

/// Produces `letter`'s message to `owner`'s retry topic, without the `dlq-*` headers and with the replay
/// headers (the count raised, the original coordinates, the operator, the letter and operation it came from);
/// once acknowledged.
async fn send(
    producer: &rdkafka::producer::FutureProducer,
    owner: &DlqOwner,
    letter: &DeadLetter,
    operator: &str,
    identity: &str,
    operation: Option<i64>,
) -> Result<(i32, i64), AdminError> {
    let count = (letter.replay_count + 1).to_string();
    let operation = operation.map(|o| o.to_string()).unwrap_or_default();
    let partition = letter.original_partition.to_string();
    let offset = letter.original_offset.to_string();
    replay::send(
        producer,
        replay::RetryMessage {
            retry_topic: &owner.retry_topic,
            key: letter.record.key.as_deref(),
            payload: letter.record.payload.as_deref(),
        },
        letter
            .record
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_deref())),
        |name| !name.starts_with(names::PREFIX) && !replay::ALL.contains(&name),
        &[
            (replay::REPLAY_COUNT, count.as_str()),
            (replay::ORIGINAL_TOPIC, letter.original_topic.as_str()),
            (replay::ORIGINAL_PARTITION, partition.as_str()),
            (replay::ORIGINAL_OFFSET, offset.as_str()),
            (replay::OPERATOR, operator),
            (replay::LETTER, identity),
            (replay::OPERATION, operation.as_str()),
        ],
    )
    .await
    .map_err(|e| AdminError::kafka_doing(format!("replaying to {}", owner.retry_topic), e))
}

/// One send of a replay, as `saga_dlq_replay_log` records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ReplayRecord {
    /// When it was sent.
    pub sent_at: DateTime<Utc>,
    /// Who sent it.
    pub operator: String,
    /// The dead-letter topic.
    pub dlq_topic: String,
    /// The letter's partition there.
    pub dlq_partition: i32,
    /// The letter's offset there.
    pub dlq_offset: i64,
    /// The consumer group it went back to.
    pub group: String,
    /// Where it went: the group's retry topic.
    pub retry_topic: String,
    /// Its partition there.
    pub retry_partition: i32,
    /// Its offset there.
    pub retry_offset: i64,
    /// The saga's key.
    pub idempotency_key: Option<String>,
    /// Its tenant.
    pub tenant: Option<String>,
    /// Whether it was forced (sent again although replayed, or over the replay limit).
    pub forced: bool,
}

/// The replays recorded in `pool`'s schema, newest first: of dead-letter topic `topic` (all when `None`),
/// at most `limit`.
pub async fn replays(
    pool: &PgPool,
    topic: Option<&str>,
    limit: i64,
) -> Result<Vec<ReplayRecord>, AdminError> {
    let recorded: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.tables \
         WHERE table_schema = current_schema() AND table_name = 'saga_dlq_replay_log')",
    )
    .fetch_one(pool)
    .await?;
    if !recorded {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(
        "SELECT sent_at, operator, dlq_topic, dlq_partition, dlq_offset, consumer_group, retry_topic, \
                retry_partition, retry_offset, idempotency_key, tenant_id, forced \
         FROM saga_dlq_replay_log WHERE ($1::text IS NULL OR dlq_topic = $1) \
         ORDER BY sent_at DESC, id DESC LIMIT $2",
    )
    .bind(topic)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(ReplayRecord {
                sent_at: r.try_get(0)?,
                operator: r.try_get(1)?,
                dlq_topic: r.try_get(2)?,
                dlq_partition: r.try_get(3)?,
                dlq_offset: r.try_get(4)?,
                group: r.try_get(5)?,
                retry_topic: r.try_get(6)?,
                retry_partition: r.try_get(7)?,
                retry_offset: r.try_get(8)?,
                idempotency_key: r.try_get(9)?,
                tenant: r.try_get(10)?,
                forced: r.try_get(11)?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(Into::into)
}

/// Every message of `topic` there is now, by partition and offset.
pub async fn read_topic(kafka: &KafkaConfig, topic: &str) -> Result<Vec<Record>, AdminError> {
    let ranges = crate::broker::partitions_of(kafka, topic)
        .await?
        .into_iter()
        .filter(|(_, low, high)| high > low)
        .collect();
    read(kafka, topic, ranges, usize::MAX).await
}

/// The messages of partition `partition` of `topic` from offset `from`, until `until` (excluded) or until
/// they hold `max_bytes` (keys, payloads and headers; at least one message is read).
pub(crate) async fn read_bounded(
    kafka: &KafkaConfig,
    topic: &str,
    partition: i32,
    from: i64,
    until: i64,
    max_bytes: usize,
) -> Result<Vec<Record>, AdminError> {
    read(kafka, topic, vec![(partition, from, until)], max_bytes).await
}

/// The messages of `topic` in the ranges (partition, from, until), by partition and offset, until they hold
/// `max_bytes`. A partition whose end comes first (offsets left out by compaction or transaction markers)
/// ends there.
async fn read(
    kafka: &KafkaConfig,
    topic: &str,
    ranges: Vec<(i32, i64, i64)>,
    max_bytes: usize,
) -> Result<Vec<Record>, AdminError> {
    if ranges.is_empty() {
        return Ok(Vec::new());
    }
    let mut config = saga_runtime::kafka::client_config(kafka);
    config
        .set("group.id", format!("saga-admin-{}", uuid::Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        // An offset retention deleted meanwhile is an error, never a jump to the end (which would look like
        // an empty range); what is fetched ahead stays small.
        .set("auto.offset.reset", "error")
        .set("queued.max.messages.kbytes", "16384")
        .set("fetch.max.bytes", "16777216");
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = config.create().map_err(AdminError::kafka)?;
        let mut tpl = TopicPartitionList::new();
        for (partition, from, _) in &ranges {
            tpl.add_partition_offset(&topic, *partition, Offset::Offset(*from))
                .map_err(AdminError::kafka)?;
        }
        consumer.assign(&tpl).map_err(AdminError::kafka)?;
        let mut until: BTreeMap<i32, i64> = ranges.iter().map(|(p, _, u)| (*p, *u)).collect();
        let mut records = Vec::new();
        let mut bytes = 0usize;
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !until.is_empty() && bytes < max_bytes {
            if std::time::Instant::now() > deadline {
                return Err(AdminError::kafka_said(format!(
                    "reading {topic} did not finish within 60 s"
                )));
            }
            let Some(message) = consumer.poll(Duration::from_millis(200)) else {
                continue;
            };
            let message = match message {
                Err(rdkafka::error::KafkaError::PartitionEOF(partition)) => {
                    until.remove(&partition);
                    continue;
                }
                other => other.map_err(AdminError::kafka)?,
            };
            let (partition, offset) = (message.partition(), message.offset());
            let Some(end) = until.get(&partition).copied() else {
                continue;
            };
            if offset < end {
                bytes += message.payload_len()
                    + message.key().map_or(0, <[u8]>::len)
                    + message.headers().map_or(0, |h| {
                        h.iter()
                            .map(|h| h.key.len() + h.value.map_or(0, <[u8]>::len))
                            .sum()
                    });
                records.push(Record {
                    partition,
                    offset,
                    key: message.key().map(<[u8]>::to_vec),
                    payload: message.payload().map(<[u8]>::to_vec),
                    headers: message
                        .headers()
                        .map(|h| {
                            h.iter()
                                .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                                .collect()
                        })
                        .unwrap_or_default(),
                    timestamp_ms: message.timestamp().to_millis(),
                });
            }
            if offset + 1 >= end {
                until.remove(&partition);
            }
        }
        records.sort_by_key(|r| (r.partition, r.offset));
        Ok(records)
    })
    .await
    .map_err(|e| AdminError::Kafka(saga_config::Cause::new(e)))?
}
