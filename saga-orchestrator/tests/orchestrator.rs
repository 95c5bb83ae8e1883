//! The orchestrator against the real broker and the real PostgreSQL: the happy path, failure at each
//! step, an orchestrator stopped between transitions, two instances racing, a timed-out step.

use std::time::Duration;

use outbox_relay::Relay;
use saga_consumer::{SagaConsumer, SagaConsumerBuilder};
use saga_core::headers::names;
use saga_core::{
    ErrorKind, Event, IdempotencyKey, Lineage, Message, SagaEvent, SagaStep, StepContext,
    StepError, StepName, StepOutcome, StepResult, Subscription, TenantId, Topic,
};
use saga_orchestrator::{
    Command, OnTimeout, Orchestrator, OrchestratorError, SagaDefinition, SagaStatus, Step, Verdict,
};
use saga_test_support::{TestDb, TestKafka, wait_until};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(90);

/// A participant step `name` handling command `command`: records its effect and replies `ok`, or `fail`
/// when the saga's input says `"fail_at": name`, or nothing at all when it says `"silent": name`.
struct Participant {
    name: &'static str,
    commands: String,
    replies: String,
    command: String,
    ok: String,
    fail: Option<String>,
}

impl SagaStep for Participant {
    type Payload = Value;

    fn name(&self) -> StepName {
        StepName::new(self.name).unwrap()
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        vec![Subscription::new(&self.commands, &self.command)]
    }

    async fn handle(&self, msg: &Message<Value>, ctx: &mut StepContext<'_>) -> StepResult {
        let input = msg.payload();
        if input["silent"] == self.name {
            return Ok(StepOutcome::completed());
        }
        let failing = self.fail.is_some() && input["fail_at"] == self.name;
        let kind = if failing {
            format!("failed-{}", self.name)
        } else {
            self.name.to_owned()
        };
        sqlx::query("INSERT INTO effects (kind, step_key) VALUES ($1, $2)")
            .bind(&kind)
            .bind(format!("{}:{}", msg.idempotency_key(), self.name))
            .execute(ctx.conn())
            .await?;
        let reply = if failing {
            self.fail.clone().unwrap_or_default()
        } else {
            self.ok.clone()
        };
        // Where the command says to answer, keyed by its saga (what `ctx.reply` does for a typed reply).
        let (Some(reply_to), Some(saga)) =
            (msg.header(names::REPLY_TO), msg.header(names::SAGA_ID))
        else {
            // Checked by the tests (`commands_name_their_reply_topic`): a dead letter here.
            return Err(StepError::permanent(
                "the command names no reply topic or saga",
            ));
        };
        if reply_to != self.replies {
            return Err(StepError::permanent(format!(
                "the command names {reply_to} as its reply topic, not {}",
                self.replies
            )));
        }
        ctx.emit_event(Event::new(
            reply,
            reply_to,
            saga,
            &json!({ "by": self.name, "reason": format!("{} says no", self.name) }),
        )?);
        Ok(StepOutcome::completed())
    }
}

/// Saga `test-saga`: steps a and b can be compensated, c cannot.
fn definition(
    commands: &str,
    replies: &str,
    timeout: Duration,
    on_timeout: OnTimeout,
) -> SagaDefinition<Value> {
    let step = |name: &str, compensable: bool| {
        let up = name.to_uppercase();
        let key = name.to_owned();
        let s = Step::new(
            name,
            Command::new(commands, format!("Do{up}"), |d: &Value| d["input"].clone()),
        )
        .unwrap()
        .replies_of(
            [format!("{up}Done"), format!("{up}Failed")],
            move |data: &mut Value, event_type, reply| {
                // Kept for later commands, under the step's name.
                data[key.as_str()] = reply.clone();
                if event_type.ends_with("Done") {
                    Verdict::Succeeded
                } else {
                    Verdict::Failed(reply["reason"].as_str().unwrap_or("failed").to_owned())
                }
            },
        )
        .timeout(timeout, on_timeout);
        if compensable {
            s.compensate_with_types(
                Command::new(commands, format!("Undo{up}"), |d: &Value| {
                    d["input"].clone()
                }),
                [format!("{up}Undone")],
                Duration::from_secs(2),
            )
        } else {
            s
        }
    };
    SagaDefinition::new("test-saga", replies)
        .unwrap()
        .step(step("a", true))
        .step(step("b", true))
        .step(step("c", false))
}

fn participants(commands: &str, replies: &str) -> Vec<Participant> {
    let mut all = Vec::new();
    for (name, undo) in [
        ("a", Some("compensate-a")),
        ("b", Some("compensate-b")),
        ("c", None),
    ] {
        let up = name.to_uppercase();
        all.push(Participant {
            name,
            commands: commands.into(),
            replies: replies.into(),
            command: format!("Do{up}"),
            ok: format!("{up}Done"),
            fail: Some(format!("{up}Failed")),
        });
        if let Some(undo) = undo {
            all.push(Participant {
                name: undo,
                commands: commands.into(),
                replies: replies.into(),
                command: format!("Undo{up}"),
                ok: format!("{up}Undone"),
                fail: None,
            });
        }
    }
    all
}

struct World {
    db: TestDb,
    kafka: TestKafka,
    commands: String,
    replies: String,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl World {
    async fn new(name: &str) -> Self {
        let db = TestDb::with(
            name,
            &[
                saga_consumer::migrate::migrator(),
                saga_orchestrator::migrate::migrator(),
            ],
        )
        .await;
        sqlx::query("CREATE TABLE effects (seq BIGSERIAL PRIMARY KEY, kind TEXT NOT NULL, step_key TEXT NOT NULL)")
            .execute(&db.pool)
            .await
            .unwrap();
        let kafka = TestKafka::new().await;
        let commands = kafka.topic(&format!("{name}-commands"), 2).await;
        let replies = kafka.topic(&format!("{name}-replies"), 2).await;
        for group in ["participants", "orchestrator", "orchestrator-b"] {
            kafka
                .create_topic(&format!("{commands}.{group}.dlq"), 1)
                .await;
            kafka
                .create_topic(&format!("{commands}.{group}.retry"), 1)
                .await;
        }
        Self {
            db,
            kafka,
            commands,
            replies,
            stop: CancellationToken::new(),
            tasks: Vec::new(),
        }
    }

    /// An orchestrator of the test saga on this world's topics.
    fn orchestrator(&self, timeout: Duration, on_timeout: OnTimeout) -> Orchestrator<Value> {
        Orchestrator::new(definition(
            &self.commands,
            &self.replies,
            timeout,
            on_timeout,
        ))
        .unwrap()
    }

    /// A world with its relay, its participants and one orchestrator running; a step without a reply
    /// within `timeout` fails.
    async fn running(name: &str, timeout: Duration) -> (Self, Orchestrator<Value>) {
        let mut w = Self::new(name).await;
        let o = w.orchestrator(timeout, OnTimeout::Fail);
        w.start_relay();
        w.start_participants();
        w.start_orchestrator(&o, "orchestrator", w.stop.clone());
        (w, o)
    }

    fn consumer(&self, group: &str) -> SagaConsumerBuilder {
        SagaConsumer::builder()
            .brokers(self.kafka.brokers.clone())
            .group_id(format!("{}.{group}", self.commands))
            .dlq_topic(format!("{}.{group}.dlq", self.commands))
            .pool(self.db.pool.clone())
            .commit_interval(Duration::from_millis(200))
            .session_timeout(Duration::from_secs(6))
    }

    fn spawn(&mut self, fut: impl std::future::Future<Output = ()> + Send + 'static) {
        self.tasks.push(tokio::spawn(fut));
    }

    /// The relay publishing the schema's outbox.
    fn start_relay(&mut self) {
        let relay = Relay::builder()
            .brokers(self.kafka.brokers.clone())
            .pool(self.db.pool.clone())
            .poll_interval(Duration::from_millis(200))
            .build()
            .unwrap();
        let stop = self.stop.clone().cancelled_owned();
        self.spawn(async move {
            relay.run(stop).await.unwrap();
        });
    }

    fn start_participants(&mut self) {
        let mut builder = self.consumer("participants");
        for p in participants(&self.commands, &self.replies) {
            builder = builder.step(p);
        }
        let consumer = builder.build().unwrap();
        let stop = self.stop.clone().cancelled_owned();
        self.spawn(async move {
            consumer.run(stop).await.unwrap();
        });
    }

    /// An orchestrator instance: its reply consumer and its timers, until `stop`.
    fn start_orchestrator(
        &mut self,
        orchestrator: &Orchestrator<Value>,
        group: &str,
        stop: CancellationToken,
    ) {
        let consumer = orchestrator.register(self.consumer(group)).build().unwrap();
        let (o, pool, s) = (orchestrator.clone(), self.db.pool.clone(), stop.clone());
        self.spawn(async move {
            o.run_timers(pool, Duration::from_millis(100), s.cancelled_owned())
                .await;
        });
        self.spawn(async move {
            consumer.run(stop.cancelled_owned()).await.unwrap();
        });
    }

    async fn start_saga(
        &self,
        orchestrator: &Orchestrator<Value>,
        key: &str,
        input: Value,
    ) -> uuid::Uuid {
        let lineage = Lineage::root(IdempotencyKey::new(key).unwrap(), TenantId::default());
        let mut tx = self.db.pool.begin().await.unwrap();
        let started = orchestrator
            .start(&mut tx, &lineage, json!({ "input": input }))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert!(started.created);
        started.saga_id
    }

    async fn wait_status(&self, saga: uuid::Uuid, status: SagaStatus) {
        wait_until(&format!("saga {saga} {status:?}"), WAIT, || async {
            let instance = saga_orchestrator::store::load(&self.db.pool, saga)
                .await
                .ok()??;
            (instance.status == status.as_str()).then_some(())
        })
        .await;
    }

    async fn effects(&self) -> Vec<String> {
        sqlx::query_scalar("SELECT kind FROM effects ORDER BY seq")
            .fetch_all(&self.db.pool)
            .await
            .unwrap()
    }

    async fn stop(self) {
        self.stop.cancel();
        for task in self.tasks {
            tokio::time::timeout(WAIT, task).await.unwrap().unwrap();
        }
    }
}

async fn commands_sent(pool: &PgPool, event_type: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM saga_outbox WHERE headers[array_position(headers, 'ce_type') + 1] = $1",
    )
    .bind(event_type)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn happy_path_runs_every_step_once_and_completes() {
    let (w, o) = World::running("orch-happy", Duration::from_secs(30)).await;
    let saga = w.start_saga(&o, "order-1", json!({})).await;
    w.wait_status(saga, SagaStatus::Completed).await;
    assert_eq!(w.effects().await, vec!["a", "b", "c"]);
    let instance = saga_orchestrator::store::load(&w.db.pool, saga)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        instance.step_keys,
        json!({"a": "order-1:a", "b": "order-1:b", "c": "order-1:c"})
    );
    assert_eq!(
        instance.data["b"]["by"], "b",
        "replies are kept for later commands"
    );
    let history = saga_orchestrator::store::history(&w.db.pool, saga)
        .await
        .unwrap();
    let causes: Vec<&str> = history.iter().map(|t| t.cause.as_str()).collect();
    assert_eq!(causes, vec!["started", "ADone", "BDone", "CDone"]);
    assert_eq!(history.last().unwrap().to_status, "completed");
    commands_name_their_reply_topic(&w.db.pool, &w.replies, saga, 3).await;
    w.stop().await;
}

/// Every command the orchestrator wrote (`n` of them) names its reply topic and its saga.
async fn commands_name_their_reply_topic(pool: &PgPool, replies: &str, saga: uuid::Uuid, n: i64) {
    let named: (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE saga_header(headers, 'saga-reply-to') = $1 \
                                   AND saga_header(headers, 'saga-id') = $2), count(*) \
         FROM saga_outbox WHERE headers[array_position(headers, 'ce_type') + 1] LIKE 'Do%'",
    )
    .bind(replies)
    .bind(saga.to_string())
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        named,
        (n, n),
        "commands naming their reply topic and saga, of all"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failure_at_each_step_compensates_exactly_the_completed_steps_in_reverse() {
    let (w, o) = World::running("orch-fail", Duration::from_secs(30)).await;
    let expected: [(&str, &[&str]); 3] = [
        ("a", &["failed-a"]),
        ("b", &["a", "failed-b", "compensate-a"]),
        ("c", &["a", "b", "failed-c", "compensate-b", "compensate-a"]),
    ];
    for (fail_at, effects) in expected {
        sqlx::query("TRUNCATE effects")
            .execute(&w.db.pool)
            .await
            .unwrap();
        let saga = w
            .start_saga(
                &o,
                &format!("order-fail-{fail_at}"),
                json!({ "fail_at": fail_at }),
            )
            .await;
        w.wait_status(saga, SagaStatus::Compensated).await;
        assert_eq!(w.effects().await, effects, "failing at {fail_at}");
        let keys: Vec<String> = sqlx::query_scalar(
            "SELECT step_key FROM effects WHERE kind LIKE 'compensate-%' ORDER BY seq",
        )
        .fetch_all(&w.db.pool)
        .await
        .unwrap();
        for key in keys {
            assert!(
                key.starts_with(&format!("order-fail-{fail_at}:compensate-")),
                "{key}"
            );
        }
    }
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_orchestrator_stopped_between_transitions_resumes_and_resends_with_the_same_keys() {
    let mut w = World::new("orch-resume").await;
    // Nobody answers at first: step a's command is re-sent on its deadline, with the same key.
    let o = w.orchestrator(
        Duration::from_millis(800),
        OnTimeout::Retry { attempts: 20 },
    );
    w.start_relay();
    let first = CancellationToken::new();
    w.start_orchestrator(&o, "orchestrator", first.clone());
    let saga = w.start_saga(&o, "order-resume", json!({})).await;
    wait_until("step a re-sent", WAIT, || async {
        (commands_sent(&w.db.pool, "DoA").await >= 2).then_some(())
    })
    .await;
    // The orchestrator stops between two transitions; another one takes over from the stored state.
    first.cancel();
    let instance = saga_orchestrator::store::load(&w.db.pool, saga)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (instance.status.as_str(), instance.step_index),
        ("running", 0)
    );
    let second = w.orchestrator(
        Duration::from_millis(800),
        OnTimeout::Retry { attempts: 20 },
    );
    w.start_orchestrator(&second, "orchestrator", w.stop.clone());
    wait_until(
        "step a re-sent by the second orchestrator",
        WAIT,
        || async {
            let again = saga_orchestrator::store::load(&w.db.pool, saga)
                .await
                .ok()??;
            (again.attempt > instance.attempt).then_some(())
        },
    )
    .await;
    // Now the participants come: every copy of the command carries the same key, one effect.
    w.start_participants();
    w.wait_status(saga, SagaStatus::Completed).await;
    assert!(commands_sent(&w.db.pool, "DoA").await >= 3);
    assert_eq!(
        w.effects().await,
        vec!["a", "b", "c"],
        "one effect per step despite the re-sends"
    );
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_orchestrator_instances_racing_on_one_saga_leave_one_transition() {
    let w = World::new("orch-race").await;
    let o = w.orchestrator(Duration::from_secs(30), OnTimeout::Fail);
    let saga = w.start_saga(&o, "order-race", json!({})).await;
    let reply = saga_core::EventMetadata::from_headers(
        &saga_core::Headers::new()
            .with("idempotency-key", "order-race")
            .with("ce_type", "ADone"),
    )
    .unwrap();
    let payload = json!({ "by": "a" }).to_string().into_bytes();
    // Both instances got the reply (say, a redelivery during a rebalance) and handle it at the same moment.
    let mut first = w.db.pool.begin().await.unwrap();
    let mut second = w.db.pool.begin().await.unwrap();
    assert!(o.on_reply(&mut first, &reply, &payload).await.unwrap());
    let racing = {
        let (o, reply, payload) = (o.clone(), reply.clone(), payload.clone());
        tokio::spawn(async move {
            let result = o.on_reply(&mut second, &reply, &payload).await;
            (result, second)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.commit().await.unwrap();
    let (result, second) = racing.await.unwrap();
    assert!(
        matches!(result, Err(OrchestratorError::VersionConflict { .. })),
        "the second transition conflicts: {result:?}"
    );
    drop(second);
    // It retries in a fresh transaction, sees the new state, and the reply is stale there.
    let mut retry = w.db.pool.begin().await.unwrap();
    assert!(!o.on_reply(&mut retry, &reply, &payload).await.unwrap());
    retry.commit().await.unwrap();
    let history = saga_orchestrator::store::history(&w.db.pool, saga)
        .await
        .unwrap();
    let causes: Vec<&str> = history.iter().map(|t| t.cause.as_str()).collect();
    assert_eq!(causes, vec!["started", "ADone"], "one transition");
    assert_eq!(
        commands_sent(&w.db.pool, "DoB").await,
        1,
        "one command for step b"
    );
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_timed_out_step_compensates() {
    let (w, o) = World::running("orch-timeout", Duration::from_secs(2)).await;
    // b never answers: its deadline fails it; b is compensated too (its effect may have happened), then a.
    let saga = w
        .start_saga(&o, "order-timeout", json!({ "silent": "b" }))
        .await;
    w.wait_status(saga, SagaStatus::Compensated).await;
    assert_eq!(w.effects().await, vec!["a", "compensate-b", "compensate-a"]);
    let instance = saga_orchestrator::store::load(&w.db.pool, saga)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(instance.failure.as_deref(), Some("b timed out"));
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_started_on_version_1_finish_on_it_after_version_2_is_deployed() {
    let mut w = World::new("orch-versions").await;
    let definition = |version: u32| {
        definition(
            &w.commands,
            &w.replies,
            Duration::from_secs(60),
            OnTimeout::Fail,
        )
        .version(version)
    };
    // Version 1 has the steps a and b; version 2 adds c.
    let mut v1 = definition(1);
    v1.steps.truncate(2);
    let v2 = definition(2);
    w.start_relay();

    // Version 1 runs and starts a saga; its participants are not up yet, so it is still at step a when
    // version 1's orchestrator stops for the deploy.
    let old = Orchestrator::new(v1.clone()).unwrap();
    let old_stop = CancellationToken::new();
    w.start_orchestrator(&old, "orchestrator", old_stop.clone());
    let first = w.start_saga(&old, "v1-order", json!({})).await;
    old_stop.cancel();

    // Version 2 is deployed, keeping version 1 for the instances that started on it.
    let new = Orchestrator::new(v2).unwrap().keep_running(v1).unwrap();
    w.start_orchestrator(&new, "orchestrator", w.stop.clone());
    w.start_participants();
    let second = w.start_saga(&new, "v2-order", json!({})).await;

    w.wait_status(first, SagaStatus::Completed).await;
    w.wait_status(second, SagaStatus::Completed).await;
    let effects_of = |key: &'static str| {
        let pool = w.db.pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT kind FROM effects WHERE step_key LIKE $1 || ':%' ORDER BY seq",
            )
            .bind(key)
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(
        effects_of("v1-order").await,
        ["a", "b"],
        "finished on version 1"
    );
    assert_eq!(
        effects_of("v2-order").await,
        ["a", "b", "c"],
        "ran version 2"
    );
    for (saga, version) in [(first, 1), (second, 2)] {
        let instance = saga_orchestrator::store::load(&w.db.pool, saga)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(instance.definition_version, Some(version));
    }
    assert_eq!(
        commands_sent(&w.db.pool, "DoC").await,
        1,
        "c only for version 2"
    );
    w.stop().await;
}

#[derive(serde::Serialize, serde::Deserialize, SagaEvent)]
#[saga(crate = "saga_core")]
struct Charge {
    order: i64,
}

#[derive(serde::Serialize, serde::Deserialize, SagaEvent)]
#[saga(crate = "saga_core")]
struct Charged {
    order: i64,
}

async fn charge(msg: &Message<Charge>, ctx: &mut StepContext<'_>) -> StepResult {
    ctx.reply(&Charged {
        order: msg.payload().order,
    })?;
    Ok(StepOutcome::completed())
}

#[tokio::test]
async fn a_participant_replies_where_the_command_says_and_a_message_asking_no_reply_is_refused() {
    use saga_core::testing::{event, handle};
    let db = TestDb::new("orch-reply").await;
    let step = saga_core::step("charge", charge).on(&Topic::new("payments"));
    let command = |headers: &[(&str, &str)]| {
        let mut built = event(Charge { order: 7 }).key("order-7");
        for (name, value) in headers {
            built = built.header(name, value);
        }
        built.build()
    };

    let mut tx = db.pool.begin().await.unwrap();
    let asked = command(&[(names::REPLY_TO, "orders.replies"), (names::SAGA_ID, "s-1")]);
    let handled = handle(&step, asked, &mut tx).await;
    assert_eq!(handled.result.unwrap(), StepOutcome::completed());
    assert_eq!(handled.emitted.len(), 1);
    let reply = &handled.emitted[0];
    assert_eq!(
        (reply.topic(), reply.partition_key(), reply.event_type()),
        ("orders.replies", Some("s-1"), "Charged")
    );
    assert_eq!(
        reply.header(names::IDEMPOTENCY_KEY),
        Some("order-7"),
        "the saga's lineage"
    );
    assert_eq!(reply.payload::<Charged>().unwrap().order, 7);

    // A message that is no command: nothing to answer, the step fails for good (a dead letter saying so).
    for (headers, says) in [
        (vec![], names::REPLY_TO),
        (vec![(names::REPLY_TO, "orders/replies")], "no topic name"),
        (vec![(names::REPLY_TO, "")], "no topic name"),
    ] {
        let handled = handle(&step, command(&headers), &mut tx).await;
        let refused = handled.result.unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::Permanent, "{refused}");
        assert!(refused.to_string().contains(says), "{refused}");
        assert!(handled.emitted.is_empty());
    }
}
