//! Durable timers against a real PostgreSQL: one saga whose timer fails to fire does not hold up the other
//! due timers of its type.

use std::time::Duration;

use futures::future::BoxFuture;
use saga_core::{IdempotencyKey, Lineage, StepError, TenantId};
use saga_orchestrator::{
    Command, OnTimeout, Orchestrator, SagaChange, SagaDefinition, SagaHooks, Step, Verdict,
};
use saga_test_support::TestDb;
use sqlx::PgConnection;
use uuid::Uuid;

/// Fails every transition of the saga started with key `poison`.
struct FailsFor(&'static str);

type Data = serde_json::Value;

impl SagaHooks<Data> for FailsFor {
    fn transitioned<'a>(
        &'a self,
        _conn: &'a mut PgConnection,
        change: &'a SagaChange<'a, Data>,
    ) -> BoxFuture<'a, Result<(), StepError>> {
        Box::pin(async move {
            if change.instance.idempotency_key == self.0 && change.instance.version >= 1 {
                Err(StepError::permanent(
                    "the order row is locked by a migration",
                ))
            } else {
                Ok(())
            }
        })
    }
}

fn definition() -> SagaDefinition<Data> {
    SagaDefinition::new("timer-saga", "timer.replies")
        .unwrap()
        .step(
            Step::new(
                "a",
                Command::new("timer.commands", "DoA", |d: &Data| d["input"].clone()),
            )
            .unwrap()
            .replies_of(["ADone"], |_, _, _| Verdict::Succeeded)
            .timeout(Duration::from_secs(60), OnTimeout::Fail),
        )
}

async fn start(db: &TestDb, orchestrator: &Orchestrator<Data>, key: &str) -> Uuid {
    let mut tx = db.pool.begin().await.unwrap();
    let lineage = Lineage::root(IdempotencyKey::new(key).unwrap(), TenantId::default());
    let started = orchestrator
        .start(&mut tx, &lineage, serde_json::json!({}))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    started.saga_id
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

#[tokio::test]
async fn due_sagas_the_definition_has_no_move_for_are_marked_stuck_and_a_healthy_timer_still_fires()
{
    let db = TestDb::with(
        "timers-stuck",
        &[
            saga_consumer::migrate::migrator(),
            saga_orchestrator::migrate::migrator(),
        ],
    )
    .await;
    let orchestrator = Orchestrator::new(definition()).unwrap();
    let healthy = start(&db, &orchestrator, "healthy").await;
    let mut stuck = Vec::new();
    for n in 0..200 {
        stuck.push(start(&db, &orchestrator, &format!("lost-{n}")).await);
    }
    // These sagas were at a step the definition no longer has (it lost a step), and are due before the
    // healthy one: `decide` has nothing for them.
    sqlx::query(
        "UPDATE saga_instances SET step_index = 3, deadline = now() - interval '20 seconds' \
         WHERE saga_id = ANY($1)",
    )
    .bind(&stuck)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE saga_instances SET deadline = now() - interval '10 seconds' WHERE saga_id = $1",
    )
    .bind(healthy)
    .execute(&db.pool)
    .await
    .unwrap();

    // Ticks of 100, as `run_timers` fires them: the healthy timer fires by the third.
    let mut moved = 0;
    for _ in 0..3 {
        moved += orchestrator.fire_due(&db.pool, 100).await.unwrap();
    }
    assert_eq!(moved, 1, "the healthy saga moved");
    let healthy_now = saga_orchestrator::store::load(&db.pool, healthy)
        .await
        .unwrap()
        .unwrap();
    assert_ne!(healthy_now.status, "running", "its timeout was applied");

    let listed = saga_orchestrator::store::list(
        &db.pool,
        &saga_orchestrator::store::SagaFilter::default()
            .stuck_for(Duration::from_secs(3600))
            .limit(500),
    )
    .await
    .unwrap();
    assert_eq!(listed.len(), 200, "every lost saga is listed as stuck");
    for saga in &listed {
        assert_eq!(saga.deadline, None, "its timer is cleared");
        assert_eq!(saga.version, 1, "no transition");
        let reason = saga.stuck_reason.as_deref().unwrap_or_default();
        assert!(
            reason.contains("step 3") && reason.contains("no move"),
            "{reason}"
        );
    }
    assert_eq!(
        orchestrator.fire_due(&db.pool, 100).await.unwrap(),
        0,
        "nothing is due any more"
    );
    let due: i64 =
        sqlx::query_scalar("SELECT count(*) FROM saga_instances WHERE deadline <= now()")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(due, 0);
}

#[tokio::test]
async fn a_retry_an_operator_asks_for_resends_the_current_command_with_its_key_and_is_recorded() {
    let db = TestDb::with(
        "timers-retry",
        &[
            saga_consumer::migrate::migrator(),
            saga_orchestrator::migrate::migrator(),
        ],
    )
    .await;
    let orchestrator = Orchestrator::new(definition()).unwrap();
    let id = start(&db, &orchestrator, "order-9").await;
    let commands = || async {
        sqlx::query_as::<_, (String, Vec<String>)>(
            "SELECT topic, headers FROM saga_outbox ORDER BY id",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap()
    };
    assert_eq!(commands().await.len(), 1, "the first command");
    // Not due: nothing fires.
    assert_eq!(orchestrator.fire_due(&db.pool, 100).await.unwrap(), 0);

    let requested = saga_orchestrator::store::request_retry(&db.pool, id, "frank")
        .await
        .unwrap();
    assert_eq!(requested.retry_requested_by.as_deref(), Some("frank"));
    assert_eq!(orchestrator.fire_due(&db.pool, 100).await.unwrap(), 1);

    let instance = saga_orchestrator::store::load(&db.pool, id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (instance.status.as_str(), instance.attempt, instance.version),
        ("running", 2, 2),
        "the same step, a second attempt, not compensated"
    );
    assert_eq!(instance.retry_requested_by, None, "the request is cleared");
    assert!(instance.deadline.unwrap() > chrono::Utc::now() + chrono::Duration::seconds(50));
    let sent = commands().await;
    assert_eq!(sent.len(), 2, "the command sent again");
    let key_of = |headers: &[String]| {
        headers
            .chunks(2)
            .find(|p| p[0] == "idempotency-key")
            .map(|p| p[1].clone())
    };
    assert_eq!(sent[0].0, sent[1].0);
    assert_eq!(key_of(&sent[0].1), key_of(&sent[1].1), "with the same key");
    let history = saga_orchestrator::store::history(&db.pool, id)
        .await
        .unwrap();
    let retry = history.last().unwrap();
    assert_eq!(
        (
            retry.cause.as_str(),
            retry.operator.as_deref(),
            retry.retry_of,
            retry.version
        ),
        ("retry", Some("frank"), Some(1), 2),
        "a retry transition naming the operator and the version it retries"
    );
    assert_eq!(history[0].retry_of, None);

    // A finished saga cannot be retried.
    sqlx::query(
        "UPDATE saga_instances SET status = 'compensated', deadline = NULL WHERE saga_id = $1",
    )
    .bind(id)
    .execute(&db.pool)
    .await
    .unwrap();
    let refused = saga_orchestrator::store::request_retry(&db.pool, id, "frank").await;
    assert!(
        matches!(
            refused,
            Err(saga_orchestrator::OrchestratorError::NotRetryable { .. })
        ),
        "{refused:?}"
    );
    let unknown = saga_orchestrator::store::request_retry(&db.pool, Uuid::now_v7(), "frank").await;
    assert!(matches!(
        unknown,
        Err(saga_orchestrator::OrchestratorError::NoSuchSaga(_))
    ));
}
