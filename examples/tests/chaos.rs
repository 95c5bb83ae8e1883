//! A small, bounded run of the chaos program on a private broker: SIGKILLs of consumers and relays, crashes
//! after database commits, every event delivered twice, one broker restart. The program checks the ledgers
//! and exits non-zero on any violation; this test also checks that the faults really happened.

use saga_test_support::TestDb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_with_kills_crashes_duplicates_and_a_broker_restart_keeps_every_invariant() {
    // Makes sure the database exists; the program creates its own schemas in it.
    let _db = TestDb::empty("chaos").await;
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_chaos"))
        .args([
            "--orders",
            "120",
            "--kill-every-ms",
            "2500",
            "--crash-rate",
            "0.01",
        ])
        .args(["--timeout-secs", "600"])
        .env("DATABASE_URL", TestDb::database_url())
        .env("RUST_BACKTRACE", "0")
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "chaos failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("all hold"), "{stdout}");
    let value = |name: &str| -> i64 {
        stdout
            .lines()
            .filter(|l| l.trim_start().starts_with(name))
            .filter_map(|l| l.split_whitespace().last()?.parse::<i64>().ok())
            .sum()
    };
    assert_eq!(value("orders accepted"), 120);
    assert_eq!(
        value("charges at the gateway"),
        100,
        "one charge per paid order"
    );
    assert_eq!(
        value("shipments arranged"),
        80,
        "one shipment per completed order"
    );
    assert_eq!(
        value("refunds at the gateway"),
        20,
        "one refund per failed shipment"
    );
    assert!(value("SIGKILLs of") > 0, "processes were killed:\n{stdout}");
    assert_eq!(value("broker restarts"), 1, "{stdout}");
    assert!(value("duplicate deliveries injected") > 0);
}
