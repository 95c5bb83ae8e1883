//! The Idempotency-Key layer against a real PostgreSQL, through an axum router.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use http_body_util::BodyExt;
use saga_consumer::StepName;
use saga_consumer::http::{
    BODY_OMITTED_HEADER, IdempotencyLayer, IdempotentRequest, REPLAYED_HEADER,
};
use saga_test_support::TestDb;
use tower::ServiceExt;

mod things;

use things::{AppState, Thing, create_thing, create_things_table, insert_thing};

/// Writes a thing and answers with a body that is not UTF-8, which the layer cannot store: a 500.
async fn create_thing_in_binary(
    request: IdempotentRequest,
    axum::Json(thing): axum::Json<Thing>,
) -> axum::response::Response {
    insert_thing(&request, &thing).await;
    (StatusCode::OK, vec![0xff_u8, 0xfe, 0xfd]).into_response()
}

/// Writes a thing and answers with a session cookie and a token header beside what describes the body.
async fn create_thing_with_secrets(
    request: IdempotentRequest,
    axum::Json(thing): axum::Json<Thing>,
) -> axum::response::Response {
    insert_thing(&request, &thing).await;
    (
        StatusCode::CREATED,
        [
            ("set-cookie", "session=s3cret-session; HttpOnly"),
            ("x-auth-token", "s3cret-token"),
            ("location", "/things/1"),
            ("content-type", "application/json"),
        ],
        r#"{"ok":true}"#,
    )
        .into_response()
}

/// Writes a thing and answers with a body larger than the layer stores.
async fn create_thing_with_a_large_answer(
    request: IdempotentRequest,
    axum::Json(thing): axum::Json<Thing>,
) -> axum::response::Response {
    insert_thing(&request, &thing).await;
    (StatusCode::CREATED, "x".repeat(100_000)).into_response()
}

struct Fixture {
    db: TestDb,
    app: Router,
    state: AppState,
}

impl Fixture {
    async fn new(name: &str) -> Self {
        let db = TestDb::new(name).await;
        create_things_table(&db.pool).await;
        let state = AppState::default();
        let app = Router::new()
            .route(
                "/things",
                post(create_thing).layer(IdempotencyLayer::new(
                    db.pool.clone(),
                    StepName::from_static("create-thing"),
                )),
            )
            .route(
                "/things-of-callers",
                post(create_thing).layer(
                    IdempotencyLayer::new(db.pool.clone(), StepName::from_static("create-owned"))
                        // The authentication in front of the layer put the caller in `x-user`.
                        .with_caller(|parts| {
                            parts
                                .headers
                                .get("x-user")
                                .and_then(|v| v.to_str().ok())
                                .map(str::to_owned)
                        }),
                ),
            )
            .route(
                "/secrets",
                post(create_thing_with_secrets).layer(IdempotencyLayer::new(
                    db.pool.clone(),
                    StepName::from_static("create-secret"),
                )),
            )
            .route(
                "/large",
                post(create_thing_with_a_large_answer).layer(IdempotencyLayer::new(
                    db.pool.clone(),
                    StepName::from_static("create-large"),
                )),
            )
            .route(
                "/binary",
                post(create_thing_in_binary).layer(IdempotencyLayer::new(
                    db.pool.clone(),
                    StepName::from_static("create-binary"),
                )),
            )
            .with_state(state.clone());
        Self { db, app, state }
    }

    async fn post(
        &self,
        key: Option<&str>,
        tenant: Option<&str>,
        body: &str,
    ) -> (StatusCode, bool, serde_json::Value, Option<String>) {
        self.post_to("/things", key, tenant, body).await
    }

    async fn post_to(
        &self,
        path: &str,
        key: Option<&str>,
        tenant: Option<&str>,
        body: &str,
    ) -> (StatusCode, bool, serde_json::Value, Option<String>) {
        let mut request = Request::post(path).header("content-type", "application/json");
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        if let Some(tenant) = tenant {
            request = request.header("Tenant-Id", tenant);
        }
        let response = self
            .app
            .clone()
            .oneshot(request.body(Body::from(body.to_owned())).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let replayed = response
            .headers()
            .get(REPLAYED_HEADER)
            .is_some_and(|v| v == "true");
        let retry_after = response
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_owned());
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        (status, replayed, json, retry_after)
    }

    async fn things(&self) -> i64 {
        self.db.count("things").await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_with_the_same_key_replays_the_stored_response_without_running_the_handler() {
    let f = Fixture::new("http-replay").await;
    let (status, replayed, first, _) = f.post(Some("k-1"), None, r#"{"name":"a"}"#).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let (status, replayed, again, _) = f.post(Some("k-1"), None, r#"{"name":"a"}"#).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(again, first, "the stored body, byte for byte the same JSON");
    assert_eq!(
        f.state.calls.load(Ordering::SeqCst),
        1,
        "the handler ran once"
    );
    assert_eq!(f.things().await, 1);
}

#[tokio::test(flavor = "current_thread")]
async fn retries_sent_back_to_back_are_all_replayed_never_refused_as_in_flight() {
    // A replay must release the key before its answer goes out: the client's next retry, on another
    // connection of the pool, must find it free, not held by the previous retry's transaction.
    let f = Fixture::new("http-back-to-back").await;
    let (status, _, _, _) = f.post(Some("k-b2b"), None, r#"{"name":"a"}"#).await;
    assert_eq!(status, StatusCode::CREATED);
    // Busy cores, as on a loaded CI machine, widen the window in which a transaction dropped without
    // a rollback still holds the key.
    let spinning = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let spinners: Vec<_> = (0..4)
        .map(|_| {
            let spinning = spinning.clone();
            std::thread::spawn(move || {
                while spinning.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let _stop = StopOnDrop(spinning);
    for retry in 0..100 {
        let (status, replayed, again, _) = f.post(Some("k-b2b"), None, r#"{"name":"a"}"#).await;
        assert_eq!(
            (status, replayed),
            (StatusCode::CREATED, true),
            "retry {retry}: {again}"
        );
        let (status, _, _, _) = f.post(Some("k-b2b"), None, r#"{"name":"b"}"#).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "retry {retry}");
    }
    drop(_stop);
    for spinner in spinners {
        spinner.join().unwrap();
    }
    assert_eq!(f.state.calls.load(Ordering::SeqCst), 1);
    assert_eq!(f.things().await, 1);
}

#[tokio::test(flavor = "current_thread")]
async fn a_response_that_cannot_be_stored_rolls_back_before_answering_and_frees_the_key_at_once() {
    let f = Fixture::new("http-unstorable").await;
    let spinning = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let spinners: Vec<_> = (0..4)
        .map(|_| {
            let spinning = spinning.clone();
            std::thread::spawn(move || {
                while spinning.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let _stop = StopOnDrop(spinning);
    for round in 0..300 {
        let key = format!("k-bin-{round}");
        for attempt in 0..2 {
            let (status, _, body, _) = f
                .post_to("/binary", Some(&key), None, r#"{"name":"a"}"#)
                .await;
            assert_eq!(
                status,
                StatusCode::INTERNAL_SERVER_ERROR,
                "round {round}, attempt {attempt}: the retry finds the key free, never in flight: {body}"
            );
        }
    }
    drop(_stop);
    for spinner in spinners {
        spinner.join().unwrap();
    }
    assert_eq!(f.things().await, 0, "every handler's write rolled back");
}

/// Stops the spinning threads, also when the test fails.
struct StopOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Relaxed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_with_a_different_request_is_refused_with_422() {
    let f = Fixture::new("http-mismatch").await;
    f.post(Some("k-1"), None, r#"{"name":"a"}"#).await;
    let (status, _, body, _) = f.post(Some("k-1"), None, r#"{"name":"b"}"#).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("different request")
    );
    assert_eq!(f.things().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_still_in_flight_gets_409_and_then_the_stored_response() {
    let f = Arc::new(Fixture::new("http-in-flight").await);
    let slow = {
        let f = f.clone();
        tokio::spawn(async move {
            f.post(Some("k-1"), None, r#"{"name":"a","sleep_ms":600}"#)
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (status, _, _, retry_after) = f
        .post(Some("k-1"), None, r#"{"name":"a","sleep_ms":600}"#)
        .await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(retry_after.as_deref(), Some("1"));
    let (status, _, first, _) = slow.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    let (status, replayed, again, _) = f
        .post(Some("k-1"), None, r#"{"name":"a","sleep_ms":600}"#)
        .await;
    assert_eq!(
        (status, replayed, again),
        (StatusCode::CREATED, true, first)
    );
    assert_eq!(f.things().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_error_releases_the_key_and_rolls_back_the_handlers_writes() {
    let f = Fixture::new("http-5xx").await;
    f.state.failures_left.store(1, Ordering::SeqCst);
    let (status, replayed, _, _) = f.post(Some("k-1"), None, r#"{"name":"a"}"#).await;
    assert_eq!(
        (status, replayed),
        (StatusCode::INTERNAL_SERVER_ERROR, false)
    );
    assert_eq!(
        f.things().await,
        0,
        "the failed attempt's write rolled back"
    );
    let (status, replayed, body, _) = f.post(Some("k-1"), None, r#"{"name":"a"}"#).await;
    assert_eq!(
        (status, replayed),
        (StatusCode::CREATED, false),
        "the retry ran"
    );
    assert_eq!(body["call"], 2);
    assert_eq!(f.things().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_during_the_handler_releases_the_key() {
    let f = Arc::new(Fixture::new("http-crash").await);
    let request = {
        let f = f.clone();
        tokio::spawn(async move {
            f.post(Some("k-1"), None, r#"{"name":"a","sleep_ms":1500}"#)
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The request dies mid-handler (its connection or process gone): its transaction is dropped.
    request.abort();
    let _ = request.await;
    // Until the dead request's transaction is rolled back its key is in flight (409, Retry-After); a client
    // retrying as told then gets the key.
    let mut answer = f
        .post(Some("k-1"), None, r#"{"name":"a","sleep_ms":1500}"#)
        .await;
    for _ in 0..20 {
        if answer.0 != StatusCode::CONFLICT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        answer = f
            .post(Some("k-1"), None, r#"{"name":"a","sleep_ms":1500}"#)
            .await;
    }
    let (status, replayed, _, _) = answer;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(f.state.calls.load(Ordering::SeqCst), 2);
    assert_eq!(f.things().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_scoped_per_tenant() {
    let f = Fixture::new("http-tenants").await;
    let (_, _, acme, _) = f.post(Some("k-1"), Some("acme"), r#"{"name":"a"}"#).await;
    let (status, replayed, globex, _) =
        f.post(Some("k-1"), Some("globex"), r#"{"name":"a"}"#).await;
    assert_eq!(
        (status, replayed),
        (StatusCode::CREATED, false),
        "another tenant's key is new"
    );
    assert_eq!(globex["tenant"], "globex");
    let (_, replayed, again, _) = f.post(Some("k-1"), Some("acme"), r#"{"name":"a"}"#).await;
    assert!(replayed);
    assert_eq!(again, acme, "each tenant gets its own stored response");
    assert_eq!(f.things().await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_invalid_keys_are_rejected_before_the_handler() {
    let f = Fixture::new("http-bad-key").await;
    let (status, _, body, _) = f.post(None, None, r#"{"name":"a"}"#).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("missing Idempotency-Key")
    );
    let (status, _, body, _) = f.post(Some("has spaces"), None, r#"{"name":"a"}"#).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("invalid Idempotency-Key")
    );
    assert_eq!(f.state.calls.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_callers_known_another_caller_presenting_the_same_key_and_body_gets_422_not_the_response()
 {
    let f = Fixture::new("http-caller").await;
    let post_as = |user: &'static str| {
        let app = f.app.clone();
        async move {
            let request = Request::post("/things-of-callers")
                .header("content-type", "application/json")
                .header("Idempotency-Key", "k-1")
                .header("Tenant-Id", "acme")
                .header("x-user", user)
                .body(Body::from(r#"{"name":"secret"}"#))
                .unwrap();
            let response = app.oneshot(request).await.unwrap();
            let replayed = response.headers().get(REPLAYED_HEADER).is_some();
            let status = response.status();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (
                status,
                replayed,
                String::from_utf8_lossy(&body).into_owned(),
            )
        }
    };
    let (status, replayed, _) = post_as("alice").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let (status, replayed, body) = post_as("mallory").await;
    assert_eq!(
        (status, replayed),
        (StatusCode::UNPROCESSABLE_ENTITY, false),
        "{body}"
    );
    assert!(
        !body.contains("secret"),
        "no part of alice's response: {body}"
    );
    let (status, replayed, body) = post_as("alice").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert!(body.contains("secret"));
    assert_eq!(
        f.state.calls.load(Ordering::SeqCst),
        1,
        "the handler ran once"
    );
    assert_eq!(f.things().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_headers_that_describe_the_body_are_stored_and_a_body_too_large_to_store_is_not_kept()
{
    let f = Fixture::new("http-stored").await;
    let send = |path: &'static str, key: &'static str| {
        let app = f.app.clone();
        async move {
            let request = Request::post(path)
                .header("content-type", "application/json")
                .header("Idempotency-Key", key)
                .body(Body::from(r#"{"name":"a"}"#))
                .unwrap();
            let response = app.oneshot(request).await.unwrap();
            let (parts, body) = response.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            (parts, String::from_utf8_lossy(&body).into_owned())
        }
    };
    // The first answer carries everything the handler set; the replay only what describes the body.
    let (first, _) = send("/secrets", "k-secret").await;
    assert!(first.headers.contains_key("set-cookie"));
    let (again, body) = send("/secrets", "k-secret").await;
    assert_eq!(again.headers[REPLAYED_HEADER], "true");
    assert_eq!(again.headers["location"], "/things/1");
    assert_eq!(again.headers["content-type"], "application/json");
    assert_eq!(body, r#"{"ok":true}"#);
    assert!(
        !again.headers.contains_key("set-cookie"),
        "{:?}",
        again.headers
    );
    assert!(
        !again.headers.contains_key("x-auth-token"),
        "{:?}",
        again.headers
    );
    let stored: String = sqlx::query_scalar(
        "SELECT outcome::text FROM saga_idempotency_keys WHERE step_key = 'k-secret:create-secret'",
    )
    .fetch_one(&f.db.pool)
    .await
    .unwrap();
    assert!(!stored.contains("s3cret"), "{stored}");

    // A response larger than the layer stores: answered and committed as it is; a retry gets its status
    // and stored headers, and a short body saying its response was not kept, never the handler again.
    let before = f.things().await;
    let (large, body) = send("/large", "k-large").await;
    assert_eq!(large.status, StatusCode::CREATED);
    assert_eq!(body.len(), 100_000, "the first answer is whole");
    assert_eq!(f.things().await, before + 1);
    let (again, notice) = send("/large", "k-large").await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.headers[REPLAYED_HEADER], "true");
    assert_eq!(again.headers[BODY_OMITTED_HEADER], "100000");
    assert!(notice.contains("larger than the layer stores"), "{notice}");
    assert_eq!(
        f.things().await,
        before + 1,
        "the handler did not run again"
    );
    let stored: String = sqlx::query_scalar(
        "SELECT outcome::text FROM saga_idempotency_keys WHERE step_key = 'k-large:create-large'",
    )
    .fetch_one(&f.db.pool)
    .await
    .unwrap();
    assert!(stored.len() < 1_000, "the body was not stored: {stored}");
}
