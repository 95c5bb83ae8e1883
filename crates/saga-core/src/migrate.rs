//! The framework's tables, embedded from the workspace's `migrations/` folder.

use sqlx::PgPool;
use sqlx::migrate::{MigrateError, Migrator};

/// The table in which the framework records its applied migrations. Its own name keeps it apart from an
/// application's `_sqlx_migrations` in the same schema.
pub const MIGRATIONS_TABLE: &str = "_saga_migrations";

/// The framework's migrator. Tables are created in the first schema of the connection's `search_path`, so
/// several services can share one database with a schema each.
pub fn migrator() -> Migrator {
    let mut migrator = sqlx::migrate!("../../migrations");
    migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
    migrator
}

/// Applies the framework's migrations. Safe to run from several processes at once (the migrator takes an
/// advisory lock).
pub async fn migrate(pool: &PgPool) -> Result<(), MigrateError> {
    migrator().run(pool).await
}
