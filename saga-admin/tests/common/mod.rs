//! Running the `saga` binary against a schema and the broker.

#![allow(dead_code, unreachable_pub)]

use std::process::Output;

/// Where the `saga` command points: a database URL, a schema, the broker.
#[derive(Debug, Clone)]
pub struct Target {
    pub database_url: String,
    pub schema: String,
    pub brokers: String,
}

impl Target {
    /// The `saga` command with this target's settings and `args`.
    pub fn command(&self, args: &[&str]) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_saga"));
        command
            .args(args)
            .env("DATABASE_URL", &self.database_url)
            .env("SAGA_SCHEMA", &self.schema)
            .env("KAFKA_BROKERS", &self.brokers)
            .env("RUST_LOG", "warn")
            .env_remove("SAGA_ADMIN_TOKEN")
            .stdin(std::process::Stdio::null());
        command
    }

    /// Runs `saga args`; returns its output.
    pub async fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().await.expect("starting saga")
    }

    /// Runs `saga args` and returns its standard output; panics unless it succeeded.
    pub async fn text(&self, args: &[&str]) -> String {
        let output = self.run(args).await;
        assert!(
            output.status.success(),
            "saga {args:?} failed ({:?}):\n{}",
            output.status.code(),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).expect("UTF-8 output")
    }

    /// Runs `saga --json args` and parses what it printed.
    pub async fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let text = self.text(&all).await;
        serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("saga {all:?} printed no JSON ({e}):\n{text}"))
    }
}

/// How many letters of a replay report (`--json`) were sent, and their outcomes in order.
pub fn outcomes(report: &serde_json::Value) -> (usize, Vec<String>) {
    let outcomes: Vec<String> = report["letters"]
        .as_array()
        .expect("a report lists letters")
        .iter()
        .map(|l| match &l["outcome"] {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Object(o) => o.keys().next().cloned().unwrap_or_default(),
            other => other.to_string(),
        })
        .collect();
    (outcomes.iter().filter(|o| *o == "sent").count(), outcomes)
}

/// A pool on `schema` of the database at `url`: what the `saga` command connects to.
pub async fn schema_pool(url: &str, schema: &str) -> sqlx::PgPool {
    saga_consumer::setup::connect_postgres("DATABASE_URL", url, Some(schema), 2)
        .await
        .unwrap_or_else(|e| panic!("connecting to schema {schema}: {e}"))
}

/// A new topic of `kafka` named like a dead-letter topic (`….dlq`), with `partitions`.
pub async fn dlq_topic(
    kafka: &saga_test_support::TestKafka,
    prefix: &str,
    partitions: i32,
) -> String {
    let name = format!("{}.dlq", saga_test_support::unique_name(prefix));
    kafka.create_topic(&name, partitions).await;
    name
}

/// A role of its own that may read `schema` and nothing else; dropped by [`Reader::drop_role`].
pub struct Reader {
    role: String,
    /// The database's URL, as this role.
    pub url: String,
}

impl Reader {
    /// A new role that may read `schema` of the test database, through `pool` (a user that may grant).
    pub async fn create(pool: &sqlx::PgPool, schema: &str) -> Self {
        let role = format!("reader_{}", uuid::Uuid::new_v4().simple());
        for statement in [
            format!("CREATE ROLE {role} LOGIN"),
            format!("GRANT USAGE ON SCHEMA \"{schema}\" TO {role}"),
            format!("GRANT SELECT ON ALL TABLES IN SCHEMA \"{schema}\" TO {role}"),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(pool)
                .await
                .unwrap();
        }
        // The test database's address, as this role.
        let url = saga_test_support::TestDb::database_url();
        let (scheme, rest) = url.split_once("://").unwrap();
        let rest = rest.split_once('@').map_or(rest, |(_, host)| host);
        Self {
            url: format!("{scheme}://{role}@{rest}"),
            role,
        }
    }

    /// Drops the role (and what it was granted), through `pool`.
    pub async fn drop_role(self, pool: &sqlx::PgPool) {
        for statement in [
            format!("DROP OWNED BY {}", self.role),
            format!("DROP ROLE {}", self.role),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(pool)
                .await
                .unwrap();
        }
    }
}
