//! The broker a run uses: librdkafka's built-in mock cluster (an embedded default for the demo only), the
//! broker at `KAFKA_BROKERS`, or a private Nisshi process that can be restarted (chaos).

use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use saga_runtime::kafka::{KafkaConfig, ensure_topics};
use saga_test_support::PrivateBroker;

/// Where the saga's messages go.
pub enum Broker {
    /// librdkafka's mock cluster, inside this process, reachable over TCP by the service processes.
    Mock(MockCluster<'static, DefaultProducerContext>),
    /// A running broker.
    External(String),
    /// A Nisshi process of this run's own.
    Private(Box<PrivateBroker>),
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Broker {
    /// The mock cluster (3 brokers).
    pub fn mock() -> anyhow::Result<Self> {
        Ok(Self::Mock(MockCluster::new(3)?))
    }

    /// `bootstrap.servers`.
    pub fn brokers(&self) -> String {
        match self {
            Self::Mock(cluster) => cluster.bootstrap_servers(),
            Self::External(brokers) => brokers.clone(),
            Self::Private(broker) => broker.brokers.clone(),
        }
    }

    /// What it is, for people.
    pub fn describe(&self) -> String {
        match self {
            Self::Mock(_) => format!("librdkafka mock cluster at {}", self.brokers()),
            Self::External(b) => format!("broker at {b}"),
            Self::Private(b) => format!("private Nisshi broker at {}", b.brokers),
        }
    }

    /// Creates `topics` with `partitions` partitions each.
    pub async fn create_topics(&self, topics: &[String], partitions: i32) -> anyhow::Result<()> {
        match self {
            Self::Mock(cluster) => {
                for topic in topics {
                    cluster.create_topic(topic, partitions, 1)?;
                }
            }
            Self::External(_) | Self::Private(_) => {
                let refs: Vec<&str> = topics.iter().map(String::as_str).collect();
                ensure_topics(&KafkaConfig::new(self.brokers()), &refs, partitions, 1).await?;
            }
        }
        Ok(())
    }
}
