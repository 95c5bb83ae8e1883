//! Typed events: a payload type that knows its event type (`ce_type`), so that routing cannot swap a topic
//! and a type.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// A saga event's payload, with the event type it travels under (its `ce_type` header).
///
/// With it, a step subscribes with [`crate::Subscription::of`], and a handler emits with
/// [`crate::StepContext::emit_to`]: the type comes from the payload, never from a string that could be
/// swapped with the topic. The string forms stay for dynamic cases.
///
/// # Examples
///
/// ```
/// use saga_core::{SagaEvent, Subscription};
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct PaymentProcessed {
///     order_id: String,
/// }
///
/// impl SagaEvent for PaymentProcessed {
///     const TYPE: &'static str = "PaymentProcessed";
/// }
///
/// let sub = Subscription::of::<PaymentProcessed>("saga.payments");
/// assert_eq!((sub.topic.as_str(), sub.event_type.as_str()), ("saga.payments", "PaymentProcessed"));
/// ```
pub trait SagaEvent: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The event type, as in the `ce_type` header.
    const TYPE: &'static str;
}
