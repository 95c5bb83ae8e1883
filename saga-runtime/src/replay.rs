//! Replays of dead letters: the headers a replayed message carries, shared by the `saga` command (which
//! writes them) and the consumer (which reads them).
//!
//! A dead letter is replayed into its consumer group's retry topic, never into its original topic, so no
//! other group reading the original topic sees it. The replayed message keeps its key, value and headers
//! (but the `dlq-*` ones) and says where it first came from, so that the consumer routes it to the step
//! that subscribes to the original topic and its event type, and a dead letter of it names the original
//! coordinates again.

use saga_core::{Headers, Origin};

/// How often the message was replayed from a dead-letter topic.
pub const REPLAY_COUNT: &str = "saga-replay-count";
/// The topic the message was first consumed from.
pub const ORIGINAL_TOPIC: &str = "saga-replay-original-topic";
/// Its partition there.
pub const ORIGINAL_PARTITION: &str = "saga-replay-original-partition";
/// Its offset there.
pub const ORIGINAL_OFFSET: &str = "saga-replay-original-offset";
/// Who replayed it.
pub const OPERATOR: &str = "saga-replay-operator";
/// The identity of the dead letter it was replayed from (its position's content hash).
pub const LETTER: &str = "saga-replay-letter";
/// The bulk operation that replayed it, if one did: a resumed operation finds what it sent before a crash
/// by this and [`LETTER`].
pub const OPERATION: &str = "saga-replay-operation";
/// A release of a held key's parked message: its sequence number in `saga_parked_messages` (the consumer
/// runs it only in its turn, see saga-consumer's `hold`).
pub const RELEASE: &str = "saga-release-seq";
/// Every header name of a replay, which a new replay replaces.
pub const ALL: [&str; 8] = [
    REPLAY_COUNT,
    ORIGINAL_TOPIC,
    ORIGINAL_PARTITION,
    ORIGINAL_OFFSET,
    OPERATOR,
    LETTER,
    OPERATION,
    RELEASE,
];

/// A message a group's retry topic receives: a replay of a dead letter, or a release of a held key's parked
/// message.
#[derive(Debug, Clone, Copy)]
pub struct RetryMessage<'a> {
    /// The group's retry topic.
    pub retry_topic: &'a str,
    /// The message's key.
    pub key: Option<&'a [u8]>,
    /// Its payload.
    pub payload: Option<&'a [u8]>,
}

/// Produces `message` with the headers of `headers` that `keep` lets through, then `set` (those with an
/// empty value left out); once the broker acknowledged it, its partition and offset.
pub async fn send<'a>(
    producer: &rdkafka::producer::FutureProducer,
    message: RetryMessage<'_>,
    headers: impl IntoIterator<Item = (&'a str, Option<&'a [u8]>)>,
    keep: impl Fn(&str) -> bool,
    set: &[(&str, &str)],
) -> Result<(i32, i64), rdkafka::error::KafkaError> {
    use rdkafka::message::{Header, OwnedHeaders};
    let mut owned = OwnedHeaders::new();
    for (key, value) in headers.into_iter().filter(|(name, _)| keep(name)) {
        owned = owned.insert(Header { key, value });
    }
    for (key, value) in set.iter().filter(|(_, value)| !value.is_empty()) {
        owned = owned.insert(Header {
            key,
            value: Some(*value),
        });
    }
    let mut record =
        rdkafka::producer::FutureRecord::<[u8], [u8]>::to(message.retry_topic).headers(owned);
    if let Some(key) = message.key {
        record = record.key(key);
    }
    if let Some(payload) = message.payload {
        record = record.payload(payload);
    }
    let delivered = producer
        .send(record, std::time::Duration::from_secs(30))
        .await
        .map_err(|(e, _)| e)?;
    Ok((delivered.partition, delivered.offset))
}

/// Why a message on a retry topic cannot be routed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "a message on the retry topic needs the header {0} (a replay of `saga dlq replay` carries it)"
)]
pub struct NotAReplay(pub &'static str);

/// Where a replayed message was first consumed, from its replay headers.
pub fn original_of(headers: &Headers) -> Result<Origin, NotAReplay> {
    let text = |name: &'static str| {
        headers
            .get_str(name)
            .ok()
            .flatten()
            .filter(|v| !v.is_empty())
            .ok_or(NotAReplay(name))
    };
    Ok(Origin {
        topic: text(ORIGINAL_TOPIC)?.to_owned(),
        partition: text(ORIGINAL_PARTITION)?
            .parse()
            .map_err(|_| NotAReplay(ORIGINAL_PARTITION))?,
        offset: text(ORIGINAL_OFFSET)?
            .parse()
            .map_err(|_| NotAReplay(ORIGINAL_OFFSET))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_original_coordinates_are_read_and_a_missing_or_bad_one_named() {
        let headers = Headers::new()
            .with(ORIGINAL_TOPIC, "orders")
            .with(ORIGINAL_PARTITION, "3")
            .with(ORIGINAL_OFFSET, "41");
        assert_eq!(
            original_of(&headers),
            Ok(Origin {
                topic: "orders".into(),
                partition: 3,
                offset: 41
            })
        );
        let bad = Headers::new()
            .with(ORIGINAL_TOPIC, "orders")
            .with(ORIGINAL_PARTITION, "three")
            .with(ORIGINAL_OFFSET, "41");
        assert_eq!(original_of(&bad), Err(NotAReplay(ORIGINAL_PARTITION)));
        assert_eq!(
            original_of(&Headers::new()),
            Err(NotAReplay(ORIGINAL_TOPIC))
        );
    }
}
