//! The `saga` command against the secured broker `scripts/dev-services` starts (TLS only, SASL/SCRAM): it
//! lists dead letters over SASL_SSL, serves the inspector, and shows the password nowhere (its answers, its
//! page, its metrics, its debug log); a broker it cannot reach, or that refuses it, is an error with one
//! line naming the setting, never "0 dead letters".

mod common;

use std::time::Duration;

use saga_lab::harness::client::request;
use saga_test_support::{
    SECURE_PASSWORD, TestDb, TestKafka, expect_help_hides_secrets, expect_security_mistakes_named,
    expect_usage_error, free_local_addr, sasl_ssl_env, wait_until,
};

use common::Target;

async fn secured_target(name: &str) -> (TestDb, TestKafka, Target) {
    let db = TestDb::with(
        name,
        &[
            saga_consumer::migrate::migrator(),
            saga_orchestrator::migrate::migrator(),
        ],
    )
    .await;
    let kafka = TestKafka::secured().await;
    let target = Target {
        database_url: TestDb::database_url(),
        schema: db.schema.clone(),
        brokers: kafka.brokers.clone(),
    };
    (db, kafka, target)
}

/// `saga args` over SASL_SSL, with `RUST_LOG` at debug and librdkafka's own security and configuration
/// logging on: what a leak would most likely show.
fn secured(target: &Target, args: &[&str]) -> tokio::process::Command {
    let mut command = target.command(args);
    command
        .envs(sasl_ssl_env())
        .env("RUST_LOG", "debug")
        .env("KAFKA_PROPERTY_DEBUG", "security,conf,broker");
    command
}

#[tokio::test]
async fn dlq_list_reads_dead_letters_over_sasl_ssl_and_shows_the_password_nowhere() {
    let (_db, kafka, saga) = secured_target("admin-secured-list").await;
    let topic = common::dlq_topic(&kafka, "admin-secured", 1).await;
    let now = chrono::Utc::now().to_rfc3339();
    kafka
        .produce(
            &kafka.producer(),
            &topic,
            Some("order-7"),
            &[
                ("idempotency-key", "order-7"),
                ("dlq-original-topic", "orders"),
                ("dlq-original-partition", "0"),
                ("dlq-original-offset", "7"),
                ("dlq-consumer-group", "payments"),
                ("dlq-step", "process-payment"),
                ("dlq-reason", "handler-failed"),
                ("dlq-error", "card declined"),
                ("dlq-attempts", "1"),
                ("dlq-failed-at", &now),
            ],
            b"{}",
        )
        .await;
    let output = secured(&saga, &["dlq", "list", "--topic", &topic])
        .output()
        .await
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(output.status.success(), "{stderr}");
    assert!(stdout.contains("1 dead letters"), "{stdout}");
    assert!(stdout.contains("card declined"), "{stdout}");
    assert!(
        stderr.contains("sasl") || stderr.contains("SASL"),
        "the debug log says how it authenticated (else this check of it proves nothing): {stderr}"
    );
    for shown in [&stdout, &stderr] {
        assert!(
            !shown.contains(SECURE_PASSWORD),
            "the password shows: {shown}"
        );
    }
}

#[tokio::test]
async fn an_unreachable_or_refusing_broker_is_an_error_never_zero_dead_letters() {
    let (_db, kafka, saga) = secured_target("admin-secured-refused").await;
    let topic = common::dlq_topic(&kafka, "admin-refused", 1).await;
    // Nobody listens.
    let closed = free_local_addr().to_string();
    let mut command = saga.command(&["dlq", "list", "--topic", &topic]);
    command.env("KAFKA_BROKERS", &closed);
    let line = expect_usage_error(command, "KAFKA_BROKERS").await;
    assert!(line.contains("no Kafka broker answers"), "{line}");
    // The secured listener, reached in plaintext, and with a wrong password.
    let mut command = saga.command(&["dlq", "list", "--topic", &topic]);
    command.env("KAFKA_BROKERS", &kafka.brokers);
    expect_usage_error(command, "KAFKA_SECURITY_PROTOCOL").await;
    expect_security_mistakes_named(
        &[env!("CARGO_BIN_EXE_saga")],
        &["--schema", &saga.schema, "dlq", "list", "--topic", &topic],
    )
    .await;
}

#[tokio::test]
async fn the_inspector_serves_over_sasl_ssl_without_showing_the_password() {
    let (_db, kafka, saga) = secured_target("admin-secured-inspect").await;
    let topic = common::dlq_topic(&kafka, "admin-inspect", 1).await;
    let addr = free_local_addr();
    let listen = addr.to_string();
    let mut command = secured(&saga, &["inspect", "--listen", &listen]);
    command
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut inspector = command.spawn().unwrap();
    // Read the debug log as it comes: a full pipe would stop the inspector.
    let mut stderr = inspector.stderr.take().unwrap();
    let log = tokio::spawn(async move {
        let mut text = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut stderr, &mut text)
            .await
            .map(|_| text)
    });
    wait_until("the inspector", Duration::from_secs(60), || async {
        request(addr, "GET", "/", &[], None)
            .await
            .ok()
            .filter(|(status, _, _)| *status == 200)
    })
    .await;
    let mut pages = Vec::new();
    for path in [
        "/",
        "/metrics",
        "/groups",
        &format!("/dlq/{topic}"),
        "/api/overview",
    ] {
        let (status, _, body) = request(addr, "GET", path, &[], None).await.unwrap();
        assert_eq!(status, 200, "{path}: {}", String::from_utf8_lossy(&body));
        pages.push(String::from_utf8_lossy(&body).into_owned());
    }
    assert!(pages[3].contains(&topic), "the topic's page: {}", pages[3]);
    let _ = inspector.start_kill();
    inspector.wait().await.unwrap();
    let log = log.await.unwrap().unwrap();
    assert!(
        log.contains("DEBUG"),
        "the inspector logged at debug: {log}"
    );
    for shown in pages.iter().chain([&log]) {
        assert!(
            !shown.contains(SECURE_PASSWORD),
            "the password shows: {shown}"
        );
    }
}

#[tokio::test]
async fn saga_help_lists_the_secret_settings_without_their_values() {
    expect_help_hides_secrets(env!("CARGO_BIN_EXE_saga"), &[]).await;
    expect_help_hides_secrets(env!("CARGO_BIN_EXE_saga"), &["dlq", "list"]).await;
}
