//! The `outbox-relay` binary answers bad configuration with one line naming the setting and exit code 2.

use saga_test_support::{TestDb, TestKafka, expect_usage_error, free_local_addr};
use tokio::process::Command;

fn relay(database_url: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
    command
        .env_remove("SAGA_SCHEMA")
        .env_remove("KAFKA_BROKERS")
        .env("DATABASE_URL", database_url);
    command
}

#[tokio::test]
async fn a_database_url_that_does_not_parse_is_named() {
    let line = expect_usage_error(
        {
            let mut c = relay("not a url");
            c.arg("status");
            c
        },
        "DATABASE_URL",
    )
    .await;
    assert!(line.contains("not a PostgreSQL URL"), "{line}");
}

#[tokio::test]
async fn a_database_that_does_not_answer_is_named() {
    let closed = free_local_addr();
    let line = expect_usage_error(
        {
            let mut c = relay(&format!("postgres://postgres@{closed}/postgres"));
            c.arg("status");
            c
        },
        "DATABASE_URL",
    )
    .await;
    assert!(line.contains("does not answer"), "{line}");
}

#[tokio::test]
async fn a_schema_without_the_outbox_is_named_with_what_to_run() {
    let db = TestDb::empty("relay-cli-schema").await;
    for args in [
        vec!["--schema", "no_such_schema", "status"],
        vec!["--schema", db.schema.as_str(), "status"],
        vec!["--schema", "no_such_schema", "migrate"],
    ] {
        let mut command = relay(&TestDb::database_url());
        command.args(&args);
        let line = expect_usage_error(command, "SAGA_SCHEMA").await;
        assert!(
            line.contains("outbox-relay migrate") || line.contains("create it"),
            "{args:?}: {line}"
        );
    }
}

#[tokio::test]
async fn a_broker_that_does_not_answer_is_named() {
    let db = TestDb::new("relay-cli-broker").await;
    let closed = free_local_addr();
    let mut command = relay(&TestDb::database_url());
    command.args([
        "--schema",
        &db.schema,
        "run",
        "--brokers",
        &closed.to_string(),
    ]);
    let line = expect_usage_error(command, "KAFKA_BROKERS").await;
    assert!(line.contains("no Kafka broker answers"), "{line}");
}

#[tokio::test]
async fn an_unknown_argument_is_one_line_and_a_good_command_still_works() {
    let db = TestDb::new("relay-cli-args").await;
    let kafka = TestKafka::new().await;
    let mut command = relay(&TestDb::database_url());
    command.args(["--schema", &db.schema, "status", "--bogus"]);
    expect_usage_error(command, "--bogus").await;
    // The same setting, spelled right, works (so the failures above are about what they name).
    let ok = relay(&TestDb::database_url())
        .args(["--schema", &db.schema, "status"])
        .env("KAFKA_BROKERS", &kafka.brokers)
        .output()
        .await
        .unwrap();
    assert!(ok.status.success(), "{ok:?}");
    assert!(String::from_utf8_lossy(&ok.stdout).contains("unpublished rows:"));
}

#[tokio::test]
async fn required_variables_that_are_missing_are_named() {
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
    command
        .env_remove("DATABASE_URL")
        .env_remove("KAFKA_BROKERS")
        .arg("status");
    expect_usage_error(command, "DATABASE_URL").await;
    let db = TestDb::new("relay-cli-required").await;
    let mut command = relay(&TestDb::database_url());
    command.args(["--schema", &db.schema, "run"]);
    let line = expect_usage_error(command, "KAFKA_BROKERS").await;
    assert!(line.contains("is not set"), "{line}");
}
