//! Held keys and paused steps: what the consumer's per-key order through failures holds back
//! (`saga_held_keys`, `saga_parked_messages`, `saga_paused_steps`), and the operator's pause and resume.
//!
//! A key is held when a message of it was dead-lettered under the hold-key policy (the letter is its head),
//! or when a message of a paused step arrived; its later messages are parked in order and released, one at a
//! time, when the head is replayed and succeeds, discarded, or its step resumed.

use chrono::{DateTime, Utc};
use saga_consumer::admin::HoldCause;
use saga_consumer::admin::HoldState;
use saga_consumer::admin::Released;
use saga_consumer::admin::release_held;
use saga_runtime::cli::hex;
use saga_runtime::cli::printable;
use saga_runtime::cli::printable_bytes;
use serde::Serialize;
use sqlx::{PgConnection, PgPool, Row};

use crate::error::AdminError;

/// A held key.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct HeldKey {
    /// The consumer group that holds it.
    pub group: String,
    /// The Kafka key, as text that tells every two keys apart: UTF-8 as it is, a backslash `\\`, control
    /// characters `\u{..}`, bytes that are not UTF-8 `\x..`.
    pub key: String,
    /// The key's exact bytes, in hexadecimal: what `saga keys release --key-hex` and the page act on.
    pub key_hex: String,
    /// `held` (nothing of it runs) or `releasing` (its parked messages run one at a time, in order);
    /// `unknown: …` for a state this version does not know (a newer consumer wrote it).
    pub state: String,
    /// `dead-letter` (its head letter failed), `paused` (its step is paused) or `retrying` (a message of it
    /// waits for its delayed retry); `unknown: …` likewise.
    pub cause: String,
    /// The paused step, for `paused`.
    pub paused_step: Option<String>,
    /// The head letter's position (dead-letter topic, partition, offset), for `dead-letter`.
    pub head: Option<(String, i32, i64)>,
    /// The head letter's reason.
    pub head_reason: Option<String>,
    /// Messages parked behind it.
    pub parked: i64,
    /// When it was held.
    pub held_at: DateTime<Utc>,
    /// Seconds since.
    pub age_seconds: i64,
    /// Who released it, once releasing.
    pub released_by: Option<String>,
    /// The attempts its first parked message made (a delayed retry's), if any.
    pub retry_attempts: Option<i32>,
    /// When its first parked message runs again (a delayed retry's due time), if it waits for one.
    pub next_attempt_at: Option<DateTime<Utc>>,
}

impl HeldKey {
    /// What holds it, in words: its head letter's reason, or its paused step; and, when its first parked
    /// message waits for its delayed retry, "retrying (2 attempts), next at …" (first, or after them).
    pub fn held_by(&self) -> String {
        let cause = match (&self.head_reason, &self.paused_step) {
            (Some(reason), _) => format!("dead letter ({reason})"),
            (None, Some(step)) => format!("paused step {step}"),
            (None, None) => self.cause.clone(),
        };
        let Some(attempts) = self.retry_attempts else {
            return cause;
        };
        let made = if attempts == 1 {
            "1 attempt".to_owned()
        } else {
            format!("{attempts} attempts")
        };
        let retrying = match self.next_attempt_at {
            Some(at) if at > Utc::now() => format!(
                "retrying ({made}), next at {}",
                at.format("%Y-%m-%d %H:%M:%S UTC")
            ),
            _ => format!("retrying ({made}), due now"),
        };
        if self.cause == HoldCause::Retrying.as_str() {
            retrying
        } else {
            format!("{cause}; {retrying}")
        }
    }
}

/// A group's held keys at a glance.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct HeldSummary {
    /// The consumer group.
    pub group: String,
    /// Keys held.
    pub keys: i64,
    /// Messages parked behind them.
    pub parked: i64,
    /// Seconds since the oldest hold began.
    pub oldest_seconds: i64,
}

/// A paused step.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct PausedStep {
    /// The consumer group.
    pub group: String,
    /// The step.
    pub step: String,
    /// Who paused it.
    pub paused_by: String,
    /// Why.
    pub reason: String,
    /// When.
    pub paused_at: DateTime<Utc>,
    /// Keys its messages hold, and the messages parked behind them.
    pub held_keys: i64,
    /// Messages parked behind those keys.
    pub parked: i64,
}

/// Whether the schema has the consumer's hold tables (its consumer ran with this version).
async fn has_tables(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT to_regclass('saga_held_keys') IS NOT NULL")
        .fetch_one(conn)
        .await
}

/// The held keys of `group` (all groups if `None`), oldest first, at most `limit`.
pub async fn list(
    pool: &PgPool,
    group: Option<&str>,
    limit: i64,
) -> Result<Vec<HeldKey>, AdminError> {
    let mut conn = pool.acquire().await?;
    if !has_tables(&mut conn).await? {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {HELD_COLUMNS} FROM saga_held_keys WHERE $1::text IS NULL OR group_id = $1 \
         ORDER BY held_at, group_id, key LIMIT $2"
    )))
    .bind(group)
    .bind(limit)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(held_key)
        .collect::<Result<_, sqlx::Error>>()
        .map_err(Into::into)
}

/// Held key `key` of `group`, if it is held.
pub async fn one(pool: &PgPool, group: &str, key: &[u8]) -> Result<Option<HeldKey>, AdminError> {
    let mut conn = pool.acquire().await?;
    if !has_tables(&mut conn).await? {
        return Ok(None);
    }
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {HELD_COLUMNS} FROM saga_held_keys WHERE group_id = $1 AND key = $2"
    )))
    .bind(group)
    .bind(key)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(row.as_ref().map(held_key).transpose()?)
}

/// The columns [`held_key`] reads.
const HELD_COLUMNS: &str = "group_id, key, state, cause, paused_step, head_topic, head_partition, head_offset, \
     head_reason, parked, held_at, extract(epoch FROM now() - held_at)::bigint AS age, released_by, \
     (SELECT (to_jsonb(p) ->> 'attempts')::int FROM saga_parked_messages p \
         WHERE p.group_id = saga_held_keys.group_id AND p.key = saga_held_keys.key ORDER BY p.seq LIMIT 1) \
         AS retry_attempts, \
     (SELECT (to_jsonb(p) ->> 'due_at')::timestamptz FROM saga_parked_messages p \
         WHERE p.group_id = saga_held_keys.group_id AND p.key = saga_held_keys.key ORDER BY p.seq LIMIT 1) \
         AS next_attempt_at";
// (`to_jsonb(p) ->> …`: a schema whose consumers have not applied the delayed retries' migration yet has
// no such columns, and reads as none.)

/// A held key from a row of [`HELD_COLUMNS`].
fn held_key(r: &sqlx::postgres::PgRow) -> Result<HeldKey, sqlx::Error> {
    let key: Vec<u8> = r.try_get("key")?;
    let head = match (
        r.try_get::<Option<String>, _>("head_topic")?,
        r.try_get::<Option<i32>, _>("head_partition")?,
        r.try_get::<Option<i64>, _>("head_offset")?,
    ) {
        (Some(t), Some(p), Some(o)) => Some((t, p, o)),
        _ => None,
    };
    let state: String = r.try_get("state")?;
    let cause: String = r.try_get("cause")?;
    let unknown = |text: &str| format!("unknown: {}", printable(text, false));
    Ok(HeldKey {
        group: r.try_get("group_id")?,
        key: printable_bytes(&key).into_owned(),
        key_hex: hex(&key),
        state: HoldState::parse(&state).map_or_else(|_| unknown(&state), |s| s.as_str().to_owned()),
        cause: HoldCause::parse(&cause).map_or_else(|_| unknown(&cause), |c| c.as_str().to_owned()),
        paused_step: r.try_get("paused_step")?,
        head,
        head_reason: r.try_get("head_reason")?,
        parked: r.try_get("parked")?,
        held_at: r.try_get("held_at")?,
        age_seconds: r.try_get("age")?,
        released_by: r.try_get("released_by")?,
        retry_attempts: r
            .try_get::<Option<i32>, _>("retry_attempts")?
            .filter(|a| *a > 0),
        next_attempt_at: r.try_get("next_attempt_at")?,
    })
}

/// Each group's held keys at a glance (groups holding none are left out).
pub async fn summaries(pool: &PgPool) -> Result<Vec<HeldSummary>, AdminError> {
    let mut conn = pool.acquire().await?;
    if !has_tables(&mut conn).await? {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(
        "SELECT group_id, count(*)::bigint AS keys, coalesce(sum(parked), 0)::bigint AS parked, \
             extract(epoch FROM now() - min(held_at))::bigint AS oldest \
         FROM saga_held_keys GROUP BY group_id ORDER BY group_id",
    )
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(HeldSummary {
                group: r.try_get("group_id")?,
                keys: r.try_get("keys")?,
                parked: r.try_get("parked")?,
                oldest_seconds: r.try_get("oldest")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(Into::into)
}

/// How many keys the dead letters of identities `letters` hold at their head, and how many messages are
/// parked behind them: what a replay or discard of those letters releases.
pub async fn behind_letters(pool: &PgPool, letters: &[String]) -> Result<(i64, i64), AdminError> {
    let mut conn = pool.acquire().await?;
    if letters.is_empty() || !has_tables(&mut conn).await? {
        return Ok((0, 0));
    }
    let row = sqlx::query(
        "SELECT count(*)::bigint AS keys, coalesce(sum(parked), 0)::bigint AS parked FROM saga_held_keys \
         WHERE head_letter = ANY($1) AND state = $2",
    )
    .bind(letters)
    .bind(HoldState::Held.as_str())
    .fetch_one(&mut *conn)
    .await?;
    Ok((row.try_get("keys")?, row.try_get("parked")?))
}

/// Releases the key whose head is the dead letter of identity `letter` (it was discarded), in `tx`:
/// its parked messages run in order. Whether a key was released.
pub(crate) async fn release_discarded(
    tx: &mut PgConnection,
    group: &str,
    letter: &str,
    by: &str,
) -> Result<bool, sqlx::Error> {
    if !has_tables(tx).await? {
        return Ok(false);
    }
    let released = release_held(
        tx,
        group,
        Released::BehindLetter(letter),
        &format!("discard by {by}"),
    )
    .await?;
    Ok(released > 0)
}

/// The paused steps (of `group`, if given).
pub async fn paused(pool: &PgPool, group: Option<&str>) -> Result<Vec<PausedStep>, AdminError> {
    let mut conn = pool.acquire().await?;
    if !has_tables(&mut conn).await? {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(
        "SELECT s.group_id, s.step, s.paused_by, s.reason, s.paused_at, \
             (SELECT count(*) FROM saga_held_keys h WHERE h.group_id = s.group_id AND h.cause = $2 \
                 AND h.paused_step = s.step)::bigint AS keys, \
             (SELECT coalesce(sum(parked), 0) FROM saga_held_keys h WHERE h.group_id = s.group_id \
                 AND h.cause = $2 AND h.paused_step = s.step)::bigint AS parked \
         FROM saga_paused_steps s WHERE $1::text IS NULL OR s.group_id = $1 ORDER BY s.group_id, s.step",
    )
    .bind(group)
    .bind(HoldCause::Paused.as_str())
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(PausedStep {
                group: r.try_get("group_id")?,
                step: r.try_get("step")?,
                paused_by: r.try_get("paused_by")?,
                reason: r.try_get("reason")?,
                paused_at: r.try_get("paused_at")?,
                held_keys: r.try_get("keys")?,
                parked: r.try_get("parked")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(Into::into)
}

/// Checks that `group` runs in this schema and `step` is a step name; bad input otherwise.
async fn check_step(conn: &mut PgConnection, group: &str, step: &str) -> Result<(), AdminError> {
    saga_core::StepName::new(step)
        .map_err(|e| AdminError::bad_input(format!("step {:?}: {e}", printable(step, false))))?;
    if !has_tables(conn).await? {
        return Err(AdminError::bad_input(
            "this schema has no held keys (saga_held_keys): its consumer has not run with this version",
        ));
    }
    let known: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM saga_consumer_groups WHERE group_id = $1)",
    )
    .bind(group)
    .fetch_one(&mut *conn)
    .await?;
    if !known {
        return Err(AdminError::bad_input(format!(
            "no consumer group {:?} runs in this schema",
            printable(group, false)
        )));
    }
    Ok(())
}

/// Pauses `step` of `group`: `PAUSE_DELAY` later, its messages are parked (each holding
/// its key, in order) while the group's other steps go on. Recorded with `operator` and `reason`. Whether it was not
/// paused already.
pub async fn pause(
    pool: &PgPool,
    group: &str,
    step: &str,
    operator: &str,
    reason: &str,
) -> Result<bool, AdminError> {
    if reason.trim().is_empty() {
        return Err(AdminError::bad_input(
            "say why the step is paused (--reason)",
        ));
    }
    let mut tx = pool.begin().await?;
    check_step(&mut tx, group, step).await?;
    let paused = sqlx::query(
        "INSERT INTO saga_paused_steps (group_id, step, paused_by, reason, effective_at) \
         VALUES ($1, $2, $3, $4, now() + make_interval(secs => $5)) ON CONFLICT DO NOTHING",
    )
    .bind(group)
    .bind(step)
    .bind(operator)
    .bind(reason)
    .bind(saga_consumer::admin::PAUSE_DELAY.as_secs_f64())
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    if paused {
        log(&mut tx, group, step, "pause", operator, reason).await?;
    }
    tx.commit().await?;
    Ok(paused)
}

/// Resumes `step` of `group`: the keys its messages held are released (their parked messages run in
/// order). Recorded with `operator`. The number of keys released; bad input if it was not paused.
pub async fn resume(
    pool: &PgPool,
    group: &str,
    step: &str,
    operator: &str,
    reason: &str,
) -> Result<u64, AdminError> {
    let mut tx = pool.begin().await?;
    check_step(&mut tx, group, step).await?;
    let was_paused = sqlx::query("DELETE FROM saga_paused_steps WHERE group_id = $1 AND step = $2")
        .bind(group)
        .bind(step)
        .execute(&mut *tx)
        .await?
        .rows_affected()
        == 1;
    if !was_paused {
        return Err(AdminError::bad_input(format!(
            "step {step} of group {} is not paused",
            printable(group, false)
        )));
    }
    let released = release_held(
        &mut tx,
        group,
        Released::PausedStep(step),
        &format!("resume by {operator}"),
    )
    .await?;
    log(&mut tx, group, step, "resume", operator, reason).await?;
    tx.commit().await?;
    Ok(released)
}

async fn log(
    tx: &mut PgConnection,
    group: &str,
    step: &str,
    action: &str,
    operator: &str,
    reason: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO saga_step_pause_log (group_id, step, action, operator, reason) \
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(group)
    .bind(step)
    .bind(action)
    .bind(operator)
    .bind(reason)
    .execute(tx)
    .await?;
    Ok(())
}

/// Keys held behind the dead letters of `topics`, by (dead-letter topic, failure group): how many, the
/// messages parked behind them, and the oldest hold's age in seconds.
pub async fn by_failure_group(
    pool: &PgPool,
    topics: &[String],
) -> Result<std::collections::HashMap<(String, String), (i64, i64, i64)>, AdminError> {
    let mut conn = pool.acquire().await?;
    if !has_tables(&mut conn).await? {
        return Ok(Default::default());
    }
    let rows = sqlx::query(
        "SELECT d.dlq_topic, d.failure_group, count(*)::bigint AS keys, \
             coalesce(sum(h.parked), 0)::bigint AS parked, \
             extract(epoch FROM now() - min(h.held_at))::bigint AS oldest \
         FROM saga_held_keys h JOIN saga_dead_letters d ON d.dlq_topic = h.head_topic \
             AND d.dlq_partition = h.head_partition AND d.dlq_offset = h.head_offset \
         WHERE h.head_topic = ANY($1) GROUP BY 1, 2",
    )
    .bind(topics)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(|r| {
            Ok((
                (r.try_get("dlq_topic")?, r.try_get("failure_group")?),
                (
                    r.try_get("keys")?,
                    r.try_get("parked")?,
                    r.try_get("oldest")?,
                ),
            ))
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(Into::into)
}

/// Releases held key `key` of `group` by hand (`saga keys release`): its parked messages run in order, as if
/// its head letter had been discarded; the letter stays in its topic. For a key whose head cannot be
/// replayed or discarded. Recorded with `operator`. Bad input if the key is not held.
pub async fn release(
    pool: &PgPool,
    group: &str,
    key: &[u8],
    operator: &str,
) -> Result<HeldKey, AdminError> {
    release_pinned(pool, group, key, operator, None).await
}

/// [`release`], refused unless the key is still held since `held_at` (what a confirmation page showed):
/// a key let go and held again meanwhile is another hold, not released unseen.
pub async fn release_pinned(
    pool: &PgPool,
    group: &str,
    key: &[u8],
    operator: &str,
    held_at: Option<DateTime<Utc>>,
) -> Result<HeldKey, AdminError> {
    let mut tx = pool.begin().await?;
    if !has_tables(&mut tx).await? {
        return Err(AdminError::bad_input(
            "this schema has no held keys (saga_held_keys): its consumer has not run with this version",
        ));
    }
    if let Some(shown) = held_at {
        let now: Option<DateTime<Utc>> = sqlx::query_scalar(
            "SELECT held_at FROM saga_held_keys WHERE group_id = $1 AND key = $2 FOR UPDATE",
        )
        .bind(group)
        .bind(key)
        .fetch_optional(&mut *tx)
        .await?;
        if now != Some(shown) {
            return Err(AdminError::bad_input(
                "the key changed since the page showed it (let go, or held again): nothing was done; open it \
                 again",
            ));
        }
    }
    let released = release_held(
        &mut tx,
        group,
        Released::Key(key),
        &format!("release by {operator}"),
    )
    .await?;
    // Read in the transaction that released it: the releaser cannot let it go meanwhile.
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {HELD_COLUMNS} FROM saga_held_keys WHERE group_id = $1 AND key = $2"
    )))
    .bind(group)
    .bind(key)
    .fetch_optional(&mut *tx)
    .await?;
    tx.commit().await?;
    match row.filter(|_| released == 1) {
        Some(row) => Ok(held_key(&row)?),
        None => Err(AdminError::bad_input(format!(
            "key {} (hex {}) of group {:?} is not held (or is releasing already): see `saga keys held` \
             (a key that is not plain text: `--key-hex`, as `saga keys held --json` gives it)",
            printable_bytes(key),
            hex(key),
            printable(group, false)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(cause: &str, head_reason: Option<&str>) -> HeldKey {
        HeldKey {
            group: "g".into(),
            key: "k".into(),
            key_hex: "6b".into(),
            state: "releasing".into(),
            cause: cause.into(),
            paused_step: None,
            head: None,
            head_reason: head_reason.map(str::to_owned),
            parked: 1,
            held_at: Utc::now(),
            age_seconds: 0,
            released_by: None,
            retry_attempts: None,
            next_attempt_at: None,
        }
    }

    #[test]
    fn a_delayed_retry_says_its_attempts_and_when_it_runs_again() {
        let mut key = held("retrying", None);
        key.retry_attempts = Some(2);
        key.next_attempt_at = Some(
            DateTime::parse_from_rfc3339("2999-01-02T03:04:05Z")
                .unwrap()
                .with_timezone(&Utc),
        );
        assert_eq!(
            key.held_by(),
            "retrying (2 attempts), next at 2999-01-02 03:04:05 UTC"
        );
        key.retry_attempts = Some(1);
        key.next_attempt_at = None;
        assert_eq!(key.held_by(), "retrying (1 attempt), due now");
        // Parked behind a dead letter, it says both.
        let mut behind = held("dead-letter", Some("handler-failed"));
        behind.retry_attempts = Some(1);
        assert_eq!(
            behind.held_by(),
            "dead letter (handler-failed); retrying (1 attempt), due now"
        );
        assert_eq!(
            held("dead-letter", Some("handler-failed")).held_by(),
            "dead letter (handler-failed)"
        );
    }
}
