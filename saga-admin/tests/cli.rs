//! The `saga` command on bad input: one clear line and exit code 2, never a panic. And the listings of an
//! orchestrated schema (`sagas list`, `sagas show`) with their filters.

mod common;

use saga_test_support::{TestDb, TestKafka, expect_usage_error};

use common::Target;

async fn target(name: &str) -> (TestDb, TestKafka, Target) {
    // A service's schema: its consumer ran there (the dead-letter index is the consumer's).
    let db = TestDb::with(
        name,
        &[
            saga_consumer::migrate::migrator(),
            saga_orchestrator::migrate::migrator(),
        ],
    )
    .await;
    let kafka = TestKafka::new().await;
    let target = Target {
        database_url: TestDb::database_url(),
        schema: db.schema.clone(),
        brokers: kafka.brokers.clone(),
    };
    (db, kafka, target)
}

#[tokio::test]
async fn bad_input_gets_one_line_and_exit_code_2() {
    let (db, kafka, saga) = target("admin-cli-bad").await;
    let producer = kafka.producer();

    // The inspector's token on the command line (where `ps` shows it): refused, not shown back.
    let line = expect_usage_error(
        saga.command(&["inspect", "--admin-token=hunter2-hunter2-hunter2"]),
        "SAGA_ADMIN_TOKENS",
    )
    .await;
    assert!(!line.contains("hunter2"), "{line}");

    // An unknown topic.
    let line = expect_usage_error(
        saga.command(&["dlq", "list", "--topic", "no-such-topic-of-admin-cli.dlq"]),
        "no-such-topic-of-admin-cli",
    )
    .await;
    assert!(line.contains("does not exist"), "{line}");

    // A topic that is not a dead-letter topic, a business topic or the broker's own: refused before it is
    // read, nothing of it indexed.
    let plain = kafka.topic("admin-plain", 1).await;
    kafka
        .produce(&producer, &plain, Some("k"), &[("event-type", "X")], b"{}")
        .await;
    for topic in [plain.as_str(), "__consumer_offsets"] {
        let line =
            expect_usage_error(saga.command(&["dlq", "list", "--topic", topic]), topic).await;
        assert!(line.contains("is not a dead-letter topic"), "{line}");
    }
    let indexed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM saga_dead_letter_scans WHERE dlq_topic = ANY($1)")
            .bind([plain.clone(), "__consumer_offsets".to_owned()])
            .fetch_one(&db.pool)
            .await
            .unwrap_or(0);
    assert_eq!(indexed, 0, "nothing was read");

    // A dead letter with a malformed header, and one with a missing header.
    let malformed = common::dlq_topic(&kafka, "admin-malformed", 1).await;
    let now = chrono::Utc::now().to_rfc3339();
    kafka
        .produce(
            &producer,
            &malformed,
            Some("k"),
            &[
                ("dlq-original-topic", "orders"),
                ("dlq-original-partition", "first"),
                ("dlq-original-offset", "7"),
                ("dlq-reason", "handler-failed"),
                ("dlq-attempts", "1"),
                ("dlq-failed-at", &now),
            ],
            b"{}",
        )
        .await;
    // Listed as unreadable (with what is wrong), never failing the topic.
    let listed = saga.text(&["dlq", "list", "--topic", &malformed]).await;
    assert!(listed.contains("unreadable"), "{listed}");
    assert!(listed.contains("dlq-original-partition"), "{listed}");
    assert!(listed.contains("1 dead letters"), "{listed}");
    // More letters written by hand, each with a group and a step of its own and another problem: still
    // the topic's one unreadable group, its labels not the hand's.
    for (n, made_up) in ["first", "second", "third"].iter().enumerate() {
        let group = format!("made-up-group-{n}");
        kafka
            .produce(
                &producer,
                &malformed,
                Some("k"),
                &[
                    ("dlq-original-topic", "orders"),
                    ("dlq-original-partition", made_up),
                    ("dlq-consumer-group", &group),
                    ("dlq-step", &group),
                    ("dlq-failed-at", &now),
                ],
                b"{}",
            )
            .await;
    }
    let groups = saga.json(&["dlq", "groups", "--topic", &malformed]).await;
    let groups: Vec<(&str, &str, u64)> = groups
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["reason"].as_str().unwrap(),
                g["dlq_topic"].as_str().unwrap(),
                g["open"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(groups, [("unreadable", malformed.as_str(), 4)]);
    let missing = common::dlq_topic(&kafka, "admin-missing", 1).await;
    kafka
        .produce(
            &producer,
            &missing,
            Some("k"),
            &[("dlq-original-topic", "orders"), ("dlq-failed-at", &now)],
            b"{}",
        )
        .await;
    let listed = saga.text(&["dlq", "list", "--topic", &missing]).await;
    assert!(listed.contains("unreadable"), "{listed}");
    assert!(listed.contains("header dlq-"), "{listed}");
    assert!(listed.contains("is missing"), "{listed}");

    // No such message to show or replay.
    expect_usage_error(
        saga.command(&[
            "dlq",
            "show",
            "--topic",
            &plain,
            "--partition",
            "0",
            "--offset",
            "99",
        ]),
        "offset 99",
    )
    .await;

    // An unknown saga id, and something that is no saga id at all.
    expect_usage_error(
        saga.command(&["sagas", "show", "6f1c2a8e-0000-4000-8000-000000000000"]),
        "no saga 6f1c2a8e-0000-4000-8000-000000000000",
    )
    .await;
    expect_usage_error(
        saga.command(&["sagas", "show", "order-42"]),
        "not a saga id",
    )
    .await;
    expect_usage_error(saga.command(&["sagas", "list", "--status", "lost"]), "lost").await;

    // A bad duration.
    expect_usage_error(
        saga.command(&["dlq", "list", "--topic", &plain, "--since", "5 parsecs"]),
        "bad duration",
    )
    .await;
    expect_usage_error(
        saga.command(&["sagas", "list", "--stuck-for", "m15"]),
        "bad duration",
    )
    .await;

    // Pausing a step: not a step name; a group that does not run in this schema; no group named.
    expect_usage_error(
        saga.command(&[
            "steps", "pause", "no step", "--group", "g", "--reason", "outage",
        ]),
        "step \"no step\"",
    )
    .await;
    expect_usage_error(
        saga.command(&[
            "steps", "pause", "charge", "--group", "g", "--reason", "outage",
        ]),
        "no consumer group \"g\" runs in this schema",
    )
    .await;
    expect_usage_error(
        saga.command(&["steps", "pause", "charge"]),
        "required arguments",
    )
    .await;

    // Settings: no database, no broker, no such schema; an unknown command.
    let mut no_db = saga.command(&["outbox", "status"]);
    no_db.env_remove("DATABASE_URL");
    expect_usage_error(no_db, "DATABASE_URL").await;
    let mut no_broker = saga.command(&["dlq", "list", "--topic", &plain]);
    no_broker.env_remove("KAFKA_BROKERS");
    expect_usage_error(no_broker, "KAFKA_BROKERS").await;
    let mut no_schema = saga.command(&["outbox", "status"]);
    no_schema.env("SAGA_SCHEMA", "no_such_schema_of_admin_cli");
    expect_usage_error(no_schema, "SAGA_SCHEMA").await;
    expect_usage_error(saga.command(&["dlq", "purge"]), "purge").await;
}

#[tokio::test]
async fn sagas_list_and_show_read_instances_and_their_timeline() {
    let (db, _kafka, saga) = target("admin-cli-sagas").await;
    let running = uuid::Uuid::new_v4();
    let done = uuid::Uuid::new_v4();
    for (id, key, status, minutes) in [
        (running, "order-1", "running", 30),
        (done, "order-2", "completed", 1),
    ] {
        sqlx::query(
            "INSERT INTO saga_instances (saga_id, saga_type, tenant_id, idempotency_key, status, step_index, \
                 data, step_keys, version, created_at, updated_at) \
             VALUES ($1, 'order-fulfillment', 'acme', $2, $3, 0, '{}', '{}', 2, \
                 now() - make_interval(mins => $4), now() - make_interval(mins => $4))",
        )
        .bind(id)
        .bind(key)
        .bind(status)
        .bind(minutes)
        .execute(&db.pool)
        .await
        .unwrap();
        for (version, from, to, cause) in [
            (1, None, "running", "started"),
            (2, Some("running"), status, "PaymentProcessed"),
        ] {
            sqlx::query(
                "INSERT INTO saga_transitions (saga_id, version, from_status, to_status, step, cause, at) \
                 VALUES ($1, $2, $3, $4, 'process-payment', $5, now() - make_interval(mins => $6) + make_interval(secs => $2))",
            )
            .bind(id)
            .bind(version)
            .bind(from)
            .bind(to)
            .bind(cause)
            .bind(minutes)
            .execute(&db.pool)
            .await
            .unwrap();
        }
    }

    let all = saga.json(&["sagas", "list"]).await;
    assert_eq!(all.as_array().unwrap().len(), 2);
    let completed = saga.json(&["sagas", "list", "--status", "completed"]).await;
    let completed = completed.as_array().unwrap();
    assert_eq!(completed.len(), 1);
    assert_eq!(completed[0]["saga_id"], done.to_string());
    let stuck = saga.json(&["sagas", "list", "--stuck-for", "10m"]).await;
    let stuck = stuck.as_array().unwrap();
    assert_eq!(
        stuck.len(),
        1,
        "only the unfinished saga unmoved for 30 minutes: {stuck:?}"
    );
    assert_eq!(stuck[0]["saga_id"], running.to_string());
    assert_eq!(
        saga.json(&["sagas", "list", "--stuck-for", "1h"])
            .await
            .as_array()
            .unwrap()
            .len(),
        0
    );

    // A saga whose timer found no move in its definition is marked stuck: `--stuck` lists it at once, with
    // the reason, beside the one unmoved for 30 minutes.
    let lost = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO saga_instances (saga_id, saga_type, tenant_id, idempotency_key, status, step_index, \
             data, step_keys, version, stuck_reason, stuck_at) \
         VALUES ($1, 'order-fulfillment', 'acme', 'order-3', 'running', 4, '{}', '{}', 1, \
             'its deadline passed at step 4 (running), and the definition has no move for it', now())",
    )
    .bind(lost)
    .execute(&db.pool)
    .await
    .unwrap();
    let stuck = saga.json(&["sagas", "list", "--stuck"]).await;
    let ids: Vec<&str> = stuck
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["saga_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [running.to_string(), lost.to_string()], "{stuck}");
    let table = saga.text(&["sagas", "list", "--stuck"]).await;
    assert!(table.contains("no move for it"), "{table}");

    let shown = saga.json(&["sagas", "show", &running.to_string()]).await;
    assert_eq!(shown["instance"]["idempotency_key"], "order-1");
    let timeline: Vec<_> = shown["timeline"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["cause"].as_str().unwrap().to_owned(),
                t["to_status"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        timeline,
        [
            ("started".to_owned(), "running".to_owned()),
            ("PaymentProcessed".to_owned(), "running".to_owned())
        ]
    );
    let text = saga.text(&["sagas", "show", &done.to_string()]).await;
    assert!(
        text.contains("timeline:") && text.contains("completed"),
        "{text}"
    );

    // A failure whose text holds line breaks stays on its line: it cannot print lines that look like the
    // command's own.
    sqlx::query(
        "UPDATE saga_instances SET status = 'compensated', \
             failure = E'card declined\\nstatus: completed\\r\\nstep keys: {}' WHERE saga_id = $1",
    )
    .bind(done)
    .execute(&db.pool)
    .await
    .unwrap();
    let text = saga.text(&["sagas", "show", &done.to_string()]).await;
    assert!(
        text.contains("failure: card declined status: completed step keys: {}\n"),
        "{text}"
    );
    assert!(!text.lines().any(|l| l.starts_with("status:")), "{text}");
}

#[tokio::test]
async fn leases_lists_two_phase_steps_and_expired_shows_only_those_whose_lease_ran_out() {
    let (db, _kafka, saga) = target("admin-cli-leases").await;
    for (key, expires, holder) in [
        (
            "order-1:process-payment",
            "now() - interval '5 minutes'",
            "payments@host-a/17",
        ),
        (
            "order-2:process-payment",
            "now() + interval '5 minutes'",
            "payments@host-b/23",
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status, lease_expires_at, lease_holder) \
             VALUES ('acme', '{key}', 'started', {expires}, '{holder}')"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
    }
    sqlx::query(
        "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status) \
         VALUES ('acme', 'order-3:process-payment', 'completed')",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    let all = saga.json(&["leases"]).await;
    let all: Vec<_> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["step_key"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(all, ["order-1:process-payment", "order-2:process-payment"]);

    let expired = saga.json(&["leases", "--expired"]).await;
    let expired = expired.as_array().unwrap();
    assert_eq!(expired.len(), 1, "{expired:?}");
    assert_eq!(expired[0]["step_key"], "order-1:process-payment");
    assert_eq!(expired[0]["lease_holder"], "payments@host-a/17");
    assert_eq!(expired[0]["lease_expired"], true);
    let table = saga.text(&["leases", "--expired"]).await;
    assert!(
        table.contains("started (lease expired)") && table.contains("payments@host-a/17"),
        "{table}"
    );
}

#[tokio::test]
async fn what_a_message_carries_is_shown_escaped_and_never_drives_the_terminal() {
    let (_db, kafka, saga) = target("admin-cli-escape").await;
    let producer = kafka.producer();
    let topic = common::dlq_topic(&kafka, "admin-escape", 1).await;
    let now = chrono::Utc::now().to_rfc3339();
    // A title change, a screen clear, an 8-bit CSI and a right-to-left override, in the key, a header,
    // the error and the payload.
    let hostile = "x\u{1b}]0;pwned\u{7}\u{1b}[2J\u{9b}31m\u{202e}y";
    let (partition, offset) = kafka
        .produce(
            &producer,
            &topic,
            Some(hostile),
            &[
                ("idempotency-key", "order-1"),
                ("x-note", hostile),
                ("dlq-original-topic", "orders"),
                ("dlq-original-partition", "0"),
                ("dlq-original-offset", "7"),
                ("dlq-consumer-group", "payments"),
                ("dlq-reason", "handler-failed"),
                ("dlq-error", hostile),
                ("dlq-attempts", "1"),
                ("dlq-failed-at", &now),
            ],
            serde_json::json!({ "note": hostile })
                .to_string()
                .as_bytes(),
        )
        .await;
    let unsafe_char = |c: char| (c.is_control() && c != '\n') || c == '\u{202e}';
    for args in [
        vec!["dlq", "list", "--topic", topic.as_str()],
        vec![
            "dlq",
            "show",
            "--topic",
            topic.as_str(),
            "--partition",
            &partition.to_string(),
            "--offset",
            &offset.to_string(),
        ],
    ] {
        for json in [false, true] {
            let mut all = if json { vec!["--json"] } else { vec![] };
            all.extend(args.iter().copied());
            let text = saga.text(&all).await;
            assert!(
                !text.chars().any(unsafe_char),
                "saga {all:?} printed a control character: {text:?}"
            );
            if json {
                // Escaped for the terminal, the same text for a parser.
                let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
                assert!(parsed.to_string().contains("pwned"));
            } else {
                assert!(text.contains("\\u{1b}]0;pwned"), "{text}");
                assert!(text.contains("\\u{202e}"), "{text}");
            }
        }
    }
}

#[tokio::test]
async fn redis_forget_deletes_the_keys_of_the_schemas_namespace_only() {
    let (db, _kafka, saga) = target("admin-cli-redis").await;
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let settings = saga_consumer::settings::FastPathArgs::new(url.as_str());
    // The namespace the schema's services use by default, and another deployment's.
    let ours = saga_consumer::fast_path::FastPath::new(settings.clone(), &db.pool)
        .await
        .unwrap();
    let theirs = saga_consumer::fast_path::FastPath::with_namespace(
        settings,
        format!("{}-elsewhere", ours.namespace()),
    )
    .unwrap();
    let tenant = saga_core::TenantId::default();
    let keys: Vec<saga_core::StepKey> = (0..3)
        .map(|n| {
            saga_core::IdempotencyKey::new(&format!("order-{n}"))
                .unwrap()
                .step_key(&saga_core::StepName::from_static("charge"))
        })
        .collect();
    let pairs: Vec<_> = keys.iter().map(|k| (&tenant, k)).collect();
    ours.mark_completed(&pairs).await;
    theirs.mark_completed(&pairs).await;

    let mut command = saga.command(&["--json", "redis", "forget"]);
    command.env("REDIS_URL", &url).env_remove("REDIS_NAMESPACE");
    let output = command.output().await.unwrap();
    assert!(output.status.success(), "{output:?}");
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["namespace"], ours.namespace());
    assert_eq!(report["deleted"], 3);
    assert_eq!(ours.completed(&pairs).await, [false, false, false]);
    assert_eq!(
        theirs.completed(&pairs).await,
        [true, true, true],
        "another namespace's keys stay"
    );
    assert_eq!(theirs.forget_namespace().await.unwrap(), 3);

    let mut no_url = saga.command(&["redis", "forget"]);
    no_url.env_remove("REDIS_URL");
    expect_usage_error(no_url, "REDIS_URL").await;
}

/// The WAL outbox's operators' commands: parked events listed (oldest first, with their reason), retried,
/// discarded (asked, recorded); a lost slot recovered with what was lost said; wrong ids and a healthy slot
/// refused in one line with exit code 2.
#[tokio::test]
async fn the_wal_outbox_commands_list_retry_discard_and_recover() {
    let (db, _kafka, saga) = target("admin-cli-wal").await;
    db.prepare_wal_outbox().await;
    sqlx::query(
        "INSERT INTO saga_outbox_wal_parked (commit_lsn, message_lsn, event_index, tenant_id, topic, \
             partition_key, payload, error, attempts, holds_key, next_attempt_at) \
         VALUES ('0/1', '0/10', 0, 'default', 'orders', 'k', '\\x7b7d', 'Broker: Topic authorization failed', 4, \
                 true, now() + interval '1 hour'), \
                ('0/2', '0/20', 0, 'default', 'orders', 'k', '\\x7b7d', \
                 'waits behind an earlier event of its key that could not be published', 0, true, \
                 now() + interval '1 hour')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let listed = saga.json(&["outbox", "parked"]).await;
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 2);
    assert!(
        listed[0]["error"]
            .as_str()
            .unwrap()
            .contains("authorization")
    );
    let text = saga.text(&["outbox", "parked"]).await;
    assert!(text.contains("2 parked events"), "{text}");

    let retried = saga
        .json(&[
            "outbox",
            "retry",
            "--id",
            &listed[0]["id"].to_string(),
            "--yes",
        ])
        .await;
    assert_eq!(retried["events"], 2, "the key's events");
    let due: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM saga_outbox_wal_parked WHERE next_attempt_at <= now()",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(due, 2);
    expect_usage_error(
        saga.command(&["outbox", "retry", "--id", "999999"]),
        "999999",
    )
    .await;
    expect_usage_error(saga.command(&["outbox", "discard", "--id", "1"]), "--yes").await;

    let head = listed[0]["id"].to_string();
    saga.json(&[
        "outbox",
        "discard",
        "--id",
        &head,
        "--yes",
        "--operator",
        "ops-1",
    ])
    .await;
    let (discarded_by,): (String,) = sqlx::query_as(
        "SELECT discarded_by FROM saga_outbox_wal_parked WHERE discarded_at IS NOT NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(discarded_by, "ops-1");
    assert_eq!(
        saga.json(&["outbox", "parked"])
            .await
            .as_array()
            .unwrap()
            .len(),
        1
    );

    // Retiring the WAL outbox with a parked event open would strand it: refused.
    let line = expect_usage_error(
        saga.command(&["outbox", "wal", "retire", "--yes"]),
        "parked events",
    )
    .await;
    assert!(line.contains("retry or discard them first"), "{line}");
    // A healthy slot: nothing to recover.
    let line = expect_usage_error(
        saga.command(&["outbox", "wal", "recover", "--yes"]),
        "nothing to recover",
    )
    .await;
    assert!(line.contains("healthy"), "{line}");
    // The slot goes: recovered, with what was lost said.
    let slot = db.wal_slot_name();
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&slot)
        .execute(&db.pool)
        .await
        .unwrap();
    let text = saga
        .text(&["outbox", "wal", "recover", "--yes", "--operator", "ops-2"])
        .await;
    assert!(
        text.contains("was gone; ops-2 made it again")
            && text.contains("may never have been published")
            && text.contains("saga outbox wal incidents --keys"),
        "{text}"
    );
    let incidents = saga.json(&["outbox", "wal", "incidents"]).await;
    assert_eq!(incidents.as_array().unwrap().len(), 1);
    assert_eq!(incidents[0]["recovered_by"], "ops-2");
    let remaining = saga.json(&["outbox", "parked"]).await;
    let remaining_id = remaining[0]["id"].to_string();
    saga.json(&["outbox", "discard", "--id", &remaining_id, "--yes"])
        .await;
    let retired = saga.json(&["outbox", "wal", "retire", "--yes"]).await;
    assert_eq!(retired["unpublished_events"], 0);
    let slots: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_replication_slots WHERE database = current_database() AND slot_name = $1",
    )
    .bind(retired["slot"].as_str().unwrap())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(slots, 0, "dropped");
    assert_eq!(db.count("saga_outbox_wal_slot").await, 0, "forgotten");
    let keys = saga
        .json(&[
            "outbox",
            "wal",
            "incidents",
            "--keys",
            &incidents[0]["incident"].to_string(),
        ])
        .await;
    assert!(keys.as_array().unwrap().is_empty());
}

/// Every state-changing action leaves an entry in the audit log (who, why, through what, what it touched,
/// how it ended), a refused one too; `saga audit` reads it newest first and filters it. `saga outbox retry`
/// asks first, takes an operator and a reason, and retries a parked row of the table outbox by its id.
#[tokio::test]
async fn actions_are_audited_and_the_table_outbox_retries_a_parked_row_by_id() {
    let (db, _kafka, saga) = target("admin-cli-audit").await;
    let park = |key: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "INSERT INTO saga_outbox (tenant_id, topic, partition_key, headers, payload, attempts, \
                     last_error, parked_at) \
                 VALUES ('default', 'orders', $1, '{}', '\\x7b7d', 5, 'Broker: Message size too large', now()) \
                 RETURNING id",
            )
            .bind(key)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let (first, other) = (park("k-1").await, park("k-2").await);
    let listed = saga.json(&["outbox", "parked"]).await;
    let table_rows: Vec<i64> = listed
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["outbox"] == "table")
        .map(|p| p["id"].as_i64().unwrap())
        .collect();
    assert_eq!(table_rows, [first, other], "{listed}");

    // Each outbox numbers its own: a WAL event with the first row's id makes the id ambiguous until
    // `--outbox` says which; a table row is retried, never discarded.
    let id = first.to_string();
    sqlx::query(
        "INSERT INTO saga_outbox_wal_parked (id, commit_lsn, message_lsn, event_index, tenant_id, topic, \
             partition_key, payload, error, attempts, holds_key, next_attempt_at) OVERRIDING SYSTEM VALUE \
         VALUES ($1, '0/1', '0/10', 0, 'default', 'payments', 'w-1', '\\x7b7d', 'refused', 4, true, \
                 now() + interval '1 hour')",
    )
    .bind(first)
    .execute(&db.pool)
    .await
    .unwrap();
    let line = expect_usage_error(
        saga.command(&["outbox", "retry", "--id", &id, "--yes"]),
        "--outbox",
    )
    .await;
    assert!(line.contains("both outboxes"), "{line}");
    let line = expect_usage_error(
        saga.command(&[
            "outbox", "discard", "--id", &id, "--outbox", "table", "--yes",
        ]),
        "cannot be discarded",
    )
    .await;
    assert!(line.contains("row"), "{line}");
    // A dead letter's reason given as why: refused, pointing at --letter-reason (nothing replayed).
    expect_usage_error(
        saga.command(&[
            "dlq",
            "replay",
            "--topic",
            "x.dlq",
            "--reason",
            "crash-loop",
        ]),
        "--letter-reason crash-loop",
    )
    .await;

    // Asked first: without a terminal and without --yes, nothing is done (and nothing is recorded).
    let line = expect_usage_error(
        saga.command(&["outbox", "retry", "--id", &id, "--outbox", "table"]),
        "--yes",
    )
    .await;
    assert!(line.contains("key k-1 of orders"), "{line}");
    let retried = saga
        .json(&[
            "outbox",
            "retry",
            "--id",
            &id,
            "--outbox",
            "table",
            "--yes",
            "--operator",
            "alice",
            "--reason",
            "INC-7: limit raised",
        ])
        .await;
    assert_eq!(
        (&retried["events"], &retried["operator"]),
        (&1.into(), &"alice".into())
    );
    let parked: Vec<String> = sqlx::query_scalar(
        "SELECT partition_key FROM saga_outbox WHERE parked_at IS NOT NULL ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(parked, ["k-2"], "only the named row's key was unparked");

    // A refused action is recorded as refused, with why.
    expect_usage_error(
        saga.command(&[
            "keys",
            "release",
            "nobody",
            "--group",
            "g",
            "--operator",
            "bob",
        ]),
        "is not held",
    )
    .await;

    let log = saga.json(&["audit"]).await;
    let log = log.as_array().unwrap();
    assert_eq!(log.len(), 3, "{log:?}");
    let (release, retry, discard) = (&log[0], &log[1], &log[2]);
    assert_eq!(
        (&discard["action"], &discard["outcome"]),
        (&"outbox discard".into(), &"refused".into())
    );
    assert!(
        discard["detail"]
            .as_str()
            .is_some_and(|d| d.contains("cannot be discarded")),
        "{discard}"
    );
    assert_eq!(
        (
            &retry["action"],
            &retry["operator"],
            &retry["via"],
            &retry["outcome"]
        ),
        (
            &"outbox retry".into(),
            &"alice".into(),
            &"command".into(),
            &"done".into()
        )
    );
    assert_eq!(retry["reason"], "INC-7: limit raised");
    assert_eq!(retry["target"]["event"], id.as_str());
    assert_eq!(retry["detail"], "1 parked events to be published again");
    assert!(retry["finished_at"].is_string());
    assert_eq!(
        (
            &release["action"],
            &release["operator"],
            &release["outcome"]
        ),
        (&"keys release".into(), &"bob".into(), &"refused".into())
    );
    assert_eq!(release["target"]["key"], "nobody");
    assert_eq!(release["target"]["group"], "g");

    // Filtered; as a table.
    let alices = saga.json(&["audit", "--operator", "alice"]).await;
    assert_eq!(alices.as_array().unwrap().len(), 1);
    let none = saga.json(&["audit", "--action", "dlq replay"]).await;
    assert!(none.as_array().unwrap().is_empty());
    let text = saga.text(&["audit", "--since", "1h"]).await;
    assert!(
        text.contains("INC-7: limit raised") && text.contains("3 actions"),
        "{text}"
    );
    expect_usage_error(saga.command(&["audit", "--since", "soon"]), "bad duration").await;
}
