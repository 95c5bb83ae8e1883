//! The WAL outbox's slot against a real PostgreSQL (`wal_level = logical`, set by scripts/dev-services).

use std::time::{Duration, Instant};

use saga_runtime::store::outbox;
use saga_runtime::store::wal::{self, fence};
use saga_test_support::TestDb;

/// A service and its relay start together and both prepare the schema's slot. The one that loses the race
/// to create it must not go on (and write events) while the other is still creating it: PostgreSQL names the
/// slot at once but decodes only what commits after the transactions running then have ended, so an event
/// written meanwhile would never be published.
#[tokio::test]
async fn a_process_finding_the_slot_being_created_waits_until_it_decodes() {
    let db = TestDb::new("wal-slot").await;
    // A transaction with an id, open: the slot's creation waits for it.
    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::query("SELECT txid_current()")
        .execute(&mut *blocker)
        .await
        .unwrap();

    let pool = db.pool.clone();
    let creating = tokio::spawn(async move { wal::prepare(&pool).await });
    let slot = wal::slot_name(db.database(), &db.schema);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if slot_decodes(&db, &slot).await.is_some() {
            break;
        }
        assert!(Instant::now() < deadline, "the slot's creation never began");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let pool = db.pool.clone();
    let finding = tokio::spawn(async move { wal::prepare(&pool).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !finding.is_finished(),
        "the second process went on while the slot was still being created"
    );
    assert!(!creating.is_finished());

    blocker.commit().await.unwrap();
    let created = creating.await.unwrap().unwrap();
    let found = finding.await.unwrap().unwrap();
    assert_eq!(created.slot, found.slot);
    assert_eq!(slot_decodes(&db, &slot).await, Some(true));
    let mut conn = db.pool.acquire().await.unwrap();
    assert!(wal::drop_slot(&mut conn, &db.schema).await.unwrap());
}

/// Whether `slot` decodes yet (`None`: no such slot).
async fn slot_decodes(db: &TestDb, slot: &str) -> Option<bool> {
    sqlx::query_scalar(
        "SELECT confirmed_flush_lsn IS NOT NULL FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(&db.pool)
    .await
    .unwrap()
}

/// An event of the WAL outbox, for `prepare`d schemas.
fn event(key: &str) -> saga_core::OutboxMessage {
    let lineage = saga_core::Lineage::root(
        saga_core::IdempotencyKey::new(key).unwrap(),
        saga_core::TenantId::default(),
    );
    saga_core::OutboxMessage::from_event(
        saga_core::Event::new("Numbered", "t", key, &serde_json::json!({ "key": key })).unwrap(),
        &lineage,
        "wal-test",
    )
}

/// Writes `messages` in a transaction of their own, through `outbox`.
async fn write(
    pool: &sqlx::PgPool,
    outbox: &outbox::Outbox,
    messages: &[saga_core::OutboxMessage],
) -> Result<(), outbox::OutboxError> {
    let mut tx = pool.begin().await.unwrap();
    outbox.append(&mut tx, messages).await?;
    tx.commit().await.unwrap();
    Ok(())
}

/// How many of the schema's outbox messages `slot` holds (peeked, not consumed), read in its database.
async fn messages_in_slot(db: &TestDb, slot: &str) -> usize {
    let data: Vec<Vec<u8>> = sqlx::query_scalar(
        "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, 'proto_version', '1', \
         'publication_names', $2, 'messages', 'true')",
    )
    .bind(slot)
    .bind(wal::PUBLICATION)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let prefix = wal::prefix(&db.schema);
    data.iter()
        .filter(|d| {
            d.first() == Some(&b'M') && d.get(10..10 + prefix.len()) == Some(prefix.as_bytes())
        })
        .count()
}

/// Two services in two databases of one cluster, both on schema `public` (the usual layout): slots are
/// cluster-wide, so each gets a slot of its own, named after its database, that decodes its own events. A
/// slot of the expected name that belongs to another database is refused at start with one line.
#[tokio::test]
async fn two_databases_on_schema_public_get_a_slot_each_and_another_databases_slot_is_refused() {
    let a = TestDb::public_of_own_database("wal-db-a").await;
    let b = TestDb::public_of_own_database("wal-db-b").await;
    let slot_a = wal::prepare(&a.pool).await.unwrap();
    let slot_b = wal::prepare(&b.pool).await.unwrap();
    assert_eq!(
        (slot_a.schema.as_str(), slot_b.schema.as_str()),
        ("public", "public")
    );
    assert_ne!(slot_a.slot, slot_b.slot, "one slot per database");
    for (db, slot) in [(&a, &slot_a.slot), (&b, &slot_b.slot)] {
        let database: String = sqlx::query_scalar(
            "SELECT database::text FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(slot)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(database, db.database());
    }
    // B's events are in B's slot, A's in A's.
    let log_a = outbox::Outbox::new(wal::OutboxMode::Wal);
    log_a.open(&a.pool, Duration::from_secs(2)).await.unwrap();
    let log_b = outbox::Outbox::new(wal::OutboxMode::Wal);
    log_b.open(&b.pool, Duration::from_secs(2)).await.unwrap();
    write(&b.pool, &log_b, &[event("b-1")]).await.unwrap();
    write(&b.pool, &log_b, &[event("b-2")]).await.unwrap();
    write(&a.pool, &log_a, &[event("a-1")]).await.unwrap();
    assert_eq!(messages_in_slot(&b, &slot_b.slot).await, 2);
    assert_eq!(messages_in_slot(&a, &slot_a.slot).await, 1);

    // A slot with the name a third database's service expects, made in A: refused, naming both.
    let c = TestDb::public_of_own_database("wal-db-c").await;
    let squatter = wal::slot_name(c.database(), "public");
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(&squatter)
        .execute(&a.pool)
        .await
        .unwrap();
    let refused = wal::prepare(&c.pool).await.unwrap_err().to_string();
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&squatter)
        .execute(&a.pool)
        .await
        .unwrap();
    assert!(
        refused.contains(&format!("belongs to database {:?}", a.database()))
            && !refused.contains('\n'),
        "{refused}"
    );
}

/// A slot the schema recorded that is gone (dropped, a failover, a restore) stops the writers within
/// seconds, is refused at start with one line saying what was lost, and is never made again silently;
/// `recover` (an operator's command) makes a new one and records the incident.
#[tokio::test]
async fn a_recorded_slot_that_is_gone_stops_writers_and_only_an_operator_makes_a_new_one() {
    let db = TestDb::new("wal-slot-gone").await;
    let opened = outbox::open(
        &db.pool,
        wal::OutboxMode::Wal,
        outbox::DEFAULT_MAX_TRANSACTION_BYTES,
        Duration::from_millis(100),
    )
    .await
    .unwrap();
    write(&db.pool, &opened, &[event("before")]).await.unwrap();
    // A step completed: its events may be among those lost.
    sqlx::query(
        "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status) VALUES ('default', 'k:step', 'completed')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let slot = wal::slot_name(db.database(), &db.schema);
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&slot)
        .execute(&db.pool)
        .await
        .unwrap();

    // Within seconds, the writers stop: nothing commits whose events nobody would read.
    let deadline = Instant::now() + Duration::from_secs(5);
    while opened.health().is_writable() {
        assert!(Instant::now() < deadline, "the writers never noticed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let refused = write(&db.pool, &opened, &[event("after")])
        .await
        .unwrap_err();
    assert!(
        matches!(refused, outbox::OutboxError::Unwritable(_)) && refused.is_unavailable(),
        "{refused}"
    );
    // A process starting now is refused with one line, and nothing is made again.
    let problem = wal::prepare(&db.pool).await.unwrap_err().to_string();
    assert!(
        problem.contains("is gone")
            && problem.contains("saga outbox wal recover")
            && !problem.contains('\n'),
        "{problem}"
    );
    assert_eq!(slot_decodes(&db, &slot).await, None, "not made again");

    let recovery = wal::recover(&db.pool, "tester").await.unwrap();
    assert_eq!(
        (recovery.what.as_str(), recovery.slot.as_str()),
        ("gone", slot.as_str())
    );
    assert_eq!(
        recovery.steps_in_window, 1,
        "the step completed since the last confirmation"
    );
    assert!(recovery.lost_from <= recovery.lost_to);
    let (by, steps): (String, i64) = sqlx::query_as(
        "SELECT recovered_by, steps_in_window FROM saga_outbox_wal_incidents WHERE id = $1",
    )
    .bind(recovery.incident)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((by.as_str(), steps), ("tester", 1));
    assert_eq!(slot_decodes(&db, &slot).await, Some(true));
    let deadline = Instant::now() + Duration::from_secs(5);
    while !opened.health().is_writable() {
        assert!(Instant::now() < deadline, "the writers never went on");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    write(&db.pool, &opened, &[event("after")]).await.unwrap();
    wal::prepare(&db.pool).await.unwrap();
    assert!(matches!(
        wal::recover(&db.pool, "tester").await,
        Err(wal::RecoverError::Healthy(_))
    ));
}

/// The switch from the table, schema-wide: while a process writes the table outbox, or a row of it is
/// unpublished (in any shard), no relay may read the slot; once it passes, the switch is recorded and a
/// process in table mode is refused (its rows would not be ordered with the log's events).
#[tokio::test]
async fn the_switch_waits_for_table_writers_and_rows_and_then_refuses_table_writers() {
    let db = TestDb::new("wal-fence").await;
    wal::prepare(&db.pool).await.unwrap();
    let table = outbox::open(
        &db.pool,
        wal::OutboxMode::Table,
        outbox::DEFAULT_MAX_TRANSACTION_BYTES,
        Duration::from_secs(1),
    )
    .await
    .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let view = fence::pass(&mut conn).await.unwrap();
    assert!(
        view.table_writers && !fence::may_read_slot(&view),
        "{view:?}"
    );
    write(&db.pool, &table, &[event("k")]).await.unwrap();
    drop(table);
    // The writer's process is gone: its session, and its presence, end within a second or two.
    let deadline = Instant::now() + Duration::from_secs(10);
    let view = loop {
        let view = fence::pass(&mut conn).await.unwrap();
        if !view.table_writers {
            break view;
        }
        assert!(
            Instant::now() < deadline,
            "the writer's presence outlived it"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        view.unpublished_rows && !fence::may_read_slot(&view),
        "its row is unpublished"
    );
    sqlx::query("UPDATE saga_outbox SET published_at = now()")
        .execute(&mut *conn)
        .await
        .unwrap();
    let view = fence::pass(&mut conn).await.unwrap();
    assert!(fence::may_read_slot(&view) && !view.switched, "{view:?}");
    assert!(fence::pass(&mut conn).await.unwrap().switched, "recorded");
    let refused = outbox::open(
        &db.pool,
        wal::OutboxMode::Table,
        outbox::DEFAULT_MAX_TRANSACTION_BYTES,
        Duration::from_secs(1),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        refused.contains("moved to the write-ahead log"),
        "{refused}"
    );
}

/// A transaction's events up to the limit are written; one byte more is refused at write time, with the
/// setting named, in both modes.
#[tokio::test]
async fn events_over_the_size_limit_are_refused_at_write_time() {
    let db = TestDb::new("wal-limit").await;
    wal::prepare(&db.pool).await.unwrap();
    let events = [event("a"), event("b")];
    let size = wal::encoded_len(&events);
    for mode in [wal::OutboxMode::Wal, wal::OutboxMode::Table] {
        let at_limit = outbox::open(&db.pool, mode, size, Duration::from_secs(2))
            .await
            .unwrap();
        write(&db.pool, &at_limit, &events).await.unwrap();
        let under = outbox::open(&db.pool, mode, size - 1, Duration::from_secs(2))
            .await
            .unwrap();
        let refused = write(&db.pool, &under, &events).await.unwrap_err();
        assert!(
            matches!(refused, outbox::OutboxError::TooLarge { bytes, limit } if bytes == size && limit == size - 1),
            "{refused}"
        );
        assert!(
            refused
                .to_string()
                .contains("SAGA_OUTBOX_MAX_TRANSACTION_BYTES")
        );
        assert!(!refused.is_unavailable());
    }
    assert_eq!(
        db.count("saga_outbox").await,
        2,
        "the table mode's write at the limit"
    );
}

/// A check of the slot that does not answer (a connection whose peer vanished would block it for the
/// kernel's retransmission timeout; here the slot's table is locked by another session) stops the writers
/// within the check's deadline, and they go on once a check answers.
#[tokio::test]
async fn a_check_of_the_slot_that_does_not_answer_stops_the_writers_until_one_does() {
    let db = TestDb::new("wal-slot-hang").await;
    let opened = outbox::open(
        &db.pool,
        wal::OutboxMode::Wal,
        outbox::DEFAULT_MAX_TRANSACTION_BYTES,
        Duration::from_millis(100),
    )
    .await
    .unwrap();
    write(&db.pool, &opened, &[event("before")]).await.unwrap();
    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE saga_outbox_wal_slot IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let locked = Instant::now();
    let deadline = locked + wal::monitor::CHECK_DEADLINE + Duration::from_secs(5);
    while opened.health().is_writable() {
        assert!(
            Instant::now() < deadline,
            "a check that never answers left the outbox writable"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        locked.elapsed() >= wal::monitor::CHECK_DEADLINE / 2,
        "stopped by the deadline, not at once"
    );
    let problem = opened.health().problem().unwrap_or_default();
    assert!(problem.contains("could not be checked"), "{problem}");
    assert!(write(&db.pool, &opened, &[event("during")]).await.is_err());
    blocker.rollback().await.unwrap();
    let deadline = Instant::now() + wal::monitor::CHECK_DEADLINE + Duration::from_secs(5);
    while !opened.health().is_writable() {
        assert!(Instant::now() < deadline, "the writers never went on");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    write(&db.pool, &opened, &[event("after")]).await.unwrap();
}

/// A check the database refuses, again and again (here the slot's record table was renamed away; a
/// revoked privilege or a connection that cannot be opened does the same), stops the writers once no check
/// has answered for the deadline, and they go on once one answers.
#[tokio::test]
async fn a_check_of_the_slot_the_database_keeps_refusing_stops_the_writers_until_one_answers() {
    let db = TestDb::new("wal-slot-refused").await;
    let opened = outbox::open(
        &db.pool,
        wal::OutboxMode::Wal,
        outbox::DEFAULT_MAX_TRANSACTION_BYTES,
        Duration::from_millis(100),
    )
    .await
    .unwrap();
    write(&db.pool, &opened, &[event("before")]).await.unwrap();
    sqlx::query("ALTER TABLE saga_outbox_wal_slot RENAME TO saga_outbox_wal_slot_away")
        .execute(&db.pool)
        .await
        .unwrap();
    let refused = Instant::now();
    let deadline = refused + wal::monitor::CHECK_DEADLINE + Duration::from_secs(5);
    while opened.health().is_writable() {
        assert!(
            Instant::now() < deadline,
            "checks the database refuses left the outbox writable"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        refused.elapsed() >= wal::monitor::CHECK_DEADLINE / 2,
        "stopped once no check answered for the deadline, not at the first refusal"
    );
    let problem = opened.health().problem().unwrap_or_default();
    assert!(problem.contains("could not be checked"), "{problem}");
    assert!(write(&db.pool, &opened, &[event("during")]).await.is_err());
    sqlx::query("ALTER TABLE saga_outbox_wal_slot_away RENAME TO saga_outbox_wal_slot")
        .execute(&db.pool)
        .await
        .unwrap();
    let deadline = Instant::now() + wal::monitor::CHECK_DEADLINE + Duration::from_secs(5);
    while !opened.health().is_writable() {
        assert!(Instant::now() < deadline, "the writers never went on");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    write(&db.pool, &opened, &[event("after")]).await.unwrap();
}

/// An event holding a NUL character where the outbox keeps text is refused at write, in the log's mode as
/// in the table's: never written to fail where the relay parks it.
#[tokio::test]
async fn an_event_holding_a_nul_character_is_refused_at_write_in_both_modes() {
    for mode in [wal::OutboxMode::Wal, wal::OutboxMode::Table] {
        let db = TestDb::new("wal-nul").await;
        let opened = outbox::open(
            &db.pool,
            mode,
            outbox::DEFAULT_MAX_TRANSACTION_BYTES,
            Duration::from_secs(2),
        )
        .await
        .unwrap();
        let mut bad_key = event("k");
        bad_key.partition_key = Some("a\0b".into());
        let mut bad_header = event("k");
        bad_header.headers.push(("x-note".into(), "a\0b".into()));
        for (bad, what) in [(bad_key, "key"), (bad_header, "header \"x-note\" value")] {
            let refused = write(&db.pool, &opened, &[event("fine"), bad])
                .await
                .unwrap_err();
            assert!(
                matches!(&refused, outbox::OutboxError::Refused { what: w } if w == what)
                    && !refused.is_unavailable(),
                "{mode:?}: {refused}"
            );
        }
    }
}
