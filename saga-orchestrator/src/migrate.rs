//! The orchestrator's tables (`saga_instances`, `saga_transitions`), embedded from the workspace's
//! `migrations/orchestrator/` folder and recorded in `_saga_orchestrator_migrations`.

use sqlx::PgPool;
use sqlx::migrate::{MigrateError, Migrator};

/// The table in which the orchestrator's applied migrations are recorded.
pub const MIGRATIONS_TABLE: &str = "_saga_orchestrator_migrations";

/// The orchestrator's migrator.
pub fn migrator() -> Migrator {
    saga_runtime::store::migrate::owned_by(sqlx::migrate!("./migrations"), MIGRATIONS_TABLE)
}

/// Applies the orchestrator's migrations (the consumer's and the core's are applied by
/// `saga_consumer::migrate`).
pub async fn migrate(pool: &PgPool) -> Result<(), MigrateError> {
    migrator().run(pool).await
}
