//! The relay in WAL mode against the real broker and PostgreSQL (`wal_level = logical`, which
//! `scripts/dev-services` sets): events of many concurrent transactions are published in per-key commit
//! order; a relay process killed mid-stream loses nothing, and the one standing by takes the slot over; an
//! event the broker refuses for good is parked with its reason and the others flow; the slot's lag and
//! reader are visible to `status`; events rolled back are never published; rows a table-mode writer left
//! behind are published before the log's events.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_relay::{KafkaConfig, OutboxMode, RelayBuilder};
use saga_core::{Event, IdempotencyKey, Lineage, OutboxMessage, TenantId};
use saga_runtime::store::wal;
use saga_test_support::{ReadMessage, TestDb, TestKafka, unique_name, wait_until};

use common::{
    WAIT, builder, check_per_key_order, commit_order_table, last_in_commit_order,
    next_in_commit_order, relay_command, row, start,
};

/// A relay reading `db`'s schema's slot.
fn wal_builder(brokers: &str, db: &TestDb) -> RelayBuilder {
    builder(brokers, db.pool.clone())
        .mode(OutboxMode::Wal)
        .replication_url(db.url())
}

/// Writes `messages` to the write-ahead log in a transaction of their own.
async fn emit(db: &TestDb, messages: &[OutboxMessage]) {
    let mut tx = db.pool.begin().await.unwrap();
    wal::emit(&mut tx, messages).await.unwrap();
    tx.commit().await.unwrap();
}

/// Whether a relay reads `db`'s schema's slot.
async fn slot_read(db: &TestDb) -> bool {
    sqlx::query_scalar(
        "SELECT coalesce(bool_or(active), false) FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(wal::slot_name(db.database(), &db.schema))
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Hooks under which the deliveries `matching` fail as a topic authorization failure would, while the
/// returned flag is set (clear it: the cause is gone).
fn refused_while(
    matching: impl Fn(&outbox_relay::PublishAttempt<'_>) -> bool + Send + Sync + 'static,
) -> (
    std::sync::Arc<std::sync::atomic::AtomicBool>,
    outbox_relay::PublishHooks,
) {
    let refusing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let flag = refusing.clone();
    let hooks = outbox_relay::PublishHooks::default().fail_delivery(move |attempt| {
        (matching(attempt) && flag.load(std::sync::atomic::Ordering::SeqCst))
            .then(|| "Broker: Topic authorization failed (injected)".to_owned())
    });
    (refusing, hooks)
}

async fn read(kafka: &TestKafka, topic: &str, at_least: usize) -> Vec<ReadMessage> {
    kafka
        .read_all(topic, at_least, Duration::from_millis(800), WAIT)
        .await
}

/// A service switched from the table outbox to the log: rows it left in `saga_outbox` go out first, then
/// its events in the log, so each key's events keep their order across the switch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wal_relay_publishes_rows_left_in_the_table_first_then_the_log() {
    let db = TestDb::new("wal-switch").await;
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("wal-switch", 2).await;
    let keys = ["key-a", "key-b"];
    // Before the switch: three events per key in the table, never published.
    for seq in 1..=3 {
        let mut tx = db.pool.begin().await.unwrap();
        let rows: Vec<OutboxMessage> = keys.iter().map(|k| row(&topic, k, seq)).collect();
        saga_runtime::store::outbox::append_rows(&mut tx, &rows)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    // After it: three more per key in the log.
    wal::prepare(&db.pool).await.unwrap();
    for seq in 4..=6 {
        let rows: Vec<OutboxMessage> = keys.iter().map(|k| row(&topic, k, seq)).collect();
        emit(&db, &rows).await;
    }
    let relay = start(wal_builder(&kafka.brokers, &db));
    let messages = read(&kafka, &topic, 12).await;
    let expected: BTreeMap<String, i64> = keys.iter().map(|k| ((*k).to_owned(), 6)).collect();
    let duplicates = check_per_key_order(&messages, &expected);
    assert_eq!(
        (messages.len(), duplicates),
        (12, 0),
        "each event once, in order"
    );
    let unpublished: i64 =
        sqlx::query_scalar("SELECT count(*) FROM saga_outbox WHERE published_at IS NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(unpublished, 0, "the table's rows are marked published");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wal_events_of_many_concurrent_transactions_are_published_in_per_key_commit_order() {
    let db = TestDb::new("wal-order").await;
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("wal-order", 3).await;
    wal::prepare(&db.pool).await.unwrap();
    let keys: Vec<String> = (0..8).map(|k| format!("key-{k}")).collect();
    commit_order_table(&db, &keys).await;
    let relay = start(wal_builder(&kafka.brokers, &db));

    // Eight writers, each on every key in its own order: a key's number is taken under its row lock, in
    // the transaction that writes the event, so per key, number order is commit order.
    let per_writer = 25;
    let mut writers = Vec::new();
    for w in 0..8 {
        let (pool, topic, keys) = (db.pool.clone(), topic.clone(), keys.clone());
        writers.push(tokio::spawn(async move {
            for i in 0..per_writer {
                let key = &keys[(w + i) % keys.len()];
                let mut tx = pool.begin().await.unwrap();
                let n = next_in_commit_order(&mut tx, key).await;
                wal::emit(&mut tx, &[row(&topic, key, n)]).await.unwrap();
                tx.commit().await.unwrap();
            }
        }));
    }
    for writer in writers {
        writer.await.unwrap();
    }
    // A rolled-back transaction's event is never published.
    let mut rolled_back = db.pool.begin().await.unwrap();
    wal::emit(&mut rolled_back, &[row(&topic, "never", 1)])
        .await
        .unwrap();
    rolled_back.rollback().await.unwrap();

    let expected = last_in_commit_order(&db).await;
    let total = 8 * per_writer;
    let messages = read(&kafka, &topic, total).await;
    let duplicates = check_per_key_order(&messages, &expected);
    assert_eq!((messages.len(), duplicates), (total, 0), "each event once");
    assert_eq!(relay.probe.published(), total as u64);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wal_relay_killed_mid_stream_loses_nothing_and_the_one_standing_by_takes_over() {
    let db = TestDb::new("wal-kill").await;
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("wal-kill", 2).await;
    wal::prepare(&db.pool).await.unwrap();
    let relay = |name: &str| {
        let mut command = relay_command(&db, &kafka.brokers);
        command
            .env("SAGA_OUTBOX_MODE", "wal")
            .env("SAGA_REPLICATION_URL", db.url())
            .env("RUST_LOG", format!("warn,outbox_relay=info,{name}=info"));
        command.spawn().unwrap()
    };
    let mut first = relay("first");
    wait_until("the first relay to read the slot", WAIT, || async {
        slot_read(&db).await.then_some(())
    })
    .await;
    // The second stands by: the slot is the first's.
    let mut second = relay("second");
    tokio::time::sleep(Duration::from_millis(500)).await;

    // 40 keys, 20 events each, one transaction per event, while the first publishes.
    let (keys, per_key) = (40, 20);
    let writer = {
        let (pool, topic) = (db.pool.clone(), topic.clone());
        tokio::spawn(async move {
            for seq in 1..=per_key {
                for k in 0..keys {
                    let mut tx = pool.begin().await.unwrap();
                    wal::emit(&mut tx, &[row(&topic, &format!("key-{k}"), seq)])
                        .await
                        .unwrap();
                    tx.commit().await.unwrap();
                }
            }
        })
    };
    let published = || async { kafka.end_offsets(&topic).await.values().sum::<i64>() };
    wait_until("part of the events published", WAIT, || async {
        (published().await >= 150).then_some(())
    })
    .await;
    first.start_kill().unwrap(); // SIGKILL, wherever it is
    first.wait().await.unwrap();
    let at_kill = published().await;
    writer.await.unwrap();
    let total = usize::try_from(keys * per_key).unwrap();
    assert!(at_kill < total as i64, "killed before the end ({at_kill})");

    // The second takes the slot over and publishes the rest, from where the first confirmed.
    let messages = read(&kafka, &topic, total).await;
    let expected: BTreeMap<String, i64> =
        (0..keys).map(|k| (format!("key-{k}"), per_key)).collect();
    let duplicates = check_per_key_order(&messages, &expected);
    assert!(slot_read(&db).await, "the second relay reads the slot");
    // The first confirmed the slot's position each second, after the broker's acknowledgements: what it
    // had published since is published again, and no more.
    assert!(
        duplicates < total,
        "only what followed the first relay's last confirmation is published twice: {duplicates}"
    );
    second.start_kill().unwrap();
    second.wait().await.unwrap();
}

/// An event the broker refuses for good (too large for its topic) is parked after its attempts, with the
/// reason, and so is its key's later event (behind it, in order); the other keys flow. An operator who
/// discards it lets the key's later event go.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wal_event_the_broker_refuses_is_parked_with_its_keys_later_events_and_the_others_flow() {
    let db = TestDb::new("wal-refused").await;
    let kafka = TestKafka::new().await;
    let topic = unique_name("wal-refused");
    kafka
        .create_topic_with(&topic, 1, &[("max.message.bytes", "1000")])
        .await;
    wal::prepare(&db.pool).await.unwrap();
    let lineage = Lineage::root(IdempotencyKey::new("k").unwrap(), TenantId::default());
    let big = OutboxMessage::from_event(
        Event::new(
            "Numbered",
            &topic,
            "key-big",
            &serde_json::json!({ "key": "key-big", "seq": 1, "pad": "x".repeat(5_000) }),
        )
        .unwrap(),
        &lineage,
        "relay-test",
    );
    emit(&db, &[big, row(&topic, "key-big", 2)]).await;
    for k in 0..8 {
        emit(&db, &[row(&topic, &format!("other-{k}"), 1)]).await;
    }
    let kafka_config = KafkaConfig::new(&kafka.brokers)
        .with_property("batch.num.messages", "1")
        .with_property("max.in.flight.requests.per.connection", "1")
        .with_property("enable.idempotence", "false");
    let relay = start(
        wal_builder(&kafka.brokers, &db)
            .kafka(kafka_config)
            .park_after(3),
    );

    let messages = read(&kafka, &topic, 8).await;
    let keys: Vec<&str> = messages.iter().map(|m| m.key.as_deref().unwrap()).collect();
    assert_eq!(keys.len(), 8, "{keys:?}");
    assert!(
        !keys.contains(&"key-big"),
        "the big event's key waits behind it: {keys:?}"
    );
    let parked: Vec<(i64, String, String, i32)> = sqlx::query_as(
        "SELECT id, convert_from(payload, 'UTF8'), error, attempts FROM saga_outbox_wal_parked ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(parked.len(), 2, "{parked:?}");
    assert!(
        parked[0].1.contains("\"seq\":1") && parked[1].1.contains("\"seq\":2"),
        "in commit order"
    );
    assert!(parked[0].3 >= 3, "parked after its attempts: {parked:?}");
    assert!(!parked[0].2.is_empty());
    assert!(parked[1].2.contains("waits behind"), "{}", parked[1].2);
    assert_eq!(relay.probe.parked(), 2);

    // What status says: the slot, read, caught up, two parked events.
    wait_until("the slot to be caught up", WAIT, || async {
        let backlog = outbox_relay::backlog(&db.pool).await.unwrap();
        let w = backlog.wal.unwrap();
        (w.reading && w.lag_bytes < 100_000 && w.parked == 2).then_some(())
    })
    .await;

    // Discarding the big one lets its key's later event go, in order.
    assert!(
        outbox_relay::discard_parked(&db.pool, parked[0].0, "tester")
            .await
            .unwrap()
    );
    outbox_relay::retry_parked(&db.pool, None).await.unwrap();
    let messages = read(&kafka, &topic, 9).await;
    let last = messages.last().unwrap();
    assert_eq!(last.key.as_deref(), Some("key-big"));
    assert_eq!(last.json()["seq"], 2);
    wait_until("the parked event marked published", WAIT, || async {
        outbox_relay::parked_events(&db.pool, 10)
            .await
            .unwrap()
            .is_empty()
            .then_some(())
    })
    .await;
    relay.stop().await;
    let backlog = outbox_relay::backlog(&db.pool).await.unwrap();
    let w = backlog.wal.unwrap();
    assert!(!w.reading, "no relay reads it once stopped");
    assert_eq!(w.slot, wal::slot_name(db.database(), &db.schema));
    assert_eq!(w.wal_status.as_deref(), Some("reserved"));
}

#[tokio::test]
async fn a_relay_in_wal_mode_without_a_replication_url_is_refused_naming_the_setting() {
    let db = TestDb::new("wal-config").await;
    let error = builder("127.0.0.1:9", db.pool.clone())
        .mode(OutboxMode::Wal)
        .build()
        .unwrap_err();
    assert!(
        error.to_string().contains("SAGA_REPLICATION_URL"),
        "{error}"
    );
}

/// Two services in two databases of one cluster, both on schema `public`: each relay reads its own
/// database's slot and publishes its own events (with one slot for both, the second's events were never
/// decoded and its relay failed forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relays_of_two_databases_on_schema_public_each_publish_their_own_events() {
    let a = TestDb::public_of_own_database("wal-two-db-a").await;
    let b = TestDb::public_of_own_database("wal-two-db-b").await;
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("wal-two-db", 1).await;
    wal::prepare(&a.pool).await.unwrap();
    wal::prepare(&b.pool).await.unwrap();
    let relay_a = start(wal_builder(&kafka.brokers, &a));
    let relay_b = start(wal_builder(&kafka.brokers, &b));
    for seq in 1..=3 {
        emit(&a, &[row(&topic, "from-a", seq)]).await;
        emit(&b, &[row(&topic, "from-b", seq)]).await;
    }
    let messages = read(&kafka, &topic, 6).await;
    let expected: BTreeMap<String, i64> =
        [("from-a".to_owned(), 3), ("from-b".to_owned(), 3)].into();
    assert_eq!(check_per_key_order(&messages, &expected), 0);
    assert_eq!(
        (relay_a.probe.published(), relay_b.probe.published()),
        (3, 3)
    );
    relay_a.stop().await;
    relay_b.stop().await;
}

/// One key the broker keeps refusing (as it would a topic that does not exist with auto-creation off, or
/// a topic the relay may not write; Nisshi creates topics on produce, so the refusal is injected at the
/// producer): its events are parked after the relay's bound, in order, and so are its later ones, while
/// every other key's events, written before and after, are published and the slot is confirmed past them.
/// Once the cause is gone, the parked events go out in order, and the key's next event after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_the_broker_keeps_refusing_holds_back_only_itself_and_goes_out_in_order_after() {
    let db = TestDb::new("wal-held-key").await;
    let kafka = TestKafka::new().await;
    let ok = kafka.topic("wal-ok", 1).await;
    let held = kafka.topic("wal-held", 1).await;
    wal::prepare(&db.pool).await.unwrap();
    let (refusing, hooks) = refused_while(|attempt| attempt.topic.starts_with("wal-held"));
    let relay = start(
        wal_builder(&kafka.brokers, &db)
            .hooks(hooks)
            .park_after_time(Duration::from_secs(2)),
    );
    emit(&db, &[row(&held, "m", 1), row(&ok, "a", 1)]).await;
    emit(&db, &[row(&held, "m", 2), row(&ok, "b", 1)]).await;
    wait_until("the refused key's events parked", WAIT, || async {
        (outbox_relay::parked_events(&db.pool, 10)
            .await
            .unwrap()
            .len()
            == 2)
            .then_some(())
    })
    .await;
    // Written after: the other keys go on, the held key's event is parked behind its earlier ones.
    emit(&db, &[row(&held, "m", 3), row(&ok, "a", 2)]).await;
    let messages = read(&kafka, &ok, 3).await;
    let expected: BTreeMap<String, i64> = [("a".to_owned(), 2), ("b".to_owned(), 1)].into();
    assert_eq!(check_per_key_order(&messages, &expected), 0);
    wait_until("the held key's later event parked behind", WAIT, || async {
        let parked = outbox_relay::parked_events(&db.pool, 10).await.unwrap();
        (parked.len() == 3).then_some(())
    })
    .await;
    let parked = outbox_relay::parked_events(&db.pool, 10).await.unwrap();
    assert!(
        parked.iter().all(|p| p.topic == held && p.holds_key),
        "{parked:?}"
    );
    assert!(
        parked[0].attempts > 0 && parked[0].error.contains("authorization"),
        "{parked:?}"
    );
    assert_eq!(kafka.end_offsets(&held).await.values().sum::<i64>(), 0);
    wait_until(
        "the slot confirmed past the parked events",
        WAIT,
        || async {
            let w = outbox_relay::backlog(&db.pool).await.unwrap().wal.unwrap();
            (w.lag_bytes < 100_000).then_some(())
        },
    )
    .await;

    // The cause is gone: the parked events go out in order, the key's next one after them.
    refusing.store(false, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(outbox_relay::retry_parked(&db.pool, None).await.unwrap(), 3);
    let released = read(&kafka, &held, 3).await;
    let expected: BTreeMap<String, i64> = [("m".to_owned(), 3)].into();
    assert_eq!(check_per_key_order(&released, &expected), 0, "in order");
    wait_until("the key let go", WAIT, || async {
        outbox_relay::parked_events(&db.pool, 10)
            .await
            .unwrap()
            .is_empty()
            .then_some(())
    })
    .await;
    emit(&db, &[row(&held, "m", 4)]).await;
    let all = read(&kafka, &held, 4).await;
    let expected: BTreeMap<String, i64> = [("m".to_owned(), 4)].into();
    assert_eq!(
        check_per_key_order(&all, &expected),
        0,
        "the next event after them"
    );
    relay.stop().await;
}

/// Switching from the table to the log with two relays: a key's table row that one relay cannot publish yet
/// keeps every relay off the slot (the fence is schema-wide), so the key's event in the log goes out after
/// it; a table row written after the switch is still published; the table's backlog gauge is still
/// sampled. (Before: the relay whose own shards were empty read the slot at once: topic order [2, 1].)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn switching_to_the_log_with_two_relays_keeps_a_keys_table_rows_before_its_events() {
    let db = TestDb::new("wal-switch-two").await;
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("wal-switch-two", 1).await;
    let keys: Vec<String> = (0..16).map(|k| format!("key-{k}")).collect();
    for key in &keys {
        let mut tx = db.pool.begin().await.unwrap();
        saga_runtime::store::outbox::append_rows(&mut tx, &[row(&topic, key, 1)])
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    wal::prepare(&db.pool).await.unwrap();
    for key in &keys {
        emit(&db, &[row(&topic, key, 2)]).await;
    }
    // Key 0's table row fails its first attempts, whichever relay owns its shard.
    let failures = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let hooks = || {
        let failures = failures.clone();
        outbox_relay::PublishHooks::default().fail_delivery(move |attempt| {
            let first = attempt.key == Some("key-0")
                && attempt
                    .payload
                    .is_some_and(|p| p.windows(7).any(|w| w == b"\"seq\":1"));
            (first && failures.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < 6)
                .then(|| "injected".to_owned())
        })
    };
    let ops = saga_runtime::ops::Ops::new();
    let first = start(
        wal_builder(&kafka.brokers, &db)
            .hooks(hooks())
            .with_ops(ops.clone()),
    );
    let second = start(wal_builder(&kafka.brokers, &db).hooks(hooks()));
    let messages = read(&kafka, &topic, 32).await;
    let expected: BTreeMap<String, i64> = keys.iter().map(|k| (k.clone(), 2)).collect();
    check_per_key_order(&messages, &expected);
    assert!(failures.load(std::sync::atomic::Ordering::SeqCst) >= 6);

    // A row written to the table after the switch (a writer of an older version) is still published.
    let mut tx = db.pool.begin().await.unwrap();
    saga_runtime::store::outbox::append_rows(&mut tx, &[row(&topic, "late", 1)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let messages = read(&kafka, &topic, 33).await;
    assert!(messages.iter().any(|m| m.key.as_deref() == Some("late")));
    // The table's backlog is sampled in WAL mode too.
    assert!(
        ops.handle().sample("saga_relay_backlog", "").is_some(),
        "{}",
        ops.render()
    );
    first.stop().await;
    second.stop().await;
}

/// A process writing the table outbox keeps relays in WAL mode off the slot until it is gone: the slot is
/// not read meanwhile, and the relay says it waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_in_wal_mode_waits_at_the_fence_while_a_table_mode_writer_runs() {
    let db = TestDb::new("wal-fence-writer").await;
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("wal-fence-writer", 1).await;
    wal::prepare(&db.pool).await.unwrap();
    let mut writer = db.pool.acquire().await.unwrap().detach();
    wal::fence::enter_table_mode(&mut writer).await.unwrap();
    emit(&db, &[row(&topic, "k", 1)]).await;
    let ops = saga_runtime::ops::Ops::new();
    let relay = start(wal_builder(&kafka.brokers, &db).with_ops(ops.clone()));
    wait_until("the relay to say it waits at the fence", WAIT, || async {
        (ops.handle().sample("saga_relay_wal_fenced", "") == Some(1.0)).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !slot_read(&db).await,
        "the slot is not read while a table-mode writer runs"
    );
    assert_eq!(kafka.end_offsets(&topic).await.values().sum::<i64>(), 0);
    sqlx::Connection::close(writer).await.unwrap();
    let messages = read(&kafka, &topic, 1).await;
    assert_eq!(messages.len(), 1);
    assert_eq!(ops.handle().sample("saga_relay_wal_fenced", ""), Some(0.0));
    relay.stop().await;
}

/// A transaction's events at the writers' size limit go through the log and the relay whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transaction_at_the_size_limit_is_published() {
    let db = TestDb::new("wal-at-limit").await;
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("wal-at-limit", 1).await;
    wal::prepare(&db.pool).await.unwrap();
    let events: Vec<OutboxMessage> = (1..=40)
        .map(|seq| {
            let lineage = Lineage::root(IdempotencyKey::new("big").unwrap(), TenantId::default());
            OutboxMessage::from_event(
                Event::new(
                    "Numbered",
                    &topic,
                    "big",
                    &serde_json::json!({ "key": "big", "seq": seq, "pad": "x".repeat(20_000) }),
                )
                .unwrap(),
                &lineage,
                "relay-test",
            )
        })
        .collect();
    let limit = wal::encoded_len(&events);
    let outbox =
        saga_runtime::store::outbox::open(&db.pool, OutboxMode::Wal, limit, Duration::from_secs(2))
            .await
            .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    outbox.append(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let relay = start(
        wal_builder(&kafka.brokers, &db)
            .mode(OutboxMode::Wal)
            .replication_url(db.url())
            .max_batch_bytes(limit)
            .batch_size(500)
            .brokers(&kafka.brokers),
    );
    let messages = read(&kafka, &topic, 40).await;
    let expected: BTreeMap<String, i64> = [("big".to_owned(), 40)].into();
    assert_eq!(check_per_key_order(&messages, &expected), 0);
    relay.stop().await;
}

/// Switching with a key whose table row keeps failing: beside the log, the row is parked after the bound
/// (so the fence opens for every other key), its key's later table row waits behind it, and its key's event
/// in the log is parked behind both; once the cause is gone the row is tried again on its own, and the key's
/// three events go out in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_table_row_failing_at_the_switch_holds_only_its_key_across_the_table_and_the_log() {
    let db = TestDb::new("wal-switch-failing-row").await;
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("wal-switch-failing-row", 1).await;
    for seq in 1..=2 {
        let mut tx = db.pool.begin().await.unwrap();
        saga_runtime::store::outbox::append_rows(
            &mut tx,
            &[row(&topic, "stuck", seq), row(&topic, "fine", seq)],
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    wal::prepare(&db.pool).await.unwrap();
    emit(&db, &[row(&topic, "stuck", 3), row(&topic, "fine", 3)]).await;
    let (refusing, hooks) = refused_while(|attempt| attempt.key == Some("stuck"));
    let relay = start(
        wal_builder(&kafka.brokers, &db)
            .hooks(hooks)
            .park_after_time(Duration::from_secs(1)),
    );
    // The other key goes through the switch: its table rows, then its event in the log.
    let messages = read(&kafka, &topic, 3).await;
    let expected: BTreeMap<String, i64> = [("fine".to_owned(), 3)].into();
    assert_eq!(check_per_key_order(&messages, &expected), 0);
    let parked_row: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM saga_outbox WHERE parked_at IS NOT NULL AND published_at IS NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(parked_row, 1, "the failing row is parked");
    wait_until(
        "the stuck key's event in the log parked behind its rows",
        WAIT,
        || async {
            (outbox_relay::parked_events(&db.pool, 10)
                .await
                .unwrap()
                .len()
                == 1)
                .then_some(())
        },
    )
    .await;

    refusing.store(false, std::sync::atomic::Ordering::SeqCst);
    let messages = read(&kafka, &topic, 6).await;
    let expected: BTreeMap<String, i64> = [("fine".to_owned(), 3), ("stuck".to_owned(), 3)].into();
    assert_eq!(
        check_per_key_order(&messages, &expected),
        0,
        "in commit order"
    );
    relay.stop().await;
}

/// `url` with TLS verified against the local CA (`sslmode=verify-full`, `sslrootcert`), as a deployment
/// names its database.
fn verify_full(url: &str, ca: &str) -> String {
    let ca = std::path::Path::new(&saga_test_support::tls_file(ca))
        .display()
        .to_string();
    let joiner = if url.contains('?') { '&' } else { '?' };
    format!("{url}{joiner}sslmode=verify-full&sslrootcert={ca}")
}

/// The database pool and the replication connection both take `sslmode=verify-full` with a private CA: the
/// relay reads its slot over TLS (the server says so of the walsender's connection) and publishes; a CA that
/// did not sign the server's certificate is refused at start, naming the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_pool_and_the_replication_connection_take_verify_full_with_a_private_ca() {
    let db = TestDb::new("wal-tls").await;
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("wal-tls", 1).await;
    let url = verify_full(&db.url(), "ca.pem");
    let pool = saga_runtime::config::connect_postgres("DATABASE_URL", &url, None, 8)
        .await
        .unwrap();
    let pool_tls: bool =
        sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(pool_tls, "the pool's connection is over TLS");
    let relay = start(
        builder(&kafka.brokers, pool.clone())
            .mode(OutboxMode::Wal)
            .replication_url(url.clone()),
    );
    wait_until("the relay reads its slot", WAIT, || async {
        slot_read(&db).await.then_some(())
    })
    .await;
    let slot = wal::slot_name(db.database(), &db.schema);
    let walsender_tls: bool = wait_until("the walsender of the slot", WAIT, || async {
        sqlx::query_scalar(
            "SELECT s.ssl FROM pg_replication_slots r JOIN pg_stat_ssl s ON s.pid = r.active_pid \
             WHERE r.slot_name = $1",
        )
        .bind(&slot)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
    })
    .await;
    assert!(walsender_tls, "the replication connection is over TLS");
    emit(&db, &[row(&topic, "key-1", 1), row(&topic, "key-1", 2)]).await;
    let messages = read(&kafka, &topic, 2).await;
    assert_eq!(
        check_per_key_order(&messages, &BTreeMap::from([("key-1".to_owned(), 2)])),
        0
    );
    relay.stop().await;

    let refused = saga_runtime::config::connect_postgres(
        "DATABASE_URL",
        &verify_full(&db.url(), "other-ca.pem"),
        None,
        1,
    )
    .await
    .unwrap_err();
    assert_eq!(refused.setting, "DATABASE_URL", "{refused}");

    // A replication connection whose certificate check fails stops the relay, naming the setting: no
    // endless retry of what waiting cannot mend.
    let refusing = builder(&kafka.brokers, db.pool.clone())
        .mode(OutboxMode::Wal)
        .replication_url(verify_full(&db.url(), "other-ca.pem"))
        .build()
        .unwrap();
    let ended = tokio::time::timeout(
        Duration::from_secs(30),
        refusing.run(std::future::pending()),
    )
    .await
    .expect("the relay stops by itself");
    match ended {
        Err(outbox_relay::RelayError::Config(problem)) => {
            assert_eq!(problem.setting, "SAGA_REPLICATION_URL", "{problem}");
        }
        other => panic!("a configuration problem expected, got {other:?}"),
    }
}

/// A transaction's message in the log holding an event with a NUL character (written by a version that did
/// not refuse it at write) cannot be parked as text: it is parked whole as bytes, with the reason, and the
/// relay reads on; it never re-reads the same batch for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_logged_event_holding_a_nul_character_is_parked_as_bytes_and_the_relay_reads_on() {
    let db = TestDb::new("wal-nul-parked").await;
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("wal-nul-parked", 1).await;
    let mut bad = row(&topic, "key-1", 1);
    bad.partition_key = Some("key\0one".into());
    let relay = start(wal_builder(&kafka.brokers, &db));
    // A message written before the slot exists is never decoded: the relay makes it first.
    wait_until("the relay reads its slot", WAIT, || async {
        slot_read(&db).await.then_some(())
    })
    .await;
    emit(&db, &[bad]).await;
    emit(&db, &[row(&topic, "key-2", 1)]).await;
    let messages = read(&kafka, &topic, 1).await;
    assert_eq!(
        check_per_key_order(&messages, &BTreeMap::from([("key-2".to_owned(), 1)])),
        0
    );
    let (index, error): (i32, String) = wait_until("the message parked", WAIT, || async {
        sqlx::query_as("SELECT event_index, error FROM saga_outbox_wal_parked")
            .fetch_optional(&db.pool)
            .await
            .unwrap()
    })
    .await;
    assert_eq!(index, -1, "parked whole, as bytes");
    assert!(error.contains("NUL"), "{error}");
    relay.stop().await;
}
