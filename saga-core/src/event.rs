//! Typed events and topics: a payload knows the event types (`ce_type`) it travels under, and a topic knows
//! the events it carries, so that subscribing and emitting need no strings.

use std::borrow::Cow;
use std::marker::PhantomData;

use serde::de::DeserializeOwned;

/// A step's payload: decoded from a message's event type and its JSON payload.
///
/// Every `Deserialize` type is one (the event type is not needed to decode it); an event family
/// (`#[derive(SagaEvent)]` on an enum) decodes the variant the event type names.
pub trait FromEvent: Sized + Send + Sync + 'static {
    /// Decodes the JSON `payload` of a message of type `event_type`.
    fn from_event(event_type: &str, payload: &[u8]) -> Result<Self, serde_json::Error>;
}

impl<T: DeserializeOwned + Send + Sync + 'static> FromEvent for T {
    fn from_event(_event_type: &str, payload: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(payload)
    }
}

/// A saga event: a payload and the event types it travels under (its `ce_type` header). Derive it:
///
/// - on a struct (which also derives `Serialize` and `Deserialize`): one event type, the struct's name
///   unless `#[saga(event_type = "...")]` says otherwise;
/// - on an enum of events that share payloads, one payload per variant: one event type per variant.
///
/// The derive names the crate `saga_consumer`; add `#[saga(crate = "saga_core")]` where only `saga-core` is
/// a dependency.
///
/// # Examples
///
/// ```
/// use saga_core::{SagaEvent, Subscription, Topic};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize, SagaEvent)]
/// #[saga(crate = "saga_core")]
/// struct PaymentProcessed { order_id: String }
///
/// /// Why an order was set back: one payload, three event types.
/// #[derive(Serialize, Deserialize)]
/// struct Setback { order_id: String, reason: String }
///
/// #[derive(SagaEvent)]
/// #[saga(crate = "saga_core")]
/// enum OrderSetback { PaymentFailed(Setback), PaymentRefunded(Setback), ShipmentFailed(Setback) }
///
/// let payments: Topic<PaymentProcessed> = Topic::new("saga.payments");
/// let setbacks: Topic<OrderSetback> = Topic::new("saga.payments");
/// assert_eq!(Subscription::to(&payments).len(), 1);
/// assert_eq!(Subscription::to(&setbacks).len(), 3);
/// let failed = OrderSetback::PaymentFailed(Setback { order_id: "7".into(), reason: "declined".into() });
/// assert_eq!(failed.event_type(), "PaymentFailed");
/// ```
pub trait SagaEvent: FromEvent {
    /// The event types of this payload: one for a struct, one per variant for a family.
    const TYPES: &'static [&'static str];

    /// The event type of this value.
    fn event_type(&self) -> &'static str;

    /// The payload as JSON (a family's: its variant's value).
    fn to_json(&self) -> Result<Vec<u8>, serde_json::Error>;
}

/// A topic and the events it carries: subscribing to it and emitting to it need no event type string.
///
/// # Examples
///
/// ```
/// use saga_core::{SagaEvent, Topic};
///
/// #[derive(serde::Serialize, serde::Deserialize, SagaEvent)]
/// #[saga(crate = "saga_core")]
/// struct OrderCreated { order_id: u64 }
///
/// // Fixed names can be constants; names made at run time (a prefix per environment) use `Topic::new`.
/// const ORDERS: Topic<OrderCreated> = Topic::fixed("saga.orders");
/// let staging: Topic<OrderCreated> = Topic::new(format!("staging.{}", ORDERS.name()));
/// assert_eq!(staging.name(), "staging.saga.orders");
/// ```
pub struct Topic<E> {
    name: Cow<'static, str>,
    event: PhantomData<fn() -> E>,
}

impl<E> Topic<E> {
    /// The topic `name`, carrying events `E`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: Cow::Owned(name.into()),
            event: PhantomData,
        }
    }

    /// The topic `name`, carrying events `E`, as a constant.
    pub const fn fixed(name: &'static str) -> Self {
        Self {
            name: Cow::Borrowed(name),
            event: PhantomData,
        }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl<E> Clone for Topic<E> {
    fn clone(&self) -> Self {
        Self {
            name: self.name.clone(),
            event: PhantomData,
        }
    }
}

impl<E> std::fmt::Debug for Topic<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Topic")
            .field(&self.name)
            .field(&std::any::type_name::<E>())
            .finish()
    }
}

impl<E> PartialEq for Topic<E> {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl<E> Eq for Topic<E> {}
