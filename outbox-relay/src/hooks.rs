//! Fault injection for tests: a delivery that fails as if the broker had refused the row.

use std::sync::Arc;

/// An outbox row about to be published, as a hook sees it.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct PublishAttempt<'a> {
    /// The row's id.
    pub id: i64,
    /// Its topic.
    pub topic: &'a str,
    /// Its Kafka key.
    pub key: Option<&'a str>,
    /// Its payload.
    pub payload: Option<&'a [u8]>,
}

type FailHook = Arc<dyn Fn(&PublishAttempt<'_>) -> Option<String> + Send + Sync>;

/// Callbacks the relay calls at fixed points, for fault injection in tests.
#[derive(Clone, Default)]
pub struct PublishHooks {
    fail_delivery: Option<FailHook>,
}

impl PublishHooks {
    /// Calls `hook` for each row about to be sent; when it returns an error text, the row is not given to
    /// the producer and its delivery report says that error, as if the broker had refused it this time.
    /// The relay then treats it as any failed delivery: retried later, its key's later rows held back.
    pub fn fail_delivery(
        mut self,
        hook: impl Fn(&PublishAttempt<'_>) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.fail_delivery = Some(Arc::new(hook));
        self
    }

    /// The error an injected failure reports for `attempt`, if any.
    pub(crate) fn injected_failure(&self, attempt: &PublishAttempt<'_>) -> Option<String> {
        self.fail_delivery.as_ref().and_then(|hook| hook(attempt))
    }
}

impl std::fmt::Debug for PublishHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublishHooks")
            .field("fail_delivery", &self.fail_delivery.is_some())
            .finish()
    }
}
