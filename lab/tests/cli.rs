//! Every program of the lab (the demo, the chaos program, the benchmark) answers bad configuration with one
//! line naming the setting and exit code 2, never a panic.

use saga_test_support::{TestDb, expect_usage_error, free_local_addr};
use tokio::process::Command;

const BINARIES: [&str; 3] = [
    env!("CARGO_BIN_EXE_saga-demo"),
    env!("CARGO_BIN_EXE_chaos"),
    env!("CARGO_BIN_EXE_saga-bench"),
];

fn binary(path: &str) -> Command {
    let mut command = Command::new(path);
    command.env_remove("KAFKA_BROKERS");
    command
}

#[tokio::test]
async fn a_database_url_that_does_not_parse_is_named_by_every_program() {
    for path in BINARIES {
        let mut command = binary(path);
        command.env("DATABASE_URL", "not a url");
        let line = expect_usage_error(command, "DATABASE_URL").await;
        assert!(line.contains("not a PostgreSQL URL"), "{path}: {line}");
    }
}

#[tokio::test]
async fn a_database_that_does_not_answer_is_named_by_every_program() {
    let closed = free_local_addr();
    for path in BINARIES {
        let mut command = binary(path);
        command.env(
            "DATABASE_URL",
            format!("postgres://postgres@{closed}/postgres"),
        );
        let line = expect_usage_error(command, "DATABASE_URL").await;
        assert!(line.contains("does not answer"), "{path}: {line}");
    }
}

#[tokio::test]
async fn a_broker_that_does_not_answer_is_named_by_the_demo_and_the_bench() {
    let _db = TestDb::empty("cli-broker").await;
    let closed = free_local_addr().to_string();
    for path in [BINARIES[0], BINARIES[2]] {
        let mut command = binary(path);
        command
            .env("DATABASE_URL", TestDb::database_url())
            .env("KAFKA_BROKERS", &closed);
        let line = expect_usage_error(command, "KAFKA_BROKERS").await;
        assert!(line.contains("no Kafka broker answers"), "{path}: {line}");
    }
}

#[tokio::test]
async fn bad_arguments_are_one_line_with_exit_code_2() {
    for path in BINARIES {
        let mut command = binary(path);
        command.arg("--no-such-flag");
        expect_usage_error(command, "--no-such-flag").await;
    }
    let mut command = binary(BINARIES[1]);
    command.args(["--orders", "many"]);
    expect_usage_error(command, "--orders").await;
}

#[tokio::test]
async fn chaos_without_the_broker_binary_says_how_to_install_it() {
    let _db = TestDb::empty("cli-chaos").await;
    let mut command = binary(BINARIES[1]);
    command
        .env("DATABASE_URL", TestDb::database_url())
        .env("NISSHI_BIN", "/nonexistent/nisshi");
    let line = expect_usage_error(command, "NISSHI_BIN").await;
    assert!(line.contains("scripts/dev-services"), "{line}");
}
