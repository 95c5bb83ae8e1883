//! The handler invocation as a composable service, in the manner of `tower`: the runtime wraps the step's
//! handler in layers (a per-message tracing span, a timeout, panic catching) and users may add their own
//! with [`crate::SagaConsumerBuilder::layer`].
//!
//! A [`StepService`] runs inside the batch transaction; it sees the step, the decoded messages (consecutive
//! messages of one partition, new to the step) and the connection. Deduplication and the transaction
//! itself wrap it at the batch level (see `dedup` and `executor`), because a batch's keys are claimed
//! with one statement.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use saga_core::{Origin, OutboxMessage, StepError, StepName, StepOutcome, TenantId};
use tower_layer::Layer;
use tracing::Instrument;

use crate::handler::{Decoded, RegisteredStep, StepMode};

/// What a handler produced: one outcome per message, and the events it emitted.
#[derive(Debug)]
#[non_exhaustive]
pub struct StepResponse {
    /// How each message's step ended, in the request's order.
    pub outcomes: Vec<StepOutcome>,
    /// The outbox rows emitted.
    pub emitted: Vec<OutboxMessage>,
}

impl From<crate::handler::HandlerOutput> for StepResponse {
    fn from(h: crate::handler::HandlerOutput) -> Self {
        Self {
            outcomes: h.outcomes,
            emitted: h.emitted,
        }
    }
}

/// One message of a request.
#[derive(Debug)]
pub struct StepItem<'a> {
    pub(crate) decoded: &'a Decoded,
    pub(crate) tenant: &'a TenantId,
    pub(crate) origin: &'a Origin,
    pub(crate) span: &'a tracing::Span,
}

impl StepItem<'_> {
    /// The message's tenant.
    pub fn tenant(&self) -> &TenantId {
        self.tenant
    }

    /// Where the message came from.
    pub fn origin(&self) -> &Origin {
        self.origin
    }

    /// The message's tracing span.
    pub fn span(&self) -> &tracing::Span {
        self.span
    }
}

/// One handler invocation: consecutive messages of one partition for one step, new to it, inside the
/// batch's transaction. A two-phase step's completion is a request of one message with its external
/// response.
#[non_exhaustive]
pub struct StepRequest<'a> {
    pub(crate) step: &'a RegisteredStep,
    pub(crate) items: Vec<StepItem<'a>>,
    pub(crate) response: Option<Box<dyn Any + Send>>,
    /// The open transaction.
    pub conn: &'a mut sqlx::PgConnection,
}

impl std::fmt::Debug for StepRequest<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepRequest")
            .field("step", &self.step.name)
            .field("items", &self.items)
            .finish_non_exhaustive()
    }
}

impl StepRequest<'_> {
    /// The step being run.
    pub fn step_name(&self) -> &StepName {
        &self.step.name
    }

    /// The messages, in order.
    pub fn items(&self) -> &[StepItem<'_>] {
        &self.items
    }
}

/// A handler invocation service: what a layer of one's own wraps ([`crate::SagaServiceBuilder::layer`]).
///
/// # Examples
///
/// A layer counting handler calls per step:
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use futures::future::BoxFuture;
/// use saga_consumer::{BoxStepService, StepResponse, StepError, StepRequest, StepService};
///
/// #[derive(Clone, Default)]
/// struct CountCalls(Arc<AtomicU64>);
///
/// struct Counted<S> { inner: S, calls: Arc<AtomicU64> }
///
/// impl<S: StepService> tower_layer::Layer<S> for CountCalls {
///     type Service = Counted<S>;
///     fn layer(&self, inner: S) -> Counted<S> { Counted { inner, calls: self.0.clone() } }
/// }
///
/// impl<S: StepService> StepService for Counted<S> {
///     fn call<'a>(&'a self, request: StepRequest<'a>) -> BoxFuture<'a, Result<StepResponse, StepError>> {
///         self.calls.fetch_add(request.items().len() as u64, Ordering::Relaxed);
///         self.inner.call(request)
///     }
/// }
///
/// let counter = CountCalls::default();
/// # fn register(b: saga_consumer::SagaServiceBuilder, c: CountCalls) -> saga_consumer::SagaServiceBuilder {
/// #     b.layer(c)
/// # }
/// # let _: fn(saga_consumer::SagaServiceBuilder, CountCalls) -> _ = register;
/// # let _ = counter;
/// ```
pub trait StepService: Send + Sync + 'static {
    /// Runs the handler for `request` inside the open transaction.
    fn call<'a>(
        &'a self,
        request: StepRequest<'a>,
    ) -> BoxFuture<'a, Result<StepResponse, StepError>>;
}

/// A shared, type-erased [`StepService`], what layers wrap.
pub type BoxStepService = Arc<dyn StepService>;

impl StepService for BoxStepService {
    fn call<'a>(
        &'a self,
        request: StepRequest<'a>,
    ) -> BoxFuture<'a, Result<StepResponse, StepError>> {
        (**self).call(request)
    }
}

/// The innermost service: the step's own handler (or a two-phase step's completing handler).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct HandlerService;

impl StepService for HandlerService {
    fn call<'a>(
        &'a self,
        request: StepRequest<'a>,
    ) -> BoxFuture<'a, Result<StepResponse, StepError>> {
        let StepRequest {
            step,
            items,
            conn,
            response,
        } = request;
        let source = step.name.as_str();
        Box::pin(async move {
            let decoded: Vec<&Decoded> = items.iter().map(|i| i.decoded).collect();
            let handled = match (&step.mode, response, decoded.as_slice()) {
                (StepMode::Transactional(s), _, _) => s.handle(&decoded, conn, source).await?,
                (StepMode::TwoPhase(s), Some(response), [one]) => {
                    s.complete(one, response, conn, source).await?
                }
                (StepMode::TwoPhase(_), _, _) => {
                    return Err(StepError::permanent(
                        "a two-phase step completes one message, with its external response",
                    ));
                }
            };
            Ok(handled.into())
        })
    }
}

/// Runs the inner service inside the message's tracing span (for a batch: a `saga.batch` span that follows
/// from each message's span).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct InstrumentLayer;

/// See [`InstrumentLayer`].
pub(crate) struct Instrumented<S>(S);

impl<S: StepService> Layer<S> for InstrumentLayer {
    type Service = Instrumented<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Instrumented(inner)
    }
}

impl<S: StepService> StepService for Instrumented<S> {
    fn call<'a>(
        &'a self,
        request: StepRequest<'a>,
    ) -> BoxFuture<'a, Result<StepResponse, StepError>> {
        let span = match request.items.as_slice() {
            [one] => one.span.clone(),
            items => {
                let batch = tracing::info_span!(
                    "saga.batch",
                    step = %request.step.name,
                    messages = items.len()
                );
                for item in items {
                    batch.follows_from(item.span);
                }
                batch
            }
        };
        Box::pin(self.0.call(request).instrument(span))
    }
}

/// The handler took longer than its time limit.
#[derive(Debug, thiserror::Error)]
#[error("handler timed out after {0:?}")]
#[non_exhaustive]
pub struct HandlerTimedOut(pub Duration);

/// Fails a handler that runs longer than a limit, transiently: the transaction rolls back and the message is
/// retried.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TimeoutLayer(pub Duration);

/// See [`TimeoutLayer`].
pub(crate) struct Timeout<S> {
    inner: S,
    limit: Duration,
}

impl<S: StepService> Layer<S> for TimeoutLayer {
    type Service = Timeout<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Timeout {
            inner,
            limit: self.0,
        }
    }
}

impl<S: StepService> StepService for Timeout<S> {
    fn call<'a>(
        &'a self,
        request: StepRequest<'a>,
    ) -> BoxFuture<'a, Result<StepResponse, StepError>> {
        Box::pin(async move {
            match tokio::time::timeout(self.limit, self.inner.call(request)).await {
                Ok(result) => result,
                Err(_) => Err(StepError::transient(HandlerTimedOut(self.limit))),
            }
        })
    }
}

/// The handler panicked.
#[derive(Debug, thiserror::Error)]
#[error("handler panicked: {0}")]
#[non_exhaustive]
pub struct HandlerPanicked(pub String);

/// Turns a panicking handler into a permanent error, so that the message is dead-lettered instead of
/// taking the consumer down (and, after a restart, down again).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CatchPanicLayer;

/// See [`CatchPanicLayer`].
pub(crate) struct CatchPanic<S>(S);

impl<S: StepService> Layer<S> for CatchPanicLayer {
    type Service = CatchPanic<S>;
    fn layer(&self, inner: S) -> Self::Service {
        CatchPanic(inner)
    }
}

impl<S: StepService> StepService for CatchPanic<S> {
    fn call<'a>(
        &'a self,
        request: StepRequest<'a>,
    ) -> BoxFuture<'a, Result<StepResponse, StepError>> {
        Box::pin(async move {
            match AssertUnwindSafe(self.0.call(request)).catch_unwind().await {
                Ok(result) => result,
                Err(panic) => {
                    let text = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "non-string panic payload".to_owned());
                    Err(StepError::permanent(HandlerPanicked(text)))
                }
            }
        })
    }
}

/// Wraps `inner` in `layer` and erases the result.
pub(crate) fn apply<L>(layer: &L, inner: BoxStepService) -> BoxStepService
where
    L: Layer<BoxStepService>,
    L::Service: StepService,
{
    Arc::new(layer.layer(inner))
}
