//! The shipping service: `arrange-shipment` on `PaymentProcessed` (or the `ArrangeShipment` command).
//! Addresses in Atlantis cannot be served: the shipment fails (a business rejection), which starts the
//! compensation.

use saga_consumer::{Message, StepContext, StepOutcome, StepResult};
use uuid::Uuid;

use crate::events::{Outcomes, Setback, Ship, ShipmentArranged, ShipmentSetback};

/// `arrange-shipment`: records the shipment and emits `ShipmentArranged`, or `ShipmentFailed` for an
/// address it cannot serve.
pub async fn arrange_shipment(
    msg: &Message<Ship>,
    ctx: &mut StepContext<'_>,
    outcomes: &Outcomes,
) -> StepResult {
    let (payment, command) = (msg.payload().payment(), msg.payload().is_command());
    let (order_id, shipment_id) = (payment.order_id, Uuid::now_v7());
    if payment.ship_to.contains("Atlantis") {
        let reason = format!("cannot ship to {}", payment.ship_to);
        insert_shipment(ctx, order_id, shipment_id, &payment.ship_to, Some(&reason)).await?;
        let failed = ShipmentSetback::ShipmentFailed(Setback {
            order_id,
            reason: reason.clone(),
        });
        Outcomes::send(
            ctx,
            command,
            &outcomes.shipment_setbacks,
            order_id.to_string(),
            &failed,
        )?;
        return Ok(StepOutcome::rejected(reason));
    }
    insert_shipment(ctx, order_id, shipment_id, &payment.ship_to, None).await?;
    let arranged = ShipmentArranged {
        order_id,
        shipment_id,
    };
    Outcomes::send(
        ctx,
        command,
        &outcomes.shipments,
        order_id.to_string(),
        &arranged,
    )?;
    StepOutcome::completed_with(&serde_json::json!({ "shipment_id": shipment_id }))
}

/// Records a shipment: arranged, or failed for `reason`.
async fn insert_shipment(
    ctx: &mut StepContext<'_>,
    order_id: Uuid,
    shipment_id: Uuid,
    ship_to: &str,
    failure: Option<&str>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO shipments (order_id, shipment_id, ship_to, status, reason) \
         VALUES ($1, $2, $3, CASE WHEN $4::text IS NULL THEN 'ARRANGED' ELSE 'FAILED' END, $4)",
    )
    .bind(order_id)
    .bind(shipment_id)
    .bind(ship_to)
    .bind(failure)
    .execute(ctx.conn())
    .await?;
    Ok(())
}
