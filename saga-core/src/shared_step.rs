//! A step name the services of an orchestrated saga must agree on, declared once.

use crate::key::{MAX_STEP_NAME_LEN, StepName};

/// `compensate-`: the prefix of a compensation's step name.
const COMPENSATE: &[u8] = b"compensate-";
/// `on-compensate-`: the longest prefix the orchestrator puts before a step's name (its compensation's
/// reply step).
const ON_COMPENSATE: usize = b"on-compensate-".len();

/// The name of an orchestrated saga's step, declared once where both sides read it (a module or crate the
/// orchestrator's service and the participant's share): the orchestrator's step
/// (`Step::shared` in `saga-orchestrator`), the participant step that serves its commands, and, for a
/// compensated step, the participant step that serves its compensation, always `compensate-{step}`.
///
/// Declared as a `const`, it is checked when compiled: a name that is no valid step name, too long for
/// the names derived from it, or a compensation not named `compensate-{step}` does not build.
/// The orchestrator checks at its start that a step declared compensated has a compensation, and one
/// declared without has none.
///
/// ```
/// use saga_core::SharedStep;
///
/// pub const PROCESS_PAYMENT: SharedStep =
///     SharedStep::new("process-payment").compensated_by("compensate-process-payment");
/// pub const ARRANGE_SHIPMENT: SharedStep = SharedStep::new("arrange-shipment");
///
/// assert_eq!(PROCESS_PAYMENT.name(), "process-payment");
/// assert_eq!(PROCESS_PAYMENT.compensation(), Some("compensate-process-payment"));
/// assert_eq!(ARRANGE_SHIPMENT.compensation(), None);
/// ```
///
/// ```compile_fail,E0080
/// const REFUND: saga_core::SharedStep =
///     saga_core::SharedStep::new("process-payment").compensated_by("refund-payment");
/// # let _ = REFUND;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SharedStep {
    name: &'static str,
    compensation: Option<&'static str>,
}

impl SharedStep {
    /// The step `name`: 1 to 40 bytes of lowercase ASCII letters, digits and `-`, starting with a letter
    /// (40, so that `on-compensate-{step}`, the longest name the orchestrator derives, fits).
    ///
    /// # Panics
    /// If `name` is not such a name: at compile time in a `const`.
    pub const fn new(name: &'static str) -> Self {
        let bytes = name.as_bytes();
        assert!(
            !bytes.is_empty() && bytes.len() + ON_COMPENSATE <= MAX_STEP_NAME_LEN,
            "a shared step's name is 1 to 40 bytes"
        );
        assert!(
            bytes[0].is_ascii_lowercase(),
            "a step name starts with a lowercase ASCII letter"
        );
        let mut i = 0;
        while i < bytes.len() {
            let c = bytes[i];
            assert!(
                c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-',
                "a step name is lowercase ASCII letters, digits and -"
            );
            i += 1;
        }
        Self {
            name,
            compensation: None,
        }
    }

    /// Declares that the step is compensated, by the participant step `name`, which must be
    /// `compensate-{step}` (written out, so that a search for it finds the declaration).
    ///
    /// # Panics
    /// If `name` is not `compensate-{step}`: at compile time in a `const`.
    pub const fn compensated_by(self, name: &'static str) -> Self {
        let (step, compensation) = (self.name.as_bytes(), name.as_bytes());
        assert!(
            compensation.len() == COMPENSATE.len() + step.len(),
            "a step's compensation is named compensate- followed by the step's name"
        );
        let mut i = 0;
        while i < compensation.len() {
            let expected = if i < COMPENSATE.len() {
                COMPENSATE[i]
            } else {
                step[i - COMPENSATE.len()]
            };
            assert!(
                compensation[i] == expected,
                "a step's compensation is named compensate- followed by the step's name"
            );
            i += 1;
        }
        Self {
            name: self.name,
            compensation: Some(name),
        }
    }

    /// The step's name.
    pub const fn name(self) -> &'static str {
        self.name
    }

    /// The name of the participant step that compensates it, when it is declared compensated.
    pub const fn compensation(self) -> Option<&'static str> {
        self.compensation
    }

    /// The step's name, as the step name type.
    pub fn step_name(self) -> StepName {
        StepName::from_static(self.name)
    }
}

impl AsRef<str> for SharedStep {
    fn as_ref(&self) -> &str {
        self.name
    }
}

impl std::fmt::Display for SharedStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_declared_name_and_its_compensation_read_back() {
        const PAY: SharedStep = SharedStep::new("pay-2").compensated_by("compensate-pay-2");
        assert_eq!(PAY.name(), "pay-2");
        assert_eq!(PAY.compensation(), Some("compensate-pay-2"));
        assert_eq!(PAY.step_name().as_str(), "pay-2");
        assert_eq!(SharedStep::new("ship").compensation(), None);
        // The longest: `on-compensate-{step}` is a valid step name.
        let longest = SharedStep::new("a234567890123456789012345678901234567890");
        let derived = format!("on-compensate-{}", longest.name());
        assert!(StepName::new(&derived).is_ok(), "{derived}");
    }

    #[test]
    fn names_that_would_not_work_are_refused() {
        for bad in [
            "",
            "Pay",
            "1pay",
            "pay_2",
            "pay 2",
            "a2345678901234567890123456789012345678901",
        ] {
            let refused = std::panic::catch_unwind(|| SharedStep::new(bad));
            assert!(refused.is_err(), "{bad:?} is refused");
        }
        for bad in [
            "compensate-pa",
            "compensate-pay-3",
            "refund-pay-2",
            "compensate-pay-2x",
        ] {
            let refused = std::panic::catch_unwind(|| SharedStep::new("pay-2").compensated_by(bad));
            assert!(refused.is_err(), "{bad:?} is refused");
        }
    }
}
