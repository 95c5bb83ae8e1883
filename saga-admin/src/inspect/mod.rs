//! The inspector page: server-rendered HTML (no JavaScript), reading only through this crate's library, as
//! the `saga` command does.
//!
//! - `/`: sagas by status, stuck sagas, dead letters by topic and reason, the outbox's backlog, consumer
//!   lag.
//! - `/sagas/{id}`: a saga's timeline of transitions, its keys, its compensations.
//! - `/dlq/{topic}`: a dead-letter topic's letters; `/dlq/{topic}/{partition}/{offset}` one of them, with
//!   a replay button behind a confirmation (a POST).
//!
//! Bound to localhost by default. With a token (`SAGA_ADMIN_TOKEN`), every request needs it: as
//! `?token=…` once (a cookie keeps it), or `Authorization: Bearer …`. A POST from another origin is refused.

mod pages;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use saga_runtime::kafka::KafkaConfig;
use sqlx::PgPool;

use crate::error::AdminError;

/// What the inspector shows and who may see it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct InspectOptions {
    /// Dead-letter topics to show (empty: the broker's topics ending in `.dlq`).
    pub dlq_topics: Vec<String>,
    /// Consumer groups to show the lag of (empty: those the schema records).
    pub groups: Vec<String>,
    /// Unfinished sagas unmoved for this long count as stuck.
    pub stuck_for: Duration,
    /// If set, required of every request.
    pub token: Option<String>,
}

impl Default for InspectOptions {
    fn default() -> Self {
        Self {
            dlq_topics: Vec::new(),
            groups: Vec::new(),
            stuck_for: Duration::from_secs(300),
            token: None,
        }
    }
}

#[derive(Clone)]
struct App {
    kafka: KafkaConfig,
    pool: PgPool,
    options: Arc<InspectOptions>,
}

/// The inspector's routes over `pool`'s schema and the broker of `kafka`.
pub fn router(kafka: KafkaConfig, pool: PgPool, options: InspectOptions) -> Router {
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
        .layer(middleware::from_fn_with_state(app.clone(), guard))
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
    axum::serve(listener, router(kafka, pool, options))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|e| AdminError::Store(format!("serving the inspector: {e}")))
}

const TOKEN_COOKIE: &str = "saga_admin_token";

/// The token check, and the refusal of a POST from another origin.
async fn guard(State(app): State<App>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    if request.method() == axum::http::Method::POST && !same_origin(headers) {
        return (
            StatusCode::FORBIDDEN,
            Html(pages::message(
                "Refused",
                "A replay must come from this inspector's own page.",
            )),
        )
            .into_response();
    }
    let Some(token) = app.options.token.as_deref() else {
        return next.run(request).await;
    };
    let from_query = request
        .uri()
        .query()
        .and_then(|q| {
            q.split('&')
                .find_map(|kv| kv.strip_prefix("token="))
                .map(str::to_owned)
        })
        .is_some_and(|t| t == token);
    let from_cookie = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().strip_prefix(&format!("{TOKEN_COOKIE}=")))
        .any(|t| t == token);
    let from_header = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| t == token);
    if !(from_query || from_cookie || from_header) {
        return (
            StatusCode::UNAUTHORIZED,
            Html(pages::message(
                "Token required",
                "This inspector requires SAGA_ADMIN_TOKEN: open it as /?token=… once.",
            )),
        )
            .into_response();
    }
    let mut response = next.run(request).await;
    if from_query
        && let Ok(cookie) = HeaderValue::from_str(&format!(
            "{TOKEN_COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/"
        ))
    {
        response.headers_mut().append(header::SET_COOKIE, cookie);
    }
    response
}

/// Whether a request's `Origin` (if the browser sent one) is the host it was sent to.
fn same_origin(headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return true;
    };
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    origin
        .split_once("://")
        .is_some_and(|(_, authority)| authority == host)
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

async fn dlq_topic(State(app): State<App>, Path(topic): Path<String>) -> Response {
    match crate::dlq::list(&app.kafka, &topic, &crate::dlq::DlqFilter::default()).await {
        Ok(letters) => Html(pages::dlq_topic(&topic, &letters)).into_response(),
        Err(e) => failure(&e),
    }
}

async fn dlq_letter(
    State(app): State<App>,
    Path((topic, partition, offset)): Path<(String, i32, i64)>,
) -> Response {
    match one_letter(&app, &topic, partition, offset).await {
        Ok(letter) => Html(pages::dlq_letter(&letter)).into_response(),
        Err(e) => failure(&e),
    }
}

async fn confirm_replay(
    State(app): State<App>,
    Path((topic, partition, offset)): Path<(String, i32, i64)>,
) -> Response {
    match one_letter(&app, &topic, partition, offset).await {
        Ok(letter) => Html(pages::confirm_replay(&letter)).into_response(),
        Err(e) => failure(&e),
    }
}

async fn replay(
    State(app): State<App>,
    Path((topic, partition, offset)): Path<(String, i32, i64)>,
) -> Response {
    let filter = crate::dlq::DlqFilter::at(partition, offset);
    match crate::dlq::replay(
        &app.kafka,
        &app.pool,
        &topic,
        &filter,
        &crate::dlq::ReplayOptions::default(),
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
