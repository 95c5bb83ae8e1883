//! Fault injection for a step's tests: tower layers ([`saga_consumer::FnStep::layer`]) that make a step fail where
//! a real deployment fails, so that a test sees whether the step's effects still happen exactly once.
//!
//! - [`fail_after_handler`]: the handler ran, then the step fails before its transaction commits (as when
//!   the process dies between the two, or the commit itself fails). Everything the handler wrote through
//!   its [`saga_consumer::StepContext`] rolls back and the message is retried; what it did elsewhere (a second
//!   pool, an HTTP call without the external key) happens again. A step whose test passes with this layer
//!   is idempotent in the way the framework means.
//! - [`fail_before_handler`]: the step fails before its handler runs (a dependency briefly down).
//!
//! On a two-phase step ([`saga_consumer::TwoPhaseFn::layer`]) they wrap its completion: `fail_after_handler` loses
//! the completion after the outside call was made, the failure that matters most for such a step: the
//! message runs again, its call with it, and the outside system must absorb the repeat (the external key).
//! There `fail_before_handler` fails before the completion runs, also after the call was made: the same
//! repeat, without the completion's writes to roll back.
//!
//! Each counts per message and step (the message's external key: its tenant, its saga's key and the
//! step), so a layer shared by several steps fails each step's first `times` calls of a message, and then
//! the step runs normally.
//!
//! # Examples
//!
//! ```
//! use saga_testing::faults::fail_after_handler;
//! use saga_consumer::{Message, SagaEvent, StepContext, StepOutcome, StepResult, Topic, step};
//!
//! #[derive(serde::Serialize, serde::Deserialize, SagaEvent)]
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
//! // In the test's service: every message's first run is lost after the handler ran.
//! let reserve = step("reserve", reserve).on(&Topic::new("orders")).layer(fail_after_handler(1));
//! # let _ = reserve;
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use tower_layer::Layer;
use tower_service::Service;

use saga_consumer::{CompleteCall, StepCall, StepError, StepOutcome};

use crate::BoxError;

/// Where a [`FaultLayer`] fails a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum When {
    /// Before the handler runs.
    Before,
    /// After the handler ran, before the transaction commits.
    After,
}

/// Fails each message's first `times` calls after its handler ran: see the [module](self).
pub fn fail_after_handler(times: u32) -> FaultLayer {
    FaultLayer::new(When::After, times)
}

/// Fails each message's first `times` calls before its handler runs: see the [module](self).
pub fn fail_before_handler(times: u32) -> FaultLayer {
    FaultLayer::new(When::Before, times)
}

/// A layer injecting transient failures into a step: [`fail_after_handler`], [`fail_before_handler`].
#[derive(Debug, Clone)]
pub struct FaultLayer {
    when: When,
    times: u32,
    /// Calls so far, per message and step (its external key), shared by the layer's services.
    calls: Arc<Mutex<HashMap<String, u32>>>,
}

impl FaultLayer {
    fn new(when: When, times: u32) -> Self {
        Self {
            when,
            times,
            calls: Arc::default(),
        }
    }

    /// Whether this call of the step with external key `key` fails.
    fn fails(&self, key: &str) -> bool {
        let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        let seen = calls.entry(key.to_owned()).or_insert(0);
        *seen += 1;
        *seen <= self.times
    }

    /// How many calls the layer saw in all, failed ones included (and the re-runs the runtime makes of the
    /// messages before a failed one in a batch, when it narrows the batch down).
    pub fn calls(&self) -> u32 {
        let calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        calls.values().sum()
    }
}

impl<S> Layer<S> for FaultLayer {
    type Service = Faulty<S>;

    fn layer(&self, inner: S) -> Faulty<S> {
        Faulty {
            inner,
            plan: self.clone(),
        }
    }
}

/// A step's service wrapped by a [`FaultLayer`].
#[derive(Debug, Clone)]
pub struct Faulty<S> {
    inner: S,
    plan: FaultLayer,
}

/// The injected failure.
#[derive(Debug, thiserror::Error)]
#[error("fault injection: the step failed {0} its handler")]
struct Injected(&'static str);

/// Starts `handler` (the inner service's call), or fails at once: `fails` says whether this call fails,
/// `when` where.
fn start<F>(when: When, fails: bool, handler: impl FnOnce() -> F) -> FaultFuture<F> {
    if fails && when == When::Before {
        return FaultFuture {
            handler: None,
            fails,
        };
    }
    FaultFuture {
        handler: Some(Box::pin(handler())),
        fails,
    }
}

impl<'a, E, S> Service<StepCall<'a, E>> for Faulty<S>
where
    S: Service<StepCall<'a, E>, Response = StepOutcome>,
    S::Error: Into<BoxError>,
{
    type Response = StepOutcome;
    type Error = BoxError;
    type Future = FaultFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, call: StepCall<'a, E>) -> Self::Future {
        let fails = self.plan.fails(call.msg.external_key().as_str());
        start(self.plan.when, fails, || self.inner.call(call))
    }
}

/// A two-phase step's completion ([`saga_consumer::TwoPhaseFn::layer`]): "after the handler" is after the
/// completion ran, the outside call made; the message runs again, its call with it.
impl<'a, E, R, S> Service<CompleteCall<'a, E, R>> for Faulty<S>
where
    S: Service<CompleteCall<'a, E, R>, Response = StepOutcome>,
    S::Error: Into<BoxError>,
{
    type Response = StepOutcome;
    type Error = BoxError;
    type Future = FaultFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, call: CompleteCall<'a, E, R>) -> Self::Future {
        let fails = self.plan.fails(call.msg.external_key().as_str());
        start(self.plan.when, fails, || self.inner.call(call))
    }
}

/// The response of a [`Faulty`] step: the handler's, or the injected failure (before the handler ran, or
/// after it did).
pub struct FaultFuture<F> {
    /// The handler's call; `None` when it fails before the handler runs.
    handler: Option<Pin<Box<F>>>,
    /// Whether this call fails.
    fails: bool,
}

impl<F> std::fmt::Debug for FaultFuture<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultFuture")
            .field("fails", &self.fails)
            .finish_non_exhaustive()
    }
}

impl<F, Err> Future for FaultFuture<F>
where
    F: Future<Output = Result<StepOutcome, Err>>,
    Err: Into<BoxError>,
{
    type Output = Result<StepOutcome, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let fails = self.fails;
        let Some(handler) = self.handler.as_mut() else {
            return Poll::Ready(Err(StepError::transient(Injected("before")).into()));
        };
        match handler.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => Poll::Ready(Err(e.into())),
            // The handler's writes are in the transaction, which this error rolls back.
            Poll::Ready(Ok(_)) if fails => {
                Poll::Ready(Err(StepError::transient(Injected("after")).into()))
            }
            Poll::Ready(Ok(outcome)) => Poll::Ready(Ok(outcome)),
        }
    }
}
