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

use crate::clock::SagaClock;
use crate::definition::{DefinitionError, SagaData, SagaDefinition};
use crate::engine::{Decision, Refusal, SagaEvent, SagaState, SagaStatus, decide};
use crate::error::OrchestratorError;
use crate::store::{self, SagaInstance};

/// What [`Orchestrator::start`] did: the key's instance, and whether this call created it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Started {
    /// The instance.
    pub saga_id: Uuid,
    /// Whether this call created it and sent its first command (`false`: the key's instance existed, and
    /// nothing was sent).
    pub created: bool,
}

/// A transition as hooks see it: the instance, its state before and after (with the saga's data), the
/// step concerned and what caused it.
#[derive(Debug)]
#[non_exhaustive]
pub struct SagaChange<'a, D> {
    /// The instance as stored before the transition (its id, key, tenant, version).
    pub instance: &'a SagaInstance,
    /// Its state before the transition.
    pub before: &'a SagaState<D>,
    /// Its state after it.
    pub after: &'a SagaState<D>,
    /// The step (or compensation) concerned.
    pub step: Option<&'a str>,
    /// What caused it: `started`, a reply's event type, `timeout`, `retry`.
    pub cause: &'a str,
}

impl<D> SagaChange<'_, D> {
    /// The saga's data after the transition.
    pub fn data(&self) -> &D {
        &self.after.data
    }

    /// Where the saga stands after the transition.
    pub fn status(&self) -> SagaStatus {
        self.after.status
    }
}

/// What a service does on its own tables when one of its sagas moves: record the history, mark the
/// order completed or cancelled. Runs in the transition's transaction, with the saga's data.
///
/// # Examples
///
/// ```
/// use futures::future::BoxFuture;
/// use saga_orchestrator::{SagaChange, SagaHooks, SagaStatus};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Clone, Serialize, Deserialize)]
/// struct Order { order_id: i64 }
///
/// struct MarkOrders;
///
/// impl SagaHooks<Order> for MarkOrders {
///     fn transitioned<'a>(
///         &'a self,
///         conn: &'a mut sqlx::PgConnection,
///         change: &'a SagaChange<'a, Order>,
///     ) -> BoxFuture<'a, Result<(), saga_core::StepError>> {
///         Box::pin(async move {
///             if change.status() == SagaStatus::Completed {
///                 sqlx::query("UPDATE orders SET status = 'COMPLETED' WHERE order_id = $1")
///                     .bind(change.data().order_id)
///                     .execute(conn)
///                     .await?;
///             }
///             Ok(())
///         })
///     }
/// }
/// # let _ = MarkOrders;
/// ```
pub trait SagaHooks<D>: Send + Sync + 'static {
    /// Called after each transition.
    fn transitioned<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        change: &'a SagaChange<'a, D>,
    ) -> BoxFuture<'a, Result<(), saga_core::StepError>>;
}

/// No hooks.
struct NoHooks;

impl<D> SagaHooks<D> for NoHooks {
    fn transitioned<'a>(
        &'a self,
        _conn: &'a mut PgConnection,
        _change: &'a SagaChange<'a, D>,
    ) -> BoxFuture<'a, Result<(), saga_core::StepError>> {
        Box::pin(async { Ok(()) })
    }
}

/// The orchestrator of one saga type, whose data is `D`.
pub struct Orchestrator<D> {
    inner: Arc<Inner<D>>,
}

impl<D> Clone for Orchestrator<D> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

struct Inner<D> {
    /// The definition new instances start on.
    definition: SagaDefinition<D>,
    /// Earlier versions whose instances still run, newest first.
    kept: Vec<SagaDefinition<D>>,
    hooks: Arc<dyn SagaHooks<D>>,
    timer_interval: Duration,
    /// Where its commands are written: the service's outbox.
    outbox: Option<saga_consumer::Outbox>,
    /// What deadlines are set and fired by.
    clock: SagaClock,
}

impl<D> Clone for Inner<D> {
    fn clone(&self) -> Self {
        Self {
            definition: self.definition.clone(),
            kept: self.kept.clone(),
            hooks: Arc::clone(&self.hooks),
            timer_interval: self.timer_interval,
            outbox: self.outbox.clone(),
            clock: self.clock.clone(),
        }
    }
}

impl<D> std::fmt::Debug for Orchestrator<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Orchestrator")
            .field("saga_type", &self.inner.definition.saga_type)
            .field("version", &self.inner.definition.version)
            .field(
                "kept",
                &self
                    .inner
                    .kept
                    .iter()
                    .map(|d| d.version)
                    .collect::<Vec<_>>(),
            )
            .field("timer_interval", &self.inner.timer_interval)
            .finish_non_exhaustive()
    }
}

/// What a due instance's timer did.
enum Fired {
    /// The instance moved.
    Moved,
    /// It could not move, for this reason: it is marked stuck.
    Stuck(String),
}

impl<D: SagaData> Orchestrator<D> {
    /// An orchestrator for `definition` (validated): new instances start on its version.
    pub fn new(definition: SagaDefinition<D>) -> Result<Self, DefinitionError> {
        definition.validate()?;
        Ok(Self {
            inner: Arc::new(Inner {
                definition,
                kept: Vec::new(),
                hooks: Arc::new(NoHooks),
                timer_interval: Duration::from_secs(1),
                outbox: None,
                clock: SagaClock::system(),
            }),
        })
    }

    fn with_inner(self, change: impl FnOnce(&mut Inner<D>)) -> Self {
        let mut inner = (*self.inner).clone();
        change(&mut inner);
        Self {
            inner: Arc::new(inner),
        }
    }

    /// The same orchestrator, still running the instances that started on `earlier`, an earlier version
    /// of the same saga type: they finish on the definition they started with (its steps, its
    /// compensations), while new instances start on the current one. Keep a version until none of its
    /// instances runs (`saga sagas list`); an instance of a version the orchestrator does not have is never
    /// misread: its replies are refused (dead-lettered, or retried if it is newer than every version here,
    /// as during a rolling deploy) and its timer marked stuck, each with the reason.
    ///
    /// # Examples
    ///
    /// ```
    /// # use saga_orchestrator::{Orchestrator, SagaDefinition};
    /// # fn example<D: saga_orchestrator::SagaData>(v1: SagaDefinition<D>, v2: SagaDefinition<D>) -> Result<(), saga_orchestrator::definition::DefinitionError> {
    /// // v2 added a step; instances that started on v1 finish on v1.
    /// let orchestrator = Orchestrator::new(v2.version(2))?.keep_running(v1)?;
    /// # let _ = orchestrator; Ok(()) }
    /// ```
    pub fn keep_running(self, earlier: SagaDefinition<D>) -> Result<Self, DefinitionError> {
        earlier.validate()?;
        let saga = self.inner.definition.saga_type.to_string();
        if earlier.saga_type != self.inner.definition.saga_type {
            return Err(DefinitionError::Versions {
                saga,
                reason: format!(
                    "a definition of {} cannot run its instances",
                    earlier.saga_type
                ),
            });
        }
        if self.definitions().any(|d| d.version == earlier.version) {
            return Err(DefinitionError::Versions {
                saga,
                reason: format!("two definitions are version {}", earlier.version),
            });
        }
        // A reply step takes one reply per instance (its step key is the saga's key and its name): a reply
        // type the versions route to different reply steps would let one version's reply step consume the
        // reply another version's instance expects from a later step, and that later reply would then be
        // a duplicate to it.
        for (reply, route) in earlier.reply_routes() {
            let clash = self.definitions().find_map(|d| {
                d.reply_routes()
                    .into_iter()
                    .find(|(r, other)| *r == reply && *other != route)
                    .map(|(_, other)| (d.version, other))
            });
            if let Some((version, other)) = clash {
                return Err(DefinitionError::Versions {
                    saga,
                    reason: format!(
                        "reply {reply} goes to {route} in version {} and to {other} in version {version}: \
                         give the step of one version a reply type of its own",
                        earlier.version
                    ),
                });
            }
        }
        Ok(self.with_inner(|inner| {
            inner.kept.push(earlier);
            inner.kept.sort_by_key(|d| std::cmp::Reverse(d.version));
        }))
    }

    /// The same orchestrator with `hooks`.
    pub fn with_hooks(self, hooks: impl SagaHooks<D>) -> Self {
        self.with_inner(|inner| inner.hooks = Arc::new(hooks))
    }

    /// The same orchestrator, looking for due timers every `every` (default 1 s) when it runs in a
    /// service.
    pub fn with_timer_interval(self, every: Duration) -> Self {
        self.with_inner(|inner| inner.timer_interval = every)
    }

    /// The same orchestrator, writing its commands to `outbox`: the service's
    /// ([`SagaServiceBuilder::outbox`]). An orchestrator added to a service with
    /// [`SagaServiceBuilder::with`] is given it; one that starts sagas elsewhere (an HTTP route) must be
    /// given it too, or it writes a table outbox.
    pub fn with_outbox(self, outbox: &saga_consumer::Outbox) -> Self {
        self.with_inner(|inner| inner.outbox = Some(outbox.clone()))
    }

    /// The same orchestrator on `clock`: a test's [`SagaClock::manual`], advanced to make timeouts due
    /// without waiting for them. Deadlines are the database's `now()` plus the clock's offset, when they are
    /// set and when they are fired.
    pub fn with_clock(self, clock: &SagaClock) -> Self {
        self.with_inner(|inner| inner.clock = clock.clone())
    }

    /// The definition new instances start on.
    pub fn definition(&self) -> &SagaDefinition<D> {
        &self.inner.definition
    }

    /// Every definition it runs: the current one, then the kept ones, newest first.
    fn definitions(&self) -> impl Iterator<Item = &SagaDefinition<D>> {
        std::iter::once(&self.inner.definition).chain(&self.inner.kept)
    }

    /// The definition `instance` runs (a 0.2 instance: version 1), and its data read.
    fn read(
        &self,
        instance: &SagaInstance,
    ) -> Result<(&SagaDefinition<D>, SagaState<D>), OrchestratorError> {
        let version = instance.definition_version.unwrap_or(1);
        let definition = self
            .definitions()
            .find(|d| i64::from(d.version) == i64::from(version))
            .ok_or_else(|| OrchestratorError::UnknownVersion {
                saga_id: instance.saga_id,
                version,
                known: self.definitions().map(|d| d.version).collect(),
            })?;
        let data = definition
            .read_data(&instance.data, instance.stored_by_0_2())
            .map_err(|reason| OrchestratorError::Unreadable {
                saga_id: instance.saga_id,
                reason,
            })?;
        Ok((definition, instance.state(data)?))
    }

    /// Starts an instance for `lineage`'s key and tenant with `data`, on the current definition, in the
    /// caller's transaction, and sends the first command. Idempotent on the key: starting again returns
    /// the existing instance ([`Started::created`] says which).
    pub async fn start(
        &self,
        conn: &mut PgConnection,
        lineage: &Lineage,
        data: D,
    ) -> Result<Started, OrchestratorError> {
        let def = &self.inner.definition;
        let json = stored_form(&data).map_err(|reason| OrchestratorError::Unreadable {
            saga_id: Uuid::nil(),
            reason,
        })?;
        let (instance, created) = store::insert(
            conn,
            def.saga_type.as_str(),
            lineage.tenant(),
            lineage.idempotency_key(),
            &json,
            i32::try_from(def.version).unwrap_or(i32::MAX),
        )
        .await?;
        if created {
            let state = SagaState::started(data);
            let decision = decide(def, &state, SagaEvent::Started)
                .map_err(|r| refused(&instance, r))?
                .ok_or_else(|| OrchestratorError::Corrupt("a new saga did not start".into()))?;
            self.transition(conn, &instance, def, &state, &decision, lineage)
                .await?;
        }
        Ok(Started {
            saga_id: instance.saga_id,
            created,
        })
    }

    /// Handles a reply: finds the instance by the reply's key and tenant, decides on the definition it
    /// runs, and applies the decision (versioned) in the caller's transaction. Returns whether anything
    /// changed (a stale or duplicate reply changes nothing). A reply that does not decode as its step's
    /// reply type is refused ([`OrchestratorError::BadReply`]): the consumer dead-letters it with the
    /// reason, and the saga stays where it is.
    pub async fn on_reply(
        &self,
        conn: &mut PgConnection,
        reply: &EventMetadata,
        payload: &[u8],
    ) -> Result<bool, OrchestratorError> {
        let saga_type = self.inner.definition.saga_type.as_str();
        let instance = store::by_key(
            conn,
            saga_type,
            reply.tenant.as_str(),
            reply.idempotency_key.as_str(),
        )
        .await?
        .ok_or_else(|| OrchestratorError::UnknownSaga {
            saga_type: saga_type.to_owned(),
            tenant: reply.tenant.to_string(),
            key: reply.idempotency_key.to_string(),
        })?;
        if SagaStatus::parse(&instance.status).is_some_and(SagaStatus::is_final) {
            // A late duplicate for an ended saga: nothing to read, nothing to do.
            return Ok(false);
        }
        let (def, state) = self.read(&instance)?;
        let event = SagaEvent::Reply {
            event_type: &reply.event_type,
            payload,
        };
        let Some(decision) = decide(def, &state, event).map_err(|r| refused(&instance, r))? else {
            tracing::debug!(saga = %instance.saga_id, reply = %reply.event_type, "reply changes nothing");
            return Ok(false);
        };
        self.transition(
            conn,
            &instance,
            def,
            &state,
            &decision,
            &Lineage::caused_by(reply),
        )
        .await?;
        Ok(true)
    }

    /// Fires the due timers of up to `limit` instances in one transaction, skipping instances another
    /// instance of the orchestrator is handling. Each instance moves in a savepoint of its own: one whose
    /// transition fails (its hook errs, a command cannot be built) is rolled back alone, marked with the
    /// error (`timer_failures`, `last_error`) and tried again later with backoff, while the others move.
    /// One the orchestrator has no move for (it was at a step its definition no longer has, it runs a
    /// version this orchestrator does not have, its data does not read) is marked stuck with the reason
    /// and its deadline cleared: it is never due again until someone moves it. Returns how many moved.
    pub async fn fire_due(&self, pool: &PgPool, limit: i64) -> Result<usize, OrchestratorError> {
        let saga_type = self.inner.definition.saga_type.as_str();
        let mut tx = pool.begin().await?;
        // Instances of a newer version are left to the orchestrators that have it (a rolling deploy).
        let newest = self.definitions().map(|d| d.version).max().unwrap_or(1);
        let newest = i32::try_from(newest).unwrap_or(i32::MAX);
        let now = self.inner.clock.offset_ms();
        let due = store::lock_due(&mut tx, saga_type, newest, now, limit).await?;
        let mut moved = 0;
        for instance in &due {
            let mut savepoint = sqlx::Connection::begin(&mut *tx).await?;
            match self.fire_one(&mut savepoint, instance).await {
                Ok(Fired::Moved) => {
                    savepoint.commit().await?;
                    moved += 1;
                }
                Ok(Fired::Stuck(reason)) => {
                    savepoint.commit().await?;
                    tracing::error!(saga = %instance.saga_id, %reason, "a saga is stuck; its timer is cleared");
                    store::mark_stuck(&mut tx, instance, &reason).await?;
                }
                Err(e) => {
                    savepoint.rollback().await?;
                    tracing::warn!(saga = %instance.saga_id, error = %e, "a saga's timer failed to fire; will retry");
                    store::timer_failed(&mut tx, instance, &e.to_string(), now).await?;
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
    ) -> Result<Fired, OrchestratorError> {
        let (def, state) = match self.read(instance) {
            Ok(read) => read,
            Err(
                e @ (OrchestratorError::UnknownVersion { .. }
                | OrchestratorError::Unreadable { .. }),
            ) => return Ok(Fired::Stuck(e.to_string())),
            Err(e) => return Err(e),
        };
        // Due because an operator asked for a retry, or because its deadline passed.
        let event = if instance.retry_requested_by.is_some() {
            SagaEvent::Retry
        } else {
            SagaEvent::Timeout
        };
        let Some(decision) = decide(def, &state, event).map_err(|r| refused(instance, r))? else {
            return Ok(Fired::Stuck(format!(
                "its deadline passed at step {} ({}), and version {} of {} has no move for it \
                 (a step removed from the definition without a new version?)",
                instance.step_index, instance.status, def.version, instance.saga_type
            )));
        };
        self.transition(conn, instance, def, &state, &decision, &instance.lineage()?)
            .await?;
        Ok(Fired::Moved)
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
        def: &SagaDefinition<D>,
        before: &SagaState<D>,
        decision: &Decision<D>,
        lineage: &Lineage,
    ) -> Result<(), OrchestratorError> {
        let table;
        let outbox = match &self.inner.outbox {
            Some(outbox) => outbox,
            None => {
                table = saga_consumer::Outbox::table();
                &table
            }
        };
        let data = serde_json::to_value(&decision.next.data).map_err(|e| {
            OrchestratorError::Unreadable {
                saga_id: instance.saga_id,
                reason: format!("the saga's data does not serialize: {e}"),
            }
        })?;
        let version = i32::try_from(def.version).unwrap_or(i32::MAX);
        let now = self.inner.clock.offset_ms();
        store::apply(
            conn, instance, decision, &data, version, now, lineage, outbox,
        )
        .await?;
        let change = SagaChange {
            instance,
            before,
            after: &decision.next,
            step: decision.step.as_deref(),
            cause: &decision.cause,
        };
        self.inner.hooks.transitioned(conn, &change).await?;
        tracing::info!(
            saga = %instance.saga_id,
            from = %instance.status,
            to = decision.next.status.as_str(),
            step = decision.step.as_deref().unwrap_or(""),
            cause = %decision.cause,
            version = def.version,
            "saga transition"
        );
        Ok(())
    }

    /// The consumer steps that deliver replies: `on-{step}` for each step's replies and
    /// `on-compensate-{step}` for each compensation's, on the definition's reply topic, for every version
    /// it runs (a step of several versions has one reply step, subscribed to all their replies). Each reply
    /// is deduplicated by its step key like any message, and decided on by the definition its instance
    /// runs. Registering them one by one leaves the reply topic not strict (an unknown reply type
    /// skipped): use [`Orchestrator::register`] or [`SagaServiceBuilder::with`], which declare it.
    pub fn reply_steps(&self) -> Vec<ReplyStep<D>> {
        let mut steps: Vec<ReplyStep<D>> = Vec::new();
        for def in self.definitions() {
            for (reply, name) in def.reply_routes() {
                let subscription = Subscription::new(&def.reply_topic, &reply);
                match steps.iter_mut().find(|s| s.name.as_str() == name) {
                    Some(existing) if existing.subscriptions.contains(&subscription) => {}
                    Some(existing) => existing.subscriptions.push(subscription),
                    None => steps.push(ReplyStep {
                        orchestrator: self.clone(),
                        // Checked when the orchestrator was built (`SagaDefinition::validate`): never
                        // replaced.
                        name: StepName::new(&name).expect(
                            "the orchestrator validated its definition's derived names when it was built",
                        ),
                        subscriptions: vec![subscription],
                    }),
                }
            }
        }
        steps
    }

    /// Registers the reply steps with a consumer (for a consumer run on its own; a `SagaService` takes
    /// the whole orchestrator with [`saga_consumer::SagaServiceBuilder::with`]).
    pub fn register(&self, mut builder: SagaConsumerBuilder) -> SagaConsumerBuilder {
        for step in self.reply_steps() {
            builder = builder.step(step);
        }
        // A reply type no version expects is a version this orchestrator does not have: a dead letter to
        // replay after the deploy, never skipped.
        for topic in self.reply_topics() {
            builder = builder.strict(topic);
        }
        builder
    }

    /// The reply topics of its definitions.
    fn reply_topics(&self) -> Vec<String> {
        let mut topics: Vec<String> = self.definitions().map(|d| d.reply_topic.clone()).collect();
        topics.sort();
        topics.dedup();
        topics
    }

    /// An instance of this saga type, by id, with its data read (`None` if there is none).
    pub async fn instance(
        &self,
        pool: &PgPool,
        saga_id: Uuid,
    ) -> Result<Option<(SagaInstance, D)>, OrchestratorError> {
        let Some(instance) = store::load(pool, saga_id).await? else {
            return Ok(None);
        };
        let (_, state) = self.read(&instance)?;
        Ok(Some((instance, state.data)))
    }
}

/// The saga's data as it is stored, checked to read back as `D`: a value JSON cannot hold (a NaN, which
/// becomes `null`) is refused before it is written, not found unreadable at the next transition.
fn stored_form<D: SagaData>(data: &D) -> Result<serde_json::Value, String> {
    let json = serde_json::to_value(data)
        .map_err(|e| format!("the saga's data does not serialize: {e}"))?;
    D::deserialize(&json).map_err(|e| {
        format!(
            "the saga's data would not read back after it is stored ({e}): a NaN or an infinity?"
        )
    })?;
    Ok(json)
}

/// The orchestrator's error for what the user's code refused.
fn refused(instance: &SagaInstance, refusal: Refusal) -> OrchestratorError {
    match refusal {
        Refusal::Reply(reason) => OrchestratorError::BadReply {
            saga_id: instance.saga_id,
            reason,
        },
        Refusal::Command(source) => OrchestratorError::BadCommand {
            saga_id: instance.saga_id,
            source,
        },
    }
}
/// Adds the orchestrator to a service: its reply steps, its tables, and its timers as a background task.
///
/// # Examples
///
/// ```no_run
/// # fn example<D: saga_orchestrator::SagaData>(orchestrator: saga_orchestrator::Orchestrator<D>, pool: saga_consumer::sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let service = saga_consumer::SagaService::builder()
///     .from_env()
///     .pool(pool)
///     .with(orchestrator)
///     .build()?;
/// # let _ = service; Ok(()) }
/// ```
impl<D: SagaData> Extension for Orchestrator<D> {
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
        for topic in this.reply_topics() {
            service = service.strict(topic);
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
pub struct ReplyStep<D> {
    orchestrator: Orchestrator<D>,
    name: StepName,
    subscriptions: Vec<Subscription>,
}

/// A reply's payload as it came: decoded by the reply type of the step it answers, once.
#[derive(Debug)]
pub struct RawReply(Vec<u8>);

impl saga_core::FromEvent for RawReply {
    fn from_event(_event_type: &str, payload: &[u8]) -> Result<Self, serde_json::Error> {
        Ok(Self(payload.to_vec()))
    }
}

impl<D: SagaData> SagaStep for ReplyStep<D> {
    type Payload = RawReply;

    fn name(&self) -> StepName {
        self.name.clone()
    }

    fn subscriptions(&self) -> Vec<Subscription> {
        self.subscriptions.clone()
    }

    async fn handle(&self, msg: &Message<RawReply>, ctx: &mut StepContext<'_>) -> StepResult {
        let moved = self
            .orchestrator
            .on_reply(ctx.conn(), msg.metadata(), &msg.payload().0)
            .await?;
        StepOutcome::completed_with(&serde_json::json!({ "moved": moved }))
    }
}
