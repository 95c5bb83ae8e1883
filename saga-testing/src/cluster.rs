//! librdkafka's mock cluster inside the test process, and the kit's clients of it: producing the test's
//! events, reading topics back, a group's committed offsets against the topics' ends, and rewinding a
//! group.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::Message as _;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{
    BaseProducer, DefaultProducerContext, FutureProducer, FutureRecord, Producer,
};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use saga_consumer::{Headers, Origin, RawMessage};

use crate::KitError;
use crate::error::kafka;

/// How long one request to the mock cluster may take.
const REQUEST: Duration = Duration::from_secs(10);

/// The group id of the kit's readers (it never joins it).
const READER: &str = "saga-testing-reader";

/// Where one partition stands for a consumer group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Position {
    /// The group's committed offset (the partition's start when it committed none).
    pub committed: i64,
    /// The partition's start (its low watermark).
    pub low: i64,
    /// The partition's end (its high watermark).
    pub end: i64,
}

/// The mock cluster and its clients.
pub(crate) struct Cluster {
    brokers: String,
    partitions: i32,
    producer: FutureProducer,
    created: Mutex<HashSet<String>>,
    /// One client per consumer group whose offsets the kit reads (it never joins the group).
    groups: Mutex<HashMap<String, Arc<BaseConsumer>>>,
    /// The client that made the mock cluster (`test.mock.num.brokers`): the cluster lives as long as it.
    /// Declared last, so dropped last: the kit's other clients close while their broker still runs.
    owner: BaseProducer,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("brokers", &self.brokers)
            .field("partitions", &self.partitions)
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// A mock cluster of one broker, whose topics get `partitions` partitions, and whose groups assign a
    /// new group's first member at once (see [`crate::mock::join_at_once`]).
    pub(crate) fn start(partitions: i32) -> Result<Self, KitError> {
        let owner: BaseProducer = ClientConfig::new()
            .set("test.mock.num.brokers", "1")
            .set("log_level", "3")
            .create()
            .map_err(kafka)?;
        crate::mock::join_at_once(owner.client())?;
        let brokers = mock_of(&owner)?.bootstrap_servers();
        // The relay's producer: keys partitioned with murmur2, so that an event the test sends and one a
        // service emits with the same key share a partition.
        let producer = saga_runtime::kafka::idempotent_producer(
            &saga_consumer::KafkaConfig::new(&brokers),
            Duration::ZERO,
            REQUEST,
        )
        .map_err(kafka)?;
        Ok(Self {
            owner,
            brokers,
            partitions,
            producer,
            created: Mutex::default(),
            groups: Mutex::default(),
        })
    }

    /// `bootstrap.servers`.
    pub(crate) fn brokers(&self) -> &str {
        &self.brokers
    }

    /// Creates `topic` unless the kit created it already.
    pub(crate) fn create_topic(&self, topic: &str) -> Result<(), KitError> {
        let mut created = self.created.lock().unwrap_or_else(PoisonError::into_inner);
        if created.contains(topic) {
            return Ok(());
        }
        match mock_of(&self.owner)?.create_topic(topic, self.partitions, 1) {
            // Made by a producer (the mock cluster creates a topic on first use).
            Err(e) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::TopicAlreadyExists) => {}
            other => other.map_err(kafka)?,
        }
        created.insert(topic.to_owned());
        Ok(())
    }

    /// Produces one message and waits for the acknowledgement. Returns its partition and offset.
    pub(crate) async fn produce(
        &self,
        topic: &str,
        key: Option<&str>,
        headers: &Headers,
        payload: Option<&[u8]>,
    ) -> Result<(i32, i64), KitError> {
        self.create_topic(topic)?;
        let mut record = FutureRecord::<str, [u8]>::to(topic)
            .headers(saga_runtime::kafka::to_kafka_headers(headers));
        if let Some(key) = key {
            record = record.key(key);
        }
        if let Some(payload) = payload {
            record = record.payload(payload);
        }
        let delivered = self
            .producer
            .send(record, REQUEST)
            .await
            .map_err(|(e, _)| kafka(e))?;
        Ok((delivered.partition, delivered.offset))
    }

    /// Every message of `topic`, partition by partition, from its start to its end as it is now.
    pub(crate) async fn read(&self, topic: &str) -> Result<Vec<RawMessage>, KitError> {
        self.create_topic(topic)?;
        let brokers = self.brokers.clone();
        let topic = topic.to_owned();
        blocking(move || {
            let reader: BaseConsumer = config(&brokers)
                .set("group.id", READER)
                .set("enable.auto.commit", "false")
                .create()
                .map_err(kafka)?;
            let mut ends = BTreeMap::new();
            let mut assignment = TopicPartitionList::new();
            for partition in partitions(&reader, &topic)? {
                let (low, high) = reader
                    .fetch_watermarks(&topic, partition, REQUEST)
                    .map_err(kafka)?;
                if high > low {
                    ends.insert(partition, high);
                    assignment
                        .add_partition_offset(&topic, partition, Offset::Offset(low))
                        .map_err(kafka)?;
                }
            }
            reader.assign(&assignment).map_err(kafka)?;
            let mut messages = Vec::new();
            let deadline = Instant::now() + REQUEST;
            while !ends.is_empty() {
                if Instant::now() > deadline {
                    return Err(KitError::Read {
                        topic,
                        detail: format!("partitions {:?} did not reach their ends", ends.keys()),
                    });
                }
                let Some(message) = reader.poll(Duration::from_millis(100)) else {
                    continue;
                };
                let message = message.map_err(kafka)?;
                let (partition, offset) = (message.partition(), message.offset());
                if ends.get(&partition).is_some_and(|end| offset + 1 >= *end) {
                    ends.remove(&partition);
                }
                messages.push(RawMessage {
                    origin: Origin {
                        topic: topic.clone(),
                        partition,
                        offset,
                    },
                    key: message.key().map(<[u8]>::to_vec),
                    payload: message.payload().map(<[u8]>::to_vec),
                    headers: saga_runtime::kafka::from_kafka_headers(message.headers()),
                    timestamp_ms: message.timestamp().to_millis(),
                });
            }
            messages.sort_by_key(|m| (m.origin.partition, m.origin.offset));
            Ok(messages)
        })
        .await
    }

    /// How many messages `topic` holds now (its partitions' ends less their starts).
    pub(crate) async fn count(&self, topic: &str) -> Result<i64, KitError> {
        let client = self.group_client(READER)?;
        let topic = topic.to_owned();
        blocking(move || {
            let mut count = 0;
            for partition in partitions(&client, &topic)? {
                let (low, high) = client
                    .fetch_watermarks(&topic, partition, REQUEST)
                    .map_err(kafka)?;
                count += high - low;
            }
            Ok(count)
        })
        .await
    }

    /// Where group `group` stands on every partition of `topics`.
    pub(crate) async fn positions(
        &self,
        group: &str,
        topics: &[String],
    ) -> Result<BTreeMap<(String, i32), Position>, KitError> {
        let client = self.group_client(group)?;
        let topics = topics.to_vec();
        blocking(move || {
            let mut ends = BTreeMap::new();
            let mut asked = TopicPartitionList::new();
            for topic in &topics {
                for partition in partitions(&client, topic)? {
                    let (low, high) = client
                        .fetch_watermarks(topic, partition, REQUEST)
                        .map_err(kafka)?;
                    ends.insert((topic.clone(), partition), (low, high));
                    asked.add_partition(topic, partition);
                }
            }
            let committed = client.committed_offsets(asked, REQUEST).map_err(kafka)?;
            Ok(ends
                .into_iter()
                .map(|((topic, partition), (low, high))| {
                    let committed = committed
                        .find_partition(&topic, partition)
                        .and_then(|p| p.offset().to_raw())
                        .filter(|offset| *offset >= 0)
                        .unwrap_or(low);
                    let position = Position {
                        committed,
                        low,
                        end: high,
                    };
                    ((topic, partition), position)
                })
                .collect())
        })
        .await
    }

    /// Commits, for group `group` (whose members must have left), the start of every partition of
    /// `topics`: the group's next member reads them again from there. The commit is made as the group's
    /// member (a broker refuses one from outside a group it knows), then read back. Returns how many
    /// messages the group will read again.
    pub(crate) async fn rewind(&self, group: &str, topics: &[String]) -> Result<i64, KitError> {
        let brokers = self.brokers.clone();
        let (group_name, topics_owned) = (group.to_owned(), topics.to_vec());
        let again = blocking(move || {
            let member: BaseConsumer = config(&brokers)
                .set("group.id", &group_name)
                .set("enable.auto.commit", "false")
                .set("auto.offset.reset", "earliest")
                // The mock cluster makes the group's next join (the service's, started again) wait this
                // member's session timeout less a second: the services' own.
                .set(
                    "session.timeout.ms",
                    crate::service::SESSION_TIMEOUT.as_millis().to_string(),
                )
                .set(
                    "heartbeat.interval.ms",
                    (crate::service::SESSION_TIMEOUT.as_millis() / 4).to_string(),
                )
                .create()
                .map_err(kafka)?;
            let names: Vec<&str> = topics_owned.iter().map(String::as_str).collect();
            member.subscribe(&names).map_err(kafka)?;
            let mut start = TopicPartitionList::new();
            let mut again = 0;
            let mut wanted = 0;
            for topic in &topics_owned {
                for partition in partitions(&member, topic)? {
                    let (low, high) = member
                        .fetch_watermarks(topic, partition, REQUEST)
                        .map_err(kafka)?;
                    start
                        .add_partition_offset(topic, partition, Offset::Offset(low))
                        .map_err(kafka)?;
                    again += high - low;
                    wanted += 1;
                }
            }
            // The only member: every partition is assigned to it.
            let deadline = Instant::now() + Duration::from_secs(30);
            while member.assignment().map_err(kafka)?.count() < wanted {
                if Instant::now() > deadline {
                    return Err(crate::error::kafka_said(format!(
                        "rewinding {group_name}: its partitions were not assigned within 30 s"
                    )));
                }
                if let Some(Err(e)) = member.poll(Duration::from_millis(50)) {
                    return Err(kafka(e));
                }
            }
            member.commit(&start, CommitMode::Sync).map_err(kafka)?;
            member.unsubscribe();
            Ok(again)
        })
        .await?;
        let rewound = self.positions(group, topics).await?;
        if let Some(((topic, partition), p)) = rewound.iter().find(|(_, p)| p.committed != p.low) {
            return Err(crate::error::kafka_said(format!(
                "rewinding {group}: {topic}/{partition} stayed at offset {}",
                p.committed
            )));
        }
        Ok(again)
    }

    /// The client that reads and commits group `group`'s offsets.
    fn group_client(&self, group: &str) -> Result<Arc<BaseConsumer>, KitError> {
        let mut groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(client) = groups.get(group) {
            return Ok(client.clone());
        }
        let client: Arc<BaseConsumer> = Arc::new(
            config(&self.brokers)
                .set("group.id", group)
                .set("enable.auto.commit", "false")
                .create()
                .map_err(kafka)?,
        );
        groups.insert(group.to_owned(), client.clone());
        Ok(client)
    }
}

/// The mock cluster `owner` made.
fn mock_of(owner: &BaseProducer) -> Result<MockCluster<'_, DefaultProducerContext>, KitError> {
    owner
        .client()
        .mock_cluster()
        .ok_or_else(|| crate::error::kafka_said("the kit's client holds no mock cluster"))
}

/// A client configuration for the mock cluster at `brokers`.
fn config(brokers: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set("log_level", "3");
    config
}

/// The partitions of `topic`, in order.
fn partitions(client: &BaseConsumer, topic: &str) -> Result<Vec<i32>, KitError> {
    let metadata = client.fetch_metadata(Some(topic), REQUEST).map_err(kafka)?;
    let mut partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic)
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    partitions.sort_unstable();
    Ok(partitions)
}

/// Runs librdkafka's blocking calls on tokio's blocking pool.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, KitError> + Send + 'static,
) -> Result<T, KitError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| KitError::Kafka(saga_consumer::Cause::new(e)))?
}
