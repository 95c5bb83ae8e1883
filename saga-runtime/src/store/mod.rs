//! The PostgreSQL side of the framework: the idempotency store, the outbox writer, garbage collection and
//! their migrations. Used by the consumer, the relay, the orchestrator and the HTTP layer; services reach it
//! through those (`ctx.emit`, `IdempotentRequest::emit`, the runner's migrations), not directly.

pub mod fault;
pub mod gc;
pub mod idempotency;
pub mod migrate;
pub mod outbox;
pub mod wal;
