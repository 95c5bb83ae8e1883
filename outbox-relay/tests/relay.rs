//! The relay against the real broker and the real PostgreSQL. Each test's name says which behaviour it
//! covers: order, late, instance, kill, outage, refused.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use outbox_relay::{KafkaConfig, PublishHooks};
use saga_core::{Event, IdempotencyKey, Lineage, OutboxMessage, TenantId};
use saga_runtime::store::outbox;
use saga_test_support::{PrivateBroker, ReadMessage, TestDb, TestKafka, unique_name, wait_until};
use tokio_util::sync::CancellationToken;

mod common;

use common::{
    RunningRelay, WAIT, builder, check_per_key_order, commit_order_table, last_in_commit_order,
    next_in_commit_order, relay_command, row, start,
};

async fn unpublished(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM saga_outbox WHERE published_at IS NULL")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn wait_all_published(db: &TestDb) {
    wait_until("every outbox row published", WAIT, || async {
        (unpublished(db).await == 0).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn order_rows_of_many_concurrent_transactions_are_all_published_in_per_key_commit_order() {
    let db = TestDb::new("relay-order").await;
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("relay-order", 3).await;
    let keys: Vec<String> = (0..8).map(|k| format!("key-{k}")).collect();
    commit_order_table(&db, &keys).await;
    let relay = start(builder(&kafka.brokers, db.pool.clone()));

    // Each writer appends a row, waits a random moment, and only then learns its place in the key's commit
    // order (the counter row lock serialises commits per key) and writes it into the row. Without the
    // per-key lock taken by the append, a later id could commit first and be published out of order.
    let pool = db.pool_of(20).await;
    let mut writers = Vec::new();
    for w in 0..16 {
        let (pool, topic, keys) = (pool.clone(), topic.clone(), keys.clone());
        writers.push(tokio::spawn(async move {
            for i in 0..25 {
                let key = &keys[(w * 7 + i * 3) % keys.len()];
                let mut tx = pool.begin().await.unwrap();
                let ids = outbox::append_rows(&mut tx, &[row(&topic, key, 0)])
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_micros(rand_micros(w, i))).await;
                let n = next_in_commit_order(&mut tx, key).await;
                sqlx::query("UPDATE saga_outbox SET payload = $2 WHERE id = $1")
                    .bind(ids[0])
                    .bind(serde_json::to_vec(&serde_json::json!({"key": key, "seq": n})).unwrap())
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    wait_all_published(&db).await;
    let expected = last_in_commit_order(&db).await;
    assert_eq!(expected.values().sum::<i64>(), 400);
    let messages = kafka
        .read_all(&topic, 400, Duration::from_millis(500), WAIT)
        .await;
    let duplicates = check_per_key_order(&messages, &expected);
    assert_eq!(
        duplicates, 0,
        "a relay that was not interrupted publishes each row once"
    );
    assert_eq!(relay.probe.published(), 400);
    relay.stop().await;
}

fn rand_micros(w: usize, i: usize) -> u64 {
    // Deterministic jitter, 0 to 3 ms.
    ((w * 7919 + i * 104_729) % 3000) as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn late_a_row_committing_after_later_ids_were_published_is_still_published() {
    let db = TestDb::new("relay-late").await;
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("relay-late", 1).await;
    let relay = start(builder(&kafka.brokers, db.pool.clone()));

    // The early transaction takes the smaller id and stays open.
    let mut early = db.pool.begin().await.unwrap();
    let early_ids = outbox::append_rows(&mut early, &[row(&topic, "a", 1)])
        .await
        .unwrap();
    let mut later = db.pool.begin().await.unwrap();
    let later_ids = outbox::append_rows(&mut later, &[row(&topic, "b", 1)])
        .await
        .unwrap();
    later.commit().await.unwrap();
    assert!(early_ids[0] < later_ids[0]);

    let first = kafka
        .read_all(&topic, 1, Duration::from_millis(300), WAIT)
        .await;
    assert_eq!(
        first.len(),
        1,
        "the committed later row is published without waiting"
    );
    assert_eq!(first[0].key.as_deref(), Some("b"));

    early.commit().await.unwrap();
    wait_all_published(&db).await;
    let all = kafka
        .read_all(&topic, 2, Duration::from_millis(300), WAIT)
        .await;
    let keys: Vec<_> = all.iter().map(|m| m.key.clone().unwrap()).collect();
    assert_eq!(keys, vec!["b", "a"], "the late row was not skipped");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instance_two_relays_share_the_outbox_keep_order_and_hand_over_when_one_stops() {
    let db = TestDb::new("relay-instance").await;
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("relay-instance", 4).await;
    let first = start(builder(&kafka.brokers, db.pool_of(3).await));
    let second = start(builder(&kafka.brokers, db.pool_of(3).await));
    wait_until("both instances own half the shards", WAIT, || async {
        (first.probe.owned_shards() == 32 && second.probe.owned_shards() == 32).then_some(())
    })
    .await;

    // One writer per key, so each key's sequence is its commit order.
    let keys = 40;
    let per_key = 30;
    let mut writers = Vec::new();
    for k in 0..keys {
        let (pool, topic) = (db.pool.clone(), topic.clone());
        writers.push(tokio::spawn(async move {
            let key = format!("key-{k}");
            for seq in 1..=per_key {
                let mut tx = pool.begin().await.unwrap();
                outbox::append_rows(&mut tx, &[row(&topic, &key, seq)])
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    wait_until("both instances published", WAIT, || async {
        (first.probe.published() > 50 && second.probe.published() > 50).then_some(())
    })
    .await;
    let first_published = first.probe.clone();
    first.stop().await;
    wait_until("the remaining instance owns every shard", WAIT, || async {
        (second.probe.owned_shards() == 64).then_some(())
    })
    .await;
    for w in writers {
        w.await.unwrap();
    }
    wait_all_published(&db).await;
    let total = usize::try_from(keys * per_key).unwrap();
    let messages = kafka
        .read_all(&topic, total, Duration::from_millis(500), WAIT)
        .await;
    let expected: BTreeMap<String, i64> =
        (0..keys).map(|k| (format!("key-{k}"), per_key)).collect();
    check_per_key_order(&messages, &expected);
    assert!(first_published.published() > 0 && second.probe.published() > 0);
    second.stop().await;
}

/// Inserts `keys` × `per_key` rows in transactions of 500 rows, in per-key sequence order.
async fn fill(db: &TestDb, topic: &str, keys: i64, per_key: i64) -> BTreeMap<String, i64> {
    let mut rows = Vec::new();
    for seq in 1..=per_key {
        for k in 0..keys {
            rows.push(row(topic, &format!("key-{k}"), seq));
        }
    }
    for chunk in rows.chunks(500) {
        let mut tx = db.pool.begin().await.unwrap();
        outbox::append_rows(&mut tx, chunk).await.unwrap();
        tx.commit().await.unwrap();
    }
    (0..keys).map(|k| (format!("key-{k}"), per_key)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_the_relay_process_mid_batch_loses_nothing() {
    let db = TestDb::new("relay-kill").await;
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("relay-kill", 2).await;
    let expected = fill(&db, &topic, 50, 200).await;
    let total = 50 * 200;

    let mut child = relay_command(&db, &kafka.brokers).spawn().unwrap();
    wait_until("part of the outbox published", WAIT, || async {
        let left = unpublished(&db).await;
        (left < total - 1_500).then_some(())
    })
    .await;
    child.start_kill().unwrap(); // SIGKILL, wherever it is
    child.wait().await.unwrap();
    let left_after_kill = unpublished(&db).await;
    assert!(left_after_kill > 0, "killed before the end");

    let mut restarted = relay_command(&db, &kafka.brokers).spawn().unwrap();
    wait_all_published(&db).await;
    restarted.start_kill().unwrap();
    restarted.wait().await.unwrap();

    let messages = kafka
        .read_all(
            &topic,
            usize::try_from(total).unwrap(),
            Duration::from_millis(800),
            WAIT,
        )
        .await;
    let duplicates = check_per_key_order(&messages, &expected);
    assert!(
        messages.len() >= usize::try_from(total).unwrap(),
        "every row at least once"
    );
    // A relay marks each batch after its acknowledgements and before the next: a kill can leave at most
    // one batch (200 rows) published but unmarked, which the restarted relay publishes again.
    assert!(
        duplicates <= 200,
        "at most the batch in flight is published twice, not {duplicates}"
    );
    assert_eq!(messages.len(), usize::try_from(total).unwrap() + duplicates);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn outage_of_the_broker_loses_nothing_and_marks_nothing_it_did_not_acknowledge() {
    let db = TestDb::new("relay-outage").await;
    let mut broker = PrivateBroker::launch("relay-outage").await;
    let kafka = TestKafka::with_brokers(&broker.brokers).await;
    let topic = kafka.topic("relay-outage", 2).await;
    let relay = start(builder(&broker.brokers, db.pool.clone()));

    let before = fill(&db, &topic, 10, 5).await;
    wait_all_published(&db).await;

    broker.stop().await;
    let mut during = BTreeMap::new();
    for k in 0..10 {
        let key = format!("key-{k}");
        let mut tx = db.pool.begin().await.unwrap();
        outbox::append_rows(&mut tx, &[row(&topic, &key, 6), row(&topic, &key, 7)])
            .await
            .unwrap();
        tx.commit().await.unwrap();
        during.insert(key, 7);
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        unpublished(&db).await,
        20,
        "nothing is marked published while the broker is away"
    );
    assert!(
        !relay.handle.is_finished(),
        "the relay waits, it does not exit"
    );

    broker.start().await;
    wait_all_published(&db).await;
    let messages = kafka
        .read_all(&topic, 70, Duration::from_millis(800), WAIT)
        .await;
    check_per_key_order(&messages, &during);
    // What was acknowledged and marked before the outage is not published again after it.
    let before_outage = messages
        .iter()
        .filter(|m| m.json()["seq"].as_i64().unwrap() <= 5)
        .count();
    assert_eq!(
        before_outage,
        before
            .values()
            .map(|n| usize::try_from(*n).unwrap())
            .sum::<usize>()
    );
    relay.stop().await;
    let unique: BTreeSet<(String, i64)> = messages
        .iter()
        .map(|m| {
            let p = m.json();
            (
                p["key"].as_str().unwrap().to_owned(),
                p["seq"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(unique.len(), 70);
}

/// The advisory locks on the outbox's shards that any session holds: (shard, holders).
async fn shard_locks(db: &TestDb) -> Vec<(i64, i64)> {
    sqlx::query_as(
        "SELECT objid::int8, count(*) FROM pg_locks \
         WHERE locktype = 'advisory' AND granted AND objsubid = 2 \
           AND classid = (hashtext('saga-outbox-shards/' || current_schema()) & 2147483647)::int4::oid \
         GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instance_a_relay_joining_after_repeated_rebalances_and_a_scale_down_gets_every_shard_it_is_due()
 {
    let db = TestDb::new("relay-shards").await;
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("relay-shards", 2).await;
    // Rebalancing every 50 ms runs the shard statements many times over: PostgreSQL then plans them
    // generically, which used to lock owned shards again (session advisory locks stack).
    let fast = |pool| builder(&kafka.brokers, pool).rebalance_interval(Duration::from_millis(50));
    let mut relays = Vec::new();
    for _ in 0..3 {
        relays.push(start(fast(db.pool_of(3).await)));
    }
    let owned = |relays: &[RunningRelay]| {
        relays
            .iter()
            .map(|r| r.probe.owned_shards())
            .collect::<Vec<_>>()
    };
    wait_until("three relays own every shard", WAIT, || async {
        (owned(&relays).iter().sum::<i64>() == 64).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;

    relays.push(start(fast(db.pool_of(3).await)));
    wait_until("four relays own 16 shards each", WAIT, || async {
        (owned(&relays) == [16, 16, 16, 16]).then_some(())
    })
    .await;
    let locks = shard_locks(&db).await;
    assert_eq!(locks.len(), 64, "every shard is locked");
    assert!(locks.iter().all(|(_, holders)| *holders == 1), "{locks:?}");

    // Scale down to two: the survivors take every shard the others held.
    relays.remove(0).stop().await;
    relays.remove(0).stop().await;
    wait_until("two relays own 32 shards each", WAIT, || async {
        (owned(&relays) == [32, 32]).then_some(())
    })
    .await;
    assert_eq!(shard_locks(&db).await.len(), 64);

    // And rows of every shard are published.
    let expected = fill(&db, &topic, 300, 1).await;
    let shards: i64 = sqlx::query_scalar("SELECT count(DISTINCT shard) FROM saga_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(shards, 64, "the rows cover every shard");
    wait_all_published(&db).await;
    let messages = kafka
        .read_all(&topic, 300, Duration::from_millis(500), WAIT)
        .await;
    check_per_key_order(&messages, &expected);
    for relay in relays {
        relay.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refused_a_row_the_broker_refuses_is_parked_its_key_held_until_then_and_other_keys_flow() {
    let db = TestDb::new("relay-refused").await;
    let kafka = TestKafka::new().await;
    // The broker itself refuses messages over 1,000 bytes on this topic.
    let topic = unique_name("relay-refused");
    kafka
        .create_topic_with(&topic, 1, &[("max.message.bytes", "1000")])
        .await;
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
    let mut rows = vec![big, row(&topic, "key-big", 2)];
    for k in 0..8 {
        rows.push(row(&topic, &format!("other-{k}"), 1));
    }
    let mut tx = db.pool.begin().await.unwrap();
    let ids = outbox::append_rows(&mut tx, &rows).await.unwrap();
    tx.commit().await.unwrap();

    // One message per produce request, one request at a time, and no idempotence: the broker refuses the
    // first row alone and accepts the second, the case where a relay must not mark the second before the
    // first is settled. Two rows per batch: held keys must not fill the batches.
    let kafka_config = KafkaConfig::new(&kafka.brokers)
        .with_property("batch.num.messages", "1")
        .with_property("max.in.flight.requests.per.connection", "1")
        .with_property("enable.idempotence", "false");
    let relay = builder(&kafka.brokers, db.pool.clone())
        .kafka(kafka_config)
        .batch_size(2)
        .park_after(4)
        .build()
        .unwrap();
    let probe = relay.probe();
    let stop = CancellationToken::new();
    let running = tokio::spawn(relay.run(stop.clone().cancelled_owned()));
    wait_until(
        "the refused row parked and the rest published",
        WAIT,
        || async {
            let left: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM saga_outbox WHERE published_at IS NULL AND parked_at IS NULL",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            (left == 0).then_some(())
        },
    )
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();

    type Times = (
        Option<chrono::DateTime<chrono::Utc>>,
        Option<chrono::DateTime<chrono::Utc>>,
        i32,
        Option<String>,
    );
    let times = |id: i64| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_as::<_, Times>(
                "SELECT published_at, parked_at, attempts, last_error FROM saga_outbox WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let (published, parked_at, attempts, error) = times(ids[0]).await;
    let parked_at = parked_at.expect("the refused row is parked");
    assert_eq!(published, None);
    assert_eq!(attempts, 4, "parked after its attempts");
    assert!(
        error.as_deref().unwrap_or_default().contains("too large"),
        "{error:?}"
    );
    let (second, _, _, _) = times(ids[1]).await;
    assert!(
        second.expect("the key's next row is published") >= parked_at,
        "the key's next row is marked only once the refused one is settled"
    );
    for id in &ids[2..] {
        let (published, _, _, _) = times(*id).await;
        assert!(
            published.expect("published") < parked_at,
            "other keys were published while the refused row waited for its retries"
        );
    }
    assert_eq!(probe.parked(), 1);
    let backlog = outbox_relay::backlog(&db.pool).await.unwrap();
    assert_eq!((backlog.unpublished, backlog.parked), (0, 1));
    let messages = kafka
        .read_all(&topic, 9, Duration::from_millis(500), WAIT)
        .await;
    assert!(
        messages
            .iter()
            .all(|m| m.json()["key"] != "key-big" || m.json()["seq"] == 2),
        "the refused row never reached the topic"
    );
}

/// Checks that, per key, no row comes after a later row of its key (a later duplicate of an earlier row
/// is allowed: it repeats, it does not reorder), and that each key's rows 1..=`expected[key]` are all
/// there. Returns the number of duplicates.
fn check_never_earlier_after_later(
    messages: &[ReadMessage],
    expected: &BTreeMap<String, i64>,
) -> usize {
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    let mut seen: BTreeMap<String, BTreeSet<i64>> = BTreeMap::new();
    let mut duplicates = 0;
    for m in messages {
        let payload = m.json();
        let key = payload["key"].as_str().unwrap().to_owned();
        let seq = payload["seq"].as_i64().unwrap();
        let highest = last.entry(key.clone()).or_insert(0);
        assert!(
            seq >= *highest,
            "key {key}: row {seq} at offset {} after row {highest}",
            m.offset
        );
        *highest = seq;
        if !seen.entry(key).or_default().insert(seq) {
            duplicates += 1;
        }
    }
    for (key, count) in expected {
        let got: Vec<i64> = seen.get(key).into_iter().flatten().copied().collect();
        assert_eq!(
            got,
            (1..=*count).collect::<Vec<_>>(),
            "key {key}: every row"
        );
    }
    duplicates
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn order_a_failed_delivery_never_lets_a_later_row_of_its_key_reach_the_topic_first() {
    let db = TestDb::new("relay-failed-delivery").await;
    let kafka = TestKafka::new().await;
    let topic = kafka.topic("relay-failed-delivery", 1).await;
    // Four keys of six rows each, in one batch.
    let expected = fill(&db, &topic, 4, 6).await;
    // The first delivery of key-1's second row fails, as if the broker had refused it: its key's later
    // rows are in the same batch.
    let failed = Arc::new(AtomicUsize::new(0));
    let hooks = {
        let failed = failed.clone();
        PublishHooks::default().fail_delivery(move |attempt| {
            let payload: serde_json::Value = serde_json::from_slice(attempt.payload?).ok()?;
            (payload["key"] == "key-1"
                && payload["seq"] == 2
                && failed.fetch_add(1, Ordering::SeqCst) == 0)
                .then(|| "injected: the broker refused the row".to_owned())
        })
    };
    let relay = start(builder(&kafka.brokers, db.pool.clone()).hooks(hooks));
    wait_all_published(&db).await;
    relay.stop().await;
    assert!(
        failed.load(Ordering::SeqCst) >= 2,
        "the row failed once, then was tried again"
    );
    let (attempts, error): (i32, Option<String>) = sqlx::query_as(
        "SELECT attempts, last_error FROM saga_outbox \
         WHERE convert_from(payload, 'UTF8')::jsonb @> '{\"key\": \"key-1\", \"seq\": 2}'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(attempts, 1, "one failed attempt recorded");
    assert!(error.unwrap_or_default().contains("injected"));
    let messages = kafka
        .read_all(&topic, 24, Duration::from_millis(500), WAIT)
        .await;
    let duplicates = check_never_earlier_after_later(&messages, &expected);
    assert_eq!(
        duplicates, 0,
        "no row was sent twice: the key's later rows waited for the failed one"
    );
}
