//! The example saga end to end on the real broker and the real PostgreSQL: the happy path and both
//! compensation paths, HTTP retries, and the fault mode.

use std::collections::HashMap;

use saga_examples::service::{Service, quote_ident};
use saga_lab::harness::client::{self, send};
use saga_lab::harness::ledger::{self, Path};
use saga_lab::harness::local::{LocalSaga, WAIT};
use saga_lab::harness::run::{PlannedOrder, plan};
use saga_lab::harness::summary::{figure, run_to_summary};
use saga_test_support::{TestDb, TestKafka};

/// Submits twelve orders (eight happy, two declined, two whose shipment fails), waits until every saga
/// finished, and checks the ledgers: the counts of each path, one charge per paid order, one refund per
/// failed shipment, one shipment per completed order. Returns the orders and their ids by key.
async fn run_all_three_paths(
    saga: &LocalSaga,
    run: &str,
) -> (Vec<PlannedOrder>, HashMap<String, String>) {
    let orders = plan(run, 12);
    let mut expected = HashMap::new();
    let mut ids = HashMap::new();
    for order in &orders {
        let submitted = client::submit_order(saga.api(), &order.key, &order.request, false, WAIT)
            .await
            .unwrap();
        expected.insert(order.key.clone(), order.path);
        ids.insert(order.key.clone(), submitted.order_id.unwrap());
    }
    saga.wait_finished(12).await;
    let facts = ledger::read_facts(&saga.db.pool, &saga.args).await.unwrap();
    let ledger = ledger::check(&facts, &expected);
    assert!(ledger.violations.is_empty(), "{:#?}", ledger.violations);
    assert_eq!(
        (ledger.completed, ledger.declined, ledger.refunded),
        (8, 2, 2)
    );
    assert_eq!(
        (ledger.charges, ledger.refunds, ledger.shipments),
        (10, 2, 8)
    );
    (orders, ids)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_happy_path_and_both_compensation_paths_end_to_end() {
    let saga = LocalSaga::start("saga-paths").await;
    let (orders, ids) = run_all_three_paths(&saga, "paths").await;

    // GET /orders/{id} tells where each saga stands, step by step.
    let refunded = orders
        .iter()
        .find(|o| o.path == Path::ShipmentFails)
        .unwrap();
    let view = saga.get(&format!("/orders/{}", ids[&refunded.key])).await;
    assert_eq!(view.status, 200);
    assert_eq!(view.body["status"], "CANCELLED");
    assert!(view.body["reason"].as_str().unwrap().contains("Atlantis"));
    let steps: Vec<&str> = view.body["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["status"].as_str().unwrap())
        .collect();
    for status in ["PENDING", "PAID", "COMPENSATING", "CANCELLED"] {
        assert!(steps.contains(&status), "{status} missing from {steps:?}");
    }
    let declined = orders.iter().find(|o| o.path == Path::Declined).unwrap();
    let view = saga.get(&format!("/orders/{}", ids[&declined.key])).await;
    assert_eq!(view.body["status"], "CANCELLED");
    assert!(view.body["reason"].as_str().unwrap().contains("declined"));
    saga.stop().await;
}

/// The same saga with every client of every service on the secured broker (TLS only, SASL/SCRAM): the
/// three paths end to end, the ledgers exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_saga_runs_end_to_end_over_sasl_ssl() {
    let saga = LocalSaga::start_secured("saga-sasl-ssl").await;
    assert_eq!(
        saga.args.saga.kafka.security_protocol,
        Some(saga_consumer::settings::SecurityProtocol::SaslSsl)
    );
    run_all_three_paths(&saga, "sasl").await;
    saga.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_retries_with_the_same_key_return_the_stored_response_and_create_one_order() {
    let saga = LocalSaga::start("saga-http").await;
    let order = plan("http", 1).remove(0);
    let body = serde_json::to_vec(&order.request).unwrap();
    let headers = [("idempotency-key", order.key.as_str())];
    let first = send(saga.api(), "POST", "/orders", &headers, Some(body.clone()))
        .await
        .unwrap();
    assert_eq!(
        (first.status, first.replayed),
        (201, false),
        "first answer: {}",
        first.body
    );
    for _ in 0..3 {
        let again = send(saga.api(), "POST", "/orders", &headers, Some(body.clone()))
            .await
            .unwrap();
        assert_eq!(
            (again.status, again.replayed),
            (201, true),
            "retried answer: {}",
            again.body
        );
        assert_eq!(
            again.body, first.body,
            "the stored response: the same order id"
        );
    }
    let mut other = order.request.clone();
    other.amount_cents += 1;
    let reused = send(
        saga.api(),
        "POST",
        "/orders",
        &headers,
        Some(serde_json::to_vec(&other).unwrap()),
    )
    .await
    .unwrap();
    assert_eq!(reused.status, 422);
    saga.wait_finished(1).await;
    let facts = ledger::read_facts(&saga.db.pool, &saga.args).await.unwrap();
    assert_eq!(facts.len(), 1, "one order for one key");
    let only = facts.values().next().unwrap();
    assert_eq!((only.status.as_str(), only.charges), ("COMPLETED", 1));
    saga.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_fault_mode_still_yields_one_charge_per_paid_order_and_one_shipment_per_completed_order()
 {
    // The demo itself, as users run it, on the real broker: every event delivered twice, and services
    // crashing after 5% of their database commits (before committing offsets), restarted each time. The
    // demo checks the ledger and exits non-zero on any violation.
    let _db = TestDb::empty("saga-faults").await;
    let kafka = TestKafka::new().await;
    let mut demo = tokio::process::Command::new(env!("CARGO_BIN_EXE_saga-demo"));
    demo.args(["--orders", "24", "--duplicates", "--crash-rate", "0.05"])
        .args(["--timeout-secs", "240"])
        .env("KAFKA_BROKERS", &kafka.brokers)
        .env("DATABASE_URL", TestDb::database_url());
    let stdout = run_to_summary(demo).await;
    let line = |label: &str| figure(&stdout, label);
    assert_eq!(line("orders accepted"), 24);
    assert_eq!(
        line("charges at the gateway"),
        20,
        "one charge per paid order"
    );
    assert_eq!(
        line("shipments arranged"),
        16,
        "one shipment per completed order"
    );
    assert_eq!(line("refunds at the gateway"), 4);
    assert!(line("duplicate deliveries injected") > 0);
    assert!(line("duplicates absorbed by step keys") > 0);
    // The counts above are also guaranteed by primary keys (a second charge of one order would fail and be
    // dead-lettered): that no step ran twice and nothing was dead-lettered is what shows exactly once.
    assert_eq!(line("steps run twice"), 0);
    assert_eq!(line("dead letters"), 0);
    // Ordering through failures: a key held behind its dead letter, its cancel parked, both run in order
    // once the letter is replayed (the demo checks the order and exits non-zero otherwise).
    assert!(
        stdout.contains("order-7 held, ")
            && stdout.contains("order 7 charged, then cancelled (in order), its key let go"),
        "{stdout}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_orchestrated_saga_takes_all_three_paths_and_shows_its_history() {
    let saga = LocalSaga::start_with("saga-orchestrated", true).await;
    let (orders, ids) = run_all_three_paths(&saga, "orchestrated").await;

    // The order names its saga; GET /sagas/{id} shows the state history.
    let refunded = orders
        .iter()
        .find(|o| o.path == Path::ShipmentFails)
        .unwrap();
    let order = saga.get(&format!("/orders/{}", ids[&refunded.key])).await;
    assert_eq!(order.body["status"], "CANCELLED");
    let saga_id = order.body["saga_id"].as_str().unwrap().to_owned();
    let view = saga.get(&format!("/sagas/{saga_id}")).await;
    assert_eq!(view.status, 200);
    assert_eq!(view.body["saga"]["status"], "compensated");
    let key = refunded.key.as_str();
    assert_eq!(
        view.body["saga"]["step_keys"],
        serde_json::json!({
            "process-payment": format!("{key}:process-payment"),
            "arrange-shipment": format!("{key}:arrange-shipment"),
            "compensate-process-payment": format!("{key}:compensate-process-payment"),
        })
    );
    let history: Vec<(String, String)> = view.body["history"]
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
        history,
        vec![
            ("started".to_owned(), "running".to_owned()),
            ("PaymentProcessed".to_owned(), "running".to_owned()),
            ("ShipmentFailed".to_owned(), "compensating".to_owned()),
            ("PaymentRefunded".to_owned(), "compensated".to_owned()),
        ]
    );
    saga.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_tenants_sending_the_same_idempotency_key_are_each_charged_for_their_own_order() {
    let saga = LocalSaga::start("saga-tenants").await;
    let order = plan("tenants", 1).remove(0);
    assert_eq!(order.path, Path::Happy);
    let body = serde_json::to_vec(&order.request).unwrap();
    let mut order_ids = Vec::new();
    for tenant in ["tenant-a", "tenant-b"] {
        let headers = [("idempotency-key", "shared-key-1"), ("tenant-id", tenant)];
        let answer = send(saga.api(), "POST", "/orders", &headers, Some(body.clone()))
            .await
            .unwrap();
        assert_eq!(
            (answer.status, answer.replayed),
            (201, false),
            "{tenant}: a new order, not the other tenant's replayed: {}",
            answer.body
        );
        order_ids.push(answer.body["order_id"].as_str().unwrap().to_owned());
    }
    assert_ne!(order_ids[0], order_ids[1]);
    saga.wait_finished(2).await;

    // The gateway's ledger: two charges with different ids, each for its own order.
    let gateway = quote_ident(&saga.args.gateway_schema());
    let payment = quote_ident(&saga.args.schema(Service::Payment));
    let charges: Vec<(String, String, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT c.order_id::text, c.charge_id, p.charge_id FROM {gateway}.gateway_charges c \
         JOIN {payment}.payments p ON p.order_id = c.order_id WHERE NOT c.declined ORDER BY 1"
    )))
    .fetch_all(&saga.db.pool)
    .await
    .unwrap();
    assert_eq!(charges.len(), 2, "two charges: {charges:?}");
    assert_ne!(charges[0].1, charges[1].1, "different charge ids");
    let mut expected_orders = order_ids.clone();
    expected_orders.sort();
    assert_eq!(
        charges.iter().map(|c| c.0.clone()).collect::<Vec<_>>(),
        expected_orders
    );
    for (order_id, gateway_charge, recorded_charge) in &charges {
        assert_eq!(
            gateway_charge, recorded_charge,
            "order {order_id} is paid with its own charge"
        );
    }
    for order_id in &order_ids {
        let view = saga.get(&format!("/orders/{order_id}")).await;
        assert_eq!(view.body["status"], "COMPLETED", "{}", view.body);
    }
    let facts = ledger::read_facts(&saga.db.pool, &saga.args).await.unwrap();
    assert!(
        facts.values().all(|f| f.charges == 1 && f.shipments == 1),
        "{facts:?}"
    );
    saga.stop().await;
}
