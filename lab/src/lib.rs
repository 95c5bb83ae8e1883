//! # The lab around the example saga
//!
//! What runs, breaks and measures the example services, kept apart from them so that `examples/` reads as
//! examples:
//!
//! - [`harness`]: the whole saga with real processes (or in this process), a client, the ledger checks and
//!   fault injection: behind `saga-demo`, `chaos` and the end-to-end tests.
//! - `bench` (feature `bench`, on by default): the measurements of `saga-bench`, each beside the limit of the
//!   work it measures.

#![deny(missing_docs)]

#[cfg(feature = "bench")]
pub mod bench;
pub mod harness;
