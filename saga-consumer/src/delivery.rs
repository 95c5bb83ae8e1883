//! A consumed message on its way through the runtime: where it is routed (a step, ignored, or poison) and
//! its tracing span.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use saga_core::{EnvelopeError, EventMetadata, Origin, RawMessage, StepKey, TenantId};
use saga_runtime::trace;

use crate::dlq::DeadLetterReason;
use crate::handler::{Decoded, RegisteredStep};
use crate::hold::Role;
use crate::machine::Kind;

/// Why a message can never be handled.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PoisonReason {
    /// Its headers or payload do not decode (missing or invalid key header, bad JSON, ...).
    #[error(transparent)]
    Envelope(#[from] EnvelopeError),
    /// It arrived on the retry topic without the replay headers naming its original topic.
    #[error(transparent)]
    NotAReplay(#[from] saga_runtime::replay::NotAReplay),
    /// No step handles its event type on its topic, which is declared strict.
    #[error("no step handles event type {event_type:?} on topic {topic:?}")]
    UnknownEventType {
        /// The topic.
        topic: String,
        /// The event type.
        event_type: String,
    },
}

/// Where a message goes.
pub(crate) enum Route {
    /// To a step.
    Step {
        step: Arc<RegisteredStep>,
        decoded: Decoded,
        step_key: StepKey,
        tenant: TenantId,
    },
    /// Nowhere: its event type is declared ignored on this topic, or no step reads it on a topic not
    /// declared strict.
    Ignored,
    /// To the dead-letter topic.
    Poison(PoisonReason),
}

/// A consumed message and where it goes.
pub(crate) struct Delivery {
    pub raw: RawMessage,
    /// For a replay read from the retry topic: where the message was first consumed (it is routed by that
    /// topic, and a dead letter of it names these coordinates).
    pub replayed_from: Option<Origin>,
    pub route: Route,
    pub span: tracing::Span,
    /// Attempts so far (the current one included once it has started).
    pub attempts: u32,
    /// Processed alone because the last run died near it: the crash-loop guard counts its starts.
    pub isolated: bool,
    /// For an isolated message: the guard's exclusive lock, held while it runs (see `guard`).
    pub alone: Option<tokio::sync::OwnedRwLockWriteGuard<()>>,
    /// Redis knows its step key to be completed: it is finished as a duplicate without a claim (see
    /// `fast`); or it is a stale copy of a held key's release (see `hold`).
    pub known_done: bool,
    /// What its key's hold makes of it (see `hold`): it runs, is parked, or releases its key.
    pub hold: Role,
    /// Its key's hold could not be read, for good (a row this version cannot read): it is dead-lettered
    /// with this reason (`store-refused`) rather than run out of its key's order.
    pub store_refused: Option<String>,
}

impl Delivery {
    /// Where the message was first consumed: its own position, or, for a replay, the original one.
    pub(crate) fn original(&self) -> &Origin {
        self.replayed_from.as_ref().unwrap_or(&self.raw.origin)
    }

    pub(crate) fn step_name(&self) -> Option<&str> {
        match &self.route {
            Route::Step { step, .. } => Some(step.name.as_str()),
            _ => None,
        }
    }

    /// How the batch machine processes it.
    pub(crate) fn kind(&self) -> Kind {
        if self.store_refused.is_some() {
            return Kind::Poison(DeadLetterReason::StoreRefused);
        }
        if self.hold == Role::Park {
            return Kind::Held;
        }
        self.unheld_kind()
    }

    /// How the batch machine processes it once its key turned out not held.
    pub(crate) fn unheld_kind(&self) -> Kind {
        match &self.route {
            _ if self.known_done => Kind::NoClaim,
            Route::Ignored => Kind::NoClaim,
            Route::Poison(PoisonReason::UnknownEventType { .. }) => {
                Kind::Poison(DeadLetterReason::UnknownEventType)
            }
            Route::Poison(_) => Kind::Poison(DeadLetterReason::Undecodable),
            Route::Step { step, .. } => match step.mode {
                crate::handler::StepMode::Transactional(_) => Kind::Transactional,
                crate::handler::StepMode::TwoPhase(_) => Kind::TwoPhase,
            },
        }
    }

    /// Why a poison message can never be handled (empty for others).
    pub(crate) fn poison_text(&self) -> String {
        if let Some(refused) = &self.store_refused {
            return refused.clone();
        }
        match &self.route {
            Route::Poison(reason) => reason.to_string(),
            _ => String::new(),
        }
    }

    /// Whether the batch's transaction has nothing to do for it: ignored, or known done.
    pub(crate) fn needs_no_claim(&self) -> bool {
        self.known_done || matches!(self.route, Route::Ignored)
    }

    pub(crate) fn is_transactional_or_ignored(&self) -> bool {
        match &self.route {
            Route::Ignored => true,
            Route::Step { step, .. } => {
                matches!(step.mode, crate::handler::StepMode::Transactional(_))
            }
            Route::Poison(_) => false,
        }
    }
}

/// Whether `raw`, consumed from the retry topic (`replayed` read its original), is an operator's replay
/// of a dead letter (not a held key's release).
fn is_letter_replay(
    raw: &RawMessage,
    replayed: &Option<Result<Origin, saga_runtime::replay::NotAReplay>>,
) -> bool {
    matches!(replayed, Some(Ok(_)))
        && raw
            .headers
            .get_str(saga_runtime::replay::LETTER)
            .ok()
            .flatten()
            .is_some_and(|l| !l.is_empty())
}

/// Routes messages by topic and event type.
pub(crate) struct Router {
    steps: HashMap<(String, String), Arc<RegisteredStep>>,
    ignored: HashSet<(String, String)>,
    /// Topics whose event types no step reads are poison, not skipped.
    strict: HashSet<String>,
    /// The consumer group, named by each message's span.
    group: String,
    /// The group's retry topic: its messages are routed by the original topic their headers name.
    retry_topic: String,
}

impl Router {
    pub(crate) fn new(
        steps: &[RegisteredStep],
        ignored: &[(String, String)],
        strict: &[String],
        group: String,
        retry_topic: String,
    ) -> Self {
        Self {
            steps: steps
                .iter()
                .flat_map(|s| {
                    let step = Arc::new(s.clone());
                    s.subscriptions.iter().map(move |sub| {
                        (
                            (sub.topic().to_owned(), sub.event_type().to_owned()),
                            step.clone(),
                        )
                    })
                })
                .collect(),
            ignored: ignored.iter().cloned().collect(),
            strict: strict.iter().cloned().collect(),
            group,
            retry_topic,
        }
    }

    /// Reads the headers, finds the step and decodes the payload. The message's span continues the trace
    /// its headers carry; the events its step emits are that span's children.
    pub(crate) fn route(&self, raw: RawMessage) -> Delivery {
        // A replay on the retry topic goes where a message of its original topic goes.
        let replayed = (raw.origin.topic == self.retry_topic)
            .then(|| saga_runtime::replay::original_of(&raw.headers));
        let routing_topic = match &replayed {
            Some(Ok(original)) => original.topic.as_str(),
            _ => raw.origin.topic.as_str(),
        };
        let meta = EventMetadata::from_headers(&raw.headers);
        let id = meta
            .as_ref()
            .ok()
            .map(|m| (routing_topic.to_owned(), m.event_type.clone()));
        let step = id.as_ref().and_then(|id| self.steps.get(id));
        let step_key = match (&meta, step) {
            (Ok(meta), Some(step)) => Some(meta.step_key(&step.name)),
            _ => None,
        };
        let read = meta.as_ref().ok();
        let span = trace::process_span(
            &trace::MessageFields {
                topic: &raw.origin.topic,
                partition: raw.origin.partition,
                offset: raw.origin.offset,
                key: raw.key.as_deref(),
                group: &self.group,
                tenant: read.map(|m| m.tenant.as_str()),
                event_type: read.map(|m| m.event_type.as_str()),
                step: step.map(|s| s.name.as_str()),
                step_key: step_key.as_ref().map(StepKey::as_str),
                traceparent: read.and_then(|m| m.traceparent.as_ref()),
            },
            &raw.headers,
        );
        let letter_replay = is_letter_replay(&raw, &replayed);
        let (replayed_from, not_a_replay) = match replayed {
            Some(Ok(original)) => (Some(original), None),
            Some(Err(e)) => (None, Some(e)),
            None => (None, None),
        };
        let route = match (meta, id, step, step_key) {
            _ if not_a_replay.is_some() => {
                Route::Poison(not_a_replay.expect("checked by the guard").into())
            }
            (Err(e), ..) => Route::Poison(e.into()),
            (Ok(mut meta), _, Some(step), Some(step_key)) => {
                let tenant = meta.tenant.clone();
                meta.span_context = trace::span_context(&span);
                let origin = replayed_from.as_ref().unwrap_or(&raw.origin);
                match step.decode(&raw, meta, origin) {
                    Ok(decoded) => Route::Step {
                        step: step.clone(),
                        decoded,
                        step_key,
                        tenant,
                    },
                    Err(e) => Route::Poison(e.into()),
                }
            }
            // Declared none of its business, or on a topic not declared strict: another service's type.
            // An operator's replay of a dead letter is never skipped: it was sent to be run, and a skip
            // would close the letter with nothing done (it is dead-lettered again, saying why).
            (Ok(_), Some(id), ..)
                if self.ignored.contains(&id)
                    || !(self.strict.contains(&id.0) || letter_replay) =>
            {
                Route::Ignored
            }
            (Ok(meta), ..) => Route::Poison(PoisonReason::UnknownEventType {
                topic: replayed_from
                    .as_ref()
                    .map_or_else(|| raw.origin.topic.clone(), |o| o.topic.clone()),
                event_type: meta.event_type,
            }),
        };
        Delivery {
            raw,
            replayed_from,
            route,
            span,
            attempts: 0,
            isolated: false,
            alone: None,
            known_done: false,
            hold: Role::Free,
            store_refused: None,
        }
    }
}
