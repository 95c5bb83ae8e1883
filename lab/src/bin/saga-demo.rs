//! Runs the whole saga locally and shows it working: see `saga-demo --help`.

use std::time::Duration;

use saga_lab::harness::broker::Broker;
use saga_lab::harness::run::{Run, RunOptions, plan};
use saga_lab::harness::summary::Summary;
use saga_lab::harness::{ChildCommand, RunFlags, run_name};
use tokio_util::sync::CancellationToken;

/// mimalloc, not the system's allocator: with glibc's malloc, allocation was about a quarter of the
/// consumer's own CPU (docs/guide/deployment.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Runs the order → payment → shipping saga: starts the three services, submits orders (some retried with
/// the same key, some with declined cards, some whose shipment fails), waits for every saga to finish, and
/// prints what happened. With KAFKA_BROKERS unset it runs on librdkafka's built-in mock cluster.
#[derive(Debug, clap::Parser)]
#[command(name = "saga-demo", version)]
struct Cli {
    #[command(subcommand)]
    child: Option<ChildCommand>,
    /// Orders to submit.
    #[arg(long, default_value_t = 24)]
    orders: usize,
    /// Fault mode: deliver every event twice.
    #[arg(long)]
    duplicates: bool,
    /// Fault mode: probability that a service crashes right after a database commit, before committing
    /// its offsets (it is restarted).
    #[arg(long, default_value_t = 0.0)]
    crash_rate: f64,
    #[command(flatten)]
    flags: RunFlags,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 180)]
    timeout_secs: u64,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli: Cli = saga_runtime::cli::parse();
    saga_runtime::cli::exit_code(run(cli).await)
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    if let Some(child) = cli.child {
        return Box::pin(child.run()).await;
    }
    let name = run_name("demo");
    let broker = match std::env::var("KAFKA_BROKERS") {
        Ok(brokers) if !brokers.is_empty() => Broker::External(brokers),
        _ => Broker::mock()?,
    };
    let style = if cli.flags.orchestrated {
        "orchestrated"
    } else {
        "choreographed"
    };
    println!(
        "saga demo {name}: {} orders, {style} saga, on the {}",
        cli.orders,
        broker.describe()
    );
    let broker_label = broker.describe();
    let options = RunOptions {
        database_url: cli.flags.database_url.clone(),
        crash_rate: cli.crash_rate,
        gateway_latency_ms: 2,
        partitions: 3,
        name: name.clone(),
        separate_relays: false,
        orchestrated: cli.flags.orchestrated,
        outbox_mode: cli.flags.outbox,
    };
    let run = Run::start(&options, broker).await?;
    println!(
        "services ready (logs in {})",
        run.supervisor.log_dir().display()
    );
    let stop = CancellationToken::new();
    let copies = if cli.duplicates {
        Some(run.duplicate_events(stop.clone())?)
    } else {
        None
    };
    let stats = run.submit(plan(&name, cli.orders), 8).await;
    println!(
        "{} orders accepted ({} HTTP requests, {} replayed); waiting for the sagas to finish",
        stats.accepted, stats.requests, stats.replays
    );
    let waited = run
        .wait_finished(stats.accepted, Duration::from_secs(cli.timeout_secs), |n| {
            println!("  {n}/{} sagas finished", stats.accepted);
        })
        .await;
    // Let late duplicates arrive and be absorbed before counting.
    if cli.duplicates {
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let ledger = run.ledger(&stats.expected).await?;
    let dead_letters = run.dead_letters().await?;
    // Ordering through failures, on the same broker and database: a key held behind its dead letter and
    // released, in order, by a replay.
    let held_key = saga_lab::harness::held::order_7(
        &run.broker,
        &cli.flags.database_url,
        &name,
        cli.flags.keep,
    )
    .await;
    let duplicates_absorbed = run.duplicates_absorbed();
    let deaths = run
        .supervisor
        .deaths
        .load(std::sync::atomic::Ordering::Relaxed);
    stop.cancel();
    run.finish(cli.flags.keep).await?;
    let mut faults = Vec::new();
    if cli.duplicates {
        faults.push("every event delivered twice".to_owned());
    }
    if cli.crash_rate > 0.0 {
        faults.push(format!(
            "crash after {:.0}% of database commits",
            cli.crash_rate * 100.0
        ));
    }
    let summary = Summary {
        title: format!(
            "saga demo {name}, {style} saga, on the {broker_label}{}",
            if faults.is_empty() {
                String::new()
            } else {
                format!("; faults: {}", faults.join(", "))
            }
        ),
        ledger: &ledger,
        client: &stats,
        duplicates_absorbed,
        duplicates_injected: copies.map_or(0, |c| c.copies()),
        deaths,
        dead_letters,
        extra: Vec::new(),
    };
    summary.print();
    match &held_key {
        Ok(lines) => {
            println!(
                "\nordering through failures (OrderPolicy::HoldKey, a small order service of its own):"
            );
            for line in lines {
                println!("  {line}");
            }
        }
        Err(e) => println!("\nordering through failures: FAILED: {e:#}"),
    }
    waited?;
    held_key?;
    anyhow::ensure!(summary.ok(), "invariants violated");
    Ok(())
}
