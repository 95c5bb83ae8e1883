//! Every program of the lab (the demo, the chaos program, the benchmark) answers bad configuration with one
//! line naming the setting and exit code 2, never a panic.

use saga_test_support::{TestDb, expect_configuration_mistakes_named, expect_usage_error};
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
async fn every_program_names_a_bad_database_url_an_absent_database_or_broker_and_a_bad_flag() {
    let _db = TestDb::empty("cli-broker").await;
    expect_configuration_mistakes_named(&BINARIES, &[BINARIES[0], BINARIES[2]]).await;
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
