//! The HTTP idempotency layer's added latency: the same handler (an order row and an outbox row in one
//! transaction) behind the layer and without it, over one keep-alive connection.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use saga_consumer::http::{IdempotencyLayer, IdempotentRequest};
use saga_core::Lineage;
use saga_core::{Event, IdempotencyKey, OutboxMessage, StepName, TenantId};
use sqlx::{PgConnection, PgPool};

use crate::bench::{Progress, percentile};

#[derive(serde::Deserialize)]
pub(crate) struct Body {
    key: String,
    amount: i64,
}

async fn write(conn: &mut PgConnection, lineage: &Lineage, body: &Body) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO bench_orders (key, amount) VALUES ($1, $2)")
        .bind(&body.key)
        .bind(body.amount)
        .execute(&mut *conn)
        .await?;
    let event = Event::new(
        "OrderCreated",
        "bench.orders",
        body.key.clone(),
        &serde_json::json!({ "amount": body.amount }),
    )
    .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
    super::outbox()
        .append(
            conn,
            &[OutboxMessage::from_event(event, lineage, "saga-bench")],
        )
        .await
        .map_err(|e| match e {
            saga_consumer::OutboxWriteError::Database(e) => e,
            other => sqlx::Error::Protocol(other.to_string()),
        })?;
    Ok(())
}

pub(crate) async fn with_layer(
    request: IdempotentRequest,
    Json(body): Json<Body>,
) -> (StatusCode, &'static str) {
    let mut conn = request.transaction().await;
    match write(&mut conn, &request.lineage(), &body).await {
        Ok(()) => (StatusCode::CREATED, "{\"ok\":true}"),
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "{}"),
    }
}

async fn without_layer(
    State(pool): State<PgPool>,
    Json(body): Json<Body>,
) -> (StatusCode, &'static str) {
    let done: Result<(), sqlx::Error> = async {
        let lineage = Lineage::root(
            IdempotencyKey::new(&body.key).map_err(|e| sqlx::Error::Protocol(e.to_string()))?,
            TenantId::default(),
        );
        let mut tx = pool.begin().await?;
        write(&mut tx, &lineage, &body).await?;
        tx.commit().await
    }
    .await;
    match done {
        Ok(()) => (StatusCode::CREATED, "{\"ok\":true}"),
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "{}"),
    }
}

/// The table the handlers write.
pub(crate) async fn create_table(pool: &PgPool) -> Result<(), sqlx::Error> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_orders (key TEXT NOT NULL, amount BIGINT NOT NULL)",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Latency percentiles in milliseconds: (with p50, with p99, without p50, without p99).
pub async fn overhead(
    pool: &PgPool,
    requests: usize,
    progress: &Progress,
) -> anyhow::Result<(f64, f64, f64, f64)> {
    create_table(pool).await?;
    let app = Router::new()
        .route(
            "/with",
            post(with_layer).layer(IdempotencyLayer::new(
                pool.clone(),
                StepName::from_static("create-order"),
            )),
        )
        .route("/without", post(without_layer))
        .with_state(pool.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let mut client = Client::connect(addr).await?;
    let (mut with, mut without) = (Vec::new(), Vec::new());
    let warmup = 200;
    for i in 0..(requests + warmup) {
        // Alternate, so that both see the same database and machine conditions.
        for (path, samples) in [("/with", &mut with), ("/without", &mut without)] {
            let key = format!("bench-http-{path}-{i}-{}", uuid::Uuid::new_v4().simple());
            let body = serde_json::json!({ "key": key, "amount": i }).to_string();
            let elapsed = client.post(path, &key, body).await?;
            if i >= warmup {
                samples.push(elapsed.as_secs_f64() * 1_000.0);
            }
        }
        if i % 500 == 0 {
            progress.note(&format!("{i}/{} request pairs", requests + warmup));
        }
    }
    server.abort();
    Ok((
        percentile(&mut with, 0.5),
        percentile(&mut with, 0.99),
        percentile(&mut without, 0.5),
        percentile(&mut without, 0.99),
    ))
}

pub(crate) struct Client {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    addr: SocketAddr,
}

impl Client {
    pub(crate) async fn connect(addr: SocketAddr) -> anyhow::Result<Self> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(Self { sender, addr })
    }

    async fn post(&mut self, path: &str, key: &str, body: String) -> anyhow::Result<Duration> {
        let (status, elapsed) = self.post_status(path, key, body).await?;
        anyhow::ensure!(status == StatusCode::CREATED, "{path} answered {status}");
        Ok(elapsed)
    }

    /// Posts `body` with `key`; the status and the time to the whole response.
    pub(crate) async fn post_status(
        &mut self,
        path: &str,
        key: &str,
        body: String,
    ) -> anyhow::Result<(StatusCode, Duration)> {
        let request = hyper::Request::post(path)
            .header("host", self.addr.to_string())
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from(body)))?;
        self.sender.ready().await?;
        let started = Instant::now();
        let response = self.sender.send_request(request).await?;
        let status = response.status();
        response.into_body().collect().await?;
        Ok((status, started.elapsed()))
    }
}
