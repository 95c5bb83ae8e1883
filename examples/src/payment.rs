//! The payment service: `process-payment` charges an order through the gateway (two-phase, since the
//! gateway is outside the database) and `refund-payment` compensates a failed shipment. Both take a family
//! of two event types (the choreographed saga's event, or the orchestrator's command) and send their
//! outcome where [`Outcomes`] says, so the same steps serve both sagas.

use saga_consumer::{
    Message, StepContext, StepError, StepName, StepOutcome, StepResult, Subscription, Topic,
    TwoPhaseStep,
};
use sqlx::PgPool;

use crate::events::{Charge, Outcomes, PaymentProcessed, PaymentSetback, Refund, Setback};
use crate::gateway::{ChargeResult, PaymentGateway};

/// `process-payment` on `OrderCreated` (or the `ProcessPayment` command): charges the card, emits
/// `PaymentProcessed` or, when the card is declined, `PaymentFailed` (a business rejection).
#[derive(Debug)]
pub struct ProcessPayment {
    /// The gateway.
    pub gateway: PaymentGateway,
    /// What it consumes.
    pub charges: Topic<Charge>,
    /// Where its outcome goes.
    pub outcomes: Outcomes,
}

impl TwoPhaseStep for ProcessPayment {
    type Payload = Charge;
    type Response = ChargeResult;

    fn name(&self) -> StepName {
        StepName::from_static("process-payment")
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        Subscription::to(&self.charges)
    }

    async fn call(&self, msg: &Message<Charge>) -> Result<ChargeResult, StepError> {
        let order = msg.payload().order();
        // The external key (the step's, with its tenant) is the gateway's idempotency key: after a crash
        // this call repeats, the charge not; another tenant's order with the same client key is its own.
        self.gateway
            .charge(
                msg.external_key().as_str(),
                order.order_id,
                order.request.amount_cents,
                &order.request.card,
            )
            .await
            .map_err(StepError::transient)
    }

    async fn complete(
        &self,
        msg: &Message<Charge>,
        response: ChargeResult,
        ctx: &mut StepContext<'_>,
    ) -> StepResult {
        let order = msg.payload().order();
        let key = order.order_id.to_string();
        match response {
            ChargeResult::Charged { charge_id } => {
                sqlx::query(
                    "INSERT INTO payments (order_id, charge_id, amount_cents, status) \
                     VALUES ($1, $2, $3, 'CHARGED')",
                )
                .bind(order.order_id)
                .bind(&charge_id)
                .bind(order.request.amount_cents)
                .execute(ctx.conn())
                .await?;
                let processed = PaymentProcessed {
                    order_id: order.order_id,
                    charge_id: charge_id.clone(),
                    amount_cents: order.request.amount_cents,
                    ship_to: order.request.ship_to.clone(),
                };
                ctx.emit(&self.outcomes.payments, key, &processed)?;
                StepOutcome::completed_with(&serde_json::json!({ "charge_id": charge_id }))
            }
            ChargeResult::Declined { reason } => {
                sqlx::query(
                    "INSERT INTO payments (order_id, amount_cents, status, reason) \
                     VALUES ($1, $2, 'DECLINED', $3)",
                )
                .bind(order.order_id)
                .bind(order.request.amount_cents)
                .bind(&reason)
                .execute(ctx.conn())
                .await?;
                let failed = PaymentSetback::PaymentFailed(Setback {
                    order_id: order.order_id,
                    reason: reason.clone(),
                });
                ctx.emit(&self.outcomes.payment_setbacks, key, &failed)?;
                Ok(StepOutcome::rejected(reason))
            }
        }
    }
}

/// `refund-payment` on `ShipmentFailed` (or, as `compensate-process-payment`, on the `RefundPayment`
/// command): refunds the charge (its own step key, so a redelivery refunds once) and emits
/// `PaymentRefunded`. As a compensation it tolerates a missing effect: with nothing charged there is
/// nothing to refund, and it confirms all the same.
#[derive(Debug)]
pub struct RefundPayment {
    /// The gateway.
    pub gateway: PaymentGateway,
    /// The payment service's database, to find the charge.
    pub pool: PgPool,
    /// The step's name (the orchestrator's compensation is `compensate-process-payment`).
    pub name: StepName,
    /// What it consumes.
    pub refunds: Topic<Refund>,
    /// Where its outcome goes.
    pub outcomes: Outcomes,
}

/// The charge and its refund; `None` when nothing was charged.
#[derive(Debug)]
pub struct Refunded(Option<(String, String)>);

impl TwoPhaseStep for RefundPayment {
    type Payload = Refund;
    type Response = Refunded;

    fn name(&self) -> StepName {
        self.name.clone()
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        Subscription::to(&self.refunds)
    }

    async fn call(&self, msg: &Message<Refund>) -> Result<Refunded, StepError> {
        let charge_id: Option<String> = sqlx::query_scalar(
            "SELECT charge_id FROM payments WHERE order_id = $1 AND charge_id IS NOT NULL",
        )
        .bind(msg.payload().setback().order_id)
        .fetch_optional(&self.pool)
        .await?;
        let Some(charge_id) = charge_id else {
            return Ok(Refunded(None));
        };
        let refund_id = self
            .gateway
            .refund(msg.external_key().as_str(), &charge_id)
            .await
            .map_err(StepError::transient)?;
        Ok(Refunded(Some((charge_id, refund_id))))
    }

    async fn complete(
        &self,
        msg: &Message<Refund>,
        refunded: Refunded,
        ctx: &mut StepContext<'_>,
    ) -> StepResult {
        let setback = msg.payload().setback();
        if let Refunded(Some((_, refund_id))) = &refunded {
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
        ctx.emit(
            &self.outcomes.payment_setbacks,
            setback.order_id.to_string(),
            &done,
        )?;
        let (charge_id, refund_id) = refunded.0.unzip();
        StepOutcome::completed_with(&serde_json::json!({
            "charge_id": charge_id,
            "refund_id": refund_id,
        }))
    }
}
