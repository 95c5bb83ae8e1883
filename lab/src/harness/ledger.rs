//! Reading every service's tables and the gateway's ledger after a run, and checking the saga's
//! invariants: every order finished, one charge per paid order, a refund only for a failed shipment and at
//! most one per charge, one shipment per completed order, no order lost.

use std::collections::HashMap;

use sqlx::{PgPool, Row};
use uuid::Uuid;

use saga_examples::service::{Service, ServiceArgs, quote_ident};

/// What an order was meant to go through, as the client chose it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// Paid and shipped: COMPLETED.
    Happy,
    /// The card is declined: CANCELLED, never charged.
    Declined,
    /// The shipment fails: charged, refunded, CANCELLED.
    ShipmentFails,
}

/// The facts of one order, across the services.
#[derive(Debug, Clone)]
pub struct OrderFacts {
    /// The client's key.
    pub key: String,
    /// The order's status.
    pub status: String,
    /// Successful charges at the gateway.
    pub charges: i64,
    /// Declined charge attempts at the gateway.
    pub declines: i64,
    /// Refunds at the gateway.
    pub refunds: i64,
    /// Most refunds of one charge.
    pub refunds_per_charge: i64,
    /// Arranged shipments.
    pub shipments: i64,
    /// Failed shipments.
    pub failed_shipments: i64,
}

/// The counts of a run, and what went wrong.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    /// Orders in the order service.
    pub orders: usize,
    /// Completed orders.
    pub completed: usize,
    /// Cancelled because the card was declined.
    pub declined: usize,
    /// Cancelled after a refund.
    pub refunded: usize,
    /// Orders not finished yet.
    pub unfinished: usize,
    /// Successful charges.
    pub charges: i64,
    /// Refunds.
    pub refunds: i64,
    /// Arranged shipments.
    pub shipments: i64,
    /// Steps that ran more than once for one order (distinct events of one type from one step).
    pub steps_run_twice: usize,
    /// Violated invariants, for people.
    pub violations: Vec<String>,
}

/// Reads the facts of every order.
pub async fn read_facts(
    pool: &PgPool,
    args: &ServiceArgs,
) -> Result<HashMap<Uuid, OrderFacts>, sqlx::Error> {
    let order = quote_ident(&args.schema(Service::Order));
    let shipping = quote_ident(&args.schema(Service::Shipping));
    let gateway = quote_ident(&args.gateway_schema());
    let query = format!(
        "SELECT o.order_id, o.idempotency_key, o.status, \
           (SELECT count(*) FROM {gateway}.gateway_charges c WHERE c.order_id = o.order_id AND NOT c.declined), \
           (SELECT count(*) FROM {gateway}.gateway_charges c WHERE c.order_id = o.order_id AND c.declined), \
           (SELECT count(*) FROM {gateway}.gateway_refunds r JOIN {gateway}.gateway_charges c USING (charge_id) \
             WHERE c.order_id = o.order_id), \
           (SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM {gateway}.gateway_refunds r \
             JOIN {gateway}.gateway_charges c USING (charge_id) WHERE c.order_id = o.order_id GROUP BY r.charge_id) x), \
           (SELECT count(*) FROM {shipping}.shipments s WHERE s.order_id = o.order_id AND s.status = 'ARRANGED'), \
           (SELECT count(*) FROM {shipping}.shipments s WHERE s.order_id = o.order_id AND s.status = 'FAILED') \
         FROM {order}.orders o"
    );
    let rows = sqlx::query(sqlx::AssertSqlSafe(query))
        .fetch_all(pool)
        .await?;
    rows.into_iter()
        .map(|r| {
            Ok((
                r.try_get(0)?,
                OrderFacts {
                    key: r.try_get(1)?,
                    status: r.try_get(2)?,
                    charges: r.try_get(3)?,
                    declines: r.try_get(4)?,
                    refunds: r.try_get(5)?,
                    refunds_per_charge: r.try_get(6)?,
                    shipments: r.try_get(7)?,
                    failed_shipments: r.try_get(8)?,
                },
            ))
        })
        .collect()
}

/// Finds steps that took effect more than once: in every service's outbox, the events of one order
/// (partition key), type and emitting step with more than one message id. A step that ran twice emits its
/// event twice, with two ids; a redelivery absorbed by the step key emits nothing. The orchestrator's
/// commands are left out: it re-sends a compensation, with the same key, until it is confirmed.
pub async fn steps_run_twice(
    pool: &PgPool,
    args: &ServiceArgs,
) -> Result<Vec<String>, sqlx::Error> {
    let mut found = Vec::new();
    for service in Service::ALL {
        let schema = quote_ident(&args.schema(service));
        let rows: Vec<(Option<String>, String, String, i64)> =
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT partition_key, headers[array_position(headers, 'ce_type') + 1], \
                        headers[array_position(headers, 'ce_source') + 1], \
                        count(DISTINCT headers[array_position(headers, 'ce_id') + 1]) \
                 FROM {schema}.saga_outbox \
                 WHERE headers[array_position(headers, 'ce_source') + 1] NOT LIKE 'orchestrator/%' \
                 GROUP BY 1, 2, 3 HAVING count(DISTINCT headers[array_position(headers, 'ce_id') + 1]) > 1"
            )))
            .fetch_all(pool)
            .await?;
        for (key, event_type, source, ids) in rows {
            found.push(format!(
                "{} step {source} emitted {event_type} {ids} times for {}: it ran more than once",
                service.as_str(),
                key.unwrap_or_default()
            ));
        }
    }
    Ok(found)
}

/// Counts finished orders (COMPLETED or CANCELLED).
pub async fn finished_orders(pool: &PgPool, args: &ServiceArgs) -> Result<i64, sqlx::Error> {
    count_orders(pool, args, "WHERE status IN ('COMPLETED', 'CANCELLED')").await
}

/// Counts the orders the order service accepted.
pub async fn submitted_orders(pool: &PgPool, args: &ServiceArgs) -> Result<i64, sqlx::Error> {
    count_orders(pool, args, "").await
}

async fn count_orders(
    pool: &PgPool,
    args: &ServiceArgs,
    filter: &'static str,
) -> Result<i64, sqlx::Error> {
    let order = quote_ident(&args.schema(Service::Order));
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {order}.orders {filter}"
    )))
    .fetch_one(pool)
    .await
}

/// Checks the invariants, given the path the client chose for each key it got an order for.
pub fn check(facts: &HashMap<Uuid, OrderFacts>, expected: &HashMap<String, Path>) -> Ledger {
    let mut ledger = Ledger {
        orders: facts.len(),
        ..Ledger::default()
    };
    let mut by_key: HashMap<&str, usize> = HashMap::new();
    for (id, f) in facts {
        *by_key.entry(f.key.as_str()).or_default() += 1;
        ledger.charges += f.charges;
        ledger.refunds += f.refunds;
        ledger.shipments += f.shipments;
        let mut violation = |what: String| {
            ledger
                .violations
                .push(format!("order {id} ({}): {what}", f.key))
        };
        if f.refunds_per_charge > 1 {
            violation(format!("a charge refunded {} times", f.refunds_per_charge));
        }
        match f.status.as_str() {
            "COMPLETED" => {
                ledger.completed += 1;
                if f.charges != 1 {
                    violation(format!("completed with {} charges", f.charges));
                }
                if f.shipments != 1 {
                    violation(format!("completed with {} shipments", f.shipments));
                }
                if f.refunds != 0 {
                    violation("completed but refunded".into());
                }
            }
            "CANCELLED" if f.declines > 0 => {
                ledger.declined += 1;
                if f.charges != 0 || f.shipments != 0 || f.refunds != 0 {
                    violation(format!(
                        "declined, yet {} charges, {} shipments, {} refunds",
                        f.charges, f.shipments, f.refunds
                    ));
                }
            }
            "CANCELLED" => {
                ledger.refunded += 1;
                if f.charges != 1 || f.refunds != 1 || f.failed_shipments != 1 || f.shipments != 0 {
                    violation(format!(
                        "compensated with {} charges, {} refunds, {} failed and {} arranged shipments",
                        f.charges, f.refunds, f.failed_shipments, f.shipments
                    ));
                }
            }
            other => {
                ledger.unfinished += 1;
                violation(format!("not finished: {other}"));
            }
        }
        if f.refunds > 0 && f.failed_shipments == 0 {
            violation("refunded without a failed shipment".into());
        }
        if let Some(path) = expected.get(f.key.as_str()) {
            let ok = matches!(
                (path, f.status.as_str(), f.declines > 0),
                (Path::Happy, "COMPLETED", _)
                    | (Path::Declined, "CANCELLED", true)
                    | (Path::ShipmentFails, "CANCELLED", false)
            );
            if !ok {
                violation(format!(
                    "took the wrong path: meant {path:?}, ended {}",
                    f.status
                ));
            }
        }
    }
    for (key, n) in &by_key {
        if *n > 1 {
            ledger
                .violations
                .push(format!("key {key} created {n} orders"));
        }
    }
    for key in expected.keys() {
        if !by_key.contains_key(key.as_str()) {
            ledger
                .violations
                .push(format!("key {key} was accepted but its order is lost"));
        }
    }
    ledger
}
