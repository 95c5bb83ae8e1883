//! The order service: `POST /orders` (behind the Idempotency-Key layer) creates an order and, in the same
//! transaction, its `OrderCreated` event (choreographed saga) or its saga instance (orchestrated saga);
//! `GET /orders/{id}` shows the order and its history, `GET /sagas/{id}` an orchestrated saga's state
//! history. In the choreographed saga its steps follow the saga to its end: `mark-order-paid`,
//! `complete-order`, `note-shipment-failed`, and `cancel-order` on `PaymentFailed` or `PaymentRefunded`;
//! in the orchestrated one, [`OrderSagaHooks`] keep the order in step with its saga.
//!
//! Events of different topics can arrive in any order, so every status change is guarded: an order only
//! moves forward (PENDING → PAID → COMPLETED, or → COMPENSATING → CANCELLED), never back.

use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use std::time::Duration;

use futures::future::BoxFuture;
use saga_consumer::Outbox;
use saga_consumer::fast_path::FastPath;
use saga_consumer::http::{IdempotencyLayer, IdempotentRequest};
use saga_consumer::{
    Message, SagaEvent, StepContext, StepError, StepName, StepOutcome, StepResult,
};
use saga_orchestrator::definition::DefinitionError;
use saga_orchestrator::{
    Command, Decision, OnTimeout, Orchestrator, SagaDefinition, SagaHooks, SagaInstance,
    SagaStatus, Step,
};
use serde::Serialize;
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::events::{
    Charge, OrderCreated, OrderRequest, PaymentProcessed, PaymentSetback, Refund, Setback, Ship,
    ShipmentArranged, ShipmentSetback, Topics,
};

#[derive(Clone)]
struct AppState {
    pool: PgPool,
    topics: Topics,
    orchestrator: Option<Orchestrator>,
}

/// The HTTP API, writing its events to the service's `outbox`; with an orchestrator, orders start
/// orchestrated sagas; with a fast path, `POST /orders` answers in-flight and replayed keys from Redis.
pub fn router(
    pool: PgPool,
    topics: Topics,
    outbox: &Outbox,
    orchestrator: Option<Orchestrator>,
    fast_path: Option<FastPath>,
) -> Router {
    let create = post(create_order).layer(
        IdempotencyLayer::new(pool.clone(), StepName::from_static("create-order"))
            .with_outbox(outbox)
            .with_fast_path(fast_path),
    );
    let orchestrator = orchestrator.map(|o| o.with_outbox(outbox));
    Router::new()
        .route("/orders", create)
        .route("/orders/{id}", get(get_order))
        .route("/sagas/{id}", get(get_saga))
        .with_state(AppState {
            pool,
            topics,
            orchestrator,
        })
}

/// The orchestrated order saga: `process-payment` (compensated by `RefundPayment`), then
/// `arrange-shipment`.
pub fn order_saga(topics: &Topics) -> Result<SagaDefinition, DefinitionError> {
    let payment = Step::new(
        "process-payment",
        Command::to(&topics.payment_commands, |data| {
            Charge::ProcessPayment(reply(data, "input"))
        }),
    )?
    .succeeds_on(PaymentProcessed::TYPES)
    .fails_on([PaymentSetback::PAYMENT_FAILED])
    .compensate_with(
        Command::to(&topics.refund_commands, |data| {
            Refund::RefundPayment(Setback {
                order_id: reply::<OrderCreated>(data, "input").order_id,
                reason: data["arrange-shipment"]["reason"]
                    .as_str()
                    .unwrap_or("the saga was compensated")
                    .to_owned(),
            })
        }),
        [PaymentSetback::PAYMENT_REFUNDED],
        Duration::from_secs(10),
    )
    .timeout(Duration::from_secs(60), OnTimeout::Fail);
    let shipment = Step::new(
        "arrange-shipment",
        Command::to(&topics.shipping_commands, |data| {
            Ship::ArrangeShipment(reply(data, "process-payment"))
        }),
    )?
    .succeeds_on(ShipmentArranged::TYPES)
    .fails_on([ShipmentSetback::SHIPMENT_FAILED])
    .timeout(Duration::from_secs(60), OnTimeout::Fail);
    Ok(
        SagaDefinition::new("order-fulfillment", &topics.order_replies)?
            .step(payment)
            .step(shipment),
    )
}

/// What the saga's data holds under `at`: its input (the `OrderCreated` it started with) or a step's
/// reply, each written there by this service from the same type.
fn reply<T: serde::de::DeserializeOwned>(data: &serde_json::Value, at: &str) -> T {
    serde_json::from_value(data[at].clone())
        .unwrap_or_else(|e| panic!("the saga's {at} is not what this service wrote there: {e}"))
}

/// Keeps an order in step with its orchestrated saga: its status and its history.
#[derive(Debug)]
pub struct OrderSagaHooks;

impl SagaHooks for OrderSagaHooks {
    fn transitioned<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        before: &'a SagaInstance,
        decision: &'a Decision,
    ) -> BoxFuture<'a, Result<(), StepError>> {
        Box::pin(async move {
            let Some(order_id) = before.data["input"]["order_id"]
                .as_str()
                .and_then(|id| Uuid::parse_str(id).ok())
            else {
                return Err(StepError::permanent("an order saga without an order id"));
            };
            let note = format!(
                "saga {}: {} ({})",
                decision.next.status.as_str(),
                decision.step.as_deref().unwrap_or("-"),
                decision.cause
            );
            let (from, to): (&[&str], &str) = match decision.next.status {
                SagaStatus::Running if decision.step.as_deref() == Some("arrange-shipment") => {
                    (&["PENDING"], "PAID")
                }
                SagaStatus::Running => (&[], "PENDING"),
                SagaStatus::Compensating => (&["PENDING", "PAID"], "COMPENSATING"),
                SagaStatus::Completed => (&["PENDING", "PAID"], "COMPLETED"),
                SagaStatus::Compensated => (&["PENDING", "PAID", "COMPENSATING"], "CANCELLED"),
                // A status of a later version: the order keeps what it has.
                _ => return Ok(()),
            };
            advance(
                conn,
                order_id,
                from,
                to,
                decision.next.failure.as_deref(),
                &note,
            )
            .await?;
            Ok(())
        })
    }
}

/// The order as the API shows it.
#[derive(Debug, Serialize)]
pub struct OrderView {
    /// The order.
    pub order_id: Uuid,
    /// Where the saga stands.
    pub status: String,
    /// Why it was cancelled.
    pub reason: Option<String>,
    /// The customer.
    pub customer: String,
    /// The amount.
    pub amount_cents: i64,
    /// The address.
    pub ship_to: String,
    /// The orchestrated saga running it, if any.
    pub saga_id: Option<Uuid>,
    /// The saga's steps so far.
    pub history: Vec<HistoryEntry>,
}

/// One step of an order's saga.
#[derive(Debug, Serialize)]
pub struct HistoryEntry {
    /// When.
    pub at: chrono::DateTime<chrono::Utc>,
    /// The status it led to.
    pub status: String,
    /// What happened.
    pub note: String,
}

fn error(status: StatusCode, message: &str) -> Response {
    (status, Json(serde_json::json!({ "error": message }))).into_response()
}

async fn create_order(
    State(app): State<AppState>,
    request: IdempotentRequest,
    Json(body): Json<OrderRequest>,
) -> Response {
    if body.amount_cents <= 0 || body.customer.trim().is_empty() || body.ship_to.trim().is_empty() {
        // A 4xx is stored with the key and replayed: the same request stays invalid.
        return error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "customer, ship_to and a positive amount_cents are required",
        );
    }
    let order_id = Uuid::now_v7();
    let created: Result<Option<Uuid>, String> = async {
        let mut conn = request.transaction().await;
        insert_order(&mut conn, &request, order_id, &body)
            .await
            .map_err(|e| e.to_string())?;
        match &app.orchestrator {
            Some(orchestrator) => {
                let input = serde_json::to_value(OrderCreated {
                    order_id,
                    request: body.clone(),
                })
                .map_err(|e| e.to_string())?;
                let (saga_id, _) = orchestrator
                    .start(&mut conn, &request.lineage(), input)
                    .await
                    .map_err(|e| e.to_string())?;
                sqlx::query("UPDATE orders SET saga_id = $2 WHERE order_id = $1")
                    .bind(order_id)
                    .bind(saga_id)
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(Some(saga_id))
            }
            None => {
                // The saga's first event, written to the outbox in the request's transaction.
                let created = OrderCreated {
                    order_id,
                    request: body.clone(),
                };
                request
                    .emit(&app.topics.orders, order_id.to_string(), &created)
                    .map_err(|e| e.to_string())?;
                Ok(None)
            }
        }
    }
    .await;
    match created {
        Ok(saga_id) => (
            StatusCode::CREATED,
            [(header::LOCATION, format!("/orders/{order_id}"))],
            Json(serde_json::json!({ "order_id": order_id, "status": "PENDING", "saga_id": saga_id })),
        )
            .into_response(),
        // A 5xx rolls the transaction back and releases the key: the client's retry runs again.
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e),
    }
}

async fn insert_order(
    conn: &mut PgConnection,
    request: &IdempotentRequest,
    order_id: Uuid,
    body: &OrderRequest,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO orders (order_id, tenant_id, idempotency_key, customer, amount_cents, ship_to, status) \
         VALUES ($1, $2, $3, $4, $5, $6, 'PENDING')",
    )
    .bind(order_id)
    .bind(request.tenant().as_str())
    .bind(request.key().as_str())
    .bind(&body.customer)
    .bind(body.amount_cents)
    .bind(&body.ship_to)
    .execute(&mut *conn)
    .await?;
    record(conn, order_id, "PENDING", "order accepted").await?;
    Ok(())
}

async fn get_saga(State(app): State<AppState>, Path(saga_id): Path<Uuid>) -> Response {
    let loaded = async {
        let Some(instance) = saga_orchestrator::store::load(&app.pool, saga_id).await? else {
            return Ok(None);
        };
        let history = saga_orchestrator::store::history(&app.pool, saga_id).await?;
        Ok::<_, saga_orchestrator::OrchestratorError>(Some((instance, history)))
    }
    .await;
    match loaded {
        Ok(Some((instance, history))) => {
            Json(serde_json::json!({ "saga": instance, "history": history })).into_response()
        }
        Ok(None) => error(StatusCode::NOT_FOUND, "no such saga"),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

async fn get_order(State(app): State<AppState>, Path(order_id): Path<Uuid>) -> Response {
    match load_order(&app.pool, order_id).await {
        Ok(Some(view)) => Json(view).into_response(),
        Ok(None) => error(StatusCode::NOT_FOUND, "no such order"),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

/// Reads an order and its history.
pub async fn load_order(pool: &PgPool, order_id: Uuid) -> Result<Option<OrderView>, sqlx::Error> {
    let Some(row) = sqlx::query(
        "SELECT status, reason, customer, amount_cents, ship_to, saga_id FROM orders WHERE order_id = $1",
    )
    .bind(order_id)
    .fetch_optional(pool)
    .await?
    else {
        return Ok(None);
    };
    let history =
        sqlx::query("SELECT at, status, note FROM order_history WHERE order_id = $1 ORDER BY at")
            .bind(order_id)
            .fetch_all(pool)
            .await?
            .into_iter()
            .map(|h| {
                Ok(HistoryEntry {
                    at: h.try_get(0)?,
                    status: h.try_get(1)?,
                    note: h.try_get(2)?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()?;
    Ok(Some(OrderView {
        order_id,
        status: row.try_get(0)?,
        reason: row.try_get(1)?,
        customer: row.try_get(2)?,
        amount_cents: row.try_get(3)?,
        ship_to: row.try_get(4)?,
        saga_id: row.try_get(5)?,
        history,
    }))
}

async fn record(
    conn: &mut PgConnection,
    order_id: Uuid,
    status: &str,
    note: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO order_history (order_id, status, note) VALUES ($1, $2, $3)")
        .bind(order_id)
        .bind(status)
        .bind(note)
        .execute(conn)
        .await?;
    Ok(())
}

/// Moves an order to `to` if it is in one of `from`, and records the step in its history either way.
/// Returns whether the status changed.
async fn advance(
    conn: &mut PgConnection,
    order_id: Uuid,
    from: &[&str],
    to: &str,
    reason: Option<&str>,
    note: &str,
) -> Result<bool, sqlx::Error> {
    let moved = sqlx::query(
        "UPDATE orders SET status = $2, reason = coalesce($3, reason), updated_at = now() \
         WHERE order_id = $1 AND status = ANY($4)",
    )
    .bind(order_id)
    .bind(to)
    .bind(reason)
    .bind(from)
    .execute(&mut *conn)
    .await?
    .rows_affected()
        == 1;
    record(conn, order_id, to, note).await?;
    Ok(moved)
}

/// `mark-order-paid` on `PaymentProcessed`.
pub async fn mark_order_paid(
    msg: &Message<PaymentProcessed>,
    ctx: &mut StepContext<'_>,
) -> StepResult {
    let paid = msg.payload();
    let note = format!("paid, charge {}", paid.charge_id);
    advance(ctx.conn(), paid.order_id, &["PENDING"], "PAID", None, &note).await?;
    Ok(StepOutcome::completed())
}

/// `complete-order` on `ShipmentArranged`.
pub async fn complete_order(
    msg: &Message<ShipmentArranged>,
    ctx: &mut StepContext<'_>,
) -> StepResult {
    let shipped = msg.payload();
    let note = format!("shipped, shipment {}", shipped.shipment_id);
    let from = ["PENDING", "PAID"];
    advance(
        ctx.conn(),
        shipped.order_id,
        &from,
        "COMPLETED",
        None,
        &note,
    )
    .await?;
    Ok(StepOutcome::completed())
}

/// `note-shipment-failed` on `ShipmentFailed`: the refund is under way.
pub async fn note_shipment_failed(
    msg: &Message<ShipmentSetback>,
    ctx: &mut StepContext<'_>,
) -> StepResult {
    let ShipmentSetback::ShipmentFailed(failed) = msg.payload();
    let note = format!("shipment failed ({}), refund under way", failed.reason);
    let (from, reason) = (["PENDING", "PAID"], Some(failed.reason.as_str()));
    advance(
        ctx.conn(),
        failed.order_id,
        &from,
        "COMPENSATING",
        reason,
        &note,
    )
    .await?;
    Ok(StepOutcome::completed())
}

/// `cancel-order` on `PaymentFailed` or `PaymentRefunded`: one step key, so an order is cancelled once.
pub async fn cancel_order(msg: &Message<PaymentSetback>, ctx: &mut StepContext<'_>) -> StepResult {
    let (PaymentSetback::PaymentFailed(setback) | PaymentSetback::PaymentRefunded(setback)) =
        msg.payload();
    let note = format!("cancelled: {}", setback.reason);
    let (from, reason) = (
        ["PENDING", "PAID", "COMPENSATING"],
        Some(setback.reason.as_str()),
    );
    advance(
        ctx.conn(),
        setback.order_id,
        &from,
        "CANCELLED",
        reason,
        &note,
    )
    .await?;
    Ok(StepOutcome::completed())
}
