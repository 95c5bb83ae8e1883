//! Kafka client plumbing: configuration, the idempotent producer, topics, and header conversion between
//! saga-core's [`Headers`] and rdkafka's.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureProducer;
use saga_core::Headers;

pub use crate::kafka_probe::{probe, refusal};
pub use saga_config::KafkaConfig;

/// The variable naming the brokers.
pub const BROKERS_VAR: &str = "KAFKA_BROKERS";

/// A librdkafka configuration for `config` with the settings every client of the framework uses.
pub fn client_config(config: &KafkaConfig) -> ClientConfig {
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", &config.brokers)
        // Brokers here listen on IPv4; `localhost` may resolve to ::1 first.
        .set("broker.address.family", "v4");
    for (name, value) in &config.properties {
        client.set(name, value);
    }
    client
}

/// An idempotent producer (`enable.idempotence=true`, which implies `acks=all` and keeps per-partition
/// order across retries). `linger` trades latency for batching; `message_timeout` of zero waits forever
/// for the broker, which the relay wants (a broker outage must not fail rows).
pub fn idempotent_producer(
    config: &KafkaConfig,
    linger: Duration,
    message_timeout: Duration,
) -> Result<FutureProducer, KafkaError> {
    producer_config(config, linger, message_timeout).create()
}

/// The configuration of an idempotent producer, for callers that add settings of their own. Keys are
/// partitioned with murmur2, as Kafka's Java clients do, so that both put a key on the same partition.
pub fn producer_config(
    config: &KafkaConfig,
    linger: Duration,
    message_timeout: Duration,
) -> ClientConfig {
    let mut client = client_config(config);
    client
        .set("enable.idempotence", "true")
        .set("partitioner", "murmur2_random")
        .set("linger.ms", linger.as_millis().to_string())
        .set(
            "message.timeout.ms",
            message_timeout.as_millis().to_string(),
        );
    for (name, value) in &config.properties {
        client.set(name, value);
    }
    client
}

/// Creates the topics that do not exist yet, with `partitions` partitions and replication factor
/// `replication`. Topics that exist are left as they are.
pub async fn ensure_topics(
    config: &KafkaConfig,
    topics: &[&str],
    partitions: i32,
    replication: i32,
) -> Result<(), KafkaError> {
    let admin: AdminClient<DefaultClientContext> = client_config(config).create()?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| NewTopic::new(t, partitions, TopicReplication::Fixed(replication)))
        .collect();
    let results = admin
        .create_topics(
            &new,
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((_, code)) => return Err(KafkaError::AdminOp(code)),
        }
    }
    Ok(())
}

/// How long the broker keeps the messages of each of `topics` (`retention.ms`): `Some(None)` for ever
/// (`-1`), `None` when the broker does not say (Kafka's default is then 7 days).
pub async fn topic_retentions(
    config: &KafkaConfig,
    topics: &[&str],
) -> Result<Vec<(String, Option<Option<Duration>>)>, KafkaError> {
    use rdkafka::admin::ResourceSpecifier;
    let admin: AdminClient<DefaultClientContext> = client_config(config).create()?;
    let specifiers: Vec<ResourceSpecifier<'_>> =
        topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
    let results = admin
        .describe_configs(
            &specifiers,
            &AdminOptions::new().request_timeout(Some(Duration::from_secs(30))),
        )
        .await?;
    let mut retentions = Vec::with_capacity(topics.len());
    for (topic, result) in topics.iter().zip(results) {
        let resource = result.map_err(KafkaError::AdminOp)?;
        let retention = resource
            .entries
            .iter()
            .find(|e| e.name == "retention.ms")
            .and_then(|e| e.value.as_deref())
            .and_then(|v| v.trim().parse::<i64>().ok())
            .map(|ms| u64::try_from(ms).ok().map(Duration::from_millis));
        retentions.push(((*topic).to_owned(), retention));
    }
    Ok(retentions)
}

/// One partition's watermarks: the first offset the broker still keeps and the next it will write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Watermarks {
    /// The partition.
    pub partition: i32,
    /// The first offset the broker keeps: above 0 once retention (or a deletion) dropped earlier messages.
    pub low: i64,
    /// The next offset the broker will write.
    pub high: i64,
}

/// The watermarks of every partition of `topic`, in partition order, or `None` when the broker does not
/// know the topic (another error the broker reports of the topic is an error). The requests block, so they run on tokio's blocking pool.
pub async fn watermarks(
    config: &KafkaConfig,
    topic: &str,
) -> Result<Option<Vec<Watermarks>>, KafkaError> {
    let config = client_config(config);
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let timeout = Duration::from_secs(10);
        let client: BaseConsumer = config.create()?;
        let metadata = client.fetch_metadata(Some(&topic), timeout)?;
        let Some(found) = metadata.topics().iter().find(|t| t.name() == topic) else {
            return Ok(None);
        };
        // Only an unknown topic is one the broker does not know: another error (the user may not read
        // it, its leader is being elected) is the broker's answer, not an empty topic.
        match found.error().map(RDKafkaErrorCode::from) {
            None => {}
            Some(RDKafkaErrorCode::UnknownTopicOrPartition) => return Ok(None),
            Some(code) => return Err(KafkaError::MetadataFetch(code)),
        }
        if found.partitions().is_empty() {
            return Ok(None);
        }
        let mut partitions: Vec<i32> = found.partitions().iter().map(|p| p.id()).collect();
        partitions.sort_unstable();
        partitions
            .into_iter()
            .map(|partition| {
                let (low, high) = client.fetch_watermarks(&topic, partition, timeout)?;
                Ok(Watermarks {
                    partition,
                    low,
                    high,
                })
            })
            .collect::<Result<Vec<_>, KafkaError>>()
            .map(Some)
    })
    .await
    .map_err(|_| KafkaError::Canceled)?
}

/// Whether a produce error means the broker (or the client) refuses this message for good, so that
/// producing it again cannot succeed: it is too large, or not a valid record. Other errors are transient (the
/// producer retries those itself, or they concern the connection).
pub fn refused_for_good(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::MessageBatchTooLarge
            | RDKafkaErrorCode::InvalidRecord
            | RDKafkaErrorCode::InvalidMessage
            | RDKafkaErrorCode::InvalidMessageSize
    )
}

/// Converts saga-core headers to rdkafka headers.
pub fn to_kafka_headers(headers: &Headers) -> OwnedHeaders {
    headers.iter().fold(
        OwnedHeaders::new_with_capacity(headers.len()),
        |h, header| {
            h.insert(Header {
                key: &header.name,
                value: header.value.as_deref(),
            })
        },
    )
}

/// Converts text header pairs (as stored in the outbox) to rdkafka headers.
pub fn pairs_to_kafka_headers(pairs: &[(String, String)]) -> OwnedHeaders {
    pairs
        .iter()
        .fold(OwnedHeaders::new_with_capacity(pairs.len()), |h, (n, v)| {
            h.insert(Header {
                key: n,
                value: Some(v.as_bytes()),
            })
        })
}

/// Converts rdkafka headers to saga-core headers. Header names that are not UTF-8 are kept lossily.
pub fn from_kafka_headers<H: rdkafka::message::Headers>(headers: Option<&H>) -> Headers {
    let mut out = Headers::new();
    if let Some(headers) = headers {
        for header in headers.iter() {
            out.push(header.key.to_owned(), header.value.map(<[u8]>::to_vec));
        }
    }
    out
}
