//! Every binary of the example answers bad configuration with one line naming the setting and exit code 2,
//! never a panic.

use saga_test_support::{
    TestDb, expect_configuration_mistakes_named, expect_help_hides_secrets,
    expect_security_mistakes_named,
};

const BINARIES: [&str; 3] = [
    env!("CARGO_BIN_EXE_order-service"),
    env!("CARGO_BIN_EXE_payment-service"),
    env!("CARGO_BIN_EXE_shipping-service"),
];

#[tokio::test]
async fn every_service_names_a_bad_database_url_an_absent_database_or_broker_and_a_bad_flag() {
    let _db = TestDb::empty("cli-broker").await;
    expect_configuration_mistakes_named(&BINARIES, &BINARIES).await;
}

/// Against the secured broker: a wrong password, a CA that did not sign the broker's certificate and a
/// plaintext client at the TLS listener each stop a service at start, within 30 s, with one line naming
/// the setting (no crash loop, no endless retry), and no line or `--help` shows a secret.
#[tokio::test]
async fn every_service_names_a_refused_password_an_unknown_ca_and_plaintext_at_tls() {
    let _db = TestDb::empty("cli-secured").await;
    expect_security_mistakes_named(&BINARIES, &[]).await;
    for binary in BINARIES {
        expect_help_hides_secrets(binary, &[]).await;
    }
}

/// The example services read the framework's settings through the framework's declarations: a setting
/// means the same in them as in any service (`SAGA_CREATE_TOPICS` is a partition count, not a switch).
#[tokio::test]
async fn the_services_read_the_frameworks_settings_as_any_service_does() {
    for binary in BINARIES {
        let mut command = tokio::process::Command::new(binary);
        command.env("SAGA_CREATE_TOPICS", "true");
        let line = saga_test_support::expect_usage_error(command, "SAGA_CREATE_TOPICS").await;
        assert!(line.contains("'true'"), "{line}");
        let help = tokio::process::Command::new(binary)
            .arg("--help")
            .output()
            .await
            .unwrap();
        let help = String::from_utf8_lossy(&help.stdout);
        for flag in ["--relay-batch-size", "--key-retention-hours", "--group-id"] {
            assert!(help.contains(flag), "{binary}: {flag} in --help");
        }
    }
}
