//! The WAL relay: publishes the outbox that services in WAL mode write to PostgreSQL's write-ahead log (see
//! `saga_runtime::store::wal`).
//!
//! It reads the schema's replication slot through the `pgoutput` plugin with logical messages on, keeps the
//! messages of its schema's prefix, and publishes their events in the order their transactions committed:
//! per-key order holds by construction. The slot's position is confirmed only after the broker acknowledged
//! every event before it, so a relay that dies republishes from the last confirmed commit (the consumers'
//! step keys absorb the duplicates) and never skips one.
//!
//! - **One relay per slot.** PostgreSQL lets one connection read a slot at a time. A second relay finds it
//!   active, stands by, and tries again every second: when the first dies, its connection ends and the
//!   second takes over where the slot was confirmed.
//! - **Refused events.** An event the broker refuses for good (too large, not a valid record), after
//!   `RELAY_PARK_AFTER_ATTEMPTS` attempts, and a message that does not decode, are parked in
//!   `saga_outbox_wal_parked` with the reason, so that the slot moves on.
//! - **Idle schemas.** When nothing of its own is pending, the relay confirms the positions the server says
//!   it has read up to, so that another schema's traffic does not keep the write-ahead log from being
//!   recycled.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use pgwire_replication::{
    Lsn, PgWireError, ReplicationClient, ReplicationConfig, ReplicationEvent, TlsConfig,
};
use saga_runtime::config::ConfigProblem;
use saga_runtime::store::wal::{self, WalOutbox};
use tokio_util::sync::CancellationToken;

use crate::publisher::Publisher;
use crate::relay::Relay;
use crate::store::OutboxRow;

/// How a session with the slot ended.
enum WalEnd {
    /// Another relay reads the slot: stand by.
    Standby(String),
    /// The database or the stream failed: reconnect.
    Failed(String),
    /// Shutdown.
    Shutdown,
}

/// Where a published event came from, for parking it.
struct Origin {
    tenant: String,
    commit_lsn: Lsn,
}

/// Microseconds between the Unix epoch and PostgreSQL's (2000-01-01).
const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;

fn pg_time(micros: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(micros.saturating_add(PG_EPOCH_MICROS)).unwrap_or_else(Utc::now)
}

/// The replication connection's settings from `url` (a `postgres://` URL), for `slot`.
pub(crate) fn replication_config(
    url: &str,
    slot: &str,
) -> Result<ReplicationConfig, ConfigProblem> {
    let bad = |why: String| {
        ConfigProblem::new(
            "SAGA_REPLICATION_URL",
            why,
            "set it (or DATABASE_URL) to postgres://USER:PASSWORD@HOST:PORT/DATABASE",
        )
    };
    let parsed = url::Url::parse(url).map_err(|e| bad(format!("does not parse ({e})")))?;
    if !matches!(parsed.scheme(), "postgres" | "postgresql") {
        return Err(bad(format!("is a {} URL", parsed.scheme())));
    }
    let query: HashMap<String, String> = parsed.query_pairs().into_owned().collect();
    let host = query
        .get("host")
        .cloned()
        .or_else(|| parsed.host_str().map(str::to_owned))
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned());
    let user = Some(percent_decode(parsed.username()))
        .filter(|u| !u.is_empty())
        .or_else(|| query.get("user").cloned())
        .unwrap_or_else(|| "postgres".to_owned());
    let password = parsed.password().map(percent_decode).unwrap_or_default();
    let database = Some(percent_decode(parsed.path().trim_start_matches('/')))
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| user.clone());
    let mut cfg = ReplicationConfig::new(host, user, password, database, slot, wal::PUBLICATION);
    cfg.port = parsed.port().unwrap_or(5432);
    cfg.tls = match query.get("sslmode").map(String::as_str) {
        Some("require") => TlsConfig::require(),
        Some("verify-ca") => TlsConfig::verify_ca(None),
        Some("verify-full") => TlsConfig::verify_full(None),
        _ => TlsConfig::disabled(),
    };
    // Confirmations reach the server within a second: the slot's lag, and the WAL it holds, stay small.
    cfg.status_interval = Duration::from_secs(1);
    cfg.idle_wakeup_interval = Duration::from_secs(1);
    cfg.application_name = Some("saga-outbox-relay".to_owned());
    Ok(cfg)
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(hex) = bytes.get(i + 1..i + 3)
            && let Ok(value) = u8::from_str_radix(std::str::from_utf8(hex).unwrap_or("zz"), 16)
        {
            out.push(value);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn classify(e: &PgWireError) -> WalEnd {
    let text = e.to_string();
    // 55006 object_in_use: "replication slot ... is active for PID ...".
    if text.contains("55006") || text.contains("is active for PID") {
        WalEnd::Standby(text)
    } else {
        WalEnd::Failed(text)
    }
}

impl Relay {
    /// The WAL relay's loop: sessions with the slot, standing by while another relay reads it, reconnecting
    /// after a failure, until `shutdown`.
    pub(crate) async fn run_wal(
        &self,
        publisher: &mut Publisher,
        url: &str,
        shutdown: &CancellationToken,
    ) {
        let mut wait = Duration::from_millis(200);
        let mut standing_by = false;
        while !shutdown.is_cancelled() {
            let end = self.wal_session(publisher, url, shutdown).await;
            self.metrics.wal_active.set(0);
            let pause = match end {
                WalEnd::Shutdown => break,
                WalEnd::Standby(holder) => {
                    if !standing_by {
                        tracing::info!(%holder, "another relay reads the outbox's slot; standing by");
                    }
                    standing_by = true;
                    // A relay standing by is healthy: it takes over when the other dies.
                    self.ops.set_ready(true);
                    wait = Duration::from_millis(200);
                    self.settings.standby_interval
                }
                WalEnd::Failed(e) => {
                    standing_by = false;
                    self.ops.set_ready(false);
                    tracing::warn!(error = %e, ?wait, "the WAL relay lost its slot; reconnecting");
                    let pause = wait;
                    wait = (wait * 2).min(Duration::from_secs(10));
                    pause
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// One session with the slot: see the module documentation.
    async fn wal_session(
        &self,
        publisher: &mut Publisher,
        url: &str,
        shutdown: &CancellationToken,
    ) -> WalEnd {
        let outbox = match wal::prepare(&self.pool).await {
            Ok(outbox) => outbox,
            Err(e) => return WalEnd::Failed(e.to_string()),
        };
        let cfg = match replication_config(url, &outbox.slot) {
            Ok(cfg) => cfg,
            Err(e) => return WalEnd::Failed(e.to_string()),
        };
        let mut client = match ReplicationClient::connect(cfg).await {
            Ok(client) => client,
            Err(e) => return classify(&e),
        };
        let end = self.stream(&mut client, &outbox, publisher, shutdown).await;
        client.stop();
        end
    }

    async fn stream(
        &self,
        client: &mut ReplicationClient,
        outbox: &WalOutbox,
        publisher: &mut Publisher,
        shutdown: &CancellationToken,
    ) -> WalEnd {
        let batch_size = usize::try_from(self.settings.batch_size).unwrap_or(usize::MAX);
        let mut batch: Vec<OutboxRow> = Vec::new();
        let mut origins: HashMap<i64, Origin> = HashMap::new();
        let mut next_id = 0_i64;
        let mut in_transaction = false;
        let mut commit_time = Utc::now();
        let mut commit_lsn = Lsn::from_u64(0);
        let mut last_commit_end: Option<Lsn> = None;
        let mut started = false;
        let mut next_lag = Instant::now();
        loop {
            // Publish what was read once nothing more is waiting (or the batch is full), at a commit.
            let received = if !batch.is_empty() && !in_transaction {
                match tokio::time::timeout(Duration::ZERO, client.recv()).await {
                    Ok(received) => received,
                    Err(_) => {
                        if let Err(end) = self
                            .publish_all(publisher, &mut batch, &mut origins, shutdown)
                            .await
                        {
                            return end;
                        }
                        if let Some(lsn) = last_commit_end {
                            client.update_applied_lsn(lsn);
                        }
                        continue;
                    }
                }
            } else {
                tokio::select! {
                    () = shutdown.cancelled() => return WalEnd::Shutdown,
                    received = client.recv() => received,
                }
            };
            let event = match received {
                Ok(Some(event)) => event,
                Ok(None) => return WalEnd::Failed("the replication stream ended".into()),
                Err(e) => return classify(&e),
            };
            if !started {
                started = true;
                self.metrics.wal_active.set(1);
                self.ops.set_ready(true);
                tracing::info!(slot = %outbox.slot, schema = %outbox.schema, "the WAL relay reads the outbox's slot");
            }
            match event {
                ReplicationEvent::Begin {
                    final_lsn,
                    commit_time_micros,
                    ..
                } => {
                    in_transaction = true;
                    commit_time = pg_time(commit_time_micros);
                    commit_lsn = final_lsn;
                }
                ReplicationEvent::Message {
                    transactional: true,
                    prefix,
                    content,
                    ..
                } if prefix == outbox.prefix => match wal::decode(&content) {
                    Ok(events) => {
                        for event in events {
                            origins.insert(
                                next_id,
                                Origin {
                                    tenant: event.tenant,
                                    commit_lsn,
                                },
                            );
                            batch.push(OutboxRow {
                                id: next_id,
                                topic: event.topic,
                                partition_key: event.partition_key,
                                headers: event.headers,
                                payload: Some(event.payload),
                                created_at: commit_time,
                            });
                            next_id += 1;
                        }
                    }
                    Err(e) => {
                        // Never held forever: set aside, visible, with the reason.
                        tracing::error!(error = %e, lsn = %commit_lsn, "an outbox message does not decode; parking it");
                        if let Err(e) = self.park_raw(commit_lsn, &content, &e.to_string()).await {
                            return WalEnd::Failed(e.to_string());
                        }
                    }
                },
                ReplicationEvent::Commit { end_lsn, .. } => {
                    in_transaction = false;
                    last_commit_end = Some(end_lsn);
                    if batch.is_empty() {
                        // Nothing of this schema is pending: the transaction is done with.
                        client.update_applied_lsn(end_lsn);
                    } else if batch.len() >= batch_size {
                        if let Err(end) = self
                            .publish_all(publisher, &mut batch, &mut origins, shutdown)
                            .await
                        {
                            return end;
                        }
                        client.update_applied_lsn(end_lsn);
                    }
                }
                // The server read the log up to here, and sent everything it decoded before: with nothing
                // pending, nothing before it is owed.
                ReplicationEvent::KeepAlive { wal_end, .. }
                    if batch.is_empty() && !in_transaction =>
                {
                    client.update_applied_lsn(wal_end);
                }
                ReplicationEvent::StoppedAt { .. } => {
                    return WalEnd::Failed("the replication stream stopped".into());
                }
                _ => {}
            }
            if Instant::now() >= next_lag {
                next_lag = Instant::now() + self.settings.backlog_interval;
                if let Ok(Some(lag)) = wal::slot_lag(&self.pool, &outbox.schema).await {
                    self.metrics.wal_lag_bytes.set(lag.lag_bytes);
                    self.metrics
                        .oldest_age_seconds
                        .set(lag.lag_seconds.unwrap_or(0.0).round() as i64);
                }
            }
        }
    }

    /// Publishes `batch` until every event is acknowledged or parked; clears it. A refused event is tried
    /// again with backoff, then parked after `park_after` attempts; its key's later events wait for it.
    async fn publish_all(
        &self,
        publisher: &mut Publisher,
        batch: &mut Vec<OutboxRow>,
        origins: &mut HashMap<i64, Origin>,
        shutdown: &CancellationToken,
    ) -> Result<(), WalEnd> {
        let mut attempts: HashMap<i64, u32> = HashMap::new();
        while !batch.is_empty() {
            let Some(outcome) = publisher.publish(batch, shutdown).await else {
                return Err(WalEnd::Shutdown);
            };
            let mut done: HashSet<i64> = outcome.acked.iter().map(|a| a.id).collect();
            self.metrics.observe_commit_to_ack(
                outcome
                    .acked
                    .iter()
                    .map(crate::publisher::Acked::latency_seconds),
            );
            self.metrics.published.inc_by(outcome.acked.len() as u64);
            let mut backoff = 0;
            for failed in &outcome.failed {
                self.metrics.failures.inc();
                let tried = attempts.entry(failed.id).or_default();
                *tried += 1;
                backoff = backoff.max(*tried);
                if failed.refused && *tried >= self.settings.park_after {
                    let row = batch.iter().find(|r| r.id == failed.id);
                    let origin = origins.get(&failed.id);
                    if let (Some(row), Some(origin)) = (row, origin) {
                        self.park(row, origin, &failed.error, *tried)
                            .await
                            .map_err(|e| WalEnd::Failed(e.to_string()))?;
                        self.metrics.parked.inc();
                        tracing::error!(topic = %row.topic, error = %failed.error, "an outbox event the broker refuses is parked");
                    }
                    done.insert(failed.id);
                } else {
                    tracing::warn!(error = %failed.error, attempts = *tried, "publishing an outbox event failed; retrying");
                }
            }
            batch.retain(|r| !done.contains(&r.id));
            for id in &done {
                origins.remove(id);
            }
            if !batch.is_empty() {
                let wait = Duration::from_millis(100) * 2u32.saturating_pow(backoff.min(7));
                tokio::select! {
                    () = shutdown.cancelled() => return Err(WalEnd::Shutdown),
                    () = tokio::time::sleep(wait) => {}
                }
            }
        }
        origins.clear();
        Ok(())
    }

    async fn park(
        &self,
        row: &OutboxRow,
        origin: &Origin,
        error: &str,
        attempts: u32,
    ) -> Result<(), sqlx::Error> {
        let headers: Vec<&str> = row
            .headers
            .iter()
            .flat_map(|(n, v)| [n.as_str(), v.as_str()])
            .collect();
        sqlx::query(
            "INSERT INTO saga_outbox_wal_parked (commit_lsn, tenant_id, topic, partition_key, headers, payload, \
                 error, attempts) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(origin.commit_lsn.to_pg_string())
        .bind(&origin.tenant)
        .bind(&row.topic)
        .bind(&row.partition_key)
        .bind(&headers)
        .bind(&row.payload)
        .bind(error)
        .bind(i32::try_from(attempts).unwrap_or(i32::MAX))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn park_raw(
        &self,
        commit_lsn: Lsn,
        content: &[u8],
        error: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO saga_outbox_wal_parked (commit_lsn, tenant_id, topic, payload, error, attempts) \
             VALUES ($1, '', '', $2, $3, 0)",
        )
        .bind(commit_lsn.to_pg_string())
        .bind(content)
        .bind(error)
        .execute(&self.pool)
        .await?;
        self.metrics.parked.inc();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_gives_the_replication_connection_its_settings() {
        let cfg = replication_config(
            "postgres://us%40er:p%3Ass@db.example:6543/sagas?sslmode=require&options=-c%20search_path%3Dx",
            "slot",
        )
        .unwrap();
        assert_eq!(
            (
                cfg.host.as_str(),
                cfg.port,
                cfg.user.as_str(),
                cfg.password.as_str(),
                cfg.database.as_str()
            ),
            ("db.example", 6543, "us@er", "p:ss", "sagas")
        );
        assert!(cfg.tls.mode.requires_tls());
        let local = replication_config("postgres://postgres@127.0.0.1/test", "slot").unwrap();
        assert_eq!((local.port, local.password.as_str()), (5432, ""));
        assert!(!local.tls.mode.requires_tls());
        assert!(replication_config("mysql://x@y/z", "slot").is_err());
        assert!(replication_config("not a url", "slot").is_err());
        assert_eq!(pg_time(0).timestamp(), 946_684_800);
    }
}
