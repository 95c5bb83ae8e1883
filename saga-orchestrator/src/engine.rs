//! The orchestrator's decisions, as a pure function of the definition, the instance's state and an event:
//! which state comes next and which command to send. No I/O here; `store` applies decisions.

use std::time::Duration;

use saga_core::StepName;
use serde_json::Value;

use crate::definition::{OnTimeout, SagaDefinition, Verdict};

/// Where a saga instance stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SagaStatus {
    /// Running its steps forward.
    Running,
    /// Undoing the completed steps, in reverse.
    Compensating,
    /// Every step completed.
    Completed,
    /// A step failed and every completed step was compensated.
    Compensated,
}

impl SagaStatus {
    /// The stored value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Compensating => "compensating",
            Self::Completed => "completed",
            Self::Compensated => "compensated",
        }
    }

    /// Parses a stored value.
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "running" => Some(Self::Running),
            "compensating" => Some(Self::Compensating),
            "completed" => Some(Self::Completed),
            "compensated" => Some(Self::Compensated),
            _ => None,
        }
    }

    /// Whether the saga ended.
    pub fn is_final(self) -> bool {
        matches!(self, Self::Completed | Self::Compensated)
    }
}

/// The state a decision depends on.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct SagaState<D> {
    /// Where it stands.
    pub status: SagaStatus,
    /// The step being run or compensated.
    pub step_index: usize,
    /// Sends of the current command so far.
    pub attempt: u32,
    /// The saga's data.
    pub data: D,
    /// Why it is compensating.
    pub failure: Option<String>,
}

impl<D> SagaState<D> {
    /// The state of a new instance started with `data`.
    pub(crate) fn started(data: D) -> Self {
        Self {
            status: SagaStatus::Running,
            step_index: 0,
            attempt: 1,
            data,
            failure: None,
        }
    }
}

/// What happened to an instance.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum SagaEvent<'a> {
    /// It was just created.
    Started,
    /// A participant replied.
    Reply {
        /// The reply's event type.
        event_type: &'a str,
        /// Its JSON payload.
        payload: &'a [u8],
    },
    /// The current step's deadline passed.
    Timeout,
    /// An operator asked for the current command to be sent again (`saga sagas retry`).
    Retry,
}

/// The cause recorded for a transition an operator's retry made.
pub(crate) const RETRY_CAUSE: &str = "retry";

/// A command to send.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Outgoing {
    /// The step (or compensation) it belongs to; the participant's step key is `{key}:{step}`.
    pub step: StepName,
    /// The topic.
    pub topic: String,
    /// The event type.
    pub event_type: String,
    /// The payload.
    pub payload: Value,
    /// Where the participant answers (the definition's reply topic): the command's `saga-reply-to`.
    pub reply_topic: String,
}

/// A decision: the next state, the command to send and when the next deadline falls.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Decision<D> {
    /// The next state.
    pub next: SagaState<D>,
    /// The command to send, if any.
    pub send: Option<Outgoing>,
    /// The new deadline, from now; `None` clears it (the saga ended).
    pub deadline: Option<Duration>,
    /// What caused the transition, for the history.
    pub cause: String,
    /// The step concerned, for the history.
    pub step: Option<String>,
}

/// Why no decision could be made: the user's code refused its input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// A reply did not decode as the step's reply type.
    Reply(String),
    /// A command could not be built from the data.
    Command(crate::definition::CommandError),
}

/// `compensate-{step}`, which [`SagaDefinition::validate`] (run by `Orchestrator::new`, the only way a
/// definition reaches `decide`) checked.
fn compensation_name<D>(step: &crate::definition::Step<D>) -> StepName {
    step.compensation_name()
        .expect("the orchestrator validated its definition's derived names when it was built")
}

/// Decides what `event` does to an instance in `state`. `Ok(None)`: nothing (a stale, duplicate or
/// unrelated reply, or an event for an ended saga); `Err`: the reply or a command refused by the user's
/// code, which leaves the instance as it is.
pub(crate) fn decide<D: Clone>(
    def: &SagaDefinition<D>,
    state: &SagaState<D>,
    event: SagaEvent<'_>,
) -> Result<Option<Decision<D>>, Refusal> {
    match (state.status, event) {
        (_, _) if state.status.is_final() => Ok(None),
        (SagaStatus::Running, SagaEvent::Started) => {
            run_step(def, state, state.step_index, 1, "started").map(Some)
        }
        (
            SagaStatus::Running,
            SagaEvent::Reply {
                event_type,
                payload,
            },
        ) => {
            let i = state.step_index;
            let Some(replies) = def.steps.get(i).and_then(|s| s.replies.as_ref()) else {
                return Ok(None);
            };
            if !replies.expects(event_type) {
                return Ok(None);
            }
            let step = &def.steps[i];
            let mut next = state.clone();
            match replies
                .apply(&mut next.data, event_type, payload)
                .map_err(Refusal::Reply)?
            {
                Verdict::Succeeded if i + 1 < def.steps.len() => {
                    run_step(def, &next, i + 1, 1, event_type).map(Some)
                }
                Verdict::Succeeded => {
                    next.status = SagaStatus::Completed;
                    Ok(Some(Decision {
                        next,
                        send: None,
                        deadline: None,
                        cause: event_type.to_owned(),
                        step: Some(step.name.to_string()),
                    }))
                }
                Verdict::Failed(reason) => {
                    next.failure = Some(reason);
                    // The step did not take effect: undo the ones before it.
                    compensate_from(def, next, i.checked_sub(1), event_type).map(Some)
                }
            }
        }
        (SagaStatus::Running, SagaEvent::Timeout) => {
            let i = state.step_index;
            let Some(step) = def.steps.get(i) else {
                return Ok(None);
            };
            match step.on_timeout {
                OnTimeout::Retry { attempts } if state.attempt < attempts => {
                    run_step(def, state, i, state.attempt + 1, "timeout").map(Some)
                }
                _ => {
                    let mut next = state.clone();
                    next.failure = Some(format!("{} timed out", step.name));
                    // Its effect may have happened: undo it too (compensations tolerate a missing effect).
                    compensate_from(def, next, Some(i), "timeout").map(Some)
                }
            }
        }
        (
            SagaStatus::Compensating,
            SagaEvent::Reply {
                event_type,
                payload,
            },
        ) => {
            let j = state.step_index;
            let Some(compensation) = def.steps.get(j).and_then(|s| s.compensation.as_ref()) else {
                return Ok(None);
            };
            if !compensation.done.expects(event_type) {
                return Ok(None);
            }
            let mut next = state.clone();
            compensation
                .done
                .apply(&mut next.data, event_type, payload)
                .map_err(Refusal::Reply)?;
            compensate_from(def, next, j.checked_sub(1), event_type).map(Some)
        }
        (SagaStatus::Running, SagaEvent::Retry) => {
            // The current step again, as a new attempt with the same key: a participant that completed
            // it absorbs the command; one that dead-lettered it runs it.
            if def.steps.get(state.step_index).is_none() {
                return Ok(None);
            }
            run_step(def, state, state.step_index, state.attempt + 1, RETRY_CAUSE).map(Some)
        }
        (SagaStatus::Compensating, event @ (SagaEvent::Retry | SagaEvent::Timeout)) => {
            // Never skipped: send the compensation again, with the same key.
            let j = state.step_index;
            let mut next = state.clone();
            next.attempt += 1;
            let Some((send, resend_after)) = compensation_command(def, &next, j)? else {
                return Ok(None);
            };
            let cause = match event {
                SagaEvent::Retry => RETRY_CAUSE,
                _ => "timeout",
            };
            Ok(Some(Decision {
                send: Some(send),
                deadline: Some(resend_after),
                cause: cause.into(),
                step: Some(compensation_name(&def.steps[j]).to_string()),
                next,
            }))
        }
        _ => Ok(None),
    }
}

/// Runs step `i` (send its command) as attempt `attempt`.
fn run_step<D: Clone>(
    def: &SagaDefinition<D>,
    state: &SagaState<D>,
    i: usize,
    attempt: u32,
    cause: &str,
) -> Result<Decision<D>, Refusal> {
    let step = &def.steps[i];
    let mut next = state.clone();
    next.status = SagaStatus::Running;
    next.step_index = i;
    next.attempt = attempt;
    let (event_type, payload) = step
        .command
        .build_for(&next.data, None)
        .map_err(Refusal::Command)?;
    Ok(Decision {
        send: Some(Outgoing {
            step: step.name.clone(),
            topic: step.command.topic().to_owned(),
            event_type,
            payload,
            reply_topic: def.reply_topic.clone(),
        }),
        deadline: Some(step.timeout),
        cause: cause.to_owned(),
        step: Some(step.name.to_string()),
        next,
    })
}

/// Starts (or continues) compensating from step `from` downwards: the highest step at or below it that
/// has a compensation; none left means the saga is compensated.
fn compensate_from<D>(
    def: &SagaDefinition<D>,
    mut next: SagaState<D>,
    from: Option<usize>,
    cause: &str,
) -> Result<Decision<D>, Refusal> {
    let target = from.and_then(|k| (0..=k).rev().find(|&j| def.steps[j].compensation.is_some()));
    match target {
        Some(j) => {
            next.status = SagaStatus::Compensating;
            next.step_index = j;
            next.attempt = 1;
            let (send, resend_after) =
                compensation_command(def, &next, j)?.expect("the target step has a compensation");
            Ok(Decision {
                send: Some(send),
                deadline: Some(resend_after),
                cause: cause.to_owned(),
                step: Some(compensation_name(&def.steps[j]).to_string()),
                next,
            })
        }
        None => {
            next.status = SagaStatus::Compensated;
            Ok(Decision {
                send: None,
                deadline: None,
                cause: cause.to_owned(),
                step: None,
                next,
            })
        }
    }
}

/// The compensation command of step `j`, built for why the saga compensates; `None` if it has none.
fn compensation_command<D>(
    def: &SagaDefinition<D>,
    state: &SagaState<D>,
    j: usize,
) -> Result<Option<(Outgoing, Duration)>, Refusal> {
    let Some(step) = def.steps.get(j) else {
        return Ok(None);
    };
    let Some(compensation) = step.compensation.as_ref() else {
        return Ok(None);
    };
    let why = state.failure.as_deref().unwrap_or("the saga compensates");
    let (event_type, payload) = compensation
        .command
        .build_for(&state.data, Some(why))
        .map_err(Refusal::Command)?;
    Ok(Some((
        Outgoing {
            step: compensation_name(step),
            topic: compensation.command.topic().to_owned(),
            event_type,
            payload,
            reply_topic: def.reply_topic.clone(),
        },
        compensation.resend_after,
    )))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::definition::{Command, Step};

    /// Three steps a, b, c; a and b can be compensated, c cannot. The data is JSON: each reply's payload
    /// is kept under its step's name.
    fn definition() -> SagaDefinition<Value> {
        let step = |name: &str, compensable: bool| {
            let upper = name.to_uppercase();
            let key = name.to_owned();
            let s = Step::new(
                name,
                Command::new("commands", format!("Do{upper}"), |d: &Value| d.clone()),
            )
            .unwrap()
            .replies_of(
                [format!("{upper}Done"), format!("{upper}Failed")],
                move |data, event_type, payload| {
                    let reason = payload["reason"].as_str().unwrap_or("failed").to_owned();
                    data[key.as_str()] = payload;
                    if event_type.ends_with("Done") {
                        Verdict::Succeeded
                    } else {
                        Verdict::Failed(reason)
                    }
                },
            );
            if compensable {
                s.compensate_with_types(
                    Command::new("commands", format!("Undo{upper}"), |d: &Value| d.clone()),
                    [format!("{upper}Undone")],
                    Duration::from_secs(5),
                )
            } else {
                s
            }
        };
        SagaDefinition::new("test-saga", "replies")
            .unwrap()
            .step(step("a", true))
            .step(step("b", true))
            .step(step("c", false))
    }

    fn reply<'a>(event_type: &'a str, payload: &'a [u8]) -> SagaEvent<'a> {
        SagaEvent::Reply {
            event_type,
            payload,
        }
    }

    /// Runs `replies` from the start; returns the commands sent, in order, and the final status.
    fn run(def: &SagaDefinition<Value>, events: &[SagaEvent<'_>]) -> (Vec<String>, SagaStatus) {
        let mut state = SagaState::started(json!({"input": {"order": 1}}));
        let mut sent = Vec::new();
        for event in std::iter::once(SagaEvent::Started).chain(events.iter().copied()) {
            if let Some(d) = decide(def, &state, event).unwrap() {
                sent.extend(d.send.map(|s| s.event_type));
                state = d.next;
            }
        }
        (sent, state.status)
    }

    #[test]
    fn the_happy_path_runs_every_step_in_order() {
        let def = definition();
        def.validate().unwrap();
        let ok = b"{}".as_slice();
        let (sent, status) = run(
            &def,
            &[reply("ADone", ok), reply("BDone", ok), reply("CDone", ok)],
        );
        assert_eq!(sent, vec!["DoA", "DoB", "DoC"]);
        assert_eq!(status, SagaStatus::Completed);
    }

    #[test]
    fn a_failure_at_each_step_compensates_exactly_the_completed_steps_in_reverse() {
        let def = definition();
        let ok = b"{}".as_slice();
        let no = br#"{"reason": "no"}"#.as_slice();
        let (sent, status) = run(&def, &[reply("AFailed", no)]);
        assert_eq!(
            (sent, status),
            (vec!["DoA".into()], SagaStatus::Compensated)
        );

        let (sent, status) = run(
            &def,
            &[
                reply("ADone", ok),
                reply("BFailed", no),
                reply("AUndone", ok),
            ],
        );
        assert_eq!(sent, vec!["DoA", "DoB", "UndoA"]);
        assert_eq!(status, SagaStatus::Compensated);

        let (sent, status) = run(
            &def,
            &[
                reply("ADone", ok),
                reply("BDone", ok),
                reply("CFailed", no),
                reply("BUndone", ok),
                reply("AUndone", ok),
            ],
        );
        assert_eq!(sent, vec!["DoA", "DoB", "DoC", "UndoB", "UndoA"]);
        assert_eq!(status, SagaStatus::Compensated);
    }

    #[test]
    fn a_timed_out_step_is_compensated_too_and_compensations_are_resent_not_skipped() {
        let def = definition();
        let ok = b"{}".as_slice();
        let (sent, status) = run(
            &def,
            &[
                reply("ADone", ok),
                SagaEvent::Timeout,
                SagaEvent::Timeout,
                reply("BUndone", ok),
                reply("AUndone", ok),
            ],
        );
        assert_eq!(sent, vec!["DoA", "DoB", "UndoB", "UndoB", "UndoA"]);
        assert_eq!(status, SagaStatus::Compensated);
    }

    #[test]
    fn a_step_with_retries_is_resent_before_it_fails() {
        let mut def = definition();
        def.steps[0].on_timeout = OnTimeout::Retry { attempts: 3 };
        let (sent, status) = run(
            &def,
            &[SagaEvent::Timeout, SagaEvent::Timeout, SagaEvent::Timeout],
        );
        assert_eq!(sent, vec!["DoA", "DoA", "DoA", "UndoA"]);
        assert_eq!(status, SagaStatus::Compensating);
    }

    #[test]
    fn a_retry_resends_the_current_command_as_a_new_attempt_and_a_finished_saga_has_none() {
        let def = definition();
        let decided = |state: &SagaState<Value>, event| decide(&def, state, event).unwrap();
        let started = decided(&SagaState::started(json!({})), SagaEvent::Started).unwrap();
        let retried = decided(&started.next, SagaEvent::Retry).unwrap();
        assert_eq!(retried.send, started.send, "the same command");
        assert_eq!(
            (
                retried.next.status,
                retried.next.step_index,
                retried.next.attempt
            ),
            (SagaStatus::Running, 0, 2)
        );
        assert_eq!(retried.cause, RETRY_CAUSE);
        // Compensating: the compensation again.
        let timed_out = decided(&started.next, SagaEvent::Timeout).unwrap();
        assert_eq!(timed_out.next.status, SagaStatus::Compensating);
        let again = decided(&timed_out.next, SagaEvent::Retry).unwrap();
        assert_eq!(again.send, timed_out.send);
        assert_eq!(again.next.attempt, timed_out.next.attempt + 1);
        // Finished: nothing to retry.
        let mut done = started.next;
        done.status = SagaStatus::Compensated;
        assert!(decided(&done, SagaEvent::Retry).is_none());
    }

    #[test]
    fn stale_and_unrelated_replies_change_nothing() {
        let def = definition();
        let ok = b"{}".as_slice();
        let (sent, status) = run(
            &def,
            &[
                reply("BDone", ok),
                reply("Unknown", ok),
                reply("ADone", ok),
                reply("ADone", ok),
            ],
        );
        assert_eq!(sent, vec!["DoA", "DoB"]);
        assert_eq!(status, SagaStatus::Running);
    }

    #[test]
    fn replies_are_kept_in_the_data_for_later_commands() {
        let def = definition();
        let state = SagaState::started(json!({"input": {"order": 7}}));
        let d = decide(&def, &state, reply("ADone", br#"{"charge": "ch_1"}"#))
            .unwrap()
            .unwrap();
        assert_eq!(
            d.next.data,
            json!({"input": {"order": 7}, "a": {"charge": "ch_1"}})
        );
        assert_eq!(d.send.unwrap().payload, d.next.data);
    }

    #[test]
    fn a_reply_that_does_not_decode_is_refused_with_its_reason_and_moves_nothing() {
        let def = definition();
        let started = decide(&def, &SagaState::started(json!({})), SagaEvent::Started)
            .unwrap()
            .unwrap();
        let refused = decide(&def, &started.next, reply("ADone", b"not json")).unwrap_err();
        let Refusal::Reply(reason) = refused else {
            panic!("expected a refused reply, got {refused:?}");
        };
        assert!(reason.contains("ADone"), "{reason}");
    }
}
