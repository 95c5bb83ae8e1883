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

/// A password no test uses elsewhere: wherever it shows, a secret leaked.
pub const LEAK_CANARY: &str = "canary-password-7f3a9e";

/// Asserts that each binary of `paths` (started with `args`, a command that talks to Kafka at start) meets
/// the mistakes a team makes against a secured cluster with one line naming the setting, exit code 2, within
/// 30 seconds, and never shows the password: a wrong SASL password, a CA that did not sign the broker's
/// certificate, a plaintext client at the TLS listener (each against the secured broker
/// `scripts/dev-services` starts). The database of the test must be reachable.
pub async fn expect_security_mistakes_named(paths: &[&str], args: &[&str]) {
    let mut checks = tokio::task::JoinSet::new();
    for path in paths {
        for mistake in SecurityMistake::ALL {
            let (path, args) = (
                path.to_string(),
                args.iter().map(ToString::to_string).collect(),
            );
            checks.spawn(security_mistake_named(path, args, mistake));
        }
    }
    while let Some(done) = checks.join_next().await {
        if let Err(e) = done {
            std::panic::resume_unwind(e.into_panic());
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum SecurityMistake {
    WrongPassword,
    UnknownCa,
    PlaintextAtTls,
}

impl SecurityMistake {
    const ALL: [Self; 3] = [Self::WrongPassword, Self::UnknownCa, Self::PlaintextAtTls];

    /// The environment of the mistake, and the setting its line must name.
    fn env(self) -> (Vec<(&'static str, String)>, &'static str) {
        let mut env = crate::sasl_ssl_env();
        let mut set = |name: &'static str, value: String| {
            env.retain(|(n, _)| *n != name);
            env.push((name, value));
        };
        match self {
            Self::WrongPassword => {
                set("KAFKA_SASL_PASSWORD", LEAK_CANARY.to_owned());
                (env, "KAFKA_SASL_PASSWORD")
            }
            Self::UnknownCa => {
                let other = crate::tls_file("other-ca.pem").display().to_string();
                set("KAFKA_SSL_CA_LOCATION", other);
                set("KAFKA_SASL_PASSWORD", LEAK_CANARY.to_owned());
                (env, "KAFKA_SSL_CA_LOCATION")
            }
            Self::PlaintextAtTls => {
                let brokers = crate::secure_brokers();
                (vec![("KAFKA_BROKERS", brokers)], "KAFKA_SECURITY_PROTOCOL")
            }
        }
    }
}

async fn security_mistake_named(path: String, args: Vec<String>, mistake: SecurityMistake) {
    let (env, setting) = mistake.env();
    let mut command = program(&path);
    command
        .args(&args)
        .env("DATABASE_URL", crate::TestDb::database_url())
        .envs(env);
    let started = std::time::Instant::now();
    let line = expect_usage_error(command, setting).await;
    let took = started.elapsed();
    assert!(
        took < std::time::Duration::from_secs(30),
        "{path} {mistake:?}: took {took:?} to say {line}"
    );
    assert!(
        !line.contains(LEAK_CANARY),
        "{path} {mistake:?} shows the password: {line}"
    );
}

/// Asserts that `path args --help`, run with every secret setting set to [`LEAK_CANARY`], lists the
/// secret settings but shows none of their values.
pub async fn expect_help_hides_secrets(path: &str, args: &[&str]) {
    let output = tokio::process::Command::new(path)
        .args(args)
        .arg("--help")
        .env("KAFKA_SASL_PASSWORD", LEAK_CANARY)
        .env("KAFKA_SSL_KEY_PASSWORD", LEAK_CANARY)
        .env("KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET", LEAK_CANARY)
        // The URLs' passwords too, where a program takes them.
        .env(
            "DATABASE_URL",
            format!("postgres://svc:{LEAK_CANARY}@db.internal/sagas"),
        )
        .env(
            "SAGA_REPLICATION_URL",
            format!("postgres://repl:{LEAK_CANARY}@db.internal/sagas"),
        )
        .env(
            "REDIS_URL",
            format!("redis://:{LEAK_CANARY}@cache.internal"),
        )
        .output()
        .await
        .expect("starting the binary");
    let help = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{path} --help failed: {help}");
    for setting in [
        "KAFKA_SASL_PASSWORD",
        "KAFKA_SSL_KEY_PASSWORD",
        "KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET",
    ] {
        assert!(
            help.contains(setting),
            "{path} --help does not list {setting}:\n{help}"
        );
    }
    assert!(
        !help.contains(LEAK_CANARY),
        "{path} --help shows a secret:\n{help}"
    );
}
