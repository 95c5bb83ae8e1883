//! Dead letters replayed with `saga dlq replay`, end to end on the real broker and the real PostgreSQL:
//! payments dead-lettered during a gateway outage complete their sagas once the gateway is back, each
//! charged once; a second replay sends nothing; a forced replay of a message that already took effect
//! changes nothing downstream; a dead letter of the crash-loop guard, replayed, is processed, not
//! dead-lettered again. Along the way: the filters, `--dry-run`, `--json`, `keys show`, `lag`, `outbox
//! status`.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use saga_admin::dlq::{self, DlqFilter};
use saga_config::KafkaConfig;
use saga_examples::service::{Service, quote_ident};
use saga_lab::harness::client;
use saga_lab::harness::ledger::{self, Path};
use saga_lab::harness::local::{LocalSaga, WAIT};
use saga_lab::harness::run::plan;
use saga_test_support::wait_until;

use common::{Target, outcomes};

/// Waits until the payment service's group committed everything there is on the orders topic.
async fn wait_payments_caught_up(saga: &LocalSaga) {
    let topic = saga.args.topics().orders.name().to_owned();
    let group = saga.args.group(Service::Payment);
    wait_until("the payment service caught up", WAIT, || async {
        let end = saga.kafka.end_offsets(&topic).await;
        let committed = saga.kafka.committed_offsets(&group, &topic).await;
        end.iter()
            .all(|(p, e)| *e == 0 || committed.get(p) == Some(e))
            .then_some(())
    })
    .await;
}

async fn order_status(saga: &LocalSaga, order_id: &str) -> String {
    saga.get(&format!("/orders/{order_id}")).await.body["status"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

async fn wait_status(saga: &LocalSaga, order_id: &str, status: &str) {
    wait_until(&format!("order {order_id} {status}"), WAIT, || async {
        (order_status(saga, order_id).await == status).then_some(())
    })
    .await;
}

async fn count(saga: &LocalSaga, sql: String) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(&saga.db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn payments_dead_lettered_in_a_gateway_outage_are_replayed_once_and_complete_their_sagas() {
    let saga = LocalSaga::start("admin-replay").await;
    let dlq_topic = saga.args.dlq(Service::Payment);
    let payment_schema = saga.args.schema(Service::Payment);
    let payments = Target {
        database_url: saga.args.database_url().to_owned(),
        schema: payment_schema.clone(),
        brokers: saga.args.brokers().to_owned(),
    };
    let kafka = KafkaConfig::new(saga.args.brokers().to_owned());
    let payments_pool = common::schema_pool(saga.args.database_url(), &payment_schema).await;

    // The gateway is down: both payments fail past the retry budget and are dead-lettered.
    saga.gateway_down(true).await;
    let orders: Vec<_> = plan("admin-replay", 6)
        .into_iter()
        .filter(|o| o.path == Path::Happy)
        .take(2)
        .collect();
    let mut ids = Vec::new();
    for order in &orders {
        let submitted = client::submit_order(saga.api(), &order.key, &order.request, false, WAIT)
            .await
            .unwrap();
        ids.push(submitted.order_id.unwrap());
    }
    let letters = wait_until("two dead letters", WAIT, || async {
        let letters = dlq::list(&kafka, &payments_pool, &dlq_topic, &DlqFilter::default())
            .await
            .ok()?;
        (letters.len() >= 2).then_some(letters)
    })
    .await;
    assert_eq!(letters.len(), 2);
    // As the index holds them; their messages, as the topic does.
    let letters = dlq::with_records(&kafka, &payments_pool, letters)
        .await
        .unwrap();
    assert_eq!(letters.len(), 2);
    for letter in &letters {
        assert_eq!(letter.reason, "retries-exhausted", "{letter:?}");
        assert_eq!(letter.step.as_deref(), Some("process-payment"));
        assert_eq!(letter.attempts, 5, "the default retry budget");
        assert_eq!(
            letter.original_topic,
            saga.args.topics().orders.name().to_owned()
        );
        assert!(
            letter.error.contains("gateway unavailable"),
            "{}",
            letter.error
        );
    }
    let keys: BTreeSet<_> = letters
        .iter()
        .map(|l| l.idempotency_key.clone().unwrap())
        .collect();
    assert_eq!(keys, orders.iter().map(|o| o.key.clone()).collect());
    let facts = ledger::read_facts(&saga.db.pool, &saga.args).await.unwrap();
    assert!(
        facts
            .values()
            .all(|f| f.charges == 0 && f.status == "PENDING"),
        "{facts:?}"
    );
    let (a, b) = (&orders[0].key, &orders[1].key);
    let (a_id, b_id) = (&ids[0], &ids[1]);
    let letter_of = |key: &str| {
        letters
            .iter()
            .find(|l| l.idempotency_key.as_deref() == Some(key))
            .unwrap()
    };

    // A copy of B's dead letter as the crash-loop guard would have written it.
    let crafted: Vec<(String, String)> = letter_of(b)
        .record
        .headers
        .iter()
        .map(|(n, v)| {
            let v = String::from_utf8_lossy(v.as_deref().unwrap_or_default()).into_owned();
            (
                n.clone(),
                if n == "dlq-reason" {
                    "crash-loop".to_owned()
                } else {
                    v
                },
            )
        })
        .collect();
    let headers: Vec<(&str, &str)> = crafted
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    let producer = saga.kafka.producer();
    let b_record = &letter_of(b).record;
    saga.kafka
        .produce_to(
            &producer,
            &dlq_topic,
            Some(b_record.partition),
            b_record
                .key
                .as_deref()
                .map(|k| std::str::from_utf8(k).unwrap()),
            &headers,
            b_record.payload.as_deref().unwrap(),
        )
        .await;

    // The filters select what they say.
    let listed = payments.json(&["dlq", "list", "--topic", &dlq_topic]).await;
    assert_eq!(listed.as_array().unwrap().len(), 3);
    let crash = payments
        .json(&[
            "dlq",
            "list",
            "--topic",
            &dlq_topic,
            "--letter-reason",
            "crash-loop",
        ])
        .await;
    let crash = crash.as_array().unwrap();
    assert_eq!(crash.len(), 1);
    assert_eq!(crash[0]["idempotency_key"], b.as_str());
    assert_eq!(
        crash[0]["original_topic"],
        saga.args.topics().orders.name().to_owned()
    );
    let by_step = payments
        .json(&[
            "dlq",
            "list",
            "--topic",
            &dlq_topic,
            "--step",
            "process-payment",
            "--since",
            "1h",
        ])
        .await;
    assert_eq!(by_step.as_array().unwrap().len(), 3);
    let other_step = payments
        .json(&[
            "dlq",
            "list",
            "--topic",
            &dlq_topic,
            "--step",
            "arrange-shipment",
        ])
        .await;
    assert_eq!(other_step.as_array().unwrap().len(), 0);
    let limited = payments
        .json(&["dlq", "list", "--topic", &dlq_topic, "--limit", "1"])
        .await;
    assert_eq!(limited.as_array().unwrap().len(), 1);
    let table = payments.text(&["dlq", "list", "--topic", &dlq_topic]).await;
    assert!(
        table.contains("3 dead letters") && table.contains(a.as_str()),
        "{table}"
    );
    let a_letter = letter_of(a);
    let shown = payments
        .text(&[
            "dlq",
            "show",
            "--topic",
            &dlq_topic,
            "--partition",
            &a_letter.partition.to_string(),
            "--offset",
            &a_letter.offset.to_string(),
        ])
        .await;
    assert!(
        shown.contains("dlq-reason")
            && shown.contains("retries-exhausted")
            && shown.contains(a_id.as_str()),
        "{shown}"
    );

    // A dry run says what it would send and sends nothing.
    let orders_topic = saga.args.topics().orders.name().to_owned();
    let before = saga.kafka.end_offsets(&orders_topic).await;
    let dry = payments
        .json(&["dlq", "replay", "--topic", &dlq_topic, "--dry-run"])
        .await;
    assert_eq!(outcomes(&dry), (0, vec!["would-send".to_owned(); 3]));
    assert_eq!(saga.kafka.end_offsets(&orders_topic).await, before);
    let recorded = quote_ident(&payment_schema);
    assert_eq!(
        count(&saga, format!("SELECT count(*) FROM pg_tables WHERE schemaname = '{payment_schema}' AND tablename = 'saga_dlq_replays'")).await,
        0,
        "a dry run creates nothing either"
    );

    // The gateway is back. The crash-loop copy, replayed, is processed: B completes, and nothing is
    // dead-lettered again.
    saga.gateway_down(false).await;
    let report = payments
        .json(&[
            "dlq",
            "replay",
            "--topic",
            &dlq_topic,
            "--letter-reason",
            "crash-loop",
        ])
        .await;
    assert_eq!(outcomes(&report), (1, vec!["sent".to_owned()]));
    wait_status(&saga, b_id, "COMPLETED").await;

    // The retries-exhausted letters: A completes; B's payment had taken effect, its replay is a no-op.
    let report = payments
        .json(&[
            "dlq",
            "replay",
            "--topic",
            &dlq_topic,
            "--letter-reason",
            "retries-exhausted",
        ])
        .await;
    assert_eq!(outcomes(&report).0, 2, "{report}");
    wait_status(&saga, a_id, "COMPLETED").await;
    wait_payments_caught_up(&saga).await;
    let facts = ledger::read_facts(&saga.db.pool, &saga.args).await.unwrap();
    assert_eq!(facts.len(), 2);
    assert!(
        facts
            .values()
            .all(|f| f.charges == 1 && f.shipments == 1 && f.status == "COMPLETED"),
        "one charge and one shipment per order: {facts:?}"
    );
    assert_eq!(
        count(
            &saga,
            format!("SELECT sum(replays) FROM {recorded}.saga_dlq_replays")
        )
        .await,
        3
    );

    // The same replay again sends nothing.
    let again = payments
        .json(&["dlq", "replay", "--topic", &dlq_topic])
        .await;
    assert_eq!(
        outcomes(&again),
        (0, vec!["already-replayed".to_owned(); 3])
    );

    // Forced, A's letter is sent again: its step key absorbs it, nothing changes downstream.
    let outbox_before = count(
        &saga,
        format!("SELECT count(*) FROM {recorded}.saga_outbox"),
    )
    .await;
    let forced = payments
        .json(&[
            "dlq",
            "replay",
            "--topic",
            &dlq_topic,
            "--force",
            "--partition",
            &a_letter.partition.to_string(),
            "--offset",
            &a_letter.offset.to_string(),
        ])
        .await;
    assert_eq!(outcomes(&forced), (1, vec!["sent".to_owned()]));
    wait_payments_caught_up(&saga).await;
    // The shipping and order services have seen whatever the payment service emitted by now.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = ledger::read_facts(&saga.db.pool, &saga.args).await.unwrap();
    assert!(
        after
            .values()
            .all(|f| f.charges == 1 && f.shipments == 1 && f.status == "COMPLETED"),
        "{after:?}"
    );
    assert_eq!(
        count(
            &saga,
            format!("SELECT count(*) FROM {recorded}.saga_outbox")
        )
        .await,
        outbox_before,
        "the duplicate emitted nothing"
    );
    assert!(
        ledger::steps_run_twice(&saga.db.pool, &saga.args)
            .await
            .unwrap()
            .is_empty()
    );
    let dead = dlq::list(&kafka, &payments_pool, &dlq_topic, &DlqFilter::default())
        .await
        .unwrap();
    assert_eq!(dead.len(), 3, "no replayed message was dead-lettered again");

    // The step keys of A: the payment's, completed after its failed attempts; and in the order service's
    // schema the HTTP key beside the order's own steps.
    let a_keys = payments.json(&["keys", "show", a]).await;
    let a_keys = a_keys.as_array().unwrap();
    assert_eq!(a_keys.len(), 1, "{a_keys:?}");
    assert_eq!(a_keys[0]["step"], "process-payment");
    assert_eq!(a_keys[0]["status"], "completed");
    let holder = a_keys[0]["lease_holder"].as_str().unwrap_or_default();
    assert!(
        holder.starts_with(&format!("{}@", saga.args.group(Service::Payment))),
        "the two-phase lease names its holder: {holder}"
    );
    assert!(
        a_keys[0]["external_key"]
            .as_str()
            .unwrap()
            .contains(a.as_str())
    );
    let orders_target = Target {
        schema: saga.args.schema(Service::Order),
        ..payments.clone()
    };
    let order_keys = orders_target
        .json(&["keys", "show", a, "--tenant", "default"])
        .await;
    let steps: BTreeSet<_> = order_keys
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["step"].as_str().unwrap().to_owned())
        .collect();
    assert!(
        steps.contains("create-order") && steps.contains("complete-order"),
        "{steps:?}"
    );
    let none = orders_target
        .json(&["keys", "show", a, "--tenant", "someone-else"])
        .await;
    assert_eq!(none.as_array().unwrap().len(), 0);
    let expired = payments.json(&["leases", "--expired"]).await;
    assert_eq!(
        expired.as_array().unwrap().len(),
        0,
        "no external call hangs"
    );

    // Lag and the outbox: all caught up.
    let lag = payments
        .json(&[
            "lag",
            "--group",
            &saga.args.group(Service::Payment),
            "--topic",
            &orders_topic,
        ])
        .await;
    let lag = lag.as_array().unwrap();
    assert_eq!(lag.len(), 3, "one row per partition");
    assert!(lag.iter().all(|p| p["lag"] == 0), "{lag:?}");
    let status = payments.json(&["outbox", "status"]).await;
    assert_eq!(status["unpublished"], 0, "{status}");

    saga.stop().await;
}
