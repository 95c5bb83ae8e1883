//! HTTP requests into a service's routes inside the test process: no port, no client, the same
//! `axum::Router` the service serves.

use axum::body::Body;
use http_body_util::BodyExt;
use tower_service::Service;

use crate::KitError;

/// A route's answer.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Answer {
    /// The status code.
    pub status: u16,
    /// The headers.
    pub headers: http::HeaderMap,
    /// The body as JSON (`Null` when it is empty or not JSON; see [`Answer::text`]).
    pub json: serde_json::Value,
    /// The body as text.
    pub text: String,
}

/// Sends `method path` with `headers` and, if given, `json` as the body to `app`, and reads the answer.
///
/// # Examples
///
/// ```no_run
/// # async fn example(app: axum::Router) -> Result<(), saga_testing::KitError> {
/// let body = serde_json::json!({ "amount_cents": 1250 });
/// let answer = saga_testing::http::send(&app, "POST", "/orders", &[("idempotency-key", "order-7")], Some(&body)).await?;
/// assert_eq!(answer.status, 201);
/// # Ok(()) }
/// ```
pub async fn send(
    app: &axum::Router,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    json: Option<&serde_json::Value>,
) -> Result<Answer, KitError> {
    let bad = |e: saga_consumer::Cause| KitError::Http {
        request: format!("{method} {path}"),
        source: e,
    };
    let mut request = http::Request::builder().method(method).uri(path);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let body = match json {
        Some(json) => {
            request = request.header(http::header::CONTENT_TYPE, "application/json");
            Body::from(serde_json::to_vec(json).map_err(|e| bad(saga_consumer::Cause::new(e)))?)
        }
        None => Body::empty(),
    };
    let request = request
        .body(body)
        .map_err(|e| bad(saga_consumer::Cause::new(e)))?;
    let mut app = app.clone();
    futures::future::poll_fn(|cx| Service::<http::Request<Body>>::poll_ready(&mut app, cx))
        .await
        .map_err(|e| bad(saga_consumer::Cause::new(e)))?;
    let response = app
        .call(request)
        .await
        .map_err(|e| bad(saga_consumer::Cause::new(e)))?;
    let (parts, body) = response.into_parts();
    let bytes = body
        .collect()
        .await
        .map_err(|e| bad(saga_consumer::Cause::new(e)))?
        .to_bytes();
    Ok(Answer {
        status: parts.status.as_u16(),
        headers: parts.headers,
        json: serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
        text: String::from_utf8_lossy(&bytes).into_owned(),
    })
}
