//! The JSON API under the page (`/api/…`): every view and action of the page, for scripts and other
//! dashboards. The page renders the same data, and its forms post to these actions: a request that accepts
//! HTML (a browser's form) gets the result as a page, any other gets JSON.
//!
//! Reads: `GET /api/overview`, `/api/sagas/{id}`, `/api/dlq/{topic}`, `/api/dlq/{topic}/{partition}/{offset}`,
//! `/api/groups`, `/api/groups/{id}`, `/api/groups/{id}/plan?action=replay|discard`, `/api/operations`,
//! `/api/operations/{id}`, `/api/trace?key=…&tenant=…`.
//!
//! Actions (`POST`): `/api/dlq/{topic}/{partition}/{offset}/replay`, `/api/groups/{id}/replay`,
//! `/api/groups/{id}/discard`, `/api/operations/{id}/cancel`, `/api/operations/{id}/undo`,
//! `/api/operations/{id}/resume`, `/api/sagas/{id}/retry`. A bulk action starts a durable operation, runs it
//! in the background and answers with it at once (`202`); follow it at `/api/operations/{id}`.

use std::collections::BTreeMap;

use axum::Extension;
use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::security::{Caller, FormFields};
use super::{App, pages};
use crate::audit::{self, Action, Actor, Via};
use crate::dlq::{self, DeadLetter, DlqFilter, ReplayOptions};
use crate::error::AdminError;
use crate::groups::{self, FailureGroup, GroupedLetter};
use crate::keys::KeyView;
use crate::lag::PartitionLag;
use crate::operations::{self, Operation, OperationLetter, Plan};
use crate::outbox::OutboxStatus;
use saga_orchestrator::SagaInstance;

/// Whether the request wants a page (a browser) rather than JSON.
pub(super) fn wants_html(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("text/html"))
}

/// An error, as a page or as JSON: bad input is the caller's (400, said as it is), a stale index 503 (how
/// stale, said), the rest the service's (502): what failed, in a word, and a reference to the inspector's log, which has the details (a
/// database's or broker's error names addresses and settings the page's viewers need not see).
pub(super) fn failure(e: &AdminError, html: bool) -> Response {
    let (status, text) = if e.is_caller_error() {
        (StatusCode::BAD_REQUEST, e.to_string())
    } else if let AdminError::Stale(staleness) = e {
        // Said in words that quote no server's error: the log line has it.
        (StatusCode::SERVICE_UNAVAILABLE, staleness.to_string())
    } else if let AdminError::Busy(why) = e {
        // The toolkit's own words (what it waited for, and how long).
        (StatusCode::SERVICE_UNAVAILABLE, why.clone())
    } else {
        let reference = format!("r-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        tracing::error!(%reference, error = %e, "the inspector could not answer");
        let what = match e {
            AdminError::Database(_) => "the database",
            AdminError::Kafka(_) => "the broker",
            _ => "the database or the broker",
        };
        (
            StatusCode::BAD_GATEWAY,
            format!(
                "{what} failed; the inspector's log has the details under reference {reference}"
            ),
        )
    };
    if html {
        (status, Html(pages::message("Cannot show this", &text))).into_response()
    } else {
        (status, Json(serde_json::json!({ "error": text }))).into_response()
    }
}

/// `value` as JSON, or rendered by `render` for a browser.
fn answer<T: Serialize>(
    headers: &HeaderMap,
    status: StatusCode,
    value: Result<T, AdminError>,
    render: impl FnOnce(&T) -> String,
) -> Response {
    let html = wants_html(headers);
    match value {
        Ok(v) if html => (status, Html(render(&v))).into_response(),
        Ok(v) => (status, Json(v)).into_response(),
        Err(e) => failure(&e, html),
    }
}

// ---- Data -----------------------------------------------------------------------------------------------

/// A dead-letter topic's count, by reason.
#[derive(Debug, Clone, Serialize)]
pub(super) struct TopicLetters {
    pub topic: String,
    pub total: usize,
    pub open: usize,
    pub by_reason: BTreeMap<String, usize>,
}

/// A consumer group's lag, or why it could not be read.
#[derive(Debug, Clone, Serialize)]
pub(super) struct GroupLag {
    pub group: String,
    pub total: i64,
    pub partitions: Vec<PartitionLag>,
    pub error: Option<String>,
}

/// What the overview shows.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Overview {
    /// Sagas by status; `None` when the schema keeps no orchestrated sagas.
    pub sagas_by_status: Option<Vec<(String, i64)>>,
    pub stuck_for: String,
    pub stuck: Vec<SagaInstance>,
    pub dead_letters: Vec<TopicLetters>,
    pub failure_groups: Vec<FailureGroup>,
    pub outbox: Result<OutboxStatus, String>,
    pub lag: Vec<GroupLag>,
    pub operations: Vec<Operation>,
    /// Keys held behind a dead letter or a paused step, oldest first (at most 50).
    pub held_keys: Vec<crate::holds::HeldKey>,
    /// Paused steps.
    pub paused_steps: Vec<crate::holds::PausedStep>,
}

impl App {
    /// The dead-letter topics the inspector shows: the configured ones, or the broker's `.dlq` topics. A
    /// broker that cannot list them leaves, on a page (a read as indexed: see [`crate::freshness`]), those
    /// the schema's consumer groups record; elsewhere it is the error.
    pub(super) async fn dlq_topics(&self) -> Result<Vec<String>, AdminError> {
        if !self.options.dlq_topics.is_empty() {
            return Ok(self.options.dlq_topics.clone());
        }
        match dlq::discover_topics(&self.kafka).await {
            // Each of them then says, read, that its index could not be brought up to date.
            Err(e @ AdminError::Kafka(_)) if crate::freshness::reading_as_indexed() => {
                tracing::warn!(error = %e, "the broker did not list the dead-letter topics");
                groups::dlq_topics_of(&self.pool).await
            }
            found => found,
        }
    }

    /// Bad input unless `topic` is one of the dead-letter topics the inspector shows: those it was given
    /// (`--dlq-topic`), else the broker's `.dlq` topics and those the schema's consumer groups record. Any
    /// other topic (a business topic, `__consumer_offsets`) is refused before it is read.
    pub(super) async fn shown_topic(&self, topic: &str) -> Result<(), AdminError> {
        let mut shown = self.dlq_topics().await?;
        if self.options.dlq_topics.is_empty() {
            shown.extend(groups::dlq_topics_of(&self.pool).await?);
        }
        if shown.iter().any(|t| t == topic) {
            Ok(())
        } else {
            Err(AdminError::bad_input(format!(
                "{topic} is not a dead-letter topic this inspector shows"
            )))
        }
    }

    pub(super) async fn overview(&self) -> Result<Overview, AdminError> {
        let (sagas_by_status, stuck) = match crate::sagas::counts(&self.pool).await {
            Ok(counts) => {
                let stuck =
                    crate::sagas::list(&self.pool, None, Some(self.options.stuck_for), 50).await?;
                (Some(counts), stuck)
            }
            Err(AdminError::BadInput(_)) => (None, Vec::new()),
            Err(e) => return Err(e),
        };
        let topics = self.dlq_topics().await?;
        let failure_groups = groups::groups(&self.kafka, &self.pool, &topics).await?;
        let counts = crate::index::counts(&self.pool, &topics).await?;
        let dead_letters = topics
            .iter()
            .map(|topic| {
                let of_topic: Vec<(&String, &(usize, usize))> = counts
                    .iter()
                    .filter(|((t, _), _)| t == topic)
                    .map(|((_, reason), n)| (reason, n))
                    .collect();
                TopicLetters {
                    topic: topic.clone(),
                    total: of_topic.iter().map(|(_, (total, _))| total).sum(),
                    open: of_topic.iter().map(|(_, (_, open))| open).sum(),
                    by_reason: of_topic
                        .iter()
                        .map(|(reason, (total, _))| ((*reason).clone(), *total))
                        .collect(),
                }
            })
            .collect();
        let outbox = crate::outbox::status(&self.pool)
            .await
            .map_err(|e| e.to_string());
        let group_names = if self.options.groups.is_empty() {
            crate::lag::known_groups(&self.pool).await?
        } else {
            self.options.groups.clone()
        };
        let mut lag = Vec::new();
        for group in group_names {
            let topics = crate::lag::known_topics(&self.pool, &group).await?;
            lag.push(match crate::lag::lag(&self.kafka, &group, &topics).await {
                Ok(partitions) => GroupLag {
                    total: partitions.iter().map(|p| p.lag).sum(),
                    group,
                    partitions,
                    error: None,
                },
                Err(e) => GroupLag {
                    group,
                    total: 0,
                    partitions: Vec::new(),
                    error: Some(e.to_string()),
                },
            });
        }
        Ok(Overview {
            sagas_by_status,
            stuck_for: crate::duration::human(self.options.stuck_for),
            stuck,
            dead_letters,
            failure_groups,
            outbox,
            lag,
            operations: operations::list(&self.pool, 10).await?,
            held_keys: crate::holds::list(&self.pool, None, 50).await?,
            paused_steps: crate::holds::paused(&self.pool, None).await?,
        })
    }
}

/// A failure group and its letters.
#[derive(Debug, Clone, Serialize)]
pub(super) struct GroupView {
    pub group: FailureGroup,
    pub letters: Vec<GroupedLetter>,
}

/// An operation and its letters.
#[derive(Debug, Clone, Serialize)]
pub(super) struct OperationView {
    pub operation: Operation,
    pub letters: Vec<OperationLetter>,
}

// ---- Reads ----------------------------------------------------------------------------------------------

pub(super) async fn overview(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
) -> Response {
    answer(&headers, StatusCode::OK, app.overview().await, |o| {
        pages::overview(o, &caller)
    })
}

pub(super) async fn saga(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    // A viewer who may not act sees no stored HTTP response (it may hold what the client alone should).
    let detail = crate::sagas::show(&app.pool, &id).await.map(|mut d| {
        if caller.read_only {
            d.keys = d.keys.into_iter().map(KeyView::without_response).collect();
        }
        d
    });
    answer(&headers, StatusCode::OK, detail, |d| {
        pages::saga(d, &caller)
    })
}

/// `?after=PARTITION-OFFSET`: the page of a topic's letters after that one.
#[derive(Debug, Default, Deserialize)]
pub(super) struct PageQuery {
    after: Option<String>,
}

pub(super) async fn dlq_topic(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    Path(topic): Path<String>,
    Query(page): Query<PageQuery>,
) -> Response {
    let after = match page.after.as_deref().map(position) {
        Some(None) => {
            return failure(
                &AdminError::bad_input("after is PARTITION-OFFSET"),
                wants_html(&headers),
            );
        }
        Some(Some(after)) => Some(after),
        None => None,
    };
    let letters = match app.shown_topic(&topic).await {
        Ok(()) => topic_letters(&app, &topic, after).await,
        Err(e) => Err(e),
    };
    answer(&headers, StatusCode::OK, letters, |letters| {
        let next = (letters.len() >= PAGE_LETTERS)
            .then(|| {
                letters
                    .last()
                    .map(|l| (l.letter.partition, l.letter.offset))
            })
            .flatten();
        pages::dlq_topic(&topic, letters, next, caller.read_only)
    })
}

/// `PARTITION-OFFSET` read.
fn position(text: &str) -> Option<(i32, i64)> {
    let (partition, offset) = text.split_once('-')?;
    Some((partition.parse().ok()?, offset.parse().ok()?))
}

/// How many letters of a topic a page lists, the oldest first.
const PAGE_LETTERS: usize = 500;

/// A page of [`PAGE_LETTERS`] letters of `topic` (after `after`), with their groups and states.
async fn topic_letters(
    app: &App,
    topic: &str,
    after: Option<(i32, i64)>,
) -> Result<Vec<GroupedLetter>, AdminError> {
    crate::index::sync_for_reading(&app.kafka, &app.pool, topic).await?;
    let topics = [topic.to_owned()];
    let filter = DlqFilter {
        limit: Some(PAGE_LETTERS),
        ..DlqFilter::default()
    };
    crate::index::letters(
        &app.pool,
        &crate::index::Selection {
            topics: &topics,
            filter: Some(&filter),
            after,
            ..crate::index::Selection::default()
        },
    )
    .await
}

pub(super) async fn dlq_letter(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    Path((topic, partition, offset)): Path<(String, i32, i64)>,
) -> Response {
    answer(
        &headers,
        StatusCode::OK,
        one_letter(&app, &topic, partition, offset).await,
        |l| pages::dlq_letter(l, caller.read_only),
    )
}

pub(super) async fn failure_groups(State(app): State<App>, headers: HeaderMap) -> Response {
    let groups = match app.dlq_topics().await {
        Ok(topics) => groups::groups(&app.kafka, &app.pool, &topics).await,
        Err(e) => Err(e),
    };
    answer(&headers, StatusCode::OK, groups, |g| pages::groups(g))
}

pub(super) async fn failure_group(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let view = async {
        let topics = app.dlq_topics().await?;
        let (group, letters) = groups::find(&app.kafka, &app.pool, &topics, &id).await?;
        Ok(GroupView { group, letters })
    }
    .await;
    answer(&headers, StatusCode::OK, view, |v| pages::group(v, &caller))
}

/// `?action=replay|discard`.
#[derive(Debug, Deserialize)]
pub(super) struct PlanQuery {
    action: String,
}

pub(super) async fn plan(app: &App, id: &str, action: &str) -> Result<Plan, AdminError> {
    let topics = app.dlq_topics().await?;
    match action {
        "replay" => {
            operations::plan_replay(
                &app.kafka,
                &app.pool,
                &topics,
                id,
                &ReplayOptions::default(),
            )
            .await
        }
        "discard" => operations::plan_discard(&app.kafka, &app.pool, &topics, id).await,
        other => Err(AdminError::bad_input(format!(
            "unknown action {other:?}: replay or discard"
        ))),
    }
}

pub(super) async fn group_plan(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(query): Query<PlanQuery>,
) -> Response {
    answer(
        &headers,
        StatusCode::OK,
        plan(&app, &id, &query.action).await,
        |p| pages::confirm_plan(p, &id, &caller),
    )
}

pub(super) async fn operations_list(State(app): State<App>, headers: HeaderMap) -> Response {
    answer(
        &headers,
        StatusCode::OK,
        operations::list(&app.pool, 100).await,
        |ops| pages::operations(ops),
    )
}

pub(super) async fn operation(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> Response {
    let view = operations::get(&app.pool, id)
        .await
        .map(|(operation, letters)| OperationView { operation, letters });
    answer(&headers, StatusCode::OK, view, |v| {
        pages::operation(v, &caller)
    })
}

/// `?key=…&tenant=…`.
#[derive(Debug, Deserialize)]
pub(super) struct TraceQuery {
    key: Option<String>,
    tenant: Option<String>,
}

pub(super) async fn trace(
    State(app): State<App>,
    headers: HeaderMap,
    Query(query): Query<TraceQuery>,
) -> Response {
    let key = query.key.unwrap_or_default();
    let tenant = query.tenant.filter(|t| !t.trim().is_empty());
    if key.trim().is_empty() && wants_html(&headers) {
        return Html(pages::trace_form()).into_response();
    }
    let trace = crate::trace::trace(&app.pool, key.trim(), tenant.as_deref(), &[]).await;
    answer(&headers, StatusCode::OK, trace, pages::trace)
}

// ---- Actions --------------------------------------------------------------------------------------------

/// The header in which a script gives the reason of an action (a page's form gives its `reason` field).
pub(super) const REASON_HEADER: &str = "saga-reason";

/// The caller as the audit log's actor: its token's name, the form's `reason` (a script's: the
/// `saga-reason` header), through the page.
fn actor(
    caller: &Caller,
    form: Option<&Extension<FormFields>>,
    headers: &HeaderMap,
) -> Result<Actor, AdminError> {
    let header = headers
        .get(REASON_HEADER)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let reason = form
        .and_then(|Extension(f)| f.get("reason"))
        .or(header.as_deref());
    Actor::new(caller.operator.clone(), reason, Via::Page)
}

fn read_only(caller: &Caller, headers: &HeaderMap) -> Option<Response> {
    caller.read_only.then(|| {
        failure(
            &AdminError::bad_input("this inspector is read-only"),
            wants_html(headers),
        )
    })
}

pub(super) async fn replay_letter(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    form: Option<Extension<FormFields>>,
    headers: HeaderMap,
    Path((topic, partition, offset)): Path<(String, i32, i64)>,
) -> Response {
    if let Some(refused) = read_only(&caller, &headers) {
        return refused;
    }
    let actor = match actor(&caller, form.as_ref(), &headers) {
        Ok(actor) => actor,
        Err(e) => return failure(&e, wants_html(&headers)),
    };
    let action = Action::new("dlq replay")
        .on("topic", &topic)
        .on("letters", format!("at {partition}/{offset}"));
    let work = replay_checked(&app, &caller, form.as_ref(), &topic, partition, offset);
    let report = audit::audited(&app.pool, &actor, action, work, |r| {
        format!("{} sent to {}", r.sent(), r.retry_topic)
    })
    .await;
    answer(&headers, StatusCode::OK, report, |r| {
        pages::replayed(&topic, r)
    })
}

/// Replays the letter at `partition`/`offset` of `topic` as `caller`'s, if it is the letter the page's
/// confirmation showed.
async fn replay_checked(
    app: &App,
    caller: &Caller,
    form: Option<&Extension<FormFields>>,
    topic: &str,
    partition: i32,
    offset: i64,
) -> Result<dlq::ReplayReport, AdminError> {
    // The page's confirmation names the letter it showed: a letter now at that position (its topic
    // recreated) is not replayed unseen.
    let pinned = form.and_then(|Extension(f)| f.get("letter"));
    match (pinned, caller.scripted) {
        (None, false) => {
            return Err(AdminError::bad_input(
                "a replay must be confirmed from the letter's page: open it again",
            ));
        }
        (None, true) => app.shown_topic(topic).await?,
        (Some(pinned), _) => {
            if one_letter(app, topic, partition, offset).await?.identity() != pinned {
                return Err(AdminError::bad_input(
                    "another letter is at this position now (its topic was recreated): nothing was done; \
                     open it again",
                ));
            }
        }
    }
    // And the retry topic it showed: a group given another one meanwhile gets nothing unseen.
    if let Some(shown) = form.and_then(|Extension(f)| f.get("retry_topic")) {
        let owner = dlq::owner_of(&app.pool, topic).await?;
        if owner.retry_topic != shown {
            return Err(AdminError::bad_input(format!(
                "changed since the preview: group {} reads {} now, not {shown}: nothing was done; open it \
                 again",
                owner.group, owner.retry_topic
            )));
        }
    }
    dlq::replay(
        &app.kafka,
        &app.pool,
        topic,
        &DlqFilter::at(partition, offset),
        &ReplayOptions::default().by(caller.operator.clone()),
    )
    .await
}

/// The exact bytes of a key named by hexadecimal path segment `key_hex`.
pub(super) fn key_of_hex(key_hex: &str) -> Result<Vec<u8>, AdminError> {
    saga_runtime::cli::parse_hex(key_hex)
        .ok_or_else(|| AdminError::bad_input("the key is not hexadecimal"))
}

/// Releases a held key by hand (`saga keys release` from the page): pinned to the hold the confirmation
/// showed (`held_at`), so a key let go and held again meanwhile is not released unseen.
pub(super) async fn release_key(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    form: Option<Extension<FormFields>>,
    headers: HeaderMap,
    Path((group, key_hex)): Path<(String, String)>,
) -> Response {
    if let Some(refused) = read_only(&caller, &headers) {
        return refused;
    }
    let pinned = form.as_ref().and_then(|Extension(f)| f.get("held_at"));
    let actor = match actor(&caller, form.as_ref(), &headers) {
        Ok(actor) => actor,
        Err(e) => return failure(&e, wants_html(&headers)),
    };
    let key = key_of_hex(&key_hex);
    let action = Action::new("keys release")
        .on("group", &group)
        .on_bytes("key", key.as_deref().unwrap_or_default());
    let work = async {
        let key = key?;
        let held_at = match (pinned, caller.scripted) {
            (None, false) => {
                return Err(AdminError::bad_input(
                    "a release must be confirmed from the key's page: open it again",
                ));
            }
            (None, true) => None,
            (Some(text), _) => Some(
                chrono::DateTime::parse_from_rfc3339(text)
                    .map_err(|_| {
                        AdminError::bad_input("the confirmation's held_at does not parse")
                    })?
                    .with_timezone(&chrono::Utc),
            ),
        };
        crate::holds::release_pinned(&app.pool, &group, &key, &caller.operator, held_at).await
    };
    let released = audit::audited(&app.pool, &actor, action, work, |r| {
        format!("released; {} parked messages run in order", r.parked)
    })
    .await;
    answer(&headers, StatusCode::OK, released, pages::key_released)
}

/// The form field (or query parameter) pinning a confirmation to its preview: see [`PlanPin`].
pub(super) const PLAN_FIELD: &str = "plan";
/// How long a preview may be confirmed.
const PLAN_TTL_SECS: i64 = 600;

/// What a preview's confirmation carries: when the preview was made, how many letters it listed, its
/// plan's [`digest`](Plan::digest), and a seal of these with the session, as
/// `{unix seconds}.{letters}.{digest}.{seal}`. The confirmation acts only if
/// the plan made when it arrives has the same digest (the same letters, alike) and the preview is at most
/// ten minutes old: letters that arrived since are not acted on unseen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PlanPin {
    made_at: i64,
    letters: usize,
    digest: String,
    /// A hash of the above with the session's CSRF token: a pin is the session's, and its time is the
    /// preview's.
    seal: String,
}

impl PlanPin {
    /// The pin of `plan`, previewed now in the session whose CSRF token is `csrf`.
    pub(super) fn of(plan: &Plan, csrf: &str) -> Self {
        let (made_at, letters, digest) = (
            chrono::Utc::now().timestamp(),
            plan.letters.len(),
            plan.digest(),
        );
        Self {
            seal: Self::seal(made_at, letters, &digest, csrf),
            made_at,
            letters,
            digest,
        }
    }

    fn seal(made_at: i64, letters: usize, digest: &str, csrf: &str) -> String {
        use sha2::Digest as _;
        sha2::Sha256::digest(format!("plan\0{csrf}\0{made_at}\0{letters}\0{digest}"))[..12]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    fn parse(text: &str) -> Option<Self> {
        let mut parts = text.splitn(4, '.');
        Some(Self {
            made_at: parts.next()?.parse().ok()?,
            letters: parts.next()?.parse().ok()?,
            digest: parts.next()?.to_owned(),
            seal: parts.next()?.to_owned(),
        })
    }

    /// Bad input unless the pin is of the session whose CSRF token is `csrf`, `plan`, made now, is the one
    /// its preview showed, and the preview is recent.
    fn admits(&self, plan: &Plan, csrf: &str) -> Result<(), AdminError> {
        if self.seal != Self::seal(self.made_at, self.letters, &self.digest, csrf) {
            return Err(AdminError::bad_input(
                "the confirmation's plan is not this session's preview: preview again, then confirm",
            ));
        }
        let age = chrono::Utc::now().timestamp() - self.made_at;
        if !(0..=PLAN_TTL_SECS).contains(&age) {
            return Err(AdminError::bad_input(
                "the preview expired (it is older than ten minutes): preview again, then confirm",
            ));
        }
        if self.digest != plan.digest() {
            return Err(AdminError::bad_input(format!(
                "changed since the preview (it listed {} letter(s); now {} letter(s), {} held key(s) with {} \
                 message(s) parked behind them, sent to {}): nothing was done; preview again, then confirm",
                self.letters,
                plan.letters.len(),
                plan.held_keys,
                plan.parked_behind,
                plan.retry_topic.as_deref().unwrap_or("no retry topic")
            )));
        }
        Ok(())
    }
}

impl std::fmt::Display for PlanPin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}.{}.{}.{}",
            self.made_at, self.letters, self.digest, self.seal
        )
    }
}

/// `plan` if the confirmation of `caller` may act on it: a page's confirmation must carry its preview's
/// pin (see [`PlanPin`]); a script's may (`?plan=` or a form field), else it acts on the plan as made now,
/// as the command does after its own preview.
fn pinned(
    caller: &Caller,
    form: Option<&FormFields>,
    query: &PinQuery,
    plan: Result<Plan, AdminError>,
) -> Result<Plan, AdminError> {
    let plan = plan?;
    let presented = form
        .and_then(|f| f.get(PLAN_FIELD))
        .or(query.plan.as_deref());
    match presented {
        Some(text) => {
            let pin = PlanPin::parse(text)
                .ok_or_else(|| AdminError::bad_input("the confirmation's plan is malformed"))?;
            pin.admits(&plan, &caller.csrf)?;
        }
        None if !caller.scripted => {
            return Err(AdminError::bad_input(
                "a confirmation must come from the preview's page: preview again, then confirm",
            ));
        }
        None => {}
    }
    Ok(plan)
}

/// `?plan=`: a script's pin of its preview.
#[derive(Debug, Default, Deserialize)]
pub(super) struct PinQuery {
    plan: Option<String>,
}

/// Starts the operation `plan` of `caller`, runs it in the background, and answers with it (a browser:
/// with a redirect to its page).
async fn start_operation(
    app: &App,
    caller: &Caller,
    form: Option<&Extension<FormFields>>,
    headers: &HeaderMap,
    (plan, unplanned): (Result<Plan, AdminError>, Action),
) -> Response {
    let html = wants_html(headers);
    let actor = match actor(caller, form, headers) {
        Ok(actor) => actor,
        Err(e) => return failure(&e, html),
    };
    let action = plan.as_ref().map_or(unplanned, Plan::audit_action);
    let work = async { operations::start(&app.pool, &plan?, &caller.operator).await };
    let started = audit::audited(&app.pool, &actor, action, work, |id| {
        format!("started operation {id}")
    })
    .await;
    let id = match started {
        Ok(id) => id,
        Err(e) => return failure(&e, html),
    };
    spawn_run(app, id, actor);
    if html {
        return (
            StatusCode::SEE_OTHER,
            [(header::LOCATION, format!("/operations/{id}"))],
        )
            .into_response();
    }
    match operations::get(&app.pool, id).await {
        Ok((operation, letters)) => (
            StatusCode::ACCEPTED,
            Json(OperationView { operation, letters }),
        )
            .into_response(),
        Err(e) => failure(&e, false),
    }
}

/// Runs operation `id` in the background as `operator`'s (its record says how far it got, and who ran it).
fn spawn_run(app: &App, id: i64, actor: Actor) {
    let app = app.clone();
    let options = ReplayOptions::default().by(actor.operator.clone());
    tokio::spawn(async move {
        // The run is an entry of the audit log of its own: how the operation ended, or why it stopped.
        let action = Action::new("dlq operations run").on("operation", id);
        let work = operations::run(&app.kafka, &app.pool, id, &options);
        let ran = audit::audited(&app.pool, &actor, action, work, |o| {
            format!("operation {}: {}, {} done", o.id, o.status, o.done)
        })
        .await;
        if let Err(e) = ran {
            tracing::warn!(operation = id, error = %e, "a dead-letter operation stopped");
        }
    });
}

pub(super) async fn group_replay(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    form: Option<Extension<FormFields>>,
    Query(query): Query<PinQuery>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Some(refused) = read_only(&caller, &headers) {
        return refused;
    }
    let plan = pinned(
        &caller,
        form.as_ref().map(|Extension(f)| f),
        &query,
        plan(&app, &id, "replay").await,
    );
    let unplanned = Action::new("dlq replay --group").on("group", &id);
    start_operation(&app, &caller, form.as_ref(), &headers, (plan, unplanned)).await
}

pub(super) async fn group_discard(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    form: Option<Extension<FormFields>>,
    Query(query): Query<PinQuery>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Some(refused) = read_only(&caller, &headers) {
        return refused;
    }
    let plan = pinned(
        &caller,
        form.as_ref().map(|Extension(f)| f),
        &query,
        plan(&app, &id, "discard").await,
    );
    let unplanned = Action::new("dlq discard").on("group", &id);
    start_operation(&app, &caller, form.as_ref(), &headers, (plan, unplanned)).await
}

/// The preview of undoing discard operation `id`: what it would open again, with the pin its confirmation
/// carries.
pub(super) async fn undo_plan(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> Response {
    let plan = operations::plan_undo(&app.pool, id).await;
    answer(&headers, StatusCode::OK, plan, |p| {
        pages::confirm_plan(p, &id.to_string(), &caller)
    })
}

pub(super) async fn operation_undo(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    form: Option<Extension<FormFields>>,
    Query(query): Query<PinQuery>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> Response {
    if let Some(refused) = read_only(&caller, &headers) {
        return refused;
    }
    let plan = pinned(
        &caller,
        form.as_ref().map(|Extension(f)| f),
        &query,
        operations::plan_undo(&app.pool, id).await,
    );
    let unplanned = Action::new("dlq discard --undo").on("undoes", id);
    start_operation(&app, &caller, form.as_ref(), &headers, (plan, unplanned)).await
}

pub(super) async fn operation_cancel(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    form: Option<Extension<FormFields>>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> Response {
    if let Some(refused) = read_only(&caller, &headers) {
        return refused;
    }
    let cancelled = match actor(&caller, form.as_ref(), &headers) {
        Ok(actor) => {
            let action = Action::new("dlq operations cancel").on("operation", id);
            let work = operations::cancel(&app.pool, id, &caller.operator);
            audit::audited(&app.pool, &actor, action, work, |o| {
                format!("operation {}: {}", o.id, o.status)
            })
            .await
        }
        Err(e) => Err(e),
    };
    after_operation_action(&app, &headers, id, cancelled.map(drop)).await
}

pub(super) async fn operation_resume(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    form: Option<Extension<FormFields>>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> Response {
    if let Some(refused) = read_only(&caller, &headers) {
        return refused;
    }
    let work = async {
        match operations::get(&app.pool, id).await? {
            (operation, _) if operation.status == "running" => Ok(()),
            (operation, _) => Err(AdminError::bad_input(format!(
                "operation {id} is {}: nothing left to run",
                operation.status
            ))),
        }
    };
    let action = Action::new("dlq operations resume").on("operation", id);
    let running = match actor(&caller, form.as_ref(), &headers) {
        Ok(actor) => {
            let resumed = audit::audited(&app.pool, &actor, action, work, |()| {
                "resumed in the background".to_owned()
            })
            .await;
            if resumed.is_ok() {
                spawn_run(&app, id, actor);
            }
            resumed
        }
        Err(e) => Err(e),
    };
    after_operation_action(&app, &headers, id, running).await
}

/// Answers an action on operation `id`: a redirect to its page for a browser, the operation as JSON
/// otherwise.
async fn after_operation_action(
    app: &App,
    headers: &HeaderMap,
    id: i64,
    done: Result<(), AdminError>,
) -> Response {
    let html = wants_html(headers);
    if let Err(e) = done {
        return failure(&e, html);
    }
    if html {
        return (
            StatusCode::SEE_OTHER,
            [(header::LOCATION, format!("/operations/{id}"))],
        )
            .into_response();
    }
    match operations::get(&app.pool, id).await {
        Ok((operation, letters)) => Json(OperationView { operation, letters }).into_response(),
        Err(e) => failure(&e, false),
    }
}

pub(super) async fn saga_retry(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    form: Option<Extension<FormFields>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Some(refused) = read_only(&caller, &headers) {
        return refused;
    }
    let html = wants_html(&headers);
    let retried = match actor(&caller, form.as_ref(), &headers) {
        Ok(actor) => {
            let action = Action::new("sagas retry").on("saga", &id);
            let pinned = form.as_ref().and_then(|Extension(f)| f.get("version"));
            let work = async {
                let version = match (pinned, caller.scripted) {
                    (None, false) => {
                        return Err(AdminError::bad_input(
                            "a retry must be confirmed from the saga's page: open it again",
                        ));
                    }
                    (None, true) => None,
                    (Some(text), _) => Some(text.parse::<i64>().map_err(|_| {
                        AdminError::bad_input("the confirmation's version does not parse")
                    })?),
                };
                crate::sagas::retry_pinned(&app.pool, &id, &caller.operator, version).await
            };
            audit::audited(&app.pool, &actor, action, work, |i| {
                format!(
                    "retry of step {} attempt {} requested",
                    i.step_index, i.attempt
                )
            })
            .await
        }
        Err(e) => Err(e),
    };
    match retried {
        Ok(_) if html => (
            StatusCode::SEE_OTHER,
            [(header::LOCATION, format!("/sagas/{id}"))],
        )
            .into_response(),
        Ok(instance) => (StatusCode::ACCEPTED, Json(instance)).into_response(),
        Err(e) => failure(&e, html),
    }
}

pub(super) async fn one_letter(
    app: &App,
    topic: &str,
    partition: i32,
    offset: i64,
) -> Result<DeadLetter, AdminError> {
    app.shown_topic(topic).await?;
    let listed = dlq::list(
        &app.kafka,
        &app.pool,
        topic,
        &DlqFilter::at(partition, offset),
    )
    .await?;
    dlq::with_records(&app.kafka, &app.pool, listed)
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| {
            AdminError::bad_input(format!(
                "{topic} has no dead letter at partition {partition} offset {offset}"
            ))
        })
}
