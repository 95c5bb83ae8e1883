//! The example saga tested with the test kit (`saga-testing`): the three services in this process, on
//! librdkafka's mock cluster and the real PostgreSQL. Orders go in through the order service's routes; the
//! tests wait until the system is quiet and assert on the events published, the orders' states and the
//! gateway's ledger, through a crash of each participant before its offset commit, and, orchestrated,
//! through a shipping service that never answers until the clock is moved past the step's timeout.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use saga_consumer::SagaServiceBuilder;
use saga_examples::events::{
    OrderRequest, PaymentProcessed, PaymentSetback, RefundReply, ShipmentArranged, Topics,
};
use saga_examples::order::{self, OrderSaga};
use saga_examples::service::{self, Service, ServiceArgs, quote_ident};
use saga_orchestrator::SagaStatus;
use saga_testing::{SagaTest, ServiceSetup, http};
use uuid::Uuid;

/// The saga's services in a kit test, and the order service's routes.
struct Saga {
    test: SagaTest,
    args: ServiceArgs,
    routes: Arc<Mutex<Option<Router>>>,
}

impl Saga {
    /// Starts `services` (the order service among them), choreographed or orchestrated.
    async fn start(name: &str, orchestrated: bool, services: &[Service]) -> Self {
        let mut test = SagaTest::start(name).await.unwrap();
        let mut args = ServiceArgs::local("", "", test.name(), test.name());
        args.orchestrated = orchestrated;
        args.gateway_latency_ms = 0;
        for topic in args.all_topics() {
            test.create_topic(&topic).unwrap();
        }
        let routes = Arc::new(Mutex::new(None));
        for service in services {
            let (service, routes, args) = (*service, routes.clone(), args.clone());
            test.service_async(service.as_str(), move |s| {
                setup(service, args.clone(), s, routes.clone())
            })
            .await
            .unwrap();
        }
        Self { test, args, routes }
    }

    fn topics(&self) -> Topics {
        self.args.topics()
    }

    /// `POST /orders` with idempotency key `key`. Returns the order's id.
    async fn order(&self, key: &str, card: &str, ship_to: &str) -> Uuid {
        let request = OrderRequest {
            customer: "ada".to_owned(),
            amount_cents: 1250,
            card: card.to_owned(),
            ship_to: ship_to.to_owned(),
        };
        let body = serde_json::to_value(&request).unwrap();
        let routes = self.routes.lock().unwrap().clone().unwrap();
        let answer = http::send(
            &routes,
            "POST",
            "/orders",
            &[("idempotency-key", key)],
            Some(&body),
        )
        .await
        .unwrap();
        assert_eq!(answer.status, 201, "{}", answer.text);
        answer.json["order_id"].as_str().unwrap().parse().unwrap()
    }

    /// The order's status, as `GET /orders/{id}` shows it.
    async fn status(&self, order: Uuid) -> String {
        let routes = self.routes.lock().unwrap().clone().unwrap();
        let answer = http::send(&routes, "GET", &format!("/orders/{order}"), &[], None)
            .await
            .unwrap();
        answer.json["status"].as_str().unwrap().to_owned()
    }

    /// The gateway's charges and refunds.
    async fn ledger(&self) -> (i64, i64) {
        let gateway = quote_ident(&self.args.gateway_schema());
        let count = |table: &str| {
            let sql = format!("SELECT count(*) FROM {gateway}.{table}");
            let pool = self.test.pool("payment").unwrap().clone();
            async move {
                sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                    .fetch_one(&pool)
                    .await
                    .unwrap()
            }
        };
        (
            count("gateway_charges").await,
            count("gateway_refunds").await,
        )
    }

    /// The gateway's charges without a call time (`call_ms`, which saga-bench takes out of a saga's time).
    async fn untimed_charges(&self) -> i64 {
        let gateway = quote_ident(&self.args.gateway_schema());
        let pool = self.test.pool("payment").unwrap().clone();
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {gateway}.gateway_charges WHERE call_ms IS NULL OR call_ms < 0"
        )))
        .fetch_one(&pool)
        .await
        .unwrap()
    }

    async fn stop(self) {
        let gateway = quote_ident(&self.args.gateway_schema());
        let pool = self.test.pool("payment").unwrap().clone();
        self.test.stop().await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA {gateway} CASCADE"
        )))
        .execute(&pool)
        .await
        .unwrap();
    }
}

/// Sets up `service` as its binary does, on the kit's schema, broker and clock; the order service's routes
/// go to `routes`.
async fn setup(
    service: Service,
    mut args: ServiceArgs,
    s: ServiceSetup,
    routes: Arc<Mutex<Option<Router>>>,
) -> anyhow::Result<SagaServiceBuilder> {
    args.saga.database.database_url = Some(s.database_url().to_owned());
    args.saga.kafka.brokers = Some(s.brokers().to_owned());
    service::migrate(service, &args, s.pool()).await?;
    if service != Service::Order {
        return service::steps(service, &args, s.pool(), s.builder()).await;
    }
    let (builder, orchestrator) = if args.orchestrated {
        let orchestrator = s.orchestrator(service::orchestrator(&args)?);
        (s.builder().with(orchestrator.clone()), Some(orchestrator))
    } else {
        let builder = service::steps(service, &args, s.pool(), s.builder()).await?;
        (builder, None)
    };
    let app = order::router(
        s.pool().clone(),
        args.topics(),
        &builder.outbox(),
        orchestrator,
        None,
    );
    *routes.lock().unwrap() = Some(app);
    Ok(builder)
}

/// What the three orders must have led to: one charge and one shipment for the paid order, a declined
/// charge and a cancellation, a refund and a cancellation for the one that could not be shipped.
async fn check(saga: &Saga, paid: Uuid, declined: Uuid, unshippable: Uuid) {
    let topics = saga.topics();
    let payments = saga.test.published(&topics.payments).await.unwrap();
    assert_eq!(payments.len(), 2, "two orders charged");
    payments.one(|p: &PaymentProcessed| p.order_id == paid);
    let setbacks = saga.test.published(&topics.payment_setbacks).await.unwrap();
    setbacks.one(|s| matches!(s, PaymentSetback::PaymentFailed(s) if s.order_id == declined));
    setbacks.one(|s| matches!(s, PaymentSetback::PaymentRefunded(s) if s.order_id == unshippable));
    let shipments = saga.test.published(&topics.shipments).await.unwrap();
    assert_eq!(shipments.len(), 1);
    shipments.one(|s: &ShipmentArranged| s.order_id == paid);
    assert_eq!(saga.status(paid).await, "COMPLETED");
    assert_eq!(saga.status(declined).await, "CANCELLED");
    assert_eq!(saga.status(unshippable).await, "CANCELLED");
    // The ground truth: three charges (the declined one recorded as such), one refund.
    assert_eq!(saga.ledger().await, (3, 1));
    assert_eq!(
        saga.untimed_charges().await,
        0,
        "each charge keeps its call's time"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_path_of_the_choreographed_saga_once_through_a_crash_of_each_participant() {
    let mut saga = Saga::start("example-paths", false, &Service::ALL).await;
    let paid = saga.order("happy", "4242", "Lisbon").await;
    let declined = saga.order("declined", "0002", "Lisbon").await;
    let unshippable = saga.order("atlantis", "4242", "Atlantis").await;
    saga.test.wait_quiet().await.unwrap();
    check(&saga, paid, declined, unshippable).await;
    for participant in ["payment", "shipping", "order"] {
        let again = saga
            .test
            .crash_before_offset_commit(participant)
            .await
            .unwrap();
        assert!(again > 0, "{participant} consumed nothing");
    }
    saga.test.wait_quiet().await.unwrap();
    // Every order's charge was delivered to the payment service again, and skipped.
    let skipped = saga
        .test
        .ops("payment")
        .unwrap()
        .sample("saga_consumer_duplicates_total", "step=\"process-payment\"");
    assert_eq!(skipped, Some(3.0));
    check(&saga, paid, declined, unshippable).await;
    saga.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_orchestrated_order_whose_shipment_never_answers_is_refunded_when_its_timeout_fires() {
    // No shipping service: the shipment step's command is never answered.
    let mut saga = Saga::start("example-timeout", true, &[Service::Order, Service::Payment]).await;
    let order = saga.order("stranded", "4242", "Lisbon").await;
    saga.test.wait_quiet().await.unwrap();
    assert_eq!(saga.status(order).await, "PAID");
    let running = saga
        .test
        .saga::<OrderSaga>("order", "stranded")
        .await
        .unwrap();
    let running = running.expect("the order started its saga");
    assert_eq!(running.status, SagaStatus::Running);
    let charged = running
        .data
        .payment
        .as_ref()
        .expect("the payment step's reply");
    assert_eq!(charged.order_id, order);
    assert!(running.data.shipment.is_none(), "no shipment answered");

    saga.test.advance(Duration::from_secs(60));
    saga.test.wait_quiet().await.unwrap();
    let done = saga
        .test
        .saga::<OrderSaga>("order", "stranded")
        .await
        .unwrap();
    let done = done.unwrap();
    assert_eq!(done.status, SagaStatus::Compensated, "{done:?}");
    assert!(done.failure.is_some(), "{done:?}");
    assert_eq!(saga.status(order).await, "CANCELLED");
    let replies = saga
        .test
        .published(&saga_consumer::Topic::<RefundReply>::new(
            saga.topics().order_replies.clone(),
        ))
        .await
        .unwrap();
    replies.one(|r| matches!(r, RefundReply::PaymentRefunded(s) if s.order_id == order));
    // The participant answered the orchestrator's commands (`ctx.reply`): nothing on the choreographed
    // saga's topics.
    let topics = saga.topics();
    assert_eq!(
        saga.test.published(&topics.payments).await.unwrap().len(),
        0
    );
    assert_eq!(
        saga.test
            .published(&topics.payment_setbacks)
            .await
            .unwrap()
            .len(),
        0
    );
    assert_eq!(saga.ledger().await, (1, 1), "charged once, refunded once");
    saga.stop().await;
}
