//! The consumer with its database connections over TLS against plaintext, in one run, on the mock
//! cluster: the same messages, the same batches, two schemas of one server, rounds taken in turns so that
//! the machine's drift falls on both alike.

use serde::Serialize;
use sqlx::PgPool;

use crate::bench::Progress;
use crate::bench::consumer;
use saga_runtime::kafka::KafkaConfig;

/// Rounds of each. On a small machine one round's rate moves by a tenth or more from the next: five
/// rounds, each pair in turn starting with the other side, and the medians.
pub const ROUNDS: usize = 5;

/// What the section measured.
#[derive(Debug, Clone, Serialize)]
pub struct TlsFigures {
    /// The consumer over plaintext connections (`sslmode=disable`), messages/s, the median of the rounds.
    pub plain_msgs_per_s: f64,
    /// The consumer over TLS (`sslmode=require`; rustls, TLS 1.3), messages/s, the median of the rounds.
    pub tls_msgs_per_s: f64,
    /// TLS / plaintext.
    pub tls_vs_plain_ratio: f64,
    /// Each round's messages/s: plaintext, then TLS.
    pub rounds: Vec<(f64, f64)>,
}

/// `url` with its `sslmode` set to `mode` (any `sslmode` it had is replaced).
pub fn with_sslmode(url: &str, mode: &str) -> String {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut pairs: Vec<&str> = query
        .split('&')
        .filter(|p| !p.is_empty() && !p.starts_with("sslmode="))
        .collect();
    let sslmode = format!("sslmode={mode}");
    pairs.push(&sslmode);
    format!("{base}?{}", pairs.join("&"))
}

/// `url`, with `sslmode` set to `mode` unless it names one already.
pub fn with_default_sslmode(url: &str, mode: &str) -> String {
    let named = url
        .split_once('?')
        .is_some_and(|(_, query)| query.split('&').any(|p| p.starts_with("sslmode=")));
    if named {
        url.to_owned()
    } else {
        with_sslmode(url, mode)
    }
}

/// Whether `pool`'s connections are over TLS, as the server sees them.
pub async fn over_tls(pool: &PgPool) -> anyhow::Result<bool> {
    Ok(
        sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(pool)
            .await?,
    )
}

/// Runs the framework's consumer over `topic` (`messages` on it) [`ROUNDS`] times on each of `plain` and
/// `tls`, in turns, with `batch_size` and `concurrency`.
#[allow(clippy::too_many_arguments)]
pub async fn figures(
    kafka: &KafkaConfig,
    plain: &PgPool,
    tls: &PgPool,
    topic: &str,
    messages: i64,
    batch_size: usize,
    concurrency: usize,
    progress: &Progress,
) -> anyhow::Result<TlsFigures> {
    anyhow::ensure!(!over_tls(plain).await?, "the plaintext pool is over TLS");
    anyhow::ensure!(over_tls(tls).await?, "the TLS pool is not over TLS");
    let mut rounds = Vec::with_capacity(ROUNDS);
    for round in 0..ROUNDS {
        let mut rates = [0.0; 2];
        // Each side goes first in every other round, so that a drift within a round falls on both.
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            let pool = [plain, tls][side];
            // A group, and step keys, of the round's and the side's own.
            let run = consumer::framework(
                kafka,
                pool,
                topic,
                round * 2 + side,
                messages,
                batch_size,
                concurrency,
                progress,
            )
            .await?;
            rates[side] = run.msgs_per_s;
        }
        progress.note(&format!(
            "consumer over TLS, round {}: plaintext {:.0} msg/s, TLS {:.0} msg/s",
            round + 1,
            rates[0],
            rates[1]
        ));
        rounds.push((rates[0], rates[1]));
    }
    let median = |side: fn(&(f64, f64)) -> f64| {
        let mut values: Vec<f64> = rounds.iter().map(side).collect();
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let (plain_msgs_per_s, tls_msgs_per_s) = (median(|r| r.0), median(|r| r.1));
    Ok(TlsFigures {
        plain_msgs_per_s,
        tls_msgs_per_s,
        tls_vs_plain_ratio: tls_msgs_per_s / plain_msgs_per_s,
        rounds,
    })
}

#[cfg(test)]
mod tests {
    use super::with_sslmode;

    #[test]
    fn a_default_sslmode_leaves_one_the_url_names() {
        assert_eq!(
            super::with_default_sslmode("postgres://u@h/db", "disable"),
            "postgres://u@h/db?sslmode=disable"
        );
        assert_eq!(
            super::with_default_sslmode("postgres://u@h/db?sslmode=require", "disable"),
            "postgres://u@h/db?sslmode=require"
        );
    }

    #[test]
    fn sslmode_is_set_once() {
        assert_eq!(
            with_sslmode("postgres://u@h/db", "require"),
            "postgres://u@h/db?sslmode=require"
        );
        assert_eq!(
            with_sslmode("postgres://u@h/db?sslmode=disable&options=x", "require"),
            "postgres://u@h/db?options=x&sslmode=require"
        );
    }
}
