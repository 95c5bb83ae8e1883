//! Steps written as async functions: `step("mark-order-paid", mark_order_paid).on(&payments)`, as an axum
//! handler is a function and tower's `service_fn` makes a service of one.

use std::future::Future;

use crate::context::StepContext;
use crate::envelope::Message;
use crate::event::{SagaEvent, Topic};
use crate::key::StepName;
use crate::step::{SagaStep, StepResult, Subscription};

/// A step's handler as an async function of the message and the transaction: an `async fn` taking
/// `(&Message<P>, &mut StepContext<'_>)`, or an async closure `async |msg: &Message<P>, ctx: &mut
/// StepContext<'_>| { … }`. Implemented for every such function; its future must be `Send`.
pub trait StepFn<'a, P: 'a>: Send + Sync + 'static {
    /// The future the call returns.
    type Future: Future<Output = StepResult> + Send + 'a;

    /// Calls the function.
    fn call(&self, msg: &'a Message<P>, ctx: &'a mut StepContext<'a>) -> Self::Future;
}

impl<'a, P: 'a, F, Fut> StepFn<'a, P> for F
where
    F: Fn(&'a Message<P>, &'a mut StepContext<'a>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = StepResult> + Send + 'a,
{
    type Future = Fut;

    fn call(&self, msg: &'a Message<P>, ctx: &'a mut StepContext<'a>) -> Fut {
        self(msg, ctx)
    }
}

/// A step's handler with the step's own state: an `async fn` taking `(&Message<P>, &mut StepContext<'_>,
/// &S)`, where `S` is what [`step_with`] was given (topics to emit to, a client), or such an async closure.
pub trait StepFnWith<'a, P: 'a, S: 'a>: Send + Sync + 'static {
    /// The future the call returns.
    type Future: Future<Output = StepResult> + Send + 'a;

    /// Calls the function.
    fn call(&self, msg: &'a Message<P>, ctx: &'a mut StepContext<'a>, state: &'a S)
    -> Self::Future;
}

impl<'a, P: 'a, S: 'a, F, Fut> StepFnWith<'a, P, S> for F
where
    F: Fn(&'a Message<P>, &'a mut StepContext<'a>, &'a S) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = StepResult> + Send + 'a,
{
    type Future = Fut;

    fn call(&self, msg: &'a Message<P>, ctx: &'a mut StepContext<'a>, state: &'a S) -> Fut {
        self(msg, ctx, state)
    }
}

/// A step made of an async function: see [`step`] and [`step_with`].
pub struct FnStep<E, F, S = ()> {
    name: StepName,
    subscriptions: Vec<Subscription>,
    handler: F,
    state: S,
    event: std::marker::PhantomData<fn() -> E>,
}

/// The handler of a step without state.
#[doc(hidden)]
#[derive(Debug)]
pub struct Stateless<F>(F);

/// The handler of a step with state.
#[doc(hidden)]
#[derive(Debug)]
pub struct Stateful<F>(F);

impl<E, F, S> std::fmt::Debug for FnStep<E, F, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FnStep")
            .field("name", &self.name)
            .field("subscriptions", &self.subscriptions)
            .finish_non_exhaustive()
    }
}

/// A transactional step named `name` whose handler is the async function `handler`, consuming the topics
/// [`FnStep::on`] adds. The name is the step's identity (part of every step key): renaming a step makes
/// every message it had processed new to it.
///
/// # Panics
/// If `name` is not a valid step name (see [`StepName`]): a literal, checked when the service is built.
///
/// # Examples
///
/// ```
/// use saga_core::{Message, SagaEvent, StepContext, StepOutcome, StepResult, Topic, step};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize, SagaEvent)]
/// #[saga(crate = "saga_core")]
/// struct PaymentProcessed { order_id: i64 }
///
/// async fn mark_order_paid(msg: &Message<PaymentProcessed>, ctx: &mut StepContext<'_>) -> StepResult {
///     sqlx::query("UPDATE orders SET status = 'PAID' WHERE id = $1")
///         .bind(msg.payload().order_id)
///         .execute(ctx.conn())
///         .await?;
///     Ok(StepOutcome::completed())
/// }
///
/// let payments: Topic<PaymentProcessed> = Topic::new("saga.payments");
/// let mark_paid = step("mark-order-paid", mark_order_paid).on(&payments);
/// // Or a closure:
/// let audit = step("audit-payment", async |msg: &Message<PaymentProcessed>, ctx: &mut StepContext<'_>| {
///     sqlx::query("INSERT INTO audit (order_id) VALUES ($1)").bind(msg.payload().order_id).execute(ctx.conn()).await?;
///     Ok(StepOutcome::completed())
/// })
/// .on(&payments);
/// # let _ = (mark_paid, audit);
/// ```
pub fn step<E, F>(name: &'static str, handler: F) -> FnStep<E, Stateless<F>>
where
    E: SagaEvent,
    F: for<'a> StepFn<'a, E>,
{
    FnStep {
        name: StepName::from_static(name),
        subscriptions: Vec::new(),
        handler: Stateless(handler),
        state: (),
        event: std::marker::PhantomData,
    }
}

/// Like [`step`], for a handler that needs state of the step's own (topics it emits to, a client): the
/// handler gets `&state` as its third argument.
///
/// # Panics
/// If `name` is not a valid step name (see [`step`]).
///
/// # Examples
///
/// ```
/// use saga_core::{Message, SagaEvent, StepContext, StepOutcome, StepResult, Topic, step_with};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize, SagaEvent)]
/// #[saga(crate = "saga_core")]
/// struct PaymentProcessed { order_id: i64 }
///
/// #[derive(Serialize, Deserialize, SagaEvent)]
/// #[saga(crate = "saga_core")]
/// struct ShipmentArranged { order_id: i64 }
///
/// async fn arrange(msg: &Message<PaymentProcessed>, ctx: &mut StepContext<'_>, shipping: &Topic<ShipmentArranged>) -> StepResult {
///     let order_id = msg.payload().order_id;
///     ctx.emit(shipping, order_id.to_string(), &ShipmentArranged { order_id })?;
///     Ok(StepOutcome::completed())
/// }
///
/// let arrange_shipment = step_with("arrange-shipment", Topic::new("saga.shipping"), arrange)
///     .on(&Topic::new("saga.payments"));
/// # let _ = arrange_shipment;
/// ```
pub fn step_with<E, S, F>(name: &'static str, state: S, handler: F) -> FnStep<E, Stateful<F>, S>
where
    E: SagaEvent,
    S: Send + Sync + 'static,
    F: for<'a> StepFnWith<'a, E, S>,
{
    FnStep {
        name: StepName::from_static(name),
        subscriptions: Vec::new(),
        handler: Stateful(handler),
        state,
        event: std::marker::PhantomData,
    }
}

impl<E: SagaEvent, F, S> FnStep<E, F, S> {
    /// Consumes the events of `topic` too.
    #[must_use]
    pub fn on(mut self, topic: &Topic<E>) -> Self {
        self.subscriptions.extend(Subscription::to(topic));
        self
    }
}

impl<E, F> SagaStep for FnStep<E, Stateless<F>>
where
    E: SagaEvent,
    F: for<'a> StepFn<'a, E>,
{
    type Payload = E;

    fn name(&self) -> StepName {
        self.name.clone()
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        self.subscriptions.clone()
    }

    async fn handle(&self, msg: &Message<E>, ctx: &mut StepContext<'_>) -> StepResult {
        let mut ctx = ctx.reborrow();
        self.handler.0.call(msg, &mut ctx).await
    }
}

impl<E, F, S> SagaStep for FnStep<E, Stateful<F>, S>
where
    E: SagaEvent,
    S: Send + Sync + 'static,
    F: for<'a> StepFnWith<'a, E, S>,
{
    type Payload = E;

    fn name(&self) -> StepName {
        self.name.clone()
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        self.subscriptions.clone()
    }

    async fn handle(&self, msg: &Message<E>, ctx: &mut StepContext<'_>) -> StepResult {
        let mut ctx = ctx.reborrow();
        self.handler.0.call(msg, &mut ctx, &self.state).await
    }
}
