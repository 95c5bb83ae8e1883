//! Property tests: parsing keys and headers from arbitrary input never panics, and derivation round-trips.

use proptest::prelude::*;
use saga_core::headers::names;
use saga_core::{EventMetadata, Headers, IdempotencyKey, StepKey, StepName, TenantId, TraceParent};

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
    fn arbitrary_header_bytes_never_panic(
        headers in proptest::collection::vec(
            (prop_oneof![
                Just(names::IDEMPOTENCY_KEY.to_owned()),
                Just(names::TENANT_ID.to_owned()),
                Just(names::CE_TYPE.to_owned()),
                Just(names::TRACEPARENT.to_owned()),
                Just(names::CORRELATION_ID.to_owned()),
                any::<String>(),
            ],
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..300))),
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
            }
            Err(err) => prop_assert!(!err.to_string().is_empty()),
        }
    }
}
