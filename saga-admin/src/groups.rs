//! Failure groups: dead letters grouped by a fingerprint of their cause, so that an operator sees "412
//! payments failed with `card processor timed out`" instead of 412 letters.
//!
//! A letter's cause is its dead-letter topic, its consumer group, its step, its reason and the first line of
//! its error **normalised**: quoted values, UUIDs, long hexadecimal ids and numbers are replaced by
//! placeholders, so that `order 17 not found` and `order 4711 not found` fall into one group and
//! `duplicate key ... "payments_pkey"` does not split by the values it quotes. The group's id is a hash of
//! the cause (`g-` and twelve hexadecimal digits): stable across runs, the same for every operator.
//!
//! A letter is **open** until it is replayed (`saga_dlq_replays`) or discarded (`saga_dlq_discards`, see
//! [`crate::operations`]); a group's `open` count is what needs an operator.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use saga_config::KafkaConfig;
use serde::Serialize;
use sqlx::PgPool;

use saga_consumer::admin::letters;

use crate::dlq::DeadLetter;
use crate::error::AdminError;
use crate::index;

/// What became of a dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum LetterState {
    /// Neither replayed nor discarded.
    Open,
    /// Replayed to its group's retry topic.
    Replayed,
    /// Discarded: resolved without sending (reversible).
    Discarded,
}

impl LetterState {
    /// The state in a word.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Open => "open",
            Self::Replayed => "replayed",
            Self::Discarded => "discarded",
        }
    }
}

/// A dead letter with its failure group and its state.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct GroupedLetter {
    /// The letter.
    #[serde(flatten)]
    pub letter: DeadLetter,
    /// Its failure group's id.
    pub group_id: String,
    /// What became of it.
    pub state: LetterState,
}

/// Dead letters that share a cause.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct FailureGroup {
    /// The group's id: `g-` and twelve hexadecimal digits of the cause's hash.
    pub id: String,
    /// The dead-letter topic.
    pub dlq_topic: String,
    /// The consumer group that gave up on the letters.
    pub consumer_group: String,
    /// Their step, if one was found.
    pub step: Option<String>,
    /// Their `dlq-reason`.
    pub reason: String,
    /// The first line of their error, normalised (see the module documentation).
    pub cause: String,
    /// Letters neither replayed nor discarded.
    pub open: usize,
    /// Every letter of the group.
    pub total: usize,
    /// When the first was dead-lettered.
    pub first_seen: DateTime<Utc>,
    /// When the last was dead-lettered.
    pub last_seen: DateTime<Utc>,
    /// The error of the group's latest letter, as it was.
    pub example_error: String,
    /// The position of that letter in the dead-letter topic.
    pub example_position: (i32, i64),
    /// Keys held behind letters of the group (their head letters are in it): their later messages wait,
    /// parked, until the head is replayed and succeeds or is discarded (see [`crate::holds`]).
    pub held_keys: i64,
    /// Messages parked behind those keys.
    pub parked: i64,
    /// Seconds since the oldest of those holds began.
    pub oldest_held_seconds: Option<i64>,
}

impl FailureGroup {
    /// The keys its letters hold, in words: how many, the messages parked behind them and the oldest
    /// hold's age (empty if none).
    pub fn held_summary(&self) -> String {
        match self.oldest_held_seconds {
            Some(age) if self.held_keys > 0 => format!(
                "{} ({} parked, oldest {})",
                self.held_keys,
                self.parked,
                crate::duration::human(std::time::Duration::from_secs(age.max(0) as u64))
            ),
            _ => String::new(),
        }
    }
}

pub use saga_consumer::admin::letters::normalise;

/// The id of the failure group `letter` belongs to.
pub fn group_id(letter: &DeadLetter) -> String {
    letters::failure_group(&letter.topic, &letter.fields())
}

/// The dead-letter topics the consumer groups of `pool`'s schema recorded (`saga_consumer_groups`).
pub async fn dlq_topics_of(pool: &PgPool) -> Result<Vec<String>, AdminError> {
    let recorded: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.tables \
         WHERE table_schema = current_schema() AND table_name = 'saga_consumer_groups')",
    )
    .fetch_one(pool)
    .await?;
    if !recorded {
        return Ok(Vec::new());
    }
    Ok(
        sqlx::query_scalar("SELECT DISTINCT dlq_topic FROM saga_consumer_groups ORDER BY 1")
            .fetch_all(pool)
            .await?,
    )
}

/// Every dead letter of `topics` with its group and state, by topic, partition and offset, as the
/// dead-letter index of `pool`'s schema holds them (see [`crate::index`]; their records empty). Topics that
/// do not exist hold nothing.
pub async fn letters(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topics: &[String],
) -> Result<Vec<GroupedLetter>, AdminError> {
    index::sync_all(kafka, pool, topics).await?;
    index::letters(
        pool,
        &index::Selection {
            topics,
            ..index::Selection::default()
        },
    )
    .await
}

/// The failure groups of `letters`, the most open letters first.
pub fn group(letters: &[GroupedLetter]) -> Vec<FailureGroup> {
    let mut groups: BTreeMap<&str, FailureGroup> = BTreeMap::new();
    for grouped in letters {
        let l = &grouped.letter;
        let g = groups
            .entry(grouped.group_id.as_str())
            .or_insert_with(|| FailureGroup {
                id: grouped.group_id.clone(),
                dlq_topic: l.topic.clone(),
                consumer_group: l.group.clone(),
                step: l.step.clone(),
                reason: l.reason.clone(),
                cause: normalise(&l.error),
                open: 0,
                total: 0,
                first_seen: l.failed_at,
                last_seen: l.failed_at,
                example_error: l.error.clone(),
                example_position: (l.partition, l.offset),
                held_keys: 0,
                parked: 0,
                oldest_held_seconds: None,
            });
        g.total += 1;
        if grouped.state == LetterState::Open {
            g.open += 1;
        }
        g.first_seen = g.first_seen.min(l.failed_at);
        if l.failed_at >= g.last_seen {
            g.last_seen = l.failed_at;
            g.example_error.clone_from(&l.error);
            g.example_position = (l.partition, l.offset);
        }
    }
    let mut groups: Vec<FailureGroup> = groups.into_values().collect();
    groups.sort_by(|a, b| {
        b.open
            .cmp(&a.open)
            .then(b.last_seen.cmp(&a.last_seen))
            .then(a.id.cmp(&b.id))
    });
    groups
}

/// The failure groups of `topics`, the most open letters first, counted in the dead-letter index of
/// `pool`'s schema (no letter is loaded).
pub async fn groups(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topics: &[String],
) -> Result<Vec<FailureGroup>, AdminError> {
    index::sync_all(kafka, pool, topics).await?;
    let mut groups = index::groups(pool, topics).await?;
    let held = crate::holds::by_failure_group(pool, topics).await?;
    for g in &mut groups {
        if let Some(&(keys, parked, oldest)) = held.get(&(g.dlq_topic.clone(), g.id.clone())) {
            g.held_keys = keys;
            g.parked = parked;
            g.oldest_held_seconds = Some(oldest);
        }
    }
    Ok(groups)
}

/// Failure group `id` of `topics` and its letters; bad input if no letter of `topics` is in it.
pub async fn find(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topics: &[String],
    id: &str,
) -> Result<(FailureGroup, Vec<GroupedLetter>), AdminError> {
    index::sync_all(kafka, pool, topics).await?;
    let letters = index::letters(
        pool,
        &index::Selection {
            topics,
            group: Some(id),
            ..index::Selection::default()
        },
    )
    .await?;
    let group = group(&letters).into_iter().next().ok_or_else(|| {
        AdminError::bad_input(format!(
            "no dead letter of {} is in failure group {id} (see `saga dlq groups`)",
            topics.join(", ")
        ))
    })?;
    Ok((group, letters))
}
