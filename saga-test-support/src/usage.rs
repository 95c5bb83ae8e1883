//! Checking how a binary answers bad input: one line on stderr naming the setting, exit code 2, no panic.

use std::process::Output;

/// Runs `command` (its stdin closed) and asserts that it failed as a binary of the framework must on bad
/// input or configuration: exit code 2, and on stderr exactly one line, which mentions `setting`, with no
/// panic or backtrace. Returns that line.
pub async fn expect_usage_error(mut command: tokio::process::Command, setting: &str) -> String {
    let output: Output = command
        .stdin(std::process::Stdio::null())
        .env_remove("RUST_BACKTRACE")
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("starting the binary");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(
        output.status.code(),
        Some(2),
        "exit code 2 expected; stderr:\n{stderr}"
    );
    assert!(
        !stderr.contains("panicked") && !stderr.contains("backtrace"),
        "no panic or backtrace expected:\n{stderr}"
    );
    assert_eq!(lines.len(), 1, "one line expected:\n{stderr}");
    assert!(
        lines[0].contains(setting),
        "the line should name {setting}: {}",
        lines[0]
    );
    lines[0].to_owned()
}

/// `path` run with the environment cleared of `KAFKA_BROKERS`, the way the checks below start a binary.
fn program(path: &str) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(path);
    command.env_remove("KAFKA_BROKERS");
    command
}

/// Asserts that each binary of `paths` answers the configuration mistakes every binary of the framework
/// can meet with one line naming the setting and exit code 2: a `DATABASE_URL` that does not parse, a
/// database that does not answer, an unknown flag; and, for `with_broker` (those that talk to Kafka at
/// start), a broker that does not answer (the database of the test then must be reachable).
pub async fn expect_configuration_mistakes_named(paths: &[&str], with_broker: &[&str]) {
    // Each binary's checks wait on timeouts: run them side by side.
    let mut checks = tokio::task::JoinSet::new();
    for path in paths {
        checks.spawn(configuration_mistakes_named(path.to_string(), false));
    }
    for path in with_broker {
        checks.spawn(configuration_mistakes_named(path.to_string(), true));
    }
    while let Some(done) = checks.join_next().await {
        if let Err(e) = done {
            std::panic::resume_unwind(e.into_panic());
        }
    }
}

async fn configuration_mistakes_named(path: String, broker: bool) {
    let closed = crate::free_local_addr();
    if broker {
        let mut command = program(&path);
        command
            .env("DATABASE_URL", crate::TestDb::database_url())
            .env("KAFKA_BROKERS", closed.to_string());
        let line = expect_usage_error(command, "KAFKA_BROKERS").await;
        assert!(line.contains("no Kafka broker answers"), "{path}: {line}");
        return;
    }
    let mut command = program(&path);
    command.env("DATABASE_URL", "not a url");
    let line = expect_usage_error(command, "DATABASE_URL").await;
    assert!(line.contains("not a PostgreSQL URL"), "{path}: {line}");

    let mut command = program(&path);
    command.env(
        "DATABASE_URL",
        format!("postgres://postgres@{closed}/postgres"),
    );
    let line = expect_usage_error(command, "DATABASE_URL").await;
    assert!(line.contains("does not answer"), "{path}: {line}");

    let mut command = program(&path);
    command.arg("--no-such-flag");
    expect_usage_error(command, "--no-such-flag").await;
}
