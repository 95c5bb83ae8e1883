//! Durable timers against a real PostgreSQL: one saga whose timer fails to fire does not hold up the other
//! due timers of its type.

use std::time::Duration;

use futures::future::BoxFuture;
use saga_core::{IdempotencyKey, Lineage, StepError, TenantId};
use saga_orchestrator::{
    Command, Decision, OnTimeout, Orchestrator, SagaDefinition, SagaHooks, SagaInstance, Step,
};
use saga_test_support::TestDb;
use sqlx::PgConnection;
use uuid::Uuid;

/// Fails every transition of the saga started with key `poison`.
struct FailsFor(&'static str);

impl SagaHooks for FailsFor {
    fn transitioned<'a>(
        &'a self,
        _conn: &'a mut PgConnection,
        before: &'a SagaInstance,
        _decision: &'a Decision,
    ) -> BoxFuture<'a, Result<(), StepError>> {
        Box::pin(async move {
            if before.idempotency_key == self.0 && before.version >= 1 {
                Err(StepError::permanent(
                    "the order row is locked by a migration",
                ))
            } else {
                Ok(())
            }
        })
    }
}

fn definition() -> SagaDefinition {
    SagaDefinition::new("timer-saga", "timer.replies")
        .unwrap()
        .step(
            Step::new(
                "a",
                Command::new("timer.commands", "DoA", |d| d["input"].clone()),
            )
            .unwrap()
            .succeeds_on(["ADone"])
            .timeout(Duration::from_secs(60), OnTimeout::Fail),
        )
}

async fn start(db: &TestDb, orchestrator: &Orchestrator, key: &str) -> Uuid {
    let mut tx = db.pool.begin().await.unwrap();
    let lineage = Lineage::root(IdempotencyKey::new(key).unwrap(), TenantId::default(), None);
    let (id, _) = orchestrator
        .start(&mut tx, &lineage, serde_json::json!({}))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    id
}

#[tokio::test]
async fn a_saga_whose_timer_fails_is_marked_and_put_off_while_the_others_fire() {
    let db = TestDb::with(
        "timers-isolated",
        &[
            saga_consumer::migrate::migrator(),
            saga_orchestrator::migrate::migrator(),
        ],
    )
    .await;
    let orchestrator = Orchestrator::new(definition())
        .unwrap()
        .with_hooks(FailsFor("poison"));
    // The failing saga's deadline is the earliest: it is picked first on every tick.
    let poison = start(&db, &orchestrator, "poison").await;
    let healthy = start(&db, &orchestrator, "healthy").await;
    for (id, ago) in [(poison, 20), (healthy, 10)] {
        sqlx::query("UPDATE saga_instances SET deadline = now() - $2 * interval '1 second' WHERE saga_id = $1")
            .bind(id)
            .bind(ago)
            .execute(&db.pool)
            .await
            .unwrap();
    }

    let moved = orchestrator.fire_due(&db.pool, 100).await.unwrap();
    assert_eq!(moved, 1, "the healthy saga moved");
    let load = |id| {
        let pool = db.pool.clone();
        async move {
            saga_orchestrator::store::load(&pool, id)
                .await
                .unwrap()
                .unwrap()
        }
    };
    let healthy_now = load(healthy).await;
    assert_ne!(healthy_now.status, "running", "its timeout was applied");
    assert_eq!(healthy_now.version, 2);
    let poison_now = load(poison).await;
    assert_eq!(poison_now.status, "running", "unchanged");
    assert_eq!(poison_now.version, 1, "its transition rolled back");
    assert_eq!(poison_now.timer_failures, 1);
    assert!(
        poison_now
            .last_error
            .as_deref()
            .unwrap_or_default()
            .contains("locked by a migration"),
        "{:?}",
        poison_now.last_error
    );
    assert!(
        poison_now.deadline.unwrap() > chrono::Utc::now(),
        "put off, so that it is not picked first on every tick"
    );
    assert_eq!(
        orchestrator.fire_due(&db.pool, 100).await.unwrap(),
        0,
        "nothing else is due"
    );
}
