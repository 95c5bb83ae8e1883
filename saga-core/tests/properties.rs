//! Property tests: parsing keys and headers from arbitrary input never panics, step keys round-trip, and
//! external keys keep tenants apart, stay within their bounds and never change.

use proptest::prelude::*;
use saga_core::headers::names;
use saga_core::{
    EnvelopeError, EventMetadata, ExternalKey, HeaderError, Headers, IdempotencyKey, StepKey,
    StepName, TenantId, TraceParent,
};

fn valid_key() -> impl Strategy<Value = String> {
    proptest::string::string_regex("[A-Za-z0-9._~:@/+=-]{1,200}").unwrap()
}

fn valid_step() -> impl Strategy<Value = String> {
    proptest::string::string_regex("[a-z][a-z0-9-]{0,53}").unwrap()
}

proptest! {
    #[test]
    fn step_keys_round_trip(key in valid_key(), step in valid_step()) {
        let original = IdempotencyKey::new(&key).unwrap();
        let name = StepName::new(&step).unwrap();
        let step_key = original.step_key(&name);
        prop_assert_eq!(step_key.as_str(), format!("{key}:{step}"));
        prop_assert_eq!(step_key.original_key(), original);
        prop_assert_eq!(step_key.step_name(), name);
        prop_assert_eq!(StepKey::new(step_key.as_str()).unwrap(), step_key);
    }

    #[test]
    fn arbitrary_strings_never_panic_key_parsing(s in any::<String>()) {
        let _ = IdempotencyKey::new(&s);
        let _ = StepName::new(&s);
        let _ = TenantId::new(&s);
        let _ = StepKey::new(&s);
        let _ = TraceParent::parse(&s);
    }

    #[test]
    fn accepted_keys_only_hold_allowed_characters(s in any::<String>()) {
        if let Ok(key) = IdempotencyKey::new(&s) {
            prop_assert!(!key.as_str().is_empty() && key.as_str().len() <= 200);
            prop_assert!(key.as_str().chars().all(|c| c.is_ascii_graphic()));
        }
    }

    #[test]
    fn arbitrary_header_bytes_never_panic_and_every_error_names_a_real_defect(
        headers in proptest::collection::vec(
            (prop_oneof![
                Just(names::IDEMPOTENCY_KEY.to_owned()),
                Just(names::TENANT_ID.to_owned()),
                Just(names::CE_TYPE.to_owned()),
                Just(names::TRACEPARENT.to_owned()),
                Just(names::CORRELATION_ID.to_owned()),
                any::<String>(),
            ],
            proptest::option::of(prop_oneof![
                // Valid values too, so that both outcomes are exercised.
                valid_key().prop_map(String::into_bytes),
                proptest::collection::vec(any::<u8>(), 0..300),
            ])),
            0..12,
        )
    ) {
        let mut list = Headers::new();
        for (name, value) in headers {
            list.push(name, value);
        }
        match EventMetadata::from_headers(&list) {
            Ok(meta) => {
                prop_assert_eq!(Some(meta.idempotency_key.as_str()), list.get_str(names::IDEMPOTENCY_KEY).unwrap());
                prop_assert_eq!(Some(meta.event_type.as_str()), list.get_str(names::CE_TYPE).unwrap());
                let tenant = list.get_str(names::TENANT_ID).unwrap().unwrap_or("default");
                prop_assert_eq!(meta.tenant.as_str(), tenant);
            }
            // Each error must be justified by the input, not just have a message.
            Err(EnvelopeError::MissingHeader(name)) => {
                prop_assert_eq!(list.get_str(name), Ok(None));
            }
            Err(EnvelopeError::Header(HeaderError::NotUtf8 { name })) => {
                let not_utf8 = matches!(list.get_str(&name), Err(HeaderError::NotUtf8 { .. }));
                prop_assert!(not_utf8);
            }
            Err(EnvelopeError::Header(HeaderError::Conflicting { name })) => {
                let conflicting = matches!(list.get_str(&name), Err(HeaderError::Conflicting { .. }));
                prop_assert!(conflicting);
            }
            Err(EnvelopeError::InvalidKey { header, .. }) => {
                let value = list.get_str(header).unwrap().unwrap();
                let invalid = match header {
                    h if h == names::IDEMPOTENCY_KEY => IdempotencyKey::new(value).is_err(),
                    h if h == names::TENANT_ID => TenantId::new(value).is_err(),
                    _ => false,
                };
                prop_assert!(invalid, "{header}={value:?} was refused but is valid");
            }
            Err(EnvelopeError::InvalidEventType(t)) => {
                prop_assert_eq!(Some(t.as_str()), list.get_str(names::CE_TYPE).unwrap());
                prop_assert!(t.is_empty() || t.len() > 200 || t.chars().any(char::is_control), "{t:?}");
            }
            Err(other) => prop_assert!(false, "headers alone cannot fail with {other}"),
        }
    }
}

fn valid_tenant() -> impl Strategy<Value = String> {
    proptest::string::string_regex("[A-Za-z0-9._-]{1,64}").unwrap()
}

proptest! {
    #[test]
    fn external_keys_never_cross_tenants(
        key in valid_key(), step in valid_step(), a in valid_tenant(), b in valid_tenant(),
    ) {
        prop_assume!(a != b);
        let (key, step) = (IdempotencyKey::new(&key).unwrap(), StepName::new(&step).unwrap());
        let (a, b) = (TenantId::new(&a).unwrap(), TenantId::new(&b).unwrap());
        let (ka, kb) = (ExternalKey::of(&a, &key, &step), ExternalKey::of(&b, &key, &step));
        prop_assert_ne!(ka.as_str(), kb.as_str());
        prop_assert_ne!(ka.compact(), kb.compact());
    }

    #[test]
    fn external_keys_are_bounded_and_safe_for_outside_systems(
        key in valid_key(), step in valid_step(), tenant in valid_tenant(),
    ) {
        let (key, step) = (IdempotencyKey::new(&key).unwrap(), StepName::new(&step).unwrap());
        let external = ExternalKey::of(&TenantId::new(&tenant).unwrap(), &key, &step);
        prop_assert!(external.as_str().len() <= ExternalKey::MAX_LEN);
        prop_assert!(external.as_str().bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b)));
        prop_assert_eq!(external.compact().len(), 36);
    }

    #[test]
    fn external_keys_are_stable_and_tell_steps_and_keys_apart(
        key in valid_key(), other in valid_key(), step in valid_step(), other_step in valid_step(),
        tenant in valid_tenant(),
    ) {
        let tenant = TenantId::new(&tenant).unwrap();
        let (k1, s1) = (IdempotencyKey::new(&key).unwrap(), StepName::new(&step).unwrap());
        let (k2, s2) = (IdempotencyKey::new(&other).unwrap(), StepName::new(&other_step).unwrap());
        // The same inputs, the same key, however derived.
        prop_assert_eq!(ExternalKey::of(&tenant, &k1, &s1), ExternalKey::new(&tenant, &k1.step_key(&s1)));
        if (key.as_str(), step.as_str()) != (other.as_str(), other_step.as_str()) {
            prop_assert_ne!(ExternalKey::of(&tenant, &k1, &s1).compact(), ExternalKey::of(&tenant, &k2, &s2).compact());
        }
    }
}

/// The external key of one saga step, written down: outside systems store these, so they never change
/// between versions (the UUIDv5 namespace is fixed forever).
#[test]
fn an_external_key_is_the_same_in_every_version() {
    let key = ExternalKey::of(
        &TenantId::new("acme").unwrap(),
        &IdempotencyKey::new("order-42").unwrap(),
        &StepName::new("charge-payment").unwrap(),
    );
    assert_eq!(
        key.compact(),
        GOLDEN_COMPACT,
        "the external key of acme/order-42/charge-payment changed"
    );
}

/// UUIDv5 of `acme\0order-42\0charge-payment` in the external keys' namespace.
const GOLDEN_COMPACT: &str = "3cd543ba-7532-5d2c-b8ed-177a37e20c9b";
