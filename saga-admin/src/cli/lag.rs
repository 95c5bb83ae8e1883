//! `saga lag`: a consumer group's lag.

use super::Cli;
use crate::lag;
use crate::table::Table;

impl Cli {
    /// `saga lag`: `group`'s committed offset, high watermark and lag per partition of `topics` (default:
    /// those the schema records for the group).
    pub(super) async fn lag(&self, group: &str, topics: &[String]) -> anyhow::Result<()> {
        let kafka = self.kafka().await?;
        let topics = if topics.is_empty() {
            lag::known_topics(&self.pool().await?, group).await?
        } else {
            topics.to_vec()
        };
        let found = lag::lag(&kafka, group, &topics).await?;
        self.print(&found, || {
            let mut t = Table::new(["topic", "partition", "committed", "high watermark", "lag"]);
            for l in &found {
                t.row([
                    l.topic.clone(),
                    l.partition.to_string(),
                    l.committed
                        .map_or_else(|| "-".to_owned(), |c| c.to_string()),
                    l.high_watermark.to_string(),
                    l.lag.to_string(),
                ]);
            }
            format!(
                "{}total lag {}",
                t.render(),
                found.iter().map(|l| l.lag).sum::<i64>()
            )
        })
    }
}
