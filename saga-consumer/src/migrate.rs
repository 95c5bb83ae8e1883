//! The consumer's own tables (the crash-loop guard's progress and suspects), embedded from the workspace's
//! `migrations/consumer/` folder and recorded in `_saga_consumer_migrations`.

use sqlx::PgPool;
use sqlx::migrate::{MigrateError, Migrator};

/// The table in which the consumer's applied migrations are recorded.
pub const MIGRATIONS_TABLE: &str = "_saga_consumer_migrations";

/// The consumer's migrator.
pub fn migrator() -> Migrator {
    saga_runtime::store::migrate::owned_by(sqlx::migrate!("./migrations"), MIGRATIONS_TABLE)
}

/// Applies the key store's, the outbox's and the consumer's migrations: every table a consumer needs.
pub async fn migrate(pool: &PgPool) -> Result<(), MigrateError> {
    saga_runtime::store::migrate::migrate(pool).await?;
    migrator().run(pool).await
}
