//! End-to-end saga latency: from the order's acceptance (`POST /orders`) to its completion (the order
//! service's `complete-order` step), with the three services running on the real broker.

use std::time::Duration;

use sqlx::{PgPool, Row};
use tokio_util::sync::CancellationToken;

use crate::bench::Progress;
use crate::harness::client;
use crate::harness::ledger;
use crate::harness::run::plan;
use crate::service::{Service, ServiceArgs, quote_ident};

/// Submits `orders` happy-path orders at `per_second` and returns the p50 and p99 latency in milliseconds.
pub async fn latency(
    args: &ServiceArgs,
    pool: &PgPool,
    orders: usize,
    per_second: u32,
    progress: &Progress,
) -> anyhow::Result<(f64, f64)> {
    let stop = CancellationToken::new();
    let services: Vec<_> = Service::ALL
        .iter()
        .map(|s| {
            tokio::spawn(crate::service::run(
                *s,
                args.clone(),
                stop.clone().cancelled_owned(),
            ))
        })
        .collect();
    // Wait for the API and for the consumers to have joined their groups.
    loop {
        if client::send(
            args.http_addr,
            "GET",
            "/orders/00000000-0000-0000-0000-000000000000",
            &[],
            None,
        )
        .await
        .is_ok_and(|a| a.status == 404)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;

    let happy: Vec<_> = plan("bench", orders * 2)
        .into_iter()
        .filter(|o| o.path == crate::harness::ledger::Path::Happy)
        .take(orders)
        .collect();
    let mut tick =
        tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(per_second.max(1))));
    let mut submissions = Vec::new();
    for order in happy {
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
    loop {
        let finished = ledger::finished_orders(pool, args).await?;
        progress.note(&format!("{finished}/{orders} sagas finished"));
        if finished >= i64::try_from(orders)? {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    stop.cancel();
    for s in services {
        s.await??;
    }
    let order = quote_ident(&args.schema(Service::Order));
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), percentile_cont(0.99) WITHIN GROUP (ORDER BY ms) \
         FROM (SELECT extract(epoch FROM h.at - o.created_at) * 1000 AS ms \
               FROM {order}.orders o JOIN {order}.order_history h ON h.order_id = o.order_id AND h.status = 'COMPLETED') AS l"
    )))
    .fetch_one(pool)
    .await?;
    Ok((row.try_get(0)?, row.try_get(1)?))
}
