//! Every binary of the example answers bad configuration with one line naming the setting and exit code 2,
//! never a panic.

use saga_test_support::{TestDb, expect_usage_error, free_local_addr};
use tokio::process::Command;

const BINARIES: [&str; 3] = [
    env!("CARGO_BIN_EXE_order-service"),
    env!("CARGO_BIN_EXE_payment-service"),
    env!("CARGO_BIN_EXE_shipping-service"),
];

fn binary(path: &str) -> Command {
    let mut command = Command::new(path);
    command.env_remove("KAFKA_BROKERS");
    command
}

#[tokio::test]
async fn a_database_url_that_does_not_parse_is_named_by_every_service() {
    for path in BINARIES {
        let mut command = binary(path);
        command.env("DATABASE_URL", "not a url");
        let line = expect_usage_error(command, "DATABASE_URL").await;
        assert!(line.contains("not a PostgreSQL URL"), "{path}: {line}");
    }
}

#[tokio::test]
async fn a_database_that_does_not_answer_is_named_by_every_service() {
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
async fn a_broker_that_does_not_answer_is_named_by_every_service() {
    let _db = TestDb::empty("cli-broker").await;
    let closed = free_local_addr().to_string();
    for path in BINARIES {
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
}
