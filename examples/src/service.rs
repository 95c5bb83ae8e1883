//! Running one of the example services: its schema (framework tables and its own), its consumer, its
//! outbox relay (embedded here for convenience; `outbox-relay run` does the same as a process of its own),
//! and for the order service the HTTP API.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use std::future::Future;

use outbox_relay::Relay;
#[cfg(feature = "redis")]
use saga_consumer::fast_path::FastPath;
use saga_consumer::setup::connect_postgres;
use saga_consumer::{
    Hooks, KafkaConfig, OrderPolicy, OutboxMode, SagaService, SagaServiceBuilder, step, step_with,
};
use saga_orchestrator::Orchestrator;
use sqlx::PgPool;
use sqlx::migrate::Migrator;

use crate::events::{ARRANGE_SHIPMENT, Topics};
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

/// The demo's defaults: a local PostgreSQL database and broker.
const DEMO_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/saga_demo";
const DEMO_BROKERS: &str = "127.0.0.1:9092";

/// Where a service finds everything; flags or environment variables. The framework's settings are its own
/// declarations ([`saga_consumer::settings::ServiceArgs`]), flattened: this adds only the example's.
#[derive(Debug, Clone, Args)]
pub struct ServiceArgs {
    /// The framework's settings (`DATABASE_URL` defaults to the demo's database, `KAFKA_BROKERS` to
    /// 127.0.0.1:9092).
    #[command(flatten)]
    pub saga: saga_consumer::settings::ServiceArgs,
    /// Prefix of the schemas: `{prefix}_order`, `{prefix}_payment`, `{prefix}_shipping`,
    /// `{prefix}_gateway`.
    #[arg(long, env = "SAGA_SCHEMA_PREFIX", default_value = "saga")]
    pub schema_prefix: String,
    /// Prefix of the topics and consumer groups.
    #[arg(long, env = "SAGA_TOPIC_PREFIX", default_value = "saga")]
    pub topic_prefix: String,
    /// The order service's HTTP address.
    #[arg(long, env = "HTTP_ADDR", default_value = "127.0.0.1:8080")]
    pub http_addr: SocketAddr,
    /// Fault injection: probability of a crash right after each database commit, before the offsets are
    /// committed (the process aborts).
    #[arg(long, env = "SAGA_FAULT_CRASH_AFTER_COMMIT", default_value_t = 0.0)]
    pub crash_after_commit: f64,
    /// The gateway's simulated latency in milliseconds.
    #[arg(long, env = "GATEWAY_LATENCY_MS", default_value_t = 2)]
    pub gateway_latency_ms: u64,
    /// Run the orchestrated saga (the order service orchestrates with commands and replies) instead of the
    /// choreographed one (each service reacts to the previous one's events).
    #[arg(long, env = "SAGA_ORCHESTRATED", default_value_t = false, action = clap::ArgAction::Set)]
    pub orchestrated: bool,
}

impl ServiceArgs {
    /// The demo's settings for services whose schemas and topics start with the given prefixes, on
    /// `database_url` and `brokers`; the framework's other settings are their defaults.
    pub fn local(
        database_url: impl Into<String>,
        brokers: impl Into<String>,
        schema_prefix: impl Into<String>,
        topic_prefix: impl Into<String>,
    ) -> Self {
        let mut saga = saga_consumer::settings::ServiceArgs::default();
        saga.database.database_url = Some(database_url.into());
        saga.kafka.brokers = Some(brokers.into());
        Self {
            saga,
            schema_prefix: schema_prefix.into(),
            topic_prefix: topic_prefix.into(),
            http_addr: "127.0.0.1:8080".parse().expect("an address"),
            crash_after_commit: 0.0,
            gateway_latency_ms: 2,
            orchestrated: false,
        }
    }

    /// The PostgreSQL URL (the demo's database unless `DATABASE_URL`).
    pub fn database_url(&self) -> &str {
        self.saga
            .database
            .database_url
            .as_deref()
            .unwrap_or(DEMO_DATABASE_URL)
    }

    /// The brokers (127.0.0.1:9092 unless `KAFKA_BROKERS`).
    pub fn brokers(&self) -> &str {
        self.saga.kafka.brokers.as_deref().unwrap_or(DEMO_BROKERS)
    }

    /// Where the outbox is written.
    pub fn outbox_mode(&self) -> OutboxMode {
        self.saga.outbox.mode
    }

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
        let admin = connect_postgres("DATABASE_URL", self.database_url(), None, 1).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA IF NOT EXISTS {}",
            quote_ident(schema)
        )))
        .execute(&admin)
        .await
        .or_else(ignore_race)?;
        admin.close().await;
        Ok(connect_postgres("DATABASE_URL", self.database_url(), Some(schema), size).await?)
    }

    /// Checks, before anything starts, that PostgreSQL and the broker answer: a setting that keeps the
    /// saga from running is reported as a [`saga_consumer::ConfigProblem`] naming it.
    pub async fn check(&self) -> anyhow::Result<()> {
        connect_postgres("DATABASE_URL", self.database_url(), None, 1)
            .await?
            .close()
            .await;
        saga_consumer::setup::probe_broker(&self.kafka()?).await?;
        Ok(())
    }

    /// The Kafka configuration: the brokers, the security settings (`KAFKA_SECURITY_PROTOCOL`, SASL, TLS)
    /// and librdkafka properties from `KAFKA_PROPERTY_*`; settings that cannot work together are a
    /// [`saga_consumer::ConfigProblem`] naming the one to change.
    pub fn kafka(&self) -> Result<KafkaConfig, saga_consumer::ConfigProblem> {
        self.saga
            .kafka
            .secure(KafkaConfig::with_env_properties(Some(
                self.brokers().to_owned(),
            ))?)
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
    migrate(service, args, &pool).await?;
    Ok(pool)
}

/// Applies the framework's and `service`'s migrations to `pool` (and the gateway's to its schema, for the
/// payment service).
pub async fn migrate(service: Service, args: &ServiceArgs, pool: &PgPool) -> anyhow::Result<()> {
    saga_consumer::migrate::migrate(pool)
        .await
        .context("applying the framework's migrations")?;
    if service == Service::Order {
        // The order service shows its saga instances (GET /sagas/{id}) in either mode.
        saga_orchestrator::migrate::migrate(pool)
            .await
            .context("applying the orchestrator's migrations")?;
    }
    service
        .migrator()
        .run(pool)
        .await
        .context("applying the service's migrations")?;
    if service == Service::Payment {
        let gateway = gateway_pool(args).await?;
        gateway_migrator()
            .run(&gateway)
            .await
            .context("applying the gateway's migrations")?;
    }
    Ok(())
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
    let outcomes = topics.outcomes();
    Ok(match service {
        Service::Order if orchestrated => builder.with(orchestrator(args)?),
        Service::Order => builder
            .step(step("mark-order-paid", order::mark_order_paid).on(&topics.payments))
            .step(step("complete-order", order::complete_order).on(&topics.shipments))
            .step(
                step("note-shipment-failed", order::note_shipment_failed)
                    .on(&topics.shipment_setbacks),
            )
            .step(step("cancel-order", order::cancel_order).on(&topics.payment_setbacks))
            // An order's events depend on each other (paid, then shipped or cancelled): one dead-lettered
            // holds the order's later events back until it is replayed or discarded.
            .order_policy_for_topic(topics.payments.name(), OrderPolicy::HoldKey)
            .order_policy_for_topic(topics.shipments.name(), OrderPolicy::HoldKey)
            .order_policy_for_topic(topics.shipment_setbacks.name(), OrderPolicy::HoldKey)
            .order_policy_for_topic(topics.payment_setbacks.name(), OrderPolicy::HoldKey),
        Service::Payment => {
            let latency = Duration::from_millis(args.gateway_latency_ms);
            let gateway = PaymentGateway::new(gateway_pool(args).await?, latency);
            let (charges, refunds, refund_name) = if orchestrated {
                let (charges, refunds) = (&topics.payment_commands, &topics.refund_commands);
                let compensation = crate::events::PROCESS_PAYMENT.compensation();
                (
                    charges,
                    refunds,
                    compensation.expect("the payment step is compensated"),
                )
            } else {
                (&topics.charges, &topics.refunds, "refund-payment")
            };
            let payments = payment::Payments {
                gateway,
                pool: pool.clone(),
                outcomes,
            };
            let builder = builder
                .two_phase_step(payment::process_payment(payments.clone(), charges))
                .two_phase_step(payment::refund_payment(refund_name, payments, refunds));
            // The commands' topic is the payment service's alone: a command type it does not know
            // (a newer orchestrator's) is a dead letter, not skipped. On the choreographed topics the
            // other services' event types are skipped, by default.
            if orchestrated {
                builder.strict(topics.payment_commands.name())
            } else {
                builder
            }
        }
        Service::Shipping => {
            let arrange = step_with(
                ARRANGE_SHIPMENT.name(),
                outcomes,
                shipping::arrange_shipment,
            );
            if orchestrated {
                builder
                    .step(arrange.on(&topics.shipping_commands))
                    .strict(topics.shipping_commands.name())
            } else {
                builder.step(arrange.on(&topics.shipments_to_arrange))
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
pub fn orchestrator(args: &ServiceArgs) -> anyhow::Result<Orchestrator<order::OrderSaga>> {
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
    // The relay's settings are the framework's (RELAY_*, retention, SAGA_OUTBOX_MODE): those a service's
    // embedded relay reads too.
    Relay::builder()
        .args(
            &args.saga.relay,
            &args.saga.outbox,
            Some(args.database_url()),
        )
        .kafka(args.kafka()?)
        .pool(pool)
        .build()?
        .run(shutdown)
        .await?;
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
    if let Some(partitions) = args.saga.create_topics {
        // Every topic of the saga: this service publishes to topics others consume.
        let names = args.all_topics();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        saga_consumer::setup::ensure_topics(
            &args.kafka()?,
            &refs,
            partitions,
            args.saga.topic_replication,
        )
        .await
        .context("creating topics")?;
    }
    let pool = prepare(service, &args).await?;
    // REDIS_URL turns the Redis fast path on: for the consumer (the service does that), and for the HTTP
    // layer, given the same.
    #[cfg(feature = "redis")]
    let fast_path = if args.saga.fast_path.enabled(&args.saga.relay.retention)? {
        let fast = FastPath::new(args.saga.fast_path.clone(), &pool).await?;
        fast.connect().await;
        Some(fast)
    } else {
        None
    };
    #[cfg(not(feature = "redis"))]
    let fast_path: Option<FastPath> = None;
    #[cfg(not(feature = "redis"))]
    if std::env::var_os("REDIS_URL").is_some_and(|url| !url.is_empty()) {
        tracing::warn!(
            "REDIS_URL is set, but this build has no Redis fast path (feature `redis`): ignored"
        );
    }
    #[cfg(not(feature = "otel"))]
    if std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").is_some_and(|url| !url.is_empty()) {
        tracing::warn!(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set, but this build exports no traces (feature `otel`): ignored"
        );
    }
    #[cfg(feature = "redis")]
    let consumer_fast_path = fast_path.clone();
    let mut saga = args.saga.clone();
    // The demo's defaults where unset, and the example's own names for the group and its topics.
    saga.database.database_url = Some(args.database_url().to_owned());
    saga.kafka.brokers = Some(args.brokers().to_owned());
    saga.consumer.group_id = Some(args.group(service));
    saga.consumer.dlq_topic = Some(args.dlq(service));
    // A demo's pace where left at the framework's defaults (a value other than the default, set by flag or
    // variable, stands): offsets committed often, a killed service's partitions taken over quickly.
    let defaults = saga_consumer::settings::ConsumerArgs::default();
    if saga.consumer.commit_interval == defaults.commit_interval {
        saga.consumer.commit_interval = Duration::from_millis(250);
    }
    if saga.consumer.session_timeout == defaults.session_timeout {
        saga.consumer.session_timeout = Duration::from_secs(6);
    }
    let builder = SagaService::builder().args(&saga).pool(pool.clone());
    #[cfg(feature = "redis")]
    let builder = builder.fast_path(consumer_fast_path);
    let mut builder = builder;
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
        let app = order::router(
            pool.clone(),
            args.topics(),
            &builder.outbox(),
            orchestrator,
            fast_path,
        );
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

/// Without the feature `redis` there is no fast path: the type a service's fast path would have, with no
/// value.
#[cfg(not(feature = "redis"))]
#[derive(Debug, Clone)]
pub enum FastPath {}
