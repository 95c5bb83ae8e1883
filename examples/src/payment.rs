//! The payment service: `process-payment` charges an order through the gateway (two-phase mode, since the
//! gateway is outside the database) and `refund-payment` compensates a failed shipment. Each step is wired
//! by what it consumes and where it sends its outcome, so that the same steps serve the choreographed saga
//! (events) and the orchestrated one (commands and replies).

use saga_consumer::{
    Event, Message, StepContext, StepError, StepName, StepOutcome, StepResult, Subscription,
    TwoPhaseStep,
};
use sqlx::PgPool;

use crate::events::{OrderCreated, OrderSetback, PaymentProcessed, types};
use crate::gateway::{ChargeResult, PaymentGateway};

/// `process-payment` on `OrderCreated` (or the `ProcessPayment` command): charges the card, emits
/// `PaymentProcessed` or, when the card is declined, `PaymentFailed` (a business rejection).
#[derive(Debug)]
pub struct ProcessPayment {
    /// The gateway.
    pub gateway: PaymentGateway,
    /// What it consumes.
    pub consumes: Subscription,
    /// Where its outcome goes.
    pub emits_to: String,
}

impl TwoPhaseStep for ProcessPayment {
    type Payload = OrderCreated;
    type Response = ChargeResult;

    fn name(&self) -> StepName {
        StepName::from_static("process-payment")
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        vec![self.consumes.clone()]
    }

    async fn call(&self, msg: &Message<OrderCreated>) -> Result<ChargeResult, StepError> {
        let order = &msg.payload;
        // The external key (the step key with its tenant) is the gateway's idempotency key: after a crash
        // this call repeats, the charge not; and another tenant's order with the same client key is charged
        // on its own.
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
        msg: &Message<OrderCreated>,
        response: ChargeResult,
        ctx: &mut StepContext<'_>,
    ) -> StepResult {
        let order = &msg.payload;
        let order_id = order.order_id.to_string();
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
                ctx.emit_to(
                    &self.emits_to,
                    order_id,
                    &PaymentProcessed {
                        order_id: order.order_id,
                        charge_id: charge_id.clone(),
                        amount_cents: order.request.amount_cents,
                        ship_to: order.request.ship_to.clone(),
                    },
                )?;
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
                ctx.emit(Event::new(
                    types::PAYMENT_FAILED,
                    &self.emits_to,
                    order_id,
                    &OrderSetback {
                        order_id: order.order_id,
                        reason: reason.clone(),
                    },
                )?);
                Ok(StepOutcome::rejected(reason))
            }
        }
    }
}

/// `refund-payment` on `ShipmentFailed` (or `compensate-process-payment` on the `RefundPayment` command):
/// refunds the charge (its own step key, so a redelivery refunds once) and emits `PaymentRefunded`. As a
/// compensation it tolerates a missing effect: with nothing charged there is nothing to refund, and it
/// confirms all the same.
#[derive(Debug)]
pub struct RefundPayment {
    /// The gateway.
    pub gateway: PaymentGateway,
    /// The payment service's database, to find the charge.
    pub pool: PgPool,
    /// The step's name.
    pub name: StepName,
    /// What it consumes.
    pub consumes: Subscription,
    /// Where its outcome goes.
    pub emits_to: String,
}

/// The charge and its refund; `None` when nothing was charged.
#[derive(Debug)]
pub struct Refund(Option<(String, String)>);

impl TwoPhaseStep for RefundPayment {
    type Payload = OrderSetback;
    type Response = Refund;

    fn name(&self) -> StepName {
        self.name.clone()
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        vec![self.consumes.clone()]
    }

    async fn call(&self, msg: &Message<OrderSetback>) -> Result<Refund, StepError> {
        let charge_id: Option<String> = sqlx::query_scalar(
            "SELECT charge_id FROM payments WHERE order_id = $1 AND charge_id IS NOT NULL",
        )
        .bind(msg.payload.order_id)
        .fetch_optional(&self.pool)
        .await?;
        let Some(charge_id) = charge_id else {
            return Ok(Refund(None));
        };
        let refund_id = self
            .gateway
            .refund(msg.external_key().as_str(), &charge_id)
            .await
            .map_err(StepError::transient)?;
        Ok(Refund(Some((charge_id, refund_id))))
    }

    async fn complete(
        &self,
        msg: &Message<OrderSetback>,
        refund: Refund,
        ctx: &mut StepContext<'_>,
    ) -> StepResult {
        if let Refund(Some((_, refund_id))) = &refund {
            sqlx::query(
                "UPDATE payments SET status = 'REFUNDED', refund_id = $2, reason = $3, updated_at = now() \
                 WHERE order_id = $1",
            )
            .bind(msg.payload.order_id)
            .bind(refund_id)
            .bind(&msg.payload.reason)
            .execute(ctx.conn())
            .await?;
        }
        ctx.emit(Event::new(
            types::PAYMENT_REFUNDED,
            &self.emits_to,
            msg.payload.order_id.to_string(),
            &OrderSetback {
                order_id: msg.payload.order_id,
                reason: format!("refunded: {}", msg.payload.reason),
            },
        )?);
        let (charge_id, refund_id) = refund.0.unzip();
        StepOutcome::completed_with(&serde_json::json!({
            "charge_id": charge_id,
            "refund_id": refund_id,
        }))
    }
}
