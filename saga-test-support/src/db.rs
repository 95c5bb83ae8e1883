//! A PostgreSQL schema per test.

use std::str::FromStr;
use std::time::Duration;

use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
// Schema and database names below are generated here from [a-z0-9_] only, so formatting them into SQL
// is safe; `AssertSqlSafe` records that audit.
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};

use crate::env::{HOW_TO_START, database_url, epoch_secs};

/// The database in which tests create their schemas.
const TEST_DATABASE: &str = "saga_test";
/// Schemas of failed or killed test runs older than this are dropped by later runs.
const STALE_AFTER_SECS: u64 = 6 * 3600;

/// A schema of the test's own in the `saga_test` database, with the framework's migrations applied.
///
/// Its pool's connections have `search_path` set to the schema, so unqualified table names resolve there.
/// When the value is dropped the schema is dropped too, unless the test is panicking: then it is kept and its
/// name printed, for inspection.
pub struct TestDb {
    /// A pool whose connections use the test's schema.
    pub pool: PgPool,
    /// The schema's name.
    pub schema: String,
    /// The database the schema is in.
    database: String,
    /// The application name of the test's sessions.
    tag: String,
    /// Set when the database is the test's own: it is dropped with the value.
    admin_options: Option<PgConnectOptions>,
    options: PgConnectOptions,
}

impl std::fmt::Debug for TestDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestDb")
            .field("schema", &self.schema)
            .finish_non_exhaustive()
    }
}

impl TestDb {
    /// Creates the schema and applies the key store's and the outbox's migrations (`saga-core`'s). Panics,
    /// saying how to start PostgreSQL, if it is unreachable.
    pub async fn new(test_name: &str) -> Self {
        Self::with(test_name, &[]).await
    }

    /// Creates the schema and applies `saga-core`'s migrations, then `more` in order (the consumer's, the
    /// orchestrator's: each crate owns its tables).
    pub async fn with(test_name: &str, more: &[Migrator]) -> Self {
        let db = Self::empty(test_name).await;
        db.apply(&saga_runtime::store::migrate::migrator()).await;
        for migrator in more {
            db.apply(migrator).await;
        }
        db
    }

    /// Applies `migrator` to the schema.
    pub async fn apply(&self, migrator: &Migrator) {
        migrator
            .run(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("applying migrations to schema {}: {e}", self.schema));
    }

    /// Like [`TestDb::with`], in a database of the test's own, for a test that changes database-wide
    /// settings (`ALTER DATABASE .. SET default_transaction_read_only`, say) without touching other tests.
    /// The database is dropped with the value, unless the test failed.
    pub async fn with_own_database(test_name: &str, more: &[Migrator]) -> Self {
        let database = format!(
            "saga_{}",
            crate::env::unique_name(test_name).replace('-', "_")
        );
        let db = Self::empty_in(test_name, Some(database)).await;
        db.apply(&saga_runtime::store::migrate::migrator()).await;
        for migrator in more {
            db.apply(migrator).await;
        }
        db
    }

    /// The schema `public` of a database of the test's own, with the framework's migrations applied: for
    /// what two services in two databases of one cluster share (both on `public`, the usual layout), such as
    /// replication slots. The database is dropped with the value, unless the test failed.
    pub async fn public_of_own_database(test_name: &str) -> Self {
        let database = format!(
            "saga_{}",
            crate::env::unique_name(test_name).replace('-', "_")
        );
        let db = Self::empty_in_schema(test_name, Some(database), Some("public")).await;
        db.apply(&saga_runtime::store::migrate::migrator()).await;
        db
    }

    /// Creates the schema without applying any migration.
    pub async fn empty(test_name: &str) -> Self {
        Self::empty_in(test_name, None).await
    }

    /// Creates the schema in `saga_test`, or in a new database `own`.
    async fn empty_in(test_name: &str, own: Option<String>) -> Self {
        Self::empty_in_schema(test_name, own, None).await
    }

    /// Creates a schema of the test's own (or uses `existing`, in a database of its own) in `saga_test`, or
    /// in a new database `own`.
    async fn empty_in_schema(test_name: &str, own: Option<String>, existing: Option<&str>) -> Self {
        let url = crate::services().await.database_url.clone();
        let admin_options = PgConnectOptions::from_str(&url)
            .unwrap_or_else(|e| panic!("DATABASE_URL {url:?} is not a PostgreSQL URL: {e}"));
        let mut admin = connect(&admin_options, &url).await;
        ensure_database(&mut admin, TEST_DATABASE).await;
        if let Some(own) = &own {
            drop_stale_databases(&mut admin).await;
            ensure_database(&mut admin, own).await;
        }
        admin.close().await.ok();
        let database = own.clone().unwrap_or_else(|| TEST_DATABASE.to_owned());

        let options = admin_options.clone().database(&database);
        let mut conn = connect(&options, &url).await;
        drop_stale_schemas(&mut conn).await;
        let schema = match existing {
            Some(schema) => schema.to_owned(),
            None => {
                let schema = format!("t_{}", crate::env::unique_name(test_name).replace('-', "_"));
                sqlx::query(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
                    .execute(&mut conn)
                    .await
                    .unwrap_or_else(|e| panic!("creating schema {schema}: {e}"));
                schema
            }
        };
        conn.close().await.ok();

        // The application name tags the test's sessions, so that clean-up can end them (the database's name
        // where the schema is not the test's own).
        let tag = if existing.is_some() {
            database.clone()
        } else {
            schema.clone()
        };
        let options = options
            .options([("search_path", schema.as_str())])
            .application_name(&tag);
        let mut db = Self {
            pool: PgPool::connect_lazy_with(options.clone()),
            schema,
            database,
            tag,
            admin_options: own.map(|_| admin_options),
            options,
        };
        db.pool = db.pool_of(16).await;
        db
    }

    /// Another pool on this schema, with `size` connections.
    pub async fn pool_of(&self, size: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(self.options.clone())
            .await
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", self.database))
    }

    /// The database the schema is in (`saga_test`, or the test's own).
    pub fn database(&self) -> &str {
        &self.database
    }

    /// Connection options for this schema (for a pool of another size, or a dedicated connection).
    pub fn connect_options(&self) -> PgConnectOptions {
        self.options.clone()
    }

    /// A URL for this schema, for child processes: `DATABASE_URL`'s server, the schema's database and the
    /// schema as `search_path`.
    pub fn url(&self) -> String {
        format!(
            "{}/{}?options=-c%20search_path%3D{}",
            server_url(),
            self.database,
            self.schema
        )
    }

    /// The URL of the `saga_test` database itself (no schema chosen): `DATABASE_URL` with its database
    /// replaced.
    pub fn database_url() -> String {
        format!("{}/{TEST_DATABASE}", server_url())
    }

    /// Makes this schema's WAL outbox ready (its slot created and recorded), as a service writing in WAL
    /// mode does when it starts.
    pub async fn prepare_wal_outbox(&self) {
        saga_runtime::store::wal::prepare(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("preparing the WAL outbox of {}: {e}", self.schema));
    }

    /// The name of this schema's WAL outbox slot.
    pub fn wal_slot_name(&self) -> String {
        saga_runtime::store::wal::slot_name(&self.database, &self.schema)
    }

    /// Counts the rows of `table` (an unqualified name in the test's schema).
    pub async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("counting {table}: {e}"))
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "test failed: keeping schema {} in database {} for inspection",
                self.schema, self.database
            );
            return;
        }
        let options = self.options.clone();
        let schema = self.schema.clone();
        let database = self.database.clone();
        let tag = self.tag.clone();
        let own_database = self
            .admin_options
            .clone()
            .map(|admin| (admin, self.database.clone()));
        // Drop runs inside the test's runtime, which may be single-threaded and is blocked here: nothing
        // may wait for it. Clean up on a thread with a runtime of its own, over a connection of its own:
        // end the test's sessions (their open transactions would block the DROP), then drop the schema.
        let cleanup = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async move {
                let Ok(mut conn) =
                    PgConnection::connect_with(&options.application_name("saga-test-cleanup"))
                        .await
                else {
                    return;
                };
                let _ = sqlx::query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE application_name = $1 AND pid <> pg_backend_pid()",
                )
                .bind(&tag)
                .execute(&mut conn)
                .await;
                let _ = sqlx::query(AssertSqlSafe(format!(
                    "DROP SCHEMA IF EXISTS {schema} CASCADE"
                )))
                .execute(&mut conn)
                .await;
                drop_wal_slot(&mut conn, &database, &schema).await;
                conn.close().await.ok();
                if let Some((admin, database)) = own_database
                    && let Ok(mut admin) = PgConnection::connect_with(&admin).await
                {
                    let _ = sqlx::query(AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {database} WITH (FORCE)"
                    )))
                    .execute(&mut admin)
                    .await;
                }
            });
        });
        let _ = cleanup.join();
    }
}

/// Drops the WAL outbox's slot of `schema` in `database` (by either of its names), if it has one, ending a
/// relay still reading it: a slot left behind would keep the server's write-ahead log from being recycled.
async fn drop_wal_slot(conn: &mut PgConnection, database: &str, schema: &str) {
    let slots = [
        saga_runtime::store::wal::slot_name(database, schema),
        saga_runtime::store::wal::legacy_slot_name(schema),
    ];
    for _ in 0..50 {
        let _ = sqlx::query(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
             WHERE slot_name = ANY($1) AND database = current_database() AND active_pid IS NOT NULL",
        )
        .bind(&slots[..])
        .execute(&mut *conn)
        .await;
        match sqlx::query(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
             WHERE slot_name = ANY($1) AND database = current_database()",
        )
        .bind(&slots[..])
        .execute(&mut *conn)
        .await
        {
            Ok(_) => return,
            // Still active: its walsender is ending.
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

async fn connect(options: &PgConnectOptions, url: &str) -> PgConnection {
    match tokio::time::timeout(Duration::from_secs(10), PgConnection::connect_with(options)).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => panic!("PostgreSQL is not reachable at {url}: {e}. To fix: {HOW_TO_START}."),
        Err(_) => panic!("PostgreSQL at {url} did not answer within 10 s. To fix: {HOW_TO_START}."),
    }
}

/// `DATABASE_URL` without its database and query: `postgres://user@host:port`.
fn server_url() -> String {
    let base = database_url();
    let (without_query, _) = base.split_once('?').unwrap_or((&base, ""));
    without_query
        .rsplit_once('/')
        .map_or(without_query, |(server, _db)| server)
        .to_owned()
}

async fn ensure_database(admin: &mut PgConnection, name: &str) {
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(name)
            .fetch_one(&mut *admin)
            .await
            .expect("looking up the test database");
    if exists {
        return;
    }
    if let Err(e) = sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut *admin)
        .await
    {
        // Another test created it at the same moment.
        let raced = e
            .as_database_error()
            .and_then(|d| d.code())
            .is_some_and(|code| code == "42P04" || code == "23505");
        assert!(raced, "creating database {name}: {e}");
    }
}

/// Drops the databases of tests ([`TestDb::with_own_database`]) that failed or were killed long ago.
async fn drop_stale_databases(admin: &mut PgConnection) {
    let databases: Vec<String> =
        sqlx::query_scalar("SELECT datname::text FROM pg_database WHERE datname LIKE 'saga\\_%'")
            .fetch_all(&mut *admin)
            .await
            .unwrap_or_default();
    for database in databases.into_iter().filter(|d| is_stale(d)) {
        let _ = sqlx::query(AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {database} WITH (FORCE)"
        )))
        .execute(&mut *admin)
        .await;
    }
}

/// Whether a generated name (`{prefix}_{epoch}_{random}`) is older than [`STALE_AFTER_SECS`].
fn is_stale(name: &str) -> bool {
    let created = name.rsplit('_').nth(1).and_then(|s| s.parse::<u64>().ok());
    created.is_some_and(|c| epoch_secs().saturating_sub(c) > STALE_AFTER_SECS)
}

async fn drop_stale_schemas(conn: &mut PgConnection) {
    let schemas: Vec<String> =
        sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 't\\_%'")
            .fetch_all(&mut *conn)
            .await
            .unwrap_or_default();
    for schema in schemas {
        // t_{prefix}_{epoch}_{random}: the epoch is the second-to-last part.
        if is_stale(&schema) {
            let _ = sqlx::query(AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS {schema} CASCADE"
            )))
            .execute(&mut *conn)
            .await;
        }
    }
}
