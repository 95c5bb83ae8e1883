//! The inspector page: server-rendered HTML (no JavaScript), reading only through this crate's library, as
//! the `saga` command does.
//!
//! - `/`: sagas by status, stuck sagas, dead letters by topic and reason, the outbox's backlog, consumer
//!   lag.
//! - `/sagas/{id}`: a saga's timeline of transitions, its keys, its compensations.
//! - `/dlq/{topic}`: a dead-letter topic's letters; `/dlq/{topic}/{partition}/{offset}` one of them, with
//!   a replay button behind a confirmation (a POST), unless the inspector is read-only.
//!
//! Who may drive it is checked by the `security` module: the `Host` a request names, a token where tokens are
//! configured, and for a POST its origin and the session's CSRF token.

mod pages;
mod security;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use saga_runtime::kafka::KafkaConfig;
use sqlx::PgPool;

use crate::error::AdminError;
pub use security::NamedToken;
use security::{Caller, Guard};

/// What the inspector shows and who may drive it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct InspectOptions {
    /// Dead-letter topics to show (empty: the broker's topics ending in `.dlq`).
    pub dlq_topics: Vec<String>,
    /// Consumer groups to show the lag of (empty: those the schema records).
    pub groups: Vec<String>,
    /// Unfinished sagas unmoved for this long count as stuck.
    pub stuck_for: Duration,
    /// The tokens, by name, one of which every request must present; none: no token asked (then the
    /// inspector must listen on localhost only, see the `saga inspect` command).
    pub tokens: Vec<NamedToken>,
    /// Names besides the listening address and localhost that requests may give as `Host` (the name a
    /// proxy in front serves it under), with or without a port.
    pub public_names: Vec<String>,
    /// Shows no replay button and refuses every POST.
    pub read_only: bool,
    /// Marks cookies `Secure`: the inspector is served over TLS (by a proxy in front).
    pub secure_cookies: bool,
}

impl Default for InspectOptions {
    fn default() -> Self {
        Self {
            dlq_topics: Vec::new(),
            groups: Vec::new(),
            stuck_for: Duration::from_secs(300),
            tokens: Vec::new(),
            public_names: Vec::new(),
            read_only: false,
            secure_cookies: false,
        }
    }
}

#[derive(Clone)]
struct App {
    kafka: KafkaConfig,
    pool: PgPool,
    options: Arc<InspectOptions>,
}

/// The inspector's routes over `pool`'s schema and the broker of `kafka`, answering requests that name
/// `bound` (the address it listens on), localhost at its port, or one of the options' public names.
pub fn router(
    kafka: KafkaConfig,
    pool: PgPool,
    options: InspectOptions,
    bound: SocketAddr,
) -> Router {
    let guard = Arc::new(Guard::new(
        bound,
        &options.public_names,
        options.tokens.clone(),
        options.read_only,
        options.secure_cookies,
    ));
    let app = App {
        kafka,
        pool,
        options: Arc::new(options),
    };
    Router::new()
        .route("/", get(overview))
        .route("/sagas/{id}", get(saga))
        .route("/dlq/{topic}", get(dlq_topic))
        .route("/dlq/{topic}/{partition}/{offset}", get(dlq_letter))
        .route(
            "/dlq/{topic}/{partition}/{offset}/replay",
            get(confirm_replay).post(replay),
        )
        .layer(axum::middleware::from_fn_with_state(guard, security::guard))
        .with_state(app)
}

/// Serves the inspector on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    kafka: KafkaConfig,
    pool: PgPool,
    options: InspectOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AdminError> {
    let bound = listener
        .local_addr()
        .map_err(|e| AdminError::Store(format!("serving the inspector: {e}")))?;
    axum::serve(listener, router(kafka, pool, options, bound))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|e| AdminError::Store(format!("serving the inspector: {e}")))
}

/// An error as a page: bad input is the visitor's (400), the rest the service's (502).
fn failure(e: &AdminError) -> Response {
    let status = if e.is_caller_error() {
        StatusCode::BAD_REQUEST
    } else {
        StatusCode::BAD_GATEWAY
    };
    (
        status,
        Html(pages::message("Cannot show this", &e.to_string())),
    )
        .into_response()
}

async fn overview(State(app): State<App>) -> Response {
    match pages::overview(&app.kafka, &app.pool, &app.options).await {
        Ok(html) => Html(html).into_response(),
        Err(e) => failure(&e),
    }
}

async fn saga(State(app): State<App>, Path(id): Path<String>) -> Response {
    match crate::sagas::show(&app.pool, &id).await {
        Ok(detail) => Html(pages::saga(&detail)).into_response(),
        Err(e) => failure(&e),
    }
}

async fn dlq_topic(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    Path(topic): Path<String>,
) -> Response {
    match crate::dlq::list(&app.kafka, &topic, &crate::dlq::DlqFilter::default()).await {
        Ok(letters) => Html(pages::dlq_topic(&topic, &letters, caller.read_only)).into_response(),
        Err(e) => failure(&e),
    }
}

async fn dlq_letter(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    Path((topic, partition, offset)): Path<(String, i32, i64)>,
) -> Response {
    match one_letter(&app, &topic, partition, offset).await {
        Ok(letter) => Html(pages::dlq_letter(&letter, caller.read_only)).into_response(),
        Err(e) => failure(&e),
    }
}

async fn confirm_replay(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    Path((topic, partition, offset)): Path<(String, i32, i64)>,
) -> Response {
    if caller.read_only {
        return failure(&AdminError::bad_input("this inspector is read-only"));
    }
    let letter = match one_letter(&app, &topic, partition, offset).await {
        Ok(letter) => letter,
        Err(e) => return failure(&e),
    };
    match crate::dlq::owner_of(&app.pool, &topic).await {
        Ok(owner) => Html(pages::confirm_replay(&letter, &owner, &caller)).into_response(),
        Err(e) => failure(&e),
    }
}

async fn replay(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    Path((topic, partition, offset)): Path<(String, i32, i64)>,
) -> Response {
    let filter = crate::dlq::DlqFilter::at(partition, offset);
    match crate::dlq::replay(
        &app.kafka,
        &app.pool,
        &topic,
        &filter,
        &crate::dlq::ReplayOptions::default().by(caller.operator),
    )
    .await
    {
        Ok(report) => Html(pages::replayed(&topic, &report)).into_response(),
        Err(e) => failure(&e),
    }
}

async fn one_letter(
    app: &App,
    topic: &str,
    partition: i32,
    offset: i64,
) -> Result<crate::dlq::DeadLetter, AdminError> {
    let filter = crate::dlq::DlqFilter::at(partition, offset);
    crate::dlq::list(&app.kafka, topic, &filter)
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| {
            AdminError::bad_input(format!(
                "{topic} has no dead letter at partition {partition} offset {offset}"
            ))
        })
}
