//! The inspector page in a real browser: headless Chromium, driven over WebDriver by chromedriver (the
//! Debian packages `chromium` and `chromium-driver`, which `scripts/test` installs where missing). It
//! renders the overview and an orchestrated saga's page from the real services' schema, the test reads
//! the rendered DOM, and the replay button replays one dead letter into its group's retry topic, as the
//! operator its token names. Screenshots are saved under `target/inspector/`.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use base64::Engine as _;
use saga_admin::inspect::{self, InspectOptions, NamedToken};
use saga_config::KafkaConfig;
use saga_examples::service::Service;
use saga_lab::harness::client::{self, send};
use saga_lab::harness::local::{LocalSaga, WAIT};
use saga_lab::harness::run::plan;
use saga_test_support::{free_local_addr, wait_until};
use serde_json::{Value, json};

/// A WebDriver session of headless Chromium, through a chromedriver of its own.
struct Browser {
    driver: tokio::process::Child,
    addr: SocketAddr,
    session: String,
}

impl Browser {
    async fn start() -> Self {
        let chromedriver = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .expect("chromedriver is not installed: run scripts/test, or apt-get install -y chromium chromium-driver");
        let addr = free_local_addr();
        let driver = tokio::process::Command::new(chromedriver)
            .arg(format!("--port={}", addr.port()))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("starting chromedriver");
        wait_until("chromedriver", Duration::from_secs(30), || async {
            let status = send(addr, "GET", "/status", &[], None).await.ok()?;
            (status.body["value"]["ready"] == true).then_some(())
        })
        .await;
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1280,900", "--disable-background-networking"]
            }
        }}});
        let created = send(
            addr,
            "POST",
            "/session",
            &[],
            Some(capabilities.to_string().into_bytes()),
        )
        .await
        .expect("creating a WebDriver session");
        let session = created.body["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no WebDriver session: {}", created.body))
            .to_owned();
        Self {
            driver,
            addr,
            session,
        }
    }

    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let path = format!("/session/{}{path}", self.session);
        let answer = send(
            self.addr,
            method,
            &path,
            &[],
            Some(body.unwrap_or(json!({})).to_string().into_bytes()).filter(|_| method == "POST"),
        )
        .await
        .unwrap_or_else(|e| panic!("WebDriver {method} {path}: {e}"));
        assert_eq!(
            answer.status, 200,
            "WebDriver {method} {path}: {}",
            answer.body
        );
        answer.body["value"].clone()
    }

    async fn open(&self, url: &str) {
        self.call("POST", "/url", Some(json!({ "url": url }))).await;
    }

    async fn title(&self) -> String {
        self.call("GET", "/title", None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// The elements matching `css`, as WebDriver element ids.
    async fn find_all(&self, css: &str) -> Vec<String> {
        let found = self
            .call(
                "POST",
                "/elements",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        found
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                e.as_object()
                    .unwrap()
                    .values()
                    .next()
                    .unwrap()
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect()
    }

    /// The one element matching `css`, waiting for it while a page loads (after a click, say).
    async fn find(&self, css: &str) -> String {
        for _ in 0..100 {
            let found = self.find_all(css).await;
            if found.len() == 1 {
                return found.into_iter().next().unwrap();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // What the page said, for the failure's message (an error page's text, say).
        let said = match self.find_all("#message").await.first() {
            Some(message) => self.text(message).await,
            None => String::new(),
        };
        panic!(
            "no single element {css} on {:?} after 10 s; the page says: {said:?}",
            self.title().await
        );
    }

    async fn text(&self, element: &str) -> String {
        self.call("GET", &format!("/element/{element}/text"), None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    async fn attribute(&self, element: &str, name: &str) -> String {
        self.call("GET", &format!("/element/{element}/attribute/{name}"), None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Types `text` into the field `element`.
    async fn type_into(&self, element: &str, text: &str) {
        self.call(
            "POST",
            &format!("/element/{element}/value"),
            Some(json!({ "text": text })),
        )
        .await;
    }

    async fn click(&self, element: &str) {
        self.call(
            "POST",
            &format!("/element/{element}/click"),
            Some(json!({})),
        )
        .await;
    }

    /// Saves a screenshot of the page as `target/inspector/{name}.png`; returns its path.
    async fn screenshot(&self, name: &str) -> PathBuf {
        let png = self.call("GET", "/screenshot", None).await;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().unwrap())
            .expect("a base64 PNG");
        assert!(bytes.starts_with(b"\x89PNG"), "a PNG");
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/inspector");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{name}.png"));
        std::fs::write(&path, bytes).unwrap();
        path
    }

    async fn quit(self) {
        // Dropping ends the session and the driver (see `Drop`), on this path and on a failure's.
        drop(self);
    }
}

impl Drop for Browser {
    /// Ends the WebDriver session, which closes Chromium, then kills chromedriver: on every path, a panic
    /// included (a chromedriver killed alone would leave its Chromium running).
    fn drop(&mut self) {
        use std::io::{Read, Write};
        if let Ok(mut stream) =
            std::net::TcpStream::connect_timeout(&self.addr, Duration::from_secs(5))
        {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
            let request = format!(
                "DELETE /session/{} HTTP/1.1\r\nhost: {}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                self.session, self.addr
            );
            if stream.write_all(request.as_bytes()).is_ok() {
                let mut answer = Vec::new();
                let _ = stream.read_to_end(&mut answer);
            }
        }
        let _ = self.driver.start_kill();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_inspector_shows_a_saga_and_the_dead_letters_in_a_browser_and_replays_one() {
    let saga = LocalSaga::start_with("admin-inspector", true).await;

    // One orchestrated order, completed.
    let order = plan(
        &format!("admin-inspector-{}", uuid::Uuid::new_v4().simple()),
        1,
    )
    .remove(0);
    let submitted = client::submit_order(saga.api(), &order.key, &order.request, false, WAIT)
        .await
        .unwrap();
    saga.wait_finished(1).await;
    let order_id = submitted.order_id.unwrap();
    let saga_id = saga.get(&format!("/orders/{order_id}")).await.body["saga_id"]
        .as_str()
        .unwrap()
        .to_owned();

    // A topic no service reads, and a dead letter of it, of a group of the order service's schema (its
    // consumer would record the group there at start).
    let original = saga.kafka.topic("admin-inspector-input", 1).await;
    let dlq_topic = format!("{original}.dlq");
    let retry_topic = format!("{original}.retry");
    saga.kafka.create_topic(&dlq_topic, 1).await;
    saga.kafka.create_topic(&retry_topic, 1).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {}.saga_consumer_groups (group_id, dlq_topic, retry_topic, topics) \
         VALUES ('payments', $1, $2, ARRAY[$3])",
        saga.args.schema(Service::Order)
    )))
    .bind(&dlq_topic)
    .bind(&retry_topic)
    .bind(&original)
    .execute(&saga.db.pool)
    .await
    .unwrap();
    let producer = saga.kafka.producer();
    let failed_at = chrono::Utc::now().to_rfc3339();
    let (dlq_partition, dlq_offset) = saga
        .kafka
        .produce(
            &producer,
            &dlq_topic,
            Some("order-7"),
            &[
                ("event-type", "OrderCreated"),
                ("idempotency-key", "order-7"),
                ("tenant-id", "acme"),
                ("dlq-original-topic", &original),
                ("dlq-original-partition", "0"),
                ("dlq-original-offset", "41"),
                ("dlq-consumer-group", "payments"),
                ("dlq-step", "process-payment"),
                ("dlq-reason", "handler-failed"),
                ("dlq-error", "card processor said no"),
                ("dlq-attempts", "1"),
                ("dlq-failed-at", &failed_at),
            ],
            br#"{"order_id":"7","amount_cents":1200}"#,
        )
        .await;

    // The inspector over the order service's schema (where the orchestrator keeps its sagas).
    let kafka = KafkaConfig::new(saga.args.brokers().to_owned());
    let admin_pool = saga_consumer::setup::connect_postgres(
        "DATABASE_URL",
        saga.args.database_url(),
        Some(&saga.args.schema(Service::Order)),
        2,
    )
    .await
    .unwrap();
    let token = "alice-token-0123456789abcdef";
    let mut options = InspectOptions::default();
    options.dlq_topics = vec![dlq_topic.clone()];
    options.groups = vec![saga.args.group(Service::Order)];
    options.tokens = vec![NamedToken::new("alice", token).unwrap()];
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(inspect::serve(
        listener,
        kafka,
        admin_pool.clone(),
        options,
        stop.clone().cancelled_owned(),
    ));

    // A key of the group held for its delayed retry: a message that failed transiently twice, due in an hour.
    let schema = saga.args.schema(Service::Order);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {schema}.saga_held_keys (group_id, key, state, cause, parked) \
         VALUES ('payments', 'order-9'::bytea, 'releasing', 'retrying', 1)"
    )))
    .execute(&saga.db.pool)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {schema}.saga_parked_messages (group_id, key, topic, \"partition\", \"offset\", step, \
             header_names, header_values, digest, attempts, due_at) \
         VALUES ('payments', 'order-9'::bytea, $1, 0, 42, 'process-payment', '{{}}', '{{}}', 'd', 2, \
             date_trunc('second', now()) + interval '1 hour')"
    )))
    .bind(&original)
    .execute(&saga.db.pool)
    .await
    .unwrap();
    let due: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT due_at FROM {schema}.saga_parked_messages WHERE key = 'order-9'::bytea"
    )))
    .fetch_one(&saga.db.pool)
    .await
    .unwrap();

    let browser = Browser::start().await;

    // The token once in the address: the page comes back without it, and a cookie keeps it.
    browser.open(&format!("{base}/?token={token}")).await;
    let url = browser.call("GET", "/url", None).await;
    assert_eq!(
        url.as_str(),
        Some(format!("{base}/").as_str()),
        "the token left the address"
    );

    // The overview: the completed saga, the dead letter's count.
    let completed = browser
        .find("#sagas-by-status tr[data-status=\"completed\"]")
        .await;
    assert!(
        browser.text(&completed).await.ends_with('1'),
        "{}",
        browser.text(&completed).await
    );
    let letters = browser
        .find(&format!(
            "#dead-letters tr[data-dlq-topic=\"{dlq_topic}\"][data-count]"
        ))
        .await;
    assert_eq!(browser.attribute(&letters, "data-count").await, "1");
    browser
        .find(&format!(
            "[data-group=\"{}\"]",
            saga.args.group(Service::Order)
        ))
        .await;
    // The held key says its delayed retry: its attempts and when it runs again.
    let retrying = browser.find("#held-keys tr[data-key=\"order-9\"]").await;
    let said = browser.text(&retrying).await;
    assert!(
        said.contains(&format!(
            "retrying (2 attempts), next at {}",
            due.format("%Y-%m-%d %H:%M:%S UTC")
        )),
        "{said}"
    );
    browser.screenshot("overview").await;

    // The saga's page: its id, its states in order.
    browser.open(&format!("{base}/sagas/{saga_id}")).await;
    let id = browser.find("#saga-id").await;
    assert_eq!(browser.text(&id).await, saga_id);
    let mut timeline = Vec::new();
    for item in browser.find_all("#timeline li").await {
        timeline.push((
            browser.attribute(&item, "data-cause").await,
            browser.attribute(&item, "data-status").await,
        ));
    }
    assert_eq!(
        timeline,
        [
            ("started".to_owned(), "running".to_owned()),
            ("PaymentProcessed".to_owned(), "running".to_owned()),
            ("ShipmentArranged".to_owned(), "completed".to_owned()),
        ]
    );
    assert_eq!(
        browser.find_all("#step-keys tr").await.len(),
        3,
        "a header and two step keys"
    );
    browser.screenshot("saga").await;

    // The dead letters of the topic; Replay…, then Confirm: the message is replayed, once, into the retry
    // topic of the group that gave up on it, recorded under the token's name.
    browser.open(&format!("{base}/dlq/{dlq_topic}")).await;
    let count = browser.find("#dlq-count").await;
    assert_eq!(browser.attribute(&count, "data-count").await, "1");
    browser.screenshot("dead-letters").await;
    let replay = browser.find("#letters a.replay").await;
    browser.click(&replay).await;
    let retry = browser.find("#retry-topic").await;
    assert_eq!(browser.text(&retry).await, retry_topic);
    let operator = browser.find("#operator").await;
    assert_eq!(browser.text(&operator).await, "alice");
    // Why, typed into the form: recorded in the audit log with the action.
    let reason = browser.find("form input[name=\"reason\"]").await;
    browser
        .type_into(&reason, "INC-12 card processor back")
        .await;
    browser.screenshot("confirm-replay").await;
    let confirm = browser.find("#confirm").await;
    browser.click(&confirm).await;
    let replayed = browser.find("#replayed").await;
    assert_eq!(browser.attribute(&replayed, "data-sent").await, "1");
    let mut newest = saga_admin::audit::AuditFilter::default();
    newest.limit = 1;
    let entry = saga_admin::audit::list(&admin_pool, &newest).await.unwrap();
    assert_eq!(
        (
            entry[0].action.as_str(),
            entry[0].operator.as_str(),
            entry[0].via.as_str(),
            entry[0].outcome.as_str(),
            entry[0].reason.as_deref()
        ),
        (
            "dlq replay",
            "alice",
            "page",
            "done",
            Some("INC-12 card processor back")
        )
    );
    let messages = saga
        .kafka
        .read_all(&retry_topic, 1, Duration::from_secs(1), WAIT)
        .await;
    assert_eq!(messages.len(), 1);
    let message = &messages[0];
    assert_eq!(message.header("saga-replay-count"), Some("1"));
    assert_eq!(
        message.header("saga-replay-original-topic"),
        Some(original.as_str())
    );
    assert_eq!(message.header("saga-replay-operator"), Some("alice"));
    assert_eq!(message.header("idempotency-key"), Some("order-7"));
    assert_eq!(
        message.header("dlq-reason"),
        None,
        "the dlq-* headers are dropped"
    );
    assert_eq!(message.json()["amount_cents"], 1200);
    // Confirmed again (a reload, a second click), it is not sent again.
    browser
        .open(&format!(
            "{base}/dlq/{dlq_topic}/{dlq_partition}/{dlq_offset}/replay"
        ))
        .await;
    let confirm = browser.find("#confirm").await;
    browser.click(&confirm).await;
    let replayed = browser.find("#replayed").await;
    assert_eq!(browser.attribute(&replayed, "data-sent").await, "0");
    assert_eq!(
        saga.kafka
            .end_offsets(&retry_topic)
            .await
            .values()
            .sum::<i64>(),
        1
    );
    assert_eq!(
        saga.kafka
            .end_offsets(&original)
            .await
            .values()
            .sum::<i64>(),
        0,
        "no group reading the original topic sees the replay"
    );
    let log = saga_admin::dlq::replays(&admin_pool, Some(&dlq_topic), 10)
        .await
        .unwrap();
    assert_eq!(
        log.iter().map(|r| r.operator.as_str()).collect::<Vec<_>>(),
        ["alice"]
    );

    // Two more letters of one cause: a failure group, replayed in bulk after its preview.
    let card_declined = |offset: &'static str, card: &'static str| {
        let (producer, dlq_topic, original) = (&producer, &dlq_topic, &original);
        let kafka = &saga.kafka;
        async move {
            let error = format!("card {card} declined by the processor");
            let failed_at = chrono::Utc::now().to_rfc3339();
            kafka
                .produce(
                    producer,
                    dlq_topic,
                    Some("order-8"),
                    &[
                        ("event-type", "OrderCreated"),
                        ("idempotency-key", "order-8"),
                        ("tenant-id", "acme"),
                        ("dlq-original-topic", original),
                        ("dlq-original-partition", "0"),
                        ("dlq-original-offset", offset),
                        ("dlq-consumer-group", "payments"),
                        ("dlq-step", "process-payment"),
                        ("dlq-reason", "handler-failed"),
                        ("dlq-error", &error),
                        ("dlq-attempts", "1"),
                        ("dlq-failed-at", &failed_at),
                    ],
                    br#"{"order_id":"8","amount_cents":900}"#,
                )
                .await
        }
    };
    card_declined("42", "41").await;
    card_declined("43", "4242").await;
    browser.open(&format!("{base}/groups")).await;
    let group = browser.find("#failure-groups tr[data-open=\"2\"] a").await;
    browser.screenshot("failure-groups").await;
    browser.click(&group).await;
    let cause = browser.find("#cause").await;
    assert_eq!(
        browser.text(&cause).await,
        "card <n> declined by the processor"
    );
    assert_eq!(
        browser
            .find_all("#letters tr[data-state=\"open\"]")
            .await
            .len(),
        2
    );
    browser.screenshot("failure-group").await;
    let replay_group = browser.find("#replay-group").await;
    browser.click(&replay_group).await;
    let plan = browser.find("#plan").await;
    assert_eq!(browser.attribute(&plan, "data-would-act").await, "2");
    browser.screenshot("group-replay-preview").await;
    let preview_url = browser
        .call("GET", "/url", None)
        .await
        .as_str()
        .unwrap()
        .to_owned();
    // A third letter of the cause arrives after the preview: its confirmation acts on nothing, and says so.
    card_declined("44", "777").await;
    let confirm = browser.find("#confirm").await;
    browser.click(&confirm).await;
    let refused = browser.find("#message").await;
    let said = browser.text(&refused).await;
    assert!(said.contains("changed since the preview"), "{said}");
    assert_eq!(
        saga.kafka
            .end_offsets(&retry_topic)
            .await
            .values()
            .sum::<i64>(),
        1,
        "nothing sent by the stale confirmation"
    );
    // Previewed again: the three letters, confirmed.
    browser.open(&preview_url).await;
    let plan = browser.find("#plan").await;
    assert_eq!(browser.attribute(&plan, "data-would-act").await, "3");
    let confirm = browser.find("#confirm").await;
    browser.click(&confirm).await;
    // The operation's page, until its run ended.
    let operation_url = wait_until("the operation's page", WAIT, || async {
        let url = browser.call("GET", "/url", None).await;
        let url = url.as_str()?.to_owned();
        url.contains("/operations/").then_some(url)
    })
    .await;
    let done = wait_until("the operation to end", WAIT, || async {
        browser.open(&operation_url).await;
        let operation = browser.find("#operation").await;
        (browser.attribute(&operation, "data-status").await == "done").then_some(operation)
    })
    .await;
    assert_eq!(browser.attribute(&done, "data-done").await, "3");
    let who = browser.find("#operation-operator").await;
    assert_eq!(browser.text(&who).await, "alice");
    browser.screenshot("operation").await;
    assert_eq!(
        saga.kafka
            .end_offsets(&retry_topic)
            .await
            .values()
            .sum::<i64>(),
        4,
        "the group's three letters sent, once each"
    );

    // The saga across every service, from its page's link.
    browser.open(&format!("{base}/sagas/{saga_id}")).await;
    let trace_link = browser.find("#trace-link").await;
    browser.click(&trace_link).await;
    let summary = browser.find("#trace-summary").await;
    let lanes: usize = browser
        .attribute(&summary, "data-lanes")
        .await
        .parse()
        .unwrap();
    assert_eq!(lanes, 3, "the order, payment and shipping services");
    assert!(
        !browser
            .find_all(".lane-event[data-kind=\"transition\"]")
            .await
            .is_empty(),
        "the orchestrator's transitions"
    );
    assert!(
        !browser
            .find_all(".lane-event[data-kind=\"emitted\"][data-status=\"published\"]")
            .await
            .is_empty(),
        "published events"
    );
    browser.screenshot("trace").await;

    // An unfinished saga (of a type no orchestrator here runs): Retry…, then Confirm.
    let stuck = uuid::Uuid::now_v7();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {}.saga_instances (saga_id, saga_type, tenant_id, idempotency_key, status, step_index, \
             data, version, stuck_reason) VALUES ($1, 'manual-saga', 'default', 'order-9', 'running', 1, '{{}}', 2, \
             'its deadline passed and the definition has no move for it')",
        saga.args.schema(Service::Order)
    )))
    .bind(stuck)
    .execute(&saga.db.pool)
    .await
    .unwrap();
    browser.open(&format!("{base}/sagas/{stuck}")).await;
    let retry = browser.find("#retry").await;
    browser.click(&retry).await;
    let retry_url = browser
        .call("GET", "/url", None)
        .await
        .as_str()
        .unwrap()
        .to_owned();
    // The saga moves on while its confirmation is open: confirming does nothing, and says so.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {}.saga_instances SET version = version + 1 WHERE saga_id = $1",
        saga.args.schema(Service::Order)
    )))
    .bind(stuck)
    .execute(&saga.db.pool)
    .await
    .unwrap();
    let confirm = browser.find("#confirm").await;
    browser.click(&confirm).await;
    let refused = browser.find("#message").await;
    let said = browser.text(&refused).await;
    assert!(said.contains("changed since the preview"), "{said}");
    let unchanged = saga_orchestrator::store::load(&admin_pool, stuck)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(unchanged.retry_requested_by, None, "nothing requested");
    // Opened again, confirmed.
    browser.open(&retry_url).await;
    let confirm = browser.find("#confirm").await;
    browser.click(&confirm).await;
    let requested = browser.find("#retry-requested").await;
    assert_eq!(browser.text(&requested).await, "retry requested by alice");
    browser.screenshot("saga-retry").await;
    let instance = saga_orchestrator::store::load(&admin_pool, stuck)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(instance.retry_requested_by.as_deref(), Some("alice"));
    assert_eq!(instance.stuck_reason, None, "no longer stuck: due now");

    // An inspector whose database user may only read: a letter arrives that only a user that may write
    // the index could take in, and the topic's page shows the letters as indexed, under a banner that
    // says how stale they are.
    let schema = saga.args.schema(Service::Order);
    let reader = common::Reader::create(&saga.db.pool, &schema).await;
    let reader_pool = common::schema_pool(&reader.url, &schema).await;
    card_declined("45", "999").await;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let reading = format!("http://{}", listener.local_addr().unwrap());
    let mut options = InspectOptions::default();
    options.dlq_topics = vec![dlq_topic.clone()];
    options.tokens = vec![NamedToken::new("alice", token).unwrap()];
    let stop_reading = tokio_util::sync::CancellationToken::new();
    let reading_server = tokio::spawn(inspect::serve(
        listener,
        KafkaConfig::new(saga.args.brokers().to_owned()),
        reader_pool.clone(),
        options,
        stop_reading.clone().cancelled_owned(),
    ));
    browser.open(&format!("{reading}/?token={token}")).await;
    browser.open(&format!("{reading}/dlq/{dlq_topic}")).await;
    let banner = browser.find("#index-stale").await;
    let said = browser.text(&banner).await;
    assert!(
        said.contains("could not be brought up to date") && said.contains("permission denied"),
        "{said}"
    );
    let count = browser.find("#dlq-count").await;
    assert_eq!(
        browser.attribute(&count, "data-count").await,
        "4",
        "the letters as indexed, not the one only a writer could take in"
    );
    browser.screenshot("index-stale").await;
    stop_reading.cancel();
    reading_server.await.unwrap().unwrap();
    reader_pool.close().await;
    reader.drop_role(&saga.db.pool).await;

    browser.quit().await;
    stop.cancel();
    server.await.unwrap().unwrap();
    saga.stop().await;
}
