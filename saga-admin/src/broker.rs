//! The broker's view of a topic, shared by the dead-letter reader and the lag report.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use saga_runtime::kafka::KafkaConfig;

use crate::error::AdminError;

/// The partitions of `topic` with their low and high watermarks; bad input if it does not exist.
pub(crate) async fn partitions_of(
    kafka: &KafkaConfig,
    topic: &str,
) -> Result<Vec<(i32, i64, i64)>, AdminError> {
    let config = saga_runtime::kafka::client_config(kafka);
    let topic = topic.to_owned();
    let brokers = kafka.brokers.clone();
    tokio::task::spawn_blocking(move || {
        let client: BaseConsumer = config.create()?;
        let metadata = client.fetch_metadata(Some(&topic), Duration::from_secs(10))?;
        let Some(found) = metadata
            .topics()
            .iter()
            .find(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty())
        else {
            return Err(AdminError::bad_input(format!(
                "topic {topic} does not exist at {brokers}"
            )));
        };
        found
            .partitions()
            .iter()
            .map(|p| {
                let (low, high) =
                    client.fetch_watermarks(&topic, p.id(), Duration::from_secs(10))?;
                Ok((p.id(), low, high))
            })
            .collect()
    })
    .await
    .map_err(|e| AdminError::Kafka(e.to_string()))?
}
