//! Running one of the example services: its schema (framework tables and its own), its consumer, its
//! outbox relay (embedded here for convenience; `outbox-relay run` does the same as a process of its own),
//! and for the order service the HTTP API.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use std::future::Future;

use outbox_relay::Relay;
use saga_consumer::fast_path::FastPath;
use saga_consumer::setup::connect_postgres;
use saga_consumer::{
    Hooks, KafkaConfig, OutboxMode, SagaService, SagaServiceBuilder, StepName, step, step_with,
};
use saga_orchestrator::Orchestrator;
use sqlx::PgPool;
use sqlx::migrate::Migrator;

use crate::events::Topics;
use crate::gateway::PaymentGateway;
use crate::{order, payment, shipping};

/// The three services.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub enum Service {
    /// Orders: HTTP API and saga bookkeeping.
    Order,
    /// Payments: charges and refunds through the gateway.
    Payment,
    /// Shipping: shipments.
    Shipping,
}

impl Service {
    /// All three.
    pub const ALL: [Self; 3] = [Self::Order, Self::Payment, Self::Shipping];

    /// `order`, `payment` or `shipping`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Order => "order",
            Self::Payment => "payment",
            Self::Shipping => "shipping",
        }
    }

    fn migrator(self) -> Migrator {
        let mut migrator = match self {
            Self::Order => sqlx::migrate!("./migrations/order"),
            Self::Payment => sqlx::migrate!("./migrations/payment"),
            Self::Shipping => sqlx::migrate!("./migrations/shipping"),
        };
        migrator.dangerous_set_table_name(format!("_{}_service_migrations", self.as_str()));
        migrator
    }
}

/// Where a service finds everything; flags or environment variables.
#[derive(Debug, Clone, Args)]
pub struct ServiceArgs {
    /// PostgreSQL URL (the database holding the services' schemas).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/saga_demo"
    )]
    pub database_url: String,
    /// Prefix of the schemas: `{prefix}_order`, `{prefix}_payment`, `{prefix}_shipping`,
    /// `{prefix}_gateway`.
    #[arg(long, env = "SAGA_SCHEMA_PREFIX", default_value = "saga")]
    pub schema_prefix: String,
    /// Kafka bootstrap servers.
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    pub brokers: String,
    /// Prefix of the topics and consumer groups.
    #[arg(long, env = "SAGA_TOPIC_PREFIX", default_value = "saga")]
    pub topic_prefix: String,
    /// The order service's HTTP address.
    #[arg(long, env = "HTTP_ADDR", default_value = "127.0.0.1:8080")]
    pub http_addr: SocketAddr,
    /// Where to serve /metrics, /healthz and /readyz.
    #[arg(long, env = "SAGA_OPS_ADDR")]
    pub ops_addr: Option<SocketAddr>,
    /// Fault injection: probability of a crash right after each database commit, before the offsets are
    /// committed (the process aborts).
    #[arg(long, env = "SAGA_FAULT_CRASH_AFTER_COMMIT", default_value_t = 0.0)]
    pub crash_after_commit: f64,
    /// Create the topics if they do not exist.
    #[arg(long, env = "SAGA_CREATE_TOPICS")]
    pub create_topics: bool,
    /// The gateway's simulated latency in milliseconds.
    #[arg(long, env = "GATEWAY_LATENCY_MS", default_value_t = 2)]
    pub gateway_latency_ms: u64,
    /// Run the service's outbox relay inside the service (the default), or not (a separate
    /// `outbox-relay run` publishes the outbox).
    #[arg(long, env = "SAGA_EMBEDDED_RELAY", default_value_t = true, action = clap::ArgAction::Set)]
    pub embedded_relay: bool,
    /// Run the orchestrated saga (the order service orchestrates with commands and replies) instead of the
    /// choreographed one (each service reacts to the previous one's events).
    #[arg(long, env = "SAGA_ORCHESTRATED", default_value_t = false, action = clap::ArgAction::Set)]
    pub orchestrated: bool,
    /// Where the outbox is written: `table` (rows) or `wal` (PostgreSQL's write-ahead log, read by the relay
    /// through the schema's replication slot; needs wal_level = logical).
    #[arg(long, env = "SAGA_OUTBOX_MODE", default_value = "table", value_parser = parse_outbox_mode)]
    pub outbox_mode: OutboxMode,
    /// How long the broker may hold a consumer's fetch while it has nothing new, in milliseconds (the
    /// framework's default when unset). A broker that looks for new records at intervals within this wait
    /// instead of answering when they arrive delivers them up to half of it later.
    #[arg(long, env = "SAGA_FETCH_WAIT_MS")]
    pub fetch_wait_ms: Option<u64>,
}

fn parse_outbox_mode(text: &str) -> Result<OutboxMode, String> {
    OutboxMode::parse(text).map_err(|p| p.problem)
}

impl ServiceArgs {
    /// The topics.
    pub fn topics(&self) -> Topics {
        Topics::with_prefix(&self.topic_prefix)
    }

    /// The schema of `service`.
    pub fn schema(&self, service: Service) -> String {
        format!("{}_{}", self.schema_prefix, service.as_str())
    }

    /// The gateway's schema.
    pub fn gateway_schema(&self) -> String {
        format!("{}_gateway", self.schema_prefix)
    }

    /// The consumer group of `service`.
    pub fn group(&self, service: Service) -> String {
        format!("{}.{}-service", self.topic_prefix, service.as_str())
    }

    /// The dead-letter topic of `service`.
    pub fn dlq(&self, service: Service) -> String {
        format!("{}.dlq", self.group(service))
    }

    /// The retry topic of `service`, where its replayed dead letters arrive.
    pub fn retry(&self, service: Service) -> String {
        format!("{}.retry", self.group(service))
    }

    /// Every topic the saga needs.
    pub fn all_topics(&self) -> Vec<String> {
        let mut topics: Vec<String> = self
            .topics()
            .all()
            .iter()
            .map(|t| (*t).to_owned())
            .collect();
        topics.extend(Service::ALL.iter().map(|s| self.dlq(*s)));
        topics.extend(Service::ALL.iter().map(|s| self.retry(*s)));
        topics
    }

    /// A pool on `schema` (created if missing). A bad or unreachable `DATABASE_URL` is a
    /// [`saga_consumer::ConfigProblem`].
    pub async fn pool(&self, schema: &str, size: u32) -> anyhow::Result<PgPool> {
        let admin = connect_postgres("DATABASE_URL", &self.database_url, None, 1).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA IF NOT EXISTS {}",
            quote_ident(schema)
        )))
        .execute(&admin)
        .await
        .or_else(ignore_race)?;
        admin.close().await;
        Ok(connect_postgres("DATABASE_URL", &self.database_url, Some(schema), size).await?)
    }

    /// Checks, before anything starts, that PostgreSQL and the broker answer: a setting that keeps the
    /// saga from running is reported as a [`saga_consumer::ConfigProblem`] naming it.
    pub async fn check(&self) -> anyhow::Result<()> {
        connect_postgres("DATABASE_URL", &self.database_url, None, 1)
            .await?
            .close()
            .await;
        saga_consumer::setup::probe_broker(&self.kafka()).await?;
        Ok(())
    }

    /// The Kafka configuration: the brokers, and librdkafka properties from `KAFKA_PROPERTY_*`.
    pub fn kafka(&self) -> KafkaConfig {
        KafkaConfig::with_env_properties(Some(self.brokers.clone()))
            .unwrap_or_else(|_| KafkaConfig::new(self.brokers.clone()))
    }
}

/// `CREATE SCHEMA IF NOT EXISTS` races with itself: two processes may both find it missing.
fn ignore_race(e: sqlx::Error) -> Result<sqlx::postgres::PgQueryResult, sqlx::Error> {
    match e.as_database_error().and_then(|d| d.code()) {
        Some(code) if code == "23505" || code == "42P06" => Ok(Default::default()),
        _ => Err(e),
    }
}

/// Quotes an SQL identifier.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Creates `service`'s schema and applies the framework's and the service's migrations (and the gateway's,
/// for the payment service). Returns the service's pool.
pub async fn prepare(service: Service, args: &ServiceArgs) -> anyhow::Result<PgPool> {
    let pool = args.pool(&args.schema(service), 12).await?;
    saga_consumer::migrate::migrate(&pool)
        .await
        .context("applying the framework's migrations")?;
    if service == Service::Order {
        // The order service shows its saga instances (GET /sagas/{id}) in either mode.
        saga_orchestrator::migrate::migrate(&pool)
            .await
            .context("applying the orchestrator's migrations")?;
    }
    service
        .migrator()
        .run(&pool)
        .await
        .context("applying the service's migrations")?;
    if service == Service::Payment {
        let gateway = gateway_pool(args).await?;
        gateway_migrator()
            .run(&gateway)
            .await
            .context("applying the gateway's migrations")?;
    }
    Ok(pool)
}

fn gateway_migrator() -> Migrator {
    let mut migrator = sqlx::migrate!("./migrations/gateway");
    migrator.dangerous_set_table_name("_gateway_migrations");
    migrator
}

async fn gateway_pool(args: &ServiceArgs) -> anyhow::Result<PgPool> {
    args.pool(&args.gateway_schema(), 4).await
}

/// Adds `service`'s steps (or, for the orchestrated order service, its orchestrator) to `builder`.
pub async fn steps(
    service: Service,
    args: &ServiceArgs,
    pool: &PgPool,
    builder: SagaServiceBuilder,
) -> anyhow::Result<SagaServiceBuilder> {
    let topics = args.topics();
    let orchestrated = args.orchestrated;
    let outcomes = topics.outcomes(orchestrated);
    Ok(match service {
        Service::Order if orchestrated => builder.with(orchestrator(args)?),
        Service::Order => builder
            .step(step("mark-order-paid", order::mark_order_paid).on(&topics.payments))
            .step(step("complete-order", order::complete_order).on(&topics.shipments))
            .step(
                step("note-shipment-failed", order::note_shipment_failed)
                    .on(&topics.shipment_setbacks),
            )
            .step(step("cancel-order", order::cancel_order).on(&topics.payment_setbacks)),
        Service::Payment => {
            let latency = Duration::from_millis(args.gateway_latency_ms);
            let gateway = PaymentGateway::new(gateway_pool(args).await?, latency);
            let (charges, refunds, refund_name) = if orchestrated {
                let (charges, refunds) = (&topics.payment_commands, &topics.refund_commands);
                (charges, refunds, "compensate-process-payment")
            } else {
                (&topics.charges, &topics.refunds, "refund-payment")
            };
            let builder = builder
                .two_phase_step(payment::ProcessPayment {
                    gateway: gateway.clone(),
                    charges: charges.clone(),
                    outcomes: outcomes.clone(),
                })
                .two_phase_step(payment::RefundPayment {
                    gateway,
                    pool: pool.clone(),
                    name: StepName::new(refund_name)?,
                    refunds: refunds.clone(),
                    outcomes,
                });
            if orchestrated {
                builder
            } else {
                builder.ignore(&topics.shipments)
            }
        }
        Service::Shipping => {
            let arrange = step_with("arrange-shipment", outcomes, shipping::arrange_shipment);
            if orchestrated {
                builder.step(arrange.on(&topics.shipping_commands))
            } else {
                builder
                    .step(arrange.on(&topics.shipments_to_arrange))
                    .ignore(&topics.payment_setbacks)
            }
        }
    })
}

/// Fault injection: aborts the process after a database commit with probability `p`.
fn crash_after_commit(p: f64) -> Hooks {
    Hooks::default().on_db_commit(move |info| {
        if rand::random::<f64>() < p {
            eprintln!(
                "fault injection: crashing after the database commit of {}/{} offsets {}..={}",
                info.topic, info.partition, info.first_offset, info.last_offset
            );
            std::process::abort();
        }
    })
}

/// The `main` of the stand-alone service binaries (`order-service`, `payment-service`,
/// `shipping-service`): reads the settings from flags and the environment (see `--help`), then runs
/// `service` until SIGTERM or Ctrl-C.
pub async fn main(service: Service, about: &'static str) -> anyhow::Result<()> {
    use clap::{CommandFactory, Parser};

    #[derive(Parser)]
    #[command(version)]
    struct Cli {
        #[command(flatten)]
        args: ServiceArgs,
    }

    let name = match service {
        Service::Order => "order-service",
        Service::Payment => "payment-service",
        Service::Shipping => "shipping-service",
    };
    let cli: Cli = saga_consumer::setup::parse_command(Cli::command().name(name).about(about));
    let _tracing = saga_consumer::telemetry::init_tracing();
    run(service, cli.args, saga_consumer::shutdown_signal()).await
}

/// The orchestrator of the order saga.
pub fn orchestrator(args: &ServiceArgs) -> anyhow::Result<Orchestrator> {
    Ok(Orchestrator::new(order::order_saga(&args.topics())?)?.with_hooks(order::OrderSagaHooks))
}

/// Runs only the outbox relay of `service`'s schema, until `shutdown` resolves.
pub async fn run_relay(
    service: Service,
    args: ServiceArgs,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let pool = args.pool(&args.schema(service), 4).await?;
    saga_consumer::migrate::migrate(&pool)
        .await
        .context("applying the framework's migrations")?;
    let mut relay = Relay::builder()
        .kafka(args.kafka())
        .pool(pool)
        .mode(args.outbox_mode)
        .replication_url(args.database_url.clone());
    if let Some(addr) = args.ops_addr {
        relay = relay.ops_addr(addr);
    }
    relay.build()?.run(shutdown).await?;
    Ok(())
}

/// Runs `service` until `shutdown` resolves: its consumer, its relay (unless it runs apart), its
/// orchestrator's timers and, for the order service, its HTTP API, all stopped together by
/// [`SagaService`].
pub async fn run(
    service: Service,
    args: ServiceArgs,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    args.check().await?;
    if args.create_topics {
        // Every topic of the saga: this service publishes to topics others consume.
        let names = args.all_topics();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        saga_consumer::setup::ensure_topics(&args.kafka(), &refs, 3, 1)
            .await
            .context("creating topics")?;
    }
    let pool = prepare(service, &args).await?;
    // REDIS_URL turns the Redis fast path on.
    let fast_path = FastPath::from_env(&pool).await?;
    let consumer_fast_path = fast_path.clone();
    let mut builder = SagaService::builder()
        .kafka(args.kafka())
        .group_id(args.group(service))
        .dlq_topic(args.dlq(service))
        .pool(pool.clone())
        .consumer(|c| {
            let c = c
                .commit_interval(Duration::from_millis(250))
                .session_timeout(Duration::from_secs(6))
                .fast_path(consumer_fast_path);
            match args.fetch_wait_ms {
                Some(ms) => c.fetch_wait(Duration::from_millis(ms)),
                None => c,
            }
        })
        .embedded_relay(args.embedded_relay)
        .outbox_mode(args.outbox_mode)
        .relay(|r| r.replication_url(args.database_url.clone()));
    if let Some(addr) = args.ops_addr {
        builder = builder.ops_addr(addr);
    }
    if args.crash_after_commit > 0.0 {
        builder = builder.hooks(crash_after_commit(args.crash_after_commit));
    }
    builder = steps(service, &args, &pool, builder).await?;
    if service == Service::Order {
        let listener = tokio::net::TcpListener::bind(args.http_addr)
            .await
            .with_context(|| format!("binding {}", args.http_addr))?;
        tracing::info!(addr = %args.http_addr, "order API listening");
        let orchestrator = args.orchestrated.then(|| orchestrator(&args)).transpose()?;
        let app = order::router(pool.clone(), args.topics(), orchestrator, fast_path);
        builder = builder.task("the order API", move |ctx| async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(ctx.shutdown())
                .await?;
            Ok(())
        });
    }
    tracing::info!(service = service.as_str(), "service starting");
    builder.build()?.run(shutdown).await?;
    Ok(())
}
