//! Measures the framework on this machine: see `saga-bench --help`.

use std::time::Duration;

use saga_consumer::OutboxMode;
use saga_examples::service::ServiceArgs;
use saga_lab::bench::{
    Progress, Report, broker, consumer, cpu, http, otel, relay, saga, scale, slow,
};
use saga_lab::harness::broker::Broker;
use saga_runtime::kafka::{KafkaConfig, ensure_topics};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// mimalloc, not the system's allocator: with glibc's malloc, allocation was about a quarter of the
/// consumer's own CPU (docs/guide/deployment.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Measures, in one run: consumer throughput with dedup and outbox against an at-least-once baseline, the
/// SQL ceiling (plain, then with each statement the guarantees need) and Kafka consumption alone; relay throughput on a backlog and commit-to-ack latency at a steady rate; the HTTP idempotency layer's
/// added latency; end-to-end saga latency. Prints a table and writes target/saga-bench.json. Needs
/// PostgreSQL and a broker (scripts/dev-services). Build with --release.
#[derive(Debug, clap::Parser)]
#[command(name = "saga-bench", version)]
struct Cli {
    /// Messages for the consumer measurements. librdkafka's mock cluster keeps at most 5 MiB per
    /// partition: a `-mock` section given more stops with a line saying so.
    #[arg(long, default_value_t = 100_000)]
    messages: i64,
    /// Partitions of the consumer topic (and the consumers' concurrency).
    #[arg(long, default_value_t = 4)]
    partitions: i32,
    /// Partitions of each topic of the `saga` section. 20 orders/s need one; on the local broker a
    /// consumer's delivery latency grows with the partitions it reads (see the broker section).
    #[arg(long, default_value_t = 1)]
    saga_partitions: i32,
    /// Messages per transaction, for both consumers.
    #[arg(long, default_value_t = 100)]
    batch_size: usize,
    /// Rows in the relay backlog.
    #[arg(long, default_value_t = 100_000)]
    relay_rows: i64,
    /// Rows per second for the latency measurement.
    #[arg(long, default_value_t = 1_000)]
    steady_rate: u32,
    /// Seconds of steady writing.
    #[arg(long, default_value_t = 10)]
    steady_secs: u32,
    /// Request pairs (with and without the layer).
    #[arg(long, default_value_t = 2_000)]
    http_requests: usize,
    /// Orders for the end-to-end latency.
    #[arg(long, default_value_t = 200)]
    saga_orders: usize,
    /// Orders run first and left out of the end-to-end latency (the first sagas also open connections,
    /// prepare statements and fetch the producers' metadata).
    #[arg(long, default_value_t = 20)]
    saga_warmup: usize,
    /// The saga services' and the broker section's consumer fetch wait in milliseconds
    /// (`fetch.wait.max.ms`; the framework's default when unset).
    #[arg(long)]
    fetch_wait_ms: Option<u64>,
    /// The fetch wait of the `saga-mock` section's services, in milliseconds. The mock cluster answers a
    /// fetch that found nothing only when its wait ends, where Kafka answers as soon as a message arrives: a
    /// short wait stands for that, so the section shows the framework's and PostgreSQL's part of the saga.
    #[arg(long, default_value_t = 1)]
    mock_saga_fetch_wait_ms: u64,
    /// Orders per second for the end-to-end latency.
    #[arg(long, default_value_t = 20)]
    saga_rate: u32,
    /// Also measure the consumer and the relay on librdkafka's in-process mock cluster, to tell the
    /// framework's own cost from the broker's.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    mock_too: bool,
    /// Only these sections (broker, consumer, consumer-mock, consumer-tls, relay, relay-mock, scale, http,
    /// redis, otel, saga, saga-mock, dlq-index); all but dlq-index by default. `dlq-index` runs only when named, with
    /// the `saga` binary built beside this one (cargo build --release -p saga-admin). The `-mock` ones, `redis` and `otel` run on librdkafka's
    /// in-process mock cluster; they, and `http`, need no broker.
    #[arg(long, value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(SECTIONS))]
    only: Vec<String>,
    /// PostgreSQL URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/saga_demo"
    )]
    database_url: String,
    /// Kafka bootstrap servers.
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    brokers: String,
    /// Dead letters of the `dlq-index` section (more than 777: its trace finds `order-777`'s letter).
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(i64).range(778..))]
    dlq_letters: i64,
    /// Messages per setting of the scale-out section.
    #[arg(long, default_value_t = 30_000)]
    scale_messages: i64,
    /// Internal: run as one consumer process of a measured run (`topic|schema|batch size|group|concurrency|key concurrency|tracing`).
    #[arg(long = "scale-worker", hide = true)]
    scale_worker: Option<String>,
    /// Redis, for the `redis` section.
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// Rounds of the `otel` section (each: a consumer process without OpenTelemetry, one with the layer, one
    /// with spans built).
    #[arg(long, default_value_t = 3)]
    otel_rounds: usize,
    /// The outbox modes to measure the consumer, the relay and the saga with (table, wal; both by default:
    /// wal needs wal_level = logical).
    #[arg(long, value_delimiter = ',', default_value = "table,wal", value_parser = parse_outbox_mode)]
    outbox_modes: Vec<OutboxMode>,
    /// The measured consumer holds keys (`OrderPolicy::HoldKey` on its topic): each of its batches reads its
    /// keys' holds, the cost of per-key order through failures when nothing is held.
    #[arg(long)]
    hold_keys: bool,
    /// Where to write the figures: after every section, so a run that fails keeps what it measured.
    #[arg(long, default_value = "target/saga-bench.json")]
    output: std::path::PathBuf,
    /// The most minutes a section may run (`dlq-index`: three times as many); past it, the run ends with
    /// a line saying what the section was waiting for.
    #[arg(long, default_value_t = 20)]
    section_minutes: u64,
}

/// The sections of a run, in the order they run.
const SECTIONS: [&str; 14] = [
    "broker",
    "consumer",
    "consumer-mock",
    "consumer-tls",
    "relay",
    "relay-mock",
    "scale",
    "http",
    "redis",
    "otel",
    "saga",
    "saga-mock",
    "slow-steps",
    "dlq-index",
];

/// The sections that need no broker (the mock cluster stands in, or no Kafka at all).
const BROKER_FREE: [&str; 8] = [
    "consumer-mock",
    "consumer-tls",
    "relay-mock",
    "saga-mock",
    "slow-steps",
    "http",
    "redis",
    "otel",
];

fn parse_outbox_mode(text: &str) -> Result<OutboxMode, String> {
    OutboxMode::parse(text).map_err(|p| p.problem)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let mut cli: Cli = saga_runtime::cli::parse();
    // Plaintext unless the URL says otherwise: the figures compare with earlier runs', taken before the
    // pool preferred TLS (the `consumer-tls` section measures TLS beside it).
    cli.database_url = saga_lab::bench::tls::with_default_sslmode(&cli.database_url, "disable");
    saga_runtime::cli::exit_code(run(cli).await)
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    saga_lab::bench::set_hold_keys(cli.hold_keys);
    // `--mock-too false` leaves out the mock-cluster sections unless they are named.
    let section = |name: &str| {
        let named = cli.only.iter().any(|o| o == name);
        let mock = name.ends_with("-mock");
        named || (cli.only.is_empty() && (!mock || cli.mock_too))
    };
    // The framework's subscriber; a traced worker adds the OpenTelemetry layer of the `otel` section.
    let worker = cli
        .scale_worker
        .as_deref()
        .map(scale::Worker::parse)
        .transpose()?;
    let (_provider, otel_layer) = match worker.as_ref().and_then(|w| w.tracing.sampled_out()) {
        Some(sampled_out) => {
            let (provider, layer) = otel::layer(sampled_out);
            (Some(provider), Some(layer))
        }
        None => (None, None),
    };
    let _ = tracing_subscriber::registry()
        .with(saga_runtime::telemetry::env_filter())
        .with(saga_runtime::telemetry::log_lines())
        .with(otel_layer)
        .try_init();
    if let Some(worker) = worker {
        let kafka = KafkaConfig::new(cli.brokers.clone());
        return worker.run(&kafka, &cli.database_url).await;
    }
    let progress = Progress::new();
    // A section that runs has a deadline: one that waits too long ends the run, saying for what.
    let starts = |name: &str| {
        let minutes = if name == "dlq-index" { 3 } else { 1 } * cli.section_minutes;
        section(name) && progress.begin_section(name, Duration::from_secs(minutes * 60))
    };
    let run = format!(
        "bench-{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis()
    );
    let mut args = ServiceArgs::local(
        cli.database_url.clone(),
        cli.brokers.clone(),
        run.replace('-', "_"),
        run.clone(),
    );
    args.http_addr = saga_test_support::free_local_addr();
    args.gateway_latency_ms = 1;
    if let Some(ms) = cli.fetch_wait_ms {
        args.saga.consumer.fetch_wait = std::time::Duration::from_millis(ms);
    }
    let uses_broker = SECTIONS
        .iter()
        .any(|name| !BROKER_FREE.contains(name) && section(name));
    if uses_broker {
        args.check().await?;
    }
    let kafka = KafkaConfig::new(cli.brokers.clone());
    let mut report = Report {
        settings: serde_json::json!({
            "messages": cli.messages, "partitions": cli.partitions, "saga_partitions": cli.saga_partitions, "batch_size": cli.batch_size,
            "relay_rows": cli.relay_rows, "steady_rate": cli.steady_rate, "steady_secs": cli.steady_secs,
            "http_requests": cli.http_requests, "saga_orders": cli.saga_orders, "saga_rate": cli.saga_rate,
            "mock_saga_fetch_wait_ms": cli.mock_saga_fetch_wait_ms,
            "scale_messages": cli.scale_messages, "scale_key_concurrency": scale::KEY_CONCURRENCY,
            "cores": std::thread::available_parallelism().map(std::num::NonZero::get).unwrap_or(1),
            "release_build": !cfg!(debug_assertions),
        }),
        ..Report::default()
    };
    report.machine = Some(machine(&cli).await);
    let mut schemas = Vec::new();
    let schema = |suffix: &str| format!("{}_{suffix}", args.schema_prefix);

    if starts("broker") {
        let topic = format!("{run}.broker");
        ensure_topics(&kafka, &[&topic], cli.partitions, 1).await?;
        progress.note("broker: raw produce throughput and ack latency");
        report.broker_produce_msgs_per_s =
            Some(broker::produce_throughput(&kafka, &topic, cli.relay_rows, 0, &progress).await?);
        report.broker_produce_with_headers_msgs_per_s = Some(
            broker::produce_throughput(&kafka, &topic, cli.relay_rows / 4, 10, &progress).await?,
        );
        report.broker_ack_ms = Some(broker::ack_latency(&kafka, &topic, 500).await?);
        let (delivery, idle) = (
            format!("{run}.broker-delivery"),
            format!("{run}.broker-idle"),
        );
        let two = format!("{delivery}-2");
        ensure_topics(&kafka, &[&delivery], 1, 1).await?;
        ensure_topics(&kafka, &[&two, &idle], cli.partitions, 1).await?;
        progress.note(
            "broker: send-to-receive latency at 20 messages/s, one partition, then two topics",
        );
        let fetch_wait = cli.fetch_wait_ms.map_or(
            saga_consumer::settings::ConsumerArgs::default().fetch_wait,
            std::time::Duration::from_millis,
        );
        report.broker_delivery_ms =
            Some(broker::delivery_latency(&kafka, &delivery, None, 1, fetch_wait, 300, 20).await?);
        report.broker_delivery_two_topics_ms = Some(
            broker::delivery_latency(
                &kafka,
                &two,
                Some(&idle),
                cli.partitions,
                fetch_wait,
                300,
                20,
            )
            .await?,
        );
    }
    checkpoint(&report, &cli.output)?;
    if starts("consumer") {
        let figures =
            consumer_figures(&cli, &args, &kafka, "consumer", &mut schemas, &progress).await?;
        report.consumer_msgs_per_s = Some(figures.framework);
        report.baseline_msgs_per_s = Some(figures.baseline);
        report.consumer_vs_baseline_ratio = Some(figures.framework / figures.baseline);
        report.sql_ceiling_msgs_per_s = Some(figures.ceiling);
        report.consumer_vs_sql_ceiling_ratio = Some(figures.vs_ceiling);
        report.sql_with_guarantees_msgs_per_s = Some(figures.guarded);
        report.consumer_vs_sql_with_guarantees_ratio = Some(figures.vs_guarded);
        report.kafka_consume_only_msgs_per_s = Some(figures.consume_only);
        report.sql_ceiling_steps = Some(serde_json::to_value(&figures.ceiling_steps)?);
        report.consumer_run = Some(figures.run);
        report.consumer_cpu = Some(figures.cpu);
    }
    checkpoint(&report, &cli.output)?;
    if starts("consumer-mock") {
        {
            progress.note("consumer on librdkafka's mock cluster");
            let mock = Broker::mock()?;
            let mock_kafka = KafkaConfig::new(mock.brokers());
            for mode in &cli.outbox_modes {
                // The consumer's and the ceiling's outbox writes follow the mode (opened with the schema).
                saga_lab::bench::set_outbox(saga_consumer::Outbox::new(
                    *mode,
                    saga_consumer::settings::OutboxArgs::default().max_transaction_bytes,
                ));
                let label = if *mode == OutboxMode::Wal {
                    "mock_wal"
                } else {
                    "mock"
                };
                // Topics of the mode's own: the mock cluster has no admin API to create them on demand.
                let work = format!("{run}.{label}.work");
                let topics = [
                    work.clone(),
                    format!("{work}.dlq"),
                    format!("{work}.retry"),
                    format!("{work}.done"),
                ];
                mock.create_topics(&topics, cli.partitions).await?;
                let figures =
                    consumer_figures(&cli, &args, &mock_kafka, label, &mut schemas, &progress)
                        .await?;
                let value = serde_json::json!({
                    "consumer_msgs_per_s": figures.framework,
                    "baseline_msgs_per_s": figures.baseline,
                    "consumer_vs_baseline_ratio": figures.framework / figures.baseline,
                    "sql_ceiling_msgs_per_s": figures.ceiling,
                    "consumer_vs_sql_ceiling_ratio": figures.vs_ceiling,
                    "sql_with_guarantees_msgs_per_s": figures.guarded,
                    "consumer_vs_sql_with_guarantees_ratio": figures.vs_guarded,
                    "kafka_consume_only_msgs_per_s": figures.consume_only,
                    "sql_ceiling_steps": figures.ceiling_steps,
                    "consumer_run": figures.run,
                    "consumer_cpu": figures.cpu,
                });
                let mock_figures = report
                    .mock_broker
                    .get_or_insert_with(|| serde_json::json!({}));
                if *mode == OutboxMode::Wal {
                    mock_figures["wal"] = value;
                } else if let (Some(into), Some(from)) =
                    (mock_figures.as_object_mut(), value.as_object())
                {
                    into.extend(from.clone());
                }
            }
            saga_lab::bench::set_outbox(saga_consumer::Outbox::table());
        }
    }
    checkpoint(&report, &cli.output)?;
    if starts("consumer-tls") {
        let require = saga_lab::bench::tls::with_sslmode(&cli.database_url, "require");
        match sqlx::PgPool::connect(&require).await {
            Ok(pool) => {
                pool.close().await;
                report.consumer_tls = Some(tls_figures(&cli, &args, &mut schemas, &progress).await?);
            }
            Err(e) => progress.note(&format!(
                "consumer-tls skipped: the server refuses sslmode=require ({e}); scripts/dev-services \
                 gives the local PostgreSQL a certificate"
            )),
        }
    }
    checkpoint(&report, &cli.output)?;
    if starts("relay") {
        let topic = format!("{run}.relay");
        ensure_topics(&kafka, &[&topic], cli.partitions, 1).await?;
        for mode in &cli.outbox_modes {
            let figures = relay_figures(
                &cli,
                &args,
                &kafka,
                &topic,
                *mode,
                "relay",
                &mut schemas,
                &progress,
            )
            .await?;
            if *mode == OutboxMode::Wal {
                figures.record(report.wal.get_or_insert_with(|| serde_json::json!({})));
            } else {
                report.relay_rows_per_s = Some(figures.rows_per_s);
                report.relay_commit_to_ack_p50_ms = Some(figures.p50_ms);
                report.relay_commit_to_ack_p99_ms = Some(figures.p99_ms);
                report.relay_sql_ceiling_rows_per_s = figures.sql_ceiling;
            }
        }
    }
    checkpoint(&report, &cli.output)?;
    if starts("relay-mock") {
        let topic = format!("{run}.relay");
        {
            progress.note("relay on librdkafka's mock cluster");
            let mock = Broker::mock()?;
            let mock_kafka = KafkaConfig::new(mock.brokers());
            mock.create_topics(std::slice::from_ref(&topic), cli.partitions)
                .await?;
            for mode in &cli.outbox_modes {
                let measured = relay_figures(
                    &cli,
                    &args,
                    &mock_kafka,
                    &topic,
                    *mode,
                    "relay_mock",
                    &mut schemas,
                    &progress,
                )
                .await?;
                measured.record(mock_figures(&mut report, *mode));
            }
        }
    }
    checkpoint(&report, &cli.output)?;
    if starts("scale") {
        for key_concurrency in [1, scale::KEY_CONCURRENCY] {
            let mut settings = Vec::new();
            for n in [1, 2, 4] {
                let name = schema(&format!("scale{n}k{key_concurrency}"));
                let pool = fresh_schema(&args, &name, &mut schemas).await?;
                settings.push((n, name, pool));
            }
            let steps = scale::consumers(
                &kafka,
                &cli.database_url,
                &run,
                settings,
                cli.scale_messages,
                cli.partitions,
                cli.batch_size,
                key_concurrency,
                &progress,
            )
            .await?;
            if key_concurrency == 1 {
                report.scale_consumers = Some(steps);
            } else {
                report.scale_consumers_keys_in_parallel = Some(steps);
            }
        }
        let topic = format!("{run}.relay");
        ensure_topics(&kafka, &[&topic], cli.partitions, 1).await?;
        let mut relays: Vec<scale::ScaleStep> = Vec::new();
        for instances in [1, 2] {
            let pool = fresh_schema(
                &args,
                &schema(&format!("scale_relay{instances}")),
                &mut schemas,
            )
            .await?;
            let table = relay::Outbox {
                mode: OutboxMode::Table,
                url: cli.database_url.clone(),
            };
            let per_s = relay::backlog(
                &kafka,
                &pool,
                &topic,
                cli.relay_rows,
                instances,
                &table,
                &progress,
            )
            .await?;
            progress.note(&format!(
                "scale-out: {instances} relay(s): {per_s:.0} rows/s"
            ));
            let one = relays.first().map_or(per_s, |s| s.per_s);
            relays.push(scale::ScaleStep {
                instances,
                per_s,
                ratio: per_s / one,
            });
        }
        report.scale_relays = Some(relays);
    }
    checkpoint(&report, &cli.output)?;
    if starts("http") {
        let pool = fresh_schema(&args, &schema("http"), &mut schemas).await?;
        progress.note("http: with and without the idempotency layer");
        let (w50, w99, o50, o99) = http::overhead(&pool, cli.http_requests, &progress).await?;
        report.http_with_layer_ms = Some((w50, w99));
        report.http_without_layer_ms = Some((o50, o99));
        report.http_overhead_p50_ms = Some(w50 - o50);
        report.http_overhead_p99_ms = Some(w99 - o99);
    }
    checkpoint(&report, &cli.output)?;
    if starts("redis") {
        let mut pools = Vec::new();
        for side in ["redis_http_pg", "redis_http", "redis_dup_pg", "redis_dup"] {
            pools.push(fresh_schema(&args, &schema(side), &mut schemas).await?);
        }
        let mock = Broker::mock()?;
        let mock_kafka = KafkaConfig::new(mock.brokers());
        let topic = format!("{run}.redis.work");
        mock.create_topics(
            &[
                topic.clone(),
                format!("{topic}.dlq"),
                format!("{topic}.retry"),
            ],
            cli.partitions,
        )
        .await?;
        report.redis = Some(
            saga_lab::bench::redis::figures(
                &cli.redis_url,
                [&pools[0], &pools[1], &pools[2], &pools[3]],
                &mock_kafka,
                &topic,
                200,
                1_000,
                cli.messages / 2,
                &progress,
            )
            .await?,
        );
    }
    checkpoint(&report, &cli.output)?;
    if starts("otel") {
        let mut pools = Vec::new();
        for i in 0..cli.otel_rounds.max(1) * 3 {
            let name = schema(&format!("otel{i}"));
            let pool = fresh_schema(&args, &name, &mut schemas).await?;
            consumer::create_effects_table(&pool).await?;
            pools.push((name, pool));
        }
        let mock = Broker::mock()?;
        let mock_kafka = KafkaConfig::new(mock.brokers());
        let topic = format!("{run}.otel.work");
        mock.create_topics(
            &[
                topic.clone(),
                format!("{topic}.dlq"),
                format!("{topic}.retry"),
                format!("{topic}.done"),
            ],
            cli.partitions,
        )
        .await?;
        progress
            .note("otel: the consumer with and without an OpenTelemetry layer (spans sampled out)");
        consumer::produce_keys(
            &mock_kafka,
            &topic,
            cli.messages / 2,
            cli.messages / 2,
            Some(otel::SAMPLED_OUT_PARENT),
            &progress,
        )
        .await?;
        report.otel = Some(
            otel::figures(
                &mock_kafka,
                &cli.database_url,
                &pools,
                &topic,
                cli.messages / 2,
                cli.batch_size,
                usize::try_from(cli.partitions)?,
                &progress,
            )
            .await?,
        );
    }
    checkpoint(&report, &cli.output)?;
    if starts("saga") {
        let quiet = quiet_database(&cli.database_url, &mut schemas, &progress).await?;
        report.settings["saga_checkpointed"] = serde_json::json!(quiet);
        let broker = Broker::External(cli.brokers.clone());
        for mode in &cli.outbox_modes {
            let latency = saga_pass(&cli, &args, &broker, *mode, &mut schemas, &progress).await?;
            if *mode == OutboxMode::Wal {
                let wal = report.wal.get_or_insert_with(|| serde_json::json!({}));
                wal["saga_e2e_p50_ms"] = serde_json::json!(latency.e2e_ms.0);
                wal["saga_e2e_p99_ms"] = serde_json::json!(latency.e2e_ms.1);
            } else {
                report.saga_e2e_p50_ms = Some(latency.e2e_ms.0);
                report.saga_e2e_p99_ms = Some(latency.e2e_ms.1);
                report.saga_hops = Some(latency.hops);
            }
        }
    }
    checkpoint(&report, &cli.output)?;
    if starts("saga-mock") {
        let quiet = quiet_database(&cli.database_url, &mut schemas, &progress).await?;
        report.settings["saga_mock_checkpointed"] = serde_json::json!(quiet);
        // The same sagas on the mock cluster, whose delivery is its fetch wait: what the framework and
        // PostgreSQL take without the broker's time.
        let mock = Broker::mock()?;
        let mut args = args.clone();
        args.saga.kafka.brokers = Some(mock.brokers());
        args.saga.consumer.fetch_wait =
            std::time::Duration::from_millis(cli.mock_saga_fetch_wait_ms);
        args.schema_prefix = format!("{}_mock", args.schema_prefix);
        args.topic_prefix = format!("{}-mock", args.topic_prefix);
        for mode in &cli.outbox_modes {
            let latency = saga_pass(&cli, &args, &mock, *mode, &mut schemas, &progress).await?;
            let figures = mock_figures(&mut report, *mode);
            if *mode == OutboxMode::Table {
                figures["saga_hops"] = serde_json::json!(latency.hops);
            }
            figures["saga_e2e_p50_ms"] = serde_json::json!(latency.e2e_ms.0);
            figures["saga_e2e_p99_ms"] = serde_json::json!(latency.e2e_ms.1);
            // The framework's part: end to end less the payment step's outside call (the gateway's time).
            figures["saga_framework_p50_ms"] = serde_json::json!(latency.framework_ms.0);
            figures["saga_framework_p99_ms"] = serde_json::json!(latency.framework_ms.1);
            figures["saga_call_p50_ms"] = serde_json::json!(latency.call_ms.0);
            figures["saga_call_p99_ms"] = serde_json::json!(latency.call_ms.1);
        }
    }

    checkpoint(&report, &cli.output)?;
    if starts("slow-steps") {
        report.slow_steps = Some(slow_steps(&args, &run, &mut schemas, &progress).await?);
    }

    // Named only: it runs the `saga` binary, built apart.
    checkpoint(&report, &cli.output)?;
    if cli.only.iter().any(|o| o == "dlq-index")
        && progress.begin_section(
            "dlq-index",
            Duration::from_secs(3 * 60 * cli.section_minutes),
        )
    {
        // The trace reads every service schema of the database: the earlier sections' go first, so that
        // the section measures a trace over its own data, not over the run's leftovers.
        let admin = sqlx::PgPool::connect(&cli.database_url).await?;
        for name in schemas.drain(..) {
            saga_lab::harness::drop_schema(&admin, &name).await?;
        }
        admin.close().await;
        let name = schema("dlq");
        schemas.push(name.clone());
        report.dlq_index = Some(
            saga_lab::bench::dlq::run(
                &kafka,
                &cli.database_url,
                &name,
                &format!("{run}.letters.dlq"),
                cli.dlq_letters,
                &progress,
            )
            .await?,
        );
    }

    checkpoint(&report, &cli.output)?;
    // The sections ended: what follows (deleting topics and schemas) has no deadline of a section's.
    progress.end_section();
    // The broker keeps what was produced: delete the run's topics.
    if uses_broker
        && let Ok(admin) = saga_runtime::kafka::client_config(&kafka)
            .create::<rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>>()
    {
        let names: Vec<String> = [
            "work",
            "work.dlq",
            "work.retry",
            "work.done",
            "relay",
            "broker",
            "orders",
            "payments",
            "shipping",
            "scale1",
            "scale1.dlq",
            "scale1.retry",
            "scale1.done",
            "scale2",
            "scale2.dlq",
            "scale2.retry",
            "scale2.done",
            "scale4",
            "scale4.dlq",
            "scale4.retry",
            "scale4.done",
            "letters.dlq",
            "letters.dlq.large",
        ]
        .iter()
        .map(|t| format!("{run}.{t}"))
        .chain(args.all_topics())
        .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let _ = admin
            .delete_topics(&refs, &rdkafka::admin::AdminOptions::new())
            .await;
    }
    let admin = sqlx::PgPool::connect(&cli.database_url).await?;
    for name in schemas {
        saga_lab::harness::drop_schema(&admin, &name).await?;
    }
    report.print();
    report.complete = true;
    checkpoint(&report, &cli.output)?;
    println!("\nwritten to {}", cli.output.display());
    Ok(())
}

/// Writes the figures measured so far (marked incomplete until the run's end): a section that fails later
/// leaves the earlier ones on disk. Written beside and renamed, so that a run killed meanwhile leaves the
/// file whole.
fn checkpoint(report: &Report, output: &std::path::Path) -> anyhow::Result<()> {
    if let Some(dir) = output.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let partial = output.with_extension("json.partial");
    std::fs::write(&partial, serde_json::to_string_pretty(report)?)?;
    std::fs::rename(&partial, output)?;
    Ok(())
}

/// A new schema `name` with the framework's migrations; remembered for clean-up.
async fn fresh_schema(
    args: &ServiceArgs,
    name: &str,
    schemas: &mut Vec<String>,
) -> anyhow::Result<sqlx::PgPool> {
    let pool = args.pool(name, 16).await?;
    schemas.push(name.to_owned());
    saga_consumer::migrate::migrate(&pool).await?;
    Ok(pool)
}

/// The `slow-steps` section on the mock cluster: the serial run, the parallel one, and the parallel one
/// with 1% of keys failing, each on a topic, group and schema of its own (see [`slow`]).
async fn slow_steps(
    args: &ServiceArgs,
    run: &str,
    schemas: &mut Vec<String>,
    progress: &Progress,
) -> anyhow::Result<slow::Figures> {
    let mock = Broker::mock()?;
    let kafka = KafkaConfig::new(mock.brokers());
    let parallel_messages = slow::KEYS * slow::PER_KEY;
    let runs = [
        ("serial", 1, slow::SERIAL_MESSAGES, false),
        ("parallel", slow::KEY_CONCURRENCY, parallel_messages, false),
        ("failing", slow::KEY_CONCURRENCY, parallel_messages, true),
    ];
    let mut figures = Vec::new();
    let mut in_order = false;
    for (label, keys_at_once, messages, failing) in runs {
        let topic = format!("{run}.slow.{label}");
        let topics = [
            topic.clone(),
            format!("{topic}.dlq"),
            format!("{topic}.retry"),
        ];
        mock.create_topics(&topics, 1).await?;
        progress.note(&format!(
            "slow steps, {label}: producing {messages} messages"
        ));
        slow::produce(&kafka, &topic, messages).await?;
        let name = format!("{}_slow_{label}", args.schema_prefix);
        schemas.push(name.clone());
        // Connections for every key at once around its call, and the consumer's own.
        let pool = args.pool(&name, slow::KEY_CONCURRENCY as u32 + 8).await?;
        saga_consumer::migrate::migrate(&pool).await?;
        slow::create_table(&pool).await?;
        let measured = slow::run(
            &kafka,
            &pool,
            &topic,
            keys_at_once,
            messages,
            failing,
            progress,
        )
        .await?;
        if failing {
            in_order = slow::failing_keys_in_order(&pool).await?;
        }
        figures.push(measured);
        pool.close().await;
    }
    let [serial, parallel, with_failures] = <[slow::Run; 3]>::try_from(figures)
        .map_err(|_| anyhow::anyhow!("the slow-steps section measured fewer runs than it made"))?;
    Ok(slow::Figures {
        call_ms: slow::CALL.as_secs_f64() * 1000.0,
        keys: slow::KEYS,
        failures_vs_failure_free: with_failures.msgs_per_s / parallel.msgs_per_s,
        failing_keys_in_order: in_order,
        serial,
        parallel,
        with_failures,
    })
}

/// The `consumer-tls` section: the consumer on the mock cluster with its database connections over TLS
/// (`sslmode=require`) against plaintext (`sslmode=disable`), in turns, in one run.
async fn tls_figures(
    cli: &Cli,
    args: &ServiceArgs,
    schemas: &mut Vec<String>,
    progress: &Progress,
) -> anyhow::Result<saga_lab::bench::tls::TlsFigures> {
    progress.note("consumer over TLS against plaintext, on librdkafka's mock cluster");
    let mock = Broker::mock()?;
    let kafka = KafkaConfig::new(mock.brokers());
    let work = format!("{}.mock_tls.work", args.topic_prefix);
    let topics = [
        work.clone(),
        format!("{work}.dlq"),
        format!("{work}.retry"),
        format!("{work}.done"),
    ];
    mock.create_topics(&topics, cli.partitions).await?;
    saga_lab::bench::consumer::produce(&kafka, &work, cli.messages, progress).await?;
    let mut pools = Vec::new();
    for (side, sslmode) in [("plain", "disable"), ("tls", "require")] {
        let mut side_args = args.clone();
        side_args.saga.database.database_url = Some(saga_lab::bench::tls::with_sslmode(
            args.database_url(),
            sslmode,
        ));
        let pool = fresh_schema(
            &side_args,
            &format!("{}_tls_{side}", args.schema_prefix),
            schemas,
        )
        .await?;
        saga_lab::bench::consumer::create_effects_table(&pool).await?;
        pools.push(pool);
    }
    saga_lab::bench::set_outbox(saga_consumer::Outbox::table());
    saga_lab::bench::tls::figures(
        &kafka,
        &pools[0],
        &pools[1],
        &work,
        cli.messages,
        cli.batch_size,
        usize::try_from(cli.partitions)?,
        progress,
    )
    .await
}

/// The machine of the run: CPU, cores, memory, kernel, PostgreSQL, the build's commit.
async fn machine(cli: &Cli) -> serde_json::Value {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let cpu = read("/proc/cpuinfo").lines().find_map(|l| {
        l.strip_prefix("model name")
            .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
    });
    let memory_gib = read("/proc/meminfo").lines().find_map(|l| {
        let kib: f64 = l
            .strip_prefix("MemTotal:")?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some((kib / 1_048_576.0 * 10.0).round() / 10.0)
    });
    let postgres = match sqlx::PgPool::connect(&cli.database_url).await {
        Ok(pool) => sqlx::query_scalar::<_, String>("SELECT current_setting('server_version')")
            .fetch_one(&pool)
            .await
            .ok(),
        Err(_) => None,
    };
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        // The working tree differs from that commit (a file changed or not yet added), as it is when the
        // run starts: the figures may not be the commit's.
        .map(|commit| {
            let clean = std::process::Command::new("git")
                .args(["status", "--porcelain"])
                .output()
                .is_ok_and(|o| o.status.success() && o.stdout.is_empty());
            if clean {
                commit
            } else {
                format!("{commit} with uncommitted changes")
            }
        });
    serde_json::json!({
        "cpu": cpu,
        "cores": std::thread::available_parallelism().map(std::num::NonZero::get).unwrap_or(1),
        "memory_gib": memory_gib,
        "kernel": read("/proc/sys/kernel/osrelease").trim(),
        "postgres": postgres,
        "commit": commit,
        "allocator": "mimalloc",
    })
}

/// Where the report keeps the mock cluster's figures of outbox mode `mode`: `mock_broker`, or its `wal` part.
fn mock_figures(report: &mut Report, mode: OutboxMode) -> &mut serde_json::Value {
    let figures = report
        .mock_broker
        .get_or_insert_with(|| serde_json::json!({}));
    if mode != OutboxMode::Wal {
        return figures;
    }
    if figures.get("wal").is_none() {
        figures["wal"] = serde_json::json!({});
    }
    &mut figures["wal"]
}

/// Before a latency section: drops the earlier sections' schemas (their tables would still be vacuumed
/// meanwhile; their buffers go with them) and has PostgreSQL write out the rest of its dirty pages now
/// (`CHECKPOINT`), so that the section measures its own sagas, not the vacuum and the checkpoint the
/// throughput sections' writes owe. Returns whether the checkpoint ran. A schema that cannot be dropped
/// now is noted and left to the run's final cleanup.
async fn quiet_database(
    url: &str,
    schemas: &mut Vec<String>,
    progress: &Progress,
) -> anyhow::Result<bool> {
    progress.doing("quieting the database: the earlier sections' schemas dropped, a checkpoint");
    let admin = sqlx::PgPool::connect(url).await?;
    // A WAL pass's relay lets go of its slot as its connection closes: an active slot is not dropped.
    for _ in 0..100 {
        let active: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_replication_slots WHERE database = current_database() AND active",
        )
        .fetch_one(&admin)
        .await?;
        if active == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut kept = Vec::new();
    for name in schemas.drain(..) {
        if let Err(e) = saga_lab::harness::drop_schema(&admin, &name).await {
            progress.note(&format!("schema {name} left to the final cleanup: {e}"));
            kept.push(name);
        }
    }
    *schemas = kept;
    // A role without the right to checkpoint measures without it: the figures stay, the page says so.
    let checkpointed = match sqlx::query("CHECKPOINT").execute(&admin).await {
        Ok(_) => true,
        Err(e) => {
            progress.note(&format!("no checkpoint before the latency section: {e}"));
            false
        }
    };
    admin.close().await;
    Ok(checkpointed)
}

/// One pass of the `saga` section: the example's services in outbox mode `mode` on `broker`, each mode on
/// schemas, topics and an HTTP address of its own; the schemas it used are added to `schemas`.
async fn saga_pass(
    cli: &Cli,
    args: &ServiceArgs,
    broker: &Broker,
    mode: OutboxMode,
    schemas: &mut Vec<String>,
    progress: &Progress,
) -> anyhow::Result<saga::SagaLatency> {
    let mut args = args.clone();
    args.saga.outbox.mode = mode;
    // librdkafka's mock cluster does not answer DescribeConfigs: the services' check that topics keep
    // messages no longer than step keys cannot run there (as in `harness::run` and saga-testing).
    args.saga.accept_key_expiry = matches!(broker, Broker::Mock(_));
    if mode == OutboxMode::Wal {
        args.schema_prefix = format!("{}_wal", args.schema_prefix);
        args.topic_prefix = format!("{}-wal", args.topic_prefix);
    }
    args.http_addr = saga_test_support::free_local_addr();
    broker
        .create_topics(&args.all_topics(), cli.saga_partitions)
        .await?;
    let probe = format!("{}_probe", args.schema_prefix);
    let pool = args.pool(&probe, 2).await?;
    schemas.push(probe);
    progress.note(&format!(
        "saga: end-to-end latency ({}, {})",
        mode.as_str(),
        broker.describe()
    ));
    let latency = saga::latency(
        &args,
        &pool,
        cli.saga_warmup,
        cli.saga_orders,
        cli.saga_rate,
        progress,
    )
    .await?;
    progress.note(&format!(
        "saga ({}): p50 {:.1} ms, p99 {:.1} ms; less the payment gateway's call (p50 {:.1} ms): p50 {:.1} ms, p99 {:.1} ms",
        mode.as_str(),
        latency.e2e_ms.0,
        latency.e2e_ms.1,
        latency.call_ms.0,
        latency.framework_ms.0,
        latency.framework_ms.1
    ));
    for service in saga_examples::service::Service::ALL {
        schemas.push(args.schema(service));
    }
    schemas.push(args.gateway_schema());
    Ok(latency)
}

/// The relay's figures on `kafka`, each in a fresh schema (`{prefix}_{label}`, `{prefix}_{label}_steady`
/// and, in table mode, `{prefix}_{label}_sql`): rows per second through a backlog, commit-to-ack p50 and p99
/// at a steady rate, and the relay's SQL ceiling (the same backlog drained by its statements alone).
#[allow(clippy::too_many_arguments)]
async fn relay_figures(
    cli: &Cli,
    args: &ServiceArgs,
    kafka: &KafkaConfig,
    topic: &str,
    mode: OutboxMode,
    label: &str,
    schemas: &mut Vec<String>,
    progress: &Progress,
) -> anyhow::Result<RelayFigures> {
    let label = format!("{label}_{}", mode.as_str());
    let outbox = relay::Outbox {
        mode,
        url: cli.database_url.clone(),
    };
    progress.note(&format!("{label}: backlog"));
    let pool = fresh_schema(args, &format!("{}_{label}", args.schema_prefix), schemas).await?;
    let rows = relay::backlog(kafka, &pool, topic, cli.relay_rows, 1, &outbox, progress).await?;
    progress.note(&format!("{label}: backlog {rows:.0} events/s"));
    let pool = fresh_schema(
        args,
        &format!("{}_{label}_steady", args.schema_prefix),
        schemas,
    )
    .await?;
    progress.note(&format!("{label}: latency at a steady rate"));
    let (p50, p99) = relay::steady(
        kafka,
        &pool,
        topic,
        cli.steady_rate,
        cli.steady_secs,
        &outbox,
        progress,
    )
    .await?;
    progress.note(&format!(
        "{label}: commit→ack p50 {p50:.2} ms, p99 {p99:.2} ms"
    ));
    let sql_ceiling = if mode == OutboxMode::Table {
        let pool = fresh_schema(
            args,
            &format!("{}_{label}_sql", args.schema_prefix),
            schemas,
        )
        .await?;
        let ceiling = relay::sql_ceiling(&pool, topic, cli.relay_rows, progress).await?;
        progress.note(&format!(
            "{label}: the relay's SQL alone {ceiling:.0} events/s"
        ));
        Some(ceiling)
    } else {
        None
    };
    Ok(RelayFigures {
        rows_per_s: rows,
        p50_ms: p50,
        p99_ms: p99,
        sql_ceiling,
    })
}

/// What [`relay_figures`] measured.
struct RelayFigures {
    /// Events per second through the backlog.
    rows_per_s: f64,
    /// Commit-to-acknowledgement p50 at the steady rate, in milliseconds.
    p50_ms: f64,
    /// Its p99.
    p99_ms: f64,
    /// The relay's statements alone over the same backlog (table mode), in events per second.
    sql_ceiling: Option<f64>,
}

impl RelayFigures {
    /// Writes the figures into `figures` (a JSON object), under the names the report uses.
    fn record(&self, figures: &mut serde_json::Value) {
        figures["relay_rows_per_s"] = serde_json::json!(self.rows_per_s);
        figures["relay_commit_to_ack_p50_ms"] = serde_json::json!(self.p50_ms);
        figures["relay_commit_to_ack_p99_ms"] = serde_json::json!(self.p99_ms);
        if let Some(ceiling) = self.sql_ceiling {
            figures["relay_sql_ceiling_rows_per_s"] = serde_json::json!(ceiling);
            figures["relay_vs_sql_ceiling_ratio"] = serde_json::json!(self.rows_per_s / ceiling);
        }
    }
}

/// The framework's consumer over `kafka` and its yardsticks, in turn: the at-least-once baseline, the
/// framework, the SQL ceiling, the SQL with the guarantees and Kafka consumption alone, with CPU per
/// message around each of the last four.
async fn consumer_figures(
    cli: &Cli,
    args: &ServiceArgs,
    kafka: &KafkaConfig,
    label: &str,
    schemas: &mut Vec<String>,
    progress: &Progress,
) -> anyhow::Result<ConsumerFigures> {
    let topic = if label.starts_with("mock") {
        format!("{}.{label}.work", args.topic_prefix)
    } else {
        let topic = format!("{}.work", args.topic_prefix);
        ensure_topics(
            kafka,
            &[
                &topic,
                &format!("{topic}.dlq"),
                &format!("{topic}.retry"),
                &format!("{topic}.done"),
            ],
            cli.partitions,
            1,
        )
        .await?;
        topic
    };
    progress.note(&format!("consumer ({label}): producing the messages"));
    consumer::produce(kafka, &topic, cli.messages, progress).await?;
    let pool = fresh_schema(args, &format!("{}_{label}", args.schema_prefix), schemas).await?;
    // As a service does at start (in WAL mode, its events are decoded only once the slot exists).
    let mode = saga_lab::bench::outbox().mode();
    saga_lab::bench::set_outbox(saga_consumer::setup::use_outbox(&pool, mode).await?);
    consumer::create_effects_table(&pool).await?;
    consumer::create_baseline_table(&pool).await?;
    progress.note(&format!("consumer ({label}): the at-least-once baseline"));
    let baseline =
        consumer::baseline(kafka, &pool, &topic, cli.messages, cli.batch_size, progress).await?;
    progress.note(&format!(
        "consumer ({label}): baseline {baseline:.0} msg/s; now the framework's consumer"
    ));
    // The framework's rounds and the ceilings in turns, round by round: the machine's drift and the tables'
    // growth fall on each alike.
    let kinds = consumer::Ceiling::STEPS;
    let mut rates = vec![Vec::with_capacity(consumer::CEILING_ROUNDS); kinds.len()];
    let mut cpu_seconds = vec![Vec::new(); kinds.len()];
    let (mut runs, mut framework_cpu) = (Vec::new(), Vec::new());
    let mut last_sample = cpu::CpuSample::now();
    for round in 0..consumer::CEILING_ROUNDS {
        let run = consumer::framework(
            kafka,
            &pool,
            &topic,
            round,
            cli.messages,
            cli.batch_size,
            usize::try_from(cli.partitions)?,
            progress,
        )
        .await?;
        let sample = cpu::CpuSample::now();
        if let (Some(from), Some(to)) = (last_sample, sample) {
            framework_cpu.push(from.until(&to, cli.messages));
        }
        last_sample = sample;
        progress.note(&format!(
            "consumer ({label}): framework {:.0} msg/s; now the SQL ceilings, round {} of {}",
            run.msgs_per_s,
            round + 1,
            consumer::CEILING_ROUNDS
        ));
        runs.push(run);
        for (i, kind) in kinds.into_iter().enumerate() {
            let rate = consumer::sql_ceiling(
                &pool,
                kind,
                round,
                cli.messages,
                cli.batch_size,
                usize::try_from(cli.partitions)?,
            )
            .await?;
            let sample = cpu::CpuSample::now();
            if let (Some(from), Some(to)) = (last_sample, sample) {
                cpu_seconds[i].push(from.until(&to, cli.messages));
            }
            rates[i].push(rate);
            last_sample = sample;
        }
    }
    // Each round's framework against the ceilings of the same round, which ran right after it: the
    // median of those ratios is the figure, so that the machine's drift between rounds cancels out.
    let round_ratios = |ceiling: &[f64]| {
        let mut ratios: Vec<f64> = runs
            .iter()
            .zip(ceiling)
            .map(|(run, ceiling)| run.msgs_per_s / ceiling)
            .collect();
        saga_lab::bench::percentile(&mut ratios, 0.5)
    };
    let (vs_ceiling, vs_guarded) = (
        round_ratios(&rates[0]),
        round_ratios(&rates[kinds.len() - 1]),
    );
    // The median round's run stands for the framework.
    runs.sort_by(|a, b| a.msgs_per_s.total_cmp(&b.msgs_per_s));
    let run = runs.swap_remove(runs.len() / 2);
    let framework = run.msgs_per_s;
    progress.note(&format!(
        "consumer ({label}): framework {framework:.0} msg/s, the median of its rounds"
    ));
    let mut steps = Vec::with_capacity(kinds.len());
    for ((kind, mut rates), used) in kinds.into_iter().zip(rates).zip(cpu_seconds) {
        let step = CeilingStep {
            statements: kind.id(),
            rounds_msgs_per_s: rates.clone(),
            msgs_per_s: saga_lab::bench::percentile(&mut rates, 0.5),
            cpu: cpu::CpuUse::sum(&used),
        };
        progress.note(&format!(
            "consumer ({label}): {kind} {:.0} msg/s (rounds {}){}",
            step.msgs_per_s,
            step.rounds_msgs_per_s
                .iter()
                .map(|r| format!("{r:.0}"))
                .collect::<Vec<_>>()
                .join(", "),
            step.cpu.map(|u| format!(", {u}")).unwrap_or_default()
        ));
        steps.push(step);
    }
    let consume_only = consumer::consume_only(kafka, &topic, cli.messages, progress).await?;
    let consumed = last_sample
        .zip(cpu::CpuSample::now())
        .map(|(from, to)| from.until(&to, cli.messages));
    progress.note(&format!(
        "consumer ({label}): Kafka consumption alone {consume_only:.0} msg/s{}",
        consumed.map(|u| format!(", {u}")).unwrap_or_default()
    ));
    let (ceiling, guarded) = (&steps[0], &steps[steps.len() - 1]);
    let cpu = match (
        cpu::CpuUse::sum(&framework_cpu),
        ceiling.cpu,
        guarded.cpu,
        consumed,
    ) {
        (Some(framework), Some(ceiling), Some(guarded), Some(consumed)) => {
            // The consumption phase is short and mostly the group join, so on the mock cluster the
            // machine's figure is mostly other processes' idle work: count this process's CPU (client and
            // mock cluster). A broker of its own is part of consumption's cost: count the machine's.
            let consuming = if label == "mock" {
                consumed.bench_process_us_per_msg
            } else {
                consumed.machine_us_per_msg
            };
            let bound = ceiling.machine_us_per_msg / (guarded.machine_us_per_msg + consuming);
            progress.note(&format!(
                "consumer ({label}): consumer / SQL ceiling cannot exceed {bound:.2} on these cores \
                 with the guarantees kept (their statements' CPU and consumption's, nothing else)"
            ));
            serde_json::json!({
                "framework": framework,
                "sql_ceiling": ceiling,
                "sql_with_guarantees": guarded,
                "kafka_consume_only": consumed,
                "consumer_vs_sql_ceiling_cpu_bound": bound,
            })
        }
        _ => serde_json::Value::Null,
    };
    Ok(ConsumerFigures {
        framework,
        vs_ceiling,
        vs_guarded,
        baseline,
        ceiling: ceiling.msgs_per_s,
        guarded: guarded.msgs_per_s,
        consume_only,
        run,
        cpu,
        ceiling_steps: steps,
    })
}

/// One of the SQL ceilings, from the plain rows to every statement the guarantees need.
#[derive(Debug, serde::Serialize)]
struct CeilingStep {
    /// The statements beside the plain inserts (`plain+crash_loop_record+...`).
    statements: String,
    /// Messages/s, the median of its rounds.
    msgs_per_s: f64,
    /// Messages/s of each round.
    rounds_msgs_per_s: Vec<f64>,
    /// CPU per message (`None` without Linux's `/proc`).
    cpu: Option<cpu::CpuUse>,
}

/// The consumer's figures on one broker, messages/s.
struct ConsumerFigures {
    /// The framework's consumer (the median of its rounds).
    framework: f64,
    /// Framework / plain SQL ceiling: the median of the rounds' ratios.
    vs_ceiling: f64,
    /// Framework / SQL with the guarantees: the median of the rounds' ratios.
    vs_guarded: f64,
    /// The at-least-once baseline.
    baseline: f64,
    /// The SQL the framework must do, without Kafka.
    ceiling: f64,
    /// The statements the framework's guarantees need, without Kafka or the runtime.
    guarded: f64,
    /// Kafka consumption alone.
    consume_only: f64,
    /// The framework's run in detail.
    run: consumer::FrameworkRun,
    /// CPU per message of the framework's run, the two ceilings and consumption alone, and the bound they
    /// set on consumer / SQL ceiling (`null` without Linux's `/proc`).
    cpu: serde_json::Value,
    /// The ceilings from the plain rows to every statement the guarantees need.
    ceiling_steps: Vec<CeilingStep>,
}
