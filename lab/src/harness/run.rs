//! One run of the saga with real processes: a broker, the three services as supervised child processes of
//! the running binary, a client submitting orders, and the ledger at the end.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use saga_runtime::config::connect_postgres;
use saga_testing::duplicate::Duplicator;
use sqlx::PgPool;
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use crate::harness::broker::Broker;
use crate::harness::client::{self, Submission};
use crate::harness::ledger::{self, Ledger, Path};
use crate::harness::processes::Supervisor;
use saga_consumer::OutboxMode;
use saga_examples::events::OrderRequest;
use saga_examples::service::{Service, ServiceArgs};

/// How to run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// PostgreSQL URL (database for the run's schemas).
    pub database_url: String,
    /// Probability of a crash after each database commit, in every service.
    pub crash_rate: f64,
    /// The gateway's latency in milliseconds.
    pub gateway_latency_ms: u64,
    /// Partitions per topic.
    pub partitions: i32,
    /// Name prefix of the run (schemas, topics, groups).
    pub name: String,
    /// Run each service's outbox relay as a process of its own (`{service}-relay`) instead of inside the
    /// service.
    pub separate_relays: bool,
    /// Run the orchestrated saga instead of the choreographed one.
    pub orchestrated: bool,
    /// Where the services write their outbox.
    pub outbox_mode: OutboxMode,
}

/// An order the client will submit.
#[derive(Debug, Clone)]
pub struct PlannedOrder {
    /// Its idempotency key.
    pub key: String,
    /// The path it is meant to take.
    pub path: Path,
    /// The request.
    pub request: OrderRequest,
    /// Whether the client sends it a second time after the first answer (a retry after a lost response).
    pub repeat: bool,
}

/// `n` orders: one in six declined, one in six with a failing shipment, one in three repeated.
pub fn plan(run: &str, n: usize) -> Vec<PlannedOrder> {
    (0..n)
        .map(|i| {
            let path = match i % 6 {
                4 => Path::Declined,
                5 => Path::ShipmentFails,
                _ => Path::Happy,
            };
            PlannedOrder {
                key: format!("{run}-order-{i}"),
                path,
                request: OrderRequest {
                    customer: format!("customer-{i}"),
                    amount_cents: 1_000 + i64::try_from(i).unwrap_or(0),
                    card: if path == Path::Declined {
                        "4000000000000002".into()
                    } else {
                        "4242424242424242".into()
                    },
                    ship_to: if path == Path::ShipmentFails {
                        "1 Sunken Way, Atlantis".into()
                    } else {
                        format!("{i} Main Street, Springfield")
                    },
                },
                repeat: i % 3 == 0,
            }
        })
        .collect()
}

/// What the client saw.
#[derive(Debug, Clone, Default)]
pub struct ClientStats {
    /// Orders accepted.
    pub accepted: usize,
    /// Requests sent.
    pub requests: u64,
    /// Replayed answers.
    pub replays: u64,
    /// 409 answers.
    pub conflicts: u64,
    /// Requests without an answer.
    pub unanswered: u64,
    /// Orders that were never accepted, with the reason.
    pub failures: Vec<String>,
    /// The path of each accepted key.
    pub expected: HashMap<String, Path>,
}

impl ClientStats {
    /// Adds the figures of `other`, a later submission of other orders.
    pub fn add(&mut self, other: Self) {
        self.accepted += other.accepted;
        self.requests += other.requests;
        self.replays += other.replays;
        self.conflicts += other.conflicts;
        self.unanswered += other.unanswered;
        self.failures.extend(other.failures);
        self.expected.extend(other.expected);
    }
}

/// Submits `orders` to the order API at `addr`, `concurrency` at a time, each retried with its key until
/// answered.
pub async fn submit_orders(
    addr: SocketAddr,
    orders: Vec<PlannedOrder>,
    concurrency: usize,
) -> ClientStats {
    let results: Vec<(PlannedOrder, anyhow::Result<Submission>)> = futures::stream::iter(orders)
        .map(|order| async move {
            let submitted = client::submit_order(
                addr,
                &order.key,
                &order.request,
                order.repeat,
                Duration::from_secs(300),
            )
            .await;
            (order, submitted)
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    let mut stats = ClientStats::default();
    for (order, result) in results {
        match result {
            Ok(s) => {
                stats.accepted += 1;
                stats.requests += u64::from(s.requests);
                stats.replays += u64::from(s.replays);
                stats.conflicts += u64::from(s.conflicts);
                stats.unanswered += u64::from(s.unanswered);
                stats.expected.insert(order.key, order.path);
            }
            Err(e) => stats.failures.push(e.to_string()),
        }
    }
    stats
}

/// A running saga.
#[derive(Debug)]
pub struct Run {
    /// The services' settings (shared by every child).
    pub args: ServiceArgs,
    /// The broker.
    pub broker: Broker,
    /// The child processes.
    pub supervisor: Arc<Supervisor>,
    /// A pool for reading every schema.
    pub pool: PgPool,
    ops: HashMap<String, SocketAddr>,
    duplicates: Arc<DuplicateCounts>,
    stop: CancellationToken,
}

/// Duplicates reported by the services' metrics, summed over process restarts.
#[derive(Debug, Default)]
struct DuplicateCounts {
    counts: std::sync::Mutex<HashMap<String, (f64, f64)>>,
    total: AtomicU64,
}

impl Run {
    /// Starts the services as child processes of this binary (`{exe} service {name}`) against `broker`.
    pub async fn start(options: &RunOptions, broker: Broker) -> anyhow::Result<Self> {
        let mut args = ServiceArgs::local(
            options.database_url.clone(),
            broker.brokers(),
            options.name.replace('-', "_"),
            options.name.clone(),
        );
        args.http_addr = saga_test_support::free_local_addr();
        args.crash_after_commit = options.crash_rate;
        args.gateway_latency_ms = options.gateway_latency_ms;
        args.orchestrated = options.orchestrated;
        args.saga.embedded_relay = !options.separate_relays;
        args.saga.outbox.mode = options.outbox_mode;
        // librdkafka's mock cluster keeps messages in memory for the run only, and does not answer
        // DescribeConfigs: the services' check that topics keep messages no longer than step keys has
        // nothing to check there (it would time out).
        args.saga.accept_key_expiry = matches!(broker, Broker::Mock(_));
        args.check().await?;
        broker
            .create_topics(&args.all_topics(), options.partitions)
            .await?;
        let pool = connect_postgres("DATABASE_URL", &options.database_url, None, 4).await?;
        let log_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../target/saga-runs")
            .join(&options.name);
        let supervisor = Arc::new(Supervisor::new(&log_dir)?);
        let exe = std::env::current_exe()?;
        let mut ops = HashMap::new();
        let mut children: Vec<(String, &str, Service)> = Service::ALL
            .iter()
            .map(|s| (s.as_str().to_owned(), "service", *s))
            .collect();
        if options.separate_relays {
            children.extend(
                Service::ALL
                    .iter()
                    .map(|s| (format!("{}-relay", s.as_str()), "relay", *s)),
            );
        }
        for (name, role, service) in children {
            let addr = saga_test_support::free_local_addr();
            ops.insert(name.clone(), addr);
            let (exe, args) = (exe.clone(), args.clone());
            supervisor.spawn(&name, move || {
                let mut command = Command::new(&exe);
                command
                    .args([role, service.as_str()])
                    .env("DATABASE_URL", args.database_url())
                    .env("SAGA_SCHEMA_PREFIX", &args.schema_prefix)
                    .env("KAFKA_BROKERS", args.brokers())
                    .env("SAGA_TOPIC_PREFIX", &args.topic_prefix)
                    .env("HTTP_ADDR", args.http_addr.to_string())
                    // A relay apart serves its ops endpoint where `outbox-relay run` does.
                    .env(
                        if role == "relay" {
                            "RELAY_OPS_ADDR"
                        } else {
                            "SAGA_OPS_ADDR"
                        },
                        addr.to_string(),
                    )
                    .env(
                        "SAGA_FAULT_CRASH_AFTER_COMMIT",
                        args.crash_after_commit.to_string(),
                    )
                    .env("GATEWAY_LATENCY_MS", args.gateway_latency_ms.to_string())
                    .env("SAGA_EMBEDDED_RELAY", args.saga.embedded_relay.to_string())
                    .env(
                        "SAGA_ACCEPT_KEY_EXPIRY",
                        args.saga.accept_key_expiry.to_string(),
                    )
                    .env("SAGA_ORCHESTRATED", args.orchestrated.to_string())
                    .env("SAGA_OUTBOX_MODE", args.outbox_mode().as_str())
                    .env(
                        "RUST_LOG",
                        std::env::var("RUST_LOG")
                            .unwrap_or_else(|_| "info,librdkafka=warn,sqlx=warn".into()),
                    );
                command
            });
        }
        let run = Self {
            args,
            broker,
            supervisor,
            pool,
            ops,
            duplicates: Arc::default(),
            stop: CancellationToken::new(),
        };
        run.wait_ready(Duration::from_secs(120)).await?;
        run.scrape_in_background();
        Ok(run)
    }

    /// Waits until every service reports ready (consumer in its group, relay connected) and the API
    /// answers.
    async fn wait_ready(&self, timeout: Duration) -> anyhow::Result<()> {
        let started = Instant::now();
        for (name, addr) in &self.ops {
            loop {
                let ready = client::send(*addr, "GET", "/readyz", &[], None)
                    .await
                    .is_ok_and(|a| a.status == 200);
                if ready {
                    break;
                }
                anyhow::ensure!(
                    started.elapsed() < timeout,
                    "{name} did not become ready within {timeout:?}; see {}",
                    self.supervisor.log_dir().display()
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        Ok(())
    }

    fn scrape_in_background(&self) {
        let (ops, counts, stop) = (self.ops.clone(), self.duplicates.clone(), self.stop.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                for (name, addr) in &ops {
                    if let Some(value) = scrape_duplicates(*addr).await {
                        counts.observe(name, value);
                    }
                }
                tokio::select! {
                    () = stop.cancelled() => {}
                    () = tokio::time::sleep(Duration::from_millis(300)) => {}
                }
            }
        });
    }

    /// Delivers every event on the run's topics a second time, until `stop` (see
    /// [`saga_testing::duplicate`]).
    pub fn duplicate_events(&self, stop: CancellationToken) -> anyhow::Result<Duplicator> {
        Ok(Duplicator::start(
            &self.args.kafka()?,
            &format!("{}.duplicator", self.args.topic_prefix),
            &self.args.topics().all(),
            stop.cancelled_owned(),
        )?)
    }

    /// Submits `orders` to this run's API; see [`submit_orders`].
    pub async fn submit(&self, orders: Vec<PlannedOrder>, concurrency: usize) -> ClientStats {
        submit_orders(self.args.http_addr, orders, concurrency).await
    }

    /// Waits until `expected` orders are finished (COMPLETED or CANCELLED), calling `progress` now and then.
    pub async fn wait_finished(
        &self,
        expected: usize,
        timeout: Duration,
        mut progress: impl FnMut(i64),
    ) -> anyhow::Result<()> {
        let started = Instant::now();
        let mut last_report = Instant::now();
        loop {
            let finished = ledger::finished_orders(&self.pool, &self.args).await?;
            if finished >= i64::try_from(expected).unwrap_or(i64::MAX) {
                progress(finished);
                return Ok(());
            }
            if last_report.elapsed() >= Duration::from_secs(2) {
                progress(finished);
                last_report = Instant::now();
            }
            anyhow::ensure!(
                started.elapsed() < timeout,
                "only {finished} of {expected} sagas finished within {timeout:?}; see {}",
                self.supervisor.log_dir().display()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Reads the ledger and checks the invariants against what the client expected.
    pub async fn ledger(&self, expected: &HashMap<String, Path>) -> anyhow::Result<Ledger> {
        let facts = ledger::read_facts(&self.pool, &self.args).await?;
        let mut ledger = ledger::check(&facts, expected);
        let twice = ledger::steps_run_twice(&self.pool, &self.args).await?;
        ledger.steps_run_twice = twice.len();
        ledger.violations.extend(twice);
        Ok(ledger)
    }

    /// Messages in the services' dead-letter topics. A run's messages are all valid: any dead letter is a
    /// message the framework failed to handle (a step that ran twice and hit a primary key, say).
    pub async fn dead_letters(&self) -> anyhow::Result<i64> {
        let kafka = saga_runtime::kafka::KafkaConfig::new(self.broker.brokers());
        let mut total = 0;
        for service in Service::ALL {
            let topic = self.args.dlq(service);
            let partitions = saga_runtime::kafka::watermarks(&kafka, &topic).await?;
            total += partitions
                .iter()
                .flatten()
                .map(|w| w.high - w.low)
                .sum::<i64>();
        }
        Ok(total)
    }

    /// Redelivered messages the services skipped by their step key, as their metrics report them.
    pub fn duplicates_absorbed(&self) -> u64 {
        self.duplicates.total()
    }

    /// Stops the services gracefully; drops the run's schemas unless `keep`.
    pub async fn finish(self, keep: bool) -> anyhow::Result<()> {
        // One last scrape before the services go.
        for (name, addr) in &self.ops {
            if let Some(value) = scrape_duplicates(*addr).await {
                self.duplicates.observe(name, value);
            }
        }
        self.stop.cancel();
        self.supervisor.stop().await;
        if !keep {
            for schema in Service::ALL
                .iter()
                .map(|s| self.args.schema(*s))
                .chain([self.args.gateway_schema()])
            {
                super::drop_schema(&self.pool, &schema).await?;
            }
        }
        Ok(())
    }
}

impl DuplicateCounts {
    /// Records a scraped value; a value lower than the last one means the process restarted.
    fn observe(&self, process: &str, value: f64) {
        let mut counts = self.counts.lock().expect("counts");
        let (earlier, last) = counts.entry(process.to_owned()).or_insert((0.0, 0.0));
        if value < *last {
            *earlier += *last;
        }
        *last = value;
        let total: f64 = counts.values().map(|(e, l)| e + l).sum();
        // Counts are whole numbers.
        self.total
            .store(total.max(0.0).round() as u64, Ordering::Relaxed);
    }

    fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }
}

/// The sum of `saga_consumer_duplicates_total` on a service's `/metrics`.
async fn scrape_duplicates(addr: SocketAddr) -> Option<f64> {
    let (status, _, body) = client::request(addr, "GET", "/metrics", &[], None)
        .await
        .ok()?;
    if status != 200 {
        return None;
    }
    let text = String::from_utf8_lossy(&body);
    Some(
        text.lines()
            .filter(|l| l.starts_with("saga_consumer_duplicates_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum(),
    )
}
