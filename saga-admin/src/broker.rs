//! The broker's view of a topic, shared by the dead-letter reader and the lag report.

use saga_consumer::KafkaConfig;
use saga_runtime::kafka::Watermarks;

use crate::error::AdminError;

/// The partitions of `topic` with their low and high watermarks; bad input if it does not exist.
pub(crate) async fn partitions_of(
    kafka: &KafkaConfig,
    topic: &str,
) -> Result<Vec<(i32, i64, i64)>, AdminError> {
    let Some(partitions) = saga_runtime::kafka::watermarks(kafka, topic)
        .await
        .map_err(AdminError::kafka)?
    else {
        // The broker's address is not named: the inspector shows this to its viewers.
        return Err(AdminError::bad_input(format!(
            "topic {topic} does not exist on the broker"
        )));
    };
    Ok(partitions
        .into_iter()
        .map(
            |Watermarks {
                 partition,
                 low,
                 high,
             }| (partition, low, high),
        )
        .collect())
}
