//! The shipping service: `arrange-shipment` on `PaymentProcessed`. Addresses in Atlantis cannot be served:
//! the shipment fails (a business rejection), which starts the compensation.

use saga_consumer::{
    Event, Message, SagaStep, StepContext, StepName, StepOutcome, StepResult, Subscription,
};
use uuid::Uuid;

use crate::events::{OrderSetback, PaymentProcessed, ShipmentArranged, types};

/// `arrange-shipment` on `PaymentProcessed` (or the `ArrangeShipment` command): emits `ShipmentArranged`,
/// or `ShipmentFailed`.
#[derive(Debug)]
pub struct ArrangeShipment {
    /// What it consumes.
    pub consumes: Subscription,
    /// Where its outcome goes.
    pub emits_to: String,
}

impl SagaStep for ArrangeShipment {
    type Payload = PaymentProcessed;

    fn name(&self) -> StepName {
        StepName::from_static("arrange-shipment")
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        vec![self.consumes.clone()]
    }

    async fn handle(
        &self,
        msg: &Message<PaymentProcessed>,
        ctx: &mut StepContext<'_>,
    ) -> StepResult {
        let payment = &msg.payload;
        let shipment_id = Uuid::now_v7();
        let key = payment.order_id.to_string();
        if payment.ship_to.contains("Atlantis") {
            let reason = format!("cannot ship to {}", payment.ship_to);
            sqlx::query(
                "INSERT INTO shipments (order_id, shipment_id, ship_to, status, reason) \
                 VALUES ($1, $2, $3, 'FAILED', $4)",
            )
            .bind(payment.order_id)
            .bind(shipment_id)
            .bind(&payment.ship_to)
            .bind(&reason)
            .execute(ctx.conn())
            .await?;
            ctx.emit(Event::new(
                types::SHIPMENT_FAILED,
                &self.emits_to,
                key,
                &OrderSetback {
                    order_id: payment.order_id,
                    reason: reason.clone(),
                },
            )?);
            return Ok(StepOutcome::rejected(reason));
        }
        sqlx::query(
            "INSERT INTO shipments (order_id, shipment_id, ship_to, status) VALUES ($1, $2, $3, 'ARRANGED')",
        )
        .bind(payment.order_id)
        .bind(shipment_id)
        .bind(&payment.ship_to)
        .execute(ctx.conn())
        .await?;
        ctx.emit_to(
            &self.emits_to,
            key,
            &ShipmentArranged {
                order_id: payment.order_id,
                shipment_id,
            },
        )?;
        StepOutcome::completed_with(&serde_json::json!({ "shipment_id": shipment_id }))
    }
}
