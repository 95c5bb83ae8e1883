//! The one setting of librdkafka's mock cluster that its Rust wrapper does not offer: how long a new
//! group waits for more members before it assigns partitions.

#![allow(unsafe_code)]

use rdkafka::bindings::{
    rd_kafka_handle_mock_cluster, rd_kafka_mock_group_initial_rebalance_delay_ms,
};
use rdkafka::client::{Client, ClientContext};

use crate::KitError;

/// Makes the mock cluster `owner` holds (a client made with `test.mock.num.brokers`) assign a new group's
/// partitions to its first member at once.
///
/// The mock cluster, like a broker's `group.initial.rebalance.delay.ms`, otherwise holds a new group's first
/// join 3 s for more members to come; the kit starts one member per group, so every service started (and
/// every rewind of a group) waited those 3 s for nothing.
pub(crate) fn join_at_once<C: ClientContext>(owner: &Client<C>) -> Result<(), KitError> {
    // SAFETY: `native_ptr` is `owner`'s live handle, borrowed for this call; librdkafka returns the mock
    // cluster that handle made, or null when it made none, and only reads the handle.
    let cluster = unsafe { rd_kafka_handle_mock_cluster(owner.native_ptr()) };
    if cluster.is_null() {
        return Err(crate::error::kafka_said(
            "the kit's client holds no mock cluster",
        ));
    }
    // SAFETY: `cluster` is non-null and lives as long as `owner`, which outlives this call. The setter
    // writes one integer under the cluster's lock; the cluster's thread reads it while handling a request,
    // which it does holding the same lock, and no group exists yet (the kit calls this first).
    unsafe { rd_kafka_mock_group_initial_rebalance_delay_ms(cluster, 0) };
    Ok(())
}
