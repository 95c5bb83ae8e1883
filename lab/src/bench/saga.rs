//! End-to-end saga latency: from the order's acceptance (`POST /orders`) to its completion (the order
//! service's `complete-order` step), with the three services running in this process on a broker (the
//! local one, or librdkafka's mock cluster).

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgPool, Row};
use tokio_util::sync::CancellationToken;

use crate::bench::Progress;
use crate::harness::client;
use crate::harness::ledger;
use crate::harness::run::{PlannedOrder, plan};
use saga_examples::service::{Service, ServiceArgs, quote_ident};

/// What the sagas measured: end-to-end p50 and p99 in milliseconds, and each hop.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SagaLatency {
    /// End to end, p50 and p99, ms.
    pub e2e_ms: (f64, f64),
    /// The framework's part: each saga's end to end less its payment step's outside call (the simulated
    /// gateway's own time, `gateway_charges.call_ms`), p50 and p99, ms.
    pub framework_ms: (f64, f64),
    /// The outside call alone, p50 and p99, ms.
    pub call_ms: (f64, f64),
    /// Each hop.
    pub hops: Vec<Hop>,
}

/// One hop of the saga, p50 and p99 in milliseconds of each part, from the rows' own timestamps.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Hop {
    /// `service event → service step`.
    pub hop: String,
    /// The outbox row's insert to the broker's acknowledgement (`published_at - created_at`): the commit,
    /// the relay's wake-up, its read and the produce.
    pub relay_ms: (f64, f64),
    /// The acknowledgement to the start of the consuming step's transaction: the consumer's fetch and
    /// hand-off to its worker.
    pub delivery_ms: (f64, f64),
    /// The step's transaction start to its own outbox row (the next hop's start), or to the order's
    /// completion for the last hop.
    pub step_ms: (f64, f64),
}

/// Where a hop's step ends: at the first outbox row of that event type it wrote, or when the order reached
/// that status in its history.
#[derive(Clone, Copy)]
enum StepEnd {
    Emits(&'static str),
    Status(&'static str),
}

/// The saga's hops: (upstream service, event type, downstream service, step, where the step ends). The
/// last is a side branch: the order service's consumer of the event shipping also consumes, so that the
/// same message's delivery to two services compares.
const HOPS: [(Service, &str, Service, &str, StepEnd); 4] = [
    (
        Service::Order,
        "OrderCreated",
        Service::Payment,
        "process-payment",
        StepEnd::Emits("PaymentProcessed"),
    ),
    (
        Service::Payment,
        "PaymentProcessed",
        Service::Shipping,
        "arrange-shipment",
        StepEnd::Emits("ShipmentArranged"),
    ),
    (
        Service::Shipping,
        "ShipmentArranged",
        Service::Order,
        "complete-order",
        StepEnd::Status("COMPLETED"),
    ),
    (
        Service::Payment,
        "PaymentProcessed",
        Service::Order,
        "mark-order-paid",
        StepEnd::Status("PAID"),
    ),
];

/// Each hop's parts, joined on the idempotency key the saga's events carry.
async fn hops(pool: &PgPool, args: &ServiceArgs, from: DateTime<Utc>) -> anyhow::Result<Vec<Hop>> {
    let header = |h: &str| format!("o.headers[array_position(o.headers, '{h}') + 1]");
    let mut hops = Vec::new();
    for (up, event, down, step, next) in HOPS {
        let (up_schema, down_schema) = (
            quote_ident(&args.schema(up)),
            quote_ident(&args.schema(down)),
        );
        let step_end = match next {
            StepEnd::Emits(next) => format!(
                "(SELECT min(n.created_at) FROM {down_schema}.saga_outbox n \
                  WHERE n.headers[array_position(n.headers, 'idempotency-key') + 1] = {key} \
                    AND n.headers[array_position(n.headers, 'ce_type') + 1] = '{next}')",
                key = header("idempotency-key")
            ),
            StepEnd::Status(status) => format!(
                "(SELECT h.at FROM {down_schema}.order_history h JOIN {down_schema}.orders r ON r.order_id = h.order_id \
                  WHERE h.status = '{status}' AND r.idempotency_key = {key} LIMIT 1)",
                key = header("idempotency-key")
            ),
        };
        let sql = format!(
            "WITH parts AS ( \
               SELECT extract(epoch FROM o.published_at - o.created_at) * 1000 AS relay, \
                      extract(epoch FROM k.created_at - o.published_at) * 1000 AS delivery, \
                      extract(epoch FROM {step_end} - k.created_at) * 1000 AS step \
               FROM {up_schema}.saga_outbox o \
               JOIN {down_schema}.saga_idempotency_keys k ON k.step_key = {key} || ':{step}' \
               WHERE {ce} = '{event}' AND o.published_at IS NOT NULL AND o.created_at >= $1) \
             SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY relay), percentile_cont(0.99) WITHIN GROUP (ORDER BY relay), \
                    percentile_cont(0.5) WITHIN GROUP (ORDER BY delivery), percentile_cont(0.99) WITHIN GROUP (ORDER BY delivery), \
                    percentile_cont(0.5) WITHIN GROUP (ORDER BY step), percentile_cont(0.99) WITHIN GROUP (ORDER BY step) \
             FROM parts",
            key = header("idempotency-key"),
            ce = header("ce_type"),
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(from)
            .fetch_one(pool)
            .await?;
        let get = |i: usize| {
            row.try_get::<Option<f64>, _>(i)
                .map(|v| v.unwrap_or(f64::NAN))
        };
        hops.push(Hop {
            hop: format!("{} {event} → {} {step}", up.as_str(), down.as_str()),
            relay_ms: (get(0)?, get(1)?),
            delivery_ms: (get(2)?, get(3)?),
            step_ms: (get(4)?, get(5)?),
        });
    }
    Ok(hops)
}

/// How long the services may take to answer on the order API.
const START_LIMIT: Duration = Duration::from_secs(60);

/// Returns once the order API at `addr` answers (a 404 for an order that does not exist), each try bounded.
async fn api_answers(addr: std::net::SocketAddr) {
    loop {
        let tried = tokio::time::timeout(
            Duration::from_secs(2),
            client::send(
                addr,
                "GET",
                "/orders/00000000-0000-0000-0000-000000000000",
                &[],
                None,
            ),
        )
        .await;
        if matches!(tried, Ok(Ok(a)) if a.status == 404) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Submits `warmup` happy-path orders, then `orders` more, at `per_second`; returns the end-to-end latency
/// and its hops of the `orders` (the first sagas also pay for connections, plans and producers' metadata,
/// once per process).
pub async fn latency(
    args: &ServiceArgs,
    pool: &PgPool,
    warmup: usize,
    orders: usize,
    per_second: u32,
    progress: &Progress,
) -> anyhow::Result<SagaLatency> {
    let stop = CancellationToken::new();
    let mut services = tokio::task::JoinSet::new();
    for s in Service::ALL {
        let run = saga_examples::service::run(s, args.clone(), stop.clone().cancelled_owned());
        services.spawn(async move { (s, run.await) });
    }
    // Wait for the API and for the consumers to have joined their groups; a service that stops first, or
    // an API that does not answer in time, ends the section with the reason.
    progress.doing(&format!(
        "waiting for the order API at {} (the services starting)",
        args.http_addr
    ));
    tokio::select! {
        () = api_answers(args.http_addr) => {}
        Some(stopped) = services.join_next() => {
            let (service, result) = stopped?;
            anyhow::bail!(
                "the {} service stopped before the order API answered: {}",
                service.as_str(),
                result.err().map_or_else(|| "it returned".to_owned(), |e| format!("{e:#}"))
            );
        }
        () = tokio::time::sleep(START_LIMIT) => anyhow::bail!(
            "the order API at {} did not answer within {} s",
            args.http_addr,
            START_LIMIT.as_secs()
        ),
    }
    tokio::time::sleep(Duration::from_secs(3)).await;

    let mut happy = plan("bench", (warmup + orders) * 2)
        .into_iter()
        .filter(|o| o.path == crate::harness::ledger::Path::Happy);
    submit(
        args,
        pool,
        happy.by_ref().take(warmup),
        per_second,
        progress,
    )
    .await?;
    let from: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await?;
    submit(args, pool, happy.take(orders), per_second, progress).await?;
    stop.cancel();
    while let Some(stopped) = services.join_next().await {
        let (service, result) = stopped?;
        result.map_err(|e| anyhow::anyhow!("the {} service: {e:#}", service.as_str()))?;
    }
    let order = quote_ident(&args.schema(Service::Order));
    // The hops are read from the outbox's rows: the write-ahead log keeps none.
    let hops = if args.outbox_mode() == saga_consumer::OutboxMode::Table {
        hops(pool, args, from).await?
    } else {
        Vec::new()
    };
    for hop in &hops {
        progress.note(&format!(
            "hop {}: relay commit→ack p50/p99 {:.1}/{:.1} ms, ack→step's transaction p50/p99 {:.1}/{:.1} ms, step p50/p99 {:.1}/{:.1} ms",
            hop.hop, hop.relay_ms.0, hop.relay_ms.1, hop.delivery_ms.0, hop.delivery_ms.1, hop.step_ms.0, hop.step_ms.1
        ));
    }
    let gateway = quote_ident(&args.gateway_schema());
    // Each saga's end to end, and its payment step's outside calls (the gateway's own time), by order: the
    // sagas whose every charge was timed.
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "WITH l AS ( \
           SELECT extract(epoch FROM h.at - o.created_at) * 1000 AS ms, c.call_ms \
           FROM {order}.orders o \
           JOIN {order}.order_history h ON h.order_id = o.order_id AND h.status = 'COMPLETED' \
           CROSS JOIN LATERAL (SELECT sum(call_ms) AS call_ms, count(*) - count(call_ms) AS untimed \
                               FROM {gateway}.gateway_charges WHERE order_id = o.order_id) c \
           WHERE o.created_at >= $1 AND c.untimed = 0 AND c.call_ms IS NOT NULL) \
         SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), \
                percentile_cont(0.5) WITHIN GROUP (ORDER BY ms - call_ms), \
                percentile_cont(0.99) WITHIN GROUP (ORDER BY ms - call_ms), \
                percentile_cont(0.5) WITHIN GROUP (ORDER BY call_ms), percentile_cont(0.99) WITHIN GROUP (ORDER BY call_ms) \
         FROM l"
    )))
    .bind(from)
    .fetch_one(pool)
    .await?;
    let pair = |i: usize| -> Result<(f64, f64), sqlx::Error> {
        Ok((
            row.try_get::<Option<f64>, _>(i)?.unwrap_or(f64::NAN),
            row.try_get::<Option<f64>, _>(i + 1)?.unwrap_or(f64::NAN),
        ))
    };
    Ok(SagaLatency {
        e2e_ms: pair(0)?,
        framework_ms: pair(2)?,
        call_ms: pair(4)?,
        hops,
    })
}

/// Submits `orders` at `per_second` and waits until every saga of the schema finished.
async fn submit(
    args: &ServiceArgs,
    pool: &PgPool,
    orders: impl Iterator<Item = PlannedOrder>,
    per_second: u32,
    progress: &Progress,
) -> anyhow::Result<()> {
    let mut tick =
        tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(per_second.max(1))));
    let mut submissions = Vec::new();
    for order in orders {
        tick.tick().await;
        let addr = args.http_addr;
        submissions.push(tokio::spawn(async move {
            client::submit_order(
                addr,
                &order.key,
                &order.request,
                false,
                Duration::from_secs(60),
            )
            .await
        }));
    }
    for s in submissions {
        s.await??;
    }
    let submitted = ledger::submitted_orders(pool, args).await?;
    super::wait_until_done(
        "the sagas",
        Duration::from_millis(500),
        super::STALL_LIMIT,
        || async {
            let finished = ledger::finished_orders(pool, args).await?;
            progress.note(&format!("{finished}/{submitted} sagas finished"));
            Ok(submitted - finished)
        },
    )
    .await?;
    Ok(())
}
