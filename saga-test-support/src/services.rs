//! Where a test finds PostgreSQL and the broker, decided once per test process:
//!
//! 1. `DATABASE_URL` / `KAFKA_BROKERS` when set (`scripts/test` sets both to the local services that
//!    `scripts/dev-services` found or started);
//! 2. otherwise, where a Docker engine answers (and the `containers` feature is on, the default), a
//!    PostgreSQL and an Apache Kafka (KRaft) container started with `testcontainers`, removed when the test
//!    process exits;
//! 3. otherwise the local defaults (`127.0.0.1:5432`, `127.0.0.1:9092`). If those do not answer either,
//!    the test fails with one line saying what to start.
//!
//! The container path is not exercised on the machines the project's CI runs on (they have no Docker
//! engine); it is kept to the few lines below.

use tokio::sync::OnceCell;

use crate::env::{DEFAULT_DATABASE_URL, DEFAULT_KAFKA_BROKERS};

/// The services this test process uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Services {
    /// The PostgreSQL URL (its database is the server's default one).
    pub database_url: String,
    /// The broker's `bootstrap.servers`.
    pub kafka_brokers: String,
}

static SERVICES: OnceCell<Services> = OnceCell::const_new();

/// The services, resolved on the first call of the process (which may start containers).
pub async fn services() -> &'static Services {
    SERVICES.get_or_init(resolve).await
}

/// The services if already resolved, else what the environment or the defaults say. For code that runs
/// after a [`crate::TestDb`] or [`crate::TestKafka`] was created.
pub(crate) fn resolved_or_env() -> Services {
    SERVICES.get().cloned().unwrap_or_else(|| Services {
        database_url: std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned()),
        kafka_brokers: std::env::var("KAFKA_BROKERS")
            .unwrap_or_else(|_| DEFAULT_KAFKA_BROKERS.to_owned()),
    })
}

async fn resolve() -> Services {
    let database_url = std::env::var("DATABASE_URL").ok();
    let kafka_brokers = std::env::var("KAFKA_BROKERS").ok();
    if (database_url.is_none() || kafka_brokers.is_none()) && docker::answers() {
        return docker::start(database_url, kafka_brokers).await;
    }
    Services {
        database_url: database_url.unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned()),
        kafka_brokers: kafka_brokers.unwrap_or_else(|| DEFAULT_KAFKA_BROKERS.to_owned()),
    }
}

#[cfg(feature = "containers")]
mod docker {
    use std::io::{Read, Write};
    use std::time::Duration;

    use testcontainers_modules::kafka::apache::{KAFKA_PORT, Kafka};
    use testcontainers_modules::postgres::Postgres;
    use testcontainers_modules::testcontainers::ImageExt;
    use testcontainers_modules::testcontainers::runners::AsyncRunner;

    use super::Services;

    /// Whether a Docker engine answers `GET /_ping` at `DOCKER_HOST` (or `/var/run/docker.sock`).
    pub(super) fn answers() -> bool {
        let host = std::env::var("DOCKER_HOST")
            .unwrap_or_else(|_| "unix:///var/run/docker.sock".to_owned());
        let ping = |stream: &mut dyn ReadWrite| -> Option<bool> {
            stream
                .write_all(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
                .ok()?;
            let mut reply = String::new();
            stream.read_to_string(&mut reply).ok()?;
            Some(reply.starts_with("HTTP/1.") && reply.contains(" 200 "))
        };
        let timeout = Some(Duration::from_secs(2));
        if let Some(path) = host.strip_prefix("unix://") {
            let Ok(mut stream) = std::os::unix::net::UnixStream::connect(path) else {
                return false;
            };
            let _ = stream.set_read_timeout(timeout);
            ping(&mut stream).unwrap_or(false)
        } else if let Some(addr) = host.strip_prefix("tcp://") {
            let Ok(mut stream) = std::net::TcpStream::connect(addr) else {
                return false;
            };
            let _ = stream.set_read_timeout(timeout);
            ping(&mut stream).unwrap_or(false)
        } else {
            false
        }
    }

    trait ReadWrite: Read + Write {}
    impl<T: Read + Write> ReadWrite for T {}

    /// Starts a container for each service the environment does not name, and a watcher that removes them
    /// once this process exits.
    pub(super) async fn start(
        database_url: Option<String>,
        kafka_brokers: Option<String>,
    ) -> Services {
        let mut ids = Vec::new();
        let database_url = match database_url {
            Some(url) => url,
            None => {
                let pg = Postgres::default()
                    .with_host_auth()
                    .start()
                    .await
                    .unwrap_or_else(|e| panic!("starting a PostgreSQL container: {e}"));
                let port = pg.get_host_port_ipv4(5432).await.expect("PostgreSQL port");
                ids.push(pg.id().to_owned());
                std::mem::forget(pg); // removed by the watcher, not by a drop in some test's runtime
                format!("postgres://postgres@127.0.0.1:{port}/postgres")
            }
        };
        let kafka_brokers = match kafka_brokers {
            Some(brokers) => brokers,
            None => {
                let kafka = Kafka::default()
                    .with_jvm_image()
                    .with_env_var("KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS", "0")
                    .with_env_var("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "false")
                    .start()
                    .await
                    .unwrap_or_else(|e| panic!("starting an Apache Kafka container: {e}"));
                let port = kafka
                    .get_host_port_ipv4(KAFKA_PORT)
                    .await
                    .expect("Kafka port");
                ids.push(kafka.id().to_owned());
                std::mem::forget(kafka);
                format!("127.0.0.1:{port}")
            }
        };
        remove_on_exit(&ids);
        Services {
            database_url,
            kafka_brokers,
        }
    }

    /// A shell that waits for this process to end, then removes the containers.
    fn remove_on_exit(ids: &[String]) {
        let script = format!(
            "while kill -0 {} 2>/dev/null; do sleep 1; done; docker rm -f -v {} >/dev/null 2>&1",
            std::process::id(),
            ids.join(" ")
        );
        let _ = std::process::Command::new("sh")
            .args(["-c", &script])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn();
    }
}

#[cfg(not(feature = "containers"))]
mod docker {
    use super::Services;

    pub(super) fn answers() -> bool {
        false
    }

    pub(super) async fn start(_: Option<String>, _: Option<String>) -> Services {
        unreachable!("no container is started without the `containers` feature")
    }
}
