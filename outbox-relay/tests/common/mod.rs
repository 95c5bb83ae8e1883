//! What the relay's tests share: rows numbered per key, a relay for tests (in the process or as a process
//! of its own), and the check of per-key order on the topic.

#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_relay::{Relay, RelayBuilder, RelayProbe};
use saga_core::{Event, IdempotencyKey, Lineage, OutboxMessage, TenantId};
use saga_test_support::{ReadMessage, TestDb};
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub const WAIT: Duration = Duration::from_secs(90);

/// An outbox row for `key` carrying its per-key sequence number.
pub fn row(topic: &str, key: &str, seq: i64) -> OutboxMessage {
    let lineage = Lineage::root(IdempotencyKey::new(key).unwrap(), TenantId::default());
    let event = Event::new(
        "Numbered",
        topic,
        key,
        &serde_json::json!({ "key": key, "seq": seq }),
    )
    .unwrap();
    OutboxMessage::from_event(event, &lineage, "relay-test")
}

/// A relay for tests: quick polls and rebalances, batches of 500.
pub fn builder(brokers: &str, pool: PgPool) -> RelayBuilder {
    Relay::builder()
        .brokers(brokers)
        .pool(pool)
        .batch_size(500)
        .poll_interval(Duration::from_millis(200))
        .rebalance_interval(Duration::from_millis(200))
}

pub struct RunningRelay {
    pub stop: CancellationToken,
    pub handle: JoinHandle<Result<(), outbox_relay::RelayError>>,
    pub probe: RelayProbe,
}

pub fn start(builder: RelayBuilder) -> RunningRelay {
    let relay = builder.build().expect("a valid relay");
    let probe = relay.probe();
    let stop = CancellationToken::new();
    let handle = tokio::spawn(relay.run(stop.clone().cancelled_owned()));
    RunningRelay {
        stop,
        handle,
        probe,
    }
}

impl RunningRelay {
    pub async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(WAIT, self.handle)
            .await
            .expect("the relay stops")
            .unwrap()
            .unwrap();
    }
}

/// Checks that, per key, the first occurrence of each sequence number comes in increasing order and that
/// every number from 1 to `expected[key]` is there. Returns the number of duplicates.
pub fn check_per_key_order(messages: &[ReadMessage], expected: &BTreeMap<String, i64>) -> usize {
    let mut seen: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let mut duplicates = 0;
    // Same key, same partition: offset order within a partition is publication order.
    for m in messages {
        let payload = m.json();
        let key = payload["key"].as_str().unwrap().to_owned();
        assert_eq!(
            m.key.as_deref(),
            Some(key.as_str()),
            "the Kafka key is the row's key"
        );
        let seq = payload["seq"].as_i64().unwrap();
        let list = seen.entry(key).or_default();
        if list.contains(&seq) {
            duplicates += 1;
        } else {
            list.push(seq);
        }
    }
    for (key, count) in expected {
        let got = seen.get(key).cloned().unwrap_or_default();
        let want: Vec<i64> = (1..=*count).collect();
        assert_eq!(got, want, "key {key}: rows in commit order, none missing");
    }
    assert_eq!(seen.len(), expected.len(), "no unexpected keys");
    duplicates
}

pub fn relay_command(db: &TestDb, brokers: &str) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
    command
        .args(["--database-url", &db.url(), "run", "--brokers", brokers])
        .args([
            "--relay-batch-size",
            "200",
            "--relay-poll-interval-ms",
            "200",
            "--relay-gc-interval-secs",
            "0",
        ])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    command
}

/// Per-key commit order, as the tests record it: a row per key of `keys` whose number a writer takes
/// (`next_in_commit_order`) under the row's lock, in the transaction that writes the key's event, so per
/// key, number order is commit order.
pub async fn commit_order_table(db: &TestDb, keys: &[String]) {
    sqlx::query("CREATE TABLE commit_order (key TEXT PRIMARY KEY, n BIGINT NOT NULL DEFAULT 0)")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO commit_order (key) SELECT * FROM unnest($1::text[])")
        .bind(keys)
        .execute(&db.pool)
        .await
        .unwrap();
}

/// The next number of `key` in commit order, taken in `tx` (see [`commit_order_table`]).
pub async fn next_in_commit_order(tx: &mut sqlx::PgConnection, key: &str) -> i64 {
    sqlx::query_scalar("UPDATE commit_order SET n = n + 1 WHERE key = $1 RETURNING n")
        .bind(key)
        .fetch_one(tx)
        .await
        .unwrap()
}

/// Each key's last number: what [`check_per_key_order`] expects.
pub async fn last_in_commit_order(db: &TestDb) -> BTreeMap<String, i64> {
    sqlx::query_as("SELECT key, n FROM commit_order")
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}
