//! [`Cause`]: an error of a part whose own error type is not part of the framework's API.

use std::error::Error;
use std::fmt;

/// The cause of a failure, from a part whose error type is not part of the framework's API (the Kafka
/// client's, the runtime's key store's): its message, and its own sources kept in the error chain
/// ([`Error::source`] answers the wrapped error's source, as a transparent error does).
///
/// ```
/// use saga_config::Cause;
///
/// let cause = Cause::new(std::io::Error::other("connection refused"));
/// assert_eq!(cause.to_string(), "connection refused");
/// assert_eq!(Cause::message("no partition leader").to_string(), "no partition leader");
/// ```
pub struct Cause(Box<dyn Error + Send + Sync>);

impl Cause {
    /// `e`, kept as a cause.
    pub fn new(e: impl Error + Send + Sync + 'static) -> Self {
        Self(Box::new(e))
    }

    /// A cause that is only a message: what the framework found wrong (a read that did not finish in
    /// time, an answer this version cannot read).
    pub fn message(text: impl Into<String>) -> Self {
        Self(text.into().into())
    }

    /// The wrapped error, to downcast (`cause.get().downcast_ref::<T>()`).
    pub fn get(&self) -> &(dyn Error + Send + Sync + 'static) {
        &*self.0
    }
}

impl fmt::Debug for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl Error for Cause {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.0.source()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Outer(std::io::Error);

    impl fmt::Display for Outer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("outer")
        }
    }

    impl Error for Outer {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_cause_says_its_error_and_keeps_that_errors_sources() {
        let cause = Cause::new(Outer(std::io::Error::other("inner")));
        assert_eq!(cause.to_string(), "outer");
        assert_eq!(
            cause.source().map(ToString::to_string).as_deref(),
            Some("inner")
        );
        assert!(cause.get().downcast_ref::<Outer>().is_some());
        assert!(Cause::message("m").source().is_none());
    }
}
