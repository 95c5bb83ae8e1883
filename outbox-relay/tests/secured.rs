//! The `outbox-relay` binary against the secured broker `scripts/dev-services` starts (TLS only,
//! SASL/SCRAM): it publishes the outbox over SASL_SSL in per-key commit order, its metrics and debug log
//! never show the password, and a wrong password, an unknown CA or a plaintext client at the TLS listener
//! stop it at start with one line naming the setting.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use saga_runtime::store::outbox;
use saga_test_support::{
    SECURE_PASSWORD, TestDb, TestKafka, expect_help_hides_secrets, expect_security_mistakes_named,
    free_local_addr, sasl_ssl_env, sasl_ssl_properties, secure_brokers, wait_until,
};

use common::{WAIT, check_per_key_order, row};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_publishes_over_sasl_ssl_and_shows_the_password_nowhere() {
    publishes_over_sasl_ssl("relay-secured", sasl_ssl_env()).await;
}

/// The same settings given through the escape hatch alone (`KAFKA_PROPERTY_*`): the checks read what
/// librdkafka will, so they pass, and the relay publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_publishes_over_sasl_ssl_set_through_the_escape_hatch_alone() {
    let mut env = vec![("KAFKA_BROKERS".to_owned(), secure_brokers())];
    env.extend(sasl_ssl_properties().into_iter().map(|(name, value)| {
        let variable = format!("KAFKA_PROPERTY_{}", name.replace('.', "_").to_uppercase());
        (variable, value)
    }));
    publishes_over_sasl_ssl("relay-secured-hatch", env).await;
}

/// Runs the relay binary with `env`, publishes 20 rows of four keys, and checks their order and that
/// neither the metrics nor the debug log show the password.
async fn publishes_over_sasl_ssl<K: AsRef<std::ffi::OsStr>>(name: &str, env: Vec<(K, String)>) {
    let db = TestDb::new(name).await;
    let kafka = TestKafka::secured().await;
    let topic = kafka.topic(name, 2).await;
    let mut expected = BTreeMap::new();
    let mut tx = db.pool.begin().await.unwrap();
    for seq in 1..=20 {
        let key = format!("key-{}", seq % 4);
        let n = expected.entry(key.clone()).or_insert(0);
        *n += 1;
        outbox::append_rows(&mut tx, &[row(&topic, &key, *n)])
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();

    let ops = free_local_addr();
    let mut relay = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["--database-url", &db.url(), "run"])
        .args([
            "--relay-poll-interval-ms",
            "200",
            "--relay-gc-interval-secs",
            "0",
        ])
        .args(["--relay-ops-addr", &ops.to_string()])
        .envs(env)
        .env("RUST_LOG", "debug")
        .env("KAFKA_PROPERTY_DEBUG", "security,conf,broker")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    wait_until("every row published", WAIT, || async {
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM saga_outbox WHERE published_at IS NULL")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        (left == 0).then_some(())
    })
    .await;
    let metrics = reqwest_text(ops).await;
    assert!(metrics.contains("saga_relay"), "{metrics}");
    relay.start_kill().unwrap();
    let output = relay.wait_with_output().await.unwrap();
    let log = String::from_utf8_lossy(&output.stderr);

    let messages = kafka
        .read_all(&topic, 20, Duration::from_millis(800), WAIT)
        .await;
    assert_eq!(
        check_per_key_order(&messages, &expected),
        0,
        "no duplicates"
    );
    assert!(
        log.contains("SASL") || log.contains("sasl"),
        "the debug log says how it authenticated (else this check of it proves nothing)"
    );
    for shown in [metrics.as_str(), &log] {
        assert!(
            !shown.contains(SECURE_PASSWORD),
            "the password shows: {shown}"
        );
    }
}

/// `GET /metrics` of the ops endpoint at `addr`, as text.
async fn reqwest_text(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).await.unwrap();
    text
}

#[tokio::test]
async fn a_refused_password_an_unknown_ca_and_plaintext_at_tls_stop_the_relay_naming_the_setting() {
    let db = TestDb::new("relay-secured-mistakes").await;
    expect_security_mistakes_named(
        &[env!("CARGO_BIN_EXE_outbox-relay")],
        &["--schema", &db.schema, "run"],
    )
    .await;
    expect_help_hides_secrets(env!("CARGO_BIN_EXE_outbox-relay"), &["run"]).await;
}
