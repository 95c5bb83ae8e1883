//! An `Idempotency-Key` layer for HTTP entry points: a `tower` layer, usable with axum.
//!
//! - A new key runs the handler inside a transaction that also claims the key and stores the response; the
//!   handler takes that transaction from the [`IdempotentRequest`] extension (an axum extractor), so its
//!   writes, its outbox rows, the key and the stored response commit together.
//! - A retry with the same key gets the stored status and body back, marked `Idempotent-Replayed: true`,
//!   without running the handler.
//! - The same key with a different request (method, path or body) gets 422; a key whose first request is
//!   still running gets 409 with `Retry-After`.
//! - Keys are scoped per tenant (`Tenant-Id` header).
//! - A 5xx response, or a crash, rolls the transaction back: the key is free for the retry.
//!
//! Any non-5xx response is stored and replayed, 4xx included: a request that was invalid stays invalid.
//! The key is stored in the same idempotency store as saga steps, as step key `{key}:{operation}`.
//!
//! A handler emits the saga's first events with [`IdempotentRequest::emit`] (or `emit_to`), as a step does:
//! they are appended to the outbox in the request's transaction, just before it commits.

use std::sync::Arc;
use std::task::{Context, Poll};

use axum_core::extract::FromRequestParts;
use bytes::Bytes;
use futures::future::BoxFuture;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use sha2::{Digest, Sha256};
use sqlx::{PgConnection, PgPool};
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};
use tower_layer::Layer;
use tower_service::Service;
use tracing::Instrument;

use saga_core::StepOutcome;
use saga_core::TraceParent;
use saga_core::{Event, Lineage, OutboxMessage, SagaEvent, Topic};
use saga_core::{IdempotencyKey, StepName, TenantId};
use saga_runtime::store::idempotency::{KeyStatus, StoreError, TryClaim};
use saga_runtime::store::outbox;

use crate::step_tx::{Outcomes, StepTx};

/// The request header carrying the client's key (HTTP header names are case-insensitive).
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";
/// The request header naming the tenant.
pub const TENANT_HEADER: &str = "tenant-id";
/// The response header marking a replayed response.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Settings of the layer.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct IdempotencyConfig {
    /// What the route does; keys are stored as `{key}:{operation}`.
    pub operation: StepName,
    /// The largest request body accepted (bodies are buffered to fingerprint them).
    pub max_body_bytes: usize,
    /// Where the request's events are written: the service's outbox (a table outbox when not given).
    pub outbox: crate::Outbox,
    /// The response headers stored with the key and replayed to a retry; every other header (`Set-Cookie`,
    /// `Authorization`, a session's or a proxy's) is answered once and never stored.
    pub stored_headers: Vec<HeaderName>,
    /// The largest response body stored with a key. A handler's response beyond it commits and is answered
    /// as it is, but stored without its body: a retry gets its status and headers, a short body saying so,
    /// and [`BODY_OMITTED_HEADER`] with its size.
    pub max_stored_body_bytes: usize,
}

/// The response headers a layer stores by default: what describes the body and where it points.
pub const DEFAULT_STORED_HEADERS: [HeaderName; 7] = [
    header::CONTENT_TYPE,
    header::CONTENT_LANGUAGE,
    header::CONTENT_LOCATION,
    header::LOCATION,
    header::ETAG,
    header::LAST_MODIFIED,
    header::CACHE_CONTROL,
];

impl IdempotencyConfig {
    /// The defaults for routes doing `operation`: request bodies up to 1 MiB, a table outbox, the
    /// [`DEFAULT_STORED_HEADERS`] and stored response bodies up to 64 KiB.
    pub fn new(operation: StepName) -> Self {
        Self {
            operation,
            max_body_bytes: 1 << 20,
            outbox: crate::Outbox::table(),
            stored_headers: DEFAULT_STORED_HEADERS.to_vec(),
            max_stored_body_bytes: 64 << 10,
        }
    }
}

/// A function reading who made a request.
type CallerFn = dyn Fn(&http::request::Parts) -> Option<String> + Send + Sync;

/// Reads who made a request (see [`IdempotencyLayer::with_caller`]).
#[derive(Clone)]
struct CallerOf(Arc<CallerFn>);

impl std::fmt::Debug for CallerOf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CallerOf(..)")
    }
}

/// The `tower` layer. See the module documentation.
#[derive(Clone, Debug)]
pub struct IdempotencyLayer {
    pool: PgPool,
    config: Arc<IdempotencyConfig>,
    caller: Option<CallerOf>,
    #[cfg(feature = "redis")]
    fast_path: Option<crate::fast_path::FastPath>,
}

impl IdempotencyLayer {
    /// A layer for routes doing `operation`, with its keys in `pool`'s idempotency store.
    pub fn new(pool: PgPool, operation: StepName) -> Self {
        Self {
            pool,
            config: Arc::new(IdempotencyConfig::new(operation)),
            caller: None,
            #[cfg(feature = "redis")]
            fast_path: None,
        }
    }

    /// Replaces the settings.
    pub fn with_config(mut self, config: IdempotencyConfig) -> Self {
        self.config = Arc::new(config);
        self
    }

    /// Writes the requests' events to `outbox`: the service's
    /// ([`SagaServiceBuilder::outbox`](crate::SagaServiceBuilder::outbox)). A service in WAL mode must give it:
    /// without it, a table outbox is written.
    pub fn with_outbox(mut self, outbox: &crate::Outbox) -> Self {
        Arc::make_mut(&mut self.config).outbox = outbox.clone();
        self
    }

    /// Adds the authenticated caller to each request's fingerprint: `caller` reads it from the request
    /// (an extension the authentication in front of the layer set, say). A request with the same key,
    /// tenant and body from another caller then gets 422, never the first caller's stored response.
    ///
    /// Without it, whoever presents a stored key, tenant and body gets the stored response: the layer
    /// trusts `Tenant-Id` and the key as they come, so authenticate in front of it, and make the tenant
    /// the authenticated one.
    pub fn with_caller(
        mut self,
        caller: impl Fn(&http::request::Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.caller = Some(CallerOf(Arc::new(caller)));
        self
    }

    /// Puts the Redis fast path in front of the store (feature `redis`): an in-flight lock taken before
    /// any database connection, and a replay cache of completed responses. See [`crate::fast_path`].
    #[cfg(feature = "redis")]
    pub fn with_fast_path(mut self, fast_path: Option<crate::fast_path::FastPath>) -> Self {
        self.fast_path = fast_path;
        self
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            pool: self.pool.clone(),
            config: self.config.clone(),
            caller: self.caller.clone(),
            #[cfg(feature = "redis")]
            fast_path: self.fast_path.clone(),
        }
    }
}

/// The service the layer produces.
#[derive(Clone, Debug)]
pub struct Idempotency<S> {
    inner: S,
    pool: PgPool,
    config: Arc<IdempotencyConfig>,
    caller: Option<CallerOf>,
    #[cfg(feature = "redis")]
    fast_path: Option<crate::fast_path::FastPath>,
}

struct Shared {
    /// The client's key, the tenant and the trace context of the events the request emits.
    lineage: Lineage,
    operation: StepName,
    tx: Mutex<Option<StepTx<'static>>>,
    emitted: std::sync::Mutex<Vec<OutboxMessage>>,
}

impl std::fmt::Debug for IdempotentRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentRequest")
            .field("key", self.0.lineage.idempotency_key())
            .field("operation", &self.0.operation)
            .field("tenant", self.0.lineage.tenant())
            .finish_non_exhaustive()
    }
}

/// The request's open transaction, borrowed by a handler (see [`IdempotentRequest::transaction`]): it
/// dereferences to the connection to write with.
pub struct RequestTransaction<'a>(MappedMutexGuard<'a, PgConnection>);

impl std::ops::Deref for RequestTransaction<'_> {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.0
    }
}

impl std::ops::DerefMut for RequestTransaction<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.0
    }
}

impl std::fmt::Debug for RequestTransaction<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RequestTransaction")
    }
}

/// The claimed request, as the handler sees it: the client's key, the tenant, and the transaction the
/// handler must write in. An axum extractor; rejects with 500 where the layer is not installed.
#[derive(Clone)]
pub struct IdempotentRequest(Arc<Shared>);

impl IdempotentRequest {
    /// The client's idempotency key.
    pub fn key(&self) -> &IdempotencyKey {
        self.0.lineage.idempotency_key()
    }

    /// The tenant.
    pub fn tenant(&self) -> &TenantId {
        self.0.lineage.tenant()
    }

    /// The key to hand to a system outside the database that this request calls (see
    /// [`saga_core::ExternalKey`]): unique across tenants, unlike the client's key.
    pub fn external_key(&self) -> saga_core::ExternalKey {
        self.key()
            .step_key(&self.0.operation)
            .external(self.tenant())
    }

    /// The lineage of the saga this request starts: events it emits carry the client's key as their
    /// `idempotency-key`, and continue the request's trace (as children of the request's span, when it is
    /// traced with OpenTelemetry).
    pub fn lineage(&self) -> Lineage {
        self.0.lineage.clone()
    }

    /// The open transaction, to write the request's business rows in. Hold it only while writing; do not
    /// keep it past the handler.
    pub async fn transaction(&self) -> RequestTransaction<'_> {
        RequestTransaction(MutexGuard::map(self.0.tx.lock().await, |tx| {
            tx.as_mut()
                .expect("the transaction is open until the handler returns")
                .conn()
        }))
    }

    /// Emits `event` to `topic`, keyed by `partition_key`: an event of the saga this request starts (it
    /// carries the client's key, the tenant and the request's trace). It is written to the outbox in the
    /// request's transaction if the response is not a 5xx, and discarded with everything else otherwise.
    pub fn emit<E: SagaEvent>(
        &self,
        topic: &Topic<E>,
        partition_key: impl Into<String>,
        event: &E,
    ) -> Result<(), serde_json::Error> {
        self.emit_event(Event::of(topic, partition_key, event)?);
        Ok(())
    }

    /// Emits an event built at run time (see [`Event::new`]); prefer [`IdempotentRequest::emit`].
    pub fn emit_event(&self, event: Event) {
        let row = OutboxMessage::from_event(event, &self.0.lineage, self.0.operation.as_str());
        self.0
            .emitted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(row);
    }

    fn take_emitted(&self) -> Vec<OutboxMessage> {
        std::mem::take(
            &mut *self
                .0
                .emitted
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    async fn take(&self) -> Option<StepTx<'static>> {
        self.0.tx.lock().await.take()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotentRequest {
    type Rejection = (StatusCode, &'static str);

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Self>().cloned().ok_or((
            StatusCode::INTERNAL_SERVER_ERROR,
            "IdempotencyLayer is not installed on this route",
        ))
    }
}

/// The response header on a replay whose stored response kept no body: the body's size, in bytes.
pub const BODY_OMITTED_HEADER: &str = "idempotent-body-omitted";

/// A response as stored with its key.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct StoredResponse {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
    /// The size of a body larger than the layer stores: kept without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    omitted: Option<usize>,
}

impl StoredResponse {
    /// The response to store: its status, the `stored` headers it has, and its body (UTF-8).
    /// The response to store: its status, the `stored` headers it has, and its body (UTF-8), or, beyond
    /// `max_body` bytes, its size alone.
    fn capture(
        status: StatusCode,
        headers: &HeaderMap,
        stored: &[HeaderName],
        body: &[u8],
        max_body: usize,
    ) -> Option<Self> {
        let (body, omitted) = if body.len() > max_body {
            (String::new(), Some(body.len()))
        } else {
            (String::from_utf8(body.to_vec()).ok()?, None)
        };
        let headers = headers
            .iter()
            .filter(|(name, _)| stored.contains(name))
            .filter_map(|(name, value)| Some((name.to_string(), value.to_str().ok()?.to_owned())))
            .collect();
        Some(Self {
            status: status.as_u16(),
            headers,
            body,
            omitted,
        })
    }

    /// The stored response, as a retry gets it: only its `stored` headers (a response stored by an
    /// earlier version may hold others), and for one stored without its body, a short one saying so.
    fn replay(self, stored: &[HeaderName]) -> Response<Full<Bytes>> {
        let body = match self.omitted {
            Some(size) => serde_json::json!({
                "notice": format!(
                    "the request took effect; its response ({size} bytes) was larger than the layer stores \
                     for a retry"
                )
            })
            .to_string(),
            None => self.body,
        };
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() =
            StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        for (name, value) in self.headers {
            if let (Ok(name), Ok(value)) = (
                HeaderName::try_from(name.as_str()),
                HeaderValue::try_from(value.as_str()),
            ) && stored.contains(&name)
                // A body left out takes the headers that describe it along (its ETag, its caching).
                && (self.omitted.is_none() || name == header::LOCATION)
            {
                response.headers_mut().append(name, value);
            }
        }
        if let Some(size) = self.omitted {
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            response
                .headers_mut()
                .insert(BODY_OMITTED_HEADER, HeaderValue::from(size));
        }
        response
            .headers_mut()
            .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
        response
    }
}

fn problem(status: StatusCode, message: &str) -> Response<Full<Bytes>> {
    let body = serde_json::json!({ "error": message }).to_string();
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// 409 for a key whose first request is still running.
fn in_progress() -> Response<Full<Bytes>> {
    let mut response = problem(
        StatusCode::CONFLICT,
        "a request with this Idempotency-Key is in progress",
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// The fingerprint of a request: its method, path and query, and body, and its caller where the layer
/// knows callers (see [`IdempotencyLayer::with_caller`]).
fn fingerprint(
    method: &http::Method,
    uri: &http::Uri,
    body: &[u8],
    caller: Option<Option<&str>>,
) -> Vec<u8> {
    let mut hash = Sha256::new();
    hash.update(method.as_str().as_bytes());
    hash.update([0]);
    hash.update(uri.path_and_query().map_or("", |p| p.as_str()).as_bytes());
    hash.update([0]);
    hash.update(body);
    // Appended only where callers are known: fingerprints stored without them stay valid.
    if let Some(caller) = caller {
        hash.update([0]);
        match caller {
            None => hash.update([0]),
            Some(who) => {
                hash.update([1]);
                hash.update(who.as_bytes());
            }
        }
    }
    hash.finalize().to_vec()
}

impl<S, B, RB> Service<Request<B>> for Idempotency<S>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    B: http_body::Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = Response<Full<Bytes>>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The clone that was polled ready serves this request; a fresh clone waits for the next one.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let pool = self.pool.clone();
        let config = self.config.clone();
        let caller = self.caller.clone();
        #[cfg(feature = "redis")]
        let fast_path = self.fast_path.clone();
        #[cfg(not(feature = "redis"))]
        let fast_path = None;
        let route = request
            .extensions()
            .get::<axum::extract::MatchedPath>()
            .map(axum::extract::MatchedPath::as_str);
        let span = saga_runtime::trace::http_span(request.method(), route, request.headers());
        Box::pin(
            async move {
                let answered = handle(inner, pool, config, caller, fast_path, request).await;
                if let Ok(response) = &answered {
                    tracing::Span::current()
                        .record("http.response.status_code", response.status().as_u16());
                }
                answered
            }
            .instrument(span),
        )
    }
}

#[cfg(feature = "redis")]
type FastPath = crate::fast_path::FastPath;
/// Without the `redis` feature there is no fast path.
#[cfg(not(feature = "redis"))]
enum FastPath {}

async fn handle<S, B, RB>(
    inner: S,
    pool: PgPool,
    config: Arc<IdempotencyConfig>,
    caller: Option<CallerOf>,
    fast_path: Option<FastPath>,
    request: Request<B>,
) -> Result<Response<Full<Bytes>>, S::Error>
where
    S: Service<Request<B>, Response = Response<RB>>,
    B: http_body::Body + From<Bytes>,
    B::Error: Into<BoxError>,
    RB: http_body::Body<Data = Bytes>,
    RB::Error: Into<BoxError>,
{
    let (parts, body) = request.into_parts();
    let (key, tenant, traceparent) = match read_headers(&parts.headers) {
        Ok(read) => read,
        Err((status, message)) => return Ok(problem(status, &message)),
    };
    let bytes = match read_body(body, config.max_body_bytes).await {
        Ok(bytes) => bytes,
        Err((status, message)) => return Ok(problem(status, &message)),
    };
    let who = caller.as_ref().map(|c| (c.0)(&parts));
    let hash = fingerprint(
        &parts.method,
        &parts.uri,
        &bytes,
        who.as_ref().map(Option::as_deref),
    );
    let step_key = key.step_key(&config.operation);
    let span = tracing::Span::current();
    span.record("saga.step_key", step_key.as_str());
    let request = Claimed {
        lineage: Lineage::root_traced(key, tenant, traceparent)
            .in_span(saga_runtime::trace::span_context(&span)),
        step_key,
        hash,
        request: Request::from_parts(parts, B::from(bytes)),
    };
    match fast_path {
        None => Ok(in_postgres(inner, pool, config, request).await?.0),
        #[cfg(feature = "redis")]
        Some(fast_path) => fast::handle(inner, pool, config, &fast_path, request).await,
        #[cfg(not(feature = "redis"))]
        Some(never) => match never {},
    }
}

/// A request the layer answers itself, before any database work: the status and the problem's detail.
type Refusal = (StatusCode, String);

/// What the layer reads from a request's headers: the client's key (required), the tenant (`Tenant-Id`,
/// else the default) and the caller's trace context (ignored when malformed, as W3C says).
fn read_headers(
    headers: &HeaderMap,
) -> Result<(IdempotencyKey, TenantId, Option<TraceParent>), Refusal> {
    let bad = |message: String| (StatusCode::BAD_REQUEST, message);
    let key = match headers.get(IDEMPOTENCY_KEY_HEADER).map(HeaderValue::to_str) {
        None => return Err(bad("missing Idempotency-Key header".into())),
        Some(Err(_)) => return Err(bad("Idempotency-Key is not visible ASCII".into())),
        Some(Ok(value)) => {
            IdempotencyKey::new(value).map_err(|e| bad(format!("invalid Idempotency-Key: {e}")))?
        }
    };
    let tenant = match headers.get(TENANT_HEADER).map(HeaderValue::to_str) {
        None => TenantId::default(),
        Some(Ok(value)) => {
            TenantId::new(value).map_err(|e| bad(format!("invalid Tenant-Id: {e}")))?
        }
        Some(Err(_)) => return Err(bad("invalid Tenant-Id".into())),
    };
    let traceparent = headers
        .get(saga_core::headers::names::TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse);
    Ok((key, tenant, traceparent))
}

/// The request's body, at most `max` bytes.
async fn read_body<B>(body: B, max: usize) -> Result<Bytes, Refusal>
where
    B: http_body::Body,
    B::Error: Into<BoxError>,
{
    Limited::new(body, max)
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes)
        .map_err(|_| {
            (
                StatusCode::PAYLOAD_TOO_LARGE,
                "request body too large or unreadable".into(),
            )
        })
}

/// The layer's reading of a request, for the fuzz targets (`fuzz/`): its headers, then its body (at most
/// `max_body` bytes), then the fingerprint the layer would store with the key; or the refusal it would
/// answer with. Not part of the API.
#[doc(hidden)]
pub fn read_request(
    method: &http::Method,
    uri: &http::Uri,
    headers: &HeaderMap,
    body: &[u8],
    max_body: usize,
) -> Result<(saga_core::StepKey, Vec<u8>), (u16, String)> {
    let refused = |(status, message): Refusal| (status.as_u16(), message);
    let (key, _, _) = read_headers(headers).map_err(refused)?;
    let read = read_body(Full::new(Bytes::copy_from_slice(body)), max_body);
    // A body in memory is read at the first poll; one that were not would be refused as unreadable.
    let bytes = futures::FutureExt::now_or_never(read)
        .unwrap_or_else(|| {
            Err((
                StatusCode::BAD_REQUEST,
                "request body not readable at once".into(),
            ))
        })
        .map_err(refused)?;
    let step = StepName::from_static("fuzzed");
    Ok((key.step_key(&step), fingerprint(method, uri, &bytes, None)))
}

/// A request whose key, tenant and fingerprint are read.
struct Claimed<B> {
    /// The client's key, the tenant, and the trace context of the events the request emits (the
    /// request's span when traced with OpenTelemetry, else a child of the caller's `traceparent`).
    lineage: Lineage,
    step_key: saga_core::StepKey,
    hash: Vec<u8>,
    request: Request<B>,
}

/// The request's response, and the stored response PostgreSQL holds for its key once it is known to be
/// committed (just committed, or replayed): what the fast path may cache.
type Answered = (Response<Full<Bytes>>, Option<serde_json::Value>);

/// The request served with PostgreSQL alone: the claim inside the request's step transaction decides.
async fn in_postgres<S, B, RB>(
    inner: S,
    pool: PgPool,
    config: Arc<IdempotencyConfig>,
    claimed: Claimed<B>,
) -> Result<Answered, S::Error>
where
    S: Service<Request<B>, Response = Response<RB>>,
    RB: http_body::Body<Data = Bytes>,
    RB::Error: Into<BoxError>,
{
    let Claimed {
        lineage,
        step_key,
        hash,
        mut request,
    } = claimed;
    let tx = match open_and_claim(&pool, &config, lineage.tenant(), &step_key, &hash).await {
        Ok(tx) => tx,
        Err(answered) => return Ok(answered),
    };
    let handle = IdempotentRequest(Arc::new(Shared {
        lineage,
        operation: config.operation.clone(),
        emitted: std::sync::Mutex::default(),
        tx: Mutex::new(Some(tx)),
    }));
    request.extensions_mut().insert(handle.clone());
    let (parts, body, tx) = match call_handler(inner, request, &handle).await? {
        Ok(done) => done,
        Err(answered) => return Ok(answered),
    };
    Ok(store_and_commit(tx, parts, body, &handle, &config, &step_key).await)
}

/// A 503 for what the database or the outbox could not do now (said in the log).
fn unavailable(what: &str, e: &dyn std::fmt::Display) -> Response<Full<Bytes>> {
    tracing::error!(error = %e, "{what}");
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "idempotency store unavailable",
    )
}

/// Opens the request's step transaction and claims its key: the transaction, or the answer when the
/// key is another request's (422), in progress (409), or done (its stored response, replayed).
async fn open_and_claim(
    pool: &PgPool,
    config: &IdempotencyConfig,
    tenant: &TenantId,
    step_key: &saga_core::StepKey,
    hash: &[u8],
) -> Result<StepTx<'static>, Answered> {
    // An outbox that may not be written (its WAL slot lost): the request does not run at all.
    let mut tx = StepTx::begin(config.outbox.runtime(), pool.begin())
        .await
        .map_err(|e| {
            (
                unavailable("the outbox is not writable, or no transaction began", &e),
                None,
            )
        })?;
    let mut replayed = None;
    let early = match tx.claim_request(tenant, step_key, hash).await {
        Err(e) => unavailable("claiming an idempotency key", &e),
        Ok(TryClaim::Claimed) => return Ok(tx),
        Ok(TryClaim::Busy) => in_progress(),
        Ok(TryClaim::Existing { request_hash, .. }) if request_hash.as_deref() != Some(hash) => {
            problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Idempotency-Key was used for a different request",
            )
        }
        Ok(TryClaim::Existing { stored, .. }) => {
            match (stored.status == KeyStatus::Completed)
                .then_some(stored.outcome)
                .flatten()
                .and_then(|value| {
                    let response = serde_json::from_value::<StoredResponse>(value.clone()).ok()?;
                    Some((response, value))
                }) {
                Some((response, value)) => {
                    replayed = Some(value);
                    response.replay(&config.stored_headers)
                }
                None => problem(
                    StatusCode::CONFLICT,
                    "the key's stored response cannot be replayed",
                ),
            }
        }
    };
    roll_back(tx).await;
    Err((early, replayed))
}

/// Runs the handler with `request` (which carries `handle`): its response's parts and body, and the
/// transaction it gave back; or the answer when it kept the transaction, its body failed or it answered
/// 5xx (rolled back: the key is free for the retry).
async fn call_handler<S, B, RB>(
    mut inner: S,
    request: Request<B>,
    handle: &IdempotentRequest,
) -> Result<Result<(http::response::Parts, Bytes, StepTx<'static>), Answered>, S::Error>
where
    S: Service<Request<B>, Response = Response<RB>>,
    RB: http_body::Body<Data = Bytes>,
    RB::Error: Into<BoxError>,
{
    // Every path below that does not commit rolls the transaction back before answering.
    let response = match inner.call(request).await {
        Ok(response) => response,
        Err(e) => {
            if let Some(tx) = handle.take().await {
                roll_back(tx).await;
            }
            return Err(e);
        }
    };
    let Some(tx) = handle.take().await else {
        return Ok(Err((
            problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the handler kept the transaction",
            ),
            None,
        )));
    };
    let (parts, body) = response.into_parts();
    // The error is dropped before the next await: it need not be `Send`.
    let body = body
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes)
        .ok();
    let Some(body) = body else {
        roll_back(tx).await;
        return Ok(Err((
            problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the handler's response body failed",
            ),
            None,
        )));
    };
    if parts.status.is_server_error() {
        // Rolled back: the key is free for the retry.
        roll_back(tx).await;
        return Ok(Err((Response::from_parts(parts, Full::new(body)), None)));
    }
    Ok(Ok((parts, body, tx)))
}

/// Stores the response as the key's outcome with the events the handler emitted, and commits: the
/// response, with what a replay answers; or what could not be stored, rolled back.
async fn store_and_commit(
    mut tx: StepTx<'static>,
    parts: http::response::Parts,
    body: Bytes,
    handle: &IdempotentRequest,
    config: &IdempotencyConfig,
    step_key: &saga_core::StepKey,
) -> Answered {
    if body.len() > config.max_stored_body_bytes {
        tracing::warn!(
            bytes = body.len(),
            max = config.max_stored_body_bytes,
            "the handler's response is larger than the layer stores: a retry gets its status and headers \
             without it"
        );
    }
    let Some(stored) = StoredResponse::capture(
        parts.status,
        &parts.headers,
        &config.stored_headers,
        &body,
        config.max_stored_body_bytes,
    ) else {
        roll_back(tx).await;
        return (
            problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the handler's response is not UTF-8 and cannot be stored",
            ),
            None,
        );
    };
    let stored = serde_json::to_value(&stored).ok();
    let outcome = StepOutcome::Completed {
        result: stored.clone(),
    };
    let emitted = handle.take_emitted();
    let records = [(handle.tenant(), step_key, &outcome)];
    if let Err(e) = tx.record(Outcomes::Keys(&records), &emitted).await {
        roll_back(tx).await;
        let refused = match &e {
            StoreError::Outbox(outbox::OutboxError::TooLarge { .. }) => {
                Some("the request's events are larger than the outbox accepts")
            }
            StoreError::Outbox(outbox::OutboxError::Refused { .. }) => {
                Some("the request's events hold what the outbox cannot store (a NUL character)")
            }
            _ => None,
        };
        if let Some(refused) = refused {
            tracing::error!(error = %e, "the request's events are refused");
            return (problem(StatusCode::INTERNAL_SERVER_ERROR, refused), None);
        }
        return (unavailable("storing the response and its events", &e), None);
    }
    if let Err(e) = tx.commit_request().await {
        return (unavailable("committing", &e), None);
    }
    (Response::from_parts(parts, Full::new(body)), stored)
}

/// Rolls `tx` back before the response goes out. Dropping it would also roll it back, but only once the
/// pool takes the connection back, in a task of its own: until then the transaction keeps the key's
/// advisory lock, and the client's next retry, arriving on another connection, would get a 409.
async fn roll_back(tx: StepTx<'static>) {
    if tx.roll_back().await.is_none() {
        tracing::warn!("rolling back an idempotent request's transaction failed");
    }
}

/// The Redis fast path in front of [`in_postgres`] (feature `redis`).
#[cfg(feature = "redis")]
mod fast {
    use super::{
        Answered, BoxError, Bytes, Claimed, Full, IdempotencyConfig, PgPool, Request, Response,
        Service, StoredResponse, in_postgres, in_progress,
    };
    use crate::fast_path::{CachedResponse, FastPath, InFlight, LockAnswer};
    use std::sync::Arc;

    /// Releases the in-flight lock however the request ends, its future dropped included (a client that
    /// hung up must not leave its key at 409 until the lock's TTL).
    struct Unlock(Option<(FastPath, InFlight)>);

    impl Drop for Unlock {
        fn drop(&mut self) {
            if let Some((fast, lock)) = self.0.take()
                && let Ok(runtime) = tokio::runtime::Handle::try_current()
            {
                runtime.spawn(async move { fast.unlock(lock).await });
            }
        }
    }

    /// Answers from Redis what it can (a cached response of the same request; 409 while another request
    /// holds the key's in-flight lock), and sends the rest to PostgreSQL, caching what it committed.
    pub(super) async fn handle<S, B, RB>(
        inner: S,
        pool: PgPool,
        config: Arc<IdempotencyConfig>,
        fast: &FastPath,
        claimed: Claimed<B>,
    ) -> Result<Response<Full<Bytes>>, S::Error>
    where
        S: Service<Request<B>, Response = Response<RB>>,
        RB: http_body::Body<Data = Bytes>,
        RB::Error: Into<BoxError>,
    {
        let fingerprint: String = claimed.hash.iter().map(|b| format!("{b:02x}")).collect();
        if let Some(cached) = fast
            .cached_response(claimed.lineage.tenant(), &claimed.step_key)
            .await
            && cached.fingerprint == fingerprint
            && let Ok(stored) = serde_json::from_value::<StoredResponse>(cached.response)
        {
            fast.answered("replay", 1);
            return Ok(stored.replay(&config.stored_headers));
        }
        // A cached entry for another request, or one that does not decode: PostgreSQL decides.
        let (tenant, step_key) = (claimed.lineage.tenant().clone(), claimed.step_key.clone());
        let mut lock = match fast.lock(&tenant, &step_key).await {
            (LockAnswer::Held, _) => return Ok(in_progress()),
            (_, lock) => Unlock(lock.map(|l| (fast.clone(), l))),
        };
        let answered: Answered = in_postgres(inner, pool, config, claimed).await?;
        let (response, stored) = answered;
        if let Some(response) = stored {
            // After the commit (or a replay from PostgreSQL), before the lock goes: a retry finds either.
            fast.cache_response(
                &tenant,
                &step_key,
                &CachedResponse {
                    fingerprint,
                    response,
                },
            )
            .await;
        }
        if let Some((fast, held)) = lock.0.take() {
            fast.unlock(held).await;
        }
        Ok(response)
    }
}
