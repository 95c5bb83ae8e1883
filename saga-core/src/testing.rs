//! Helpers for testing a step: build a [`Message`] in one line, and run a step's handler against a real
//! transaction, getting back its outcome and the events it emitted.
//!
//! # Examples
//!
//! ```no_run
//! use saga_core::testing::{self, message};
//! use saga_core::{Message, SagaEvent, SagaStep, StepContext, StepName, StepOutcome, StepResult, Subscription};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct OrderPlaced { order_id: i64 }
//! impl SagaEvent for OrderPlaced { const TYPE: &'static str = "OrderPlaced"; }
//!
//! struct Reserve;
//! impl SagaStep for Reserve {
//!     type Payload = OrderPlaced;
//!     fn name(&self) -> StepName { StepName::from_static("reserve") }
//!     fn subscriptions(&self) -> Vec<Subscription> { vec![Subscription::of::<OrderPlaced>("orders")] }
//!     async fn handle(&self, msg: &Message<OrderPlaced>, ctx: &mut StepContext<'_>) -> StepResult {
//!         sqlx::query("INSERT INTO reservations (order_id) VALUES ($1)")
//!             .bind(msg.payload.order_id)
//!             .execute(ctx.conn())
//!             .await?;
//!         Ok(StepOutcome::completed())
//!     }
//! }
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/test").await?;
//! let msg = message(OrderPlaced { order_id: 7 }).key("order-7").tenant("acme").build();
//! let mut tx = pool.begin().await?;
//! let handled = testing::handle(&Reserve, msg, &mut tx).await;
//! assert_eq!(handled.result?, StepOutcome::completed());
//! assert!(handled.emitted.is_empty());
//! // Drop `tx` (or roll it back) to leave nothing behind.
//! # Ok(()) }
//! ```

use sqlx::PgConnection;

use crate::context::StepContext;
use crate::envelope::{EventMetadata, Message, Origin, OutboxMessage};
use crate::event::SagaEvent;
use crate::headers::{Headers, names};
use crate::key::StepName;
use crate::step::{SagaStep, StepResult, TwoPhaseStep};

/// Starts building a message carrying `payload`. Defaults: key `test-key`, tenant `default`, event type
/// `E::TYPE` if the payload is a [`SagaEvent`] (else `Test`, see [`MessageBuilder::event_type`]), topic
/// `test`, partition 0, offset 0, step `test-step` (the `testing::handle` functions use the step's own).
pub fn message<P>(payload: P) -> MessageBuilder<P> {
    MessageBuilder {
        payload,
        key: "test-key".to_owned(),
        tenant: None,
        event_type: "Test".to_owned(),
        step: "test-step".to_owned(),
        origin: Origin {
            topic: "test".to_owned(),
            partition: 0,
            offset: 0,
        },
        headers: Vec::new(),
    }
}

/// Starts building a message carrying the event `payload`, with its event type.
pub fn event<E: SagaEvent>(payload: E) -> MessageBuilder<E> {
    message(payload).event_type(E::TYPE)
}

/// Builds a [`Message`] for tests. See [`message`].
///
/// # Examples
///
/// ```
/// let msg = saga_core::testing::message(serde_json::json!({ "order_id": 7 }))
///     .key("order-7")
///     .tenant("acme")
///     .event_type("OrderPlaced")
///     .step("reserve")
///     .build();
/// assert_eq!(msg.step_key.as_str(), "order-7:reserve");
/// assert_eq!(msg.external_key().as_str(), "acme:order-7:reserve");
/// ```
#[derive(Debug, Clone)]
pub struct MessageBuilder<P> {
    payload: P,
    key: String,
    tenant: Option<String>,
    event_type: String,
    step: String,
    origin: Origin,
    headers: Vec<(String, String)>,
}

impl<P> MessageBuilder<P> {
    /// The saga's original idempotency key (the `idempotency-key` header).
    #[must_use]
    pub fn key(mut self, key: &str) -> Self {
        key.clone_into(&mut self.key);
        self
    }

    /// The tenant (the `tenant-id` header).
    #[must_use]
    pub fn tenant(mut self, tenant: &str) -> Self {
        self.tenant = Some(tenant.to_owned());
        self
    }

    /// The event type (the `ce_type` header).
    #[must_use]
    pub fn event_type(mut self, event_type: &str) -> Self {
        event_type.clone_into(&mut self.event_type);
        self
    }

    /// The step the message's step key is derived for.
    #[must_use]
    pub fn step(mut self, step: &str) -> Self {
        step.clone_into(&mut self.step);
        self
    }

    /// Where the message came from.
    #[must_use]
    pub fn origin(mut self, topic: &str, partition: i32, offset: i64) -> Self {
        self.origin = Origin {
            topic: topic.to_owned(),
            partition,
            offset,
        };
        self
    }

    /// Another header.
    #[must_use]
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// The message.
    ///
    /// # Panics
    /// If the key, the tenant or the step name is not valid (see [`crate::IdempotencyKey`], [`crate::TenantId`],
    /// [`StepName`]): a test's mistake.
    pub fn build(self) -> Message<P> {
        let mut headers = Headers::new()
            .with(names::IDEMPOTENCY_KEY, self.key.as_str())
            .with(names::CE_TYPE, self.event_type.as_str());
        if let Some(tenant) = &self.tenant {
            headers.push_str(names::TENANT_ID, tenant.as_str());
        }
        for (name, value) in self.headers {
            headers.push_str(name, value);
        }
        let metadata = EventMetadata::from_headers(&headers)
            .unwrap_or_else(|e| panic!("a test message with invalid headers: {e}"));
        let step = StepName::new(&self.step)
            .unwrap_or_else(|e| panic!("a test message for an invalid step name: {e}"));
        Message {
            payload: self.payload,
            step_key: metadata.step_key(&step),
            metadata,
            origin: self.origin,
            headers,
        }
    }
}

/// What a step's handler did with a message in [`handle`] or [`complete`].
#[derive(Debug)]
#[non_exhaustive]
pub struct Handled {
    /// What it returned.
    pub result: StepResult,
    /// The events it emitted (written to the outbox by the runtime if the result is `Ok`).
    pub emitted: Vec<OutboxMessage>,
}

/// Runs `step`'s handler for `msg` on `conn` (open a transaction and pass it, so that the test can roll it
/// back), as the runtime would, without the key claim or the outbox write. The message's step key is
/// derived for `step`.
pub async fn handle<S: SagaStep>(
    step: &S,
    mut msg: Message<S::Payload>,
    conn: &mut PgConnection,
) -> Handled {
    let name = step.name();
    msg.step_key = msg.metadata.step_key(&name);
    let mut ctx = StepContext::new(conn, msg.lineage(), name.as_str());
    let result = step.handle(&msg, &mut ctx).await;
    Handled {
        result,
        emitted: ctx.into_emitted(),
    }
}

/// Runs a two-phase `step` for `msg`: its external call, then its completion on `conn`, as the runtime
/// would, without the lease. Returns the call's error as the result if the call fails.
pub async fn complete<S: TwoPhaseStep>(
    step: &S,
    mut msg: Message<S::Payload>,
    conn: &mut PgConnection,
) -> Handled {
    let name = step.name();
    msg.step_key = msg.metadata.step_key(&name);
    let response = match step.call(&msg).await {
        Ok(response) => response,
        Err(e) => {
            return Handled {
                result: Err(e),
                emitted: Vec::new(),
            };
        }
    };
    let mut ctx = StepContext::new(conn, msg.lineage(), name.as_str());
    let result = step.complete(&msg, response, &mut ctx).await;
    Handled {
        result,
        emitted: ctx.into_emitted(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::TenantId;

    #[test]
    fn a_message_in_one_line_carries_what_the_runtime_would_derive() {
        let msg = message(5_u32)
            .key("order-7")
            .tenant("acme")
            .event_type("Placed")
            .step("reserve")
            .origin("orders", 2, 41)
            .header("x-extra", "1")
            .build();
        assert_eq!(msg.step_key.as_str(), "order-7:reserve");
        assert_eq!(msg.tenant().as_str(), "acme");
        assert_eq!(msg.metadata.event_type, "Placed");
        assert_eq!(msg.origin.offset, 41);
        assert_eq!(msg.headers.get_str("x-extra"), Ok(Some("1")));
        assert_eq!(msg.external_key().as_str(), "acme:order-7:reserve");
        let plain = message(()).build();
        assert_eq!(plain.metadata.idempotency_key.as_str(), "test-key");
        assert_eq!(plain.tenant(), &TenantId::default());
    }
}
