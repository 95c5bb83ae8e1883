//! The relay loop: own shards, read their unpublished rows in id order, publish, mark, repeat; wake on
//! NOTIFY, poll as a fallback; reconnect after losing the database.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use saga_runtime::kafka::KafkaConfig;
use saga_runtime::ops::Ops;
use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::metrics::RelayMetrics;
use crate::publisher::{OrderKey, Publisher, order_key};
use crate::shards::ShardOwner;
use crate::store::{self, AfterPublish};

/// How the relay runs.
#[derive(Debug, Clone)]
pub struct RelaySettings {
    /// The broker.
    pub kafka: KafkaConfig,
    /// Rows per batch (default 2,000).
    pub batch_size: i64,
    /// Fallback poll when no notification comes (default 1 s).
    pub poll_interval: Duration,
    /// The producer's `linger.ms` (default 1 ms).
    pub linger: Duration,
    /// What to do with published rows (default: mark them).
    pub after_publish: AfterPublish,
    /// How often shard ownership is rebalanced between instances (default 2 s).
    pub rebalance_interval: Duration,
    /// How often the backlog gauge is sampled (default 10 s).
    pub backlog_interval: Duration,
    /// Failed attempts after which a row the broker refuses for good (too large, not a valid record) is
    /// parked instead of retried (default 3; `RELAY_PARK_AFTER_ATTEMPTS`).
    pub park_after: u32,
}

impl Default for RelaySettings {
    fn default() -> Self {
        Self {
            kafka: KafkaConfig::new("127.0.0.1:9092"),
            batch_size: 2_000,
            poll_interval: Duration::from_secs(1),
            linger: Duration::from_millis(1),
            after_publish: AfterPublish::Mark,
            rebalance_interval: Duration::from_secs(2),
            backlog_interval: Duration::from_secs(10),
            park_after: 3,
        }
    }
}

/// Why the relay stopped.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The Kafka producer could not be created.
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
}

/// An outbox relay for the outbox in the pool's schema.
pub struct Relay {
    settings: RelaySettings,
    pool: PgPool,
    metrics: RelayMetrics,
    ops: Ops,
}

/// Retry bookkeeping for rows whose publication failed: until its retry is due, a failing row holds its key
/// back, so that none of the key's later rows is published before it.
#[derive(Default)]
struct Retries {
    failures: HashMap<i64, (u32, Instant, OrderKey)>,
}

impl Retries {
    /// Keys with a failing row whose retry is not due yet: left out of the next fetch.
    fn held(&self) -> Vec<OrderKey> {
        if self.failures.is_empty() {
            return Vec::new();
        }
        let now = Instant::now();
        let held: HashSet<&OrderKey> = self
            .failures
            .values()
            .filter(|(_, due, _)| *due > now)
            .map(|(_, _, key)| key)
            .collect();
        held.into_iter().cloned().collect()
    }

    fn failed(&mut self, id: i64, key: OrderKey) {
        let entry = self.failures.entry(id).or_insert((0, Instant::now(), key));
        entry.0 += 1;
        let wait = Duration::from_millis(100) * 2u32.saturating_pow(entry.0.min(9));
        entry.1 = Instant::now() + wait.min(Duration::from_secs(60));
    }

    fn done(&mut self, id: i64) {
        self.failures.remove(&id);
    }
}

impl Relay {
    /// A relay reading the outbox through `pool` (whose `search_path` selects the schema).
    pub fn new(settings: RelaySettings, pool: PgPool) -> Self {
        Self {
            settings,
            pool,
            metrics: RelayMetrics::default(),
            ops: Ops::new(),
        }
    }

    /// Uses `ops` for metrics and readiness.
    pub fn with_ops(mut self, ops: Ops) -> Self {
        self.ops = ops;
        self
    }

    /// The relay's metrics.
    pub fn metrics(&self) -> &RelayMetrics {
        &self.metrics
    }

    /// Runs until `shutdown` fires. Database and broker outages are waited out, never fatal.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), RelayError> {
        self.ops.register(|r| self.metrics.register(r));
        let mut publisher = Publisher::new(self.settings.kafka.clone(), self.settings.linger)?;
        let mut owner = ShardOwner::new();
        let mut retries = Retries::default();
        let mut reconnect_wait = Duration::from_millis(200);
        while !shutdown.is_cancelled() {
            match self
                .session(&mut publisher, &mut owner, &mut retries, &shutdown)
                .await
            {
                Ok(()) => break,
                Err(e) => {
                    owner.forget();
                    self.ops.set_ready(false);
                    self.metrics.owned_shards.set(0);
                    tracing::warn!(error = %e, wait = ?reconnect_wait, "relay lost the database; reconnecting");
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(reconnect_wait) => {}
                    }
                    reconnect_wait = (reconnect_wait * 2).min(Duration::from_secs(10));
                }
            }
        }
        publisher.flush(Duration::from_secs(5));
        tracing::info!("relay stopped");
        Ok(())
    }

    /// One database session: returns `Ok` on shutdown, `Err` when the database failed.
    async fn session(
        &self,
        publisher: &mut Publisher,
        owner: &mut ShardOwner,
        retries: &mut Retries,
        shutdown: &CancellationToken,
    ) -> Result<(), sqlx::Error> {
        // The work connection holds the shard locks: it is this instance's identity, kept out of the pool.
        let mut conn: PgConnection = self.pool.acquire().await?.detach();
        let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
            .fetch_one(&mut conn)
            .await?;
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen("saga_outbox").await?;
        owner.join(&mut conn).await?;
        self.ops.set_ready(true);
        tracing::info!(%schema, "relay connected");

        let mut next_rebalance = Instant::now();
        let mut next_backlog = Instant::now();
        loop {
            if shutdown.is_cancelled() {
                owner.leave(&mut conn).await.ok();
                return Ok(());
            }
            if Instant::now() >= next_rebalance {
                let change = owner.rebalance(&mut conn).await?;
                if !change.acquired.is_empty() || !change.released.is_empty() {
                    tracing::info!(
                        members = change.members,
                        acquired = ?change.acquired,
                        released = ?change.released,
                        owned = owner.owned().len(),
                        "shards rebalanced"
                    );
                }
                self.metrics
                    .owned_shards
                    .set(i64::try_from(owner.owned().len()).unwrap_or(0));
                next_rebalance = Instant::now() + self.settings.rebalance_interval;
            }
            if Instant::now() >= next_backlog {
                self.sample_backlog().await;
                next_backlog = Instant::now() + self.settings.backlog_interval;
            }
            let shards = owner.owned();
            let fetch_started = Instant::now();
            let held = retries.held();
            let rows = if shards.is_empty() {
                Vec::new()
            } else {
                store::fetch_unpublished(&mut conn, &shards, &held, self.settings.batch_size)
                    .await?
            };
            let fetched_in = fetch_started.elapsed();
            if rows.is_empty() {
                let wait = self
                    .settings
                    .poll_interval
                    .min(next_rebalance.saturating_duration_since(Instant::now()))
                    .max(Duration::from_millis(10));
                if held.is_empty() {
                    wait_for_wakeup(&mut listener, &schema, wait, shutdown).await?;
                } else {
                    // Rows wait for a retry: come back when one may be due; notifications are irrelevant.
                    tokio::select! {
                        _ = shutdown.cancelled() => {}
                        _ = tokio::time::sleep(wait.min(Duration::from_millis(100))) => {}
                    }
                }
                continue;
            }
            let publish_started = Instant::now();
            let Some(outcome) = publisher.publish(&rows, shutdown).await else {
                continue; // shutdown: nothing marked, the rows are published again later
            };
            let published_in = publish_started.elapsed();
            let acked: Vec<(i64, chrono::DateTime<chrono::Utc>)> =
                outcome.acked.iter().map(|(id, _, at)| (*id, *at)).collect();
            let mark_started = Instant::now();
            store::mark_published(&mut conn, &acked, self.settings.after_publish).await?;
            tracing::debug!(
                rows = rows.len(),
                acked = acked.len(),
                held_back = outcome.held_back,
                ?fetched_in,
                ?published_in,
                marked_in = ?mark_started.elapsed(),
                "batch"
            );
            for (id, created, acked_at) in &outcome.acked {
                retries.done(*id);
                let latency = (*acked_at - *created).to_std().unwrap_or_default();
                self.metrics
                    .commit_to_ack_seconds
                    .observe(latency.as_secs_f64());
            }
            self.metrics.published.inc_by(acked.len() as u64);
            for failed in &outcome.failed {
                let parked = store::record_failure(
                    &mut conn,
                    failed.id,
                    &failed.error,
                    failed.refused,
                    self.settings.park_after,
                )
                .await?;
                if parked {
                    tracing::error!(
                        id = failed.id,
                        error = %failed.error,
                        "the broker refuses this outbox row for good; parked (its key's later rows go on)"
                    );
                    retries.done(failed.id);
                    self.metrics.parked.inc();
                } else {
                    tracing::warn!(id = failed.id, error = %failed.error, "publication failed; will retry");
                    if let Some(row) = rows.iter().find(|r| r.id == failed.id) {
                        retries.failed(failed.id, order_key(row));
                    }
                }
            }
            self.metrics.failures.inc_by(outcome.failed.len() as u64);
        }
    }

    async fn sample_backlog(&self) {
        match store::backlog(&self.pool).await {
            Ok(backlog) => {
                self.metrics.backlog.set(backlog.unpublished);
                self.metrics.parked_rows.set(backlog.parked);
                self.metrics.oldest_age_seconds.set(
                    backlog
                        .oldest_age
                        .map_or(0, |a| i64::try_from(a.as_secs()).unwrap_or(i64::MAX)),
                );
            }
            Err(e) => tracing::debug!(error = %e, "cannot sample the backlog"),
        }
    }
}

/// Waits for a notification for `schema`, for `wait`, or for shutdown. Drains notifications already
/// buffered, so that a burst of commits causes one wake-up.
async fn wait_for_wakeup(
    listener: &mut PgListener,
    schema: &str,
    wait: Duration,
    shutdown: &CancellationToken,
) -> Result<(), sqlx::Error> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let notification = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep_until(deadline) => return Ok(()),
            n = listener.recv() => n?,
        };
        if notification.payload() == schema {
            while listener.next_buffered().is_some() {}
            return Ok(());
        }
    }
}
