//! The inspector page: server-rendered HTML (no JavaScript), reading only through this crate's library, as
//! the `saga` command does, and the JSON API under it (see `api`).
//!
//! - `/`: sagas by status, stuck sagas, failure groups, dead letters by topic and reason, recent
//!   operations, the outbox's backlog, consumer lag, and a form to find a saga by its key.
//! - `/sagas/{id}`: a saga's timeline of transitions, its keys, its compensations, and a retry button for
//!   an unfinished one (behind a confirmation).
//! - `/groups`, `/groups/{id}`: failure groups and one group's letters, with replay and discard buttons
//!   behind a preview of what they would do.
//! - `/operations`, `/operations/{id}`: bulk operations, how far they got, cancel and undo buttons.
//! - `/trace?key=…`: one saga across every service schema, one lane per service.
//! - `/dlq/{topic}`: a dead-letter topic's letters; `/dlq/{topic}/{partition}/{offset}` one of them, with
//!   a replay button behind a confirmation.
//! - `/metrics`: the numbers to alert on, in Prometheus' text format.
//! - `/api/…`: every view and action as JSON; the page's forms post there.
//!
//! A read-only inspector shows no buttons and refuses every POST. Who may drive it is checked by the
//! `security` module: the `Host` a request names, a token where tokens are configured, and for a POST its
//! origin and the session's CSRF token (or a bearer token, which a browser never sends by itself).

mod api;
mod metrics;
mod pages;
mod security;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Extension;
use axum::Router;
use axum::extract::{Path, State};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use saga_config::KafkaConfig;
use sqlx::PgPool;

use crate::error::AdminError;
pub use security::NamedToken;
use security::{Caller, Guard};

/// What the inspector shows and who may drive it: the settings `saga inspect` flattens into its command
/// line (each declared once, here), and what [`serve`] takes. The tokens come from the environment
/// (`SAGA_ADMIN_TOKEN`, `SAGA_ADMIN_TOKENS`: kept off the command line), set by the command.
#[derive(Debug, Clone, clap::Args)]
#[non_exhaustive]
pub struct InspectOptions {
    /// Dead-letter topics to show (default: the broker's topics ending in `.dlq`).
    #[arg(long = "dlq-topic")]
    pub dlq_topics: Vec<String>,
    /// Consumer groups to show the lag of (default: those the schema records).
    #[arg(long = "group")]
    pub groups: Vec<String>,
    /// Unfinished sagas unmoved for this long count as stuck.
    #[arg(long = "stuck-for", default_value = "5m", value_parser = stuck_for)]
    pub stuck_for: Duration,
    /// The tokens, by name, one of which every request must present; none: no token asked (then the
    /// inspector must listen on localhost only, see the `saga inspect` command).
    #[arg(skip)]
    pub tokens: Vec<NamedToken>,
    /// A name besides the listening address and localhost that requests may give as Host (the name a
    /// proxy in front serves the page under), with or without a port; repeatable. Needs a token (or
    /// --insecure-no-token): the page is served to others.
    #[arg(long = "public-name")]
    pub public_names: Vec<String>,
    /// No replay buttons; every POST refused.
    #[arg(long)]
    pub read_only: bool,
    /// Mark cookies Secure: the page is served over TLS by a proxy in front.
    #[arg(long)]
    pub secure_cookies: bool,
}

/// `--stuck-for`: a duration with its unit (`90s`, `15m`, `2h`).
fn stuck_for(text: &str) -> Result<Duration, String> {
    crate::duration::parse(text).map_err(|e| e.to_string())
}

impl Default for InspectOptions {
    /// The declared defaults, no token.
    fn default() -> Self {
        saga_runtime::settings::defaults()
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
    let pages = Router::new()
        .route("/", get(api::overview))
        .route("/sagas/{id}", get(api::saga))
        .route(
            "/sagas/{id}/retry",
            get(confirm_retry).post(api::saga_retry),
        )
        .route("/groups", get(api::failure_groups))
        .route("/groups/{id}", get(api::failure_group))
        .route("/groups/{id}/plan", get(api::group_plan))
        .route("/operations", get(api::operations_list))
        .route("/operations/{id}", get(api::operation))
        .route("/operations/{id}/undo", get(api::undo_plan))
        .route("/trace", get(api::trace))
        .route("/dlq/{topic}", get(api::dlq_topic))
        .route("/dlq/{topic}/{partition}/{offset}", get(api::dlq_letter))
        .route(
            "/dlq/{topic}/{partition}/{offset}/replay",
            get(confirm_replay).post(api::replay_letter),
        )
        .route(
            "/keys/{group}/{key_hex}/release",
            get(confirm_release_key).post(api::release_key),
        )
        .route("/metrics", get(metrics::metrics));
    let api = Router::new()
        .route("/overview", get(api::overview))
        .route("/sagas/{id}", get(api::saga))
        .route("/sagas/{id}/retry", post(api::saga_retry))
        .route("/groups", get(api::failure_groups))
        .route("/groups/{id}", get(api::failure_group))
        .route("/groups/{id}/plan", get(api::group_plan))
        .route("/groups/{id}/replay", post(api::group_replay))
        .route("/groups/{id}/discard", post(api::group_discard))
        .route("/operations", get(api::operations_list))
        .route("/operations/{id}", get(api::operation))
        .route("/operations/{id}/cancel", post(api::operation_cancel))
        .route("/operations/{id}/undo", post(api::operation_undo))
        .route("/operations/{id}/resume", post(api::operation_resume))
        .route("/keys/{group}/{key_hex}/release", post(api::release_key))
        .route("/trace", get(api::trace))
        .route("/dlq/{topic}", get(api::dlq_topic))
        .route("/dlq/{topic}/{partition}/{offset}", get(api::dlq_letter))
        .route(
            "/dlq/{topic}/{partition}/{offset}/replay",
            post(api::replay_letter),
        );
    pages
        .layer(axum::middleware::map_request(as_page))
        .nest("/api", api)
        .layer(axum::middleware::from_fn(read_as_indexed))
        .layer(axum::middleware::from_fn(act_to_the_end))
        .layer(axum::middleware::from_fn_with_state(guard, security::guard))
        .with_state(app)
}

/// Serves the inspector on `listener` (a bound standard listener: no runtime's type in the API) until
/// `shutdown` resolves. Call it within a tokio runtime.
pub async fn serve(
    listener: std::net::TcpListener,
    kafka: KafkaConfig,
    pool: PgPool,
    options: InspectOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AdminError> {
    listener.set_nonblocking(true).map_err(AdminError::Serve)?;
    let listener = tokio::net::TcpListener::from_std(listener).map_err(AdminError::Serve)?;
    let bound = listener.local_addr().map_err(AdminError::Serve)?;
    axum::serve(listener, router(kafka, pool, options, bound))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(AdminError::Serve)
}

/// An action (a POST) runs to its end even if its client goes away meanwhile (a closed tab, a proxy's
/// timeout): half a replay, or an audit log entry left `running`, is worse than an answer nobody reads.
async fn act_to_the_end(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    if request.method() != axum::http::Method::POST {
        return next.run(request).await;
    }
    match tokio::spawn(next.run(request)).await {
        Ok(response) => response,
        Err(e) => api::failure(
            &AdminError::Internal(format!("the action's task ended: {e}")),
            false,
        ),
    }
}

/// The most bytes of a page the stale-index banner is put into.
const BANNER_PAGE_BYTES: usize = 64 << 20;

/// A page (GET) shows the dead-letter index as it is where it cannot be brought up to date, and says so in
/// a banner at its top (`#index-stale`). The API reads it so only when asked (`?as_indexed=1`), and says
/// so in a `saga-index-stale` header; else it fails (503) saying how stale the index is, as the command
/// does: a script is not handed a stale answer it did not ask for. Actions (POSTs) act only on an index
/// brought up to date, and `/metrics` counts no letter of a stale index (it says the failure as
/// `saga_inspector_scrape_errors`).
async fn read_as_indexed(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let read = matches!(
        *request.method(),
        axum::http::Method::GET | axum::http::Method::HEAD
    );
    let path = request.uri().path();
    let api = path.starts_with("/api/");
    let asked = request.uri().query().is_some_and(|q| {
        q.split('&')
            .any(|p| p == "as_indexed=1" || p == "as_indexed=true")
    });
    if !read || path == "/metrics" || (api && !asked) {
        return next.run(request).await;
    }
    let (response, stale) = crate::freshness::as_indexed(next.run(request)).await;
    if stale.is_empty() {
        return response;
    }
    let said: Vec<String> = stale.iter().map(ToString::to_string).collect();
    let html = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("text/html"));
    let (mut parts, body) = response.into_parts();
    if !html {
        // Bounded: a proxy in front refuses answers with very long headers.
        let header = saga_runtime::cli::printable(&said.join("; "), false)
            .chars()
            .filter(char::is_ascii)
            .take(2_000)
            .collect::<String>();
        if let Ok(value) = axum::http::HeaderValue::from_str(&header) {
            parts.headers.insert("saga-index-stale", value);
        }
        return Response::from_parts(parts, body);
    }
    let Ok(bytes) = axum::body::to_bytes(body, BANNER_PAGE_BYTES).await else {
        return api::failure(
            &AdminError::Internal(
                "the page could not be read back to put its banner in".to_owned(),
            ),
            true,
        );
    };
    let page = String::from_utf8_lossy(&bytes).replacen(
        "</nav>",
        &format!("</nav>{}", pages::stale_banner(&said)),
        1,
    );
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    Response::from_parts(parts, axum::body::Body::from(page))
}

/// Page routes answer pages: a request that names no `Accept` (a script, a test) gets HTML there too. (The
/// same handlers answer JSON under `/api`.)
async fn as_page(mut request: axum::extract::Request) -> axum::extract::Request {
    if !request.headers().contains_key(axum::http::header::ACCEPT) {
        request.headers_mut().insert(
            axum::http::header::ACCEPT,
            axum::http::HeaderValue::from_static("text/html"),
        );
    }
    request
}

/// The confirmation before replaying one letter.
async fn confirm_replay(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    Path((topic, partition, offset)): Path<(String, i32, i64)>,
) -> Response {
    if caller.read_only {
        return api::failure(&AdminError::bad_input("this inspector is read-only"), true);
    }
    let letter = match api::one_letter(&app, &topic, partition, offset).await {
        Ok(letter) => letter,
        Err(e) => return api::failure(&e, true),
    };
    match crate::dlq::owner_of(&app.pool, &topic).await {
        Ok(owner) => Html(pages::confirm_replay(&letter, &owner, &caller)).into_response(),
        Err(e) => api::failure(&e, true),
    }
}

/// The confirmation before releasing a held key by hand.
async fn confirm_release_key(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    Path((group, key_hex)): Path<(String, String)>,
) -> Response {
    if caller.read_only {
        return api::failure(&AdminError::bad_input("this inspector is read-only"), true);
    }
    let held = match api::key_of_hex(&key_hex) {
        Ok(key) => crate::holds::one(&app.pool, &group, &key).await,
        Err(e) => Err(e),
    };
    match held {
        Ok(Some(held)) => Html(pages::confirm_release_key(&held, &caller)).into_response(),
        Ok(None) => api::failure(
            &AdminError::bad_input("this key is not held (any more): see the overview"),
            true,
        ),
        Err(e) => api::failure(&e, true),
    }
}

/// The confirmation before retrying a saga.
async fn confirm_retry(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Response {
    if caller.read_only {
        return api::failure(&AdminError::bad_input("this inspector is read-only"), true);
    }
    match crate::sagas::show(&app.pool, &id).await {
        Ok(detail) => Html(pages::confirm_retry(&detail, &caller)).into_response(),
        Err(e) => api::failure(&e, true),
    }
}
