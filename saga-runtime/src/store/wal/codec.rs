//! The encoding of a transaction's events in one logical message.
//!
//! `SOW1`, then the number of events (u32, big-endian), then each event: tenant, topic, key (a flag byte, 1
//! and the text, or 0), the number of headers (u32) and each name and value, the payload. Texts and the
//! payload are a length (u32) and their bytes; texts are UTF-8. [`decode`] refuses anything else, naming
//! what: it reads what the database hands the relay, and must never panic.

use saga_core::OutboxMessage;

/// A decoded event of the write-ahead log's outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalEvent {
    /// The tenant.
    pub tenant: String,
    /// The topic.
    pub topic: String,
    /// The Kafka key.
    pub partition_key: Option<String>,
    /// The headers, in order.
    pub headers: Vec<(String, String)>,
    /// The payload.
    pub payload: Vec<u8>,
}

const MAGIC: &[u8; 4] = b"SOW1";

/// The length of [`encode`]'s output for `messages`, without encoding them: what a transaction's events
/// take in the write-ahead log, and what the outbox's size limit is measured against.
pub fn encoded_len(messages: &[OutboxMessage]) -> usize {
    8 + messages
        .iter()
        .map(|m| {
            // tenant, topic and payload lengths, the key's flag, the header count.
            4 + m.tenant.as_str().len()
                + 4
                + m.topic.len()
                + 1
                + m.partition_key.as_ref().map_or(0, |k| 4 + k.len())
                + 4
                + m.headers
                    .iter()
                    .map(|(n, v)| 8 + n.len() + v.len())
                    .sum::<usize>()
                + 4
                + m.payload.len()
        })
        .sum::<usize>()
}

/// `messages` in the encoding of the module documentation.
pub fn encode(messages: &[OutboxMessage]) -> Vec<u8> {
    let mut out = Vec::with_capacity(encoded_len(messages));
    out.extend_from_slice(MAGIC);
    put_len(&mut out, messages.len());
    for m in messages {
        put_bytes(&mut out, m.tenant.as_str().as_bytes());
        put_bytes(&mut out, m.topic.as_bytes());
        match &m.partition_key {
            Some(key) => {
                out.push(1);
                put_bytes(&mut out, key.as_bytes());
            }
            None => out.push(0),
        }
        put_len(&mut out, m.headers.len());
        for (name, value) in &m.headers {
            put_bytes(&mut out, name.as_bytes());
            put_bytes(&mut out, value.as_bytes());
        }
        put_bytes(&mut out, &m.payload);
    }
    out
}

fn put_len(out: &mut Vec<u8>, len: usize) {
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_len(out, bytes.len());
    out.extend_from_slice(bytes);
}

/// Why a logical message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("an outbox message of the write-ahead log does not decode: {0}")]
pub struct DecodeError(String);

/// Refuses decoded events that hold a NUL character in their topic, key or a header: what the relay keeps as
/// text (a parked event) cannot store it. Writers refuse such events (`outbox::storable`); a log written
/// by a version that did not is read with this, and the transaction's message parked whole as bytes.
pub fn storable(events: &[WalEvent]) -> Result<(), DecodeError> {
    let nul = |text: &str| text.contains('\0');
    for (index, event) in events.iter().enumerate() {
        let refused = nul(&event.topic)
            || event.partition_key.as_deref().is_some_and(nul)
            || event.headers.iter().any(|(n, v)| nul(n) || nul(v));
        if refused {
            return Err(DecodeError(format!(
                "event {index} holds a NUL character in its topic, key or a header, which the relay cannot \
                 park as text; the transaction's events are parked as bytes"
            )));
        }
    }
    Ok(())
}

/// Decodes a batch [`encode`] made. Refuses, naming what, anything else: an unknown version, a length
/// beyond the message, text that is not UTF-8, bytes left over.
pub fn decode(bytes: &[u8]) -> Result<Vec<WalEvent>, DecodeError> {
    let mut r = Reader { bytes, at: 0 };
    if r.take(4, "the version")? != MAGIC {
        return Err(DecodeError("an unknown version (not SOW1)".into()));
    }
    let count = r.len("the number of events")?;
    // Each event takes at least 21 bytes: a count beyond that is a lie.
    if count > bytes.len() / 21 {
        return Err(DecodeError(format!(
            "{count} events do not fit in {} bytes",
            bytes.len()
        )));
    }
    let mut events = Vec::with_capacity(count);
    for _ in 0..count {
        let tenant = r.text("a tenant")?;
        let topic = r.text("a topic")?;
        let partition_key = match r.take(1, "a key's flag")?[0] {
            0 => None,
            1 => Some(r.text("a key")?),
            other => return Err(DecodeError(format!("a key's flag is {other}"))),
        };
        let headers_count = r.len("the number of headers")?;
        if headers_count > (bytes.len() - r.at) / 8 {
            return Err(DecodeError(format!(
                "{headers_count} headers do not fit in what is left"
            )));
        }
        let mut headers = Vec::with_capacity(headers_count);
        for _ in 0..headers_count {
            headers.push((r.text("a header's name")?, r.text("a header's value")?));
        }
        let payload = r.bytes("a payload")?.to_vec();
        events.push(WalEvent {
            tenant,
            topic,
            partition_key,
            headers,
            payload,
        });
    }
    if r.at != bytes.len() {
        return Err(DecodeError(format!(
            "{} bytes are left over",
            bytes.len() - r.at
        )));
    }
    Ok(events)
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|end| *end <= self.bytes.len())
            .ok_or_else(|| DecodeError(format!("{what} runs past the end")))?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }

    fn len(&mut self, what: &str) -> Result<usize, DecodeError> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }

    fn bytes(&mut self, what: &str) -> Result<&'a [u8], DecodeError> {
        let n = self.len(what)?;
        self.take(n, what)
    }

    fn text(&mut self, what: &str) -> Result<String, DecodeError> {
        let b = self.bytes(what)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError(format!("{what} is not UTF-8")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use saga_core::TenantId;

    fn message(
        topic: &str,
        key: Option<&str>,
        headers: &[(&str, &str)],
        payload: &[u8],
    ) -> OutboxMessage {
        OutboxMessage {
            tenant: TenantId::default(),
            topic: topic.to_owned(),
            partition_key: key.map(str::to_owned),
            headers: headers
                .iter()
                .map(|(n, v)| ((*n).to_owned().into(), (*v).to_owned().into()))
                .collect(),
            payload: payload.to_vec(),
        }
    }

    #[test]
    fn a_batch_decodes_to_what_was_encoded() {
        let batch = [
            message(
                "orders",
                Some("k-1"),
                &[("ce_type", "OrderCreated"), ("x", "")],
                b"{\"a\":1}",
            ),
            message("payments", None, &[], b""),
            message("ünïcödé", Some(""), &[("k", "v\"\\\n")], &[0, 255, 10]),
        ];
        let decoded = decode(&encode(&batch)).unwrap();
        assert_eq!(decoded.len(), 3);
        for (d, m) in decoded.iter().zip(&batch) {
            assert_eq!(d.tenant, m.tenant.as_str());
            assert_eq!(d.topic, m.topic);
            assert_eq!(d.partition_key, m.partition_key);
            let sent: Vec<(&str, &str)> = m.headers.iter().map(|(n, v)| (&**n, &**v)).collect();
            let received: Vec<(&str, &str)> = d.headers.iter().map(|(n, v)| (&**n, &**v)).collect();
            assert_eq!(received, sent);
            assert_eq!(d.payload, m.payload);
        }
        assert_eq!(decode(&encode(&[])).unwrap(), []);
    }

    #[test]
    fn anything_else_is_refused_naming_what_never_a_panic() {
        let good = encode(&[message("t", Some("k"), &[("h", "v")], b"p")]);
        // Every truncation, and every single byte changed, decodes or is refused: never a panic.
        for end in 0..good.len() {
            assert!(decode(&good[..end]).is_err(), "truncated at {end}");
        }
        for at in 0..good.len() {
            for value in [0u8, 1, 0x7f, 0xff] {
                let mut bad = good.clone();
                bad[at] = value;
                let _ = decode(&bad);
            }
        }
        let mut extra = good;
        extra.push(0);
        assert_eq!(decode(&extra).unwrap_err().0, "1 bytes are left over");
        assert!(decode(b"SOW2\0\0\0\0").unwrap_err().0.contains("version"));
        // A count that cannot fit is refused before anything is allocated for it.
        let mut huge = b"SOW1".to_vec();
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode(&huge).unwrap_err().0.contains("do not fit"));
        // One event whose tenant is the byte 0xff: a topic "t", no key, no header, an empty payload.
        let mut not_utf8 = b"SOW1\0\0\0\x01\0\0\0\x01\xff\0\0\0\x01t\0".to_vec();
        not_utf8.extend_from_slice(&[0; 8]);
        assert!(
            decode(&not_utf8)
                .unwrap_err()
                .0
                .contains("a tenant is not UTF-8"),
            "{:?}",
            decode(&not_utf8)
        );
    }

    #[test]
    fn the_encoded_length_is_known_without_encoding() {
        let batches = [
            vec![],
            vec![message("t", None, &[], b"")],
            vec![
                message(
                    "orders",
                    Some("k-1"),
                    &[("ce_type", "OrderCreated"), ("x", "")],
                    b"{}",
                ),
                message("ünïcödé", Some(""), &[("k", "v")], &[0, 255]),
            ],
        ];
        for batch in batches {
            assert_eq!(encoded_len(&batch), encode(&batch).len());
        }
    }
}
