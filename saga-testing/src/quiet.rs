//! Whether the system under test is quiet: every message consumed and its offset committed, every outbox
//! row published, no saga timer due, every service running; and, when it is not, what is still busy.

use std::collections::BTreeMap;

use sqlx::PgPool;

use crate::KitError;
use crate::cluster::Position;

/// What kept the system from being quiet when a wait ran out: each culprit names the service and what it
/// had still to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
#[error("still busy after {waited_ms} ms: {}", list(.culprits))]
pub struct Busy {
    /// How long the wait lasted, in milliseconds.
    pub waited_ms: u128,
    /// What was busy at the last look.
    pub culprits: Vec<Culprit>,
}

impl Busy {
    /// Whether any culprit concerns service `service`.
    pub fn concerns(&self, service: &str) -> bool {
        self.culprits.iter().any(|c| c.service() == Some(service))
    }
}

fn list(culprits: &[Culprit]) -> String {
    culprits
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// One thing still in flight.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Culprit {
    /// A service has messages it has not consumed, or whose offsets it has not committed.
    #[error(
        "the {service} service has {behind} message(s) of {topic}/{partition} not done (its group \
         committed {committed}, the partition ends at {end})"
    )]
    Unconsumed {
        /// The service.
        service: String,
        /// The topic.
        topic: String,
        /// The partition.
        partition: i32,
        /// The group's committed offset.
        committed: i64,
        /// The partition's end.
        end: i64,
        /// How many messages that is.
        behind: i64,
    },
    /// A service's outbox has rows the relay has not published.
    #[error(
        "the {service} service's outbox has {rows} event(s) unpublished (the first for {topic}, key \
         {key:?})"
    )]
    Unpublished {
        /// The service.
        service: String,
        /// How many rows.
        rows: i64,
        /// The first row's topic.
        topic: String,
        /// The first row's key.
        key: Option<String>,
    },
    /// A service's outbox has rows the broker refused for good (parked): they will not be published.
    #[error("the {service} service's outbox parked {rows} event(s) the broker refused: {error}")]
    Parked {
        /// The service.
        service: String,
        /// How many rows.
        rows: i64,
        /// The first one's error.
        error: String,
    },
    /// A saga's timer is due and has not fired (is the orchestrator on the test's clock, set up with
    /// [`crate::ServiceSetup::orchestrator`]?).
    #[error(
        "the {service} service's saga {saga_id} ({saga_type}) has a timer due at step {step} (is its \
         orchestrator set up with ServiceSetup::orchestrator, on the test's clock?)"
    )]
    TimerDue {
        /// The service.
        service: String,
        /// The saga.
        saga_id: uuid::Uuid,
        /// Its type.
        saga_type: String,
        /// The step it waits in.
        step: i32,
    },
    /// A saga's timer failed to fire, and is put off to try again.
    #[error(
        "the {service} service's saga {saga_id} ({saga_type}) failed to fire its timer {failures} \
         time(s): {error}"
    )]
    TimerFailing {
        /// The service.
        service: String,
        /// The saga.
        saga_id: uuid::Uuid,
        /// Its type.
        saga_type: String,
        /// How many times it failed.
        failures: i32,
        /// The last error.
        error: String,
    },
    /// A service is releasing held keys: their parked messages go back through its retry topic one at a
    /// time.
    #[error("the {service} service is releasing {keys} held key(s)")]
    Releasing {
        /// The service.
        service: String,
        /// How many keys.
        keys: i64,
    },
    /// A service stopped while the test ran.
    #[error("the {service} service is not running: {reason}")]
    Stopped {
        /// The service.
        service: String,
        /// How it ended.
        reason: String,
    },
    /// The kit's duplicator has messages it has not copied yet.
    #[error("the duplicator has {behind} message(s) of {topic}/{partition} not copied yet")]
    Duplicating {
        /// The topic.
        topic: String,
        /// The partition.
        partition: i32,
        /// How many.
        behind: i64,
    },
}

impl Culprit {
    /// The service it concerns (`None`: the kit's duplicator).
    pub fn service(&self) -> Option<&str> {
        match self {
            Self::Unconsumed { service, .. }
            | Self::Unpublished { service, .. }
            | Self::Parked { service, .. }
            | Self::TimerDue { service, .. }
            | Self::TimerFailing { service, .. }
            | Self::Releasing { service, .. }
            | Self::Stopped { service, .. } => Some(service),
            Self::Duplicating { .. } => None,
        }
    }
}

/// The partitions of `positions` a group has not finished, as culprits of `service` (`None`: the kit's
/// duplicator).
pub(crate) fn unconsumed(
    service: Option<&str>,
    positions: &BTreeMap<(String, i32), Position>,
) -> Vec<Culprit> {
    positions
        .iter()
        .filter(|(_, p)| p.committed < p.end)
        .map(|((topic, partition), p)| match service {
            None => Culprit::Duplicating {
                topic: topic.clone(),
                partition: *partition,
                behind: p.end - p.committed,
            },
            Some(service) => Culprit::Unconsumed {
                service: service.to_owned(),
                topic: topic.clone(),
                partition: *partition,
                committed: p.committed,
                end: p.end,
                behind: p.end - p.committed,
            },
        })
        .collect()
}

/// The outbox rows of `service` (on `pool`'s schema) not yet published, and those parked.
pub(crate) async fn outbox(service: &str, pool: &PgPool) -> Result<Vec<Culprit>, KitError> {
    let mut culprits = Vec::new();
    // A service that failed before its migrations ran has no outbox: it is reported as stopped.
    if !has_table(pool, "saga_outbox").await? {
        return Ok(culprits);
    }
    let (rows, topic, key): (i64, Option<String>, Option<String>) = sqlx::query_as(
        "SELECT count(*), \
                (array_agg(topic ORDER BY id))[1], \
                (array_agg(partition_key ORDER BY id))[1] \
         FROM saga_outbox WHERE published_at IS NULL AND parked_at IS NULL",
    )
    .fetch_one(pool)
    .await?;
    if rows > 0 {
        culprits.push(Culprit::Unpublished {
            service: service.to_owned(),
            rows,
            topic: topic.unwrap_or_default(),
            key,
        });
    }
    let (parked, error): (i64, Option<String>) = sqlx::query_as(
        "SELECT count(*), (array_agg(last_error ORDER BY id))[1] \
         FROM saga_outbox WHERE published_at IS NULL AND parked_at IS NOT NULL",
    )
    .fetch_one(pool)
    .await?;
    if parked > 0 {
        culprits.push(Culprit::Parked {
            service: service.to_owned(),
            rows: parked,
            error: error.unwrap_or_default(),
        });
    }
    Ok(culprits)
}

/// The sagas of `service` whose timer is due on a clock moved by `advanced_ms`.
pub(crate) async fn timers(
    service: &str,
    pool: &PgPool,
    advanced_ms: i64,
) -> Result<Vec<Culprit>, KitError> {
    if !has_table(pool, "saga_instances").await? {
        return Ok(Vec::new());
    }
    // Due on the orchestrator's own terms (its `lock_due`: the deadline against `now()` moved by the
    // clock), or failing to fire and put off.
    let due: Vec<(uuid::Uuid, String, i32, i32, Option<String>)> = sqlx::query_as(
        "SELECT saga_id, saga_type, step_index, timer_failures, last_error FROM saga_instances \
         WHERE deadline <= now() + $1 * interval '1 millisecond' \
            OR (deadline IS NOT NULL AND timer_failures > 0) \
         ORDER BY deadline LIMIT 5",
    )
    .bind(advanced_ms)
    .fetch_all(pool)
    .await?;
    Ok(due
        .into_iter()
        .map(|(saga_id, saga_type, step, failures, error)| {
            let service = service.to_owned();
            if failures > 0 {
                Culprit::TimerFailing {
                    service,
                    saga_id,
                    saga_type,
                    failures,
                    error: error.unwrap_or_default(),
                }
            } else {
                Culprit::TimerDue {
                    service,
                    saga_id,
                    saga_type,
                    step,
                }
            }
        })
        .collect())
}

/// The held keys group `group` of `service` is releasing (but for those waiting on a paused step): the
/// releaser sends their parked messages to the retry topic outside any transaction, so nothing else shows
/// that work.
pub(crate) async fn releasing(
    service: &str,
    group: &str,
    pool: &PgPool,
) -> Result<Vec<Culprit>, KitError> {
    if !has_table(pool, "saga_held_keys").await? {
        return Ok(Vec::new());
    }
    let keys = saga_consumer::admin::releasing_keys(pool, group).await?;
    Ok(if keys > 0 {
        vec![Culprit::Releasing {
            service: service.to_owned(),
            keys,
        }]
    } else {
        Vec::new()
    })
}

/// Whether the service's schema (`pool`'s `search_path`) has table `table`: the orchestrator's are there
/// only for a service that orchestrates, and none before the migrations ran.
async fn has_table(pool: &PgPool, table: &str) -> Result<bool, KitError> {
    Ok(sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(table)
        .fetch_one(pool)
        .await?)
}
