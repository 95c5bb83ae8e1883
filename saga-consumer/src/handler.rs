//! Registered steps behind one object-safe interface, so that a consumer can run steps of different payload
//! types. Each registered step decodes its own payload; the runtime holds decoded messages as `dyn Any`.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use saga_core::{
    BatchContext, EnvelopeError, EventMetadata, FromEvent, Message, Origin, RawMessage, SagaStep,
    StepContext, StepError, StepName, StepOutcome, Subscription, TwoPhaseStep,
};

/// A message decoded for one step, type-erased.
pub(crate) type Decoded = Box<dyn Any + Send + Sync>;

/// What a step's handler produced for a batch: one outcome per message, and the emitted events.
#[derive(Debug)]
pub(crate) struct HandlerOutput {
    pub outcomes: Vec<StepOutcome>,
    pub emitted: Vec<saga_core::OutboxMessage>,
}

/// A transactional step, type-erased.
pub(crate) trait ErasedStep: Send + Sync {
    fn decode(
        &self,
        raw: &RawMessage,
        meta: EventMetadata,
        origin: &Origin,
    ) -> Result<Decoded, EnvelopeError>;
    /// Handles consecutive messages of one partition, in order.
    fn handle<'a>(
        &'a self,
        decoded: &'a [&'a Decoded],
        conn: &'a mut sqlx::PgConnection,
        source: &'a str,
    ) -> BoxFuture<'a, Result<HandlerOutput, StepError>>;
}

struct TxAdapter<S>(S);

fn message<P: 'static>(decoded: &Decoded) -> &Message<P> {
    decoded
        .downcast_ref::<Message<P>>()
        .expect("a message is handled by the step that decoded it")
}

/// Decodes `raw`'s payload as `P` for the step `step`, a message first consumed at `origin`.
fn decode_as<P: FromEvent>(
    raw: &RawMessage,
    meta: EventMetadata,
    step: &StepName,
    origin: &Origin,
) -> Result<Decoded, EnvelopeError> {
    Ok(Box::new(Message::<P>::decode_with(
        raw,
        meta,
        step,
        origin.clone(),
    )?))
}

impl<S: SagaStep> ErasedStep for TxAdapter<S> {
    fn decode(
        &self,
        raw: &RawMessage,
        meta: EventMetadata,
        origin: &Origin,
    ) -> Result<Decoded, EnvelopeError> {
        decode_as::<S::Payload>(raw, meta, &self.0.name(), origin)
    }

    fn handle<'a>(
        &'a self,
        decoded: &'a [&'a Decoded],
        conn: &'a mut sqlx::PgConnection,
        source: &'a str,
    ) -> BoxFuture<'a, Result<HandlerOutput, StepError>> {
        Box::pin(async move {
            let msgs: Vec<&Message<S::Payload>> =
                decoded.iter().map(|d| message::<S::Payload>(d)).collect();
            let mut emitted = Vec::new();
            let mut ctx = BatchContext::new(conn, source, &mut emitted);
            let outcomes = self.0.handle_batch(&msgs, &mut ctx).await?;
            if outcomes.len() != msgs.len() {
                return Err(StepError::permanent(format!(
                    "handle_batch returned {} outcomes for {} messages",
                    outcomes.len(),
                    msgs.len()
                )));
            }
            Ok(HandlerOutput { outcomes, emitted })
        })
    }
}

/// A two-phase step, type-erased: the external call's response travels as `dyn Any`.
pub(crate) trait ErasedTwoPhaseStep: Send + Sync {
    fn decode(
        &self,
        raw: &RawMessage,
        meta: EventMetadata,
        origin: &Origin,
    ) -> Result<Decoded, EnvelopeError>;
    fn lease(&self) -> Duration;
    fn call<'a>(
        &'a self,
        decoded: &'a Decoded,
    ) -> BoxFuture<'a, Result<Box<dyn Any + Send>, StepError>>;
    fn complete<'a>(
        &'a self,
        decoded: &'a Decoded,
        response: Box<dyn Any + Send>,
        conn: &'a mut sqlx::PgConnection,
        source: &'a str,
    ) -> BoxFuture<'a, Result<HandlerOutput, StepError>>;
}

struct TwoPhaseAdapter<S>(S);

impl<S: TwoPhaseStep> ErasedTwoPhaseStep for TwoPhaseAdapter<S> {
    fn decode(
        &self,
        raw: &RawMessage,
        meta: EventMetadata,
        origin: &Origin,
    ) -> Result<Decoded, EnvelopeError> {
        decode_as::<S::Payload>(raw, meta, &self.0.name(), origin)
    }

    fn lease(&self) -> Duration {
        self.0.lease()
    }

    fn call<'a>(
        &'a self,
        decoded: &'a Decoded,
    ) -> BoxFuture<'a, Result<Box<dyn Any + Send>, StepError>> {
        Box::pin(async move {
            let response = self.0.call(message::<S::Payload>(decoded)).await?;
            Ok(Box::new(response) as Box<dyn Any + Send>)
        })
    }

    fn complete<'a>(
        &'a self,
        decoded: &'a Decoded,
        response: Box<dyn Any + Send>,
        conn: &'a mut sqlx::PgConnection,
        source: &'a str,
    ) -> BoxFuture<'a, Result<HandlerOutput, StepError>> {
        Box::pin(async move {
            let msg = message::<S::Payload>(decoded);
            let response = *response
                .downcast::<S::Response>()
                .expect("the response comes from the same step's call");
            let mut emitted = Vec::new();
            let mut ctx =
                StepContext::new(conn, msg.lineage(), source, &mut emitted).answering(msg);
            let outcome = self.0.complete(msg, response, &mut ctx).await?;
            Ok(HandlerOutput {
                outcomes: vec![outcome],
                emitted,
            })
        })
    }
}

/// How a registered step runs.
#[derive(Clone)]
pub(crate) enum StepMode {
    /// Claim, handle and outbox in one transaction; batched.
    Transactional(Arc<dyn ErasedStep>),
    /// Lease, external call, completing transaction; one message at a time.
    TwoPhase(Arc<dyn ErasedTwoPhaseStep>),
}

/// A step as the consumer knows it.
#[derive(Clone)]
pub(crate) struct RegisteredStep {
    pub name: StepName,
    pub subscriptions: Vec<Subscription>,
    pub mode: StepMode,
}

impl RegisteredStep {
    pub(crate) fn transactional<S: SagaStep>(step: S) -> Self {
        Self {
            name: step.name(),
            subscriptions: step.subscriptions(),
            mode: StepMode::Transactional(Arc::new(TxAdapter(step))),
        }
    }

    pub(crate) fn two_phase<S: TwoPhaseStep>(step: S) -> Self {
        Self {
            name: step.name(),
            subscriptions: step.subscriptions(),
            mode: StepMode::TwoPhase(Arc::new(TwoPhaseAdapter(step))),
        }
    }

    pub(crate) fn decode(
        &self,
        raw: &RawMessage,
        meta: EventMetadata,
        origin: &Origin,
    ) -> Result<Decoded, EnvelopeError> {
        match &self.mode {
            StepMode::Transactional(s) => s.decode(raw, meta, origin),
            StepMode::TwoPhase(s) => s.decode(raw, meta, origin),
        }
    }
}

/// The names of `steps`, in order (what a builder's or a consumer's `Debug` shows of them).
pub(crate) fn step_names(steps: &[RegisteredStep]) -> Vec<&str> {
    steps.iter().map(|s| s.name.as_str()).collect()
}
