//! Two-phase steps written as two async functions: `two_phase("charge", client, charge, record_charge)`,
//! the external call and the completing transaction, with the fencing, leases and external keys the
//! framework's (see [`TwoPhaseStep`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use tower_layer::Layer;
use tower_service::Service;

use crate::context::StepContext;
use crate::envelope::Message;
use crate::event::{SagaEvent, Topic};
use crate::function::{BoxError, step_error};
use crate::key::StepName;
use crate::step::{StepError, StepOutcome, StepResult, Subscription, TwoPhaseStep};

/// A two-phase step's external call as an async function of the message and the step's state (the
/// client): an `async fn(&Message<P>, &S) -> Result<R, StepError>`, or such an async closure. It runs
/// outside any transaction and may run more than once for one message, so it hands the outside system
/// [`Message::external_key`] as that system's idempotency key.
pub trait CallFn<'a, P: 'a, S: 'a, R>: Send + Sync + 'static {
    /// The future the call returns.
    type Future: Future<Output = Result<R, StepError>> + Send + 'a;

    /// Calls the function.
    fn call(&self, msg: &'a Message<P>, state: &'a S) -> Self::Future;
}

impl<'a, P: 'a, S: 'a, R, F, Fut> CallFn<'a, P, S, R> for F
where
    F: Fn(&'a Message<P>, &'a S) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<R, StepError>> + Send + 'a,
{
    type Future = Fut;

    fn call(&self, msg: &'a Message<P>, state: &'a S) -> Fut {
        self(msg, state)
    }
}

/// A two-phase step's completion as an async function: `async fn(&Message<P>, R, &mut StepContext<'_>,
/// &S) -> StepResult`, given what the call returned, in the transaction that marks the step key done.
pub trait CompleteFn<'a, P: 'a, S: 'a, R>: Send + Sync + 'static {
    /// The future the call returns.
    type Future: Future<Output = StepResult> + Send + 'a;

    /// Calls the function.
    fn call(
        &self,
        msg: &'a Message<P>,
        response: R,
        ctx: &'a mut StepContext<'a>,
        state: &'a S,
    ) -> Self::Future;
}

impl<'a, P: 'a, S: 'a, R, F, Fut> CompleteFn<'a, P, S, R> for F
where
    F: Fn(&'a Message<P>, R, &'a mut StepContext<'a>, &'a S) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = StepResult> + Send + 'a,
{
    type Future = Fut;

    fn call(
        &self,
        msg: &'a Message<P>,
        response: R,
        ctx: &'a mut StepContext<'a>,
        state: &'a S,
    ) -> Fut {
        self(msg, response, ctx, state)
    }
}

/// A two-phase step made of two async functions: see [`two_phase`].
pub struct TwoPhaseFn<E, S, R, C, K> {
    name: StepName,
    subscriptions: Vec<Subscription>,
    lease: Duration,
    state: S,
    call: C,
    complete: K,
    types: std::marker::PhantomData<fn() -> (E, R)>,
}

impl<E, S, R, C, K> std::fmt::Debug for TwoPhaseFn<E, S, R, C, K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TwoPhaseFn")
            .field("name", &self.name)
            .field("subscriptions", &self.subscriptions)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

/// A two-phase step named `name`: `call` makes the external call outside any transaction (with `state`,
/// the client it needs), and `complete` records its result in the transaction that marks the step key
/// done. The runtime leases the key before the call and fences the completion by the lease, exactly as
/// for a [`TwoPhaseStep`]; the lease lasts 30 seconds unless [`TwoPhaseFn::lease`] says otherwise. A step
/// whose functions need no state passes `()`.
///
/// # Panics
/// If `name` is not a valid step name (see [`StepName`]), at once: it is a literal, so a test or the
/// service's first start finds it.
///
/// # Examples
///
/// ```
/// use saga_core::{Message, SagaEvent, StepContext, StepError, StepOutcome, StepResult, Topic, two_phase};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize, SagaEvent)]
/// #[saga(crate = "saga_core")]
/// struct OrderPlaced { order_id: i64, cents: i64 }
///
/// /// A payment provider's client (its own idempotency on the key it is handed).
/// struct Provider;
/// impl Provider {
///     async fn charge(&self, idempotency_key: &str, cents: i64) -> Result<String, std::io::Error> {
///         Ok(format!("ch_{idempotency_key}_{cents}"))
///     }
/// }
///
/// async fn charge(msg: &Message<OrderPlaced>, provider: &Provider) -> Result<String, StepError> {
///     // The external key carries the tenant: never hand the bare step key to a provider.
///     provider.charge(msg.external_key().as_str(), msg.payload().cents).await.map_err(StepError::transient)
/// }
///
/// async fn record_charge(msg: &Message<OrderPlaced>, charge_id: String, ctx: &mut StepContext<'_>, _: &Provider) -> StepResult {
///     sqlx::query("INSERT INTO payments (order_id, charge_id) VALUES ($1, $2)")
///         .bind(msg.payload().order_id)
///         .bind(&charge_id)
///         .execute(ctx.conn())
///         .await?;
///     StepOutcome::completed_with(&serde_json::json!({ "charge_id": charge_id }))
/// }
///
/// let orders: Topic<OrderPlaced> = Topic::new("saga.orders");
/// let charge = two_phase("charge", Provider, charge, record_charge).on(&orders);
/// # let _ = charge;
/// ```
pub fn two_phase<E, S, R, C, K>(
    name: &'static str,
    state: S,
    call: C,
    complete: K,
) -> TwoPhaseFn<E, S, R, C, K>
where
    E: SagaEvent,
    S: Send + Sync + 'static,
    R: Send + 'static,
    C: for<'a> CallFn<'a, E, S, R>,
    K: for<'a> CompleteFn<'a, E, S, R>,
{
    TwoPhaseFn {
        name: StepName::from_static(name),
        subscriptions: Vec::new(),
        lease: Duration::from_secs(30),
        state,
        call,
        complete,
        types: std::marker::PhantomData,
    }
}

impl<E: SagaEvent, S, R, C, K> TwoPhaseFn<E, S, R, C, K> {
    /// Consumes the events of `topic` too.
    #[must_use]
    pub fn on(mut self, topic: &Topic<E>) -> Self {
        self.subscriptions.extend(Subscription::to(topic));
        self
    }

    /// How long a lease lasts (default 30 s): after that another worker may take the key over, so it must
    /// exceed the longest external call.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Wraps the completion (the transaction that records the call's result) in a tower `layer`: the test
    /// kit's faults, say. `two_phase(..).layer(fail_after_handler(1))` loses each message's first
    /// completion after the outside call: the message runs again, and the call with it, with the same
    /// external key, which the outside system must absorb. The call itself is not wrapped. Set `.on(..)`
    /// and `.lease(..)` first: the layered step takes no more of them.
    #[must_use]
    pub fn layer<L>(self, layer: L) -> LayeredTwoPhase<E, S, R, C, L::Service>
    where
        L: Layer<Completion<E, S, R, K>>,
    {
        let state = Arc::new(self.state);
        LayeredTwoPhase {
            name: self.name,
            subscriptions: self.subscriptions,
            lease: self.lease,
            state: Arc::clone(&state),
            call: self.call,
            service: layer.layer(Completion {
                state,
                complete: Arc::new(self.complete),
                types: std::marker::PhantomData,
            }),
            types: std::marker::PhantomData,
        }
    }
}

/// One completion of a two-phase step: the message, what the outside call returned and the open
/// transaction. The completion is a `tower::Service` of it ([`Completion`]), so that tower's layers wrap
/// it ([`TwoPhaseFn::layer`]).
#[derive(Debug)]
#[non_exhaustive]
pub struct CompleteCall<'a, E, R> {
    /// The message.
    pub msg: &'a Message<E>,
    /// What the outside call returned.
    pub response: R,
    /// The open transaction and the events emitted so far.
    pub ctx: StepContext<'a>,
}

impl<'a, E, R> CompleteCall<'a, E, R> {
    /// A completion of `msg`, given what the call returned, in `ctx`'s transaction (for a layer that
    /// rebuilds the call it passes on).
    pub fn new(msg: &'a Message<E>, response: R, ctx: StepContext<'a>) -> Self {
        Self { msg, response, ctx }
    }
}

/// A two-phase step's completion function with its state, as a `tower::Service` of [`CompleteCall`].
pub struct Completion<E, S, R, K> {
    state: Arc<S>,
    complete: Arc<K>,
    types: std::marker::PhantomData<fn() -> (E, R)>,
}

impl<E, S, R, K> Clone for Completion<E, S, R, K> {
    fn clone(&self) -> Self {
        Self {
            state: Arc::clone(&self.state),
            complete: Arc::clone(&self.complete),
            types: std::marker::PhantomData,
        }
    }
}

impl<E, S, R, K> std::fmt::Debug for Completion<E, S, R, K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion").finish_non_exhaustive()
    }
}

impl<'a, E, S, R, K> Service<CompleteCall<'a, E, R>> for Completion<E, S, R, K>
where
    E: SagaEvent,
    S: Send + Sync + 'static,
    R: Send + 'static,
    K: for<'b> CompleteFn<'b, E, S, R>,
{
    type Response = StepOutcome;
    type Error = StepError;
    type Future = Pin<Box<dyn Future<Output = StepResult> + Send + 'a>>;

    fn poll_ready(&mut self, _cx: &mut TaskContext<'_>) -> Poll<Result<(), StepError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, call: CompleteCall<'a, E, R>) -> Self::Future {
        let (state, complete) = (Arc::clone(&self.state), Arc::clone(&self.complete));
        Box::pin(async move {
            let mut owned = call.ctx;
            let mut ctx = owned.reborrow();
            complete
                .call(call.msg, call.response, &mut ctx, &*state)
                .await
        })
    }
}

/// A two-phase step whose completion is wrapped in tower layers: see [`TwoPhaseFn::layer`].
pub struct LayeredTwoPhase<E, S, R, C, Svc> {
    name: StepName,
    subscriptions: Vec<Subscription>,
    lease: Duration,
    state: Arc<S>,
    call: C,
    /// Cloned for each message, as a layered step's service is.
    service: Svc,
    types: std::marker::PhantomData<fn() -> (E, R)>,
}

impl<E, S, R, C, Svc> std::fmt::Debug for LayeredTwoPhase<E, S, R, C, Svc> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayeredTwoPhase")
            .field("name", &self.name)
            .field("subscriptions", &self.subscriptions)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl<E, S, R, C, Svc> LayeredTwoPhase<E, S, R, C, Svc> {
    /// Wraps the completion in one more layer (outside the ones before).
    #[must_use]
    pub fn layer<L: Layer<Svc>>(self, layer: L) -> LayeredTwoPhase<E, S, R, C, L::Service> {
        LayeredTwoPhase {
            name: self.name,
            subscriptions: self.subscriptions,
            lease: self.lease,
            state: self.state,
            call: self.call,
            service: layer.layer(self.service),
            types: std::marker::PhantomData,
        }
    }
}

impl<E, S, R, C, Svc> TwoPhaseStep for LayeredTwoPhase<E, S, R, C, Svc>
where
    E: SagaEvent,
    S: Send + Sync + 'static,
    R: Send + 'static,
    C: for<'a> CallFn<'a, E, S, R>,
    Svc: for<'a> Service<CompleteCall<'a, E, R>, Response = StepOutcome>
        + Clone
        + Send
        + Sync
        + 'static,
    for<'a> <Svc as Service<CompleteCall<'a, E, R>>>::Future: Send,
    for<'a> <Svc as Service<CompleteCall<'a, E, R>>>::Error: Into<BoxError>,
{
    type Payload = E;
    type Response = R;

    fn name(&self) -> StepName {
        self.name.clone()
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        self.subscriptions.clone()
    }

    fn lease(&self) -> Duration {
        self.lease
    }

    async fn call(&self, msg: &Message<E>) -> Result<R, StepError> {
        self.call.call(msg, &*self.state).await
    }

    async fn complete(
        &self,
        msg: &Message<E>,
        response: R,
        ctx: &mut StepContext<'_>,
    ) -> StepResult {
        let mut service = self.service.clone();
        std::future::poll_fn(|cx| Service::<CompleteCall<'_, E, R>>::poll_ready(&mut service, cx))
            .await
            .map_err(step_error)?;
        let call = CompleteCall {
            msg,
            response,
            ctx: ctx.reborrow(),
        };
        service.call(call).await.map_err(step_error)
    }
}

impl<E, S, R, C, K> TwoPhaseStep for TwoPhaseFn<E, S, R, C, K>
where
    E: SagaEvent,
    S: Send + Sync + 'static,
    R: Send + 'static,
    C: for<'a> CallFn<'a, E, S, R>,
    K: for<'a> CompleteFn<'a, E, S, R>,
{
    type Payload = E;
    type Response = R;

    fn name(&self) -> StepName {
        self.name.clone()
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        self.subscriptions.clone()
    }

    fn lease(&self) -> Duration {
        self.lease
    }

    async fn call(&self, msg: &Message<E>) -> Result<R, StepError> {
        self.call.call(msg, &self.state).await
    }

    async fn complete(
        &self,
        msg: &Message<E>,
        response: R,
        ctx: &mut StepContext<'_>,
    ) -> StepResult {
        let mut ctx = ctx.reborrow();
        self.complete
            .call(msg, response, &mut ctx, &self.state)
            .await
    }
}
