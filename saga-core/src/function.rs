//! Steps written as async functions: `step("mark-order-paid", mark_order_paid).on(&payments)`, as an axum
//! handler is a function and tower's `service_fn` makes a service of one.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use tower_layer::Layer;
use tower_service::Service;

use crate::context::StepContext;
use crate::envelope::Message;
use crate::event::{SagaEvent, Topic};
use crate::key::StepName;
use crate::step::{SagaStep, StepError, StepOutcome, StepResult, Subscription};

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

/// A step made of an async function: see [`step`] and [`step_with`]. It is also a `tower::Service` of
/// [`StepCall`]s, so stock tower layers wrap it ([`FnStep::layer`]).
pub struct FnStep<E, F, S = ()> {
    name: StepName,
    subscriptions: Vec<Subscription>,
    handler: Arc<Handler<F, S>>,
    event: std::marker::PhantomData<fn() -> E>,
}

/// A function step's handler and its state, shared by the step and its service clones.
struct Handler<F, S> {
    function: F,
    state: S,
}

/// The handler of a step without state.
#[doc(hidden)]
#[derive(Debug)]
pub struct Stateless<F>(F);

/// The handler of a step with state.
#[doc(hidden)]
#[derive(Debug)]
pub struct Stateful<F>(F);

/// Calls a function step's handler, with or without its state: what [`Stateless`] and [`Stateful`] share.
#[doc(hidden)]
pub trait Invoke<E, S>: Send + Sync + 'static {
    /// Calls the handler.
    fn invoke<'a>(
        &'a self,
        msg: &'a Message<E>,
        ctx: &'a mut StepContext<'a>,
        state: &'a S,
    ) -> impl Future<Output = StepResult> + Send + 'a;
}

impl<E: 'static, F> Invoke<E, ()> for Stateless<F>
where
    F: for<'a> StepFn<'a, E>,
{
    fn invoke<'a>(
        &'a self,
        msg: &'a Message<E>,
        ctx: &'a mut StepContext<'a>,
        _state: &'a (),
    ) -> impl Future<Output = StepResult> + Send + 'a {
        self.0.call(msg, ctx)
    }
}

impl<E: 'static, S: 'static, F> Invoke<E, S> for Stateful<F>
where
    F: for<'a> StepFnWith<'a, E, S>,
{
    fn invoke<'a>(
        &'a self,
        msg: &'a Message<E>,
        ctx: &'a mut StepContext<'a>,
        state: &'a S,
    ) -> impl Future<Output = StepResult> + Send + 'a {
        self.0.call(msg, ctx, state)
    }
}

impl<E, F, S> Clone for FnStep<E, F, S> {
    fn clone(&self) -> Self {
        Self {
            name: self.name.clone(),
            subscriptions: self.subscriptions.clone(),
            handler: Arc::clone(&self.handler),
            event: std::marker::PhantomData,
        }
    }
}

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
/// If `name` is not a valid step name (see [`StepName`]), at once: it is a literal, so a test or the
/// service's first start finds it.
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
        handler: Arc::new(Handler {
            function: Stateless(handler),
            state: (),
        }),
        event: std::marker::PhantomData,
    }
}

/// Like [`step`], for a handler that needs state of the step's own (topics it emits to, a client): the
/// handler gets `&state` as its third argument.
///
/// # Panics
/// If `name` is not a valid step name (see [`step`]), at once.
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
        handler: Arc::new(Handler {
            function: Stateful(handler),
            state,
        }),
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

    /// Wraps the step's handler in a tower `layer`: `tower::timeout::TimeoutLayer`,
    /// `tower::limit::ConcurrencyLimitLayer`, a layer of one's own. The layer sees each message's
    /// [`StepCall`] inside the transaction; the framework's own layers (deduplication, the transaction,
    /// tracing, panic catching) stay outside it. An error the layer returns is the step's: a [`StepError`]
    /// as it is, any other (a timeout's `Elapsed`) transient, so the message is retried and, once its
    /// budget is spent, dead-lettered with that error as the reason.
    ///
    /// As axum does with a route's service, the layered service is cloned for each message, made ready and
    /// called: a layer whose state must span messages shares it between its clones (a concurrency limit's
    /// semaphore, a counter behind an `Arc`). A layer whose service is not `Clone` does not fit.
    ///
    /// # Examples
    ///
    /// ```
    /// use saga_core::{Message, SagaEvent, StepCall, StepContext, StepOutcome, StepResult, Topic, step};
    /// use serde::{Deserialize, Serialize};
    ///
    /// #[derive(Serialize, Deserialize, SagaEvent)]
    /// #[saga(crate = "saga_core")]
    /// struct PaymentProcessed { order_id: i64 }
    ///
    /// async fn mark_paid(msg: &Message<PaymentProcessed>, ctx: &mut StepContext<'_>) -> StepResult {
    ///     Ok(StepOutcome::completed())
    /// }
    ///
    /// /// Counts the calls that reach the handler: any `tower_layer::Layer` of a step's service will do.
    /// #[derive(Clone)]
    /// struct Counted<S>(S, std::sync::Arc<std::sync::atomic::AtomicU64>);
    ///
    /// impl<'a, S: tower_service::Service<StepCall<'a, PaymentProcessed>>> tower_service::Service<StepCall<'a, PaymentProcessed>> for Counted<S> {
    ///     type Response = S::Response;
    ///     type Error = S::Error;
    ///     type Future = S::Future;
    ///     fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), S::Error>> {
    ///         self.0.poll_ready(cx)
    ///     }
    ///     fn call(&mut self, call: StepCall<'a, PaymentProcessed>) -> S::Future {
    ///         self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    ///         self.0.call(call)
    ///     }
    /// }
    ///
    /// let calls = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    /// let layer = tower_layer::layer_fn(move |inner| Counted(inner, calls.clone()));
    /// let mark_paid = step("mark-order-paid", mark_paid)
    ///     .on(&Topic::new("saga.payments"))
    ///     .layer(layer);
    /// # let _ = mark_paid;
    /// ```
    #[must_use]
    pub fn layer<L: Layer<Self>>(self, layer: L) -> LayeredStep<E, L::Service> {
        LayeredStep {
            name: self.name.clone(),
            subscriptions: self.subscriptions.clone(),
            service: layer.layer(self),
            event: std::marker::PhantomData,
        }
    }
}

/// One call of a step's handler: the decoded message and the open transaction. A function step is a
/// `tower::Service` of it ([`FnStep`]), so that tower's layers wrap a step ([`FnStep::layer`]).
#[derive(Debug)]
#[non_exhaustive]
pub struct StepCall<'a, E> {
    /// The message.
    pub msg: &'a Message<E>,
    /// The open transaction and the events emitted so far.
    pub ctx: StepContext<'a>,
}

impl<'a, E> StepCall<'a, E> {
    /// A call of `msg` in `ctx`'s transaction.
    pub fn new(msg: &'a Message<E>, ctx: StepContext<'a>) -> Self {
        Self { msg, ctx }
    }
}

impl<'a, E, F, S> Service<StepCall<'a, E>> for FnStep<E, F, S>
where
    E: SagaEvent,
    S: Send + Sync + 'static,
    F: Invoke<E, S>,
{
    type Response = StepOutcome;
    type Error = StepError;
    type Future = Pin<Box<dyn Future<Output = StepResult> + Send + 'a>>;

    fn poll_ready(&mut self, _cx: &mut TaskContext<'_>) -> Poll<Result<(), StepError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, call: StepCall<'a, E>) -> Self::Future {
        let handler = Arc::clone(&self.handler);
        Box::pin(async move {
            let StepCall { msg, mut ctx } = call;
            let mut ctx = ctx.reborrow();
            handler.function.invoke(msg, &mut ctx, &handler.state).await
        })
    }
}

impl<E, F, S> SagaStep for FnStep<E, F, S>
where
    E: SagaEvent,
    S: Send + Sync + 'static,
    F: Invoke<E, S>,
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
        self.handler
            .function
            .invoke(msg, &mut ctx, &self.handler.state)
            .await
    }
}

/// A function step wrapped in tower layers: see [`FnStep::layer`].
pub struct LayeredStep<E, Svc> {
    name: StepName,
    subscriptions: Vec<Subscription>,
    /// Cloned for each message, so that every call has its own readiness (and its own waker); the layers'
    /// shared state (a concurrency limit's semaphore) is shared by the clones.
    service: Svc,
    event: std::marker::PhantomData<fn() -> E>,
}

impl<E, Svc> std::fmt::Debug for LayeredStep<E, Svc> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayeredStep")
            .field("name", &self.name)
            .field("subscriptions", &self.subscriptions)
            .finish_non_exhaustive()
    }
}

impl<E, Svc> LayeredStep<E, Svc> {
    /// Wraps the layered handler in one more `layer` (outside the ones before it).
    #[must_use]
    pub fn layer<L: Layer<Svc>>(self, layer: L) -> LayeredStep<E, L::Service> {
        LayeredStep {
            name: self.name,
            subscriptions: self.subscriptions,
            service: layer.layer(self.service),
            event: std::marker::PhantomData,
        }
    }
}

/// A layer's error as the step's: a [`StepError`] as it is, any other transient.
pub(crate) fn step_error(error: impl Into<BoxError>) -> StepError {
    match error.into().downcast::<StepError>() {
        Ok(step) => *step,
        Err(other) => StepError::transient(other),
    }
}

/// An error as tower layers return them.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

impl<E, Svc> SagaStep for LayeredStep<E, Svc>
where
    E: SagaEvent,
    Svc: for<'a> Service<StepCall<'a, E>, Response = StepOutcome> + Clone + Send + Sync + 'static,
    for<'a> <Svc as Service<StepCall<'a, E>>>::Future: Send,
    for<'a> <Svc as Service<StepCall<'a, E>>>::Error: Into<BoxError>,
{
    type Payload = E;

    fn name(&self) -> StepName {
        self.name.clone()
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        self.subscriptions.clone()
    }

    async fn handle(&self, msg: &Message<E>, ctx: &mut StepContext<'_>) -> StepResult {
        let mut service = self.service.clone();
        std::future::poll_fn(|cx| Service::<StepCall<'_, E>>::poll_ready(&mut service, cx))
            .await
            .map_err(step_error)?;
        service
            .call(StepCall::new(msg, ctx.reborrow()))
            .await
            .map_err(step_error)
    }
}
