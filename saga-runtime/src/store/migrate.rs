//! The tables of the key store and the outbox, embedded from the workspace's `migrations/core/` folder
//! (reached through the crate's `migrations` link, so that the SQL is packaged with the crate).
//!
//! Each framework crate applies its own tables with a migrator of its own, recorded in a table of its own:
//! `saga-core` the key store and the outbox, `saga-consumer` the crash-loop guard, `saga-orchestrator` the
//! saga instances. A choreographed service therefore gets no orchestrator tables.

use sqlx::PgPool;
use sqlx::migrate::{MigrateError, Migrator};

/// The table in which the key store's and the outbox's applied migrations are recorded. Its own name keeps
/// it apart from an application's `_sqlx_migrations` in the same schema.
pub const MIGRATIONS_TABLE: &str = "_saga_migrations";

/// The key store's and the outbox's migrator. Tables are created in the first schema of the connection's
/// `search_path`, so several services can share one database with a schema each.
pub fn migrator() -> Migrator {
    owned_by(sqlx::migrate!("./migrations"), MIGRATIONS_TABLE)
}

/// Readies `migrator` to record its migrations in `table`, ignoring versions recorded there that it does not
/// know: 0.1.0 applied every framework table from one set recorded in [`MIGRATIONS_TABLE`], whose later
/// versions now belong to the consumer's and the orchestrator's own migrators.
pub fn owned_by(mut migrator: Migrator, table: &'static str) -> Migrator {
    migrator.dangerous_set_table_name(table);
    migrator.set_ignore_missing(true);
    migrator
}

/// Applies the key store's and the outbox's migrations. Safe to run from several processes at once (the
/// migrator takes an advisory lock).
pub async fn migrate(pool: &PgPool) -> Result<(), MigrateError> {
    migrator().run(pool).await
}
