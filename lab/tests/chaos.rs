//! A small, bounded run of the chaos program on a private broker: SIGKILLs of consumers and relays, crashes
//! after database commits, every event delivered twice, one broker restart, with the outbox in a table and on
//! the write-ahead log. The program checks the ledgers and exits non-zero on any violation; this test also
//! checks that the faults really happened.

use saga_lab::harness::summary::{figure, run_to_summary};
use saga_test_support::TestDb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_with_kills_crashes_duplicates_and_a_broker_restart_keeps_every_invariant() {
    chaos("table").await;
}

/// The same, with the outbox on the write-ahead log: the relays killed are WAL relays, each restarted one
/// taking its slot over where the killed one confirmed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_with_the_outbox_on_the_write_ahead_log_keeps_every_invariant() {
    chaos("wal").await;
}

async fn chaos(outbox: &str) {
    // Makes sure the database exists; the program creates its own schemas in it.
    let _db = TestDb::empty("chaos").await;
    let mut chaos = tokio::process::Command::new(env!("CARGO_BIN_EXE_chaos"));
    chaos
        .args(["--orders", "120", "--kill-every-ms", "2500"])
        .args(["--crash-rate", "0.01", "--timeout-secs", "600"])
        .args(["--outbox", outbox])
        .env("DATABASE_URL", TestDb::database_url());
    let stdout = run_to_summary(chaos).await;
    let value = |label: &str| figure(&stdout, label);
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
    // The counts above are also guaranteed by primary keys (a second charge of one order would fail and be
    // dead-lettered): that no step ran twice and nothing was dead-lettered is what shows exactly once.
    // The events went through the outbox asked for: rows in table mode, none (the log) in WAL mode.
    let rows = value("outbox rows written");
    if outbox == "wal" {
        assert_eq!(rows, 0, "{stdout}");
    } else {
        assert!(rows > 0, "{stdout}");
    }
    assert_eq!(value("steps run twice"), 0, "{stdout}");
    assert_eq!(value("dead letters"), 0, "{stdout}");
}
