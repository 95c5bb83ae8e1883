//! The Kafka plumbing against the real broker: topic creation, the idempotent producer, headers both ways.

use std::time::Duration;

use rdkafka::producer::FutureRecord;
use saga_core::Headers;
use saga_runtime::kafka::{KafkaConfig, ensure_topics, to_kafka_headers};
use saga_test_support::TestKafka;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_produced_idempotently_is_consumed_with_its_key_and_headers() {
    let kafka = TestKafka::new().await;
    let topic = saga_test_support::unique_name("roundtrip");
    kafka.delete_on_drop(&topic);
    let config = KafkaConfig::new(kafka.brokers.clone());
    // ensure_topics creates the topic, and a second call finds it and leaves it alone.
    ensure_topics(&config, &[&topic], 3, 1).await.unwrap();
    ensure_topics(&config, &[&topic], 3, 1).await.unwrap();
    assert_eq!(kafka.partition_count(&topic).await, 3);

    let producer = saga_runtime::kafka::idempotent_producer(
        &config,
        Duration::from_millis(1),
        Duration::from_secs(30),
    )
    .unwrap();
    let headers = Headers::new()
        .with("idempotency-key", "k-1")
        .with("ce_type", "OrderCreated");
    let delivery = producer
        .send(
            FutureRecord::to(&topic)
                .key("order-1")
                .payload(r#"{"order_id":1}"#)
                .headers(to_kafka_headers(&headers)),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| e)
        .unwrap();

    let read = kafka
        .read_all(
            &topic,
            1,
            Duration::from_millis(300),
            Duration::from_secs(30),
        )
        .await;
    assert_eq!(read.len(), 1);
    let message = &read[0];
    assert_eq!(
        (message.partition, message.offset),
        (delivery.partition, delivery.offset)
    );
    assert_eq!(message.key.as_deref(), Some("order-1"));
    assert_eq!(message.json(), serde_json::json!({"order_id": 1}));
    assert_eq!(message.header("idempotency-key"), Some("k-1"));
    assert_eq!(message.header("ce_type"), Some("OrderCreated"));
}
