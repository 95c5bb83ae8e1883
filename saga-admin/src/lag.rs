//! Consumer lag: per partition, the group's committed offset, the high watermark, and how far behind.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use saga_consumer::KafkaConfig;
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
    if !progress_recorded(pool).await? {
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
    if !progress_recorded(pool).await? {
        return Ok(Vec::new());
    }
    Ok(
        sqlx::query_scalar("SELECT DISTINCT group_id FROM saga_consumer_progress ORDER BY 1")
            .fetch_all(pool)
            .await?,
    )
}

/// Whether `pool`'s schema has the crash-loop guard's table (a consumer ran there).
async fn progress_recorded(pool: &PgPool) -> Result<bool, AdminError> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.tables \
         WHERE table_schema = current_schema() AND table_name = 'saga_consumer_progress')",
    )
    .fetch_one(pool)
    .await?)
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
    let mut ends = Vec::new();
    for topic in topics {
        for (partition, low, high) in crate::broker::partitions_of(kafka, topic).await? {
            ends.push((topic.clone(), partition, low, high));
        }
    }
    let mut config = saga_runtime::kafka::client_config(kafka);
    config
        .set("group.id", group)
        .set("enable.auto.commit", "false");
    tokio::task::spawn_blocking(move || {
        // A consumer that never subscribes does not join the group: it only reads the group's offsets.
        let client: BaseConsumer = config.create().map_err(AdminError::kafka)?;
        let mut tpl = TopicPartitionList::new();
        for (topic, partition, _, _) in &ends {
            tpl.add_partition(topic, *partition);
        }
        let committed = client
            .committed_offsets(tpl, Duration::from_secs(10))
            .map_err(AdminError::kafka)?;
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
    .map_err(|e| AdminError::Kafka(saga_config::Cause::new(e)))?
}
