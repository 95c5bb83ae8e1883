//! The handler the HTTP layer's tests put behind the layer: it writes a thing in the request's transaction.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use saga_consumer::http::IdempotentRequest;

/// What the handler counts and how it is told to fail.
#[derive(Clone, Default)]
pub struct AppState {
    /// Calls of the handler.
    pub calls: Arc<AtomicU32>,
    /// The handler answers 500 (after writing) while this is above zero, counting down.
    pub failures_left: Arc<AtomicU32>,
}

/// A request's body.
#[derive(serde::Deserialize)]
pub struct Thing {
    pub name: String,
    /// How long the handler sleeps after writing.
    #[serde(default)]
    pub sleep_ms: u64,
}

/// The table the handler writes to.
pub async fn create_things_table(pool: &sqlx::PgPool) {
    sqlx::query("CREATE TABLE things (tenant TEXT NOT NULL, name TEXT NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
}

/// Writes `thing` for the request's tenant, in the request's transaction.
pub async fn insert_thing(request: &IdempotentRequest, thing: &Thing) {
    let mut conn = request.transaction().await;
    sqlx::query("INSERT INTO things (tenant, name) VALUES ($1, $2)")
        .bind(request.tenant().as_str())
        .bind(&thing.name)
        .execute(&mut *conn)
        .await
        .unwrap();
}

/// Writes `thing` in the request's transaction, sleeps as asked, and answers 201 with the thing, the call's
/// number and the tenant (or 500 while `failures_left` is above zero).
pub async fn create_thing(
    State(state): State<AppState>,
    request: IdempotentRequest,
    axum::Json(thing): axum::Json<Thing>,
) -> axum::response::Response {
    let call = state.calls.fetch_add(1, Ordering::SeqCst) + 1;
    insert_thing(&request, &thing).await;
    tokio::time::sleep(Duration::from_millis(thing.sleep_ms)).await;
    let failing = state
        .failures_left
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok();
    if failing {
        return (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response();
    }
    (
        StatusCode::CREATED,
        axum::Json(serde_json::json!({ "name": thing.name, "call": call, "tenant": request.tenant().as_str() })),
    )
        .into_response()
}
