//! Consumer lag: per partition, the group's committed offset, the high watermark, and how far behind.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use saga_runtime::kafka::KafkaConfig;
use serde::Serialize;
use sqlx::PgPool;

use crate::error::AdminError;

/// One partition's lag.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct PartitionLag {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The group's committed offset (the next message it will read), if it committed one.
    pub committed: Option<i64>,
    /// The partition's end: the offset the next message will get.
    pub high_watermark: i64,
    /// Messages not yet committed: the high watermark minus the committed offset (or minus the log start,
    /// if the group committed nothing).
    pub lag: i64,
}

/// The topics the consumer group `group` works on, as its crash-loop guard recorded them in `pool`'s
/// schema (`saga_consumer_progress`).
pub async fn known_topics(pool: &PgPool, group: &str) -> Result<Vec<String>, AdminError> {
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.tables \
         WHERE table_schema = current_schema() AND table_name = 'saga_consumer_progress')",
    )
    .fetch_one(pool)
    .await?;
    if !exists {
        return Ok(Vec::new());
    }
    Ok(sqlx::query_scalar(
        "SELECT DISTINCT topic FROM saga_consumer_progress WHERE group_id = $1 ORDER BY topic",
    )
    .bind(group)
    .fetch_all(pool)
    .await?)
}

/// The groups whose progress `pool`'s schema records.
pub async fn known_groups(pool: &PgPool) -> Result<Vec<String>, AdminError> {
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.tables \
         WHERE table_schema = current_schema() AND table_name = 'saga_consumer_progress')",
    )
    .fetch_one(pool)
    .await?;
    if !exists {
        return Ok(Vec::new());
    }
    Ok(
        sqlx::query_scalar("SELECT DISTINCT group_id FROM saga_consumer_progress ORDER BY 1")
            .fetch_all(pool)
            .await?,
    )
}

/// The lag of `group` on every partition of `topics`. Bad input if no topic is given or a topic does not
/// exist.
pub async fn lag(
    kafka: &KafkaConfig,
    group: &str,
    topics: &[String],
) -> Result<Vec<PartitionLag>, AdminError> {
    if topics.is_empty() {
        return Err(AdminError::bad_input(format!(
            "no topics known for group {group}: name them with --topic (the schema records the topics of \
             groups that ran with crash-loop detection)"
        )));
    }
    let mut config = saga_runtime::kafka::client_config(kafka);
    config
        .set("group.id", group)
        .set("enable.auto.commit", "false");
    let topics = topics.to_vec();
    let brokers = kafka.brokers.clone();
    tokio::task::spawn_blocking(move || {
        // A consumer that never subscribes does not join the group: it only reads the group's offsets.
        let client: BaseConsumer = config.create()?;
        let mut tpl = TopicPartitionList::new();
        let mut ends = Vec::new();
        for topic in &topics {
            let metadata = client.fetch_metadata(Some(topic), Duration::from_secs(10))?;
            let Some(found) = metadata
                .topics()
                .iter()
                .find(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty())
            else {
                return Err(AdminError::bad_input(format!(
                    "topic {topic} does not exist at {brokers}"
                )));
            };
            for p in found.partitions() {
                let (low, high) =
                    client.fetch_watermarks(topic, p.id(), Duration::from_secs(10))?;
                tpl.add_partition(topic, p.id());
                ends.push((topic.clone(), p.id(), low, high));
            }
        }
        let committed = client.committed_offsets(tpl, Duration::from_secs(10))?;
        Ok(ends
            .into_iter()
            .map(|(topic, partition, low, high)| {
                let committed =
                    committed
                        .find_partition(&topic, partition)
                        .and_then(|e| match e.offset() {
                            Offset::Offset(o) => Some(o),
                            _ => None,
                        });
                PartitionLag {
                    lag: (high - committed.unwrap_or(low)).max(0),
                    topic,
                    partition,
                    committed,
                    high_watermark: high,
                }
            })
            .collect())
    })
    .await
    .map_err(|e| AdminError::Kafka(e.to_string()))?
}
