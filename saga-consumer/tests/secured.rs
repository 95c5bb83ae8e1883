//! A service on a broker that asks every client for a certificate (mutual TLS): with the client certificate
//! and its encrypted key (and the key's passphrase), the service consumes, runs its step once per message,
//! commits its offsets and publishes what the step emits; without a certificate it stops at start with one
//! line naming the setting.

use std::time::Duration;

use saga_consumer::settings::KafkaArgs;
use saga_consumer::{ConfigError, KafkaConfig, SagaService, ServiceError};
use saga_test_support::{
    KEY_PASSPHRASE, MutualTlsFront, PrivateBroker, TestDb, TestKafka, tls_file, unique_name,
    wait_until,
};
use tokio_util::sync::CancellationToken;

mod steps;

use steps::{place_orders, read_reserved, reserve_on, stop_service};

const WAIT: Duration = Duration::from_secs(60);

/// A broker of the test's own behind a mutual-TLS front; the front's address is what clients reach.
async fn mutual_tls_broker() -> (PrivateBroker, MutualTlsFront) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let front_addr = listener.local_addr().unwrap().to_string();
    let broker = PrivateBroker::launch_behind("mtls", Some(front_addr)).await;
    let front = MutualTlsFront::start(listener, broker.brokers.clone());
    (broker, front)
}

/// The settings of a client with the local CA's client certificate, read as a service reads them.
fn mutual_tls_args(brokers: &str, with_certificate: bool) -> KafkaArgs {
    let mut vars = vec![
        ("KAFKA_BROKERS", brokers.to_owned()),
        ("KAFKA_SECURITY_PROTOCOL", "ssl".to_owned()),
        (
            "KAFKA_SSL_CA_LOCATION",
            tls_file("ca.pem").display().to_string(),
        ),
    ];
    if with_certificate {
        vars.extend([
            (
                "KAFKA_SSL_CERTIFICATE_LOCATION",
                tls_file("client.pem").display().to_string(),
            ),
            (
                "KAFKA_SSL_KEY_LOCATION",
                tls_file("client-encrypted.key").display().to_string(),
            ),
            ("KAFKA_SSL_KEY_PASSWORD", KEY_PASSPHRASE.to_owned()),
        ]);
    }
    KafkaArgs::from_vars(|var| {
        vars.iter()
            .find(|(name, _)| *name == var)
            .map(|(_, value)| value.clone())
    })
    .unwrap()
}

fn properties(config: &KafkaConfig) -> Vec<(String, String)> {
    config.properties.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_service_with_a_client_certificate_runs_over_mutual_tls() {
    let (_broker, front) = mutual_tls_broker().await;
    let kafka_config = mutual_tls_args(&front.brokers, true).config().unwrap();
    let kafka = TestKafka::with_properties(&front.brokers, properties(&kafka_config)).await;
    let db = TestDb::empty("mtls-service").await;
    sqlx::query("CREATE TABLE reservations (n BIGINT PRIMARY KEY)")
        .execute(&db.pool)
        .await
        .unwrap();
    let topic = unique_name("mtls");
    let group = format!("{topic}-group");
    for t in [
        topic.clone(),
        format!("{topic}.out"),
        format!("{group}.dlq"),
        format!("{group}.retry"),
    ] {
        kafka.create_topic(&t, 1).await;
    }
    let service = SagaService::builder()
        .kafka(kafka_config)
        .group_id(&group)
        .pool(db.pool.clone())
        .step(reserve_on(&topic))
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let running = tokio::spawn(service.run(stop.clone().cancelled_owned()));
    place_orders(&kafka, &topic, 1..=4).await;
    // Twice delivered: the step key keeps one effect per order.
    place_orders(&kafka, &topic, 1..=4).await;
    let (_, ns) = read_reserved(
        &kafka,
        &format!("{topic}.out"),
        4,
        Duration::from_millis(500),
    )
    .await;
    assert_eq!(ns, [1, 2, 3, 4]);
    assert_eq!(db.count("reservations").await, 4);
    wait_until("the group's offsets committed", WAIT, || async {
        let committed = kafka.committed_offsets(&group, &topic).await;
        (committed.get(&0) == Some(&8)).then_some(())
    })
    .await;
    stop_service(stop, running).await;
}

#[tokio::test]
async fn a_service_without_a_client_certificate_stops_at_start_naming_the_setting() {
    let (_broker, front) = mutual_tls_broker().await;
    let db = TestDb::empty("mtls-refused").await;
    let service = SagaService::builder()
        .kafka(mutual_tls_args(&front.brokers, false).config().unwrap())
        .group_id("mtls-refused")
        .pool(db.pool.clone())
        .step(reserve_on("mtls-refused"))
        .build()
        .unwrap();
    let started = std::time::Instant::now();
    let error = tokio::time::timeout(WAIT, service.run(std::future::pending()))
        .await
        .expect("the service stops by itself")
        .unwrap_err();
    match &error {
        ServiceError::Config(ConfigError::Problem(problem)) => {
            assert_eq!(
                problem.setting, "KAFKA_SSL_CERTIFICATE_LOCATION",
                "{problem}"
            );
        }
        other => panic!("a configuration problem expected, got {other}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

/// The variables of the block after `<!-- example: {name} -->` in the guide's page on connecting.
fn guide_example(name: &str) -> Vec<(String, String)> {
    let page = include_str!("../../docs/guide/connecting.md");
    let marker = format!("<!-- example: {name} -->");
    let block = page
        .split(&marker)
        .nth(1)
        .unwrap_or_else(|| panic!("the guide has no example {name}"))
        .split("```sh\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .unwrap_or_else(|| panic!("example {name} has no sh block"));
    block
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(var, value)| (var.trim().to_owned(), value.trim().to_owned()))
        .collect()
}

/// `example` with the values a local run must use in place of the guide's (addresses, files, secrets);
/// every other value (the protocol, the mechanism, `sslmode`) is the guide's own.
fn localised(example: &[(String, String)], local: &[(&str, String)]) -> Vec<(String, String)> {
    for (var, _) in local {
        assert!(
            example.iter().any(|(v, _)| v == var),
            "the example sets no {var}: {example:?}"
        );
    }
    example
        .iter()
        .map(|(var, value)| {
            let value = local
                .iter()
                .find(|(v, _)| v == var)
                .map_or_else(|| value.clone(), |(_, local)| local.clone());
            (var.clone(), value)
        })
        .collect()
}

fn kafka_args(vars: &[(String, String)]) -> KafkaArgs {
    KafkaArgs::from_vars(|var| {
        vars.iter()
            .find(|(v, _)| v == var)
            .map(|(_, value)| value.clone())
    })
    .unwrap()
}

#[tokio::test]
async fn the_guides_worked_examples_connect() {
    use saga_test_support::{SECURE_PASSWORD, SECURE_USER, secure_brokers};
    let file = |name: &str| tls_file(name).display().to_string();

    let scram = localised(
        &guide_example("sasl-scram"),
        &[
            ("KAFKA_BROKERS", secure_brokers()),
            ("KAFKA_SASL_USERNAME", SECURE_USER.to_owned()),
            ("KAFKA_SASL_PASSWORD", SECURE_PASSWORD.to_owned()),
            ("KAFKA_SSL_CA_LOCATION", file("ca.pem")),
        ],
    );
    let config = kafka_args(&scram).config().unwrap();
    saga_consumer::setup::probe_broker(&config).await.unwrap();

    let (_broker, front) = mutual_tls_broker().await;
    let mutual = localised(
        &guide_example("mutual-tls"),
        &[
            ("KAFKA_BROKERS", front.brokers.clone()),
            ("KAFKA_SSL_CA_LOCATION", file("ca.pem")),
            ("KAFKA_SSL_CERTIFICATE_LOCATION", file("client.pem")),
            ("KAFKA_SSL_KEY_LOCATION", file("client-encrypted.key")),
            ("KAFKA_SSL_KEY_PASSWORD", KEY_PASSPHRASE.to_owned()),
        ],
    );
    let config = kafka_args(&mutual).config().unwrap();
    saga_consumer::setup::probe_broker(&config).await.unwrap();

    let postgres = guide_example("postgres-verify-full");
    let (_, url) = &postgres[0];
    let query = url
        .split_once('?')
        .expect("the example's URL has a query")
        .1;
    assert!(query.contains("sslmode=verify-full"), "{url}");
    // The local server, the guide's query with the local CA for its file.
    let local_query = query.replace("/etc/postgres/ca.pem", &file("ca.pem"));
    let local = format!("{}?{local_query}", TestDb::database_url());
    let pool = saga_consumer::setup::connect_postgres("DATABASE_URL", &local, None, 1)
        .await
        .unwrap();
    let tls: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(tls, "{local}");
}
