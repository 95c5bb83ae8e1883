//! Test support for the workspace's integration tests, against a real PostgreSQL and a real Kafka-protocol
//! broker reached over TCP.
//!
//! - [`TestDb`]: a schema of its own per test (in the `saga_test` database), with the framework's
//!   migrations applied; dropped when the test passes, kept (and named) when it fails.
//! - [`TestKafka`]: uniquely named topics, created explicitly and deleted afterwards, plus helpers to
//!   produce and to read a topic back.
//! - [`PrivateBroker`]: a broker process of the test's own, for tests that stop and restart the broker.
//! - [`PrivatePostgres`]: a PostgreSQL cluster of the test's own, for tests that need a second server.
//! - [`sasl_ssl_env`], [`MutualTlsFront`]: the secured broker `scripts/dev-services` starts (TLS, SASL/SCRAM)
//!   and a mutual-TLS front for a broker of the test's own; [`tls_dir`]: the local CA and certificates.
//! - [`free_local_addr`]: an address for a server started (and restarted) on a port chosen in advance.
//!
//! The services come from `DATABASE_URL` / `KAFKA_BROKERS`, or, where those are unset and a Docker engine
//! answers, from PostgreSQL and Apache Kafka containers started once per test process (see [`services`]),
//! or else from the local defaults. Where a service is unreachable the test fails with one line saying how
//! to start it; it never passes silently.

//!
//! # Examples
//!
//! ```no_run
//! use saga_test_support::{TestDb, TestKafka};
//!
//! # async fn example() {
//! let db = TestDb::new("my-test").await; // a schema of its own, the key store and outbox applied
//! let kafka = TestKafka::new().await;
//! let topic = kafka.topic("my-test", 3).await; // unique, deleted afterwards
//! sqlx::query("CREATE TABLE effects (n BIGINT)").execute(&db.pool).await.unwrap();
//! # let _ = topic; }
//! ```

#![deny(missing_docs)]

mod broker;
mod db;
mod env;
mod kafka;
mod ports;
mod postgres;
mod secure;
mod services;
mod usage;

pub use broker::PrivateBroker;
pub use db::TestDb;
pub use env::{database_url, kafka_brokers, unique_name, wait_until};
pub use kafka::{ReadMessage, TestKafka};
pub use ports::free_local_addr;
pub use postgres::PrivatePostgres;
pub use secure::{
    KEY_PASSPHRASE, MutualTlsFront, SECURE_PASSWORD, SECURE_USER, sasl_ssl_env,
    sasl_ssl_properties, secure_brokers, tls_dir, tls_file,
};
pub use services::{Services, services};
pub use usage::{
    LEAK_CANARY, expect_configuration_mistakes_named, expect_help_hides_secrets,
    expect_security_mistakes_named, expect_usage_error,
};
