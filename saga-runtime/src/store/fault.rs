//! What a failed statement of the framework means for the work it was part of: the database is unavailable
//! (waited out, without a budget: invariant 9), the statement may pass when run again (retried with a
//! budget), the schema or the role is not what the framework needs (the operator's problem: the consumer
//! stops with the reason), or it will fail again with the same data (the message's problem: it is
//! dead-lettered with the reason, and its partition goes on).

/// What a failed statement of the framework means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DbFault {
    /// The database cannot take statements now: a lost or refused connection, a server shutting down or
    /// starting ([`saga_core::StepError::is_connection_error`]), resources it lacks (class 53: a full disk,
    /// memory), a system or I/O error (class 58), a corrupted page (XX001, XX002). Waited out without
    /// spending a budget; the connection that reported it is closed.
    Unavailable,
    /// May pass when run again unchanged: a serialization failure or deadlock (class 40), a lock not
    /// available (55P03), a statement cancelled (57014), an internal error (XX000). Retried with a budget,
    /// then taken as [`DbFault::Refused`].
    Transient,
    /// The schema or the role is not what the framework needs, whatever the message: a table, column or
    /// function missing or changed (class 42: migrations behind the binary), a privilege revoked (42501),
    /// a database or schema gone (3D000, 3F000). The operator's problem: the consumer stops with the
    /// reason, and no message is dead-lettered for it.
    Operator,
    /// Fails again with the same data: a value the column refuses (class 22: a NUL in text), a constraint
    /// (23), a key too large for its index (54000), a row that does not decode. The message's problem.
    Refused,
}

/// Classifies `error` (see [`DbFault`]).
pub fn classify(error: &sqlx::Error) -> DbFault {
    if saga_core::StepError::is_connection_error(error) {
        return DbFault::Unavailable;
    }
    let Some(code) = error.as_database_error().and_then(|db| db.code()) else {
        return DbFault::Refused;
    };
    let class = code.get(..2).unwrap_or_default();
    match (class, code.as_ref()) {
        ("53" | "58", _) | (_, "XX001" | "XX002") => DbFault::Unavailable,
        ("40", _) | (_, "55P03" | "57014" | "XX000") => DbFault::Transient,
        ("42", _) | (_, "3D000" | "3F000") => DbFault::Operator,
        _ => DbFault::Refused,
    }
}

/// What a failed statement's error says, on one line, with its SQLSTATE where the database gave one: the
/// reason a dead letter carries.
pub fn described(error: &sqlx::Error) -> String {
    let text = error
        .to_string()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    match error.as_database_error().and_then(|d| d.code()) {
        Some(code) if !text.contains(code.as_ref()) => format!("{text} (SQLSTATE {code})"),
        _ => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A database error with SQLSTATE `code`, as the server would send it.
    #[derive(Debug)]
    struct Coded(&'static str);

    impl std::fmt::Display for Coded {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("refused")
        }
    }

    impl std::error::Error for Coded {}

    impl sqlx::error::DatabaseError for Coded {
        fn message(&self) -> &str {
            "error"
        }
        fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
            Some(self.0.into())
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    fn coded(code: &'static str) -> sqlx::Error {
        sqlx::Error::Database(Box::new(Coded(code)))
    }

    #[test]
    fn only_an_unavailable_database_is_waited_out_and_only_a_passing_failure_is_transient() {
        for code in [
            "08006", "57P01", "57P03", "25006", "53300", "53100", "53200", "58030", "XX001",
        ] {
            assert_eq!(classify(&coded(code)), DbFault::Unavailable, "{code}");
        }
        assert_eq!(classify(&sqlx::Error::PoolTimedOut), DbFault::Unavailable);
        for code in ["40P01", "40001", "55P03", "57014", "XX000"] {
            assert_eq!(classify(&coded(code)), DbFault::Transient, "{code}");
        }
        for code in ["42501", "42703", "42P01", "42883", "3F000"] {
            assert_eq!(classify(&coded(code)), DbFault::Operator, "{code}");
        }
        for code in ["22021", "54000", "23505", "22P05"] {
            assert_eq!(classify(&coded(code)), DbFault::Refused, "{code}");
        }
        assert_eq!(classify(&sqlx::Error::RowNotFound), DbFault::Refused);
        assert_eq!(
            classify(&sqlx::Error::Decode(
                "a state this version does not know".into()
            )),
            DbFault::Refused
        );
    }

    #[test]
    fn a_description_names_the_sqlstate_once() {
        assert_eq!(
            described(&coded("54000")),
            "error returned from database: refused (SQLSTATE 54000)"
        );
        assert_eq!(
            described(&sqlx::Error::RowNotFound),
            sqlx::Error::RowNotFound.to_string()
        );
    }
}
