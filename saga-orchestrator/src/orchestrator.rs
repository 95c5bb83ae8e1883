//! The orchestrator: starts saga instances, turns replies and timeouts into transitions, and sends the
//! next command through the outbox, all in the transaction that consumed the reply (whose step key
//! deduplicates it).

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use std::future::Future;

use saga_consumer::{Extension, SagaConsumerBuilder, SagaServiceBuilder, TaskContext};
use saga_core::{
    EventMetadata, Lineage, Message, SagaStep, StepContext, StepName, StepOutcome, StepResult,
    Subscription,
};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::definition::{DefinitionError, SagaDefinition};
use crate::engine::{Decision, SagaEvent, SagaState, decide};
use crate::error::OrchestratorError;
use crate::store::{self, SagaInstance};

/// What a service does on its own tables when one of its sagas moves: record the history, mark the
/// order completed or cancelled. Runs in the transition's transaction.
///
/// # Examples
///
/// ```
/// use futures::future::BoxFuture;
/// use saga_orchestrator::{Decision, SagaHooks, SagaInstance, SagaStatus};
///
/// struct MarkOrders;
///
/// impl SagaHooks for MarkOrders {
///     fn transitioned<'a>(
///         &'a self,
///         conn: &'a mut sqlx::PgConnection,
///         before: &'a SagaInstance,
///         decision: &'a Decision,
///     ) -> BoxFuture<'a, Result<(), saga_core::StepError>> {
///         Box::pin(async move {
///             if decision.next.status == SagaStatus::Completed {
///                 sqlx::query("UPDATE orders SET status = 'COMPLETED' WHERE saga_id = $1")
///                     .bind(before.saga_id)
///                     .execute(conn)
///                     .await?;
///             }
///             Ok(())
///         })
///     }
/// }
/// # let _ = MarkOrders;
/// ```
pub trait SagaHooks: Send + Sync + 'static {
    /// Called after each transition, with the instance as it was before it and the decision taken.
    fn transitioned<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        before: &'a SagaInstance,
        decision: &'a Decision,
    ) -> BoxFuture<'a, Result<(), saga_core::StepError>>;
}

/// No hooks.
struct NoHooks;

impl SagaHooks for NoHooks {
    fn transitioned<'a>(
        &'a self,
        _conn: &'a mut PgConnection,
        _before: &'a SagaInstance,
        _decision: &'a Decision,
    ) -> BoxFuture<'a, Result<(), saga_core::StepError>> {
        Box::pin(async { Ok(()) })
    }
}

/// The orchestrator of one saga type.
#[derive(Clone)]
pub struct Orchestrator {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    definition: SagaDefinition,
    hooks: Arc<dyn SagaHooks>,
    timer_interval: Duration,
    /// Where its commands are written: the service's outbox.
    outbox: Option<saga_consumer::Outbox>,
}

impl std::fmt::Debug for Orchestrator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Orchestrator")
            .field("saga_type", &self.inner.definition.saga_type)
            .field("timer_interval", &self.inner.timer_interval)
            .finish_non_exhaustive()
    }
}

impl Orchestrator {
    /// An orchestrator for `definition` (validated).
    pub fn new(definition: SagaDefinition) -> Result<Self, DefinitionError> {
        definition.validate()?;
        Ok(Self {
            inner: Arc::new(Inner {
                definition,
                hooks: Arc::new(NoHooks),
                timer_interval: Duration::from_secs(1),
                outbox: None,
            }),
        })
    }

    /// The same orchestrator with `hooks`.
    pub fn with_hooks(self, hooks: impl SagaHooks) -> Self {
        let mut inner = (*self.inner).clone();
        inner.hooks = Arc::new(hooks);
        Self {
            inner: Arc::new(inner),
        }
    }

    /// The same orchestrator, looking for due timers every `every` (default 1 s) when it runs in a
    /// service.
    pub fn with_timer_interval(self, every: Duration) -> Self {
        let mut inner = (*self.inner).clone();
        inner.timer_interval = every;
        Self {
            inner: Arc::new(inner),
        }
    }

    /// The same orchestrator, writing its commands to `outbox`: the service's
    /// ([`SagaServiceBuilder::outbox`]). An orchestrator added to a service with
    /// [`SagaServiceBuilder::with`] is given it; one that starts sagas elsewhere (an HTTP route) must be
    /// given it too, or it writes a table outbox.
    pub fn with_outbox(self, outbox: &saga_consumer::Outbox) -> Self {
        let mut inner = (*self.inner).clone();
        inner.outbox = Some(outbox.clone());
        Self {
            inner: Arc::new(inner),
        }
    }

    /// The definition.
    pub fn definition(&self) -> &SagaDefinition {
        &self.inner.definition
    }

    /// Starts an instance for `lineage`'s key and tenant with `input`, in the caller's transaction, and
    /// sends the first command. Idempotent on the key: starting again returns the existing instance. The
    /// flag says whether it was created.
    pub async fn start(
        &self,
        conn: &mut PgConnection,
        lineage: &Lineage,
        input: serde_json::Value,
    ) -> Result<(Uuid, bool), OrchestratorError> {
        let def = &self.inner.definition;
        let (instance, created) = store::insert(
            conn,
            def.saga_type.as_str(),
            lineage.tenant(),
            lineage.idempotency_key(),
            &SagaState::started(input),
        )
        .await?;
        if created {
            let decision = decide(def, &instance.state()?, SagaEvent::Started)
                .ok_or_else(|| OrchestratorError::Corrupt("a new saga did not start".into()))?;
            self.transition(conn, &instance, &decision, lineage).await?;
        }
        Ok((instance.saga_id, created))
    }

    /// Handles a reply: finds the instance by the reply's key and tenant, decides, and applies the decision
    /// (versioned) in the caller's transaction. Returns whether anything changed (a stale or duplicate
    /// reply changes nothing).
    pub async fn on_reply(
        &self,
        conn: &mut PgConnection,
        reply: &EventMetadata,
        payload: &serde_json::Value,
    ) -> Result<bool, OrchestratorError> {
        let def = &self.inner.definition;
        let instance = store::by_key(
            conn,
            def.saga_type.as_str(),
            reply.tenant.as_str(),
            reply.idempotency_key.as_str(),
        )
        .await?
        .ok_or_else(|| OrchestratorError::UnknownSaga {
            saga_type: def.saga_type.to_string(),
            tenant: reply.tenant.to_string(),
            key: reply.idempotency_key.to_string(),
        })?;
        let event = SagaEvent::Reply {
            event_type: &reply.event_type,
            payload,
        };
        let Some(decision) = decide(def, &instance.state()?, event) else {
            tracing::debug!(saga = %instance.saga_id, reply = %reply.event_type, "reply changes nothing");
            return Ok(false);
        };
        self.transition(conn, &instance, &decision, &Lineage::caused_by(reply))
            .await?;
        Ok(true)
    }

    /// Fires the due timers of up to `limit` instances in one transaction, skipping instances another
    /// instance of the orchestrator is handling. Each instance moves in a savepoint of its own: one whose
    /// transition fails (its hook errs, its data is unreadable) is rolled back alone, marked with the error
    /// (`timer_failures`, `last_error`) and tried again later with backoff, while the others move. One the
    /// definition has no move for (it was at a step the definition no longer has) is marked stuck with the
    /// reason and its deadline cleared: it is never due again until someone moves it. Returns how many
    /// moved.
    pub async fn fire_due(&self, pool: &PgPool, limit: i64) -> Result<usize, OrchestratorError> {
        let def = &self.inner.definition;
        let mut tx = pool.begin().await?;
        let due = store::lock_due(&mut tx, def.saga_type.as_str(), limit).await?;
        let mut moved = 0;
        for instance in &due {
            let mut savepoint = sqlx::Connection::begin(&mut *tx).await?;
            match self.fire_one(&mut savepoint, instance).await {
                Ok(true) => {
                    savepoint.commit().await?;
                    moved += 1;
                }
                Ok(false) => {
                    savepoint.commit().await?;
                    let reason = format!(
                        "its deadline passed at step {} ({}), and the definition of {} has no move for it \
                         (a step removed from the definition?)",
                        instance.step_index, instance.status, instance.saga_type
                    );
                    tracing::error!(saga = %instance.saga_id, %reason, "a saga is stuck; its timer is cleared");
                    store::mark_stuck(&mut tx, instance, &reason).await?;
                }
                Err(e) => {
                    savepoint.rollback().await?;
                    tracing::warn!(saga = %instance.saga_id, error = %e, "a saga's timer failed to fire; will retry");
                    store::timer_failed(&mut tx, instance, &e.to_string()).await?;
                }
            }
        }
        tx.commit().await?;
        Ok(moved)
    }

    async fn fire_one(
        &self,
        conn: &mut PgConnection,
        instance: &SagaInstance,
    ) -> Result<bool, OrchestratorError> {
        // Due because an operator asked for a retry, or because its deadline passed.
        let event = if instance.retry_requested_by.is_some() {
            SagaEvent::Retry
        } else {
            SagaEvent::Timeout
        };
        let Some(decision) = decide(&self.inner.definition, &instance.state()?, event) else {
            return Ok(false);
        };
        self.transition(conn, instance, &decision, &instance.lineage()?)
            .await?;
        Ok(true)
    }

    /// Fires due timers every `every` until `shutdown` resolves. A service that registered the orchestrator
    /// with `SagaService::builder().with(orchestrator)` runs this already; several orchestrator instances
    /// may run it at once.
    pub async fn run_timers(
        &self,
        pool: PgPool,
        every: Duration,
        shutdown: impl Future<Output = ()> + Send,
    ) {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep(every) => {}
            }
            loop {
                match self.fire_due(&pool, 100).await {
                    Ok(100) => continue,
                    Ok(_) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "firing saga timers failed; retrying");
                        break;
                    }
                }
            }
        }
    }

    async fn transition(
        &self,
        conn: &mut PgConnection,
        instance: &SagaInstance,
        decision: &Decision,
        lineage: &Lineage,
    ) -> Result<(), OrchestratorError> {
        let table;
        let outbox = match &self.inner.outbox {
            Some(outbox) => outbox.runtime(),
            None => {
                table = saga_consumer::Outbox::table();
                table.runtime()
            }
        };
        store::apply(conn, instance, decision, lineage, outbox).await?;
        self.inner
            .hooks
            .transitioned(conn, instance, decision)
            .await?;
        tracing::info!(
            saga = %instance.saga_id,
            from = %instance.status,
            to = decision.next.status.as_str(),
            step = decision.step.as_deref().unwrap_or(""),
            cause = %decision.cause,
            "saga transition"
        );
        Ok(())
    }

    /// The consumer steps that deliver replies: `on-{step}` for each step's replies and
    /// `on-compensate-{step}` for each compensation's, on the definition's reply topic. Each reply is
    /// deduplicated by its step key like any message.
    pub fn reply_steps(&self) -> Vec<ReplyStep> {
        let def = &self.inner.definition;
        let mut steps = Vec::new();
        for step in &def.steps {
            let types: Vec<&String> = step.succeeds_on.iter().chain(&step.fails_on).collect();
            steps.push(self.reply_step(&format!("on-{}", step.name), &types));
            if let Some(c) = &step.compensation {
                let types: Vec<&String> = c.done_on.iter().collect();
                steps.push(self.reply_step(&format!("on-compensate-{}", step.name), &types));
            }
        }
        steps
    }

    fn reply_step(&self, name: &str, types: &[&String]) -> ReplyStep {
        let topic = &self.inner.definition.reply_topic;
        ReplyStep {
            orchestrator: self.clone(),
            // Checked when the orchestrator was built (`SagaDefinition::validate`): never replaced.
            name: StepName::new(name).expect(
                "the orchestrator validated its definition's derived names when it was built",
            ),
            subscriptions: types
                .iter()
                .map(|t| Subscription::new(topic, t.as_str()))
                .collect(),
        }
    }

    /// Registers the reply steps with a consumer (for a consumer run on its own; a `SagaService` takes
    /// the whole orchestrator with [`saga_consumer::SagaServiceBuilder::with`]).
    pub fn register(&self, mut builder: SagaConsumerBuilder) -> SagaConsumerBuilder {
        for step in self.reply_steps() {
            builder = builder.step(step);
        }
        builder
    }

    /// An instance of this saga type, by id.
    pub async fn instance(
        &self,
        pool: &PgPool,
        saga_id: Uuid,
    ) -> Result<Option<SagaInstance>, OrchestratorError> {
        store::load(pool, saga_id).await
    }
}

/// Adds the orchestrator to a service: its reply steps, its tables, and its timers as a background task.
///
/// # Examples
///
/// ```no_run
/// # fn example(orchestrator: saga_orchestrator::Orchestrator, pool: saga_consumer::sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let service = saga_consumer::SagaService::builder()
///     .from_env()
///     .pool(pool)
///     .with(orchestrator)
///     .build()?;
/// # let _ = service; Ok(()) }
/// ```
impl Extension for Orchestrator {
    fn extend(self, mut service: SagaServiceBuilder) -> SagaServiceBuilder {
        // Its commands go where the service's events go.
        let this = if self.inner.outbox.is_none() {
            self.with_outbox(&service.outbox())
        } else {
            self
        };
        service = service.migrations(crate::migrate::migrator());
        for step in this.reply_steps() {
            service = service.step(step);
        }
        let name = format!("{} timers", this.inner.definition.saga_type);
        service.task(name, move |ctx: TaskContext| async move {
            let every = this.inner.timer_interval;
            this.run_timers(ctx.pool().clone(), every, ctx.shutdown())
                .await;
            Ok(())
        })
    }
}

/// A consumer step delivering replies of one saga step to the orchestrator.
#[derive(Debug)]
pub struct ReplyStep {
    orchestrator: Orchestrator,
    name: StepName,
    subscriptions: Vec<Subscription>,
}

impl SagaStep for ReplyStep {
    type Payload = serde_json::Value;

    fn name(&self) -> StepName {
        self.name.clone()
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        self.subscriptions.clone()
    }

    async fn handle(
        &self,
        msg: &Message<serde_json::Value>,
        ctx: &mut StepContext<'_>,
    ) -> StepResult {
        let moved = self
            .orchestrator
            .on_reply(ctx.conn(), msg.metadata(), msg.payload())
            .await?;
        StepOutcome::completed_with(&serde_json::json!({ "moved": moved }))
    }
}
