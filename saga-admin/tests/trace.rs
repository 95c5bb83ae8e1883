//! `saga trace`: one choreographed saga across the three services of the example, on the real broker and
//! PostgreSQL. A payment dead-lettered during a gateway outage, replayed, then completed: the trace shows
//! the HTTP request, the dead letter, the replay, each service's steps and the events they published
//! (with where the broker put them), in the order they happened.

mod common;

use saga_admin::dlq::{self, DlqFilter};
use saga_config::KafkaConfig;
use saga_examples::service::Service;
use saga_lab::harness::client;
use saga_lab::harness::ledger::Path;
use saga_lab::harness::local::{LocalSaga, WAIT};
use saga_lab::harness::run::plan;
use saga_test_support::wait_until;
use serde_json::Value;

use common::Target;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_trace_follows_one_saga_through_every_service_its_dead_letter_and_its_replay() {
    let saga = LocalSaga::start("admin-trace").await;
    let kafka = KafkaConfig::new(saga.args.brokers().to_owned());
    let dlq_topic = saga.args.dlq(Service::Payment);
    let payments = Target {
        database_url: saga.args.database_url().to_owned(),
        schema: saga.args.schema(Service::Payment),
        brokers: saga.args.brokers().to_owned(),
    };
    let payments_pool = common::schema_pool(
        saga.args.database_url(),
        &saga.args.schema(Service::Payment),
    )
    .await;

    // The gateway is down: the payment is dead-lettered. Back up, the letter is replayed, the saga ends.
    saga.gateway_down(true).await;
    let order = plan(&format!("admin-trace-{}", uuid::Uuid::new_v4().simple()), 1)
        .into_iter()
        .find(|o| o.path == Path::Happy)
        .unwrap();
    client::submit_order(saga.api(), &order.key, &order.request, false, WAIT)
        .await
        .unwrap();
    wait_until("the payment's dead letter", WAIT, || async {
        let letters = dlq::list(&kafka, &payments_pool, &dlq_topic, &DlqFilter::default())
            .await
            .ok()?;
        (!letters.is_empty()).then_some(())
    })
    .await;
    saga.gateway_down(false).await;
    payments
        .text(&[
            "dlq",
            "replay",
            "--topic",
            &dlq_topic,
            "--operator",
            "grace",
        ])
        .await;
    saga.wait_finished(1).await;

    // Its own services' schemas, named: the database is shared with other tests, whose tables may be
    // locked meanwhile (a trace names such a list as not read, and exits 1).
    let schemas =
        [Service::Order, Service::Payment, Service::Shipping].map(|s| saga.args.schema(s));
    let trace_of = |key: &str| {
        let mut args = vec!["trace".to_owned(), key.to_owned()];
        for schema in &schemas {
            args.extend(["--in-schema".to_owned(), schema.clone()]);
        }
        args
    };
    let args = trace_of(&order.key);
    let trace = payments
        .json(&args.iter().map(String::as_str).collect::<Vec<_>>())
        .await;
    let events = trace["events"].as_array().unwrap();
    let lanes: Vec<&str> = trace["lanes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect();
    for service in [Service::Order, Service::Payment, Service::Shipping] {
        assert!(
            lanes.contains(&saga.args.schema(service).as_str()),
            "{service:?} has a lane: {lanes:?}"
        );
    }
    let times: Vec<&str> = events.iter().map(|e| e["at"].as_str().unwrap()).collect();
    let parsed: Vec<chrono::DateTime<chrono::Utc>> =
        times.iter().map(|t| t.parse().unwrap()).collect();
    assert!(
        parsed.windows(2).all(|w| w[0] <= w[1]),
        "by time: {times:?}"
    );

    let position = |pred: &dyn Fn(&Value) -> bool, what: &str| {
        events
            .iter()
            .position(pred)
            .unwrap_or_else(|| panic!("no {what} in {events:#?}"))
    };
    let payment_lane = saga.args.schema(Service::Payment);
    let in_payments = |e: &Value| e["lane"] == payment_lane.as_str();
    let http = position(
        &|e| e["kind"] == "http" && e["lane"] == saga.args.schema(Service::Order).as_str(),
        "HTTP request in the order service",
    );
    let dead = position(
        &|e| in_payments(e) && e["kind"] == "dead-letter" && e["status"] == "retries-exhausted",
        "dead letter of the payment",
    );
    let replay = position(
        &|e| {
            in_payments(e)
                && e["kind"] == "replay"
                && e["detail"].as_str().unwrap().contains("by grace")
        },
        "replay by grace",
    );
    let charged = position(
        &|e| {
            in_payments(e)
                && e["kind"] == "step"
                && e["subject"] == "process-payment"
                && e["status"] == "completed"
        },
        "process-payment completed",
    );
    let published = position(
        &|e| {
            in_payments(e)
                && e["kind"] == "emitted"
                && e["subject"] == "process-payment"
                && e["status"] == "published"
        },
        "the payment's event, published",
    );
    assert!(
        http < dead && dead < replay && replay <= charged,
        "in the order it happened: http {http}, dead letter {dead}, replay {replay}, charged {charged}"
    );
    let detail = events[published]["detail"].as_str().unwrap();
    let at = detail
        .rsplit_once(" at ")
        .map(|(_, at)| at.rsplitn(3, '/').collect::<Vec<_>>());
    assert!(
        at.as_ref().is_some_and(|parts| parts.len() == 3
            && parts[0].parse::<i64>().is_ok()
            && parts[1].parse::<i32>().is_ok()),
        "where the broker put it (topic/partition/offset): {detail}"
    );
    assert!(
        events.iter().any(
            |e| e["lane"] == saga.args.schema(Service::Shipping).as_str()
                && e["kind"] == "step"
                && e["status"] == "completed"
        ),
        "the shipping service's step"
    );

    // Another key: nothing.
    let args = trace_of("no-such-order");
    let none = payments
        .json(&args.iter().map(String::as_str).collect::<Vec<_>>())
        .await;
    assert_eq!(none["events"].as_array().unwrap().len(), 0);
    // A schema that holds no keys is refused in one line.
    let output = payments
        .run(&["trace", &order.key, "--in-schema", "pg_catalog"])
        .await;
    assert_eq!(output.status.code(), Some(2));
}
