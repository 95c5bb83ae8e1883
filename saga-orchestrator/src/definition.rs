//! The saga definition API: an ordered list of steps, each with a command to send, the replies that
//! complete or fail it, an optional compensation, and a timeout.

use std::sync::Arc;
use std::time::Duration;

use saga_core::{KeyError, StepName};

/// Builds a command's payload from the saga's data (what it was started with, plus every reply so far
/// under its step's name).
pub type PayloadFn = Arc<dyn Fn(&serde_json::Value) -> serde_json::Value + Send + Sync>;

/// A command the orchestrator sends.
#[derive(Clone)]
pub struct Command {
    /// The participant's command topic.
    pub topic: String,
    /// The command's event type (`ce_type`).
    pub event_type: String,
    /// Its payload.
    pub payload: PayloadFn,
}

impl Command {
    /// A command of type `E` (its type from [`saga_core::SagaEvent::TYPE`]) to `topic`, with the payload
    /// `payload` builds from the saga's data.
    ///
    /// # Examples
    ///
    /// ```
    /// use saga_core::SagaEvent;
    /// use saga_orchestrator::Command;
    ///
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct ProcessPayment { order_id: String }
    /// impl SagaEvent for ProcessPayment { const TYPE: &'static str = "ProcessPayment"; }
    ///
    /// let charge = Command::of::<ProcessPayment>("saga.payment-commands", |data| data["input"].clone());
    /// assert_eq!(charge.event_type, "ProcessPayment");
    /// ```
    pub fn of<E: saga_core::SagaEvent>(
        topic: impl Into<String>,
        payload: impl Fn(&serde_json::Value) -> serde_json::Value + Send + Sync + 'static,
    ) -> Self {
        Self::new(topic, E::TYPE, payload)
    }

    /// A command of `event_type` on `topic`, with the payload `payload` builds from the saga's data, for
    /// types known only at run time. Prefer [`Command::of`].
    pub fn new(
        topic: impl Into<String>,
        event_type: impl Into<String>,
        payload: impl Fn(&serde_json::Value) -> serde_json::Value + Send + Sync + 'static,
    ) -> Self {
        Self {
            topic: topic.into(),
            event_type: event_type.into(),
            payload: Arc::new(payload),
        }
    }
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Command")
            .field("topic", &self.topic)
            .field("event_type", &self.event_type)
            .finish_non_exhaustive()
    }
}

/// What happens when a step's reply does not come within its timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnTimeout {
    /// The step failed: compensate (the timed-out step included: its effect may have happened).
    Fail,
    /// Send the command again, with the same key, up to `attempts` times in all; then fail.
    Retry {
        /// Sends in all, the first included.
        attempts: u32,
    },
}

/// A compensating action.
#[derive(Debug, Clone)]
pub struct Compensation {
    /// The command that undoes the step. The participant's step for it must be named
    /// `compensate-{step}`, so its key is `{original-key}:compensate-{step}`.
    pub command: Command,
    /// The replies that confirm it.
    pub done_on: Vec<String>,
    /// How long to wait for a confirmation before sending the command again (same key). A compensation is
    /// never skipped.
    pub resend_after: Duration,
}

/// One step of a saga.
#[derive(Debug, Clone)]
pub struct Step {
    /// The step's name; the participant's step handling the command must have the same name, so that its
    /// key is `{original-key}:{step}`.
    pub name: StepName,
    /// The command that runs it.
    pub command: Command,
    /// Replies that complete it.
    pub succeeds_on: Vec<String>,
    /// Replies that fail it (permanently): the saga compensates the steps before it.
    pub fails_on: Vec<String>,
    /// How to undo it, if it can be undone.
    pub compensation: Option<Compensation>,
    /// How long to wait for a reply.
    pub timeout: Duration,
    /// What a timeout means.
    pub on_timeout: OnTimeout,
}

impl Step {
    /// A step `name` run by `command`, with a 30-second timeout that fails it.
    pub fn new(name: &str, command: Command) -> Result<Self, KeyError> {
        Ok(Self {
            name: StepName::new(name)?,
            command,
            succeeds_on: Vec::new(),
            fails_on: Vec::new(),
            compensation: None,
            timeout: Duration::from_secs(30),
            on_timeout: OnTimeout::Fail,
        })
    }

    /// Replies that complete the step.
    pub fn succeeds_on<I: IntoIterator<Item = S>, S: Into<String>>(mut self, types: I) -> Self {
        self.succeeds_on = types.into_iter().map(Into::into).collect();
        self
    }

    /// Replies that fail the step.
    pub fn fails_on<I: IntoIterator<Item = S>, S: Into<String>>(mut self, types: I) -> Self {
        self.fails_on = types.into_iter().map(Into::into).collect();
        self
    }

    /// The step's compensation, confirmed by `done_on`, re-sent every `resend_after` until confirmed.
    pub fn compensate_with<I: IntoIterator<Item = S>, S: Into<String>>(
        mut self,
        command: Command,
        done_on: I,
        resend_after: Duration,
    ) -> Self {
        self.compensation = Some(Compensation {
            command,
            done_on: done_on.into_iter().map(Into::into).collect(),
            resend_after,
        });
        self
    }

    /// The reply timeout and what it means.
    pub fn timeout(mut self, after: Duration, then: OnTimeout) -> Self {
        self.timeout = after;
        self.on_timeout = then;
        self
    }

    /// `compensate-{step}`: the name of the participant step that compensates this one.
    pub fn compensation_name(&self) -> StepName {
        StepName::new(&format!("compensate-{}", self.name)).unwrap_or_else(|_| self.name.clone())
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
    /// A step expects no reply at all.
    #[error("saga {saga}: step {step} has no reply that completes it")]
    NoReply {
        /// The saga type.
        saga: String,
        /// The step.
        step: String,
    },
}

/// A saga type: its steps in order, and the topic its participants reply on.
#[derive(Debug, Clone)]
pub struct SagaDefinition {
    /// The saga type, such as `order-fulfillment`.
    pub saga_type: StepName,
    /// Where participants send their replies.
    pub reply_topic: String,
    /// The steps, in order.
    pub steps: Vec<Step>,
}

impl SagaDefinition {
    /// A saga type `saga_type` whose replies arrive on `reply_topic`.
    pub fn new(saga_type: &str, reply_topic: impl Into<String>) -> Result<Self, DefinitionError> {
        Ok(Self {
            saga_type: StepName::new(saga_type)?,
            reply_topic: reply_topic.into(),
            steps: Vec::new(),
        })
    }

    /// Appends a step.
    pub fn step(mut self, step: Step) -> Self {
        self.steps.push(step);
        self
    }

    /// Checks the definition.
    pub fn validate(&self) -> Result<(), DefinitionError> {
        let saga = self.saga_type.to_string();
        if self.steps.is_empty() {
            return Err(DefinitionError::Empty(saga));
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
            if step.succeeds_on.is_empty() {
                return Err(DefinitionError::NoReply {
                    saga,
                    step: step.name.to_string(),
                });
            }
            let compensation_replies = step.compensation.iter().flat_map(|c| &c.done_on);
            for reply in step
                .succeeds_on
                .iter()
                .chain(&step.fails_on)
                .chain(compensation_replies)
            {
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

    /// The index of step `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.steps.iter().position(|s| s.name.as_str() == name)
    }
}
