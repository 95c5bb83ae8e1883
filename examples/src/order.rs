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

#[cfg(not(feature = "redis"))]
use crate::service::FastPath;
use futures::future::BoxFuture;
use saga_consumer::Outbox;
#[cfg(feature = "redis")]
use saga_consumer::fast_path::FastPath;
use saga_consumer::http::{IdempotencyLayer, IdempotentRequest};
use saga_consumer::{Message, StepContext, StepError, StepName, StepOutcome, StepResult};
use saga_orchestrator::definition::DefinitionError;
use saga_orchestrator::{
    Command, LegacyData, OnTimeout, Orchestrator, SagaChange, SagaDefinition, SagaHooks,
    SagaStatus, Step, Verdict,
};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::events::{
    ARRANGE_SHIPMENT, Charge, OrderCreated, OrderRequest, PROCESS_PAYMENT, PaymentProcessed,
    PaymentReply, PaymentSetback, Refund, RefundReply, Setback, Ship, ShipmentArranged,
    ShipmentReply, ShipmentSetback, Topics,
};

#[derive(Clone)]
struct AppState {
    pool: PgPool,
    topics: Topics,
    orchestrator: Option<Orchestrator<OrderSaga>>,
}

/// The HTTP API, writing its events to the service's `outbox`; with an orchestrator, orders start
/// orchestrated sagas; with a fast path, `POST /orders` answers in-flight and replayed keys from Redis.
#[cfg_attr(not(feature = "redis"), allow(clippy::needless_pass_by_value))]
pub fn router(
    pool: PgPool,
    topics: Topics,
    outbox: &Outbox,
    orchestrator: Option<Orchestrator<OrderSaga>>,
    fast_path: Option<FastPath>,
) -> Router {
    let idempotency = IdempotencyLayer::new(pool.clone(), StepName::from_static("create-order"))
        .with_outbox(outbox);
    #[cfg(feature = "redis")]
    let idempotency = idempotency.with_fast_path(fast_path);
    #[cfg(not(feature = "redis"))]
    let None = fast_path;
    let create = post(create_order).layer(idempotency);
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

/// The orchestrated order saga's data: the order it started with, and what its steps brought back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderSaga {
    /// The order.
    pub order: OrderCreated,
    /// The charge, once the payment step succeeded.
    pub payment: Option<PaymentProcessed>,
    /// The shipment, once arranged.
    pub shipment: Option<ShipmentArranged>,
}

impl OrderSaga {
    /// The saga of a new `order`.
    pub fn new(order: OrderCreated) -> Self {
        let (payment, shipment) = (None, None);
        Self {
            order,
            payment,
            shipment,
        }
    }
}

/// The orchestrated order saga: `process-payment` (compensated by `RefundPayment`), then
/// `arrange-shipment`.
pub fn order_saga(topics: &Topics) -> Result<SagaDefinition<OrderSaga>, DefinitionError> {
    let charge = |saga: &OrderSaga| Charge::ProcessPayment(saga.order.clone());
    let refund = |saga: &OrderSaga, why: &str| {
        let (order_id, reason) = (saga.order.order_id, why.to_owned());
        Refund::RefundPayment(Setback { order_id, reason })
    };
    let payment = Step::shared(
        PROCESS_PAYMENT,
        Command::to(&topics.payment_commands, charge),
    )
    .replies(|saga: &mut OrderSaga, reply: PaymentReply| match reply {
        PaymentReply::PaymentProcessed(paid) => {
            saga.payment = Some(paid);
            Verdict::Succeeded
        }
        PaymentReply::PaymentFailed(declined) => Verdict::Failed(declined.reason),
    })
    .compensate::<RefundReply>(Command::undo(&topics.refund_commands, refund))
    .resend_compensation_after(Duration::from_secs(10))
    .timeout(Duration::from_secs(60), OnTimeout::Fail);
    let ship = |saga: &OrderSaga| {
        let paid = saga.payment.clone();
        paid.map(Ship::ArrangeShipment).ok_or("no payment to ship")
    };
    let shipment = Step::shared(
        ARRANGE_SHIPMENT,
        Command::try_to(&topics.shipping_commands, ship),
    )
    .replies(|saga: &mut OrderSaga, reply: ShipmentReply| match reply {
        ShipmentReply::ShipmentArranged(arranged) => {
            saga.shipment = Some(arranged);
            Verdict::Succeeded
        }
        ShipmentReply::ShipmentFailed(failed) => Verdict::Failed(failed.reason),
    })
    .timeout(Duration::from_secs(60), OnTimeout::Fail);
    let saga = SagaDefinition::new("order-fulfillment", &topics.order_replies)?;
    Ok(saga.step(payment).step(shipment).reads_untyped(read_0_2))
}

/// An order saga stored by 0.2: its input was the order, and each step's reply was kept under the
/// step's name.
fn read_0_2(stored: &LegacyData) -> Result<OrderSaga, String> {
    Ok(OrderSaga {
        order: stored.input()?,
        payment: stored.reply(PROCESS_PAYMENT.name()),
        shipment: stored.reply(ARRANGE_SHIPMENT.name()),
    })
}

/// Keeps an order in step with its orchestrated saga: its status and its history.
#[derive(Debug)]
pub struct OrderSagaHooks;

impl SagaHooks<OrderSaga> for OrderSagaHooks {
    fn transitioned<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        change: &'a SagaChange<'a, OrderSaga>,
    ) -> BoxFuture<'a, Result<(), StepError>> {
        Box::pin(async move {
            let saga = change.data();
            let (status, step) = (change.status(), change.step.unwrap_or("-"));
            let note = format!("saga {}: {step} ({})", status.as_str(), change.cause);
            let (from, to): (&[&str], &str) = match status {
                SagaStatus::Running if saga.payment.is_some() => (&["PENDING"], "PAID"),
                SagaStatus::Running => (&[], "PENDING"),
                SagaStatus::Compensating => (&["PENDING", "PAID"], "COMPENSATING"),
                SagaStatus::Completed => (&["PENDING", "PAID"], "COMPLETED"),
                SagaStatus::Compensated => (&["PENDING", "PAID", "COMPENSATING"], "CANCELLED"),
                // A status of a later version: the order keeps what it has.
                _ => return Ok(()),
            };
            let reason = change.after.failure.as_deref();
            advance(conn, saga.order.order_id, from, to, reason, &note).await?;
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
                let saga = OrderSaga::new(OrderCreated {
                    order_id,
                    request: body.clone(),
                });
                let saga_id = orchestrator
                    .start(&mut conn, &request.lineage(), saga)
                    .await
                    .map_err(|e| e.to_string())?
                    .saga_id;
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
