//! The payment service: `process-payment` charges an order through the gateway (two-phase, since the
//! gateway is outside the database) and `refund-payment` compensates a failed shipment. Both take a family
//! of two event types (the choreographed saga's event, or the orchestrator's command) and send their
//! outcome with [`Outcomes::send`]: the answer to a command, the next event otherwise, so the same steps
//! serve both sagas. Each is two functions: the gateway call, and its record in the transaction that
//! completes the step.

use saga_consumer::{
    Message, StepContext, StepError, StepOutcome, StepResult, Topic, TwoPhaseStep, two_phase,
};
use sqlx::PgPool;

use crate::events::{
    Charge, Outcomes, PROCESS_PAYMENT, PaymentProcessed, PaymentSetback, Refund, Setback,
};
use crate::gateway::{ChargeResult, PaymentGateway};

/// What the payment steps need: the gateway, the service's database (to find a charge to refund) and
/// where their outcomes go.
#[derive(Debug, Clone)]
pub struct Payments {
    /// The gateway.
    pub gateway: PaymentGateway,
    /// The payment service's database.
    pub pool: PgPool,
    /// Where outcomes go.
    pub outcomes: Outcomes,
}

/// `process-payment` on `charges` (`OrderCreated`, or the `ProcessPayment` command): charges the card,
/// emits `PaymentProcessed` or, when the card is declined, `PaymentFailed` (a business rejection).
pub fn process_payment(payments: Payments, charges: &Topic<Charge>) -> impl TwoPhaseStep {
    two_phase(PROCESS_PAYMENT.name(), payments, charge, record_charge).on(charges)
}

async fn charge(msg: &Message<Charge>, payments: &Payments) -> Result<ChargeResult, StepError> {
    let order = msg.payload().order();
    // The external key (the step's, with its tenant) is the gateway's idempotency key: after a crash this
    // call repeats, the charge not; another tenant's order with the same client key is its own.
    let key = msg.external_key();
    let (amount, card) = (order.request.amount_cents, &order.request.card);
    let charged = payments
        .gateway
        .charge(key.as_str(), order.order_id, amount, card);
    charged.await.map_err(StepError::transient)
}

async fn record_charge(
    msg: &Message<Charge>,
    result: ChargeResult,
    ctx: &mut StepContext<'_>,
    payments: &Payments,
) -> StepResult {
    let (order, command) = (msg.payload().order(), msg.payload().is_command());
    let (key, amount) = (order.order_id.to_string(), order.request.amount_cents);
    let (charge_id, reason) = match &result {
        ChargeResult::Charged { charge_id } => (Some(charge_id), None),
        ChargeResult::Declined { reason } => (None, Some(reason)),
    };
    sqlx::query(
        "INSERT INTO payments (order_id, charge_id, amount_cents, status, reason) \
         VALUES ($1, $2, $3, CASE WHEN $2::text IS NULL THEN 'DECLINED' ELSE 'CHARGED' END, $4)",
    )
    .bind(order.order_id)
    .bind(charge_id)
    .bind(amount)
    .bind(reason)
    .execute(ctx.conn())
    .await?;
    match result {
        ChargeResult::Charged { charge_id } => {
            let ship_to = order.request.ship_to.clone();
            let processed = PaymentProcessed {
                order_id: order.order_id,
                charge_id: charge_id.clone(),
                amount_cents: amount,
                ship_to,
            };
            Outcomes::send(ctx, command, &payments.outcomes.payments, key, &processed)?;
            StepOutcome::completed_with(&serde_json::json!({ "charge_id": charge_id }))
        }
        ChargeResult::Declined { reason } => {
            let setback = Setback {
                order_id: order.order_id,
                reason: reason.clone(),
            };
            let failed = PaymentSetback::PaymentFailed(setback);
            Outcomes::send(
                ctx,
                command,
                &payments.outcomes.payment_setbacks,
                key,
                &failed,
            )?;
            Ok(StepOutcome::rejected(reason))
        }
    }
}

/// `refund-payment` on `ShipmentFailed` (or, named `compensate-process-payment`, on the `RefundPayment`
/// command): refunds the charge (its own step key, so a redelivery refunds once) and emits
/// `PaymentRefunded`. As a compensation it tolerates a missing effect: with nothing charged there is
/// nothing to refund, and it confirms all the same.
pub fn refund_payment(
    name: &'static str,
    payments: Payments,
    refunds: &Topic<Refund>,
) -> impl TwoPhaseStep {
    two_phase(name, payments, refund, record_refund).on(refunds)
}

/// The charge refunded and the refund; `None` when nothing was charged.
type Refunded = Option<(String, String)>;

async fn refund(msg: &Message<Refund>, payments: &Payments) -> Result<Refunded, StepError> {
    let charge_id: Option<String> = sqlx::query_scalar(
        "SELECT charge_id FROM payments WHERE order_id = $1 AND charge_id IS NOT NULL",
    )
    .bind(msg.payload().setback().order_id)
    .fetch_optional(&payments.pool)
    .await?;
    let Some(charge_id) = charge_id else {
        return Ok(None);
    };
    let refunded = payments
        .gateway
        .refund(msg.external_key().as_str(), &charge_id);
    let refund_id = refunded.await.map_err(StepError::transient)?;
    Ok(Some((charge_id, refund_id)))
}

async fn record_refund(
    msg: &Message<Refund>,
    refunded: Refunded,
    ctx: &mut StepContext<'_>,
    payments: &Payments,
) -> StepResult {
    let setback = msg.payload().setback();
    if let Some((_, refund_id)) = &refunded {
        sqlx::query(
            "UPDATE payments SET status = 'REFUNDED', refund_id = $2, reason = $3, updated_at = now() \
             WHERE order_id = $1",
        )
        .bind(setback.order_id)
        .bind(refund_id)
        .bind(&setback.reason)
        .execute(ctx.conn())
        .await?;
    }
    let done = PaymentSetback::PaymentRefunded(Setback {
        order_id: setback.order_id,
        reason: format!("refunded: {}", setback.reason),
    });
    let key = setback.order_id.to_string();
    let command = msg.payload().is_command();
    Outcomes::send(
        ctx,
        command,
        &payments.outcomes.payment_setbacks,
        key,
        &done,
    )?;
    let (charge_id, refund_id) = refunded.unzip();
    StepOutcome::completed_with(
        &serde_json::json!({ "charge_id": charge_id, "refund_id": refund_id }),
    )
}
