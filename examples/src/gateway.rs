//! A simulated payment gateway: an external system, with storage of its own outside the payment service's
//! transactions. Like real gateways it deduplicates on the caller's idempotency key: charging twice with
//! the same key returns the first charge. Cards ending in `0002` are declined.

use std::time::{Duration, Instant};

use sqlx::{PgPool, Row};
use uuid::Uuid;

/// The gateway's answer to a charge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChargeResult {
    /// Charged.
    Charged {
        /// The charge's id.
        charge_id: String,
    },
    /// Declined.
    Declined {
        /// Why.
        reason: String,
    },
}

/// The gateway could not be reached (a transient failure).
#[derive(Debug, thiserror::Error)]
#[error("payment gateway unavailable: {0}")]
pub struct GatewayUnavailable(String);

impl From<sqlx::Error> for GatewayUnavailable {
    fn from(e: sqlx::Error) -> Self {
        Self(e.to_string())
    }
}

/// The simulated gateway.
#[derive(Debug, Clone)]
pub struct PaymentGateway {
    pool: PgPool,
    latency: Duration,
}

impl PaymentGateway {
    /// A gateway keeping its ledger in `pool`'s schema, answering after `latency`.
    pub fn new(pool: PgPool, latency: Duration) -> Self {
        Self { pool, latency }
    }

    /// Charges `amount_cents` to `card` for `order_id`, once per `idempotency_key`. The ledger row keeps
    /// how long the call took until its ledger row's statement (`call_ms`): the outside call's own part of a
    /// saga's time.
    pub async fn charge(
        &self,
        idempotency_key: &str,
        order_id: Uuid,
        amount_cents: i64,
        card: &str,
    ) -> Result<ChargeResult, GatewayUnavailable> {
        let called = Instant::now();
        tokio::time::sleep(self.latency).await;
        self.check_up().await?;
        let declined = card.ends_with("0002");
        let row = sqlx::query(
            "WITH inserted AS ( \
                 INSERT INTO gateway_charges (idempotency_key, charge_id, order_id, amount_cents, declined, call_ms) \
                 VALUES ($1, $2, $3, $4, $5, $6) \
                 ON CONFLICT (idempotency_key) DO NOTHING \
                 RETURNING charge_id, declined) \
             SELECT charge_id, declined FROM inserted \
             UNION ALL \
             SELECT charge_id, declined FROM gateway_charges WHERE idempotency_key = $1 \
             LIMIT 1",
        )
        .bind(idempotency_key)
        .bind(format!("ch_{}", Uuid::new_v4().simple()))
        .bind(order_id)
        .bind(amount_cents)
        .bind(declined)
        // The call's time up to its ledger row's statement, on this process's clock alone.
        .bind(called.elapsed().as_secs_f64() * 1000.0)
        .fetch_one(&self.pool)
        .await?;
        let charge_id: String = row.try_get(0)?;
        Ok(if row.try_get::<bool, _>(1)? {
            ChargeResult::Declined {
                reason: format!("card declined (charge {charge_id})"),
            }
        } else {
            ChargeResult::Charged { charge_id }
        })
    }

    /// Refunds `charge_id`, once per `idempotency_key`. Returns the refund's id.
    pub async fn refund(
        &self,
        idempotency_key: &str,
        charge_id: &str,
    ) -> Result<String, GatewayUnavailable> {
        tokio::time::sleep(self.latency).await;
        self.check_up().await?;
        let refund_id: String = sqlx::query_scalar(
            "WITH inserted AS ( \
                 INSERT INTO gateway_refunds (idempotency_key, refund_id, charge_id) VALUES ($1, $2, $3) \
                 ON CONFLICT (idempotency_key) DO NOTHING RETURNING refund_id) \
             SELECT refund_id FROM inserted \
             UNION ALL \
             SELECT refund_id FROM gateway_refunds WHERE idempotency_key = $1 \
             LIMIT 1",
        )
        .bind(idempotency_key)
        .bind(format!("re_{}", Uuid::new_v4().simple()))
        .bind(charge_id)
        .fetch_one(&self.pool)
        .await?;
        Ok(refund_id)
    }

    /// Fails while the outage switch (a row in `gateway_outage`) is on.
    async fn check_up(&self) -> Result<(), GatewayUnavailable> {
        let down: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM gateway_outage)")
            .fetch_one(&self.pool)
            .await?;
        if down {
            return Err(GatewayUnavailable("outage (connection refused)".to_owned()));
        }
        Ok(())
    }
}
