//! The outbox writer: rows written into the caller's transaction, published by `outbox-relay` after commit.

use sqlx::PgConnection;

use saga_core::OutboxMessage;

/// Writes `messages` to the outbox in the caller's transaction, in order, as the process's outbox mode says
/// ([`super::wal::mode`]): rows of `saga_outbox` ([`append_rows`], returning their ids), or one logical
/// message on the write-ahead log ([`super::wal::emit`], returning no ids).
///
/// Write a transaction's events with one call where possible: in table mode, two calls that lock keys in
/// opposite orders can deadlock with another transaction doing the same (PostgreSQL then aborts one, a
/// transient error).
pub async fn append(
    conn: &mut PgConnection,
    messages: &[OutboxMessage],
) -> Result<Vec<i64>, sqlx::Error> {
    if super::wal::mode() == super::wal::OutboxMode::Wal {
        super::wal::emit(conn, messages).await?;
        Ok(Vec::new())
    } else {
        append_rows(conn, messages).await
    }
}

/// Appends `messages` to `saga_outbox` in the caller's transaction, in order, with one statement.
///
/// The statement first locks each partition key for the rest of the transaction, so rows of one key get ids
/// in the order their transactions commit; the relay publishes each key's rows in id order. An insert
/// notifies the relay (`NOTIFY saga_outbox`) when the transaction commits. Returns the new rows' ids.
pub async fn append_rows(
    conn: &mut PgConnection,
    messages: &[OutboxMessage],
) -> Result<Vec<i64>, sqlx::Error> {
    if messages.is_empty() {
        return Ok(Vec::new());
    }
    let mut tenants = Vec::with_capacity(messages.len());
    let mut topics = Vec::with_capacity(messages.len());
    let mut keys = Vec::with_capacity(messages.len());
    let mut headers = Vec::with_capacity(messages.len());
    let mut payloads = Vec::with_capacity(messages.len());
    for m in messages {
        tenants.push(m.tenant.as_str());
        topics.push(m.topic.as_str());
        keys.push(m.partition_key.as_deref());
        headers.push(array_literal(&m.headers));
        payloads.push(m.payload.as_slice());
    }
    sqlx::query_scalar(
        "SELECT saga_outbox_append($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[])",
    )
    .bind(&tenants)
    .bind(&topics)
    .bind(&keys)
    .bind(&headers)
    .bind(&payloads)
    .fetch_all(conn)
    .await
}

/// The headers as a PostgreSQL array literal, flattened: `{"name","value",...}`.
fn array_literal<N: AsRef<str>, V: AsRef<str>>(headers: &[(N, V)]) -> String {
    let mut literal = String::with_capacity(16 + headers.len() * 48);
    literal.push('{');
    for (i, value) in headers
        .iter()
        .flat_map(|(n, v)| [n.as_ref(), v.as_ref()])
        .enumerate()
    {
        if i > 0 {
            literal.push(',');
        }
        literal.push('"');
        if value.contains(['"', '\\']) {
            for c in value.chars() {
                if c == '"' || c == '\\' {
                    literal.push('\\');
                }
                literal.push(c);
            }
        } else {
            literal.push_str(value);
        }
        literal.push('"');
    }
    literal.push('}');
    literal
}

/// Pairs the `headers` column (name, value, name, value, ...) back up. A trailing odd element is ignored.
pub fn headers_from_array(flat: Vec<String>) -> Vec<(String, String)> {
    let mut pairs = Vec::with_capacity(flat.len() / 2);
    let mut items = flat.into_iter();
    while let (Some(name), Some(value)) = (items.next(), items.next()) {
        pairs.push((name, value));
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_literals_escape_quotes_and_backslashes() {
        let headers = vec![
            ("a".to_owned(), "plain".to_owned()),
            ("b".to_owned(), r#"say "hi" \ bye"#.to_owned()),
            ("c".to_owned(), String::new()),
        ];
        assert_eq!(
            array_literal(&headers),
            r#"{"a","plain","b","say \"hi\" \\ bye","c",""}"#
        );
    }
}
