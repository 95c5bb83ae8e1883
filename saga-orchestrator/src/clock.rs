//! The orchestrator's clock: the database's `now()`, which every deadline is written and read against,
//! shifted by an offset that only a test moves. A test advances it by an hour and the sagas whose timeout
//! fell within that hour are due at once, without sleeping. Only deadlines follow it: how long a saga has
//! not moved (`saga sagas list --stuck`) is measured by the database's own clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

/// The clock deadlines are set and fired by: the database's `now()` plus an offset (zero unless a test
/// advances it).
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// use saga_orchestrator::{Orchestrator, SagaClock, SagaDefinition};
///
/// # async fn test<D: saga_orchestrator::SagaData>(definition: SagaDefinition<D>, pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let clock = SagaClock::manual();
/// let orchestrator = Orchestrator::new(definition)?.with_clock(&clock);
/// // ... start a saga whose step times out after an hour ...
/// clock.advance(Duration::from_secs(3600));
/// let moved = orchestrator.fire_due(&pool, 100).await?; // the timeout fires now
/// # let _ = moved; Ok(()) }
/// ```
#[derive(Debug, Clone, Default)]
pub struct SagaClock {
    offset_ms: Arc<AtomicI64>,
}

impl SagaClock {
    /// The database's clock, unshifted: what a service runs on.
    pub fn system() -> Self {
        Self::default()
    }

    /// A clock a test moves with [`SagaClock::advance`]; it starts at the database's `now()` (the same
    /// value as [`SagaClock::system`]: the name says what the test means to do with it).
    pub fn manual() -> Self {
        Self::default()
    }

    /// Moves the clock forward by `by`: deadlines that fall within it are due at once. Every orchestrator
    /// given this clock (and its clones) sees the move.
    pub fn advance(&self, by: Duration) {
        let ms = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        // Saturating: a clock moved past the end of time stays there rather than wrapping into the past.
        let _ = self
            .offset_ms
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
                Some(now.saturating_add(ms))
            });
    }

    /// How far the clock was moved in all (zero for [`SagaClock::system`]).
    pub fn advanced(&self) -> Duration {
        Duration::from_millis(u64::try_from(self.offset_ms()).unwrap_or(0))
    }

    /// How far the clock was moved, in milliseconds: added to `now()` wherever a deadline is set or read.
    pub(crate) fn offset_ms(&self) -> i64 {
        self.offset_ms.load(Ordering::SeqCst)
    }
}
