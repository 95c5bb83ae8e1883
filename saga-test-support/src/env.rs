//! Where the services are, and small helpers.

use std::future::Future;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The default PostgreSQL URL, as in the README.
pub(crate) const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
/// The default broker address, as in the README.
pub(crate) const DEFAULT_KAFKA_BROKERS: &str = "127.0.0.1:9092";
/// How to start the services, for failure messages.
pub(crate) const HOW_TO_START: &str = "start the local services with `scripts/dev-services`, or a Docker engine (the \
tests then start containers), or point DATABASE_URL / KAFKA_BROKERS at running ones";

/// The PostgreSQL URL this test process uses (see [`crate::services`]).
pub fn database_url() -> String {
    crate::services::resolved_or_env().database_url
}

/// The broker this test process uses (see [`crate::services`]).
pub fn kafka_brokers() -> String {
    crate::services::resolved_or_env().kafka_brokers
}

/// Seconds since the epoch.
pub(crate) fn epoch_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A name no other test run uses: `{prefix}-{epoch seconds}-{random}`, lowercase, usable as a topic, group or
/// schema name (after replacing `-` where needed).
pub fn unique_name(prefix: &str) -> String {
    let clean: String = prefix
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .take(40)
        .collect();
    let random = uuid::Uuid::new_v4().simple().to_string();
    format!("{clean}-{}-{}", epoch_secs(), &random[..8])
}

/// Polls `check` every 50 ms until it returns `Some`, or panics with `what` after `timeout`.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
