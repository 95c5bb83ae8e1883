//! Uniquely named topics on the real broker, and helpers to produce and read them back.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

use crate::env::{HOW_TO_START, unique_name};

/// A message read back from a topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadMessage {
    /// Its partition.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
    /// Its key, as text.
    pub key: Option<String>,
    /// Its payload.
    pub payload: Vec<u8>,
    /// Its headers, as text.
    pub headers: Vec<(String, String)>,
}

impl ReadMessage {
    /// The value of header `name`, if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The payload parsed as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.payload).expect("payload is JSON")
    }
}

/// The broker at `KAFKA_BROKERS`, with the topics this test created (deleted when dropped).
pub struct TestKafka {
    /// The bootstrap servers.
    pub brokers: String,
    /// The librdkafka properties of every client of this broker (its security, for the secured one).
    properties: Vec<(String, String)>,
    admin: AdminClient<DefaultClientContext>,
    topics: Mutex<Vec<String>>,
}

impl std::fmt::Debug for TestKafka {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestKafka")
            .field("brokers", &self.brokers)
            .finish_non_exhaustive()
    }
}

impl TestKafka {
    /// Connects to `KAFKA_BROKERS`. Panics, saying how to start the broker, if it does not answer a metadata
    /// request within 10 seconds.
    pub async fn new() -> Self {
        Self::with_brokers(&crate::services().await.kafka_brokers).await
    }

    /// Connects to the broker at `brokers`.
    pub async fn with_brokers(brokers: &str) -> Self {
        Self::with_properties(brokers, Vec::new()).await
    }

    /// Connects to the secured broker `scripts/dev-services` starts (`KAFKA_SECURE_BROKERS`): SASL_SSL as
    /// its SCRAM user, the local CA.
    pub async fn secured() -> Self {
        Self::with_properties(&crate::secure_brokers(), crate::sasl_ssl_properties()).await
    }

    /// Connects to the broker at `brokers` with librdkafka `properties` on every client.
    pub async fn with_properties(brokers: &str, properties: Vec<(String, String)>) -> Self {
        let admin: AdminClient<DefaultClientContext> = client_config_with(brokers, &properties)
            .create()
            .expect("creating a Kafka admin client");
        let probe_config = client_config_with(brokers, &properties);
        let reachable = tokio::task::spawn_blocking(move || {
            let probe: BaseConsumer = probe_config.create().expect("creating a Kafka client");
            probe
                .fetch_metadata(None, Duration::from_secs(10))
                .map(|_| ())
        })
        .await
        .expect("metadata probe");
        if let Err(e) = reachable {
            panic!("the Kafka broker at {brokers} is not reachable: {e}. To fix: {HOW_TO_START}.");
        }
        Self {
            brokers: brokers.to_owned(),
            properties,
            admin,
            topics: Mutex::new(Vec::new()),
        }
    }

    /// A client configuration for this broker.
    pub fn config(&self) -> ClientConfig {
        client_config_with(&self.brokers, &self.properties)
    }

    /// The framework's configuration of this broker (its address and properties).
    pub fn kafka_config(&self) -> saga_runtime::kafka::KafkaConfig {
        self.properties.iter().fold(
            saga_runtime::kafka::KafkaConfig::new(self.brokers.clone()),
            |config, (name, value)| config.with_property(name, value),
        )
    }

    /// Creates a uniquely named topic (`{prefix}-{time}-{random}`) with `partitions` partitions and waits
    /// until the broker lists it. It is deleted when `self` is dropped.
    pub async fn topic(&self, prefix: &str, partitions: i32) -> String {
        let name = unique_name(prefix);
        self.create_topic(&name, partitions).await;
        name
    }

    /// Creates topic `name` and waits until the broker lists it with all its partitions.
    pub async fn create_topic(&self, name: &str, partitions: i32) {
        self.create_topic_with(name, partitions, &[]).await;
    }

    /// Creates topic `name` with topic configuration `config` (such as `("max.message.bytes", "1000")`,
    /// which makes the broker itself refuse larger messages) and waits until the broker lists it.
    pub async fn create_topic_with(&self, name: &str, partitions: i32, config: &[(&str, &str)]) {
        let mut topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
        for (key, value) in config {
            topic = topic.set(key, value);
        }
        let results = self
            .admin
            .create_topics(
                &[topic],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .unwrap_or_else(|e| panic!("creating topic {name}: {e}"));
        for result in results {
            if let Err((topic, code)) = result {
                panic!("creating topic {topic}: {code}");
            }
        }
        self.topics.lock().expect("topics").push(name.to_owned());
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.partition_count(name).await != partitions {
            assert!(
                Instant::now() < deadline,
                "topic {name} did not appear with {partitions} partitions"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Deletes topic `name` (created by other means) when `self` is dropped.
    pub fn delete_on_drop(&self, name: &str) {
        self.topics.lock().expect("topics").push(name.to_owned());
    }

    /// Deletes topic `name` now and waits until the broker no longer lists it.
    pub async fn delete_topic(&self, name: &str) {
        let results = self
            .admin
            .delete_topics(
                &[name],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .unwrap_or_else(|e| panic!("deleting topic {name}: {e}"));
        for result in results {
            if let Err((topic, code)) = result {
                panic!("deleting topic {topic}: {code}");
            }
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.partition_count(name).await != 0 {
            assert!(Instant::now() < deadline, "topic {name} is still listed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// How many partitions topic `name` has (0 if it does not exist).
    pub async fn partition_count(&self, name: &str) -> i32 {
        let config = self.config();
        let name = name.to_owned();
        tokio::task::spawn_blocking(move || {
            let client: BaseConsumer = config.create().expect("client");
            client
                .fetch_metadata(Some(&name), Duration::from_secs(5))
                .ok()
                .and_then(|m| {
                    m.topics()
                        .iter()
                        .find(|t| t.name() == name && t.error().is_none())
                        .map(|t| i32::try_from(t.partitions().len()).unwrap_or(i32::MAX))
                })
                .unwrap_or(0)
        })
        .await
        .expect("metadata")
    }

    /// An idempotent producer for this broker.
    pub fn producer(&self) -> FutureProducer {
        self.config()
            .set("enable.idempotence", "true")
            .set("linger.ms", "1")
            .create()
            .expect("creating a producer")
    }

    /// Produces one message and waits for the broker's acknowledgement. Returns its partition and offset.
    pub async fn produce(
        &self,
        producer: &FutureProducer,
        topic: &str,
        key: Option<&str>,
        headers: &[(&str, &str)],
        payload: &[u8],
    ) -> (i32, i64) {
        self.produce_to(producer, topic, None, key, headers, payload)
            .await
    }

    /// Produces an event as a saga's client would: keyed and carrying `key` as its idempotency key, of type
    /// `event_type`, with `payload` as JSON.
    pub async fn produce_event(
        &self,
        producer: &FutureProducer,
        topic: &str,
        key: &str,
        event_type: &str,
        payload: &impl serde::Serialize,
    ) -> (i32, i64) {
        let payload = serde_json::to_vec(payload).expect("a payload that serialises");
        self.produce(
            producer,
            topic,
            Some(key),
            &[("idempotency-key", key), ("ce_type", event_type)],
            &payload,
        )
        .await
    }

    /// Like [`TestKafka::produce`], to partition `partition` if given (else the partitioner's choice).
    pub async fn produce_to(
        &self,
        producer: &FutureProducer,
        topic: &str,
        partition: Option<i32>,
        key: Option<&str>,
        headers: &[(&str, &str)],
        payload: &[u8],
    ) -> (i32, i64) {
        self.produce_bytes(
            producer,
            topic,
            partition,
            key.map(str::as_bytes),
            headers,
            payload,
        )
        .await
    }

    /// [`TestKafka::produce_to`] with a key of any bytes (a zero byte, bytes that are not UTF-8).
    pub async fn produce_bytes(
        &self,
        producer: &FutureProducer,
        topic: &str,
        partition: Option<i32>,
        key: Option<&[u8]>,
        headers: &[(&str, &str)],
        payload: &[u8],
    ) -> (i32, i64) {
        let mut owned = OwnedHeaders::new();
        for (name, value) in headers {
            owned = owned.insert(Header {
                key: name,
                value: Some(*value),
            });
        }
        let mut record = FutureRecord::<[u8], [u8]>::to(topic)
            .payload(payload)
            .headers(owned);
        if let Some(key) = key {
            record = record.key(key);
        }
        if let Some(partition) = partition {
            record = record.partition(partition);
        }
        let delivery = producer
            .send(record, Duration::from_secs(30))
            .await
            .unwrap_or_else(|(e, _)| panic!("producing to {topic}: {e}"));
        (delivery.partition, delivery.offset)
    }

    /// Reads topic `topic` from the beginning of every partition until at least `expected` messages arrived
    /// and no more arrive for `settle`, or panics after `timeout`. Returns the messages ordered by partition
    /// and offset.
    pub async fn read_all(
        &self,
        topic: &str,
        expected: usize,
        settle: Duration,
        timeout: Duration,
    ) -> Vec<ReadMessage> {
        let partitions = self.partition_count(topic).await;
        assert!(partitions > 0, "topic {topic} does not exist");
        let config = self.config();
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer = config
                .clone()
                .set("group.id", unique_name("reader"))
                .set("enable.auto.commit", "false")
                .create()
                .expect("creating a reader");
            let mut tpl = TopicPartitionList::new();
            for p in 0..partitions {
                tpl.add_partition_offset(&topic, p, Offset::Beginning)
                    .expect("partition");
            }
            consumer.assign(&tpl).expect("assign");
            let deadline = Instant::now() + timeout;
            let mut last_arrival = Instant::now();
            let mut messages = Vec::new();
            loop {
                match consumer.poll(Duration::from_millis(50)) {
                    Some(Ok(m)) => {
                        last_arrival = Instant::now();
                        messages.push(ReadMessage {
                            partition: m.partition(),
                            offset: m.offset(),
                            key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                            payload: m.payload().unwrap_or_default().to_vec(),
                            headers: m
                                .headers()
                                .map(|h| {
                                    h.iter()
                                        .map(|h| {
                                            (
                                                h.key.to_owned(),
                                                String::from_utf8_lossy(
                                                    h.value.unwrap_or_default(),
                                                )
                                                .into_owned(),
                                            )
                                        })
                                        .collect()
                                })
                                .unwrap_or_default(),
                        });
                    }
                    Some(Err(e)) => eprintln!("reading {topic}: {e}"),
                    None => {}
                }
                if messages.len() >= expected && last_arrival.elapsed() >= settle {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "read {} of {expected} messages from {topic} within {timeout:?}",
                    messages.len()
                );
            }
            messages.sort_by_key(|m| (m.partition, m.offset));
            messages
        })
        .await
        .expect("reader")
    }

    /// The offsets consumer group `group` committed for `topic`, by partition (partitions without a commit are
    /// left out).
    pub async fn committed_offsets(&self, group: &str, topic: &str) -> BTreeMap<i32, i64> {
        let partitions = self.partition_count(topic).await;
        let config = self.config();
        let (group, topic) = (group.to_owned(), topic.to_owned());
        tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer = config
                .clone()
                .set("group.id", &group)
                .set("enable.auto.commit", "false")
                .create()
                .expect("creating a client");
            let mut tpl = TopicPartitionList::new();
            for p in 0..partitions {
                tpl.add_partition(&topic, p);
            }
            let committed = consumer
                .committed_offsets(tpl, Duration::from_secs(10))
                .expect("fetching committed offsets");
            committed
                .elements()
                .iter()
                .filter_map(|e| match e.offset() {
                    Offset::Offset(o) => Some((e.partition(), o)),
                    _ => None,
                })
                .collect()
        })
        .await
        .expect("committed offsets")
    }

    /// The end offset (the next offset to be written) of every partition of `topic`.
    /// A topic whose leader is still being elected is asked again, for up to five seconds.
    pub async fn end_offsets(&self, topic: &str) -> BTreeMap<i32, i64> {
        let mut tries = 0;
        let partitions = loop {
            match saga_runtime::kafka::watermarks(&self.kafka_config(), topic).await {
                Ok(partitions) => break partitions,
                Err(_) if tries < 50 => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                Err(e) => panic!("the watermarks of {topic}: {e}"),
            }
        };
        partitions
            .unwrap_or_default()
            .into_iter()
            .map(|w| (w.partition, w.high))
            .collect()
    }
}

impl Drop for TestKafka {
    fn drop(&mut self) {
        let topics = std::mem::take(&mut *self.topics.lock().unwrap_or_else(|e| e.into_inner()));
        if topics.is_empty() || std::thread::panicking() {
            return;
        }
        let config = self.config();
        let cleanup = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async move {
                let Ok(admin) = config.create::<AdminClient<DefaultClientContext>>() else {
                    return;
                };
                let names: Vec<&str> = topics.iter().map(String::as_str).collect();
                let _ = tokio::time::timeout(
                    Duration::from_secs(10),
                    admin.delete_topics(&names, &AdminOptions::new()),
                )
                .await;
            });
        });
        let _ = cleanup.join();
    }
}

/// A client configuration for `brokers` with the settings every test client uses.
pub(crate) fn client_config(brokers: &str) -> ClientConfig {
    client_config_with(brokers, &[])
}

/// [`client_config`] with librdkafka `properties` (a secured broker's).
fn client_config_with(brokers: &str, properties: &[(String, String)]) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set("broker.address.family", "v4")
        .set("socket.timeout.ms", "10000")
        .set("log_level", "3");
    for (name, value) in properties {
        config.set(name, value);
    }
    config
}
