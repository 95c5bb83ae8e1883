//! The saga definition API: an ordered list of steps, each with a command to send, the replies that
//! complete or fail it, an optional compensation, and a timeout.

use std::sync::Arc;
use std::time::Duration;

use saga_core::{KeyError, SagaEvent, StepName, Topic};

/// Builds a command from the saga's data (what it was started with, plus every reply so far under its step's
/// name): its event type and its JSON payload.
type BuildFn = Arc<dyn Fn(&serde_json::Value) -> (String, serde_json::Value) + Send + Sync>;

/// A command the orchestrator sends: to a participant's command topic, built from the saga's data.
#[derive(Clone)]
pub struct Command {
    topic: String,
    build: BuildFn,
}

impl Command {
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
    /// let commands: Topic<ProcessPayment> = Topic::new("saga.payment-commands");
    /// let charge = Command::to(&commands, |data| ProcessPayment {
    ///     order_id: data["input"]["order_id"].as_str().unwrap_or_default().to_owned(),
    /// });
    /// let (event_type, payload) = charge.build(&serde_json::json!({ "input": { "order_id": "7" } }));
    /// assert_eq!((event_type.as_str(), payload["order_id"].as_str()), ("ProcessPayment", Some("7")));
    /// ```
    pub fn to<E: SagaEvent>(
        topic: &Topic<E>,
        build: impl Fn(&serde_json::Value) -> E + Send + Sync + 'static,
    ) -> Self {
        Self {
            topic: topic.name().to_owned(),
            build: Arc::new(move |data| {
                let event = build(data);
                let payload = event
                    .to_json()
                    .and_then(|json| serde_json::from_slice(&json))
                    .unwrap_or_else(|e| {
                        // A payload type whose Serialize fails (a map with non-string keys): said loudly.
                        tracing::error!(error = %e, "a saga command does not serialize; sending null");
                        serde_json::Value::Null
                    });
                (event.event_type().to_owned(), payload)
            }),
        }
    }

    /// A command of `event_type` on `topic`, with the payload `payload` builds from the saga's data, for
    /// types known only at run time. Prefer [`Command::to`].
    pub fn new(
        topic: impl Into<String>,
        event_type: impl Into<String>,
        payload: impl Fn(&serde_json::Value) -> serde_json::Value + Send + Sync + 'static,
    ) -> Self {
        let event_type = event_type.into();
        Self {
            topic: topic.into(),
            build: Arc::new(move |data| (event_type.clone(), payload(data))),
        }
    }

    /// The participant's command topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The command for the saga's `data`: its event type and payload.
    pub fn build(&self, data: &serde_json::Value) -> (String, serde_json::Value) {
        (self.build)(data)
    }
}

impl std::fmt::Debug for Command {
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

/// A compensating action.
#[derive(Debug, Clone)]
#[non_exhaustive]
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
#[non_exhaustive]
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

    /// Replies that complete the step, by event type: `E::TYPES` of an event, or a family's variants'
    /// constants.
    pub fn succeeds_on<I: IntoIterator<Item = S>, S: AsRef<str>>(mut self, types: I) -> Self {
        self.succeeds_on = types.into_iter().map(|t| t.as_ref().to_owned()).collect();
        self
    }

    /// Replies that fail the step, by event type.
    pub fn fails_on<I: IntoIterator<Item = S>, S: AsRef<str>>(mut self, types: I) -> Self {
        self.fails_on = types.into_iter().map(|t| t.as_ref().to_owned()).collect();
        self
    }

    /// The step's compensation, confirmed by `done_on`, re-sent every `resend_after` until confirmed.
    pub fn compensate_with<I: IntoIterator<Item = S>, S: AsRef<str>>(
        mut self,
        command: Command,
        done_on: I,
        resend_after: Duration,
    ) -> Self {
        self.compensation = Some(Compensation {
            command,
            done_on: done_on.into_iter().map(|t| t.as_ref().to_owned()).collect(),
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

    /// `compensate-{step}`: the name of the participant step that compensates this one. Fails if that is
    /// no valid step name (the step's name is too long for the prefix): [`SagaDefinition::validate`]
    /// refuses such a definition, naming the step.
    pub fn compensation_name(&self) -> Result<StepName, KeyError> {
        StepName::new(&format!("compensate-{}", self.name))
    }

    /// The names this step needs besides its own: the reply step `on-{step}` and, with a compensation,
    /// `compensate-{step}` and its reply step `on-compensate-{step}`. Each must be a valid step name.
    fn derived_names(&self) -> Vec<String> {
        let mut names = vec![format!("on-{}", self.name)];
        if self.compensation.is_some() {
            names.push(format!("compensate-{}", self.name));
            names.push(format!("on-compensate-{}", self.name));
        }
        names
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
#[non_exhaustive]
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

#[cfg(test)]
mod tests {
    use saga_core::MAX_STEP_NAME_LEN;

    use super::*;

    fn step(name: &str) -> Step {
        Step::new(name, Command::new("commands", "Do", |d| d["input"].clone()))
            .unwrap()
            .succeeds_on([format!("{name}-done")])
    }

    fn refusal(definition: &SagaDefinition) -> (String, String) {
        match definition.validate() {
            Err(DefinitionError::DerivedName { step, derived, .. }) => (step, derived),
            other => panic!("expected a refused derived name, got {other:?}"),
        }
    }

    #[test]
    fn a_step_whose_derived_names_are_invalid_is_refused_naming_it_never_renamed() {
        // 45 characters: a valid step name, but `compensate-` makes 56, over the limit of 54.
        let long = "s".repeat(45);
        let compensated =
            SagaDefinition::new("orders", "replies")
                .unwrap()
                .step(step(&long).compensate_with(
                    Command::new("commands", "Undo", |d| d["input"].clone()),
                    ["undone"],
                    Duration::from_secs(1),
                ));
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
        let fine =
            SagaDefinition::new("orders", "replies")
                .unwrap()
                .step(step(&fits).compensate_with(
                    Command::new("commands", "Undo", |d| d["input"].clone()),
                    ["undone"],
                    Duration::from_secs(1),
                ));
        fine.validate().unwrap();
        assert_eq!(
            fine.steps[0].compensation_name().unwrap().as_str(),
            format!("compensate-{fits}")
        );
    }
}
