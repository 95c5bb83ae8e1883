//! Failure groups and bulk repair on the real broker and PostgreSQL, through the `saga` command: letters
//! grouped by their cause, a group replayed after a preview and a confirmation (each letter sent once, the
//! operation recorded), a group discarded and the discard undone, an operation killed midway and resumed
//! without sending any letter twice, and an operation cancelled between two letters.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use saga_admin::dlq::ReplayOptions;
use saga_admin::operations;
use saga_config::KafkaConfig;
use saga_test_support::{TestDb, TestKafka, wait_until};
use serde_json::Value;

use common::Target;

const WAIT: Duration = Duration::from_secs(60);

struct Fixture {
    db: TestDb,
    kafka: TestKafka,
    saga: Target,
    topic: String,
    dlq: String,
    retry: String,
    group: String,
}

impl Fixture {
    /// A service schema whose consumer group writes `{topic}.dlq` and reads `{topic}.retry`.
    async fn new(name: &str) -> Self {
        let db = TestDb::with(
            name,
            &[
                saga_consumer::migrate::migrator(),
                saga_admin::dlq::migrator(),
            ],
        )
        .await;
        let kafka = TestKafka::new().await;
        let topic = kafka.topic(name, 1).await;
        let (dlq, retry) = (format!("{topic}.dlq"), format!("{topic}.retry"));
        kafka.create_topic(&dlq, 1).await;
        kafka.create_topic(&retry, 1).await;
        let group = format!("{topic}-group");
        sqlx::query(
            "INSERT INTO saga_consumer_groups (group_id, dlq_topic, retry_topic, topics) \
             VALUES ($1, $2, $3, ARRAY[$4])",
        )
        .bind(&group)
        .bind(&dlq)
        .bind(&retry)
        .bind(&topic)
        .execute(&db.pool)
        .await
        .unwrap();
        let saga = Target {
            database_url: TestDb::database_url(),
            schema: db.schema.clone(),
            brokers: kafka.brokers.clone(),
        };
        Self {
            db,
            kafka,
            saga,
            topic,
            dlq,
            retry,
            group,
        }
    }

    /// Dead letters of the fixture's group, one per `(key, step, error)`, written as the consumer writes
    /// them.
    async fn letters(&self, letters: &[(String, &str, String)]) {
        let producer = self.kafka.producer();
        for (n, (key, step, error)) in letters.iter().enumerate() {
            let failed_at = chrono::Utc::now().to_rfc3339();
            let offset = n.to_string();
            self.kafka
                .produce(
                    &producer,
                    &self.dlq,
                    Some(key),
                    &[
                        ("idempotency-key", key),
                        ("ce_type", "Thing"),
                        ("dlq-original-topic", &self.topic),
                        ("dlq-original-partition", "0"),
                        ("dlq-original-offset", &offset),
                        ("dlq-consumer-group", &self.group),
                        ("dlq-step", step),
                        ("dlq-reason", "handler-failed"),
                        ("dlq-error", error),
                        ("dlq-attempts", "1"),
                        ("dlq-failed-at", &failed_at),
                    ],
                    format!("{{\"n\":{n}}}").as_bytes(),
                )
                .await;
        }
    }

    async fn groups(&self) -> Vec<Value> {
        self.saga
            .json(&["dlq", "groups"])
            .await
            .as_array()
            .unwrap()
            .clone()
    }

    /// The group whose cause is `cause`.
    async fn group(&self, cause: &str) -> Value {
        self.groups()
            .await
            .into_iter()
            .find(|g| g["cause"] == cause)
            .unwrap_or_else(|| panic!("no group with cause {cause}"))
    }

    /// The plan to replay the failure group of `cause`, as the command previews it.
    async fn plan_group_replay(&self, cause: &str) -> operations::Plan {
        let id = self.group(cause).await["id"].as_str().unwrap().to_owned();
        operations::plan_replay(
            &self.kafka_config(),
            &self.db.pool,
            std::slice::from_ref(&self.dlq),
            &id,
            &ReplayOptions::default(),
        )
        .await
        .unwrap()
    }

    /// The messages of the retry topic, by the letter their replay came from.
    async fn sent_by_letter(&self) -> BTreeMap<String, usize> {
        let mut sent = BTreeMap::new();
        for record in saga_admin::dlq::read_topic(&self.kafka_config(), &self.retry)
            .await
            .unwrap()
        {
            let letter = record
                .header("saga-replay-letter")
                .expect("a replay names its letter")
                .to_owned();
            *sent.entry(letter).or_default() += 1;
        }
        sent
    }

    async fn sent(&self) -> i64 {
        self.kafka.end_offsets(&self.retry).await.values().sum()
    }

    fn kafka_config(&self) -> KafkaConfig {
        KafkaConfig::new(self.kafka.brokers.clone())
    }
}

fn many(
    prefix: &str,
    n: usize,
    step: &'static str,
    error: impl Fn(usize) -> String,
) -> Vec<(String, &'static str, String)> {
    (0..n)
        .map(|i| (format!("{prefix}-{i}"), step, error(i)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn letters_are_grouped_by_cause_and_a_group_replay_shows_asks_and_sends_each_letter_once() {
    let f = Fixture::new("ops-groups").await;
    let mut letters = many("missing", 3, "record", |i| {
        format!("order {} not found", [17, 4711, 5][i])
    });
    letters.extend(many("declined", 2, "charge", |i| {
        format!(
            "card declined (charge {})\nDETAIL: gateway said no",
            [
                "0d9f1c2e-44aa-4b0e-9c1d-2f3a4b5c6d7e",
                "7c1e2d3f-0000-4000-8000-000000000001"
            ][i]
        )
    }));
    letters.extend(many("other", 1, "record", |_| "disk full".to_owned()));
    f.letters(&letters).await;

    // Three groups: by step and cause, numbers and ids normalised, the largest first.
    let groups = f.groups().await;
    let summary: Vec<(String, u64, u64)> = groups
        .iter()
        .map(|g| {
            (
                g["cause"].as_str().unwrap().to_owned(),
                g["open"].as_u64().unwrap(),
                g["total"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("order <n> not found".to_owned(), 3, 3),
            ("card declined (charge <uuid>)".to_owned(), 2, 2),
            ("disk full".to_owned(), 1, 1),
        ]
    );
    let missing = f.group("order <n> not found").await;
    let id = missing["id"].as_str().unwrap().to_owned();
    let listed = f.saga.json(&["dlq", "list", "--group", &id]).await;
    assert_eq!(listed.as_array().unwrap().len(), 3, "{listed}");

    // Without a terminal to ask on, and without --yes: refused in one line, nothing sent.
    let output = f.saga.run(&["dlq", "replay", "--group", &id]).await;
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("replay 3 dead letter(s)") && stderr.contains("--yes"),
        "{stderr}"
    );
    // The preview.
    let plan = f
        .saga
        .json(&["dlq", "replay", "--group", &id, "--dry-run"])
        .await;
    assert_eq!(plan["letters"].as_array().unwrap().len(), 3);
    assert_eq!(plan["retry_topic"], f.retry.as_str());
    assert_eq!(f.sent().await, 0, "nothing sent by asking or previewing");

    // Confirmed: a recorded operation, each letter sent once.
    let done = f
        .saga
        .json(&[
            "dlq",
            "replay",
            "--group",
            &id,
            "--yes",
            "--operator",
            "alice",
            "--reason",
            "order service redeployed",
        ])
        .await;
    assert_eq!(
        (
            &done["status"],
            &done["done"],
            &done["operator"],
            &done["kind"]
        ),
        (
            &Value::from("done"),
            &Value::from(3),
            &Value::from("alice"),
            &Value::from("replay")
        ),
        "{done}"
    );
    let sent = f.sent_by_letter().await;
    assert_eq!((sent.len(), sent.values().max()), (3, Some(&1)), "{sent:?}");
    // The audit log: who, why, what, how it ended.
    let log = f.saga.json(&["audit"]).await;
    assert_eq!(log.as_array().unwrap().len(), 1, "{log}");
    assert_eq!(
        (
            &log[0]["action"],
            &log[0]["operator"],
            &log[0]["reason"],
            &log[0]["outcome"]
        ),
        (
            &Value::from("dlq replay --group"),
            &Value::from("alice"),
            &Value::from("order service redeployed"),
            &Value::from("done")
        )
    );
    assert_eq!(log[0]["target"]["group"], id.as_str());
    assert_eq!(log[0]["target"]["letters"], "3");
    let missing = f.group("order <n> not found").await;
    assert_eq!(
        (&missing["open"], &missing["total"]),
        (&Value::from(0), &Value::from(3))
    );
    assert_eq!(
        f.group("disk full").await["open"],
        1,
        "other groups untouched"
    );

    // The operation, listed and shown; a second replay finds nothing open.
    let listed = f.saga.json(&["dlq", "operations"]).await;
    assert_eq!(listed.as_array().unwrap().len(), 1);
    assert_eq!(listed[0]["selection"]["failure_group"], id.as_str());
    let shown = f
        .saga
        .json(&["dlq", "operations", "show", &done["id"].to_string()])
        .await;
    let outcomes: Vec<&str> = shown["letters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["done", "done", "done"]);
    let again = f
        .saga
        .text(&["dlq", "replay", "--group", &id, "--yes"])
        .await;
    assert!(again.contains("nothing to do"), "{again}");
    assert_eq!(f.sent().await, 3);
    assert_eq!(
        f.saga
            .json(&["dlq", "operations"])
            .await
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_discarded_group_is_closed_without_sending_and_an_undo_opens_it_again() {
    let f = Fixture::new("ops-discard").await;
    f.letters(&many("declined", 2, "charge", |i| {
        format!("card {i} declined")
    }))
    .await;
    let id = f.group("card <n> declined").await["id"]
        .as_str()
        .unwrap()
        .to_owned();

    let discarded = f
        .saga
        .json(&[
            "dlq",
            "discard",
            "--group",
            &id,
            "--yes",
            "--operator",
            "carol",
        ])
        .await;
    assert_eq!(
        (&discarded["kind"], &discarded["done"]),
        (&Value::from("discard"), &Value::from(2))
    );
    assert_eq!(f.group("card <n> declined").await["open"], 0, "closed");
    assert_eq!(f.sent().await, 0, "nothing sent");
    let states: Vec<String> = f
        .saga
        .json(&["dlq", "list", "--group", &id])
        .await
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["state"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(states, ["discarded", "discarded"]);
    let by: Vec<String> = sqlx::query_scalar("SELECT discarded_by FROM saga_dlq_discards")
        .fetch_all(&f.db.pool)
        .await
        .unwrap();
    assert_eq!(by, ["carol", "carol"]);

    // A replay of a closed group has nothing to send.
    let replay = f
        .saga
        .text(&["dlq", "replay", "--group", &id, "--yes"])
        .await;
    assert!(replay.contains("nothing to do"), "{replay}");

    // Undone: open again, and replayable.
    let undo = f
        .saga
        .json(&[
            "dlq",
            "discard",
            "--undo",
            &discarded["id"].to_string(),
            "--yes",
        ])
        .await;
    assert_eq!(
        (&undo["kind"], &undo["done"]),
        (&Value::from("undo-discard"), &Value::from(2))
    );
    assert_eq!(f.group("card <n> declined").await["open"], 2);
    let replayed = f
        .saga
        .json(&["dlq", "replay", "--group", &id, "--yes"])
        .await;
    assert_eq!(replayed["done"], 2);
    assert_eq!(f.sent().await, 2);
    // Only a discard can be undone.
    let output = f
        .saga
        .run(&[
            "dlq",
            "discard",
            "--undo",
            &replayed["id"].to_string(),
            "--yes",
        ])
        .await;
    assert_eq!(output.status.code(), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_discard_reads_only_the_letters_identities_never_their_records() {
    let f = Fixture::new("ops-discard-ids").await;
    // More letters than one batch of a run.
    let total = 150;
    f.letters(&many("d", total, "charge", |i| format!("card {i} expired")))
        .await;
    let id = f.group("card <n> expired").await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let plan = operations::plan_discard(
        &f.kafka_config(),
        &f.db.pool,
        std::slice::from_ref(&f.dlq),
        &id,
    )
    .await
    .unwrap();
    let operation = operations::start(&f.db.pool, &plan, "heidi").await.unwrap();
    // Run where no broker answers: a discard needs the letters' identities, which the index holds, and
    // no record of theirs (a bulk discard of large letters must not load them).
    let nowhere = KafkaConfig::new("127.0.0.1:1");
    let done = operations::run(&nowhere, &f.db.pool, operation, &ReplayOptions::default())
        .await
        .unwrap();
    assert_eq!((done.status.as_str(), done.done), ("done", total as i32));
    let discarded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM saga_dlq_discards WHERE operation_id = $1 AND undone_at IS NULL",
    )
    .bind(operation)
    .fetch_one(&f.db.pool)
    .await
    .unwrap();
    assert_eq!(discarded, total as i64);
    assert_eq!(f.group("card <n> expired").await["open"], 0, "closed");
    assert_eq!(f.sent().await, 0, "nothing sent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_group_replay_killed_midway_is_resumed_without_sending_any_letter_twice() {
    let f = Fixture::new("ops-resume").await;
    let total = 150;
    f.letters(&many("k", total, "record", |i| {
        format!("order {i} not found")
    }))
    .await;
    let plan = f.plan_group_replay("order <n> not found").await;
    let operation = operations::start(&f.db.pool, &plan, "dave").await.unwrap();

    // A run, killed once it has sent a few letters.
    let mut run = f
        .saga
        .command(&[
            "dlq",
            "operations",
            "resume",
            &operation.to_string(),
            "--operator",
            "ivan",
        ])
        .spawn()
        .unwrap();
    let done = || async {
        let (o, _) = operations::get(&f.db.pool, operation).await.unwrap();
        o.done
    };
    wait_until("the run to send some letters", WAIT, || async {
        (done().await >= 10).then_some(())
    })
    .await;
    run.start_kill().unwrap();
    run.wait().await.unwrap();
    let (killed, letters) = operations::get(&f.db.pool, operation).await.unwrap();
    assert_eq!(
        killed.status, "running",
        "a killed run leaves its operation running"
    );
    assert!(killed.done < total as i32, "killed midway: {}", killed.done);

    // As if the run had died right after the broker acknowledged a letter, before recording it: the
    // message is in the retry topic, its letter is still pending. (The last pending letter: the first may
    // be the one the killed run was sending.)
    let pending = letters.iter().rev().find(|l| l.outcome.is_none()).unwrap();
    let identity =
        saga_admin::groups::letters(&f.kafka_config(), &f.db.pool, std::slice::from_ref(&f.dlq))
            .await
            .unwrap()
            .into_iter()
            .find(|l| l.letter.offset == pending.offset)
            .unwrap()
            .letter
            .identity();
    let producer = f.kafka.producer();
    let operation_text = operation.to_string();
    f.kafka
        .produce(
            &producer,
            &f.retry,
            Some("k"),
            &[
                ("saga-replay-letter", identity.as_str()),
                ("saga-replay-operation", operation_text.as_str()),
            ],
            b"{}",
        )
        .await;

    // Resumed: every letter in the retry topic exactly once.
    let resumed = f
        .saga
        .json(&[
            "dlq",
            "operations",
            "resume",
            &operation.to_string(),
            "--operator",
            "frank",
        ])
        .await;
    assert_eq!(
        (&resumed["status"], &resumed["done"]),
        (&Value::from("done"), &Value::from(total)),
        "{resumed}"
    );
    // Each run's sends are recorded under whoever ran it, not under the operation's starter.
    assert_eq!(resumed["operator"], "dave");
    assert_eq!(resumed["run_by"], serde_json::json!(["ivan", "frank"]));
    let senders: Vec<(String, i64)> = sqlx::query_as(
        "SELECT operator, count(*) FROM saga_dlq_replay_log GROUP BY operator ORDER BY operator",
    )
    .fetch_all(&f.db.pool)
    .await
    .unwrap();
    assert_eq!(
        senders.iter().map(|(o, _)| o.as_str()).collect::<Vec<_>>(),
        ["frank", "ivan"],
        "{senders:?}"
    );
    assert_eq!(senders.iter().map(|(_, n)| n).sum::<i64>(), total as i64);
    let sent = f.sent_by_letter().await;
    assert_eq!(sent.len(), total, "every letter sent");
    let twice: Vec<_> = sent.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "letters sent twice: {twice:?}");
    assert_eq!(f.group("order <n> not found").await["open"], 0);
    // Resuming an operation that ended is refused.
    let output = f
        .saga
        .run(&["dlq", "operations", "resume", &operation.to_string()])
        .await;
    assert_eq!(output.status.code(), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancelled_operation_stops_between_two_letters() {
    let f = Fixture::new("ops-cancel").await;
    let total = 150;
    f.letters(&many("k", total, "record", |i| {
        format!("order {i} not found")
    }))
    .await;
    let plan = f.plan_group_replay("order <n> not found").await;

    // Cancelled before any run: ended at once, nothing sent.
    let idle = operations::start(&f.db.pool, &plan, "erin").await.unwrap();
    let cancelled = f
        .saga
        .json(&["dlq", "operations", "cancel", &idle.to_string()])
        .await;
    assert_eq!(cancelled["status"], "cancelled");
    let output = f
        .saga
        .run(&["dlq", "operations", "resume", &idle.to_string()])
        .await;
    assert_eq!(
        output.status.code(),
        Some(2),
        "an ended operation is not run"
    );

    // Cancelled while it runs: it stops before its next letter.
    let operation = operations::start(&f.db.pool, &plan, "erin").await.unwrap();
    let mut child = f
        .saga
        .command(&["dlq", "operations", "resume", &operation.to_string()])
        .spawn()
        .unwrap();
    let run = tokio::spawn(async move { child.wait().await });
    wait_until("the run to send some letters", WAIT, || async {
        let (o, _) = operations::get(&f.db.pool, operation).await.unwrap();
        (o.done >= 5).then_some(())
    })
    .await;
    let line = f
        .saga
        .text(&[
            "dlq",
            "operations",
            "cancel",
            &operation.to_string(),
            "--operator",
            "grace",
        ])
        .await;
    assert!(line.contains("cancelled by grace"), "{line}");
    let status = run.await.unwrap().unwrap();
    assert!(status.success(), "{status:?}");
    let (o, _) = operations::get(&f.db.pool, operation).await.unwrap();
    assert_eq!(o.status, "cancelled");
    assert_eq!(
        o.cancelled_by.as_deref(),
        Some("grace"),
        "who cancelled is recorded"
    );
    assert!(o.done < total as i32, "stopped early: {}", o.done);
    assert_eq!(
        f.sent().await,
        i64::from(o.done),
        "what it sent is what it recorded"
    );
}

/// A run sends only to the retry topic its preview showed: the group given another one meanwhile, the run
/// stops before sending anything, and the operation says why until a run goes on with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_sends_only_where_its_preview_said_and_a_stopped_run_says_why() {
    let f = Fixture::new("ops-pinned-topic").await;
    f.letters(&many("declined", 2, "charge", |i| {
        format!("card {i} declined")
    }))
    .await;
    let plan = f.plan_group_replay("card <n> declined").await;
    let id = operations::start(&f.db.pool, &plan, "dave").await.unwrap();
    let elsewhere = format!("{}.elsewhere", f.topic);
    f.kafka.create_topic(&elsewhere, 1).await;
    let retarget = |topic: String| {
        let pool = f.db.pool.clone();
        async move {
            sqlx::query("UPDATE saga_consumer_groups SET retry_topic = $1")
                .bind(topic)
                .execute(&pool)
                .await
                .unwrap();
        }
    };
    retarget(elsewhere.clone()).await;
    let stopped = operations::run(&f.kafka_config(), &f.db.pool, id, &ReplayOptions::default())
        .await
        .unwrap_err();
    assert!(
        stopped.to_string().contains("changed since the preview"),
        "{stopped}"
    );
    assert_eq!(f.sent().await, 0);
    assert_eq!(
        f.kafka.end_offsets(&elsewhere).await.values().sum::<i64>(),
        0,
        "nothing sent where the preview did not say"
    );
    let shown = f
        .saga
        .json(&["dlq", "operations", "show", &id.to_string()])
        .await;
    assert_eq!(shown["operation"]["status"], "running");
    assert!(
        shown["operation"]["stopped"]
            .as_str()
            .is_some_and(|s| s.contains("changed since the preview")),
        "{shown}"
    );
    let text = f
        .saga
        .text(&["dlq", "operations", "show", &id.to_string()])
        .await;
    assert!(
        text.contains("its last run stopped before its end"),
        "{text}"
    );

    // The group's retry topic put back: resumed, the letters go where the preview said; the stop is cleared.
    retarget(f.retry.clone()).await;
    let done = f
        .saga
        .json(&["dlq", "operations", "resume", &id.to_string()])
        .await;
    assert_eq!(
        (&done["status"], &done["stopped"]),
        (&Value::from("done"), &Value::Null),
        "{done}"
    );
    assert_eq!(f.sent().await, 2);
}
