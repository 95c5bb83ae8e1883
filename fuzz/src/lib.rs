//! The fuzz targets' bodies: every parser that reads what a stranger wrote (a Kafka message's headers and
//! payload, a `traceparent`, the outbox's WAL messages, an HTTP request's key and body, an operator's
//! durations and filters). Each must answer any input with a value or an error, never a panic, and what it
//! accepts must hold together (round trips, bounds, errors justified by the input).
//!
//! `cargo +nightly fuzz run <target>` runs one under libFuzzer; `lab/tests/fuzz_corpus.rs` runs all
//! of them over `fuzz/corpus/` and seeded random inputs in the stable test suite.

use saga_core::headers::names;
use saga_core::{
    EventMetadata, Headers, Message, OutboxMessage, RawMessage, StepName, TenantId, TraceParent,
};

/// Splits `data` at `0xFF` bytes into fields (the fuzzer's way of giving a target several inputs).
fn fields(data: &[u8]) -> Vec<&[u8]> {
    data.split(|b| *b == 0xFF).collect()
}

/// A message's headers and payload: fields alternate header name and value, the last is the payload. A
/// name of one byte below 8 stands for one of the framework's own header names, so that the fuzzer reaches
/// the envelope's decoding, not only its rejections.
pub fn envelope(data: &[u8]) {
    let known = [
        names::IDEMPOTENCY_KEY,
        names::TENANT_ID,
        names::CE_TYPE,
        names::TRACEPARENT,
        names::CORRELATION_ID,
        names::CAUSATION_ID,
        names::CE_ID,
        names::CE_SOURCE,
    ];
    let mut parts = fields(data);
    let payload = parts.pop().unwrap_or_default();
    let mut headers = Headers::new();
    for pair in parts.chunks(2) {
        let name = match pair[0] {
            [b] if usize::from(*b) < known.len() => known[usize::from(*b)].to_owned(),
            other => String::from_utf8_lossy(other).into_owned(),
        };
        headers.push(name, pair.get(1).map(|v| v.to_vec()));
    }
    let Ok(metadata) = EventMetadata::from_headers(&headers) else {
        return;
    };
    assert!(metadata.idempotency_key.as_str().len() <= saga_core::IdempotencyKey::MAX_LEN);
    let raw = RawMessage {
        origin: saga_core::Origin {
            topic: "fuzzed".into(),
            partition: 0,
            offset: 0,
        },
        key: None,
        payload: Some(payload.to_vec()),
        headers,
        timestamp_ms: None,
    };
    let step = StepName::from_static("fuzzed");
    if let Ok(message) = Message::<serde_json::Value>::decode(&raw, &step) {
        assert_eq!(message.idempotency_key(), &metadata.idempotency_key);
        assert_eq!(
            *message.external_key(),
            saga_core::ExternalKey::of(&metadata.tenant, &metadata.idempotency_key, &step)
        );
    }
}

/// A `traceparent` value: what parses prints back to itself and parses again to the same context.
pub fn traceparent(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Some(parsed) = TraceParent::parse(text) {
        assert!(parsed.trace_id != 0 && parsed.parent_id != 0);
        let printed = parsed.to_string();
        assert_eq!(printed.len(), 55, "{printed}");
        assert_eq!(TraceParent::parse(&printed), Some(parsed));
    }
}

/// A WAL outbox message: what decodes encodes back to bytes that decode to the same events.
pub fn wal_decode(data: &[u8]) {
    use saga_runtime::store::wal;
    let Ok(events) = wal::decode(data) else {
        return;
    };
    let messages: Option<Vec<OutboxMessage>> = events
        .iter()
        .map(|e| {
            Some(OutboxMessage {
                tenant: TenantId::new(&e.tenant).ok()?,
                topic: e.topic.clone(),
                partition_key: e.partition_key.clone(),
                headers: e
                    .headers
                    .iter()
                    .map(|(n, v)| (n.clone().into(), v.clone().into()))
                    .collect(),
                payload: e.payload.clone(),
            })
        })
        .collect();
    // A tenant the framework would never write cannot be encoded again; it still decoded without harm.
    if let Some(messages) = messages {
        let again = wal::decode(&wal::encode(&messages)).expect("an encoding decodes");
        assert_eq!(again, events);
    }
}

/// The longest body the HTTP target accepts.
const MAX_BODY: usize = 64;

/// An HTTP request for the idempotency layer: `Idempotency-Key`, `Tenant-Id`, `traceparent` and the body,
/// as fields. What the layer accepts has a key it could have sent and a fingerprint; a body too long is
/// refused with 413, and only then.
pub fn http_request(data: &[u8]) {
    let parts = fields(data);
    let mut headers = http::HeaderMap::new();
    for (name, value) in ["idempotency-key", "tenant-id", "traceparent"]
        .iter()
        .zip(&parts)
    {
        // The HTTP library refuses bytes no header may hold before the layer sees them.
        if let Ok(value) = http::HeaderValue::from_bytes(value)
            && !value.is_empty()
        {
            headers.insert(*name, value);
        }
    }
    let body = parts.get(3).copied().unwrap_or_default();
    let (method, uri) = (http::Method::POST, http::Uri::from_static("/orders"));
    match saga_consumer::http::read_request(&method, &uri, &headers, body, MAX_BODY) {
        Ok((step_key, fingerprint)) => {
            let key = headers["idempotency-key"]
                .to_str()
                .expect("an accepted key is text");
            assert_eq!(step_key.as_str(), format!("{key}:fuzzed"));
            assert_eq!(fingerprint.len(), 32);
            assert!(body.len() <= MAX_BODY);
        }
        Err((413, _)) => assert!(body.len() > MAX_BODY),
        Err((status, message)) => {
            assert_eq!(status, 400, "{message}");
            assert!(!message.is_empty());
        }
    }
}

/// What an operator types: durations (`--since`, `--stuck-for`), saga statuses (`--status`), token lists
/// (`SAGA_ADMIN_TOKENS`), and the error texts failure groups are made of (`--group` filters on them).
pub fn admin_input(data: &[u8]) {
    use saga_admin::{duration, groups, sagas};
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(d) = duration::parse(text) {
        // What parses prints back as something that parses, to within the printed precision.
        let printed = duration::human(d);
        let compact: String = printed.split(' ').collect();
        assert!(duration::parse(&compact).is_ok(), "{text:?} → {printed:?}");
    }
    let _ = sagas::parse_status(text);
    if let Ok(tokens) = saga_admin::inspect::NamedToken::parse_list(text) {
        assert!(tokens.len() <= text.split(',').count());
    }
    let normal = groups::normalise(text);
    assert_eq!(
        groups::normalise(&normal),
        normal,
        "normalising is idempotent"
    );
}

/// A dead letter as the toolkit reads it from a dead-letter topic: fields alternate header name and value,
/// the last is the payload; a name of one byte below 14 stands for one of the headers the letter parser
/// reads. Reading never fails and never hides what the strict parser says: a letter it accepts is read the
/// same, one it refuses is read as an unreadable letter naming the same problem. The corpus holds dead
/// letters the consumer wrote (`SAGA_UPDATE_CORPUS=1` on saga-admin's replay tests writes them).
pub fn dead_letter(data: &[u8]) {
    use saga_admin::dlq::{DeadLetter, Record, UNREADABLE};
    let known = [
        "dlq-original-topic",
        "dlq-original-partition",
        "dlq-original-offset",
        "dlq-consumer-group",
        "dlq-step",
        "dlq-reason",
        "dlq-error",
        "dlq-attempts",
        "dlq-failed-at",
        "dlq-truncated",
        "saga-replay-count",
        names::IDEMPOTENCY_KEY,
        names::TENANT_ID,
        names::CE_TYPE,
    ];
    let mut parts = fields(data);
    let payload = parts.pop().map(<[u8]>::to_vec);
    let headers = parts
        .chunks(2)
        .map(|pair| {
            let name = match pair[0] {
                [b] if usize::from(*b) < known.len() => known[usize::from(*b)].to_owned(),
                other => String::from_utf8_lossy(other).into_owned(),
            };
            (name, pair.get(1).map(|v| v.to_vec()))
        })
        .collect();
    let record = Record::new(0, 0, headers, payload);
    let read = DeadLetter::read("fuzzed.dlq", record.clone());
    let _ = (read.identity(), saga_admin::groups::group_id(&read));
    match DeadLetter::parse("fuzzed.dlq", record) {
        Ok(letter) => {
            assert_eq!(read, letter, "a letter the parser accepts is read the same");
            assert!(read.unreadable.is_none());
        }
        Err(e) => {
            let problem = read
                .unreadable
                .as_deref()
                .expect("an unreadable letter says why");
            assert_eq!(read.reason, UNREADABLE);
            assert!(e.to_string().ends_with(problem), "{e} / {problem}");
        }
    }
}
