//! The three services running inside a test process, on schemas and topics of their own, against the real
//! PostgreSQL and the real broker: the fixture of the end-to-end tests (here and in the operators'
//! toolkit).

use std::net::SocketAddr;
use std::time::Duration;

use saga_consumer::settings::KafkaArgs;
use saga_test_support::{
    TestDb, TestKafka, free_local_addr, sasl_ssl_env, unique_name, wait_until,
};
use tokio_util::sync::CancellationToken;

use crate::harness::client::{self, send};
use crate::harness::ledger;
use saga_examples::service::{Service, ServiceArgs, quote_ident};

/// How long the fixture waits for the services and for sagas to finish.
pub const WAIT: Duration = Duration::from_secs(120);

/// The three services, started in this process.
pub struct LocalSaga {
    /// The test database (the services' schemas are in it).
    pub db: TestDb,
    /// The broker.
    pub kafka: TestKafka,
    /// The services' settings: schemas, topics, groups, the API's address.
    pub args: ServiceArgs,
    stop: CancellationToken,
    services: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl std::fmt::Debug for LocalSaga {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalSaga")
            .field("args", &self.args)
            .finish_non_exhaustive()
    }
}

impl LocalSaga {
    /// Starts the choreographed saga; `name` names its schemas and topics.
    pub async fn start(name: &str) -> Self {
        Self::start_with(name, false).await
    }

    /// Starts the saga, orchestrated or choreographed, and waits until its order API answers.
    pub async fn start_with(name: &str, orchestrated: bool) -> Self {
        Self::start_on(name, orchestrated, TestKafka::new().await, &[]).await
    }

    /// Starts the choreographed saga on the secured broker `scripts/dev-services` starts: every client of
    /// every service (consumers, relays, topic creation) over SASL_SSL with SCRAM-SHA-512 and the local CA.
    pub async fn start_secured(name: &str) -> Self {
        Self::start_on(name, false, TestKafka::secured().await, &sasl_ssl_env()).await
    }

    /// Starts the saga on `kafka`, its services given the Kafka settings `security` (variables and values,
    /// read through the framework's declarations as a service reads its environment).
    async fn start_on(
        name: &str,
        orchestrated: bool,
        kafka: TestKafka,
        security: &[(&str, String)],
    ) -> Self {
        // The schema of its own only makes sure the test database exists; the services make theirs.
        let db = TestDb::empty(name).await;
        let prefix = unique_name(name);
        let mut args = ServiceArgs::local(
            TestDb::database_url(),
            kafka.brokers.clone(),
            format!("e2e_{}", prefix.replace('-', "_")),
            prefix,
        );
        args.saga.kafka = KafkaArgs::from_vars(|var| {
            security
                .iter()
                .find(|(name, _)| *name == var)
                .map(|(_, value)| value.clone())
        })
        .expect("the security settings parse");
        args.saga.kafka.brokers = Some(kafka.brokers.clone());
        args.http_addr = free_local_addr();
        args.gateway_latency_ms = 1;
        args.orchestrated = orchestrated;
        for topic in args.all_topics() {
            kafka.create_topic(&topic, 3).await;
        }
        let stop = CancellationToken::new();
        let services = Service::ALL
            .iter()
            .map(|service| {
                tokio::spawn(saga_examples::service::run(
                    *service,
                    args.clone(),
                    stop.clone().cancelled_owned(),
                ))
            })
            .collect();
        let saga = Self {
            db,
            kafka,
            args,
            stop,
            services,
        };
        wait_until("the order API", WAIT, || async {
            // A service that stopped (its port taken, its database unreachable) fails the test here, before
            // a request can reach some other process listening on that port.
            if let Some(stopped) = saga.services.iter().position(|s| s.is_finished()) {
                panic!(
                    "the {} service stopped while starting",
                    Service::ALL[stopped].as_str()
                );
            }
            send(
                saga.api(),
                "GET",
                "/orders/00000000-0000-0000-0000-000000000000",
                &[],
                None,
            )
            .await
            .ok()
            .filter(|a| a.status == 404)
        })
        .await;
        saga
    }

    /// The order API's address.
    pub fn api(&self) -> SocketAddr {
        self.args.http_addr
    }

    /// `GET path` on the order API.
    pub async fn get(&self, path: &str) -> client::Answer {
        send(self.api(), "GET", path, &[], None).await.unwrap()
    }

    /// Waits until `n` orders finished (completed or cancelled).
    pub async fn wait_finished(&self, n: i64) {
        wait_until(&format!("{n} finished sagas"), WAIT, || async {
            let finished = ledger::finished_orders(&self.db.pool, &self.args)
                .await
                .ok()?;
            (finished >= n).then_some(())
        })
        .await;
    }

    /// Takes the payment gateway down (every charge and refund fails as unavailable) or brings it back.
    pub async fn gateway_down(&self, down: bool) {
        let gateway = quote_ident(&self.args.gateway_schema());
        let sql = if down {
            format!(
                "INSERT INTO {gateway}.gateway_outage (down) VALUES (true) ON CONFLICT DO NOTHING"
            )
        } else {
            format!("DELETE FROM {gateway}.gateway_outage")
        };
        // The payment service creates the gateway's tables while it starts, which may still be under way
        // when the order API already answers.
        wait_until("the gateway's outage switch", WAIT, || async {
            sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                .execute(&self.db.pool)
                .await
                .ok()
        })
        .await;
    }

    /// Stops the services (each must stop cleanly) and drops their schemas.
    pub async fn stop(self) {
        self.stop.cancel();
        for service in self.services {
            tokio::time::timeout(WAIT, service)
                .await
                .expect("services stop")
                .unwrap()
                .expect("services stop cleanly");
        }
        for service in Service::ALL {
            drop_schema(&self.db, &self.args.schema(service)).await;
        }
        drop_schema(&self.db, &self.args.gateway_schema()).await;
    }
}

async fn drop_schema(db: &TestDb, schema: &str) {
    super::drop_schema(&db.pool, schema).await.unwrap();
}
