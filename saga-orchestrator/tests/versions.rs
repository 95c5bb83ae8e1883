//! Typed saga data and definition versions against a real PostgreSQL: an instance stored by 0.2 (untyped
//! data, no version) is read by the definition that declares how, and written back in its type; a reply of
//! the wrong shape is refused with its reason and moves nothing; an instance of a version the orchestrator
//! does not have is never misread.

use std::time::Duration;

use saga_consumer::{SagaEvent, Topic};
use saga_core::{ErrorKind, EventMetadata, IdempotencyKey, Lineage, StepError, TenantId};
use saga_orchestrator::{
    Command, LegacyData, OnTimeout, Orchestrator, OrchestratorError, SagaDefinition, SagaStatus,
    Step, Verdict,
};
use saga_test_support::TestDb;
use serde::{Deserialize, Serialize};
use serde_json::json;
use uuid::Uuid;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Order {
    order_id: String,
    charge: Option<String>,
}

#[derive(Serialize, Deserialize, SagaEvent)]
struct Charge {
    order_id: String,
}

#[derive(Serialize, Deserialize, SagaEvent)]
struct Charged {
    charge_id: String,
}

#[derive(Serialize, Deserialize, SagaEvent)]
struct Refund {
    order_id: String,
    why: String,
}

#[derive(Serialize, Deserialize, SagaEvent)]
struct Refunded {}

#[derive(Serialize, Deserialize, SagaEvent)]
struct Ship {
    order_id: String,
    charge_id: String,
}

#[derive(Serialize, Deserialize, SagaEvent)]
struct Shipped {}

const COMMANDS: Topic<Charge> = Topic::fixed("versions.commands");
const REFUNDS: Topic<Refund> = Topic::fixed("versions.commands");
const SHIPPING: Topic<Ship> = Topic::fixed("versions.commands");

/// `charge` (refunded on compensation), then `ship`.
fn definition() -> SagaDefinition<Order> {
    definition_charging_with("charge")
}

/// [`definition`], its first step named `charge_step`.
fn definition_charging_with(charge_step: &str) -> SagaDefinition<Order> {
    let charge = Step::new(
        charge_step,
        Command::to(&COMMANDS, |o: &Order| Charge {
            order_id: o.order_id.clone(),
        }),
    )
    .unwrap()
    .replies(|o: &mut Order, charged: Charged| {
        o.charge = Some(charged.charge_id);
        Verdict::Succeeded
    })
    .compensate_with(
        Command::undo(&REFUNDS, |o: &Order, why: &str| Refund {
            order_id: o.order_id.clone(),
            why: why.to_owned(),
        }),
        |_: &mut Order, _: Refunded| {},
        Duration::from_secs(5),
    );
    let ship = Step::new(
        "ship",
        Command::try_to(&SHIPPING, |o: &Order| {
            let charge_id = o.charge.clone().ok_or("nothing charged")?;
            let order_id = o.order_id.clone();
            Ok::<_, &str>(Ship {
                order_id,
                charge_id,
            })
        }),
    )
    .unwrap()
    .replies(|_: &mut Order, _: Shipped| Verdict::Succeeded)
    .timeout(Duration::from_secs(60), OnTimeout::Fail);
    SagaDefinition::new("versioned-order", "versions.replies")
        .unwrap()
        .step(charge)
        .step(ship)
}

/// How the 0.2 instances of `definition` read.
fn read_0_2(stored: &LegacyData) -> Result<Order, String> {
    #[derive(Deserialize)]
    struct Input {
        order_id: String,
    }
    Ok(Order {
        order_id: stored.input::<Input>()?.order_id,
        charge: stored.reply::<Charged>("charge").map(|c| c.charge_id),
    })
}

async fn db(name: &str) -> TestDb {
    TestDb::with(
        name,
        &[
            saga_consumer::migrate::migrator(),
            saga_orchestrator::migrate::migrator(),
        ],
    )
    .await
}

/// An instance as 0.2 wrote it: no definition version, its data `{"input": ..., "<step>": <reply>}`,
/// waiting at step `ship` with its deadline passed.
async fn insert_0_2_instance(db: &TestDb, key: &str) -> Uuid {
    let saga_id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO saga_instances (saga_id, saga_type, tenant_id, idempotency_key, status, step_index, \
             attempt, step_keys, data, deadline, version) \
         VALUES ($1, 'versioned-order', 'default', $2, 'running', 1, 1, $3, $4, now() - interval '1 second', 2)",
    )
    .bind(saga_id)
    .bind(key)
    .bind(json!({ "charge": format!("{key}:charge"), "ship": format!("{key}:ship") }))
    .bind(json!({ "input": { "order_id": "o-7" }, "charge": { "charge_id": "ch_1" } }))
    .execute(&db.pool)
    .await
    .unwrap();
    saga_id
}

async fn outbox_payloads(db: &TestDb, event_type: &str) -> Vec<serde_json::Value> {
    let rows: Vec<Vec<u8>> = sqlx::query_scalar(
        "SELECT payload FROM saga_outbox WHERE headers[array_position(headers, 'ce_type') + 1] = $1 \
         ORDER BY id",
    )
    .bind(event_type)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    rows.iter()
        .map(|p| serde_json::from_slice(p).unwrap())
        .collect()
}

#[tokio::test]
async fn an_instance_stored_by_0_2_is_read_by_the_declared_migration_and_written_back_typed() {
    let db = db("versions-0-2").await;
    let saga_id = insert_0_2_instance(&db, "old-order").await;

    // A definition that does not say how to read 0.2 data never guesses: the instance is marked stuck.
    let unprepared = Orchestrator::new(definition()).unwrap();
    assert_eq!(unprepared.fire_due(&db.pool, 10).await.unwrap(), 0);
    let stuck = saga_orchestrator::store::load(&db.pool, saga_id)
        .await
        .unwrap()
        .unwrap();
    let reason = stuck.stuck_reason.clone().unwrap_or_default();
    assert!(reason.contains("stored by 0.2"), "{reason}");
    assert_eq!(stuck.version, 2, "no transition");

    // With the migration declared (and the instance due again), its timeout moves it: `ship` timed out,
    // so `charge` is refunded, the refund built from the data read from the 0.2 form.
    let orchestrator = Orchestrator::new(definition().reads_untyped(read_0_2)).unwrap();
    sqlx::query("UPDATE saga_instances SET deadline = now() WHERE saga_id = $1")
        .bind(saga_id)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(orchestrator.fire_due(&db.pool, 10).await.unwrap(), 1);
    assert_eq!(
        outbox_payloads(&db, "Refund").await,
        [json!({ "order_id": "o-7", "why": "ship timed out" })]
    );
    let (instance, data) = read(&db, &orchestrator, saga_id).await;
    assert_eq!(instance.status, SagaStatus::Compensating.as_str());
    assert_eq!(
        instance.definition_version,
        Some(1),
        "now stored by this version"
    );
    assert_eq!(
        instance.data,
        json!({ "order_id": "o-7", "charge": "ch_1" }),
        "written back in the saga's type"
    );
    assert_eq!(
        data,
        Order {
            order_id: "o-7".into(),
            charge: Some("ch_1".into()),
        }
    );

    // Its confirmation finishes it, on the typed form.
    assert!(
        deliver(&db, &orchestrator, "old-order", "Refunded", b"{}")
            .await
            .unwrap()
    );
    let (done, _) = read(&db, &orchestrator, saga_id).await;
    assert_eq!(done.status, SagaStatus::Compensated.as_str());
}

/// Hands `orchestrator` a reply of `event_type` carrying `payload` for the saga started with `key`, in a
/// transaction of its own: committed when the reply is handled, rolled back when it is refused.
async fn deliver(
    db: &TestDb,
    orchestrator: &Orchestrator<Order>,
    key: &str,
    event_type: &str,
    payload: &[u8],
) -> Result<bool, OrchestratorError> {
    let mut tx = db.pool.begin().await.unwrap();
    let handled = orchestrator
        .on_reply(&mut tx, &reply(key, event_type), payload)
        .await;
    if handled.is_ok() {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
    handled
}

fn reply(key: &str, event_type: &str) -> EventMetadata {
    EventMetadata {
        idempotency_key: IdempotencyKey::new(key).unwrap(),
        tenant: TenantId::default(),
        event_type: event_type.to_owned(),
        message_id: None,
        source: None,
        correlation_id: None,
        causation_id: None,
        traceparent: None,
        span_context: None,
    }
}

/// Instance `saga_id` and its data, as `orchestrator` reads them.
async fn read(
    db: &TestDb,
    orchestrator: &Orchestrator<Order>,
    saga_id: Uuid,
) -> (saga_orchestrator::SagaInstance, Order) {
    orchestrator
        .instance(&db.pool, saga_id)
        .await
        .unwrap()
        .expect("the instance exists")
}

async fn start(db: &TestDb, orchestrator: &Orchestrator<Order>, key: &str) -> Uuid {
    let mut tx = db.pool.begin().await.unwrap();
    let lineage = Lineage::root(IdempotencyKey::new(key).unwrap(), TenantId::default());
    let order = Order {
        order_id: key.to_owned(),
        charge: None,
    };
    let started = orchestrator.start(&mut tx, &lineage, order).await.unwrap();
    tx.commit().await.unwrap();
    assert!(started.created);
    started.saga_id
}

#[tokio::test]
async fn a_reply_of_the_wrong_shape_is_refused_with_its_reason_and_moves_nothing() {
    let db = db("versions-bad-reply").await;
    let orchestrator = Orchestrator::new(definition()).unwrap();
    let saga_id = start(&db, &orchestrator, "order-8").await;

    let wrong = br#"{ "charge": 12 }"#;
    let refused = deliver(&db, &orchestrator, "order-8", "Charged", wrong)
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, OrchestratorError::BadReply { reason, .. } if reason.contains("Charged")),
        "{refused}"
    );
    // The consumer dead-letters it, with that reason, rather than retrying it.
    let step_error = StepError::from(refused);
    assert_eq!(step_error.kind(), ErrorKind::Permanent);
    let (instance, data) = read(&db, &orchestrator, saga_id).await;
    assert_eq!((instance.step_index, instance.version), (0, 1), "no move");
    assert_eq!(data.charge, None);

    // The right shape moves it, and the next command is built from what the reply recorded.
    let right = br#"{ "charge_id": "ch_8" }"#;
    assert!(
        deliver(&db, &orchestrator, "order-8", "Charged", right)
            .await
            .unwrap()
    );
    assert_eq!(
        outbox_payloads(&db, "Ship").await,
        [json!({ "order_id": "order-8", "charge_id": "ch_8" })]
    );
}

#[tokio::test]
async fn an_instance_of_a_version_the_orchestrator_does_not_have_is_refused_never_misread() {
    let db = db("versions-unknown").await;
    let v1 = Orchestrator::new(definition()).unwrap();
    let saga_id = start(&db, &v1, "order-9").await;
    // Version 2 dropped the `ship` step, and was deployed without keeping version 1.
    let mut v2 = definition().version(2);
    v2.steps.truncate(1);
    let v2_only = Orchestrator::new(v2.clone()).unwrap();

    let charged = br#"{ "charge_id": "ch_9" }"#;
    let refused = deliver(&db, &v2_only, "order-9", "Charged", charged)
        .await
        .unwrap_err();
    assert!(
        matches!(
            refused,
            OrchestratorError::UnknownVersion { version: 1, .. }
        ),
        "{refused}"
    );
    assert_eq!(
        StepError::from(refused).kind(),
        ErrorKind::Permanent,
        "an older version nobody keeps: dead-lettered with the reason"
    );
    // A version newer than any the orchestrator has (a rolling deploy) is retried instead.
    let old_only = Orchestrator::new(definition()).unwrap();
    sqlx::query("UPDATE saga_instances SET definition_version = 3 WHERE saga_id = $1")
        .bind(saga_id)
        .execute(&db.pool)
        .await
        .unwrap();
    let newer = deliver(&db, &old_only, "order-9", "Charged", charged)
        .await
        .unwrap_err();
    assert_eq!(StepError::from(newer).kind(), ErrorKind::Transient);
    sqlx::query("UPDATE saga_instances SET definition_version = 1 WHERE saga_id = $1")
        .bind(saga_id)
        .execute(&db.pool)
        .await
        .unwrap();

    // Its timer marks it stuck, naming the version.
    sqlx::query("UPDATE saga_instances SET deadline = now() WHERE saga_id = $1")
        .bind(saga_id)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(v2_only.fire_due(&db.pool, 10).await.unwrap(), 0);
    let stuck = saga_orchestrator::store::load(&db.pool, saga_id)
        .await
        .unwrap()
        .unwrap();
    let reason = stuck.stuck_reason.unwrap_or_default();
    assert!(reason.contains("version 1"), "{reason}");

    // Keeping version 1 runs it on its own definition: the reply moves it to `ship`, a step v2 lacks.
    let both = Orchestrator::new(v2)
        .unwrap()
        .keep_running(definition())
        .unwrap();
    assert!(
        deliver(&db, &both, "order-9", "Charged", charged)
            .await
            .unwrap()
    );
    let (instance, _) = read(&db, &both, saga_id).await;
    assert_eq!(
        (instance.step_index, instance.definition_version),
        (1, Some(1))
    );
    assert_eq!(outbox_payloads(&db, "Ship").await.len(), 1);
}

#[test]
fn versions_that_send_one_reply_type_to_differently_named_steps_are_refused() {
    // Version 2 renamed `charge` to `authorize`, keeping its reply type: the reply steps `on-charge` and
    // `on-authorize` would both take an instance's `Charged`, and one of them would then take it for an
    // instance of the other version, for which a later reply would be a duplicate.
    let renamed = Orchestrator::new(definition_charging_with("authorize").version(2)).unwrap();
    let refused = renamed.keep_running(definition()).unwrap_err();
    let message = refused.to_string();
    assert!(
        message.contains("Charged")
            && message.contains("on-charge")
            && message.contains("on-authorize"),
        "{message}"
    );
    // The same names in both versions are fine.
    Orchestrator::new(definition().version(2))
        .unwrap()
        .keep_running(definition())
        .unwrap();
}

#[tokio::test]
async fn a_manual_clock_advanced_by_an_hour_fires_an_hour_long_timeout_at_once() {
    let db = db("versions-clock").await;
    let clock = saga_orchestrator::SagaClock::manual();
    let hour = Duration::from_secs(3600);
    let mut definition = definition();
    definition.steps[0].timeout = hour;
    let orchestrator = Orchestrator::new(definition).unwrap().with_clock(&clock);
    let saga_id = start(&db, &orchestrator, "order-10").await;
    let began = std::time::Instant::now();

    // Not due a minute before the hour is up, by the advanced clock.
    clock.advance(hour - Duration::from_secs(60));
    assert_eq!(orchestrator.fire_due(&db.pool, 10).await.unwrap(), 0);
    // Due once it is.
    clock.advance(Duration::from_secs(61));
    assert_eq!(orchestrator.fire_due(&db.pool, 10).await.unwrap(), 1);
    let (instance, _) = read(&db, &orchestrator, saga_id).await;
    assert_eq!(instance.status, SagaStatus::Compensating.as_str());
    assert_eq!(
        outbox_payloads(&db, "Refund").await,
        [json!({ "order_id": "order-10", "why": "charge timed out" })]
    );
    // The compensation's deadline is set by the same clock: due after its resend interval, not at once.
    assert_eq!(orchestrator.fire_due(&db.pool, 10).await.unwrap(), 0);
    clock.advance(Duration::from_secs(5));
    assert_eq!(orchestrator.fire_due(&db.pool, 10).await.unwrap(), 1);
    assert_eq!(outbox_payloads(&db, "Refund").await.len(), 2, "re-sent");
    let took = began.elapsed();
    assert!(took < Duration::from_secs(1), "an hour in {took:?}");
}
