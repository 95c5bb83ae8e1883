//! Observation and fault-injection points. Tests and the demo's fault mode use
//! [`Hooks::after_db_commit`] to kill a consumer exactly between its database commit and its offset commit.

use std::sync::Arc;

/// A committed transaction of one partition's messages.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CommitInfo {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The first message's offset.
    pub first_offset: i64,
    /// The last message's offset.
    pub last_offset: i64,
    /// How many messages the transaction covered.
    pub messages: usize,
}

type CommitHook = Arc<dyn Fn(&CommitInfo) + Send + Sync>;

/// Callbacks the runtime calls at fixed points.
#[derive(Clone, Default)]
pub struct Hooks {
    after_db_commit: Option<CommitHook>,
}

impl Hooks {
    /// Calls `hook` right after each database commit, before the offsets of those messages are committed
    /// to Kafka. Calling `std::process::abort()` there simulates the worst-timed crash.
    pub fn on_db_commit(mut self, hook: impl Fn(&CommitInfo) + Send + Sync + 'static) -> Self {
        self.after_db_commit = Some(Arc::new(hook));
        self
    }

    pub(crate) fn after_db_commit(&self, info: &CommitInfo) {
        if let Some(hook) = &self.after_db_commit {
            hook(info);
        }
    }
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("after_db_commit", &self.after_db_commit.is_some())
            .finish()
    }
}
