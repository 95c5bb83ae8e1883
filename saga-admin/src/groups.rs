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

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use saga_core::KafkaConfig;
use serde::Serialize;
use sha2::{Digest, Sha256};
use sqlx::PgPool;

use crate::dlq::{self, DeadLetter, DlqFilter};
use crate::error::AdminError;

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
}

/// The first line of `error`, with quoted values, UUIDs, long hexadecimal ids and numbers replaced by
/// placeholders (`"…"`, `<uuid>`, `<hex>`, `<n>`), spaces collapsed and at most 200 characters.
pub fn normalise(error: &str) -> String {
    let line = error
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    let chars: Vec<char> = line.chars().collect();
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        // A quoted value: up to the matching quote.
        if matches!(c, '"' | '\'' | '`')
            && let Some(len) = chars[i + 1..].iter().position(|&q| q == c)
        {
            out.push(c);
            out.push('…');
            out.push(c);
            i += len + 2;
            continue;
        }
        if c.is_ascii_alphanumeric() {
            // A word: letters, digits, '-', '_' and '.' between them.
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric()
                    || (matches!(chars[i], '-' | '_' | '.')
                        && chars.get(i + 1).is_some_and(char::is_ascii_alphanumeric)))
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            out.push_str(&normalise_word(&word));
            continue;
        }
        if c.is_whitespace() {
            if !out.ends_with(' ') {
                out.push(' ');
            }
        } else {
            out.push(c);
        }
        i += 1;
    }
    let out = out.trim();
    match out.char_indices().nth(200) {
        Some((cut, _)) => format!("{}…", &out[..cut]),
        None => out.to_owned(),
    }
}

/// A word of an error, or its placeholder: a UUID, a hexadecimal id of eight digits or more with a digit
/// in it, or a number (parts of a word that are numbers, as in `order-17`, are replaced alone).
fn normalise_word(word: &str) -> String {
    let is_hex = |s: &str| s.chars().all(|c| c.is_ascii_hexdigit());
    let parts: Vec<&str> = word.split('-').collect();
    if parts.len() == 5
        && parts.iter().map(|p| p.len()).eq([8, 4, 4, 4, 12])
        && parts.iter().all(|p| is_hex(p))
    {
        return "<uuid>".to_owned();
    }
    if word.len() >= 8 && is_hex(word) && word.chars().any(|c| c.is_ascii_digit()) {
        return "<hex>".to_owned();
    }
    // Numbers, alone or inside the word (`k-17`, `v2.3.1`, `42ms`).
    let mut out = String::with_capacity(word.len());
    let mut digits = false;
    for c in word.chars() {
        if c.is_ascii_digit() {
            if !digits {
                out.push_str("<n>");
                digits = true;
            }
        } else if digits && (c == '.' || c == ',') {
            // A decimal point or thousands separator inside a number stays in the placeholder.
        } else {
            digits = false;
            out.push(c);
        }
    }
    out
}

/// The id of the failure group `letter` belongs to.
pub fn group_id(letter: &DeadLetter) -> String {
    let cause = normalise(&letter.error);
    let mut hash = Sha256::new();
    for part in [
        letter.topic.as_str(),
        letter.group.as_str(),
        letter.step.as_deref().unwrap_or(""),
        letter.reason.as_str(),
        cause.as_str(),
    ] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    let digest = hash.finalize();
    format!(
        "g-{}",
        digest[..6]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    )
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

/// Every dead letter of `topics` with its group and state, by topic, partition and offset. Topics that do
/// not exist hold nothing.
pub async fn letters(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topics: &[String],
) -> Result<Vec<GroupedLetter>, AdminError> {
    let mut all = Vec::new();
    for topic in topics {
        let letters = match dlq::list(kafka, topic, &DlqFilter::default()).await {
            Ok(letters) => letters,
            Err(AdminError::BadInput(_)) if topics.len() > 1 => continue,
            Err(e) => return Err(e),
        };
        let states = states(pool, topic, &letters).await?;
        all.extend(
            letters
                .into_iter()
                .zip(states)
                .map(|(letter, state)| GroupedLetter {
                    group_id: group_id(&letter),
                    letter,
                    state,
                }),
        );
    }
    Ok(all)
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

/// The failure groups of `topics`, the most open letters first.
pub async fn groups(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topics: &[String],
) -> Result<Vec<FailureGroup>, AdminError> {
    Ok(group(&letters(kafka, pool, topics).await?))
}

/// Failure group `id` of `topics` and its letters; bad input if no letter of `topics` is in it.
pub async fn find(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topics: &[String],
    id: &str,
) -> Result<(FailureGroup, Vec<GroupedLetter>), AdminError> {
    let letters: Vec<GroupedLetter> = letters(kafka, pool, topics)
        .await?
        .into_iter()
        .filter(|l| l.group_id == id)
        .collect();
    let group = group(&letters).into_iter().next().ok_or_else(|| {
        AdminError::bad_input(format!(
            "no dead letter of {} is in failure group {id} (see `saga dlq groups`)",
            topics.join(", ")
        ))
    })?;
    Ok((group, letters))
}

/// A letter's partition and offset in its dead-letter topic.
type Position = (i32, i64);

/// The state of each of `letters` of dead-letter topic `topic`, in order.
async fn states(
    pool: &PgPool,
    topic: &str,
    letters: &[DeadLetter],
) -> Result<Vec<LetterState>, AdminError> {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = current_schema() \
         AND table_name IN ('saga_dlq_replays', 'saga_dlq_discards')",
    )
    .fetch_all(pool)
    .await?;
    // By position: (identity, replayed at); the identity is empty for records older than identities.
    let mut replayed: HashMap<Position, Vec<(String, DateTime<Utc>)>> = HashMap::new();
    if tables.iter().any(|t| t == "saga_dlq_replays") {
        let rows: Vec<(i32, i64, String, DateTime<Utc>)> = sqlx::query_as(
            "SELECT dlq_partition, dlq_offset, letter_hash, replayed_at FROM saga_dlq_replays \
             WHERE dlq_topic = $1 AND replayed_at IS NOT NULL",
        )
        .bind(topic)
        .fetch_all(pool)
        .await?;
        for (p, o, hash, at) in rows {
            replayed.entry((p, o)).or_default().push((hash, at));
        }
    }
    let mut discarded: HashMap<Position, Vec<String>> = HashMap::new();
    if tables.iter().any(|t| t == "saga_dlq_discards") {
        let rows: Vec<(i32, i64, String)> = sqlx::query_as(
            "SELECT dlq_partition, dlq_offset, letter_hash FROM saga_dlq_discards \
             WHERE dlq_topic = $1 AND undone_at IS NULL",
        )
        .bind(topic)
        .fetch_all(pool)
        .await?;
        for (p, o, hash) in rows {
            discarded.entry((p, o)).or_default().push(hash);
        }
    }
    Ok(letters
        .iter()
        .map(|l| {
            let position = (l.partition, l.offset);
            let identity = || l.identity();
            if let Some(records) = replayed.get(&position) {
                let id = identity();
                if records
                    .iter()
                    .any(|(hash, at)| *hash == id || (hash.is_empty() && *at >= l.failed_at))
                {
                    return LetterState::Replayed;
                }
            }
            if discarded
                .get(&position)
                .is_some_and(|hashes| hashes.contains(&identity()))
            {
                return LetterState::Discarded;
            }
            LetterState::Open
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_that_differ_only_in_values_normalise_alike() {
        let same = [
            (
                "order 17 not found",
                "order 4711 not found",
                "order <n> not found",
            ),
            (
                "duplicate key value violates unique constraint \"payments_pkey\"\nDETAIL: Key (order_id)=(5)",
                "duplicate key value violates unique constraint \"shipments_pkey\"",
                "duplicate key value violates unique constraint \"…\"",
            ),
            (
                "charge 0d9f1c2e-44aa-4b0e-9c1d-2f3a4b5c6d7e declined",
                "charge 7c1e2d3f-0000-4000-8000-000000000001 declined",
                "charge <uuid> declined",
            ),
            (
                "3 attempts failed; last error: gateway timed out after 1500ms (req 9f8e7d6c5b4a)",
                "5 attempts failed; last error: gateway timed out after 30.5ms (req 00ff00ff00ff)",
                "<n> attempts failed; last error: gateway timed out after <n>ms (req <hex>)",
            ),
            (
                "  key k-17   of tenant 'acme'  ",
                "key k-2 of tenant 'globex'",
                "key k-<n> of tenant '…'",
            ),
        ];
        for (a, b, expected) in same {
            assert_eq!(normalise(a), expected, "{a}");
            assert_eq!(normalise(b), expected, "{b}");
        }
        assert_ne!(normalise("card declined"), normalise("card expired"));
        assert_eq!(normalise("an unmatched \"quote"), "an unmatched \"quote");
        assert_eq!(normalise(""), "");
        assert!(normalise(&"x".repeat(500)).chars().count() <= 201);
        // Words that merely look like hexadecimal stay words.
        assert_eq!(normalise("deadbeef cafe facade"), "deadbeef cafe facade");
    }
}
