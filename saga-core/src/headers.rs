//! Message headers: the names the framework uses, an ordered header list free of any broker client type,
//! and the W3C `traceparent` value.

use std::fmt;

/// Header names. Where CloudEvents' Kafka protocol binding names a field, its name is used.
pub mod names {
    /// The client's original idempotency key, unchanged through the whole saga.
    pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
    /// The tenant the saga belongs to.
    pub const TENANT_ID: &str = "tenant-id";
    /// CloudEvents `id`: this message's unique id.
    pub const CE_ID: &str = "ce_id";
    /// CloudEvents `type`: the event type, such as `OrderCreated`.
    pub const CE_TYPE: &str = "ce_type";
    /// CloudEvents `source`: who produced the event.
    pub const CE_SOURCE: &str = "ce_source";
    /// CloudEvents `specversion`: always `1.0`.
    pub const CE_SPECVERSION: &str = "ce_specversion";
    /// CloudEvents `time`: when the event was produced (RFC 3339).
    pub const CE_TIME: &str = "ce_time";
    /// The payload's media type (CloudEvents binary mode maps `datacontenttype` here).
    pub const CONTENT_TYPE: &str = "content-type";
    /// The id shared by every message of one saga.
    pub const CORRELATION_ID: &str = "correlation-id";
    /// The id of the message whose handling produced this one.
    pub const CAUSATION_ID: &str = "causation-id";
    /// W3C trace context.
    pub const TRACEPARENT: &str = "traceparent";
    /// The topic an orchestrator's command asks to be answered on ([`crate::StepContext::reply`]).
    pub const REPLY_TO: &str = "saga-reply-to";
    /// The orchestrated saga instance a command belongs to; its replies are keyed by it.
    pub const SAGA_ID: &str = "saga-id";
}

/// The CloudEvents spec version the framework writes.
pub const CLOUDEVENTS_SPEC_VERSION: &str = "1.0";

/// A header value that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    /// The value is not UTF-8 text.
    #[error("header {name:?} is not valid UTF-8")]
    NotUtf8 {
        /// The header's name.
        name: String,
    },
    /// The header appears several times with different values, so which one applies is ambiguous.
    #[error("header {name:?} appears several times with different values")]
    Conflicting {
        /// The header's name.
        name: String,
    },
}

/// One message header. Kafka allows a header without a value (`None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The header's name.
    pub name: String,
    /// The header's value, if any.
    pub value: Option<Vec<u8>>,
}

/// The headers of a message, in order. Names may repeat, as in Kafka.
///
/// Shared when cloned: a consumed message's headers are kept both with the message the runtime holds (for a
/// dead letter) and with the decoded message a step reads, and a copy is made only when one is changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers(std::sync::Arc<Vec<Header>>);

impl Headers {
    /// No headers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a header.
    pub fn push(&mut self, name: impl Into<String>, value: Option<Vec<u8>>) {
        std::sync::Arc::make_mut(&mut self.0).push(Header {
            name: name.into(),
            value,
        });
    }

    /// Appends a text header.
    pub fn push_str(&mut self, name: impl Into<String>, value: impl Into<String>) {
        self.push(name, Some(value.into().into_bytes()));
    }

    /// Builder form of [`Headers::push_str`].
    pub fn with(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.push_str(name, value);
        self
    }

    /// The headers in order.
    pub fn iter(&self) -> impl Iterator<Item = &Header> {
        self.0.iter()
    }

    /// How many headers there are.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no headers.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The text value of header `name`, if present with a value.
    ///
    /// A header repeated with the same value is accepted; repeated with different values it is an error, as is
    /// a value that is not UTF-8. Names compare exactly (Kafka header names are case-sensitive).
    pub fn get_str(&self, name: &str) -> Result<Option<&str>, HeaderError> {
        let mut found: Option<&[u8]> = None;
        for header in self.0.iter().filter(|h| h.name == name) {
            let Some(value) = header.value.as_deref() else {
                continue;
            };
            match found {
                Some(previous) if previous != value => {
                    return Err(HeaderError::Conflicting {
                        name: name.to_owned(),
                    });
                }
                _ => found = Some(value),
            }
        }
        found
            .map(|v| {
                std::str::from_utf8(v).map_err(|_| HeaderError::NotUtf8 {
                    name: name.to_owned(),
                })
            })
            .transpose()
    }

    /// Removes every header named `name`.
    pub fn remove(&mut self, name: &str) {
        if self.0.iter().any(|h| h.name == name) {
            std::sync::Arc::make_mut(&mut self.0).retain(|h| h.name != name);
        }
    }

    /// Sets header `name` to `value`, replacing any previous occurrence.
    pub fn set_str(&mut self, name: &str, value: impl Into<String>) {
        self.remove(name);
        self.push_str(name, value);
    }
}

impl FromIterator<Header> for Headers {
    fn from_iter<I: IntoIterator<Item = Header>>(iter: I) -> Self {
        Self(std::sync::Arc::new(iter.into_iter().collect()))
    }
}

impl IntoIterator for Headers {
    type Item = Header;
    type IntoIter = std::vec::IntoIter<Header>;
    fn into_iter(self) -> Self::IntoIter {
        std::sync::Arc::unwrap_or_clone(self.0).into_iter()
    }
}

/// A W3C trace context `traceparent` (version 00): which trace a message belongs to and which span caused it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// The 16-byte trace id, shared by every span of the trace.
    pub trace_id: u128,
    /// The 8-byte id of the parent span.
    pub parent_id: u64,
    /// Trace flags; bit 0 is "sampled".
    pub flags: u8,
}

impl TraceParent {
    /// Parses a `traceparent` value. Returns `None` for anything malformed or all-zero, as the W3C
    /// recommendation says a receiver should then start a new trace rather than fail.
    pub fn parse(value: &str) -> Option<Self> {
        let mut parts = value.trim().split('-');
        let (version, trace, parent, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version.len() != 2 || version == "ff" || u8::from_str_radix(version, 16).is_err() {
            return None;
        }
        // Version 00 has exactly four fields; later versions may append more.
        if version == "00" && parts.next().is_some() {
            return None;
        }
        if trace.len() != 32 || parent.len() != 16 || flags.len() != 2 {
            return None;
        }
        let is_hex = |s: &str| {
            s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        if !is_hex(trace) || !is_hex(parent) || !is_hex(flags) {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok()?;
        let parent_id = u64::from_str_radix(parent, 16).ok()?;
        let flags = u8::from_str_radix(flags, 16).ok()?;
        (trace_id != 0 && parent_id != 0).then_some(Self {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// A new, sampled trace with a random trace id and span id.
    pub fn new_root() -> Self {
        Self {
            trace_id: loop {
                let id = rand::random::<u128>();
                if id != 0 {
                    break id;
                }
            },
            parent_id: random_span_id(),
            flags: 1,
        }
    }

    /// The context a child span passes on: same trace and flags, a new random span id.
    pub fn child(&self) -> Self {
        Self {
            parent_id: random_span_id(),
            ..*self
        }
    }

    /// The trace id as 32 lowercase hex digits.
    pub fn trace_id_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }
}

fn random_span_id() -> u64 {
    loop {
        let id = rand::random::<u64>();
        if id != 0 {
            return id;
        }
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.parent_id, self.flags
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_headers_must_agree() {
        let headers = Headers::new()
            .with("a", "1")
            .with("a", "1")
            .with("b", "1")
            .with("b", "2");
        assert_eq!(headers.get_str("a"), Ok(Some("1")));
        assert_eq!(
            headers.get_str("b"),
            Err(HeaderError::Conflicting { name: "b".into() })
        );
        assert_eq!(headers.get_str("c"), Ok(None));
    }

    #[test]
    fn non_utf8_values_are_reported() {
        let mut headers = Headers::new();
        headers.push("x", Some(vec![0xff, 0xfe]));
        assert_eq!(
            headers.get_str("x"),
            Err(HeaderError::NotUtf8 { name: "x".into() })
        );
    }

    #[test]
    fn traceparent_round_trips_and_rejects_garbage() {
        let value = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let tp = TraceParent::parse(value).unwrap();
        assert_eq!(tp.to_string(), value);
        assert_eq!(tp.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        let child = tp.child();
        assert_eq!(child.trace_id, tp.trace_id);
        assert_ne!(child.parent_id, tp.parent_id);
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
    }
}
