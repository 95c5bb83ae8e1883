//! Configuration problems found at start-up, reported as one line that names the setting and says what to
//! do, and the checks that find them: a database URL that does not parse or does not answer, a schema or
//! tables that are missing, a broker that does not answer.

use std::str::FromStr;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

pub use saga_config::{BadInput, ConfigProblem};

/// How long start-up waits for PostgreSQL or the broker to answer before calling it a configuration problem.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(10);

/// The value of `url_var`, a PostgreSQL URL a command needs: a [`ConfigProblem`] naming it when unset.
pub fn required_postgres_url<'a>(
    url_var: &str,
    url: Option<&'a str>,
) -> Result<&'a str, ConfigProblem> {
    url.ok_or_else(|| ConfigProblem::new(url_var, "is not set", POSTGRES_URL_HINT))
}

/// How long a pooled connection may have been idle and still be handed out without a ping.
const PING_AFTER_IDLE: Duration = Duration::from_secs(1);

/// How a PostgreSQL URL is written, for the problems that name one.
const POSTGRES_URL_HINT: &str = "set it to postgres://USER@HOST:PORT/DATABASE";

/// Connects a pool of `size` to the PostgreSQL at `url` (named by the variable `url_var`), with `schema`
/// (if any) as the connections' `search_path`. A URL that does not parse or a server that does not answer
/// within [`STARTUP_TIMEOUT`] is a [`ConfigProblem`].
pub async fn connect_postgres(
    url_var: &str,
    url: &str,
    schema: Option<&str>,
    size: u32,
) -> Result<PgPool, ConfigProblem> {
    let mut options = PgConnectOptions::from_str(url).map_err(|e| {
        ConfigProblem::new(
            url_var,
            format!(
                "{:?} is not a PostgreSQL URL ({})",
                redact(url),
                without_password(&e.to_string(), url)
            ),
            POSTGRES_URL_HINT,
        )
    })?;
    if let Some(schema) = schema {
        options = options.options([("search_path", schema)]);
    }
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(STARTUP_TIMEOUT)
        // A connection used within the last second is handed out without a ping first: the ping is a round
        // trip on every batch's crash-loop record and every step's lease, and a connection that died since
        // fails its first statement, which the runtime treats as the database being unavailable anyway.
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for > PING_AFTER_IDLE {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
        .connect_with(options)
        .await
        .map_err(|e| connection_problem(url_var, url, &e))
}

/// The line for a pool that could not connect: a refusal the URL must fix (its TLS, its credentials) named
/// as such, else a server that does not answer.
fn connection_problem(url_var: &str, url: &str, error: &sqlx::Error) -> ConfigProblem {
    let text = without_password(&error.to_string(), url);
    let code = error.as_database_error().and_then(|d| d.code());
    // sqlx reports a handshake the server's certificate failed as an I/O error ("invalid peer
    // certificate: UnknownIssuer").
    let tls = matches!(error, sqlx::Error::Tls(_))
        || (matches!(error, sqlx::Error::Io(_))
            && ["certificate", "TLS", "handshake", "received fatal alert"]
                .iter()
                .any(|w| text.contains(w)));
    let (what, fix) = if tls {
        (
            "refuses the connection's TLS",
            format!(
                "check {url_var}'s sslmode and sslrootcert (the CA that signed the server's certificate), \
                 and that the host is a name the certificate holds"
            ),
        )
    } else if matches!(code.as_deref(), Some("28000" | "28P01")) {
        (
            "refuses the credentials",
            format!("check {url_var}'s user and password, and the server's pg_hba.conf"),
        )
    } else {
        (
            "does not answer",
            format!("start PostgreSQL or point {url_var} at a running server"),
        )
    };
    ConfigProblem::new(
        url_var,
        format!("PostgreSQL at {} {what} ({text})", redact(url)),
        fix,
    )
}

/// Checks that the pool's schema (the first of its `search_path`, chosen by the setting `schema_var`) exists;
/// returns its name. `fix` says what to do otherwise.
pub async fn require_schema(
    pool: &PgPool,
    schema_var: &str,
    fix: &str,
) -> Result<String, ConfigProblem> {
    let schema: Option<String> = sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(pool)
        .await
        .map_err(|e| unreadable(schema_var, &e))?;
    schema.ok_or_else(|| {
        ConfigProblem::new(
            schema_var,
            "names no schema that exists in the database",
            format!("{fix}, or fix {schema_var}"),
        )
    })
}

/// Checks that the pool's schema (chosen by the setting `schema_var`) exists and holds `tables`; `migrate`
/// says how to create them.
pub async fn require_tables(
    pool: &PgPool,
    schema_var: &str,
    tables: &[&str],
    migrate: &str,
) -> Result<(), ConfigProblem> {
    let schema = require_schema(pool, schema_var, &format!("create it and {migrate}")).await?;
    let present: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables \
         WHERE table_schema = current_schema() AND table_name = ANY($1)",
    )
    .bind(tables)
    .fetch_all(pool)
    .await
    .map_err(|e| unreadable(schema_var, &e))?;
    let missing: Vec<&str> = tables
        .iter()
        .copied()
        .filter(|t| !present.iter().any(|p| p == t))
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(ConfigProblem::new(
            schema_var,
            format!("schema {schema:?} has no {} table", missing.join(", ")),
            format!("{migrate}, or fix {schema_var}"),
        ))
    }
}

fn unreadable(schema_var: &str, e: &sqlx::Error) -> ConfigProblem {
    ConfigProblem::new(
        schema_var,
        format!("the schema cannot be read ({e})"),
        "check the database and the setting",
    )
}

/// The URL (or keyword connection string) without its password (in its user part, a `password=` query
/// parameter or a `password=` keyword, quoted or not), for messages.
pub fn redact(url: &str) -> String {
    let url = match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let credentials = &url[scheme + 3..at];
            match credentials.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    };
    match password_parameter(&url) {
        Some((at, written, _)) => format!("{}***{}", &url[..at], &url[at + written.len()..]),
        None => url,
    }
}

/// `text` (an error about `url`) with `url`'s password, wherever it appears, replaced.
fn without_password(text: &str, url: &str) -> String {
    let user_part = url.find("://").and_then(|scheme| {
        let at = url.rfind('@').filter(|at| *at > scheme)?;
        url[scheme + 3..at].split_once(':').map(|(_, p)| p)
    });
    let parameter = password_parameter(url);
    [
        user_part,
        parameter.map(|(_, written, _)| written),
        parameter.map(|(_, _, value)| value),
    ]
    .into_iter()
    .flatten()
    .filter(|p| !p.is_empty() && *p != "''")
    .fold(text.to_owned(), |text, p| text.replace(p, "***"))
}

/// The password `url` gives as a `password=` query parameter or keyword (`host=db password='a b'`): as
/// written (quotes included, with its offset in `url`) and its value. `None` when there is none, or it is
/// empty.
fn password_parameter(url: &str) -> Option<(usize, &str, &str)> {
    const KEY: &str = "password=";
    url.match_indices(KEY).find_map(|(at, _)| {
        let before = url[..at].chars().next_back();
        if !matches!(before, None | Some('?' | '&')) && !before.is_some_and(char::is_whitespace) {
            return None;
        }
        let rest = &url[at + KEY.len()..];
        let (written, value) = if let Some(quoted) = rest.strip_prefix('\'') {
            // A keyword value in single quotes, `\'` and `\\` escaped.
            let mut escaped = false;
            let end = quoted
                .char_indices()
                .find(|&(_, c)| {
                    let closes = c == '\'' && !escaped;
                    escaped = c == '\\' && !escaped;
                    closes
                })
                .map_or(quoted.len(), |(i, _)| i);
            (&rest[..(end + 2).min(rest.len())], &quoted[..end])
        } else {
            let end = rest
                .find(|c: char| c.is_whitespace() || c == '&')
                .unwrap_or(rest.len());
            (&rest[..end], &rest[..end])
        };
        (!value.is_empty()).then_some((at + KEY.len(), written, value))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_tls_refusal_is_named_as_one_and_keeps_the_password_out() {
        // The system's roots did not sign the local server's certificate (scripts/dev-services makes it).
        let roots = "/etc/ssl/certs/ca-certificates.crt";
        if !std::path::Path::new(roots).exists() {
            eprintln!("skipped: no {roots}");
            return;
        }
        let url = format!(
            "postgres://svc:hunter2@127.0.0.1:5432/test?sslmode=verify-full&sslrootcert={roots}"
        );
        let url = url.as_str();
        let problem = connect_postgres("DATABASE_URL", url, None, 1)
            .await
            .unwrap_err()
            .to_string();
        assert!(problem.starts_with("DATABASE_URL"), "{problem}");
        assert!(
            problem.contains("refuses the connection's TLS"),
            "{problem}"
        );
        assert!(problem.contains("sslrootcert"), "{problem}");
        assert!(!problem.contains("hunter2"), "{problem}");
    }

    #[tokio::test]
    async fn a_url_that_does_not_parse_is_named_without_its_password() {
        for url in [
            "postgres://app:s3cr#t@db:5432/orders",
            "postgres://app@db:notaport/orders?password=s3cr#t",
        ] {
            let problem = connect_postgres("DATABASE_URL", url, None, 1)
                .await
                .unwrap_err()
                .to_string();
            assert!(problem.starts_with("DATABASE_URL: "), "{problem}");
            assert!(!problem.contains("s3cr"), "{problem}");
        }
        assert_eq!(
            redact("postgres://app:pw@db/x?sslmode=require&password=pw2"),
            "postgres://app:***@db/x?sslmode=require&password=***"
        );
        // Keyword connection strings, quoted or not.
        assert_eq!(
            redact("host=db user=app password=s3cr#t dbname=orders"),
            "host=db user=app password=*** dbname=orders"
        );
        assert_eq!(
            redact("host=db password='s3 cr\\'t' dbname=orders"),
            "host=db password=*** dbname=orders"
        );
        assert_eq!(redact("password=s3cr#t"), "password=***");
        // A name that merely ends in `password=` is not the password.
        assert_eq!(
            redact("host=db application_name=oldpassword=x"),
            "host=db application_name=oldpassword=x"
        );
        assert_eq!(
            redact("application_name=oldpassword=pw password=pw"),
            "application_name=oldpassword=pw password=***"
        );
        assert_eq!(
            without_password(
                "could not connect: s3 cr\\'t refused",
                "password='s3 cr\\'t'"
            ),
            "could not connect: *** refused"
        );
    }

    #[test]
    fn problems_print_as_one_line_naming_the_setting() {
        let p = ConfigProblem::new("DATABASE_URL", "broken\n  across lines", "fix it");
        assert_eq!(p.to_string(), "DATABASE_URL: broken across lines; fix it");
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("postgres://u:secret@h:5432/d"),
            "postgres://u:***@h:5432/d"
        );
        assert_eq!(redact("postgres://u@h/d"), "postgres://u@h/d");
    }
}
