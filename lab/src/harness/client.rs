//! A small HTTP/1.1 client for the order API (one connection per request), and the client's side of the
//! idempotency contract: retry with the same key until an answer comes.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;

use saga_examples::events::OrderRequest;

/// An answer of the API.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The status code.
    pub status: u16,
    /// Whether the answer was replayed from the stored response.
    pub replayed: bool,
    /// The JSON body.
    pub body: serde_json::Value,
}

/// Sends one request; returns the status, the headers and the body.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
) -> anyhow::Result<(u16, hyper::HeaderMap, Bytes)> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(Bytes::from(body.unwrap_or_default())))?;
    let response = sender.send_request(request).await?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let bytes = response.into_body().collect().await?.to_bytes();
    Ok((status, headers, bytes))
}

/// Sends one request and reads a JSON answer.
pub async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
) -> anyhow::Result<Answer> {
    let (status, headers, bytes) = request(addr, method, path, headers, body).await?;
    Ok(Answer {
        status,
        replayed: headers
            .get(saga_consumer::http::REPLAYED_HEADER)
            .is_some_and(|v| v == "true"),
        body: serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    })
}

/// What submitting one order took.
#[derive(Debug, Clone, Default)]
pub struct Submission {
    /// The order id the API returned.
    pub order_id: Option<String>,
    /// Requests sent.
    pub requests: u32,
    /// Answers replayed from the stored response.
    pub replays: u32,
    /// 409 answers (the same key still in flight).
    pub conflicts: u32,
    /// Requests that got no answer (connection refused or reset: the service was down).
    pub unanswered: u32,
}

/// Posts `order` with `key`, retrying with the same key on no answer, 409 and 5xx, until `deadline` has
/// passed; then, if `repeat`, posts it once more (a client that retries after a lost response).
pub async fn submit_order(
    addr: SocketAddr,
    key: &str,
    order: &OrderRequest,
    repeat: bool,
    deadline: Duration,
) -> anyhow::Result<Submission> {
    let body = serde_json::to_vec(order)?;
    let started = tokio::time::Instant::now();
    let mut submission = Submission::default();
    let mut wait = Duration::from_millis(50);
    let mut answered = 0;
    while answered < 1 + u32::from(repeat) {
        anyhow::ensure!(
            started.elapsed() < deadline,
            "no answer for order {key} within {deadline:?}"
        );
        submission.requests += 1;
        match send(
            addr,
            "POST",
            "/orders",
            &[("idempotency-key", key)],
            Some(body.clone()),
        )
        .await
        {
            Ok(answer) if answer.status == 201 => {
                submission.replays += u32::from(answer.replayed);
                submission.order_id = answer.body["order_id"].as_str().map(str::to_owned);
                answered += 1;
                continue;
            }
            Ok(answer) if answer.status == 409 => submission.conflicts += 1,
            Ok(answer) if answer.status >= 500 => {}
            Ok(answer) => anyhow::bail!("order {key} refused: {} {}", answer.status, answer.body),
            Err(_) => submission.unanswered += 1,
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(1));
    }
    Ok(submission)
}
