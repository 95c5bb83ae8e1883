//! The saga's events and topics.
//!
//! ```text
//! POST /orders ──▶ OrderCreated ──▶ process-payment ──▶ PaymentProcessed ──▶ arrange-shipment ──▶ ShipmentArranged ──▶ complete-order
//!                                       │                     │                       │
//!                                       └▶ PaymentFailed ─────┼──▶ cancel-order        └▶ ShipmentFailed ──▶ refund-payment ──▶ PaymentRefunded ──▶ cancel-order
//!                                                             └──▶ mark-order-paid
//! ```

use saga_consumer::SagaEvent;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Event type names (`ce_type`) of the events whose payload is shared by several types; the others are
/// typed ([`OrderCreated`], [`PaymentProcessed`], [`ShipmentArranged`]: see [`SagaEvent`]).
pub mod types {
    /// Its payment was declined.
    pub const PAYMENT_FAILED: &str = "PaymentFailed";
    /// Its payment was refunded (compensation).
    pub const PAYMENT_REFUNDED: &str = "PaymentRefunded";
    /// Its shipment could not be arranged.
    pub const SHIPMENT_FAILED: &str = "ShipmentFailed";
    /// Orchestrated mode: the command to charge an order.
    pub const PROCESS_PAYMENT: &str = "ProcessPayment";
    /// Orchestrated mode: the command to refund an order (the compensation of the payment).
    pub const REFUND_PAYMENT: &str = "RefundPayment";
    /// Orchestrated mode: the command to ship an order.
    pub const ARRANGE_SHIPMENT: &str = "ArrangeShipment";
}

/// The saga's topics under a common prefix: one per producing service for the choreographed saga, and
/// for the orchestrated one a command topic per participant and the orchestrator's reply topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topics {
    /// Events of the order service.
    pub orders: String,
    /// Events of the payment service.
    pub payments: String,
    /// Events of the shipping service.
    pub shipping: String,
    /// Commands to the payment service (orchestrated).
    pub payment_commands: String,
    /// Commands to the shipping service (orchestrated).
    pub shipping_commands: String,
    /// Replies to the order service's orchestrator (orchestrated).
    pub order_replies: String,
}

impl Topics {
    /// `{prefix}.orders`, `{prefix}.payments`, `{prefix}.shipping`, `{prefix}.payment-commands`,
    /// `{prefix}.shipping-commands`, `{prefix}.order-replies`.
    pub fn with_prefix(prefix: &str) -> Self {
        Self {
            orders: format!("{prefix}.orders"),
            payments: format!("{prefix}.payments"),
            shipping: format!("{prefix}.shipping"),
            payment_commands: format!("{prefix}.payment-commands"),
            shipping_commands: format!("{prefix}.shipping-commands"),
            order_replies: format!("{prefix}.order-replies"),
        }
    }

    /// Every topic.
    pub fn all(&self) -> [&str; 6] {
        [
            &self.orders,
            &self.payments,
            &self.shipping,
            &self.payment_commands,
            &self.shipping_commands,
            &self.order_replies,
        ]
    }
}

/// The order as the client submits it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderRequest {
    /// Who orders.
    pub customer: String,
    /// What it costs.
    pub amount_cents: i64,
    /// The card to charge; cards ending in `0002` are declined.
    pub card: String,
    /// Where to ship; the shipping service cannot ship to `Atlantis`.
    pub ship_to: String,
}

/// An order was accepted (`orders` topic).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderCreated {
    /// The order.
    pub order_id: Uuid,
    /// What the client submitted.
    #[serde(flatten)]
    pub request: OrderRequest,
}

/// The payment was charged (`payments` topic).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentProcessed {
    /// The order.
    pub order_id: Uuid,
    /// The gateway's charge.
    pub charge_id: String,
    /// The amount charged.
    pub amount_cents: i64,
    /// Where to ship (passed on for the shipping service).
    pub ship_to: String,
}

/// The saga ended or is being compensated for a reason (`PaymentFailed`, `PaymentRefunded`,
/// `ShipmentFailed`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderSetback {
    /// The order.
    pub order_id: Uuid,
    /// Why.
    pub reason: String,
}

/// The shipment was arranged (`shipping` topic).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShipmentArranged {
    /// The order.
    pub order_id: Uuid,
    /// The shipment.
    pub shipment_id: Uuid,
}

impl SagaEvent for OrderCreated {
    const TYPE: &'static str = "OrderCreated";
}

impl SagaEvent for PaymentProcessed {
    const TYPE: &'static str = "PaymentProcessed";
}

impl SagaEvent for ShipmentArranged {
    const TYPE: &'static str = "ShipmentArranged";
}
