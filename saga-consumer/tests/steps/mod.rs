//! The step the service tests run: records each order and emits `Reserved`.

#![allow(dead_code, unreachable_pub)]

use saga_consumer::{Message, SagaEvent, StepContext, StepOutcome, StepResult, Topic, step_with};

#[derive(serde::Serialize, serde::Deserialize, SagaEvent)]
pub struct Placed {
    pub n: i64,
}

#[derive(serde::Serialize, serde::Deserialize, SagaEvent)]
pub struct Reserved {
    pub n: i64,
}

/// Records each order and emits `Reserved` to `out`.
async fn reserve(
    msg: &Message<Placed>,
    ctx: &mut StepContext<'_>,
    out: &Topic<Reserved>,
) -> StepResult {
    let n = msg.payload().n;
    sqlx::query("INSERT INTO reservations (n) VALUES ($1)")
        .bind(n)
        .execute(ctx.conn())
        .await?;
    ctx.emit(out, n.to_string(), &Reserved { n })?;
    Ok(StepOutcome::completed())
}

/// The step `reserve` on `topic`, emitting to `{topic}.out`.
pub fn reserve_on(topic: &str) -> impl saga_consumer::SagaStep {
    step_with("reserve", Topic::new(format!("{topic}.out")), reserve).on(&Topic::new(topic))
}
