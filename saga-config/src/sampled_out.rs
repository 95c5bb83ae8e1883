//! [`SampledOut`]: which of the framework's spans a tracer provider's sampler drops.

/// Which of the framework's spans the sampler would drop, so that they are left out of OpenTelemetry at
/// their call site instead of being built first: what the framework's OpenTelemetry layer
/// (`saga_consumer::telemetry::otel_layer`) is told about its provider's sampler, by `OTEL_TRACES_SAMPLER` or
/// in code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SampledOut {
    /// None: the sampler decides every span (a sampler that ignores the parent's decision, such as
    /// `always_on` or `traceidratio`).
    #[default]
    Undecided,
    /// The spans whose parent context is sampled out (a `traceparent` with the "sampled" flag clear): what
    /// the parent-based samplers, OpenTelemetry's default, drop. Roots are left to the sampler.
    ChildrenOfSampledOut,
    /// Every span: the sampler is `always_off`.
    Everything,
}

impl SampledOut {
    /// What `OTEL_TRACES_SAMPLER` says, as the SDK reads it: unset or `parentbased_*` is
    /// [`SampledOut::ChildrenOfSampledOut`], `always_off` is [`SampledOut::Everything`], anything else
    /// [`SampledOut::Undecided`]. For a provider whose sampler is set in code, say it directly.
    pub fn from_env() -> Self {
        Self::for_sampler(std::env::var("OTEL_TRACES_SAMPLER").ok().as_deref())
    }

    /// What an `OTEL_TRACES_SAMPLER` value (`None`: unset) says; see [`SampledOut::from_env`].
    pub fn for_sampler(name: Option<&str>) -> Self {
        match name.map(str::trim) {
            None | Some("") => Self::ChildrenOfSampledOut,
            Some(n) if n.starts_with("parentbased_") => Self::ChildrenOfSampledOut,
            Some("always_off") => Self::Everything,
            Some(_) => Self::Undecided,
        }
    }
}
