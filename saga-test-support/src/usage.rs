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
