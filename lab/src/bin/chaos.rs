//! The saga under faults: see `chaos --help`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use saga_lab::harness::broker::Broker;
use saga_lab::harness::run::{Run, RunOptions, plan, submit_orders};
use saga_lab::harness::summary::Summary;
use saga_lab::harness::{ChildCommand, RunFlags, ledger, run_name};
use saga_test_support::PrivateBroker;
use tokio_util::sync::CancellationToken;

/// mimalloc, not the system's allocator: with glibc's malloc, allocation was about a quarter of the
/// consumer's own CPU (docs/guide/deployment.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Runs the example saga with thousands of orders while every event is delivered twice, service
/// (consumer) and relay processes are killed with SIGKILL at random moments, services also crash right
/// after database commits (before committing offsets), and the broker is restarted once. Then checks the
/// ledgers: every order completed or compensated, exactly one charge per paid order, a refund only for a
/// failed shipment and at most one per charge, exactly one shipment per completed order, no order lost.
/// Exits non-zero on any violation. Needs the `nisshi` broker binary (installed by scripts/dev-services).
#[derive(Debug, clap::Parser)]
#[command(name = "chaos", version)]
struct Cli {
    #[command(subcommand)]
    child: Option<ChildCommand>,
    /// Orders to submit.
    #[arg(long, default_value_t = 3_000)]
    orders: usize,
    /// Concurrent clients.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Mean time between two SIGKILLs, in milliseconds.
    #[arg(long, default_value_t = 4_000)]
    kill_every_ms: u64,
    /// Probability that a service crashes right after a database commit.
    #[arg(long, default_value_t = 0.002)]
    crash_rate: f64,
    /// Do not restart the broker.
    #[arg(long)]
    no_broker_restart: bool,
    #[command(flatten)]
    flags: RunFlags,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 1_200)]
    timeout_secs: u64,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli: Cli = saga_runtime::cli::parse();
    saga_runtime::cli::exit_code(Box::pin(run(cli)).await)
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    if let Some(child) = cli.child {
        return Box::pin(child.run()).await;
    }
    // Before the broker starts: the database must answer and the broker binary be there.
    saga_runtime::config::connect_postgres("DATABASE_URL", &cli.flags.database_url, None, 1)
        .await?
        .close()
        .await;
    if PrivateBroker::binary().is_none() {
        return Err(saga_runtime::config::ConfigProblem::new(
            "NISSHI_BIN",
            "the chaos program restarts a broker of its own and needs the `nisshi` binary, which is not installed",
            "run `scripts/dev-services` once (it installs Nisshi 0.8.1) or set NISSHI_BIN",
        )
        .into());
    }
    let name = run_name("chaos");
    let mut broker = PrivateBroker::launch(&name).await;
    let external = Broker::External(broker.brokers.clone());
    println!(
        "chaos {name}: {} orders on a private Nisshi broker at {}",
        cli.orders, broker.brokers
    );
    let options = RunOptions {
        database_url: cli.flags.database_url.clone(),
        crash_rate: cli.crash_rate,
        gateway_latency_ms: 1,
        partitions: 4,
        name: name.clone(),
        separate_relays: true,
        orchestrated: cli.flags.orchestrated,
        outbox_mode: cli.flags.outbox,
    };
    let run = Run::start(&options, external).await?;
    let args = run.args.clone();
    println!(
        "services and relays ready (logs in {})",
        run.supervisor.log_dir().display()
    );

    let stop = CancellationToken::new();
    let copies = run.duplicate_events(stop.clone())?;

    // SIGKILLs at random moments.
    let kills: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
    let killer = {
        let (supervisor, kills, stop, mean) = (
            run.supervisor.clone(),
            kills.clone(),
            stop.clone(),
            cli.kill_every_ms.max(2),
        );
        tokio::spawn(async move {
            loop {
                let wait = rand::random_range(mean / 2..=mean * 3 / 2);
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_millis(wait)) => {}
                }
                let names = supervisor.names();
                let victim = names[rand::random_range(0..names.len())].clone();
                supervisor.kill(&victim);
                *kills.lock().expect("kills").entry(victim).or_default() += 1;
            }
        })
    };

    // One broker restart, once a quarter of the sagas finished: half the orders go in first, and the other
    // half only once the broker is back, so that the restart always happens, with sagas in flight. The
    // task hands the broker back.
    let restarter = {
        let (stop, pool, args) = (stop.clone(), run.pool.clone(), args.clone());
        let (orders, enabled) = (cli.orders, !cli.no_broker_restart);
        tokio::spawn(async move {
            let threshold = i64::try_from(orders / 4).unwrap_or(1).max(1);
            if !enabled {
                return (broker, 0);
            }
            loop {
                tokio::select! {
                    () = stop.cancelled() => return (broker, 0),
                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
                if ledger::finished_orders(&pool, &args).await.unwrap_or(0) >= threshold {
                    println!("  restarting the broker");
                    broker.stop().await;
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    broker.start().await;
                    println!("  broker back");
                    return (broker, 1);
                }
            }
        })
    };

    let mut orders = plan(&name, cli.orders);
    let second_half = orders.split_off(cli.orders / 2);
    let mut stats = submit_orders(args.http_addr, orders, cli.concurrency).await;
    let restarted = tokio::select! {
        restarted = restarter => restarted?,
        () = tokio::time::sleep(Duration::from_secs(cli.timeout_secs)) => {
            anyhow::bail!("a quarter of the sagas did not finish in {} s", cli.timeout_secs)
        }
    };
    stats.add(submit_orders(args.http_addr, second_half, cli.concurrency).await);
    println!(
        "{} orders accepted ({} HTTP requests, {} replayed, {} unanswered); waiting for the sagas to finish",
        stats.accepted, stats.requests, stats.replays, stats.unanswered
    );
    let waited = wait_finished(
        &run.pool,
        &args,
        stats.accepted,
        Duration::from_secs(cli.timeout_secs),
    )
    .await;
    stop.cancel();
    let _ = killer.await;
    let (broker, restarts) = restarted;
    // Let the last duplicates be absorbed.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ledger = run.ledger(&stats.expected).await?;
    let dead_letters = run.dead_letters().await?;
    let duplicates_absorbed = run.duplicates_absorbed();
    // Which outbox carried the events: rows of saga_outbox, or (none of them) the write-ahead log.
    let mut outbox_rows = 0_i64;
    for service in saga_examples::service::Service::ALL {
        outbox_rows += sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {}.saga_outbox",
            saga_examples::service::quote_ident(&args.schema(service))
        )))
        .fetch_one(&run.pool)
        .await?;
    }
    let deaths = run
        .supervisor
        .deaths
        .load(std::sync::atomic::Ordering::Relaxed);
    run.finish(cli.flags.keep).await?;
    drop(broker);

    let kills = kills.lock().expect("kills").clone();
    let mut extra: Vec<(String, String)> = kills
        .iter()
        .map(|(name, n)| (format!("SIGKILLs of {name}"), n.to_string()))
        .collect();
    extra.push(("broker restarts".into(), restarts.to_string()));
    extra.push(("outbox rows written".into(), outbox_rows.to_string()));
    let summary = Summary {
        title: format!(
            "chaos {name}: every event delivered twice, {} SIGKILLs, crash after {:.1}% of database commits",
            kills.values().sum::<u32>(),
            cli.crash_rate * 100.0
        ),
        ledger: &ledger,
        client: &stats,
        duplicates_absorbed,
        duplicates_injected: copies.copies(),
        deaths,
        dead_letters,
        extra,
    };
    summary.print();
    waited?;
    anyhow::ensure!(summary.ok(), "invariants violated");
    Ok(())
}

async fn wait_finished(
    pool: &sqlx::PgPool,
    args: &saga_examples::service::ServiceArgs,
    expected: usize,
    timeout: Duration,
) -> anyhow::Result<()> {
    let started = tokio::time::Instant::now();
    let mut last = -1;
    loop {
        let finished = ledger::finished_orders(pool, args).await?;
        if finished != last {
            println!("  {finished}/{expected} sagas finished");
            last = finished;
        }
        if finished >= i64::try_from(expected).unwrap_or(i64::MAX) {
            return Ok(());
        }
        anyhow::ensure!(
            started.elapsed() < timeout,
            "only {finished} of {expected} sagas finished within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}
