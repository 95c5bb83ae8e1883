//! Dead letters: read a dead-letter topic, select by reason, step and age, show one, and replay them to their
//! original topic, once.
//!
//! A replay re-produces a dead letter's key, value and headers (the `dlq-*` headers dropped, the replay
//! counter [`REPLAY_COUNT_HEADER`] raised) to its original topic and partition with the idempotent
//! producer, and waits for the broker's acknowledgement. The table `saga_dlq_replays` (in the schema given)
//! records what was replayed, by dead-letter topic, partition and offset, so running the same replay again
//! sends nothing. A message replayed [`ReplayOptions::max_replays`] times already (it was dead-lettered
//! again after each) is refused unless forced. A replayed message that had already taken effect is a no-op
//! at its step: its step key is done.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use rdkafka::{Offset, TopicPartitionList};
use saga_runtime::kafka::KafkaConfig;
use serde::Serialize;
use sqlx::PgPool;
use sqlx::migrate::Migrator;

use crate::error::AdminError;

/// The header counting how often a message was replayed from a dead-letter topic.
pub const REPLAY_COUNT_HEADER: &str = "saga-replay-count";

/// The `dlq-*` headers the consumer writes (see `saga_consumer::dlq_headers`).
mod names {
    pub(super) const ORIGINAL_TOPIC: &str = "dlq-original-topic";
    pub(super) const ORIGINAL_PARTITION: &str = "dlq-original-partition";
    pub(super) const ORIGINAL_OFFSET: &str = "dlq-original-offset";
    pub(super) const CONSUMER_GROUP: &str = "dlq-consumer-group";
    pub(super) const STEP: &str = "dlq-step";
    pub(super) const REASON: &str = "dlq-reason";
    pub(super) const ERROR: &str = "dlq-error";
    pub(super) const ATTEMPTS: &str = "dlq-attempts";
    pub(super) const FAILED_AT: &str = "dlq-failed-at";
    pub(super) const TRUNCATED: &str = "dlq-truncated";
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
    /// The text value of header `name` (the first with a value).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, v)| n == name && v.is_some())
            .and_then(|(_, v)| std::str::from_utf8(v.as_deref()?).ok())
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
    /// The whole message.
    #[serde(skip)]
    pub record: Record,
}

impl DeadLetter {
    /// Reads the dead letter in `record` of `topic`; fails, naming the header, where a `dlq-*` header is
    /// missing or malformed.
    pub fn parse(topic: &str, record: Record) -> Result<Self, AdminError> {
        let at = format!("dead letter {topic}/{}/{}", record.partition, record.offset);
        let required = |name: &str| {
            record
                .header(name)
                .ok_or_else(|| AdminError::bad_input(format!("{at}: header {name} is missing")))
        };
        let parsed = |name: &str| -> Result<i64, AdminError> {
            let value = required(name)?;
            value.parse().map_err(|_| {
                AdminError::bad_input(format!("{at}: header {name} is malformed ({value:?})"))
            })
        };
        let malformed = |name: &str, value: &str| {
            AdminError::bad_input(format!("{at}: header {name} is malformed ({value:?})"))
        };
        let failed_at_text = required(names::FAILED_AT)?;
        let failed_at = DateTime::parse_from_rfc3339(failed_at_text)
            .map_err(|_| malformed(names::FAILED_AT, failed_at_text))?
            .with_timezone(&Utc);
        let original_partition =
            i32::try_from(parsed(names::ORIGINAL_PARTITION)?).map_err(|_| {
                malformed(
                    names::ORIGINAL_PARTITION,
                    required(names::ORIGINAL_PARTITION).unwrap_or(""),
                )
            })?;
        let attempts = u32::try_from(parsed(names::ATTEMPTS)?)
            .map_err(|_| malformed(names::ATTEMPTS, required(names::ATTEMPTS).unwrap_or("")))?;
        let original_topic = required(names::ORIGINAL_TOPIC)?;
        if original_topic.is_empty() {
            return Err(malformed(names::ORIGINAL_TOPIC, original_topic));
        }
        let replay_count = match record.header(REPLAY_COUNT_HEADER) {
            None => 0,
            Some(v) => v.parse().map_err(|_| malformed(REPLAY_COUNT_HEADER, v))?,
        };
        Ok(Self {
            topic: topic.to_owned(),
            partition: record.partition,
            offset: record.offset,
            original_topic: original_topic.to_owned(),
            original_partition,
            original_offset: parsed(names::ORIGINAL_OFFSET)?,
            group: record
                .header(names::CONSUMER_GROUP)
                .unwrap_or_default()
                .to_owned(),
            step: record
                .header(names::STEP)
                .filter(|s| !s.is_empty())
                .map(str::to_owned),
            reason: required(names::REASON)?.to_owned(),
            error: record.header(names::ERROR).unwrap_or_default().to_owned(),
            attempts,
            failed_at,
            idempotency_key: record.header("idempotency-key").map(str::to_owned),
            tenant: record.header("tenant-id").unwrap_or("default").to_owned(),
            truncated: record.header(names::TRUNCATED) == Some("true"),
            replay_count,
            record,
        })
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

/// The dead letters of `topic` that `filter` selects, oldest first (by partition and offset).
///
/// Fails with bad input if the topic does not exist, is not a dead-letter topic (a message without
/// `dlq-original-topic`), or holds a dead letter whose `dlq-*` headers are missing or malformed.
pub async fn list(
    kafka: &KafkaConfig,
    topic: &str,
    filter: &DlqFilter,
) -> Result<Vec<DeadLetter>, AdminError> {
    let records = read_topic(kafka, topic).await?;
    if let Some(stray) = records
        .iter()
        .find(|r| r.header(names::ORIGINAL_TOPIC).is_none())
    {
        return Err(AdminError::bad_input(format!(
            "{topic} is not a dead-letter topic: message {}/{} has no {} header",
            stray.partition,
            stray.offset,
            names::ORIGINAL_TOPIC
        )));
    }
    let now = Utc::now();
    let mut letters = Vec::new();
    for record in records {
        let letter = DeadLetter::parse(topic, record)?;
        if filter.accepts(&letter, now) {
            letters.push(letter);
        }
    }
    if let Some(limit) = filter.limit {
        letters.truncate(limit);
    }
    Ok(letters)
}

/// Dead letters by (dead-letter topic, reason): how many, over `topics`. Topics that do not exist count
/// nothing.
pub async fn counts(
    kafka: &KafkaConfig,
    topics: &[String],
) -> Result<BTreeMap<(String, String), usize>, AdminError> {
    let mut counts = BTreeMap::new();
    for topic in topics {
        let records = match read_topic(kafka, topic).await {
            Ok(records) => records,
            Err(AdminError::BadInput(_)) => continue,
            Err(e) => return Err(e),
        };
        for record in &records {
            let reason = record.header(names::REASON).unwrap_or("?").to_owned();
            *counts.entry((topic.clone(), reason)).or_default() += 1;
        }
    }
    Ok(counts)
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
    let records = read(kafka, topic, vec![(partition, offset, offset + 1)]).await?;
    records
        .into_iter()
        .next()
        .ok_or_else(|| AdminError::Kafka(format!("{topic}/{partition}/{offset} could not be read")))
}

/// The topics of the broker whose name ends in `.dlq` (the consumer's default dead-letter topics).
pub async fn discover_topics(kafka: &KafkaConfig) -> Result<Vec<String>, AdminError> {
    let config = saga_runtime::kafka::client_config(kafka);
    tokio::task::spawn_blocking(move || {
        let client: BaseConsumer = config.create()?;
        let metadata = client.fetch_metadata(None, Duration::from_secs(10))?;
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
    .map_err(|e| AdminError::Kafka(e.to_string()))?
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
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            dry_run: false,
            force: false,
            max_replays: 3,
        }
    }
}

/// What a replay did with one dead letter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum ReplayOutcome {
    /// Sent; the broker acknowledged it at this offset of the original topic.
    Sent {
        /// The replayed message's offset.
        offset: i64,
    },
    /// A dry run would send it.
    WouldSend,
    /// Replayed by an earlier run: not sent again.
    AlreadyReplayed,
    /// Replayed too often already (dead-lettered again each time): not sent.
    RefusedReplayLimit {
        /// How often it was replayed.
        replays: u32,
    },
    /// The dead-letter topic kept only a copy without its payload: there is nothing to replay.
    RefusedTruncated,
}

/// One dead letter of a replay and what happened to it.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Replayed {
    /// Its partition in the dead-letter topic.
    pub partition: i32,
    /// Its offset in the dead-letter topic.
    pub offset: i64,
    /// Where it went (or would go).
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

/// The toolkit's table (`saga_dlq_replays`), recorded in `_saga_admin_migrations`.
pub fn migrator() -> Migrator {
    saga_runtime::store::migrate::owned_by(sqlx::migrate!("./migrations"), "_saga_admin_migrations")
}

/// Replays the dead letters of `topic` that `filter` selects, recording each in `pool`'s schema (see the
/// module documentation).
pub async fn replay(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topic: &str,
    filter: &DlqFilter,
    options: &ReplayOptions,
) -> Result<ReplayReport, AdminError> {
    let letters = list(kafka, topic, filter).await?;
    if let Some(position) = filter.position
        && letters.is_empty()
    {
        return Err(AdminError::bad_input(format!(
            "{topic} has no dead letter at partition {} offset {} (that the filters select)",
            position.0, position.1
        )));
    }
    if !options.dry_run {
        migrator()
            .run(pool)
            .await
            .map_err(|e| AdminError::Store(format!("applying the toolkit's migration: {e}")))?;
    }
    let producer = saga_runtime::kafka::idempotent_producer(
        kafka,
        Duration::from_millis(1),
        Duration::from_secs(30),
    )?;
    let mut report = ReplayReport::default();
    for letter in letters {
        let outcome = replay_one(&producer, pool, &letter, options).await?;
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

async fn replay_one(
    producer: &rdkafka::producer::FutureProducer,
    pool: &PgPool,
    letter: &DeadLetter,
    options: &ReplayOptions,
) -> Result<ReplayOutcome, AdminError> {
    if letter.truncated {
        return Ok(ReplayOutcome::RefusedTruncated);
    }
    if letter.replay_count >= options.max_replays && !options.force {
        return Ok(ReplayOutcome::RefusedReplayLimit {
            replays: letter.replay_count,
        });
    }
    if !options.dry_run {
        // Claim it first: a second run finds it; a run that stopped between the send and the record
        // (replayed_at NULL) sends again, and the step key absorbs the duplicate.
        sqlx::query(
            "INSERT INTO saga_dlq_replays \
                 (dlq_topic, dlq_partition, dlq_offset, original_topic, original_partition, original_offset) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
        )
        .bind(&letter.topic)
        .bind(letter.partition)
        .bind(letter.offset)
        .bind(&letter.original_topic)
        .bind(letter.original_partition)
        .bind(letter.original_offset)
        .execute(pool)
        .await?;
    }
    let replayed: Result<Option<bool>, sqlx::Error> = sqlx::query_scalar(
        "SELECT replayed_at IS NOT NULL FROM saga_dlq_replays \
         WHERE dlq_topic = $1 AND dlq_partition = $2 AND dlq_offset = $3",
    )
    .bind(&letter.topic)
    .bind(letter.partition)
    .bind(letter.offset)
    .fetch_optional(pool)
    .await;
    // A dry run creates nothing, so the table may not exist yet: then nothing was replayed.
    let replayed = if options.dry_run {
        replayed.unwrap_or(None)
    } else {
        replayed?
    };
    if replayed == Some(true) && !options.force {
        return Ok(ReplayOutcome::AlreadyReplayed);
    }
    if options.dry_run {
        return Ok(ReplayOutcome::WouldSend);
    }
    let offset = send(producer, letter).await?;
    sqlx::query(
        "UPDATE saga_dlq_replays SET replays = replays + 1, replayed_at = now() \
         WHERE dlq_topic = $1 AND dlq_partition = $2 AND dlq_offset = $3",
    )
    .bind(&letter.topic)
    .bind(letter.partition)
    .bind(letter.offset)
    .execute(pool)
    .await?;
    Ok(ReplayOutcome::Sent { offset })
}

/// Produces `letter`'s message to its original topic and partition, without the `dlq-*` headers and with
/// the replay counter raised; returns the new offset once acknowledged.
async fn send(
    producer: &rdkafka::producer::FutureProducer,
    letter: &DeadLetter,
) -> Result<i64, AdminError> {
    let count = (letter.replay_count + 1).to_string();
    let mut headers = OwnedHeaders::new();
    for (name, value) in &letter.record.headers {
        if name.starts_with(names::PREFIX) || name == REPLAY_COUNT_HEADER {
            continue;
        }
        headers = headers.insert(Header {
            key: name,
            value: value.as_deref(),
        });
    }
    headers = headers.insert(Header {
        key: REPLAY_COUNT_HEADER,
        value: Some(count.as_str()),
    });
    let mut record = FutureRecord::<[u8], [u8]>::to(&letter.original_topic)
        .partition(letter.original_partition)
        .headers(headers);
    if let Some(key) = letter.record.key.as_deref() {
        record = record.key(key);
    }
    if let Some(payload) = letter.record.payload.as_deref() {
        record = record.payload(payload);
    }
    let delivered = producer
        .send(record, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| {
            AdminError::Kafka(format!("replaying to {}: {e}", letter.original_topic))
        })?;
    Ok(delivered.offset)
}

/// Every message of `topic` there is now, by partition and offset.
pub async fn read_topic(kafka: &KafkaConfig, topic: &str) -> Result<Vec<Record>, AdminError> {
    let ranges = crate::broker::partitions_of(kafka, topic)
        .await?
        .into_iter()
        .filter(|(_, low, high)| high > low)
        .collect();
    read(kafka, topic, ranges).await
}

/// The messages of `topic` in the ranges (partition, from, until), by partition and offset.
async fn read(
    kafka: &KafkaConfig,
    topic: &str,
    ranges: Vec<(i32, i64, i64)>,
) -> Result<Vec<Record>, AdminError> {
    if ranges.is_empty() {
        return Ok(Vec::new());
    }
    let mut config = saga_runtime::kafka::client_config(kafka);
    config
        .set("group.id", format!("saga-admin-{}", uuid::Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false");
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = config.create()?;
        let mut tpl = TopicPartitionList::new();
        for (partition, from, _) in &ranges {
            tpl.add_partition_offset(&topic, *partition, Offset::Offset(*from))?;
        }
        consumer.assign(&tpl)?;
        let mut until: BTreeMap<i32, i64> = ranges.iter().map(|(p, _, u)| (*p, *u)).collect();
        let mut records = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !until.is_empty() {
            if std::time::Instant::now() > deadline {
                return Err(AdminError::Kafka(format!(
                    "reading {topic} did not finish within 60 s"
                )));
            }
            let Some(message) = consumer.poll(Duration::from_millis(200)) else {
                continue;
            };
            let message = message?;
            let (partition, offset) = (message.partition(), message.offset());
            let Some(end) = until.get(&partition).copied() else {
                continue;
            };
            if offset < end {
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
    .map_err(|e| AdminError::Kafka(e.to_string()))?
}
