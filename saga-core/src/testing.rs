//! Helpers for testing a step: build a [`Message`] in one line, and run a step's handler against a real
//! transaction, getting back its outcome and the events it emitted.
//!
//! # Examples
//!
//! ```no_run
//! use saga_core::testing::{self, event};
//! use saga_core::{Message, SagaEvent, StepContext, StepOutcome, StepResult, Topic, step};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize, SagaEvent)]
//! #[saga(crate = "saga_core")]
//! struct OrderPlaced { order_id: i64 }
//!
//! async fn reserve(msg: &Message<OrderPlaced>, ctx: &mut StepContext<'_>) -> StepResult {
//!     sqlx::query("INSERT INTO reservations (order_id) VALUES ($1)")
//!         .bind(msg.payload().order_id)
//!         .execute(ctx.conn())
//!         .await?;
//!     Ok(StepOutcome::completed())
//! }
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/test").await?;
//! let msg = event(OrderPlaced { order_id: 7 }).key("order-7").tenant("acme").build();
//! let mut tx = pool.begin().await?;
//! let handled = testing::handle(&step("reserve", reserve).on(&Topic::new("orders")), msg, &mut tx).await;
//! assert_eq!(handled.result?, StepOutcome::completed());
//! assert!(handled.emitted.is_empty());
//! // Drop `tx` (or roll it back) to leave nothing behind.
//! # Ok(()) }
//! ```

use serde::de::DeserializeOwned;
use sqlx::PgConnection;

use crate::context::StepContext;
use crate::envelope::{EventMetadata, Message, Origin, OutboxMessage};
use crate::event::SagaEvent;
use crate::headers::{Headers, names};
use crate::key::StepName;
use crate::step::{SagaStep, StepResult, TwoPhaseStep};

/// Starts building a message carrying `payload`. Defaults: key `test-key`, tenant `default`, event type
/// `Test` (see [`MessageBuilder::event_type`]; [`event`] takes an event's own), topic `test`, partition 0,
/// offset 0, step `test-step` (the `testing::handle` functions use the step's own).
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
    let event_type = payload.event_type();
    message(payload).event_type(event_type)
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
/// assert_eq!(msg.event_type(), "OrderPlaced");
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
        Message::from_parts(self.payload, metadata, &step, self.origin, headers)
    }
}

/// An event a handler emitted, as the outbox would get it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Emitted(OutboxMessage);

impl Emitted {
    /// Its event type (`ce_type`).
    pub fn event_type(&self) -> &str {
        self.header(names::CE_TYPE).unwrap_or_default()
    }

    /// Its topic.
    pub fn topic(&self) -> &str {
        &self.0.topic
    }

    /// Its Kafka key.
    pub fn partition_key(&self) -> Option<&str> {
        self.0.partition_key.as_deref()
    }

    /// Its payload, decoded.
    pub fn payload<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.0.payload)
    }

    /// The value of its header `name` (the framework's: `idempotency-key`, `tenant-id`, …; or the
    /// handler's own).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.0
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_ref())
    }
}

/// What a step's handler did with a message in [`handle`] or [`complete`].
#[derive(Debug)]
#[non_exhaustive]
pub struct Handled {
    /// What it returned.
    pub result: StepResult,
    /// The events it emitted (written to the outbox by the runtime if the result is `Ok`).
    pub emitted: Vec<Emitted>,
}

/// Runs `step`'s handler for `msg` on `conn` (open a transaction and pass it, so that the test can roll it
/// back), as the runtime would, without the key claim or the outbox write. The message's step key is
/// derived for `step`.
pub async fn handle<S: SagaStep>(
    step: &S,
    msg: Message<S::Payload>,
    conn: &mut PgConnection,
) -> Handled {
    let name = step.name();
    let msg = msg.for_step(&name);
    let mut emitted = Vec::new();
    let result = {
        let mut ctx =
            StepContext::new(conn, msg.lineage(), name.as_str(), &mut emitted).answering(&msg);
        step.handle(&msg, &mut ctx).await
    };
    Handled {
        result,
        emitted: emitted.into_iter().map(Emitted).collect(),
    }
}

/// Runs a two-phase `step` for `msg`: its external call, then its completion on `conn`, as the runtime
/// would, without the lease. Returns the call's error as the result if the call fails.
pub async fn complete<S: TwoPhaseStep>(
    step: &S,
    msg: Message<S::Payload>,
    conn: &mut PgConnection,
) -> Handled {
    let name = step.name();
    let msg = msg.for_step(&name);
    let response = match step.call(&msg).await {
        Ok(response) => response,
        Err(e) => {
            return Handled {
                result: Err(e),
                emitted: Vec::new(),
            };
        }
    };
    let mut emitted = Vec::new();
    let result = {
        let mut ctx =
            StepContext::new(conn, msg.lineage(), name.as_str(), &mut emitted).answering(&msg);
        step.complete(&msg, response, &mut ctx).await
    };
    Handled {
        result,
        emitted: emitted.into_iter().map(Emitted).collect(),
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
        assert_eq!(msg.tenant().as_str(), "acme");
        assert_eq!(msg.event_type(), "Placed");
        assert_eq!(
            (msg.topic(), msg.partition(), msg.offset()),
            ("orders", 2, 41)
        );
        assert_eq!(msg.header("x-extra"), Some("1"));
        assert_eq!(msg.external_key().as_str(), "acme:order-7:reserve");
        let plain = message(()).build();
        assert_eq!(plain.idempotency_key().as_str(), "test-key");
        assert_eq!(plain.tenant(), &TenantId::default());
    }
}
