//! The broker's own limits, measured with the relay's producer settings: what any relay figure is bounded
//! by.

use std::time::{Duration, Instant};

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use saga_runtime::kafka::KafkaConfig;

use crate::bench::{Progress, percentile, rate};

/// Messages per second the broker acknowledges from one idempotent producer, `count` messages of about
/// 400 bytes (an outbox event's size) with `headers` headers each, sent as fast as it takes them.
pub async fn produce_throughput(
    kafka: &KafkaConfig,
    topic: &str,
    count: i64,
    headers: usize,
    progress: &Progress,
) -> anyhow::Result<f64> {
    let producer = saga_runtime::kafka::idempotent_producer(
        kafka,
        Duration::from_millis(5),
        Duration::from_secs(120),
    )?;
    let payload = vec![b'x'; 400];
    let header_values: Vec<(String, String)> = (0..headers)
        .map(|i| (format!("header-{i}"), format!("value-{i}-0123456789abcdef")))
        .collect();
    let owned = header_values.iter().fold(OwnedHeaders::new(), |h, (k, v)| {
        h.insert(Header {
            key: k,
            value: Some(v.as_str()),
        })
    });
    let started = Instant::now();
    let mut pending = Vec::with_capacity(usize::try_from(count)?);
    for n in 0..count {
        let key = format!("key-{}", n % 1_000);
        loop {
            let record = FutureRecord::to(topic)
                .key(&key)
                .payload(&payload)
                .headers(owned.clone());
            match producer.send_result(record) {
                Ok(delivery) => {
                    pending.push(delivery);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        }
    }
    for delivery in pending {
        delivery.await?.map_err(|(e, _)| e)?;
    }
    let seconds = started.elapsed().as_secs_f64();
    progress.note(&format!(
        "broker: {count} messages with {headers} headers acknowledged in {seconds:.1} s"
    ));
    Ok(rate(count, seconds))
}

/// p50 and p99 in milliseconds of the acknowledgement of single messages sent one after another.
pub async fn ack_latency(
    kafka: &KafkaConfig,
    topic: &str,
    count: usize,
) -> anyhow::Result<(f64, f64)> {
    let producer = saga_runtime::kafka::idempotent_producer(
        kafka,
        Duration::from_millis(1),
        Duration::from_secs(30),
    )?;
    let mut samples = Vec::with_capacity(count);
    for n in 0..count + 20 {
        let started = Instant::now();
        producer
            .send(
                FutureRecord::to(topic).key("k").payload(&format!("{n}")),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)?;
        if n >= 20 {
            samples.push(started.elapsed().as_secs_f64() * 1_000.0);
        }
    }
    Ok((
        percentile(&mut samples, 0.5),
        percentile(&mut samples, 0.99),
    ))
}

/// p50 and p99 in milliseconds from sending a message to a plain consumer receiving it, through the
/// broker alone: `count` messages at `per_second` on one partition of `topic` (fresh), with the
/// relay's producer settings and the saga services' `fetch.wait.max.ms` (`fetch_wait`). What one hop of a
/// saga spends in the broker (relay ack plus delivery) cannot be less than this. The consumer reads all
/// `partitions` partitions of `topic` and, with `idle_topic`, of that topic too, where nothing is sent, as
/// a service whose steps subscribe to two topics does.
pub async fn delivery_latency(
    kafka: &KafkaConfig,
    topic: &str,
    idle_topic: Option<&str>,
    partitions: i32,
    fetch_wait: Duration,
    count: usize,
    per_second: u32,
) -> anyhow::Result<(f64, f64)> {
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::{Message, Offset, TopicPartitionList};

    let consumer: StreamConsumer = saga_runtime::kafka::client_config(kafka)
        .set("group.id", format!("{topic}.latency"))
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", fetch_wait.as_millis().to_string())
        .create()?;
    let mut assignment = TopicPartitionList::new();
    for t in std::iter::once(topic).chain(idle_topic) {
        for partition in 0..partitions {
            assignment.add_partition_offset(t, partition, Offset::Beginning)?;
        }
    }
    consumer.assign(&assignment)?;
    let producer = saga_runtime::kafka::idempotent_producer(
        kafka,
        Duration::from_millis(1),
        Duration::from_secs(30),
    )?;
    let base = Instant::now();
    let sender = tokio::spawn({
        let topic = topic.to_owned();
        async move {
            let mut ticks = tokio::time::interval(Duration::from_secs(1) / per_second.max(1));
            for _ in 0..count {
                ticks.tick().await;
                // The payload is the send time, in nanoseconds since `base`.
                let sent = base.elapsed().as_nanos().to_string();
                producer
                    .send(
                        FutureRecord::to(&topic).key("k").payload(&sent),
                        Duration::from_secs(10),
                    )
                    .await
                    .map_err(|(e, _)| e)?;
            }
            anyhow::Ok(())
        }
    });
    let mut samples = Vec::with_capacity(count);
    while samples.len() < count {
        let message = tokio::time::timeout(Duration::from_secs(30), consumer.recv()).await??;
        let received = base.elapsed().as_nanos();
        let sent: u128 = std::str::from_utf8(message.payload().unwrap_or_default())?.parse()?;
        samples.push((received - sent) as f64 / 1e6);
    }
    sender.await??;
    // The first messages also wait for the consumer's first fetch.
    let mut samples = samples.split_off(count.min(10));
    Ok((
        percentile(&mut samples, 0.5),
        percentile(&mut samples, 0.99),
    ))
}
