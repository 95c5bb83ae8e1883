//! The saga definition API: the saga's data as a type of the user's (`D`), and its steps in order, each
//! with the command it sends (built from `&D`), the typed replies that update `D` and complete or fail it,
//! an optional compensation, and a timeout. A definition carries a version: instances keep the version
//! they started with (see [`crate::Orchestrator::keep_running`]).

use std::sync::Arc;
use std::time::Duration;

use saga_core::{KeyError, SagaEvent, SharedStep, StepName, Topic};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// A saga's data: a type of the user's, stored as JSON with the instance. Every
/// `Serialize + DeserializeOwned + Clone` type that is `Send + Sync` is one.
pub trait SagaData: Serialize + DeserializeOwned + Clone + Send + Sync + 'static {}

impl<T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static> SagaData for T {}

/// Builds a command from the saga's data and, for a compensation, why the saga compensates: its event
/// type and its JSON payload, or why it could not.
type BuildFn<D> =
    Arc<dyn Fn(&D, &str) -> Result<(String, serde_json::Value), CommandError> + Send + Sync>;

/// A command that could not be built from the saga's data.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CommandError {
    /// The data lacks what the command needs: [`Command::try_to`]'s function said why.
    #[error("the command to {event_type} cannot be built: {reason}")]
    NotBuildable {
        /// The command's event type (its Rust type's name).
        event_type: &'static str,
        /// Why, as the function said it.
        reason: String,
    },
    /// The command's event does not serialize.
    #[error("the command {event_type} does not serialize: {source}")]
    Serialize {
        /// The command's event type.
        event_type: String,
        /// Why.
        #[source]
        source: Arc<serde_json::Error>,
    },
}

impl PartialEq for CommandError {
    /// The same variant saying the same (a JSON error is compared by its message).
    fn eq(&self, other: &Self) -> bool {
        self.to_string() == other.to_string()
            && std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

impl Eq for CommandError {}

/// Applies a reply (its event type and JSON payload) to the saga's data: what it means for the step, or
/// why the reply cannot be read.
type ReplyFn<D> = Arc<dyn Fn(&mut D, &str, &[u8]) -> Result<Verdict, String> + Send + Sync>;

/// What a reply means for its step: returned by the function a step's [`Step::replies`] names.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// The step completed: the saga runs the next one (or completes).
    Succeeded,
    /// The step failed for good, for this reason: the saga compensates the steps before it.
    Failed(String),
}

/// A command the orchestrator sends: to a participant's command topic, built from the saga's data.
pub struct Command<D> {
    topic: String,
    build: BuildFn<D>,
}

impl<D> Clone for Command<D> {
    fn clone(&self) -> Self {
        Self {
            topic: self.topic.clone(),
            build: Arc::clone(&self.build),
        }
    }
}

/// A typed event as a command's event type and JSON payload.
fn encoded<E: SagaEvent>(event: &E) -> Result<(String, serde_json::Value), CommandError> {
    let payload = event
        .to_json()
        .and_then(|json| serde_json::from_slice(&json))
        .map_err(|source| CommandError::Serialize {
            event_type: event.event_type().to_owned(),
            source: Arc::new(source),
        })?;
    Ok((event.event_type().to_owned(), payload))
}

impl<D: SagaData> Command<D> {
    /// A command to `topic`: the event `build` makes from the saga's data (its type is the event's; on a
    /// topic of an event family, the variant's).
    ///
    /// # Examples
    ///
    /// ```
    /// use saga_core::{SagaEvent, Topic};
    /// use saga_orchestrator::Command;
    /// use serde::{Deserialize, Serialize};
    ///
    /// #[derive(Serialize, Deserialize, SagaEvent)]
    /// #[saga(crate = "saga_core")]
    /// struct ProcessPayment { order_id: String }
    ///
    /// #[derive(Clone, Serialize, Deserialize)]
    /// struct Order { order_id: String }
    ///
    /// let commands: Topic<ProcessPayment> = Topic::new("saga.payment-commands");
    /// let charge = Command::to(&commands, |order: &Order| ProcessPayment { order_id: order.order_id.clone() });
    /// let (event_type, payload) = charge.build(&Order { order_id: "7".into() }).unwrap();
    /// assert_eq!((event_type.as_str(), payload["order_id"].as_str()), ("ProcessPayment", Some("7")));
    /// ```
    pub fn to<E: SagaEvent>(
        topic: &Topic<E>,
        build: impl Fn(&D) -> E + Send + Sync + 'static,
    ) -> Self {
        Self {
            topic: topic.name().to_owned(),
            build: Arc::new(move |data, _why| encoded(&build(data))),
        }
    }

    /// A command to `topic` that may not be buildable from the data (a value a step's reply should have
    /// recorded is missing): `build` returns the event, or why not. A command that cannot be built leaves
    /// the saga where it is, and the reply or timer that led to it is refused with the reason (the reply
    /// dead-lettered, the timer tried again with backoff).
    pub fn try_to<E: SagaEvent, W: std::fmt::Display>(
        topic: &Topic<E>,
        build: impl Fn(&D) -> Result<E, W> + Send + Sync + 'static,
    ) -> Self {
        Self {
            topic: topic.name().to_owned(),
            build: Arc::new(move |data, _why| {
                let event = build(data).map_err(|why| CommandError::NotBuildable {
                    event_type: std::any::type_name::<E>(),
                    reason: why.to_string(),
                })?;
                encoded(&event)
            }),
        }
    }

    /// A compensation's command to `topic`: the event `build` makes from the saga's data and why the saga
    /// compensates (the failed step's reason, or that a step timed out).
    pub fn undo<E: SagaEvent>(
        topic: &Topic<E>,
        build: impl Fn(&D, &str) -> E + Send + Sync + 'static,
    ) -> Self {
        Self {
            topic: topic.name().to_owned(),
            build: Arc::new(move |data, why| encoded(&build(data, why))),
        }
    }

    /// A command of `event_type` on `topic`, with the payload `payload` builds from the saga's data, for
    /// types known only at run time. Prefer [`Command::to`].
    pub fn new(
        topic: impl Into<String>,
        event_type: impl Into<String>,
        payload: impl Fn(&D) -> serde_json::Value + Send + Sync + 'static,
    ) -> Self {
        let event_type = event_type.into();
        Self {
            topic: topic.into(),
            build: Arc::new(move |data, _why| Ok((event_type.clone(), payload(data)))),
        }
    }

    /// The command for the saga's `data`: its event type and payload, or why it could not be built.
    pub fn build(&self, data: &D) -> Result<(String, serde_json::Value), CommandError> {
        (self.build)(data, "")
    }
}

impl<D> Command<D> {
    /// The participant's command topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The command for the saga's `data` and, for a compensation, why the saga compensates.
    pub(crate) fn build_for(
        &self,
        data: &D,
        why: Option<&str>,
    ) -> Result<(String, serde_json::Value), CommandError> {
        (self.build)(data, why.unwrap_or_default())
    }
}

impl<D> std::fmt::Debug for Command<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Command")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

/// What happens when a step's reply does not come within its timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnTimeout {
    /// The step failed: compensate (the timed-out step included: its effect may have happened).
    Fail,
    /// Send the command again, with the same key, up to `attempts` times in all; then fail.
    Retry {
        /// Sends in all, the first included.
        attempts: u32,
    },
}

/// The replies a step (or a compensation) expects: their event types, and what applies one to the data.
pub(crate) struct Replies<D> {
    /// The event types.
    pub(crate) types: Vec<String>,
    apply: ReplyFn<D>,
}

impl<D> Clone for Replies<D> {
    fn clone(&self) -> Self {
        Self {
            types: self.types.clone(),
            apply: Arc::clone(&self.apply),
        }
    }
}

impl<D> Replies<D> {
    /// Typed replies `R`: decoded by their event type, handed to `on_reply`.
    fn typed<R: SagaEvent>(
        on_reply: impl Fn(&mut D, R) -> Verdict + Send + Sync + 'static,
    ) -> Self {
        Self {
            types: R::TYPES.iter().map(|t| (*t).to_owned()).collect(),
            apply: Arc::new(move |data, event_type, payload| {
                let reply = R::from_event(event_type, payload).map_err(|e| {
                    format!(
                        "the reply {event_type} does not decode as {}: {e}",
                        std::any::type_name::<R>()
                    )
                })?;
                Ok(on_reply(data, reply))
            }),
        }
    }

    /// Whether `event_type` is one of them.
    pub(crate) fn expects(&self, event_type: &str) -> bool {
        self.types.iter().any(|t| t == event_type)
    }

    /// Applies the reply to `data`.
    pub(crate) fn apply(
        &self,
        data: &mut D,
        event_type: &str,
        payload: &[u8],
    ) -> Result<Verdict, String> {
        (self.apply)(data, event_type, payload)
    }
}

/// A compensating action.
#[non_exhaustive]
pub struct Compensation<D> {
    /// The command that undoes the step. The participant's step for it must be named
    /// `compensate-{step}`, so its key is `{original-key}:compensate-{step}`.
    pub command: Command<D>,
    /// The replies that confirm it.
    pub(crate) done: Replies<D>,
    /// How long to wait for a confirmation before sending the command again (same key). A compensation is
    /// never skipped.
    pub resend_after: Duration,
}

impl<D> Clone for Compensation<D> {
    fn clone(&self) -> Self {
        Self {
            command: self.command.clone(),
            done: self.done.clone(),
            resend_after: self.resend_after,
        }
    }
}

impl<D> Compensation<D> {
    /// The event types that confirm it.
    pub fn done_on(&self) -> &[String] {
        &self.done.types
    }
}

impl<D> std::fmt::Debug for Compensation<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compensation")
            .field("command", &self.command)
            .field("done_on", &self.done.types)
            .field("resend_after", &self.resend_after)
            .finish()
    }
}

/// One step of a saga.
#[non_exhaustive]
pub struct Step<D> {
    /// The step's name; the participant's step handling the command must have the same name, so that its
    /// key is `{original-key}:{step}`.
    pub name: StepName,
    /// The command that runs it.
    pub command: Command<D>,
    /// The replies that complete or fail it.
    pub(crate) replies: Option<Replies<D>>,
    /// How to undo it, if it can be undone.
    pub compensation: Option<Compensation<D>>,
    /// How long to wait for a reply.
    pub timeout: Duration,
    /// What a timeout means.
    pub on_timeout: OnTimeout,
    /// The declaration both sides share, for a step made by [`Step::shared`].
    pub(crate) shared: Option<SharedStep>,
    /// The resend period [`Step::resend_compensation_after`] set, for a compensation given after it.
    pub(crate) compensation_resend: Option<Duration>,
}

/// How long a compensation waits for its confirmation before it is sent again, unless the step says.
const COMPENSATION_RESEND: Duration = Duration::from_secs(30);

impl<D> Clone for Step<D> {
    fn clone(&self) -> Self {
        Self {
            name: self.name.clone(),
            command: self.command.clone(),
            replies: self.replies.clone(),
            compensation: self.compensation.clone(),
            timeout: self.timeout,
            on_timeout: self.on_timeout,
            shared: self.shared,
            compensation_resend: self.compensation_resend,
        }
    }
}

impl<D> std::fmt::Debug for Step<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Step")
            .field("name", &self.name)
            .field("command", &self.command)
            .field("replies", &self.reply_types())
            .field("compensation", &self.compensation)
            .field("timeout", &self.timeout)
            .field("on_timeout", &self.on_timeout)
            .field("shared", &self.shared)
            .finish()
    }
}

impl<D: SagaData> Step<D> {
    /// A step `name` run by `command`, with a 30-second timeout that fails it. It needs its replies
    /// ([`Step::replies`]).
    pub fn new(name: &str, command: Command<D>) -> Result<Self, KeyError> {
        Ok(Self::named(StepName::new(name)?, command, None))
    }

    /// A step declared once where the participant's service reads it too ([`SharedStep`]): the participant
    /// names its step (and, for a compensated step, its compensation) from the same declaration. The
    /// orchestrator checks at its start that the step has a compensation ([`Step::compensate`])
    /// exactly when the declaration names one ([`DefinitionError::SharedStep`]).
    pub fn shared(step: SharedStep, command: Command<D>) -> Self {
        Self::named(step.step_name(), command, Some(step))
    }

    fn named(name: StepName, command: Command<D>, shared: Option<SharedStep>) -> Self {
        Self {
            name,
            command,
            replies: None,
            compensation: None,
            timeout: Duration::from_secs(30),
            on_timeout: OnTimeout::Fail,
            shared,
            compensation_resend: None,
        }
    }

    /// The replies that complete or fail the step: every event type of `R` (an event, or a family of
    /// them), decoded and handed with the saga's data to `on_reply`, which records what it needs in the
    /// data and says whether the step succeeded. A reply that does not decode as `R` is dead-lettered with
    /// the reason, and the saga stays where it is.
    ///
    /// # Examples
    ///
    /// ```
    /// use saga_core::{SagaEvent, Topic};
    /// use saga_orchestrator::{Command, Step, Verdict};
    /// use serde::{Deserialize, Serialize};
    ///
    /// #[derive(Clone, Serialize, Deserialize)]
    /// struct Charged { charge_id: String }
    /// #[derive(Clone, Serialize, Deserialize)]
    /// struct Declined { reason: String }
    ///
    /// /// What the payment service answers.
    /// #[derive(SagaEvent)]
    /// #[saga(crate = "saga_core")]
    /// enum PaymentReply { PaymentProcessed(Charged), PaymentFailed(Declined) }
    ///
    /// #[derive(Serialize, Deserialize, SagaEvent)]
    /// #[saga(crate = "saga_core")]
    /// struct ProcessPayment { order_id: u64 }
    ///
    /// #[derive(Clone, Default, Serialize, Deserialize)]
    /// struct Order { order_id: u64, charge_id: Option<String> }
    ///
    /// let commands: Topic<ProcessPayment> = Topic::new("saga.payment-commands");
    /// let charge = Step::new("process-payment", Command::to(&commands, |o: &Order| ProcessPayment { order_id: o.order_id }))?
    ///     .replies(|order: &mut Order, reply: PaymentReply| match reply {
    ///         PaymentReply::PaymentProcessed(charged) => {
    ///             order.charge_id = Some(charged.charge_id);
    ///             Verdict::Succeeded
    ///         }
    ///         PaymentReply::PaymentFailed(declined) => Verdict::Failed(declined.reason),
    ///     });
    /// # let _ = charge;
    /// # Ok::<(), saga_core::KeyError>(())
    /// ```
    #[must_use]
    pub fn replies<R: SagaEvent>(
        mut self,
        on_reply: impl Fn(&mut D, R) -> Verdict + Send + Sync + 'static,
    ) -> Self {
        self.replies = Some(Replies::typed(on_reply));
        self
    }

    /// Replies of types known only at run time: `types`, each handed to `on_reply` with its event type and
    /// JSON payload. Prefer [`Step::replies`].
    #[must_use]
    pub fn replies_of<I: IntoIterator<Item = S>, S: AsRef<str>>(
        mut self,
        types: I,
        on_reply: impl Fn(&mut D, &str, serde_json::Value) -> Verdict + Send + Sync + 'static,
    ) -> Self {
        self.replies = Some(Replies::raw(types, move |data, event_type, payload| {
            Ok(on_reply(data, event_type, payload))
        }));
        self
    }

    /// The step's compensation: `command` (see [`Command::undo`]), confirmed by any reply of `R`, which
    /// `on_done` records in the data; re-sent every `resend_after` until confirmed.
    #[must_use]
    pub fn compensate_with<R: SagaEvent>(
        mut self,
        command: Command<D>,
        on_done: impl Fn(&mut D, R) + Send + Sync + 'static,
        resend_after: Duration,
    ) -> Self {
        self.compensation = Some(Compensation {
            command,
            done: Replies::typed(move |data: &mut D, reply: R| {
                on_done(data, reply);
                Verdict::Succeeded
            }),
            resend_after,
        });
        self
    }

    /// The step's compensation: `command` (see [`Command::undo`]), confirmed by any reply of `R`, which the
    /// saga's data need not record; re-sent every 30 s until confirmed ([`Step::resend_compensation_after`]
    /// changes that).
    ///
    /// ```
    /// # use saga_core::{SagaEvent, Topic};
    /// # use saga_orchestrator::{Command, Step, Verdict};
    /// # use std::time::Duration;
    /// # #[derive(Clone, serde::Serialize, serde::Deserialize)] struct Order { order_id: i64 }
    /// # #[derive(serde::Serialize, serde::Deserialize, SagaEvent)] struct ProcessPayment { order_id: i64 }
    /// # #[derive(serde::Serialize, serde::Deserialize, SagaEvent)] struct RefundPayment { order_id: i64 }
    /// # #[derive(serde::Serialize, serde::Deserialize, SagaEvent)] struct PaymentProcessed { order_id: i64 }
    /// # #[derive(serde::Serialize, serde::Deserialize, SagaEvent)] struct PaymentRefunded { order_id: i64 }
    /// # const PAYMENTS: Topic<ProcessPayment> = Topic::fixed("payments");
    /// # const REFUNDS: Topic<RefundPayment> = Topic::fixed("payments");
    /// let refund = Command::undo(&REFUNDS, |o: &Order, _why: &str| RefundPayment { order_id: o.order_id });
    /// let charge = Step::new("process-payment", Command::to(&PAYMENTS, |o: &Order| ProcessPayment { order_id: o.order_id }))?
    ///     .replies(|_: &mut Order, _: PaymentProcessed| Verdict::Succeeded)
    ///     .compensate::<PaymentRefunded>(refund)
    ///     .resend_compensation_after(Duration::from_secs(10));
    /// # let _ = charge;
    /// # Ok::<(), saga_core::KeyError>(())
    /// ```
    #[must_use]
    pub fn compensate<R: SagaEvent>(self, command: Command<D>) -> Self {
        let resend_after = self.compensation_resend.unwrap_or(COMPENSATION_RESEND);
        self.compensate_with(command, |_: &mut D, _: R| {}, resend_after)
    }

    /// How long the step's compensation waits for its confirmation before it is sent again (same key):
    /// called before or after [`Step::compensate`]. Without it, 30 s. [`Step::compensate_with`] names a
    /// period of its own: whichever of the two is called last holds.
    #[must_use]
    pub fn resend_compensation_after(mut self, after: Duration) -> Self {
        self.compensation_resend = Some(after);
        if let Some(compensation) = &mut self.compensation {
            compensation.resend_after = after;
        }
        self
    }

    /// A compensation confirmed by replies of types known only at run time. Prefer
    /// [`Step::compensate_with`].
    #[must_use]
    pub fn compensate_with_types<I: IntoIterator<Item = S>, S: AsRef<str>>(
        mut self,
        command: Command<D>,
        done_on: I,
        resend_after: Duration,
    ) -> Self {
        self.compensation = Some(Compensation {
            command,
            done: Replies::raw(done_on, |_, _, _| Ok(Verdict::Succeeded)),
            resend_after,
        });
        self
    }

    /// The reply timeout and what it means.
    #[must_use]
    pub fn timeout(mut self, after: Duration, then: OnTimeout) -> Self {
        self.timeout = after;
        self.on_timeout = then;
        self
    }
}

impl<D> Replies<D> {
    /// Replies of run-time types, their payload handed to `apply` as JSON.
    fn raw<I: IntoIterator<Item = S>, S: AsRef<str>>(
        types: I,
        apply: impl Fn(&mut D, &str, serde_json::Value) -> Result<Verdict, String>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        Self {
            types: types.into_iter().map(|t| t.as_ref().to_owned()).collect(),
            apply: Arc::new(move |data, event_type, payload| {
                let json = serde_json::from_slice(payload)
                    .map_err(|e| format!("the reply {event_type} is not JSON: {e}"))?;
                apply(data, event_type, json)
            }),
        }
    }
}

impl<D> Step<D> {
    /// The event types of the replies that complete or fail the step.
    pub fn reply_types(&self) -> &[String] {
        self.replies.as_ref().map_or(&[], |r| r.types.as_slice())
    }

    /// `compensate-{step}`: the name of the participant step that compensates this one. Fails if that is
    /// no valid step name (the step's name is too long for the prefix): [`SagaDefinition::validate`]
    /// refuses such a definition, naming the step.
    pub fn compensation_name(&self) -> Result<StepName, KeyError> {
        StepName::new(&format!("compensate-{}", self.name))
    }

    /// The names this step needs besides its own: the reply step `on-{step}` and, with a compensation,
    /// `compensate-{step}` and its reply step `on-compensate-{step}`. Each must be a valid step name.
    fn derived_names(&self) -> Vec<String> {
        let mut names = vec![self.reply_step()];
        if self.compensation.is_some() {
            names.push(format!("compensate-{}", self.name));
            names.push(self.compensation_reply_step());
        }
        names
    }

    /// How the step differs from its [`SharedStep`] declaration, if it does.
    fn unlike_its_declaration(&self) -> Option<String> {
        let shared = self.shared?;
        if self.name.as_str() != shared.name() {
            return Some(format!(
                "was renamed after it was made from the declaration of {}",
                shared.name()
            ));
        }
        match (shared.compensation(), &self.compensation) {
            (Some(name), None) => Some(format!(
                "is declared compensated (by {name}) and has no compensation (Step::compensate)"
            )),
            (None, Some(_)) => Some(format!(
                "has a compensation its declaration does not name: declare it with \
                 SharedStep::new({:?}).compensated_by(\"compensate-{}\")",
                self.name.as_str(),
                self.name
            )),
            _ => None,
        }
    }

    /// `on-{step}`: the consumer step that delivers the step's replies.
    fn reply_step(&self) -> String {
        format!("on-{}", self.name)
    }

    /// `on-compensate-{step}`: the consumer step that delivers its compensation's confirmations.
    fn compensation_reply_step(&self) -> String {
        format!("on-compensate-{}", self.name)
    }
}

/// A definition that cannot work.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DefinitionError {
    /// No steps.
    #[error("saga {0} has no steps")]
    Empty(String),
    /// A name is invalid.
    #[error(transparent)]
    Name(#[from] KeyError),
    /// Two steps share a name.
    #[error("saga {saga}: two steps are named {step}")]
    DuplicateStep {
        /// The saga type.
        saga: String,
        /// The step.
        step: String,
    },
    /// A reply type is used by two steps (or twice in one), so it would be ambiguous.
    #[error("saga {saga}: reply {reply} is expected by more than one step or outcome")]
    AmbiguousReply {
        /// The saga type.
        saga: String,
        /// The reply type.
        reply: String,
    },
    /// A name the orchestrator derives from a step's (its compensation `compensate-{step}`, the reply
    /// steps `on-{step}` and `on-compensate-{step}`) is no valid step name: the step's name is too long for
    /// it, say. Never replaced by another name: a step's name is its identity, in its step keys.
    #[error(
        "saga {saga}: step {step} needs the step name {derived:?}, which is invalid ({reason}); shorten the step's name"
    )]
    DerivedName {
        /// The saga type.
        saga: String,
        /// The step.
        step: String,
        /// The derived name.
        derived: String,
        /// Why it is invalid.
        reason: KeyError,
    },
    /// A step made from a [`SharedStep`] has a compensation its declaration does not name, or none where
    /// it names one: the participant's service, reading the same declaration, would serve another.
    #[error("saga {saga}: step {step} {reason}")]
    SharedStep {
        /// The saga type.
        saga: String,
        /// The step.
        step: String,
        /// What does not match.
        reason: String,
    },
    /// A step expects no reply at all (it was given no [`Step::replies`]).
    #[error("saga {saga}: step {step} has no replies (Step::replies)")]
    NoReply {
        /// The saga type.
        saga: String,
        /// The step.
        step: String,
    },
    /// The definition's version is 0: versions start at 1.
    #[error("saga {0}: versions start at 1")]
    VersionZero(String),
    /// Two definitions an orchestrator runs share a version, or are of different saga types.
    #[error("saga {saga}: {reason}")]
    Versions {
        /// The saga type.
        saga: String,
        /// What is wrong.
        reason: String,
    },
}

/// Reads the data of an instance stored by 0.2 (`{"input": ..., "<step>": <reply>, ...}`) as `D`.
type LegacyFn<D> = Arc<dyn Fn(&LegacyData) -> Result<D, String> + Send + Sync>;

/// The data of an instance stored by 0.2, before saga data had a type: what it was started with, and
/// each reply's payload under its step's (or compensation's) name. A definition that reads them
/// ([`SagaDefinition::reads_untyped`]) turns it into its type.
#[derive(Debug, Clone)]
pub struct LegacyData(serde_json::Value);

impl LegacyData {
    /// Data as 0.2 stored it.
    pub fn new(stored: serde_json::Value) -> Self {
        Self(stored)
    }

    /// What the instance was started with, as `T`.
    pub fn input<T: DeserializeOwned>(&self) -> Result<T, String> {
        T::deserialize(&self.0["input"]).map_err(|e| format!("the 0.2 input does not read: {e}"))
    }

    /// The reply step `step` received, as `T`: `None` if it has none, or if it is not a `T` (a step's
    /// failure reply is stored under the same name as its success).
    pub fn reply<T: DeserializeOwned>(&self, step: &str) -> Option<T> {
        self.0.get(step).and_then(|v| T::deserialize(v).ok())
    }
}

/// A saga type: its data type `D`, its steps in order, the topic its participants reply on, and its
/// version.
#[non_exhaustive]
pub struct SagaDefinition<D> {
    /// The saga type, such as `order-fulfillment`.
    pub saga_type: StepName,
    /// Where participants send their replies.
    pub reply_topic: String,
    /// The definition's version (from 1): instances keep the version they started with.
    pub version: u32,
    /// The steps, in order.
    pub steps: Vec<Step<D>>,
    legacy: Option<LegacyFn<D>>,
}

impl<D> Clone for SagaDefinition<D> {
    fn clone(&self) -> Self {
        Self {
            saga_type: self.saga_type.clone(),
            reply_topic: self.reply_topic.clone(),
            version: self.version,
            steps: self.steps.clone(),
            legacy: self.legacy.clone(),
        }
    }
}

impl<D> std::fmt::Debug for SagaDefinition<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SagaDefinition")
            .field("saga_type", &self.saga_type)
            .field("reply_topic", &self.reply_topic)
            .field("version", &self.version)
            .field("steps", &self.steps)
            .field("reads_untyped", &self.legacy.is_some())
            .finish()
    }
}

impl<D: SagaData> SagaDefinition<D> {
    /// Version 1 of saga type `saga_type`, whose replies arrive on `reply_topic`.
    pub fn new(saga_type: &str, reply_topic: impl Into<String>) -> Result<Self, DefinitionError> {
        Ok(Self {
            saga_type: StepName::new(saga_type)?,
            reply_topic: reply_topic.into(),
            version: 1,
            steps: Vec::new(),
            legacy: None,
        })
    }

    /// The same definition as version `version`. Change the version whenever the steps change (one
    /// added, removed, renamed or reordered): instances keep running the version they started with, so
    /// the orchestrator keeps the versions that still have instances ([`crate::Orchestrator::keep_running`]).
    #[must_use]
    pub fn version(mut self, version: u32) -> Self {
        self.version = version;
        self
    }

    /// Appends a step.
    #[must_use]
    pub fn step(mut self, step: Step<D>) -> Self {
        self.steps.push(step);
        self
    }

    /// Reads instances stored before saga data had a type (by 0.2) with `read`: such instances run on this
    /// definition, which must be version 1 (0.2 had one version). Without it, such an instance is refused
    /// with a reason (its replies dead-lettered, its timer marked stuck), never misread.
    #[must_use]
    pub fn reads_untyped(
        mut self,
        read: impl Fn(&LegacyData) -> Result<D, String> + Send + Sync + 'static,
    ) -> Self {
        self.legacy = Some(Arc::new(read));
        self
    }

    /// The former name of [`SagaDefinition::reads_untyped`].
    #[deprecated(since = "0.3.0", note = "renamed reads_untyped")]
    #[must_use]
    pub fn reads_0_2(
        self,
        read: impl Fn(&LegacyData) -> Result<D, String> + Send + Sync + 'static,
    ) -> Self {
        self.reads_untyped(read)
    }

    /// The data of an instance as stored: `D`'s JSON, or (with no version, written by 0.2) the 0.2 form
    /// read by [`SagaDefinition::reads_untyped`].
    pub(crate) fn read_data(
        &self,
        stored: &serde_json::Value,
        from_0_2: bool,
    ) -> Result<D, String> {
        if from_0_2 {
            let read = self.legacy.as_ref().ok_or_else(|| {
                format!(
                    "the instance was stored by 0.2, and version {} of {} does not read 0.2 data \
                     (SagaDefinition::reads_untyped)",
                    self.version, self.saga_type
                )
            })?;
            return read(&LegacyData(stored.clone()));
        }
        D::deserialize(stored).map_err(|e| {
            format!(
                "the saga's data does not read as {}: {e}",
                std::any::type_name::<D>()
            )
        })
    }

    /// Checks the definition.
    pub fn validate(&self) -> Result<(), DefinitionError> {
        let saga = self.saga_type.to_string();
        if self.steps.is_empty() {
            return Err(DefinitionError::Empty(saga));
        }
        if self.version == 0 {
            return Err(DefinitionError::VersionZero(saga));
        }
        if i32::try_from(self.version).is_err() {
            return Err(DefinitionError::Versions {
                saga,
                reason: format!("version {} is over {}", self.version, i32::MAX),
            });
        }
        if self.legacy.is_some() && self.version != 1 {
            return Err(DefinitionError::Versions {
                saga,
                reason: format!(
                    "version {} reads 0.2 data, which only version 1 may (0.2 instances run on version 1)",
                    self.version
                ),
            });
        }
        let mut names = std::collections::HashSet::new();
        let mut replies = std::collections::HashSet::new();
        for step in &self.steps {
            if !names.insert(step.name.as_str()) {
                return Err(DefinitionError::DuplicateStep {
                    saga,
                    step: step.name.to_string(),
                });
            }
            for derived in step.derived_names() {
                if let Err(reason) = StepName::new(&derived) {
                    return Err(DefinitionError::DerivedName {
                        saga,
                        step: step.name.to_string(),
                        derived,
                        reason,
                    });
                }
            }
            if let Some(reason) = step.unlike_its_declaration() {
                return Err(DefinitionError::SharedStep {
                    saga,
                    step: step.name.to_string(),
                    reason,
                });
            }
            if step.reply_types().is_empty() {
                return Err(DefinitionError::NoReply {
                    saga,
                    step: step.name.to_string(),
                });
            }
            let compensation_replies = step.compensation.iter().flat_map(|c| c.done_on());
            for reply in step.reply_types().iter().chain(compensation_replies) {
                if !replies.insert(reply.as_str()) {
                    return Err(DefinitionError::AmbiguousReply {
                        saga,
                        reply: reply.clone(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Each reply type with the reply step that consumes it: `on-{step}` for a step's replies,
    /// `on-compensate-{step}` for its compensation's.
    pub(crate) fn reply_routes(&self) -> Vec<(String, String)> {
        let mut routes = Vec::new();
        for step in &self.steps {
            for reply in step.reply_types() {
                routes.push((reply.clone(), step.reply_step()));
            }
            for done in step.compensation.iter().flat_map(|c| c.done_on()) {
                routes.push((done.clone(), step.compensation_reply_step()));
            }
        }
        routes
    }

    /// The index of step `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.steps.iter().position(|s| s.name.as_str() == name)
    }
}

#[cfg(test)]
mod tests {
    use saga_core::MAX_STEP_NAME_LEN;

    use super::*;

    type Data = serde_json::Value;

    fn step(name: &str) -> Step<Data> {
        Step::new(
            name,
            Command::new("commands", "Do", |d: &Data| d["input"].clone()),
        )
        .unwrap()
        .replies_of([format!("{name}-done")], |_, _, _| Verdict::Succeeded)
    }

    fn refusal(definition: &SagaDefinition<Data>) -> (String, String) {
        match definition.validate() {
            Err(DefinitionError::DerivedName { step, derived, .. }) => (step, derived),
            other => panic!("expected a refused derived name, got {other:?}"),
        }
    }

    fn shared(declared: SharedStep, compensated: bool) -> Result<(), DefinitionError> {
        let command = || Command::new("commands", "Do", |d: &Data| d["input"].clone());
        let mut step =
            Step::shared(declared, command()).replies_of(["Done"], |_, _, _| Verdict::Succeeded);
        if compensated {
            step = step.compensate_with_types(command(), ["Undone"], Duration::from_secs(1));
        }
        let definition = SagaDefinition::new("orders", "replies").unwrap().step(step);
        assert_eq!(definition.steps[0].name.as_str(), declared.name());
        definition.validate()
    }

    #[test]
    fn a_shared_step_has_a_compensation_exactly_when_its_declaration_names_one() {
        const PAY: SharedStep = SharedStep::new("pay").compensated_by("compensate-pay");
        const SHIP: SharedStep = SharedStep::new("ship");
        shared(PAY, true).unwrap();
        shared(SHIP, false).unwrap();
        match shared(PAY, false) {
            Err(DefinitionError::SharedStep { step, reason, .. }) => {
                assert_eq!(step, "pay");
                assert!(reason.contains("compensate-pay"), "{reason}");
            }
            other => panic!("expected the missing compensation refused, got {other:?}"),
        }
        let refused = shared(SHIP, true).unwrap_err().to_string();
        assert!(
            refused.contains(r#"SharedStep::new("ship").compensated_by("compensate-ship")"#),
            "{refused}"
        );
    }

    #[test]
    fn a_step_whose_derived_names_are_invalid_is_refused_naming_it_never_renamed() {
        // 45 characters: a valid step name, but `compensate-` makes 56, over the limit of 54.
        let long = "s".repeat(45);
        let compensated = SagaDefinition::new("orders", "replies").unwrap().step(
            step(&long).compensate_with_types(
                Command::new("commands", "Undo", |d: &Data| d["input"].clone()),
                ["undone"],
                Duration::from_secs(1),
            ),
        );
        assert_eq!(
            refusal(&compensated),
            (long.clone(), format!("compensate-{long}"))
        );
        assert!(
            step(&long).compensation_name().is_err(),
            "no fallback to the step's own name"
        );
        let message = compensated.validate().unwrap_err().to_string();
        assert!(message.contains(&long), "{message}");

        // Without a compensation only the reply step's name `on-{step}` is derived: 52 + 3 is too long.
        let longer = "r".repeat(52);
        let plain = SagaDefinition::new("orders", "replies")
            .unwrap()
            .step(step(&longer));
        assert_eq!(refusal(&plain), (longer.clone(), format!("on-{longer}")));

        // The longest name that leaves room for every derived one.
        let fits = "f".repeat(MAX_STEP_NAME_LEN - "on-compensate-".len());
        let fine = SagaDefinition::new("orders", "replies").unwrap().step(
            step(&fits).compensate_with_types(
                Command::new("commands", "Undo", |d: &Data| d["input"].clone()),
                ["undone"],
                Duration::from_secs(1),
            ),
        );
        fine.validate().unwrap();
        assert_eq!(
            fine.steps[0].compensation_name().unwrap().as_str(),
            format!("compensate-{fits}")
        );
    }
}
