//! The saga's events and topics.
//!
//! ```text
//! POST /orders ──▶ OrderCreated ──▶ process-payment ──▶ PaymentProcessed ──▶ arrange-shipment ──▶ ShipmentArranged ──▶ complete-order
//!                                       │                     │                       │
//!                                       └▶ PaymentFailed ─────┼──▶ cancel-order        └▶ ShipmentFailed ──▶ refund-payment ──▶ PaymentRefunded ──▶ cancel-order
//!                                                             └──▶ mark-order-paid
//! ```
//!
//! Orchestrated, the order service sends the participants commands that carry the same payloads
//! (`ProcessPayment`, `RefundPayment`, `ArrangeShipment`), so each participant's step takes a family of
//! two event types that share a payload: the event of the choreographed saga, or the command.

use saga_consumer::{SagaEvent, SharedStep, StepContext, StepError, Topic};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The payment step: the orchestrator's step and the payment service's, and its compensation, the
/// payment service's refund. Declared once, here, where both services read it.
pub const PROCESS_PAYMENT: SharedStep =
    SharedStep::new("process-payment").compensated_by("compensate-process-payment");

/// The shipping step, the orchestrator's and the shipping service's.
pub const ARRANGE_SHIPMENT: SharedStep = SharedStep::new("arrange-shipment");

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

/// An order was accepted: the saga's first event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, SagaEvent)]
pub struct OrderCreated {
    /// The order.
    pub order_id: Uuid,
    /// What the client submitted.
    #[serde(flatten)]
    pub request: OrderRequest,
}

/// The payment was charged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, SagaEvent)]
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

/// The shipment was arranged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, SagaEvent)]
pub struct ShipmentArranged {
    /// The order.
    pub order_id: Uuid,
    /// The shipment.
    pub shipment_id: Uuid,
}

/// Why an order was set back: the payload of every failure and compensation event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Setback {
    /// The order.
    pub order_id: Uuid,
    /// Why.
    pub reason: String,
}

/// The payment service's setbacks: `cancel-order` takes either, under one step key.
#[derive(Debug, Clone, PartialEq, Eq, SagaEvent)]
pub enum PaymentSetback {
    /// The card was declined.
    PaymentFailed(Setback),
    /// The charge was refunded (the compensation of a failed shipment).
    PaymentRefunded(Setback),
}

/// The shipping service's setback.
#[derive(Debug, Clone, PartialEq, Eq, SagaEvent)]
pub enum ShipmentSetback {
    /// The address cannot be served.
    ShipmentFailed(Setback),
}

/// What charges an order: the order itself (choreographed), or the orchestrator's command.
#[derive(Debug, Clone, PartialEq, Eq, SagaEvent)]
pub enum Charge {
    /// An order was accepted.
    OrderCreated(OrderCreated),
    /// The orchestrator asks for the charge.
    ProcessPayment(OrderCreated),
}

/// What refunds a charge: a failed shipment (choreographed), or the orchestrator's compensation.
#[derive(Debug, Clone, PartialEq, Eq, SagaEvent)]
pub enum Refund {
    /// The shipment failed.
    ShipmentFailed(Setback),
    /// The orchestrator compensates the payment.
    RefundPayment(Setback),
}

/// What ships an order: a processed payment (choreographed), or the orchestrator's command.
#[derive(Debug, Clone, PartialEq, Eq, SagaEvent)]
pub enum Ship {
    /// The payment was charged.
    PaymentProcessed(PaymentProcessed),
    /// The orchestrator asks for the shipment.
    ArrangeShipment(PaymentProcessed),
}

/// What the payment service replies to the orchestrator's `ProcessPayment`.
#[derive(Debug, Clone, PartialEq, Eq, SagaEvent)]
pub enum PaymentReply {
    /// Charged.
    PaymentProcessed(PaymentProcessed),
    /// Declined.
    PaymentFailed(Setback),
}

/// What the payment service replies to the orchestrator's `RefundPayment`.
#[derive(Debug, Clone, PartialEq, Eq, SagaEvent)]
pub enum RefundReply {
    /// Refunded (or nothing was charged).
    PaymentRefunded(Setback),
}

/// What the shipping service replies to the orchestrator's `ArrangeShipment`.
#[derive(Debug, Clone, PartialEq, Eq, SagaEvent)]
pub enum ShipmentReply {
    /// Arranged.
    ShipmentArranged(ShipmentArranged),
    /// The address cannot be served.
    ShipmentFailed(Setback),
}

impl Charge {
    /// Whether it is the orchestrator's command, which is answered with a reply.
    pub fn is_command(&self) -> bool {
        matches!(self, Self::ProcessPayment(_))
    }

    /// The order to charge.
    pub fn order(&self) -> &OrderCreated {
        match self {
            Self::OrderCreated(order) | Self::ProcessPayment(order) => order,
        }
    }
}

impl Refund {
    /// Whether it is the orchestrator's command, which is answered with a reply.
    pub fn is_command(&self) -> bool {
        matches!(self, Self::RefundPayment(_))
    }

    /// Why the charge is refunded.
    pub fn setback(&self) -> &Setback {
        match self {
            Self::ShipmentFailed(setback) | Self::RefundPayment(setback) => setback,
        }
    }
}

impl Ship {
    /// Whether it is the orchestrator's command, which is answered with a reply.
    pub fn is_command(&self) -> bool {
        matches!(self, Self::ArrangeShipment(_))
    }

    /// The payment the shipment follows.
    pub fn payment(&self) -> &PaymentProcessed {
        match self {
            Self::PaymentProcessed(payment) | Self::ArrangeShipment(payment) => payment,
        }
    }
}

/// The saga's topics under a common prefix, typed by the events each service reads from them: one topic per
/// producing service for the choreographed saga, and for the orchestrated one a command topic per
/// participant and the orchestrator's reply topic.
#[derive(Debug, Clone)]
pub struct Topics {
    /// `{prefix}.orders`: orders accepted.
    pub orders: Topic<OrderCreated>,
    /// `{prefix}.orders`, as the payment service reads it.
    pub charges: Topic<Charge>,
    /// `{prefix}.payments`: payments charged.
    pub payments: Topic<PaymentProcessed>,
    /// `{prefix}.payments`: payments declined or refunded.
    pub payment_setbacks: Topic<PaymentSetback>,
    /// `{prefix}.payments`, as the shipping service reads it.
    pub shipments_to_arrange: Topic<Ship>,
    /// `{prefix}.shipping`: shipments arranged.
    pub shipments: Topic<ShipmentArranged>,
    /// `{prefix}.shipping`: shipments failed.
    pub shipment_setbacks: Topic<ShipmentSetback>,
    /// `{prefix}.shipping`, as the payment service reads it.
    pub refunds: Topic<Refund>,
    /// `{prefix}.payment-commands`: charges the orchestrator asks for.
    pub payment_commands: Topic<Charge>,
    /// `{prefix}.payment-commands`: refunds the orchestrator asks for.
    pub refund_commands: Topic<Refund>,
    /// `{prefix}.shipping-commands`: shipments the orchestrator asks for.
    pub shipping_commands: Topic<Ship>,
    /// `{prefix}.order-replies`: the participants' replies to the orchestrator.
    pub order_replies: String,
}

impl Topics {
    /// The topics under `prefix`.
    pub fn with_prefix(prefix: &str) -> Self {
        let name = |topic: &str| format!("{prefix}.{topic}");
        Self {
            orders: Topic::new(name("orders")),
            charges: Topic::new(name("orders")),
            payments: Topic::new(name("payments")),
            payment_setbacks: Topic::new(name("payments")),
            shipments_to_arrange: Topic::new(name("payments")),
            shipments: Topic::new(name("shipping")),
            shipment_setbacks: Topic::new(name("shipping")),
            refunds: Topic::new(name("shipping")),
            payment_commands: Topic::new(name("payment-commands")),
            refund_commands: Topic::new(name("payment-commands")),
            shipping_commands: Topic::new(name("shipping-commands")),
            order_replies: name("order-replies"),
        }
    }

    /// Every topic name.
    pub fn all(&self) -> [&str; 6] {
        [
            self.orders.name(),
            self.payments.name(),
            self.shipments.name(),
            self.payment_commands.name(),
            self.shipping_commands.name(),
            &self.order_replies,
        ]
    }

    /// Where a participant's outcomes go in the choreographed saga (in the orchestrated one they answer the
    /// orchestrator's commands: [`Outcomes::send`]).
    pub fn outcomes(&self) -> Outcomes {
        Outcomes {
            payments: self.payments.clone(),
            payment_setbacks: self.payment_setbacks.clone(),
            shipments: self.shipments.clone(),
            shipment_setbacks: self.shipment_setbacks.clone(),
        }
    }
}

/// Where the participants' outcomes go (see [`Topics::outcomes`]).
#[derive(Debug, Clone)]
pub struct Outcomes {
    /// Payments charged.
    pub payments: Topic<PaymentProcessed>,
    /// Payments declined or refunded.
    pub payment_setbacks: Topic<PaymentSetback>,
    /// Shipments arranged.
    pub shipments: Topic<ShipmentArranged>,
    /// Shipments failed.
    pub shipment_setbacks: Topic<ShipmentSetback>,
}

impl Outcomes {
    /// Sends a participant's outcome `event`: as its answer to the orchestrator when the step's message is
    /// the orchestrator's command (`command`, by the message's type: [`StepContext::reply`], to the reply
    /// topic the command names, keyed by the saga), else to `topic`, keyed by `key`, for the choreographed
    /// saga's next step. A command that names no reply topic fails the step (a dead letter saying so): it
    /// is never answered where nobody listens.
    pub fn send<E: SagaEvent>(
        ctx: &mut StepContext<'_>,
        command: bool,
        topic: &Topic<E>,
        key: impl Into<String>,
        event: &E,
    ) -> Result<(), StepError> {
        if command {
            ctx.reply(event)
        } else {
            ctx.emit(topic, key, event)
        }
    }
}
