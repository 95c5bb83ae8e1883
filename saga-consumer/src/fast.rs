//! The consumer's side of the Redis fast path (feature `redis`): a pre-check of a batch's step keys before
//! the batch's transaction, and completed keys written to Redis after it committed. Without the feature
//! (or without `REDIS_URL`) both do nothing. See `crate::fast_path`.
//!
//! A message whose key Redis knows to be completed is finished as a duplicate without a claim; a batch made
//! only of such messages (and ignored ones) runs no transaction at all. Redis only ever holds keys whose
//! transaction committed, so a key it knows is one PostgreSQL has; every other key is claimed inside the
//! transaction, which decides.

use crate::dedup::ItemOutcome;
use crate::delivery::Delivery;
#[cfg(feature = "redis")]
use crate::delivery::Route;

/// The fast path, when the feature is on.
#[cfg(feature = "redis")]
pub(crate) type FastPath = crate::fast_path::FastPath;

/// Without the `redis` feature there is no fast path.
#[cfg(not(feature = "redis"))]
#[derive(Clone)]
pub(crate) enum FastPath {}

/// Marks the deliveries of `batch` whose step key Redis knows to be completed (`known_done`).
pub(crate) async fn pre_check(fast: Option<&FastPath>, batch: &mut [Delivery]) {
    let Some(fast) = fast else { return };
    #[cfg(feature = "redis")]
    {
        // (index in the batch, key) of the messages routed to a step.
        let (keyed, keys): (Vec<usize>, Vec<_>) = batch
            .iter()
            .enumerate()
            .filter_map(|(i, d)| match &d.route {
                Route::Step {
                    step_key, tenant, ..
                } => Some((i, (tenant, step_key))),
                _ => None,
            })
            .unzip();
        let known = fast.completed(&keys).await;
        drop(keys);
        let mut skipped = 0;
        for (i, done) in keyed.into_iter().zip(known) {
            if done {
                batch[i].known_done = true;
                skipped += 1;
            }
        }
        fast.answered("duplicate", skipped);
    }
    #[cfg(not(feature = "redis"))]
    {
        let _ = batch;
        match *fast {}
    }
}

/// Writes to Redis the step keys of `batch` that are now known completed in PostgreSQL (claimed and
/// committed, or found completed there), in the background: call only after the commit.
pub(crate) fn after_commit(fast: Option<&FastPath>, batch: &[Delivery], outcomes: &[ItemOutcome]) {
    let Some(fast) = fast else { return };
    #[cfg(feature = "redis")]
    {
        let keys: Vec<(saga_core::TenantId, saga_core::StepKey)> = batch
            .iter()
            .zip(outcomes)
            .filter(|(d, o)| {
                !d.known_done
                    && matches!(
                        o,
                        ItemOutcome::Completed | ItemOutcome::Rejected | ItemOutcome::Duplicate
                    )
            })
            .filter_map(|(d, _)| match &d.route {
                Route::Step {
                    step_key, tenant, ..
                } => Some((tenant.clone(), step_key.clone())),
                _ => None,
            })
            .collect();
        if keys.is_empty() {
            return;
        }
        let fast = fast.clone();
        tokio::spawn(async move {
            let refs: Vec<_> = keys.iter().map(|(t, k)| (t, k)).collect();
            fast.mark_completed(&refs).await;
        });
    }
    #[cfg(not(feature = "redis"))]
    {
        let _ = (batch, outcomes);
        match *fast {}
    }
}
