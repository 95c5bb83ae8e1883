//! Validated identifiers: the original idempotency key, step names, step keys and tenants.
//!
//! A step key is `{original-key}:{step-name}`. Step names never contain `:`, so the step name is always the
//! part after the last `:` and an original key may itself contain colons (`order:42`).
//!
//! Inside the database a step key is scoped by its tenant (`(tenant, step key)` is the primary key). Outside
//! it, a step key alone is not unique: two tenants may use the same client key. Every key handed to another
//! system (a payment provider's idempotency key) is therefore an [`ExternalKey`], which carries the tenant.

use std::fmt;

/// Longest accepted original idempotency key, in bytes ([`IdempotencyKey::MAX_LEN`]).
#[doc(hidden)]
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 200;
/// Longest accepted step name, in bytes ([`StepName::MAX_LEN`]).
#[doc(hidden)]
pub const MAX_STEP_NAME_LEN: usize = 54;
/// Longest accepted tenant id, in bytes ([`TenantId::MAX_LEN`]).
#[doc(hidden)]
pub const MAX_TENANT_LEN: usize = 64;
/// The tenant of messages and requests that carry no tenant ([`TenantId::DEFAULT`]).
#[doc(hidden)]
pub const DEFAULT_TENANT: &str = "default";

/// Why a key, step name or tenant was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
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
    /// The longest idempotency key, in bytes.
    pub const MAX_LEN: usize = MAX_IDEMPOTENCY_KEY_LEN;
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

    /// The key of this saga's step `step`: `{original-key}:{step-name}` (the runtime's; see [`StepKey`]).
    #[doc(hidden)]
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
    /// The longest step name, in bytes.
    pub const MAX_LEN: usize = MAX_STEP_NAME_LEN;
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
    /// The idempotency key of one saga step: `{original-key}:{step-name}`, unique only within its tenant.
    /// The runtime's, never a step's: a step hands an outside system [`ExternalKey`] instead.
    #[doc(hidden)]
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

    /// The key to hand to a system outside the database for this step in `tenant`: see [`ExternalKey`].
    /// The step key alone is unique only within a tenant.
    #[doc(hidden)]
    pub fn external(&self, tenant: &TenantId) -> ExternalKey {
        ExternalKey::new(tenant, self)
    }
}

string_newtype!(
    /// The tenant a key belongs to: keys of different tenants never collide. 1 to 64 bytes of ASCII letters,
    /// digits and `- _ .`.
    TenantId
);

impl TenantId {
    /// The longest tenant id, in bytes.
    pub const MAX_LEN: usize = MAX_TENANT_LEN;
    /// The tenant of messages and requests that carry none.
    pub const DEFAULT: &'static str = DEFAULT_TENANT;
    const ALLOWED: &'static str = "ASCII letters, digits and - _ .";

    /// Validates a tenant id.
    pub fn new(value: &str) -> Result<Self, KeyError> {
        validate("tenant id", value, MAX_TENANT_LEN, Self::ALLOWED, |c| {
            c.is_ascii_alphanumeric() || "-_.".contains(c)
        })?;
        Ok(Self(value.to_owned()))
    }
}

/// The key a step hands to a system outside the database as that system's own idempotency key (a payment
/// provider's `Idempotency-Key`): unique across tenants, stable across calls and restarts, bounded in length
/// and made of characters providers accept.
///
/// A step key is unique only within its tenant, and one provider account usually serves every tenant: two
/// tenants whose clients sent the same key would otherwise share one charge. Get it with
/// [`crate::Message::external_key`] (or [`ExternalKey::of`]).
///
/// - [`ExternalKey::as_str`] is readable where it can be, `{tenant}:{original-key}:{step}`, when that is
///   at most [`ExternalKey::MAX_LEN`] bytes of ASCII letters, digits and `- _ . :`; otherwise
///   `{step}-{uuid}`, a UUIDv5 of the tenant, the original key and the step. Both forms are at most 255
///   bytes (the limit of many providers) and never equal for different (tenant, step key) pairs.
/// - [`ExternalKey::compact`] is always the 36-character UUIDv5, for providers with shorter limits.
///
/// ```
/// use saga_core::{ExternalKey, IdempotencyKey, StepName, TenantId};
///
/// let (key, step) = (IdempotencyKey::new("order-42")?, StepName::new("process-payment")?);
/// let acme = ExternalKey::of(&TenantId::new("acme")?, &key, &step);
/// let globex = ExternalKey::of(&TenantId::new("globex")?, &key, &step);
/// assert_eq!(acme.as_str(), "acme:order-42:process-payment");
/// assert_ne!(acme, globex);
/// assert_eq!(acme.compact().len(), 36);
/// # Ok::<(), saga_core::KeyError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExternalKey {
    readable: String,
    uuid: uuid::Uuid,
}

/// The namespace of external keys' UUIDv5s. Fixed forever: changing it would change every external key.
const EXTERNAL_KEY_NAMESPACE: uuid::Uuid = uuid::uuid!("5c0f6b8e-3a1d-4f4e-9c3b-7d2a9e1f0b64");

impl ExternalKey {
    /// The longest [`ExternalKey::as_str`], in bytes.
    pub const MAX_LEN: usize = 255;

    /// The external key of step `step` of the saga with idempotency key `key` in `tenant`: what
    /// [`crate::Message::external_key`] gives that step.
    pub fn of(tenant: &TenantId, key: &IdempotencyKey, step: &StepName) -> Self {
        Self::new(tenant, &key.step_key(step))
    }

    /// The external key of `step_key` in `tenant`.
    #[doc(hidden)]
    pub fn new(tenant: &TenantId, step_key: &StepKey) -> Self {
        let (original, step) = step_key
            .as_str()
            .rsplit_once(':')
            .expect("a step key contains ':'");
        // NUL appears in none of the three, so the name is unambiguous.
        let name = format!("{}\0{original}\0{step}", tenant.as_str());
        let uuid = uuid::Uuid::new_v5(&EXTERNAL_KEY_NAMESPACE, name.as_bytes());
        // A tenant never contains ':' and a step never does: the first and last ':' delimit the original
        // key, so different triples give different readable keys; a hashed key contains no ':' at all.
        let readable = format!("{}:{}", tenant.as_str(), step_key.as_str());
        let safe = readable.len() <= Self::MAX_LEN
            && readable
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
        Self {
            readable: if safe {
                readable
            } else {
                format!("{step}-{uuid}")
            },
            uuid,
        }
    }

    /// The key: readable where it can be (see the type's documentation), at most 255 bytes.
    pub fn as_str(&self) -> &str {
        &self.readable
    }

    /// The key as a UUIDv5 (36 characters), for providers whose limit is shorter than 255.
    pub fn compact(&self) -> String {
        self.uuid.to_string()
    }
}

impl fmt::Display for ExternalKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.readable)
    }
}

impl AsRef<str> for ExternalKey {
    fn as_ref(&self) -> &str {
        &self.readable
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

    fn external(tenant: &str, key: &str, step: &str) -> ExternalKey {
        IdempotencyKey::new(key)
            .unwrap()
            .step_key(&StepName::new(step).unwrap())
            .external(&TenantId::new(tenant).unwrap())
    }

    #[test]
    fn external_keys_differ_across_tenants_for_the_same_client_key() {
        let a = external("tenant-a", "order-1", "process-payment");
        let b = external("tenant-b", "order-1", "process-payment");
        assert_ne!(a, b);
        assert_ne!(a.as_str(), b.as_str());
        assert_ne!(a.compact(), b.compact());
        // Nor do they collide where a separator could shift between tenant and key.
        let shifted = [
            external("a.b", "c", "s"),
            external("a", "b.c", "s"),
            external("a", "b:c", "s"),
            external("a.b", "c:d", "s"),
            external("a", "b.c:d", "s"),
        ];
        for (i, x) in shifted.iter().enumerate() {
            for y in &shifted[i + 1..] {
                assert_ne!(x.as_str(), y.as_str());
            }
        }
    }

    #[test]
    fn external_keys_are_stable_values_not_per_process_random() {
        // Fixed expectations: the same inputs give the same key in every process, forever (a restart after
        // a crash must hand the provider the same key).
        let short = external(
            "acme",
            "f47ac10b-58cc-4372-a567-0e02b2c3d479",
            "process-payment",
        );
        assert_eq!(
            short.as_str(),
            "acme:f47ac10b-58cc-4372-a567-0e02b2c3d479:process-payment"
        );
        assert_eq!(
            short,
            external(
                "acme",
                "f47ac10b-58cc-4372-a567-0e02b2c3d479",
                "process-payment"
            )
        );
        let hashed = external("acme", "k/with+slash=", "process-payment");
        assert_eq!(
            hashed.as_str(),
            format!("process-payment-{}", hashed.compact())
        );
        assert_eq!(
            hashed.compact(),
            uuid::Uuid::new_v5(
                &EXTERNAL_KEY_NAMESPACE,
                b"acme\0k/with+slash=\0process-payment"
            )
            .to_string()
        );
        assert_eq!(
            EXTERNAL_KEY_NAMESPACE.to_string(),
            "5c0f6b8e-3a1d-4f4e-9c3b-7d2a9e1f0b64"
        );
    }

    #[test]
    fn external_keys_are_bounded_and_use_accepted_characters() {
        let accepted = |s: &str| {
            s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
        };
        let longest = external(
            &"t".repeat(MAX_TENANT_LEN),
            &"k".repeat(MAX_IDEMPOTENCY_KEY_LEN),
            &"s".repeat(MAX_STEP_NAME_LEN),
        );
        let odd = external("acme", "a~b@c/d+e=f", "ship");
        for key in [&longest, &odd, &external("acme", "order-1", "ship")] {
            assert!(key.as_str().len() <= ExternalKey::MAX_LEN, "{key}");
            assert!(accepted(key.as_str()), "{key}");
            assert_eq!(key.compact().len(), 36);
        }
        assert!(longest.as_str().starts_with(&"s".repeat(MAX_STEP_NAME_LEN)));
        assert!(!odd.as_str().contains('~'), "{odd}");
    }

    #[test]
    fn longest_step_key_fits_the_limits() {
        let key = IdempotencyKey::new(&"k".repeat(MAX_IDEMPOTENCY_KEY_LEN)).unwrap();
        let step = StepName::new(&"s".repeat(MAX_STEP_NAME_LEN)).unwrap();
        assert_eq!(key.step_key(&step).as_str().len(), 255);
    }
}
