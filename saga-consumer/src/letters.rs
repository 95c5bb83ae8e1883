//! Dead letters as records: what a dead letter says (read from the headers the consumer wrote on it), its
//! identity, its failure group, and the index of dead letters in PostgreSQL (`saga_dead_letters`), which the
//! consumer writes when the broker acknowledged a letter, before the message's offset is committed, and
//! which the operators' toolkit reads instead of the topic.
//!
//! One reading serves both: the consumer indexes the letter it just wrote with the same [`LetterFields::read`]
//! the toolkit uses for a letter it finds in the topic, so a letter is indexed alike whoever indexed it.

use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};
use sqlx::PgConnection;

use crate::dlq::headers as names;

/// The `reason` of a letter whose `dlq-*` headers cannot be read (see [`LetterFields::read`]).
pub const UNREADABLE: &str = "unreadable";

/// A message's header: its name and value.
pub type HeaderPair = (String, Option<Vec<u8>>);

/// The text value of header `name` in `headers` (the first with a value).
pub fn header<'a>(headers: &'a [HeaderPair], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, v)| n == name && v.is_some())
        .and_then(|(_, v)| std::str::from_utf8(v.as_deref()?).ok())
}

/// What a dead letter's headers say.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LetterFields {
    /// The topic it was consumed from.
    pub original_topic: String,
    /// Its partition there (-1 where it cannot be read).
    pub original_partition: i32,
    /// Its offset there (-1 where it cannot be read).
    pub original_offset: i64,
    /// The consumer group that gave up on it (empty: none named).
    pub group: String,
    /// The step it was meant for, if one was found.
    pub step: Option<String>,
    /// Why: `undecodable`, `unknown-event-type`, `handler-failed`, `retries-exhausted`, `crash-loop`, or
    /// [`UNREADABLE`].
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
    /// How often the message had been replayed before it was dead-lettered this time.
    pub replay_count: u32,
    /// What is wrong with a letter whose `dlq-*` headers cannot be read: see [`LetterFields::read`].
    pub unreadable: Option<String>,
}

impl LetterFields {
    /// What `headers` say, or, naming the header, what is missing or malformed.
    pub fn parse(headers: &[HeaderPair]) -> Result<Self, String> {
        let required =
            |name: &str| header(headers, name).ok_or_else(|| format!("header {name} is missing"));
        let malformed = |name: &str, value: &str| format!("header {name} is malformed ({value:?})");
        let parsed = |name: &str| -> Result<i64, String> {
            let value = required(name)?;
            value.parse().map_err(|_| malformed(name, value))
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
        let replay_count = match header(headers, saga_runtime::replay::REPLAY_COUNT) {
            None => 0,
            Some(v) => v
                .parse()
                .map_err(|_| malformed(saga_runtime::replay::REPLAY_COUNT, v))?,
        };
        Ok(Self {
            original_topic: original_topic.to_owned(),
            original_partition,
            original_offset: parsed(names::ORIGINAL_OFFSET)?,
            group: header(headers, names::CONSUMER_GROUP)
                .unwrap_or_default()
                .to_owned(),
            step: header(headers, names::STEP)
                .filter(|s| !s.is_empty())
                .map(str::to_owned),
            reason: required(names::REASON)?.to_owned(),
            error: header(headers, names::ERROR).unwrap_or_default().to_owned(),
            attempts,
            failed_at,
            idempotency_key: header(headers, "idempotency-key").map(str::to_owned),
            tenant: header(headers, "tenant-id").unwrap_or("default").to_owned(),
            truncated: header(headers, names::TRUNCATED) == Some("true"),
            replay_count,
            unreadable: None,
        })
    }

    /// What `headers` say, whatever they hold: a letter whose `dlq-*` headers are missing or malformed (a
    /// message written to the topic by hand, or carrying a header the framework reads with a value it
    /// cannot) is an [`UNREADABLE`] one, with what is wrong in `unreadable` and `error`, and what could be
    /// read of the rest (`failed_at` falls back to the message's timestamp).
    pub fn read(headers: &[HeaderPair], timestamp_ms: Option<i64>) -> Self {
        match Self::parse(headers) {
            Ok(fields) => fields,
            Err(problem) => {
                let text = |name: &str| header(headers, name).map(str::to_owned);
                let number = |name: &str| text(name).and_then(|v| v.parse::<i64>().ok());
                Self {
                    original_topic: text(names::ORIGINAL_TOPIC).unwrap_or_default(),
                    original_partition: number(names::ORIGINAL_PARTITION)
                        .and_then(|p| i32::try_from(p).ok())
                        .unwrap_or(-1),
                    original_offset: number(names::ORIGINAL_OFFSET).unwrap_or(-1),
                    group: text(names::CONSUMER_GROUP).unwrap_or_default(),
                    step: text(names::STEP).filter(|s| !s.is_empty()),
                    reason: UNREADABLE.to_owned(),
                    error: format!("unreadable dead letter: {problem}"),
                    attempts: 0,
                    failed_at: text(names::FAILED_AT)
                        .and_then(|t| DateTime::parse_from_rfc3339(&t).ok())
                        .map(|t| t.with_timezone(&Utc))
                        .or_else(|| timestamp_ms.and_then(DateTime::<Utc>::from_timestamp_millis))
                        .unwrap_or_default(),
                    idempotency_key: text("idempotency-key"),
                    tenant: text("tenant-id").unwrap_or_else(|| "default".to_owned()),
                    truncated: header(headers, names::TRUNCATED) == Some("true"),
                    replay_count: 0,
                    unreadable: Some(problem),
                }
            }
        }
    }
}

/// A letter's identity: a hash of its original coordinates, key, value and headers (the `dlq-*` ones too,
/// so two letters of one message dead-lettered twice differ). A replay is recorded under the letter's
/// position and this, so that a new letter at a reused position (the topic deleted and recreated) is a new
/// letter.
pub fn identity(
    fields: &LetterFields,
    key: Option<&[u8]>,
    payload: Option<&[u8]>,
    headers: &[HeaderPair],
) -> String {
    let mut hash = Sha256::new();
    let mut field = |bytes: &[u8]| {
        hash.update((bytes.len() as u64).to_be_bytes());
        hash.update(bytes);
    };
    field(fields.original_topic.as_bytes());
    field(&fields.original_partition.to_be_bytes());
    field(&fields.original_offset.to_be_bytes());
    let optional = |v: Option<&[u8]>| v.map_or_else(|| vec![0], |v| [&[1u8][..], v].concat());
    field(&optional(key));
    field(&optional(payload));
    for (name, value) in headers {
        field(name.as_bytes());
        field(&optional(value.as_deref()));
    }
    hex(&hash.finalize())
}

/// The first line of `error`, with quoted values, UUIDs, long hexadecimal ids and numbers replaced by
/// placeholders (`"…"`, `<uuid>`, `<hex>`, `<n>`), spaces collapsed and at most 200 characters: the cause
/// of a failure, alike for letters that differ only in the values their errors name.
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

/// The failure group of a letter of `dlq_topic` with `fields`: `g-` and twelve hexadecimal digits of a hash
/// of its cause (its dead-letter topic, consumer group, step, reason and [normalised](normalise) error).
/// Stable across runs, the same for every operator. Every [`UNREADABLE`] letter of a topic is one group:
/// its headers are whatever a hand wrote, and a group (and a metric series) per value would let them
/// multiply without bound.
pub fn failure_group(dlq_topic: &str, fields: &LetterFields) -> String {
    let cause = normalise(&fields.error);
    let parts = if fields.unreadable.is_some() {
        [dlq_topic, "", "", UNREADABLE, ""]
    } else {
        [
            dlq_topic,
            fields.group.as_str(),
            fields.step.as_deref().unwrap_or(""),
            fields.reason.as_str(),
            cause.as_str(),
        ]
    };
    let mut hash = Sha256::new();
    for part in parts {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    format!("g-{}", hex(&hash.finalize()[..6]))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A dead letter as the index holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct IndexedLetter {
    /// The dead-letter topic.
    pub dlq_topic: String,
    /// Its partition there.
    pub partition: i32,
    /// Its offset there.
    pub offset: i64,
    /// Its [identity].
    pub letter_hash: String,
    /// Its [failure group](failure_group).
    pub failure_group: String,
    /// What its headers say.
    pub fields: LetterFields,
}

impl IndexedLetter {
    /// The letter at `partition` and `offset` of `dlq_topic`, with its key, payload, headers and timestamp.
    pub fn of(
        dlq_topic: &str,
        (partition, offset): (i32, i64),
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        headers: &[HeaderPair],
        timestamp_ms: Option<i64>,
    ) -> Self {
        let fields = LetterFields::read(headers, timestamp_ms);
        Self {
            dlq_topic: dlq_topic.to_owned(),
            partition,
            offset,
            letter_hash: identity(&fields, key, payload, headers),
            failure_group: failure_group(dlq_topic, &fields),
            fields,
        }
    }
}

/// The longest text of a letter the index keeps of a name (a key, a tenant, a topic, a step, a group, a
/// reason), in bytes; a dead letter's own `dlq-error` is at most 2 KiB, and the index keeps at most
/// [`MAX_INDEXED_ERROR`] of one.
pub const MAX_INDEXED_NAME: usize = 512;
/// The longest error the index keeps, in bytes.
pub const MAX_INDEXED_ERROR: usize = 4096;

/// `text` as the index can hold it, whatever a message carried: NUL characters (which PostgreSQL's text
/// refuses) replaced, at most `max` bytes (cut at a character boundary). A letter is indexed whatever its
/// headers hold: one crafted header never stops a partition or a listing.
pub fn indexable(text: &str, max: usize) -> String {
    let mut out: String = text.replace('\0', "\u{fffd}");
    if out.len() > max {
        let mut cut = max;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
    }
    out
}

/// Records `letters` in the index of `conn`'s schema (`saga_dead_letters`), idempotently by position: a
/// letter indexed already is left as it is, unless another letter now sits at its position (the topic
/// deleted and recreated), which replaces it. What a message carried is kept as the index can hold it
/// ([`indexable`]).
pub async fn index(conn: &mut PgConnection, letters: &[IndexedLetter]) -> Result<(), sqlx::Error> {
    if letters.is_empty() {
        return Ok(());
    }
    let name = |s: &str| indexable(s, MAX_INDEXED_NAME);
    let column = |f: &dyn Fn(&IndexedLetter) -> String| letters.iter().map(f).collect::<Vec<_>>();
    let optional =
        |f: &dyn Fn(&IndexedLetter) -> Option<String>| letters.iter().map(f).collect::<Vec<_>>();
    sqlx::query(
        "INSERT INTO saga_dead_letters (dlq_topic, dlq_partition, dlq_offset, letter_hash, failure_group, \
             cause, consumer_group, original_topic, original_partition, original_offset, step, reason, error, \
             attempts, failed_at, idempotency_key, tenant_id, truncated, replay_count, unreadable) \
         SELECT * FROM unnest($1::text[], $2::int[], $3::bigint[], $4::text[], $5::text[], $6::text[], \
             $7::text[], $8::text[], $9::int[], $10::bigint[], $11::text[], $12::text[], $13::text[], \
             $14::int[], $15::timestamptz[], $16::text[], $17::text[], $18::bool[], $19::int[], $20::text[]) \
         ON CONFLICT (dlq_topic, dlq_partition, dlq_offset) DO UPDATE SET \
             letter_hash = EXCLUDED.letter_hash, failure_group = EXCLUDED.failure_group, \
             cause = EXCLUDED.cause, consumer_group = EXCLUDED.consumer_group, \
             original_topic = EXCLUDED.original_topic, original_partition = EXCLUDED.original_partition, \
             original_offset = EXCLUDED.original_offset, step = EXCLUDED.step, reason = EXCLUDED.reason, \
             error = EXCLUDED.error, attempts = EXCLUDED.attempts, failed_at = EXCLUDED.failed_at, \
             idempotency_key = EXCLUDED.idempotency_key, tenant_id = EXCLUDED.tenant_id, \
             truncated = EXCLUDED.truncated, replay_count = EXCLUDED.replay_count, \
             unreadable = EXCLUDED.unreadable, indexed_at = now() \
         WHERE saga_dead_letters.letter_hash <> EXCLUDED.letter_hash",
    )
    .bind(column(&|l| name(&l.dlq_topic)))
    .bind(letters.iter().map(|l| l.partition).collect::<Vec<_>>())
    .bind(letters.iter().map(|l| l.offset).collect::<Vec<_>>())
    .bind(column(&|l| l.letter_hash.clone()))
    .bind(column(&|l| l.failure_group.clone()))
    .bind(column(&|l| indexable(&normalise(&l.fields.error), MAX_INDEXED_NAME)))
    .bind(column(&|l| name(&l.fields.group)))
    .bind(column(&|l| name(&l.fields.original_topic)))
    .bind(
        letters
            .iter()
            .map(|l| l.fields.original_partition)
            .collect::<Vec<_>>(),
    )
    .bind(
        letters
            .iter()
            .map(|l| l.fields.original_offset)
            .collect::<Vec<_>>(),
    )
    .bind(optional(&|l| l.fields.step.as_deref().map(name)))
    .bind(column(&|l| name(&l.fields.reason)))
    .bind(column(&|l| indexable(&l.fields.error, MAX_INDEXED_ERROR)))
    .bind(
        letters
            .iter()
            .map(|l| i32::try_from(l.fields.attempts).unwrap_or(i32::MAX))
            .collect::<Vec<_>>(),
    )
    .bind(letters.iter().map(|l| l.fields.failed_at).collect::<Vec<_>>())
    .bind(optional(&|l| l.fields.idempotency_key.as_deref().map(name)))
    .bind(column(&|l| name(&l.fields.tenant)))
    .bind(letters.iter().map(|l| l.fields.truncated).collect::<Vec<_>>())
    .bind(
        letters
            .iter()
            .map(|l| i32::try_from(l.fields.replay_count).unwrap_or(i32::MAX))
            .collect::<Vec<_>>(),
    )
    .bind(optional(&|l| {
        l.fields
            .unreadable
            .as_deref()
            .map(|u| indexable(u, MAX_INDEXED_ERROR))
    }))
    .execute(conn)
    .await?;
    Ok(())
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

    fn headers(pairs: &[(&str, &str)]) -> Vec<HeaderPair> {
        pairs
            .iter()
            .map(|(n, v)| ((*n).to_owned(), Some(v.as_bytes().to_vec())))
            .collect()
    }

    #[test]
    fn what_the_index_keeps_holds_no_nul_and_is_bounded() {
        assert_eq!(indexable("a\0b", 10), "a\u{fffd}b");
        assert_eq!(indexable("héllo", 2), "h");
        assert_eq!(
            indexable(&"k".repeat(5000), MAX_INDEXED_NAME).len(),
            MAX_INDEXED_NAME
        );
        assert_eq!(indexable("fine", MAX_INDEXED_NAME), "fine");
    }

    #[test]
    fn a_letter_whose_headers_cannot_be_read_is_unreadable_and_says_why() {
        let good = headers(&[
            ("saga-replay-count", "x"),
            ("dlq-original-topic", "orders"),
            ("dlq-original-partition", "1"),
            ("dlq-original-offset", "7"),
            ("dlq-reason", "handler-failed"),
            ("dlq-attempts", "2"),
            ("dlq-failed-at", "2026-11-26T07:00:00Z"),
        ]);
        let read = LetterFields::read(&good, None);
        assert_eq!(read.reason, UNREADABLE);
        assert_eq!(
            read.unreadable.as_deref(),
            Some("header saga-replay-count is malformed (\"x\")")
        );
        assert_eq!(
            (
                read.original_topic.as_str(),
                read.original_partition,
                read.original_offset
            ),
            ("orders", 1, 7)
        );
        let fine = LetterFields::read(&good[1..], None);
        assert_eq!(fine.unreadable, None);
        assert_eq!((fine.reason.as_str(), fine.attempts), ("handler-failed", 2));
        assert_ne!(failure_group("t.dlq", &read), failure_group("t.dlq", &fine));
        // Every unreadable letter of a topic is one group, whatever its headers say; another topic, another.
        let other_problem = LetterFields::read(
            &headers(&[
                ("dlq-consumer-group", "made-up-group"),
                ("dlq-step", "made-up-step"),
            ]),
            Some(0),
        );
        assert!(other_problem.unreadable.is_some());
        assert_ne!(other_problem.unreadable, read.unreadable);
        assert_eq!(
            failure_group("t.dlq", &read),
            failure_group("t.dlq", &other_problem)
        );
        assert_ne!(
            failure_group("t.dlq", &read),
            failure_group("u.dlq", &other_problem)
        );
    }
}
