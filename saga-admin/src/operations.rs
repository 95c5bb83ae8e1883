//! Bulk repair of dead letters: replay or discard a whole failure group, as a durable operation.
//!
//! An operation is **planned** first ([`plan_replay`], [`plan_discard`], [`plan_undo`]): what it would do
//! to how many letters, which the `saga` command shows and asks to confirm, and the page shows before its
//! button. **Started** ([`start`]), it is recorded with the letters it selected (`saga_dlq_operations`,
//! `saga_dlq_operation_letters`): who, when, what. **Run** ([`run`]), it goes through the letters not done
//! yet, recording each outcome; a replayed letter's outcome is recorded in the transaction that records its
//! replay, so a run that dies leaves both or neither. A run holds the operation (a session advisory lock):
//! a second run of it waits for nothing and is refused. A run that died leaves the operation `running`;
//! running it again ([`run`], `saga dlq operations resume`) goes on where it stopped, without sending a
//! letter twice. [`cancel`] asks a run to stop before its next letter.
//!
//! **Discarding** resolves letters without sending them (`saga_dlq_discards`): they leave their group's
//! open count. It is reversible: an undo operation ([`plan_undo`]) makes the letters of a discard open
//! again.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use saga_config::KafkaConfig;
use serde::Serialize;
use sqlx::{PgPool, Row};

use crate::dlq::{self, DeadLetter, ReplayOptions, ReplayOutcome};
use crate::error::AdminError;
use crate::groups::{self, FailureGroup, GroupedLetter, LetterState};

/// Takes, on `conn`'s session, the advisory lock a run holds on operation `id`, if no other session holds
/// it. Scoped by schema: operation ids restart in each schema, advisory locks are the whole database's.
async fn try_hold(conn: &mut sqlx::PgConnection, id: i64) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT pg_try_advisory_lock(hashtextextended(current_schema() || '/saga_dlq_operation/' || $1, 0))",
    )
    .bind(id.to_string())
    .fetch_one(conn)
    .await
}

/// Lets go of the lock [`try_hold`] took.
async fn let_go(conn: &mut sqlx::PgConnection, id: i64) {
    let released = sqlx::query(
        "SELECT pg_advisory_unlock(hashtextextended(current_schema() || '/saga_dlq_operation/' || $1, 0))",
    )
    .bind(id.to_string())
    .execute(conn)
    .await;
    if let Err(e) = released {
        tracing::warn!(operation = id, error = %e, "could not release an operation's lock; its session ends it");
    }
}

/// What an operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum OperationKind {
    /// Replays letters to their group's retry topic.
    Replay,
    /// Resolves letters without sending them.
    Discard,
    /// Makes the letters of a discard open again.
    UndoDiscard,
}

impl OperationKind {
    /// The stored value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Replay => "replay",
            Self::Discard => "discard",
            Self::UndoDiscard => "undo-discard",
        }
    }

    fn parse(value: &str) -> Result<Self, AdminError> {
        match value {
            "replay" => Ok(Self::Replay),
            "discard" => Ok(Self::Discard),
            "undo-discard" => Ok(Self::UndoDiscard),
            other => Err(AdminError::Store(saga_config::Cause::message(format!(
                "an operation of kind {other:?}, which this version does not know"
            )))),
        }
    }

    /// What its `done` count counts.
    pub fn done_word(self) -> &'static str {
        match self {
            Self::Replay => "sent",
            Self::Discard => "discarded",
            Self::UndoDiscard => "restored",
        }
    }
}

/// A letter an operation would act on, and what it would do.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct PlannedLetter {
    /// The dead-letter topic.
    pub dlq_topic: String,
    /// The letter's partition there.
    pub partition: i32,
    /// Its offset there.
    pub offset: i64,
    /// Its identity (see [`DeadLetter::identity`]).
    pub letter_hash: String,
    /// The saga's key.
    pub idempotency_key: Option<String>,
    /// Why it would be refused (a replay only), if it would.
    pub refusal: Option<String>,
}

/// What an operation would do: the preview shown before it starts.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Plan {
    /// What it does.
    pub kind: OperationKind,
    /// The failure group it selects (none for an undo).
    pub group: Option<FailureGroup>,
    /// The operation an undo undoes.
    pub undoes: Option<i64>,
    /// The letters it selects, in order.
    pub letters: Vec<PlannedLetter>,
    /// Letters of the group it leaves alone: replayed or discarded already.
    pub left_alone: usize,
    /// Where a replay sends: the group's retry topic.
    pub retry_topic: Option<String>,
    /// Keys held behind the letters it acts on (they are the keys' head letters), and the messages parked
    /// behind those keys: what the decision releases besides the letters (see [`crate::holds`]).
    pub held_keys: i64,
    /// See [`Plan::held_keys`].
    pub parked_behind: i64,
}

impl Plan {
    /// What the audit log records of the plan: the action (`dlq replay --group`, `dlq discard`,
    /// `dlq discard --undo`), its group or undone operation, how many letters, and its digest.
    pub fn audit_action(&self) -> crate::audit::Action {
        let name = match self.kind {
            OperationKind::Replay => "dlq replay --group",
            OperationKind::Discard => "dlq discard",
            OperationKind::UndoDiscard => "dlq discard --undo",
        };
        let mut action = crate::audit::Action::new(name);
        if let Some(group) = &self.group {
            action = action.on("group", &group.id).on("topic", &group.dlq_topic);
        }
        if let Some(undoes) = self.undoes {
            action = action.on("undoes", undoes);
        }
        action
            .on("letters", self.would_act())
            .on("plan", self.digest())
    }

    /// A digest of what the plan does: its kind, group or undone operation, where it sends, the keys it
    /// releases and the messages parked behind them, and each letter's position, identity and refusal. Two
    /// plans with one digest act on the same letters alike: a confirmation that carries its preview's
    /// digest acts only if the plan made at confirming is the preview's.
    pub fn digest(&self) -> String {
        use sha2::{Digest as _, Sha256};
        let mut hash = Sha256::new();
        let mut field = |bytes: &[u8]| {
            hash.update((bytes.len() as u64).to_be_bytes());
            hash.update(bytes);
        };
        field(self.kind.as_str().as_bytes());
        field(self.group.as_ref().map_or("", |g| g.id.as_str()).as_bytes());
        field(&self.undoes.unwrap_or_default().to_be_bytes());
        field(self.retry_topic.as_deref().unwrap_or("").as_bytes());
        field(&self.held_keys.to_be_bytes());
        field(&self.parked_behind.to_be_bytes());
        for l in &self.letters {
            field(l.dlq_topic.as_bytes());
            field(&l.partition.to_be_bytes());
            field(&l.offset.to_be_bytes());
            field(l.letter_hash.as_bytes());
            field(l.refusal.as_deref().unwrap_or("").as_bytes());
        }
        hash.finalize()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// How many letters it would act on (sent, discarded or restored).
    pub fn would_act(&self) -> usize {
        self.letters.iter().filter(|l| l.refusal.is_none()).count()
    }

    /// How many it would refuse.
    pub fn would_refuse(&self) -> usize {
        self.letters.len() - self.would_act()
    }

    /// The plan in one sentence, for the confirmation question.
    pub fn describe(&self) -> String {
        let what = match &self.group {
            Some(g) => format!(
                "failure group {} ({} of {}, {}: {})",
                g.id,
                g.step.as_deref().unwrap_or("no step"),
                g.dlq_topic,
                g.reason,
                g.cause
            ),
            None => format!("operation {}", self.undoes.unwrap_or_default()),
        };
        let mut text = match self.kind {
            OperationKind::Replay => format!(
                "replay {} dead letter(s) of {what} to {}",
                self.would_act(),
                self.retry_topic
                    .as_deref()
                    .unwrap_or("the group's retry topic")
            ),
            OperationKind::Discard => format!(
                "discard {} dead letter(s) of {what} without sending them (reversible)",
                self.would_act()
            ),
            OperationKind::UndoDiscard => format!(
                "make the {} dead letter(s) discarded by {what} open again",
                self.would_act()
            ),
        };
        if self.held_keys > 0 {
            let when = match self.kind {
                OperationKind::Replay => "each after its head letter succeeds",
                _ => "as soon as it is done",
            };
            text.push_str(&format!(
                "; {} of them hold their keys, with {} message(s) parked behind them: those are released \
                 in their order, {when}",
                self.held_keys, self.parked_behind
            ));
        }
        if self.would_refuse() > 0 {
            text.push_str(&format!("; {} would be refused", self.would_refuse()));
        }
        if self.left_alone > 0 {
            text.push_str(&format!(
                "; {} replayed or discarded already are left alone",
                self.left_alone
            ));
        }
        text
    }
}

/// A recorded operation.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Operation {
    /// Its id.
    pub id: i64,
    /// What it does.
    pub kind: OperationKind,
    /// Who started it.
    pub operator: String,
    /// What it selected.
    pub selection: serde_json::Value,
    /// `running`, `done` or `cancelled`.
    pub status: String,
    /// Whether a cancellation was asked for.
    pub cancel_requested: bool,
    /// Letters selected.
    pub planned: i32,
    /// Letters sent, discarded or restored.
    pub done: i32,
    /// Letters left alone.
    pub skipped: i32,
    /// Letters refused.
    pub refused: i32,
    /// When it was started.
    pub created_at: DateTime<Utc>,
    /// When it last moved.
    pub updated_at: DateTime<Utc>,
    /// When it ended.
    pub finished_at: Option<DateTime<Utc>>,
    /// Who asked it to stop, if anyone did.
    pub cancelled_by: Option<String>,
    /// Who ran it, run by run: its starter, then whoever resumed it. Each run's sends and discards are
    /// recorded under its runner.
    pub run_by: Vec<String>,
    /// Why its last run stopped before its end, if it did (cleared when a run goes on with it).
    pub stopped: Option<String>,
}

/// A letter of a recorded operation and what the operation did with it.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct OperationLetter {
    /// Its place in the operation.
    pub seq: i32,
    /// The dead-letter topic.
    pub dlq_topic: String,
    /// Its partition there.
    pub partition: i32,
    /// Its offset there.
    pub offset: i64,
    /// `done`, `skipped`, `refused`, or none yet.
    pub outcome: Option<String>,
    /// What happened, in words.
    pub detail: Option<String>,
}

async fn migrate(pool: &PgPool) -> Result<(), AdminError> {
    dlq::migrator()
        .run(pool)
        .await
        .map_err(|source| AdminError::Migrations {
            what: "the toolkit's migrations",
            source,
        })
}

fn planned(letter: &DeadLetter, refusal: Option<String>) -> PlannedLetter {
    PlannedLetter {
        dlq_topic: letter.topic.clone(),
        partition: letter.partition,
        offset: letter.offset,
        letter_hash: letter.identity(),
        idempotency_key: letter.idempotency_key.clone(),
        refusal,
    }
}

/// The plan to replay failure group `group_id` of `topics`: its open letters, each to be sent to the
/// retry topic of its consumer group unless a replay would refuse it (see [`dlq::replay`]; `options`'
/// replay limit and force apply).
pub async fn plan_replay(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topics: &[String],
    group_id: &str,
    options: &ReplayOptions,
) -> Result<Plan, AdminError> {
    let (group, letters) = groups::find(kafka, pool, topics, group_id).await?;
    let owner = dlq::owner_of(pool, &group.dlq_topic).await?;
    let (open, left_alone) = split_open(letters);
    let letters: Vec<PlannedLetter> = open
        .iter()
        .map(|l| {
            let refusal = dlq::refusal(&owner, &l.letter, options).map(|o| o.describe());
            planned(&l.letter, refusal)
        })
        .collect();
    let (held_keys, parked_behind) = held_behind(pool, &letters).await?;
    Ok(Plan {
        kind: OperationKind::Replay,
        group: Some(group),
        undoes: None,
        letters,
        left_alone,
        retry_topic: Some(owner.retry_topic),
        held_keys,
        parked_behind,
    })
}

/// The plan to discard failure group `group_id` of `topics`: its open letters.
pub async fn plan_discard(
    kafka: &KafkaConfig,
    pool: &PgPool,
    topics: &[String],
    group_id: &str,
) -> Result<Plan, AdminError> {
    let (group, letters) = groups::find(kafka, pool, topics, group_id).await?;
    let (open, left_alone) = split_open(letters);
    let letters: Vec<PlannedLetter> = open.iter().map(|l| planned(&l.letter, None)).collect();
    let (held_keys, parked_behind) = held_behind(pool, &letters).await?;
    Ok(Plan {
        kind: OperationKind::Discard,
        letters,
        group: Some(group),
        undoes: None,
        left_alone,
        retry_topic: None,
        held_keys,
        parked_behind,
    })
}

/// The keys held behind those of `letters` a plan acts on, and the messages parked behind them.
async fn held_behind(pool: &PgPool, letters: &[PlannedLetter]) -> Result<(i64, i64), AdminError> {
    let acted: Vec<String> = letters
        .iter()
        .filter(|l| l.refusal.is_none())
        .map(|l| l.letter_hash.clone())
        .collect();
    crate::holds::behind_letters(pool, &acted).await
}

/// The plan to undo discard operation `operation`: its letters still discarded.
pub async fn plan_undo(pool: &PgPool, operation: i64) -> Result<Plan, AdminError> {
    let (undone, _) = get(pool, operation).await?;
    if undone.kind != OperationKind::Discard {
        return Err(AdminError::bad_input(format!(
            "operation {operation} is a {}, not a discard: only a discard can be undone",
            undone.kind.as_str()
        )));
    }
    let rows = sqlx::query(
        "SELECT dlq_topic, dlq_partition, dlq_offset, letter_hash, idempotency_key FROM saga_dlq_discards \
         WHERE operation_id = $1 AND undone_at IS NULL ORDER BY dlq_topic, dlq_partition, dlq_offset",
    )
    .bind(operation)
    .fetch_all(pool)
    .await?;
    let letters = rows
        .iter()
        .map(|r| {
            Ok(PlannedLetter {
                dlq_topic: r.try_get(0)?,
                partition: r.try_get(1)?,
                offset: r.try_get(2)?,
                letter_hash: r.try_get(3)?,
                idempotency_key: r.try_get(4)?,
                refusal: None,
            })
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    Ok(Plan {
        kind: OperationKind::UndoDiscard,
        group: None,
        undoes: Some(operation),
        left_alone: usize::try_from(undone.done)
            .unwrap_or(0)
            .saturating_sub(letters.len()),
        letters,
        retry_topic: None,
        held_keys: 0,
        parked_behind: 0,
    })
}

/// The open letters of `letters`, and how many others there were.
fn split_open(letters: Vec<GroupedLetter>) -> (Vec<GroupedLetter>, usize) {
    let total = letters.len();
    let open: Vec<GroupedLetter> = letters
        .into_iter()
        .filter(|l| l.state == LetterState::Open)
        .collect();
    let left = total - open.len();
    (open, left)
}

/// Bad input if the retry topic of `owner` is not the one operation's preview showed (recorded at its
/// start): the group was given another meanwhile, and nothing is sent where the operator did not see.
fn require_pinned_retry_topic(
    operation: &Operation,
    owner: &dlq::DlqOwner,
) -> Result<(), AdminError> {
    match operation.selection["retry_topic"].as_str() {
        Some(pinned) if pinned != owner.retry_topic => Err(AdminError::bad_input(format!(
            "operation {}: the retry topic of group {} changed since the preview (it showed {pinned}, it is \
             {} now): nothing more is sent; cancel the operation and preview again",
            operation.id, owner.group, owner.retry_topic
        ))),
        _ => Ok(()),
    }
}

/// Records `plan` as an operation of `operator`, with the letters it selected; returns its id. Nothing is
/// done to a letter yet: see [`run`].
pub async fn start(pool: &PgPool, plan: &Plan, operator: &str) -> Result<i64, AdminError> {
    migrate(pool).await?;
    let selection = match (&plan.group, plan.undoes) {
        // A replay's retry topic is pinned: a run sends there or nowhere.
        (Some(g), _) => serde_json::json!({
            "dlq_topic": g.dlq_topic,
            "failure_group": g.id,
            "step": g.step,
            "reason": g.reason,
            "cause": g.cause,
            "retry_topic": plan.retry_topic,
        }),
        (None, Some(undoes)) => serde_json::json!({ "undoes": undoes }),
        (None, None) => serde_json::json!({}),
    };
    let mut tx = pool.begin().await?;
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO saga_dlq_operations (kind, operator, selection, planned) VALUES ($1, $2, $3, $4) \
         RETURNING id",
    )
    .bind(plan.kind.as_str())
    .bind(operator)
    .bind(&selection)
    .bind(i32::try_from(plan.letters.len()).unwrap_or(i32::MAX))
    .fetch_one(&mut *tx)
    .await?;
    let seqs: Vec<i32> = (0..plan.letters.len())
        .map(|i| i32::try_from(i).unwrap_or(i32::MAX))
        .collect();
    let topics: Vec<&str> = plan.letters.iter().map(|l| l.dlq_topic.as_str()).collect();
    let partitions: Vec<i32> = plan.letters.iter().map(|l| l.partition).collect();
    let offsets: Vec<i64> = plan.letters.iter().map(|l| l.offset).collect();
    let hashes: Vec<&str> = plan
        .letters
        .iter()
        .map(|l| l.letter_hash.as_str())
        .collect();
    sqlx::query(
        "INSERT INTO saga_dlq_operation_letters (operation_id, seq, dlq_topic, dlq_partition, dlq_offset, \
             letter_hash) \
         SELECT $1, * FROM unnest($2::int[], $3::text[], $4::int[], $5::bigint[], $6::text[])",
    )
    .bind(id)
    .bind(&seqs)
    .bind(&topics)
    .bind(&partitions)
    .bind(&offsets)
    .bind(&hashes)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(id)
}

/// Records what became of letter `seq` of operation `operation`, once (a letter already recorded keeps
/// its outcome), and counts it.
pub(crate) async fn record_item(
    conn: &mut sqlx::PgConnection,
    operation: i64,
    seq: i32,
    outcome: &ReplayOutcome,
) -> Result<(), sqlx::Error> {
    let recorded = match outcome {
        ReplayOutcome::Sent { .. } => "done",
        ReplayOutcome::AlreadyReplayed | ReplayOutcome::WouldSend => "skipped",
        _ => "refused",
    };
    record(conn, operation, seq, recorded, &outcome.describe()).await
}

/// Records `outcome` (`done`, `skipped` or `refused`, which is also the operation's column counting it) of
/// letter `seq` of `operation`, once.
async fn record(
    conn: &mut sqlx::PgConnection,
    operation: i64,
    seq: i32,
    outcome: &str,
    detail: &str,
) -> Result<(), sqlx::Error> {
    debug_assert!(matches!(outcome, "done" | "skipped" | "refused"));
    let recorded = sqlx::query(
        "UPDATE saga_dlq_operation_letters SET outcome = $3, detail = $4, done_at = now() \
         WHERE operation_id = $1 AND seq = $2 AND outcome IS NULL",
    )
    .bind(operation)
    .bind(seq)
    .bind(outcome)
    .bind(detail)
    .execute(&mut *conn)
    .await?;
    if recorded.rows_affected() == 1 {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE saga_dlq_operations SET {outcome} = {outcome} + 1, updated_at = now() WHERE id = $1"
        )))
        .bind(operation)
        .execute(conn)
        .await?;
    }
    Ok(())
}

/// Runs operation `id` (see the module documentation) until every letter is done or a cancellation was
/// asked for; returns it as it ended. Bad input if it ended already or another process runs it.
pub async fn run(
    kafka: &KafkaConfig,
    pool: &PgPool,
    id: i64,
    options: &ReplayOptions,
) -> Result<Operation, AdminError> {
    migrate(pool).await?;
    let (operation, _) = get(pool, id).await?;
    if operation.status != "running" {
        return Err(AdminError::bad_input(format!(
            "operation {id} is {}: nothing left to run",
            operation.status
        )));
    }
    // The run's hold on the operation, for as long as this connection lives.
    let mut held = pool.acquire().await?;
    if !try_hold(&mut held, id).await? {
        return Err(AdminError::bad_input(format!(
            "operation {id} is being run by another process"
        )));
    }
    let result = run_held(kafka, pool, &operation, options).await;
    if let Err(e) = &result {
        record_stop(pool, id, e).await;
    }
    let_go(&mut held, id).await;
    result?;
    Ok(get(pool, id).await?.0)
}

/// Records why a run of operation `id` stopped before its end (shown with the operation: a run left
/// `running` says why); said in the log if even that fails.
async fn record_stop(pool: &PgPool, id: i64, e: &AdminError) {
    let why: String = saga_runtime::cli::printable(&e.to_string(), false)
        .chars()
        .take(2_000)
        .collect();
    tracing::warn!(operation = id, error = %e, "a run of a dead-letter operation stopped");
    let recorded = sqlx::query(
        "UPDATE saga_dlq_operations SET stopped_error = $2, stopped_at = now() WHERE id = $1",
    )
    .bind(id)
    .bind(&why)
    .execute(pool)
    .await;
    if let Err(e) = recorded {
        tracing::warn!(operation = id, error = %e, "why a run stopped could not be recorded");
    }
}

async fn run_held(
    kafka: &KafkaConfig,
    pool: &PgPool,
    operation: &Operation,
    options: &ReplayOptions,
) -> Result<(), AdminError> {
    let id = operation.id;
    let pending: Vec<(i32, String, i32, i64, String)> = sqlx::query_as(
        "SELECT seq, dlq_topic, dlq_partition, dlq_offset, letter_hash FROM saga_dlq_operation_letters \
         WHERE operation_id = $1 AND outcome IS NULL ORDER BY seq",
    )
    .bind(id)
    .fetch_all(pool)
    .await?;
    let producer = saga_runtime::kafka::idempotent_producer(
        kafka,
        std::time::Duration::from_millis(1),
        std::time::Duration::from_secs(30),
    )
    .map_err(AdminError::kafka)?;
    let owners = if operation.kind == OperationKind::Replay {
        owners_of(pool, operation, pending.iter().map(|p| &p.1)).await?
    } else {
        HashMap::new()
    };
    let (runs, run_by) = begin_run(pool, operation, options).await?;
    // A run that died may have sent letters it had no time to record: found in the retry topics by the
    // operation and letter their headers name, they are recorded, not sent again.
    let sent_before = if runs > 1 && operation.kind == OperationKind::Replay {
        sent_by(kafka, id, owners.values().map(|o| o.retry_topic.as_str())).await?
    } else {
        HashMap::new()
    };
    let mut replay_options = options.clone();
    replay_options.operator.clone_from(&run_by);
    replay_options.dry_run = false;
    // In bounded batches: a batch's letters are read (a replay's from their topics, a discard's identities
    // from the index), acted on, and let go before the next.
    for batch in pending.chunks(LETTERS_PER_BATCH) {
        let letters = letters_of(kafka, pool, operation.kind, batch).await?;
        for (seq, topic, partition, offset, hash) in batch.iter().cloned() {
            if ended_by_cancel(pool, id).await? {
                return Ok(());
            }
            let mut conn = pool.acquire().await?;
            match operation.kind {
                OperationKind::UndoDiscard => {
                    undo_one(
                        &mut conn,
                        operation,
                        seq,
                        (&topic, partition, offset, &hash),
                    )
                    .await?;
                }
                OperationKind::Discard | OperationKind::Replay => {
                    let Some(letter) =
                        letters.get(&(topic.clone(), partition, offset, hash.clone()))
                    else {
                        record(
                            &mut conn,
                            id,
                            seq,
                            "skipped",
                            "gone from the dead-letter topic",
                        )
                        .await?;
                        continue;
                    };
                    if operation.kind == OperationKind::Replay {
                        // A replay takes a connection of its own: none is held meanwhile (the run holds
                        // one for its lock already, and a pool of two must do).
                        drop(conn);
                        let owner = &owners[&topic];
                        if let Some(at) = sent_before.get(&hash) {
                            let found = dlq::record_found(
                                pool,
                                owner,
                                letter,
                                &replay_options,
                                *at,
                                (id, seq),
                            )
                            .await?;
                            if found.is_none() {
                                let mut conn = pool.acquire().await?;
                                record(&mut conn, id, seq, "skipped", "replayed already").await?;
                            }
                            continue;
                        }
                        let outcome = dlq::replay_one(
                            &producer,
                            pool,
                            owner,
                            letter,
                            &replay_options,
                            Some((id, seq)),
                        )
                        .await?;
                        // A send was recorded with the replay; anything else is recorded here.
                        let mut conn = pool.acquire().await?;
                        record_item(&mut conn, id, seq, &outcome).await?;
                    } else {
                        discard_one(&mut conn, id, seq, letter, &run_by).await?;
                    }
                }
            }
        }
    }
    sqlx::query(
        "UPDATE saga_dlq_operations SET status = 'done', finished_at = now(), updated_at = now() \
         WHERE id = $1 AND status = 'running'",
    )
    .bind(id)
    .execute(pool)
    .await?;
    Ok(())
}

/// The group owning each of a replay's dead-letter topics, each refused unless it is the one the operation
/// pinned (see [`require_pinned_retry_topic`]).
async fn owners_of<'a>(
    pool: &PgPool,
    operation: &Operation,
    topics: impl Iterator<Item = &'a String>,
) -> Result<HashMap<String, dlq::DlqOwner>, AdminError> {
    let mut owners = HashMap::new();
    for topic in topics {
        if !owners.contains_key(topic) {
            let owner = dlq::owner_of(pool, topic).await?;
            require_pinned_retry_topic(operation, &owner)?;
            owners.insert(topic.clone(), owner);
        }
    }
    Ok(owners)
}

/// Whether operation `id` was asked to stop: if so, it is marked cancelled (its run stops before its next
/// letter).
async fn ended_by_cancel(pool: &PgPool, id: i64) -> Result<bool, AdminError> {
    let cancelled: bool =
        sqlx::query_scalar("SELECT cancel_requested FROM saga_dlq_operations WHERE id = $1")
            .bind(id)
            .fetch_one(pool)
            .await?;
    if cancelled {
        sqlx::query(
            "UPDATE saga_dlq_operations SET status = 'cancelled', finished_at = now(), updated_at = now() \
             WHERE id = $1",
        )
        .bind(id)
        .execute(pool)
        .await?;
    }
    Ok(cancelled)
}

/// Counts a new run of `operation` and records who runs it: the starter for the first run, whoever resumed
/// it for the others (`options.operator`). The run's number and its operator.
async fn begin_run(
    pool: &PgPool,
    operation: &Operation,
    options: &ReplayOptions,
) -> Result<(i32, String), AdminError> {
    let id = operation.id;
    let runs: i32 = sqlx::query_scalar(
        "UPDATE saga_dlq_operations SET runs = runs + 1, updated_at = now(), stopped_error = NULL, \
             stopped_at = NULL \
         WHERE id = $1 RETURNING runs",
    )
    .bind(id)
    .fetch_one(pool)
    .await?;
    // The run's sends and discards are recorded under whoever runs it: the starter for the first run,
    // whoever resumed it for the others.
    let run_by = if options.operator.trim().is_empty() {
        operation.operator.clone()
    } else {
        options.operator.clone()
    };
    sqlx::query(
        "INSERT INTO saga_dlq_operation_runs (operation_id, run, operator) VALUES ($1, $2, $3) \
         ON CONFLICT DO NOTHING",
    )
    .bind(id)
    .bind(runs)
    .bind(&run_by)
    .execute(pool)
    .await?;
    Ok((runs, run_by))
}

/// Makes the letter at (`topic`, `partition`, `offset`) with identity `hash` open again for undo operation
/// `operation` (its letter `seq`), if the discard it undoes still holds it.
async fn undo_one(
    conn: &mut sqlx::PgConnection,
    operation: &Operation,
    seq: i32,
    (topic, partition, offset, hash): (&str, i32, i64, &str),
) -> Result<(), AdminError> {
    let id = operation.id;
    let undoes = operation.selection["undoes"].as_i64().unwrap_or_default();
    let restored = sqlx::query(
        "UPDATE saga_dlq_discards SET undone_at = now(), undone_by = $6, undo_operation_id = $7 \
         WHERE dlq_topic = $1 AND dlq_partition = $2 AND dlq_offset = $3 AND letter_hash = $4 \
           AND operation_id = $5 AND undone_at IS NULL",
    )
    .bind(topic)
    .bind(partition)
    .bind(offset)
    .bind(hash)
    .bind(undoes)
    .bind(&operation.operator)
    .bind(id)
    .execute(&mut *conn)
    .await?;
    let (outcome, detail) = if restored.rows_affected() == 1 {
        ("done", "open again")
    } else {
        ("skipped", "no longer discarded")
    };
    record(conn, id, seq, outcome, detail).await?;
    Ok(())
}

/// The most bytes of a retry topic read at once while a resumed replay looks for what it sent.
const SCAN_BYTES: usize = 16 << 20;

/// The most letters of an operation read and acted on at once.
const LETTERS_PER_BATCH: usize = 64;

/// The letters of `batch` (pending letters of an operation of `kind`) as they are now, by position and
/// identity: a replay's records from their topics (only their positions are read), a discard's from the
/// index (it needs their identities alone); none for an undo.
async fn letters_of(
    kafka: &KafkaConfig,
    pool: &PgPool,
    kind: OperationKind,
    batch: &[(i32, String, i32, i64, String)],
) -> Result<HashMap<(String, i32, i64, String), DeadLetter>, AdminError> {
    let wanted: Vec<(String, i32, i64, String)> = batch
        .iter()
        .map(|(_, topic, partition, offset, hash)| {
            (topic.clone(), *partition, *offset, hash.clone())
        })
        .collect();
    let letters = match kind {
        OperationKind::UndoDiscard => Vec::new(),
        OperationKind::Discard => crate::index::at_positions(pool, &wanted).await?,
        OperationKind::Replay => {
            let at: Vec<DeadLetter> = wanted
                .iter()
                .map(|(topic, partition, offset, hash)| {
                    DeadLetter::from_index(
                        topic,
                        (*partition, *offset),
                        saga_consumer::admin::letters::LetterFields::read(&[], None),
                        hash.clone(),
                    )
                })
                .collect();
            dlq::with_records(kafka, pool, at).await?
        }
    };
    Ok(letters
        .into_iter()
        .map(|l| ((l.topic.clone(), l.partition, l.offset, l.identity()), l))
        .collect())
}

/// The letters operation `operation` sent to `retry_topics`, by identity, with where they are: what its
/// messages' replay headers say.
async fn sent_by(
    kafka: &KafkaConfig,
    operation: i64,
    retry_topics: impl Iterator<Item = &str>,
) -> Result<HashMap<String, (i32, i64)>, AdminError> {
    let operation = operation.to_string();
    let mut topics: Vec<&str> = retry_topics.collect();
    topics.sort_unstable();
    topics.dedup();
    let mut sent = HashMap::new();
    for topic in topics {
        for (partition, low, high) in crate::broker::partitions_of(kafka, topic).await? {
            // In reads of bounded size (a retry topic holds every replay, of any size), keeping only
            // where this operation's letters are.
            let mut at = low;
            while at < high {
                let read = dlq::read_bounded(kafka, topic, partition, at, high, SCAN_BYTES).await?;
                let Some(last) = read.last().map(|r| r.offset) else {
                    break;
                };
                for record in read {
                    if record.header(saga_runtime::replay::OPERATION) == Some(operation.as_str())
                        && let Some(letter) = record.header(saga_runtime::replay::LETTER)
                    {
                        sent.insert(letter.to_owned(), (record.partition, record.offset));
                    }
                }
                at = last + 1;
            }
        }
    }
    Ok(sent)
}

/// Discards `letter` for operation `operation` (its letter `seq`), unless it was replayed or is discarded
/// already; in one transaction with the operation's record of it.
async fn discard_one(
    conn: &mut sqlx::PgConnection,
    operation: i64,
    seq: i32,
    letter: &DeadLetter,
    operator: &str,
) -> Result<(), AdminError> {
    let identity = letter.identity();
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let replayed: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM saga_dlq_replays WHERE dlq_topic = $1 AND dlq_partition = $2 \
           AND dlq_offset = $3 AND letter_hash = $4 AND replayed_at IS NOT NULL)",
    )
    .bind(&letter.topic)
    .bind(letter.partition)
    .bind(letter.offset)
    .bind(&identity)
    .fetch_one(&mut *tx)
    .await?;
    if replayed {
        record(&mut tx, operation, seq, "skipped", "replayed already").await?;
        tx.commit().await?;
        return Ok(());
    }
    let discarded = sqlx::query(
        "INSERT INTO saga_dlq_discards (dlq_topic, dlq_partition, dlq_offset, letter_hash, consumer_group, \
             idempotency_key, tenant_id, operation_id, discarded_by) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
         ON CONFLICT (dlq_topic, dlq_partition, dlq_offset, letter_hash) DO UPDATE \
         SET operation_id = EXCLUDED.operation_id, discarded_by = EXCLUDED.discarded_by, \
             discarded_at = now(), undone_at = NULL, undone_by = NULL, undo_operation_id = NULL \
         WHERE saga_dlq_discards.undone_at IS NOT NULL",
    )
    .bind(&letter.topic)
    .bind(letter.partition)
    .bind(letter.offset)
    .bind(&identity)
    .bind(&letter.group)
    .bind(crate::dlq::indexed_key(letter.idempotency_key.as_deref()))
    .bind(crate::dlq::indexed_name(&letter.tenant))
    .bind(operation)
    .bind(operator)
    .execute(&mut *tx)
    .await?;
    if discarded.rows_affected() == 1 {
        // A key held behind the letter is released with it: its parked messages run, in order.
        let detail = if crate::holds::release_discarded(&mut tx, &letter.group, &identity, operator)
            .await?
        {
            "discarded; the key it held is released"
        } else {
            "discarded"
        };
        record(&mut tx, operation, seq, "done", detail).await?;
    } else {
        record(&mut tx, operation, seq, "skipped", "discarded already").await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Asks operation `id`'s run to stop before its next letter, recorded as asked by `operator`; an operation
/// no process runs is marked cancelled at once. Returns it. Bad input if it ended already.
pub async fn cancel(pool: &PgPool, id: i64, operator: &str) -> Result<Operation, AdminError> {
    let (operation, _) = get(pool, id).await?;
    if operation.status != "running" {
        return Err(AdminError::bad_input(format!(
            "operation {id} is {}: nothing to cancel",
            operation.status
        )));
    }
    sqlx::query(
        "UPDATE saga_dlq_operations SET cancel_requested = true, \
             cancelled_by = coalesce(cancelled_by, $2), cancelled_at = coalesce(cancelled_at, now()), \
             updated_at = now() \
         WHERE id = $1 AND status = 'running'",
    )
    .bind(id)
    .bind(operator)
    .execute(pool)
    .await?;
    // No run holds it: nothing would see the request.
    let mut conn = pool.acquire().await?;
    if try_hold(&mut conn, id).await? {
        sqlx::query(
            "UPDATE saga_dlq_operations SET status = 'cancelled', finished_at = now(), updated_at = now() \
             WHERE id = $1 AND status = 'running'",
        )
        .bind(id)
        .execute(&mut *conn)
        .await?;
        let_go(&mut conn, id).await;
    }
    Ok(get(pool, id).await?.0)
}

/// The columns of an operation, read from a schema whose toolkit tables are this version's, or earlier
/// ones' (`runs`: whether who-ran-what, `saga_dlq_operation_runs`, is recorded): a read runs no migration.
fn operation_columns(runs: bool) -> String {
    let run_by = if runs {
        "ARRAY(SELECT r.operator FROM saga_dlq_operation_runs r \
               WHERE r.operation_id = saga_dlq_operations.id ORDER BY r.run)"
    } else {
        "ARRAY[]::text[]"
    };
    format!(
        "id, kind, operator, selection, status, cancel_requested, planned, done, skipped, refused, \
         created_at, updated_at, finished_at, to_jsonb(saga_dlq_operations) ->> 'cancelled_by', {run_by}, \
         to_jsonb(saga_dlq_operations) ->> 'stopped_error'"
    )
}

fn operation_of(r: &sqlx::postgres::PgRow) -> Result<Operation, AdminError> {
    Ok(Operation {
        id: r.try_get(0)?,
        kind: OperationKind::parse(r.try_get::<&str, _>(1)?)?,
        operator: r.try_get(2)?,
        selection: r.try_get(3)?,
        status: r.try_get(4)?,
        cancel_requested: r.try_get(5)?,
        planned: r.try_get(6)?,
        done: r.try_get(7)?,
        skipped: r.try_get(8)?,
        refused: r.try_get(9)?,
        created_at: r.try_get(10)?,
        updated_at: r.try_get(11)?,
        finished_at: r.try_get(12)?,
        cancelled_by: r.try_get(13)?,
        run_by: r.try_get(14)?,
        stopped: r.try_get(15)?,
    })
}

/// The columns to read operations with (see [`operation_columns`]), or `None` if the schema records
/// none. A read runs no migration: a read-only database user can look, at a schema an earlier version
/// wrote too.
async fn recorded(pool: &PgPool) -> Result<Option<String>, AdminError> {
    let (operations, runs): (bool, bool) = sqlx::query_as(
        "SELECT to_regclass('saga_dlq_operations') IS NOT NULL, \
                to_regclass('saga_dlq_operation_runs') IS NOT NULL",
    )
    .fetch_one(pool)
    .await?;
    Ok(operations.then(|| operation_columns(runs)))
}

/// The operations recorded in `pool`'s schema, newest first, at most `limit`.
pub async fn list(pool: &PgPool, limit: i64) -> Result<Vec<Operation>, AdminError> {
    let Some(columns) = recorded(pool).await? else {
        return Ok(Vec::new());
    };
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {columns} FROM saga_dlq_operations ORDER BY id DESC LIMIT $1"
    )))
    .bind(limit)
    .fetch_all(pool)
    .await?;
    rows.iter().map(operation_of).collect()
}

/// Operation `id` and its letters, in order. Bad input if there is none.
pub async fn get(pool: &PgPool, id: i64) -> Result<(Operation, Vec<OperationLetter>), AdminError> {
    let unknown = || AdminError::bad_input(format!("there is no operation {id} in this schema"));
    let Some(columns) = recorded(pool).await? else {
        return Err(unknown());
    };
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {columns} FROM saga_dlq_operations WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(pool)
    .await?
    .ok_or_else(unknown)?;
    let operation = operation_of(&row)?;
    let letters = sqlx::query(
        "SELECT seq, dlq_topic, dlq_partition, dlq_offset, outcome, detail FROM saga_dlq_operation_letters \
         WHERE operation_id = $1 ORDER BY seq",
    )
    .bind(id)
    .fetch_all(pool)
    .await?
    .iter()
    .map(|r| {
        Ok(OperationLetter {
            seq: r.try_get(0)?,
            dlq_topic: r.try_get(1)?,
            partition: r.try_get(2)?,
            offset: r.try_get(3)?,
            outcome: r.try_get(4)?,
            detail: r.try_get(5)?,
        })
    })
    .collect::<Result<_, sqlx::Error>>()?;
    Ok((operation, letters))
}
