//! A false answer is worse than none: when the dead-letter index cannot be brought up to date, `saga dlq
//! list` says how stale it is and exits non-zero, unless asked to read it as it is (`--as-indexed`); the
//! inspector's pages show the index as it is under a banner, its API only when asked (`?as_indexed=1`, with
//! a `saga-index-stale` header). Reads run no migration: a database user that may only read the schema can
//! look. On the real broker and PostgreSQL.

mod common;

use saga_admin::inspect::{self, InspectOptions};
use saga_config::KafkaConfig;
use saga_test_support::{TestDb, TestKafka};
use tokio_util::sync::CancellationToken;

use common::Target;

/// Writes a dead letter for key `key` (its message at `offset`) to `dlq`.
async fn letter(kafka: &TestKafka, dlq: &str, key: &str, offset: i64) {
    let failed_at = chrono::Utc::now().to_rfc3339();
    let offset = offset.to_string();
    kafka
        .produce(
            &kafka.producer(),
            dlq,
            Some(key),
            &[
                ("idempotency-key", key),
                ("dlq-original-topic", "orders"),
                ("dlq-original-partition", "0"),
                ("dlq-original-offset", &offset),
                ("dlq-consumer-group", "payments"),
                ("dlq-step", "process-payment"),
                ("dlq-reason", "handler-failed"),
                ("dlq-error", "card declined"),
                ("dlq-attempts", "1"),
                ("dlq-failed-at", &failed_at),
            ],
            b"{}",
        )
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_index_is_said_and_read_as_it_is_only_when_asked() {
    let db = TestDb::with(
        "admin-stale",
        &[
            saga_consumer::migrate::migrator(),
            saga_admin::dlq::migrator(),
        ],
    )
    .await;
    let kafka = TestKafka::new().await;
    let dlq = common::dlq_topic(&kafka, "admin-stale", 1).await;
    letter(&kafka, &dlq, "order-1", 0).await;
    let owner = Target {
        database_url: TestDb::database_url(),
        schema: db.schema.clone(),
        brokers: kafka.brokers.clone(),
    };
    // Indexed by a user that may write the index.
    let listed = owner.json(&["dlq", "list", "--topic", &dlq]).await;
    assert_eq!(listed.as_array().unwrap().len(), 1);

    // A second letter, which only a user that may write the index could take in.
    letter(&kafka, &dlq, "order-2", 1).await;
    let reader = common::Reader::create(&db.pool, &db.schema).await;
    let as_reader = Target {
        database_url: reader.url.clone(),
        ..owner.clone()
    };
    let output = as_reader.run(&["dlq", "list", "--topic", &dlq]).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("could not be brought up to date")
            && stderr.contains("permission denied")
            && stderr.contains("it was last brought up to date at")
            && stderr.contains("the newest letter it holds was indexed at")
            && stderr.contains("--as-indexed"),
        "{stderr}"
    );
    assert!(
        !String::from_utf8_lossy(&output.stdout).contains("dead letters"),
        "no count printed: {output:?}"
    );

    // Asked to: the index as it is (one letter), and how stale it is, on standard error.
    let output = as_reader
        .run(&["--json", "--as-indexed", "dlq", "list", "--topic", &dlq])
        .await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let listed: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    assert!(
        stderr.contains("warning: the dead-letter index of")
            && stderr.contains("permission denied"),
        "{stderr}"
    );

    // The page over the reader's pool: the letters as indexed, under a banner; the API says it in a header.
    let pool = common::schema_pool(&reader.url, &db.schema).await;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let mut options = InspectOptions::default();
    options.dlq_topics = vec![dlq.clone()];
    let server = tokio::spawn(inspect::serve(
        listener,
        KafkaConfig::new(kafka.brokers.clone()),
        pool.clone(),
        options,
        stop.clone().cancelled_owned(),
    ));
    let (_, _, page) = saga_lab::harness::client::request(
        addr,
        "GET",
        &format!("/dlq/{dlq}"),
        &[("accept", "text/html")],
        None,
    )
    .await
    .unwrap();
    let html = String::from_utf8_lossy(&page);
    assert!(
        html.contains("id=\"index-stale\"") && html.contains("permission denied"),
        "{html}"
    );
    assert!(html.contains("data-count=\"1\""), "{html}");
    // The API: a script gets no stale answer it did not ask for (503, how stale); asked, it gets one, and
    // a header saying so.
    let (status, _, body) = saga_lab::harness::client::request(
        addr,
        "GET",
        &format!("/api/dlq/{dlq}"),
        &[("accept", "application/json")],
        None,
    )
    .await
    .unwrap();
    let body = String::from_utf8_lossy(&body);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("could not be brought up to date"), "{body}");
    let (status, headers, body) = saga_lab::harness::client::request(
        addr,
        "GET",
        &format!("/api/dlq/{dlq}?as_indexed=1"),
        &[("accept", "application/json")],
        None,
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let said = headers
        .get("saga-index-stale")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    assert!(
        said.contains("could not be brought up to date"),
        "{headers:?}"
    );
    // `/metrics` keeps its other gauges and says the dead letters could not be read.
    let (status, _, metrics) =
        saga_lab::harness::client::request(addr, "GET", "/metrics", &[], None)
            .await
            .unwrap();
    let metrics = String::from_utf8_lossy(&metrics);
    assert_eq!(status, 200, "{metrics}");
    assert!(
        metrics
            .lines()
            .any(|l| l == "saga_inspector_scrape_errors{part=\"dead_letters\"} 1"),
        "{metrics}"
    );
    stop.cancel();
    server.await.unwrap().unwrap();
    pool.close().await;

    // Nothing was migrated or written by the reads: the second letter is still missing from the index.
    let indexed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM saga_dead_letters WHERE dlq_topic = $1")
            .bind(&dlq)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(indexed, 1);

    // Once a user that may write took the letter in, the reader finds every letter indexed: up to date,
    // no warning, though it may record nothing.
    let listed = owner.json(&["dlq", "list", "--topic", &dlq]).await;
    assert_eq!(listed.as_array().unwrap().len(), 2);
    let output = as_reader
        .run(&["--json", "dlq", "list", "--topic", &dlq])
        .await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        !stderr.contains("could not be brought up to date"),
        "{stderr}"
    );
    let listed: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 2, "{listed}");
    reader.drop_role(&db.pool).await;
}
