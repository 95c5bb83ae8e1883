//! Validated identifiers: the original idempotency key, step names, step keys and tenants.
//!
//! A step key is `{original-key}:{step-name}`. Step names never contain `:`, so the step name is always the
//! part after the last `:` and an original key may itself contain colons (`order:42`).

use std::fmt;

/// Longest accepted original idempotency key, in bytes.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 200;
/// Longest accepted step name, in bytes.
pub const MAX_STEP_NAME_LEN: usize = 54;
/// Longest accepted tenant id, in bytes.
pub const MAX_TENANT_LEN: usize = 64;
/// The tenant of messages and requests that carry no tenant.
pub const DEFAULT_TENANT: &str = "default";

/// Why a key, step name or tenant was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The value was empty.
    #[error("{what} is empty")]
    Empty {
        /// Which kind of identifier.
        what: &'static str,
    },
    /// The value was longer than allowed.
    #[error("{what} is {len} bytes long, the limit is {max}")]
    TooLong {
        /// Which kind of identifier.
        what: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// The value held a character outside the allowed set.
    #[error("{what} contains {found:?} at byte {position}; allowed are {allowed}")]
    InvalidCharacter {
        /// Which kind of identifier.
        what: &'static str,
        /// The offending character.
        found: char,
        /// Its byte offset.
        position: usize,
        /// A description of the allowed characters.
        allowed: &'static str,
    },
}

fn validate(
    what: &'static str,
    value: &str,
    max: usize,
    allowed: &'static str,
    is_allowed: impl Fn(char) -> bool,
) -> Result<(), KeyError> {
    if value.is_empty() {
        return Err(KeyError::Empty { what });
    }
    if value.len() > max {
        return Err(KeyError::TooLong {
            what,
            len: value.len(),
            max,
        });
    }
    match value.char_indices().find(|&(_, c)| !is_allowed(c)) {
        Some((position, found)) => Err(KeyError::InvalidCharacter {
            what,
            found,
            position,
            allowed,
        }),
        None => Ok(()),
    }
}

macro_rules! string_newtype {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(String);

        impl $name {
            /// The validated value.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<&str> for $name {
            type Error = KeyError;
            fn try_from(value: &str) -> Result<Self, KeyError> {
                Self::new(value)
            }
        }

        impl std::str::FromStr for $name {
            type Err = KeyError;
            fn from_str(value: &str) -> Result<Self, KeyError> {
                Self::new(value)
            }
        }
    };
}

string_newtype!(
    /// The client's idempotency key, carried unchanged through the whole saga in the `idempotency-key` header.
    ///
    /// 1 to 200 bytes of ASCII letters, digits and `- _ . : ~ @ / + =` (a UUID, `order:42`, a base64url token).
    IdempotencyKey
);

impl IdempotencyKey {
    const ALLOWED: &'static str = "ASCII letters, digits and - _ . : ~ @ / + =";

    /// Validates an original idempotency key.
    pub fn new(value: &str) -> Result<Self, KeyError> {
        validate(
            "idempotency key",
            value,
            MAX_IDEMPOTENCY_KEY_LEN,
            Self::ALLOWED,
            |c| c.is_ascii_alphanumeric() || "-_.:~@/+=".contains(c),
        )?;
        Ok(Self(value.to_owned()))
    }

    /// The key of this saga's step `step`: `{original-key}:{step-name}`.
    pub fn step_key(&self, step: &StepName) -> StepKey {
        StepKey(format!("{}:{}", self.0, step.0))
    }
}

string_newtype!(
    /// The name of a saga step, such as `process-payment`: 1 to 54 bytes of lowercase ASCII letters, digits
    /// and `-`, starting with a letter.
    StepName
);

impl StepName {
    const ALLOWED: &'static str = "lowercase ASCII letters, digits and -, starting with a letter";

    /// Validates a step name.
    pub fn new(value: &str) -> Result<Self, KeyError> {
        validate("step name", value, MAX_STEP_NAME_LEN, Self::ALLOWED, |c| {
            c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'
        })?;
        if !value.starts_with(|c: char| c.is_ascii_lowercase()) {
            return Err(KeyError::InvalidCharacter {
                what: "step name",
                found: value.chars().next().unwrap_or('?'),
                position: 0,
                allowed: Self::ALLOWED,
            });
        }
        Ok(Self(value.to_owned()))
    }

    /// A step name known at compile time.
    ///
    /// # Panics
    /// If `value` is not a valid step name: use it for literals only.
    pub fn from_static(value: &'static str) -> Self {
        match Self::new(value) {
            Ok(name) => name,
            Err(e) => panic!("invalid step name {value:?}: {e}"),
        }
    }
}

string_newtype!(
    /// The idempotency key of one saga step: `{original-key}:{step-name}`.
    StepKey
);

impl StepKey {
    /// Parses a step key, splitting it at its last `:`.
    pub fn new(value: &str) -> Result<Self, KeyError> {
        let (original, step) = value.rsplit_once(':').ok_or(KeyError::InvalidCharacter {
            what: "step key",
            found: ':',
            position: value.len(),
            allowed: "{original-key}:{step-name}",
        })?;
        Ok(IdempotencyKey::new(original)?.step_key(&StepName::new(step)?))
    }

    /// The original idempotency key this step key was derived from.
    pub fn original_key(&self) -> IdempotencyKey {
        let (original, _) = self.0.rsplit_once(':').expect("a step key contains ':'");
        IdempotencyKey(original.to_owned())
    }

    /// The step this key belongs to.
    pub fn step_name(&self) -> StepName {
        let (_, step) = self.0.rsplit_once(':').expect("a step key contains ':'");
        StepName(step.to_owned())
    }
}

string_newtype!(
    /// The tenant a key belongs to: keys of different tenants never collide. 1 to 64 bytes of ASCII letters,
    /// digits and `- _ .`.
    TenantId
);

impl TenantId {
    const ALLOWED: &'static str = "ASCII letters, digits and - _ .";

    /// Validates a tenant id.
    pub fn new(value: &str) -> Result<Self, KeyError> {
        validate("tenant id", value, MAX_TENANT_LEN, Self::ALLOWED, |c| {
            c.is_ascii_alphanumeric() || "-_.".contains(c)
        })?;
        Ok(Self(value.to_owned()))
    }
}

impl Default for TenantId {
    /// The tenant used when a message or request names none: `default`.
    fn default() -> Self {
        Self(DEFAULT_TENANT.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_key_is_original_key_colon_step_name() {
        let key = IdempotencyKey::new("f47ac10b-58cc-4372-a567-0e02b2c3d479").unwrap();
        let step = StepName::new("process-payment").unwrap();
        let step_key = key.step_key(&step);
        assert_eq!(
            step_key.as_str(),
            "f47ac10b-58cc-4372-a567-0e02b2c3d479:process-payment"
        );
        assert_eq!(step_key.original_key(), key);
        assert_eq!(step_key.step_name(), step);
    }

    #[test]
    fn original_keys_may_contain_colons() {
        let key = IdempotencyKey::new("order:42").unwrap();
        let step_key = key.step_key(&StepName::from_static("ship"));
        assert_eq!(step_key.as_str(), "order:42:ship");
        assert_eq!(StepKey::new("order:42:ship").unwrap(), step_key);
        assert_eq!(step_key.original_key().as_str(), "order:42");
    }

    #[test]
    fn invalid_keys_say_why() {
        assert_eq!(
            IdempotencyKey::new(""),
            Err(KeyError::Empty {
                what: "idempotency key"
            })
        );
        let long = "a".repeat(MAX_IDEMPOTENCY_KEY_LEN + 1);
        assert!(matches!(
            IdempotencyKey::new(&long),
            Err(KeyError::TooLong {
                len: 201,
                max: 200,
                ..
            })
        ));
        let err = IdempotencyKey::new("abc def").unwrap_err();
        assert!(matches!(
            err,
            KeyError::InvalidCharacter {
                found: ' ',
                position: 3,
                ..
            }
        ));
        assert!(err.to_string().contains("allowed are"), "{err}");
        assert!(StepName::new("Process").is_err());
        assert!(StepName::new("1step").is_err());
        assert!(StepName::new("a:b").is_err());
        assert!(TenantId::new("acme corp").is_err());
        assert!(StepKey::new("no-colon").is_err());
    }

    #[test]
    fn longest_step_key_fits_the_limits() {
        let key = IdempotencyKey::new(&"k".repeat(MAX_IDEMPOTENCY_KEY_LEN)).unwrap();
        let step = StepName::new(&"s".repeat(MAX_STEP_NAME_LEN)).unwrap();
        assert_eq!(key.step_key(&step).as_str().len(), 255);
    }
}
