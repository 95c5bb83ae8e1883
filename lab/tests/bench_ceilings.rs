//! The SQL ceilings `saga-bench` measures the consumer against write what they say, on the real
//! PostgreSQL: the plain one only the rows, the others also the statements the framework's guarantees need
//! (the crash-loop record, the sorted claim, the outbox append), each as the consumer makes it.

use saga_core::{OutboxMessage, TenantId};
use saga_lab::bench::consumer::{Ceiling, sql_ceiling};
use saga_test_support::TestDb;

const MESSAGES: i64 = 250;
const BATCH: usize = 100;
const CONNECTIONS: usize = 2;

#[tokio::test]
async fn each_ceiling_writes_the_rows_and_the_statements_it_names() {
    let db = TestDb::with("bench-ceilings", &[saga_consumer::migrate::migrator()]).await;
    // What the framework's run left, whose shape the ceilings copy: an outbox row and a step key.
    let headers = [
        ("ce_type".to_owned(), "WorkDone".to_owned()),
        ("note".to_owned(), r#"a "quoted" \ value"#.to_owned()),
    ];
    let mut conn = db.pool.acquire().await.unwrap();
    saga_runtime::store::outbox::append_rows(
        &mut conn,
        &[OutboxMessage {
            tenant: TenantId::default(),
            topic: "work.done".to_owned(),
            partition_key: Some("0".to_owned()),
            headers: headers
                .iter()
                .map(|(n, v)| (n.clone().into(), v.clone().into()))
                .collect(),
            payload: b"{}".to_vec(),
        }],
    )
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status) \
         VALUES ('default', 'seed:record-work', 'completed')",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    drop(conn);

    for kind in Ceiling::STEPS {
        let rate = sql_ceiling(&db.pool, kind, 0, MESSAGES, BATCH, CONNECTIONS)
            .await
            .unwrap_or_else(|e| panic!("{kind}: {e}"));
        assert!(rate > 0.0, "{kind}: {rate}");
        let prefix = format!("ceiling-{}-0-", kind.id());

        let keys: Vec<(String, String)> = sqlx::query_as(
            "SELECT step_key, status::text FROM saga_idempotency_keys \
             WHERE step_key LIKE $1 || '%' ORDER BY step_key",
        )
        .bind(&prefix)
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(keys.len(), MESSAGES as usize, "{kind}: one key per message");
        assert!(
            keys.iter()
                .all(|(k, s)| k.ends_with(":record-work") && s == "completed"),
            "{kind}: completed step keys: {:?}",
            &keys[..3]
        );

        let outbox: Vec<(String, Vec<String>)> = sqlx::query_as(
            "SELECT topic, headers FROM saga_outbox WHERE partition_key LIKE $1 || '%'",
        )
        .bind(&prefix)
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            outbox.len(),
            MESSAGES as usize,
            "{kind}: one outbox row per message"
        );
        let flat: Vec<String> = headers
            .iter()
            .flat_map(|(n, v)| [n.clone(), v.clone()])
            .collect();
        assert!(
            outbox.iter().all(|(t, h)| t == "work.done" && *h == flat),
            "{kind}: the framework's topic and headers: {:?}",
            outbox[0]
        );

        // The crash-loop record: one progress row per connection (its partition), at its last batch.
        let progress: Vec<(i32, i64, i64)> = sqlx::query_as(
            "SELECT partition, batch_offset, batch_end FROM saga_consumer_progress \
             WHERE group_id = $1 ORDER BY partition",
        )
        .bind(format!("ceiling-{}-0", kind.id()))
        .fetch_all(&db.pool)
        .await
        .unwrap();
        if kind.crash_loop_record {
            // 250 messages in batches of 100 over 2 connections: connection 0 writes 0-99 and 200-249,
            // connection 1 writes 100-199.
            assert_eq!(progress, vec![(0, 200, 249), (1, 100, 199)], "{kind}");
        } else {
            assert!(progress.is_empty(), "{kind} records no batch: {progress:?}");
        }
    }
    assert_eq!(
        db.count("bench_ceiling").await,
        MESSAGES * Ceiling::STEPS.len() as i64,
        "the business rows of every ceiling"
    );
}
