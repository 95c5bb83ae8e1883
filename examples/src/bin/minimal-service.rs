//! The smallest complete service: one step, an async function, that records a shipment for each
//! `PaymentProcessed` and emits `ShipmentArranged`, exactly once per message, until SIGTERM or Ctrl-C.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/saga_demo KAFKA_BROKERS=127.0.0.1:9092 \
//!   SAGA_GROUP_ID=shipping SAGA_CREATE_TOPICS=1 cargo run -p saga-examples --bin minimal-service
//! ```

use saga_consumer::{
    Message, SagaEvent, SagaService, StepContext, StepOutcome, StepResult, Topic, step,
};
use serde::{Deserialize, Serialize};

/// mimalloc, not the system's allocator: with glibc's malloc, allocation was about a quarter of the
/// consumer's own CPU (docs/guide/deployment.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Serialize, Deserialize, SagaEvent)]
struct PaymentProcessed {
    order_id: i64,
}

#[derive(Serialize, Deserialize, SagaEvent)]
struct ShipmentArranged {
    order_id: i64,
}

const PAYMENTS: Topic<PaymentProcessed> = Topic::fixed("saga.payments");
const SHIPPING: Topic<ShipmentArranged> = Topic::fixed("saga.shipping");

async fn arrange_shipment(
    msg: &Message<PaymentProcessed>,
    ctx: &mut StepContext<'_>,
) -> StepResult {
    let order_id = msg.payload().order_id;
    sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
        .bind(order_id)
        .execute(ctx.conn())
        .await?;
    ctx.emit(
        &SHIPPING,
        order_id.to_string(),
        &ShipmentArranged { order_id },
    )?;
    Ok(StepOutcome::completed())
}

async fn run() -> anyhow::Result<()> {
    let url = std::env::var("DATABASE_URL").unwrap_or_default();
    let pool = saga_consumer::setup::connect_postgres("DATABASE_URL", &url, None, 8).await?;
    // The service's own table (a real service keeps it in a migration of its own).
    sqlx::query("CREATE TABLE IF NOT EXISTS shipments (order_id BIGINT PRIMARY KEY)")
        .execute(&pool)
        .await?;
    SagaService::builder()
        .from_env() // KAFKA_BROKERS and SAGA_GROUP_ID are required
        .pool(pool)
        .step(step("arrange-shipment", arrange_shipment).on(&PAYMENTS))
        .build()?
        .run(saga_consumer::shutdown_signal())
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    saga_consumer::setup::exit_code(run().await)
}
