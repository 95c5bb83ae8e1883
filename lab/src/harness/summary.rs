//! The table a run prints at the end.

use crate::harness::ledger::Ledger;
use crate::harness::run::ClientStats;

/// Everything the summary shows.
#[derive(Debug)]
pub struct Summary<'a> {
    /// The title line.
    pub title: String,
    /// What the ledger says.
    pub ledger: &'a Ledger,
    /// What the client saw.
    pub client: &'a ClientStats,
    /// Duplicates the consumers absorbed.
    pub duplicates_absorbed: u64,
    /// Duplicate deliveries injected.
    pub duplicates_injected: u64,
    /// Process deaths (crashes and kills), each followed by a restart.
    pub deaths: u32,
    /// Messages in the services' dead-letter topics (none may be: every message of a run is valid).
    pub dead_letters: i64,
    /// Extra lines.
    pub extra: Vec<(String, String)>,
}

impl Summary<'_> {
    /// Prints the table.
    pub fn print(&self) {
        let l = self.ledger;
        let c = self.client;
        let mut rows: Vec<(String, String)> = vec![
            ("orders accepted".into(), c.accepted.to_string()),
            ("  completed".into(), l.completed.to_string()),
            (
                "  compensated: card declined".into(),
                l.declined.to_string(),
            ),
            (
                "  compensated: shipment failed, refunded".into(),
                l.refunded.to_string(),
            ),
            ("charges at the gateway".into(), l.charges.to_string()),
            ("refunds at the gateway".into(), l.refunds.to_string()),
            ("shipments arranged".into(), l.shipments.to_string()),
            ("steps run twice".into(), l.steps_run_twice.to_string()),
            ("dead letters".into(), self.dead_letters.to_string()),
            ("HTTP requests".into(), c.requests.to_string()),
            (
                "HTTP replays (same key, stored response)".into(),
                c.replays.to_string(),
            ),
            (
                "HTTP 409 (same key in flight)".into(),
                c.conflicts.to_string(),
            ),
            (
                "duplicates absorbed by step keys".into(),
                self.duplicates_absorbed.to_string(),
            ),
            (
                "duplicate deliveries injected".into(),
                self.duplicates_injected.to_string(),
            ),
            (
                "service processes died and restarted".into(),
                self.deaths.to_string(),
            ),
        ];
        rows.extend(self.extra.iter().cloned());
        let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        println!();
        println!("{}", self.title);
        println!("{}", "─".repeat(width + 12));
        for (name, value) in rows {
            println!("{name:<width$}  {value:>8}");
        }
        println!("{}", "─".repeat(width + 12));
        if self.ok() {
            println!(
                "invariants: every order finished, one charge per paid order, a refund only for a failed shipment,"
            );
            println!(
                "            one shipment per completed order, no order lost, no step run twice, no dead letter: all hold"
            );
        } else {
            println!("VIOLATIONS:");
            if self.dead_letters > 0 {
                println!("  - {} messages were dead-lettered", self.dead_letters);
            }
            for v in l.violations.iter().chain(&c.failures).take(50) {
                println!("  - {v}");
            }
        }
    }

    /// Whether every invariant holds.
    pub fn ok(&self) -> bool {
        self.ledger.violations.is_empty()
            && self.client.failures.is_empty()
            && self.dead_letters == 0
    }
}

/// Reads a printed summary back: the sum of the numbers ending the lines that start with `label` (after
/// indentation). Several lines can match (`SIGKILLs of` has one per process kind); none gives 0.
pub fn figure(summary: &str, label: &str) -> i64 {
    summary
        .lines()
        .filter(|line| line.trim_start().starts_with(label))
        .filter_map(|line| line.split_whitespace().last()?.parse::<i64>().ok())
        .sum()
}

/// How long [`run_to_summary`] lets a program run: less than the test runner's own limit (nextest's
/// 300 s), so that a hang fails with the program's output so far instead of being killed silently.
pub const PROGRAM_DEADLINE: std::time::Duration = std::time::Duration::from_secs(270);

/// Runs a harness program (`saga-demo`, `chaos`) to its end and returns what it printed; panics with its
/// output when it failed, ran past [`PROGRAM_DEADLINE`] or did not report that every invariant holds. Its
/// lines are echoed as they come (the test runner shows them for a failed test), so that a hang shows
/// where the program was. For tests.
pub async fn run_to_summary(mut program: tokio::process::Command) -> String {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};

    let mut child = program
        .env("RUST_BACKTRACE", "0")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the program starts");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let stderr = tokio::spawn(async move {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text).await;
        text
    });
    let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
    let mut stdout = String::new();
    let finished = tokio::time::timeout(PROGRAM_DEADLINE, async {
        while let Ok(Some(line)) = lines.next_line().await {
            println!("| {line}");
            stdout.push_str(&line);
            stdout.push('\n');
        }
        child.wait().await
    })
    .await;
    let Ok(status) = finished else {
        let _ = child.kill().await;
        let stderr = stderr.await.unwrap_or_default();
        panic!("the program ran past {PROGRAM_DEADLINE:?}; its output so far:\n{stdout}\n{stderr}");
    };
    let status = status.expect("the program's exit status");
    let stderr = stderr.await.unwrap_or_default();
    assert!(
        status.success(),
        "the program failed ({status}):\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("all hold"),
        "the program did not report its invariants:\n{stdout}"
    );
    stdout
}

#[cfg(test)]
mod tests {
    use super::figure;

    #[test]
    fn figures_are_read_back_and_summed_over_matching_lines() {
        let summary =
            "orders accepted          12\n  SIGKILLs of consumers   3\n  SIGKILLs of relays  2\n";
        assert_eq!(figure(summary, "orders accepted"), 12);
        assert_eq!(figure(summary, "SIGKILLs of"), 5);
        assert_eq!(figure(summary, "broker restarts"), 0);
    }
}
