//! # saga-testing
//!
//! A test kit for sagas built on `saga-consumer`: a team's services run in one test process, on
//! librdkafka's mock cluster (a Kafka-protocol broker inside the process, over TCP) and on a PostgreSQL
//! schema of their own per service, so that a test sends an event in, waits until the system is quiet,
//! and asserts on what happened.
//!
//! - [`SagaTest::service`]: a service of the test, built by the test's setup from [`ServiceSetup`] (its
//!   pool, a builder pointed at the mock cluster with quick settings, the test's clock).
//! - [`SagaTest::send`] an event in, or [`http::send`] a request to a service's routes.
//! - [`SagaTest::wait_quiet`]: until no message is in flight (every service's group has committed the end
//!   of every partition it reads), no outbox row is unpublished, no saga timer is due or failing, no held
//!   key is being released and every service runs. When the wait runs out it fails with [`Busy`], naming
//!   each [`Culprit`]: the service and what it still had to do. A dead letter the test did not announce
//!   ([`SagaTest::expect_dead_letters`]) fails it too: [`KitError::DeadLettered`].
//! - [`SagaTest::published`]: the events of one type on a topic ("one `PaymentProcessed` for order 7":
//!   [`Events::one`]); [`SagaTest::dead_letters`] of a service; [`SagaTest::sagas`], the orchestrator's
//!   instances and their states.
//! - Virtual time: [`SagaTest::advance`] moves the clock orchestrators set up with
//!   [`ServiceSetup::orchestrator`] run on; a one-hour timeout fires at once.
//! - Faults: [`faults`] (a step that fails its first N calls, before or after its handler), a crash before
//!   the offset commit ([`SagaTest::crash_before_offset_commit`]), duplicate deliveries
//!   ([`SagaTest::duplicate_deliveries`]).
//!
//! The services write their outbox as rows (the table outbox), which the quiet-wait reads; the retries of
//! a failing step are 5 to 20 ms apart, three attempts before a dead letter.
//!
//! # Examples
//!
//! ```no_run
//! use saga_consumer::{Message, SagaEvent, StepContext, StepOutcome, StepResult, Topic, step_with};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Debug, Serialize, Deserialize, SagaEvent)]
//! struct OrderPlaced { order: i64 }
//! #[derive(Debug, Serialize, Deserialize, SagaEvent)]
//! struct PaymentTaken { order: i64 }
//!
//! async fn take_payment(msg: &Message<OrderPlaced>, ctx: &mut StepContext<'_>, out: &Topic<PaymentTaken>) -> StepResult {
//!     let order = msg.payload().order;
//!     ctx.emit(out, order.to_string(), &PaymentTaken { order })?;
//!     Ok(StepOutcome::completed())
//! }
//!
//! # async fn example() -> Result<(), saga_testing::KitError> {
//! let mut test = saga_testing::SagaTest::start("payments").await?;
//! let (orders, payments) = (test.topic::<OrderPlaced>("orders"), test.topic::<PaymentTaken>("payments"));
//! let (input, out) = (orders.clone(), payments.clone());
//! test.service("payment", move |s| {
//!     s.builder().step(step_with("take-payment", out.clone(), take_payment).on(&input))
//! }).await?;
//! test.send(&orders, "order-7", &OrderPlaced { order: 7 }).await?;
//! test.crash_before_offset_commit("payment").await?; // delivered again: still one payment
//! test.wait_quiet().await?;
//! test.published(&payments).await?.one(|p| p.order == 7);
//! test.stop().await
//! # }
//! ```

#![deny(missing_docs)]

/// The guide's page on the kit, compiled as a doc test so that it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/testing.md")]
mod guide {}

mod cluster;
#[doc(hidden)]
pub mod duplicate;
mod error;
pub mod faults;
pub mod http;
mod mock;
mod published;
mod quiet;
mod service;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use saga_consumer::settings::ServiceArgs;
use saga_consumer::{
    IdempotencyKey, KafkaConfig, Lineage, OutboxMessage, SagaEvent, SagaServiceBuilder, TenantId,
    Topic,
};
use saga_orchestrator::{SagaInstance, SagaStatus};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

pub use error::{BoxError, KitError};
pub use published::{DeadLetter, Events};
pub use quiet::{Busy, Culprit};
pub use saga_orchestrator::SagaClock;
pub use service::ServiceSetup;

/// A saga instance as a test reads it ([`SagaTest::saga`]): its status typed and its data as the
/// definition's type.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Saga<D> {
    /// Its id.
    pub id: uuid::Uuid,
    /// Where it stands.
    pub status: SagaStatus,
    /// Its data.
    pub data: D,
    /// Why it compensates, if it does.
    pub failure: Option<String>,
    /// The instance as stored (its type, tenant, step, version, ...).
    pub instance: SagaInstance,
}

use cluster::{Cluster, Position};
use duplicate::Duplicator;
use service::{Running, drop_schemas};

/// The database the kit uses when `DATABASE_URL` is unset.
const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// How long [`SagaTest::wait_quiet`] waits by default.
const QUIET_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a service may take to be ready (its migrations applied, its partitions assigned).
const READY: Duration = Duration::from_secs(30);

/// One test's system: the mock cluster, the services, their schemas, the clock.
pub struct SagaTest {
    // Dropped first: the services are told to stop before their broker goes.
    services: Vec<Running>,
    name: String,
    database_url: String,
    cluster: Cluster,
    clock: SagaClock,
    duplicator: Option<(Duplicator, CancellationToken)>,
    quiet_timeout: Duration,
    /// Whether [`SagaTest::stop`] ran (else dropping the test drops its schemas).
    stopped: bool,
}

impl std::fmt::Debug for SagaTest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the database URL: it may hold a password.
        f.debug_struct("SagaTest")
            .field("name", &self.name)
            .field("brokers", &self.cluster.brokers())
            .field("services", &self.services)
            .finish_non_exhaustive()
    }
}

impl Drop for SagaTest {
    fn drop(&mut self) {
        if let Some((_, stop)) = self.duplicator.take() {
            stop.cancel();
        }
        if self.stopped || self.services.is_empty() {
            return;
        }
        for running in &mut self.services {
            running.abort();
        }
        let schemas: Vec<String> = self
            .services
            .iter()
            .map(|s| s.setup.schema().to_owned())
            .collect();
        if std::thread::panicking() {
            // A failed test's schemas are kept to be looked at.
            eprintln!(
                "saga-testing: the test failed; its schemas are kept: {}",
                schemas.join(", ")
            );
            return;
        }
        // A test that forgot `stop`: its schemas are dropped here, on a runtime of their own, since a drop
        // cannot await.
        let url = self.database_url.clone();
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(KitError::Runtime)?;
            runtime.block_on(drop_schemas(&url, &schemas))
        })
        .join();
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("saga-testing: dropping the schemas of {}: {e}", self.name),
            Err(_) => eprintln!(
                "saga-testing: dropping the schemas of {} panicked",
                self.name
            ),
        }
    }
}

impl SagaTest {
    /// Starts a test named `name` (its topics and schemas are named after it, made unique) on a new mock
    /// cluster, with topics of three partitions, on the PostgreSQL at `DATABASE_URL` (default
    /// `postgres://postgres@127.0.0.1:5432/postgres`).
    pub async fn start(name: &str) -> Result<Self, KitError> {
        Self::start_with(name, std::env::var("DATABASE_URL").ok(), 3).await
    }

    /// Like [`SagaTest::start`], on the PostgreSQL at `database_url` (`None`: `DATABASE_URL`, then the
    /// default), with topics of `partitions` partitions.
    pub async fn start_with(
        name: &str,
        database_url: Option<String>,
        partitions: i32,
    ) -> Result<Self, KitError> {
        let database_url = database_url
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned());
        // Checked here, so that a wrong URL is one clear error before anything else.
        saga_consumer::setup::connect_postgres("DATABASE_URL", &database_url, None, 1)
            .await?
            .close()
            .await;
        Ok(Self {
            services: Vec::new(),
            name: unique(name),
            database_url,
            cluster: Cluster::start(partitions)?,
            clock: SagaClock::manual(),
            duplicator: None,
            quiet_timeout: QUIET_TIMEOUT,
            stopped: false,
        })
    }

    /// The test's unique name: its topics' and schemas' prefix.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The topic `{name}.{suffix}` of this test.
    pub fn topic<E>(&self, suffix: &str) -> Topic<E> {
        Topic::new(format!("{}.{suffix}", self.name))
    }

    /// Creates topic `name` (with the test's partition count) unless it exists: a topic only the test
    /// reads, say. The topics services read, and their dead-letter topics, are made when they start.
    pub fn create_topic(&self, name: &str) -> Result<(), KitError> {
        self.cluster.create_topic(name)
    }

    /// The mock cluster's `bootstrap.servers`.
    pub fn brokers(&self) -> &str {
        self.cluster.brokers()
    }

    /// The test's clock: orchestrators set up with [`ServiceSetup::orchestrator`] run on it.
    pub fn clock(&self) -> &SagaClock {
        &self.clock
    }

    /// Moves the test's clock forward by `by`: saga timers that fall within it are due at once (and fire
    /// within milliseconds; [`SagaTest::wait_quiet`] waits for them).
    pub fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }

    /// How long [`SagaTest::wait_quiet`] waits (30 s unless changed).
    pub fn set_quiet_timeout(&mut self, timeout: Duration) {
        self.quiet_timeout = timeout;
    }

    /// Starts service `name`: the kit makes its schema and pool, calls `setup` with them
    /// ([`ServiceSetup::builder`] is a builder pointed at the mock cluster), creates the topics the service
    /// reads and its dead-letter topic, runs it, and waits until it is ready. `setup` is called again when
    /// the service starts again after [`SagaTest::crash_before_offset_commit`].
    pub async fn service<F>(&mut self, name: &str, setup: F) -> Result<(), KitError>
    where
        F: Fn(&ServiceSetup) -> SagaServiceBuilder + Send + Sync + 'static,
    {
        self.service_async(name, move |s| {
            let builder = setup(&s);
            async move { Ok::<_, BoxError>(builder) }
        })
        .await
    }

    /// Like [`SagaTest::service`], for a setup that awaits (a pool of its own, say) or fails.
    pub async fn service_async<F, Fut, E>(&mut self, name: &str, setup: F) -> Result<(), KitError>
    where
        F: Fn(ServiceSetup) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<SagaServiceBuilder, E>> + Send + 'static,
        E: Into<BoxError>,
    {
        let valid = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_';
        if name.is_empty() || name.len() > 20 || !name.chars().all(valid) {
            return Err(KitError::BadServiceName(name.to_owned()));
        }
        // `a-b` and `a_b` would share a schema.
        let schema = format!("{}_{}", self.name, name.replace('-', "_"));
        if self.services.iter().any(|s| s.setup.schema() == schema) {
            return Err(KitError::DuplicateService(name.to_owned()));
        }
        let make: service::Setup = Arc::new(move |s| {
            let built = setup(s);
            let built: futures::future::BoxFuture<'static, _> =
                Box::pin(async move { built.await.map_err(Into::into) });
            built
        });
        let running = Running::start(
            name,
            schema,
            self.args(name),
            self.clock.clone(),
            &self.cluster,
            make,
        )
        .await?;
        self.services.push(running);
        self.ready(name).await
    }

    /// The framework's settings of service `name` in this test: see [`ServiceSetup::args`].
    fn args(&self, name: &str) -> ServiceArgs {
        let mut args = ServiceArgs::default();
        args.database.database_url = Some(self.database_url.clone());
        args.kafka.brokers = Some(self.cluster.brokers().to_owned());
        args.consumer.group_id = Some(format!("{}.{name}", self.name));
        args.consumer.commit_interval = Duration::from_millis(20);
        args.consumer.retry.max_attempts = 3;
        args.consumer.retry.initial_backoff = Duration::from_millis(5);
        args.consumer.retry.max_backoff = Duration::from_millis(20);
        args.consumer.shutdown_timeout = Duration::from_secs(10);
        args.consumer.session_timeout = crate::service::SESSION_TIMEOUT;
        args.relay.poll_interval = Duration::from_millis(20);
        // The mock cluster keeps no topic configuration for the service to check its key retention against.
        args.accept_key_expiry = true;
        args.create_topics = None;
        args
    }

    /// Waits until service `name` is ready, or fails saying why it is not.
    async fn ready(&mut self, name: &str) -> Result<(), KitError> {
        let started = Instant::now();
        loop {
            let running = find_mut(&mut self.services, name)?;
            if let Some(reason) = running.stopped().await {
                return Err(KitError::Service {
                    service: name.to_owned(),
                    error: reason.into(),
                });
            }
            if running.is_ready() {
                return Ok(());
            }
            if started.elapsed() > READY {
                return Err(KitError::Service {
                    service: name.to_owned(),
                    error: format!("not ready within {READY:?}").into(),
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn service_ref(&self, name: &str) -> Result<&Running, KitError> {
        self.services
            .iter()
            .find(|s| s.setup.name() == name)
            .ok_or_else(|| KitError::NoService(name.to_owned()))
    }

    /// The pool on service `name`'s schema, to read its tables.
    pub fn pool(&self, service: &str) -> Result<&PgPool, KitError> {
        Ok(self.service_ref(service)?.setup.pool())
    }

    /// Sends `event` to `topic` as a saga's client would: keyed by `key`, which is also its idempotency key,
    /// in the default tenant. Returns its partition and offset.
    pub async fn send<E: SagaEvent>(
        &self,
        topic: &Topic<E>,
        key: &str,
        event: &E,
    ) -> Result<(i32, i64), KitError> {
        let idempotency =
            IdempotencyKey::new(key).map_err(|e| KitError::Event(saga_consumer::Cause::new(e)))?;
        self.send_in(
            topic,
            key,
            event,
            &Lineage::root(idempotency, TenantId::default()),
        )
        .await
    }

    /// Sends `event` to `topic`, keyed by `key`, within `lineage` (its idempotency key, tenant and
    /// correlation). Returns its partition and offset.
    pub async fn send_in<E: SagaEvent>(
        &self,
        topic: &Topic<E>,
        key: &str,
        event: &E,
        lineage: &Lineage,
    ) -> Result<(i32, i64), KitError> {
        let event = saga_consumer::Event::of(topic, key, event)
            .map_err(|e| KitError::Event(saga_consumer::Cause::new(e)))?;
        let message = OutboxMessage::from_event(event, lineage, &self.name);
        self.cluster
            .produce(
                &message.topic,
                message.partition_key.as_deref(),
                &message.header_list(),
                Some(&message.payload),
            )
            .await
    }

    /// Waits until the system is quiet (see the [crate] documentation), or fails with [`KitError::Busy`]
    /// naming what was still busy after the quiet timeout ([`SagaTest::set_quiet_timeout`]); once quiet,
    /// fails with [`KitError::DeadLettered`] when a service dead-lettered more messages than the test
    /// expects ([`SagaTest::expect_dead_letters`]).
    pub async fn wait_quiet(&mut self) -> Result<(), KitError> {
        self.wait_quiet_for(self.quiet_timeout).await
    }

    /// Like [`SagaTest::wait_quiet`], waiting at most `timeout`.
    pub async fn wait_quiet_for(&mut self, timeout: Duration) -> Result<(), KitError> {
        let started = Instant::now();
        loop {
            let before = self.positions().await?;
            let mut culprits = Vec::new();
            for running in &mut self.services {
                if let Some(reason) = running.stopped().await {
                    culprits.push(Culprit::Stopped {
                        service: running.setup.name().to_owned(),
                        reason,
                    });
                }
            }
            for (owner, positions) in &before {
                culprits.extend(quiet::unconsumed(owner.as_deref(), positions));
            }
            let advanced_ms = i64::try_from(self.clock.advanced().as_millis()).unwrap_or(i64::MAX);
            for running in &self.services {
                let (name, pool) = (running.setup.name(), running.setup.pool());
                // Timers first: a timer that fires after this read leaves its command in the outbox (read
                // next) or, published already, at a partition's end (read last).
                culprits.extend(quiet::timers(name, pool, advanced_ms).await?);
                culprits.extend(quiet::outbox(name, pool).await?);
                culprits.extend(quiet::releasing(name, &running.group, pool).await?);
            }
            // Quiet, and nothing moved while the outbox and the timers were read: a row published
            // meanwhile, or a timer that fired, shows as a partition's end that moved.
            if culprits.is_empty() && self.positions().await? == before {
                return self.no_unexpected_letters().await;
            }
            if started.elapsed() >= timeout {
                return Err(KitError::Busy(Busy {
                    waited_ms: started.elapsed().as_millis(),
                    culprits,
                }));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Fails with [`KitError::DeadLettered`] when a service dead-lettered more than the test expects.
    async fn no_unexpected_letters(&self) -> Result<(), KitError> {
        for running in &self.services {
            let expected = running.letters_expected;
            // Counted first (cheap); read only when there are more than expected (a dead-letter topic
            // two services share holds the other's letters too).
            if self.cluster.count(&running.dlq).await?
                <= i64::try_from(expected).unwrap_or(i64::MAX)
            {
                continue;
            }
            let letters = self.letters_once(running).await?;
            if letters.len() > expected {
                return Err(KitError::DeadLettered {
                    service: running.setup.name().to_owned(),
                    expected,
                    letters,
                });
            }
        }
        Ok(())
    }

    /// A service's letters, one per message it gave up on: the letter of a redelivery (after a crash) and
    /// that of a copy the kit made ([`SagaTest::duplicate_deliveries`]) count with their message's.
    async fn letters_once(&self, running: &Running) -> Result<Vec<DeadLetter>, KitError> {
        let raw = self.cluster.read(&running.dlq).await?;
        let mut seen = std::collections::HashSet::new();
        Ok(raw
            .iter()
            .filter(|m| {
                let copy = m.headers.get_str(duplicate::COPY_HEADER);
                copy.ok().flatten().is_none()
            })
            .filter_map(|m| DeadLetter::read(m, &running.group))
            .filter(|l| seen.insert((l.topic.clone(), l.partition, l.offset)))
            .collect())
    }

    /// Where every service's group (and the duplicator's, `None`) stands.
    async fn positions(&self) -> Result<Vec<(Option<String>, Positions)>, KitError> {
        let mut all = Vec::new();
        for running in &self.services {
            let positions = self
                .cluster
                .positions(&running.group, &running.topics)
                .await?;
            all.push((Some(running.setup.name().to_owned()), positions));
        }
        if let Some((duplicator, _)) = &self.duplicator {
            let positions = self
                .cluster
                .positions(duplicator.group(), duplicator.topics())
                .await?;
            all.push((None, positions));
        }
        Ok(all)
    }

    /// The events of type `E` published to `topic` so far (messages of other types there are skipped).
    pub async fn published<E: SagaEvent>(&self, topic: &Topic<E>) -> Result<Events<E>, KitError> {
        let raw = self.cluster.read(topic.name()).await?;
        Events::decode(topic.name(), &raw)
    }

    /// Says that service `service` is expected to dead-letter `count` more messages in this test.
    ///
    /// [`SagaTest::wait_quiet`] fails with [`KitError::DeadLettered`] (the letters, with their reasons and
    /// errors) when a service gave up on more messages than the test expects, so that a step that rejects
    /// what it should handle fails its test even when every assertion on rows and events holds. A test
    /// that sends a poison message says so first. Messages are counted, not letters: one dead-lettered
    /// again after [`SagaTest::crash_before_offset_commit`], or a copy of it the kit made
    /// ([`SagaTest::duplicate_deliveries`]), counts once.
    pub fn expect_dead_letters(&mut self, service: &str, count: usize) -> Result<(), KitError> {
        let running = find_mut(&mut self.services, service)?;
        running.letters_expected = running.letters_expected.saturating_add(count);
        Ok(())
    }

    /// What service `service` dead-lettered so far.
    pub async fn dead_letters(&self, service: &str) -> Result<Vec<DeadLetter>, KitError> {
        let running = self.service_ref(service)?;
        let raw = self.cluster.read(&running.dlq).await?;
        Ok(raw
            .iter()
            .filter_map(|m| DeadLetter::read(m, &running.group))
            .collect())
    }

    /// The saga instances service `service` orchestrates (its `saga_instances`), the longest unchanged
    /// first; `status` says where each stands.
    pub async fn sagas(&self, service: &str) -> Result<Vec<SagaInstance>, KitError> {
        let pool = self.pool(service)?;
        let filter = saga_orchestrator::store::SagaFilter::default().limit(10_000);
        Ok(saga_orchestrator::store::list(pool, &filter).await?)
    }

    /// The saga that client key `key` started in service `service`, its data read as `D` (the definition's
    /// data type) and its status typed; `None` if there is none. A key that started sagas of several types
    /// or tenants there is refused (read them with [`SagaTest::sagas`]).
    ///
    /// ```no_run
    /// # async fn t(test: &saga_testing::SagaTest) -> Result<(), saga_testing::KitError> {
    /// # #[derive(serde::Deserialize)] struct Order { charge_id: Option<String> }
    /// let saga = test.saga::<Order>("orders", "order-1").await?.expect("the saga started");
    /// assert_eq!(saga.status, saga_orchestrator::SagaStatus::Completed);
    /// assert!(saga.data.charge_id.is_some());
    /// # Ok(()) }
    /// ```
    pub async fn saga<D: serde::de::DeserializeOwned>(
        &self,
        service: &str,
        key: &str,
    ) -> Result<Option<Saga<D>>, KitError> {
        let mut of_key: Vec<SagaInstance> = self
            .sagas(service)
            .await?
            .into_iter()
            .filter(|i| i.idempotency_key == key)
            .collect();
        let instance = match of_key.len() {
            0 => return Ok(None),
            1 => of_key.remove(0),
            n => {
                return Err(KitError::Unsupported(format!(
                    "key {key:?} started {n} sagas in {service} (types and tenants: {}): read them with sagas()",
                    of_key
                        .iter()
                        .map(|i| format!("{}/{}", i.saga_type, i.tenant))
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        };
        let unreadable = |error: String| KitError::SagaUnreadable {
            saga_id: instance.saga_id,
            key: key.to_owned(),
            error,
        };
        let status = SagaStatus::parse(&instance.status)
            .ok_or_else(|| unreadable(format!("its status {:?} is no status", instance.status)))?;
        let data = serde_json::from_value::<D>(instance.data.clone()).map_err(|e| {
            unreadable(format!(
                "its data does not read as {}: {e}",
                std::any::type_name::<D>()
            ))
        })?;
        Ok(Some(Saga {
            id: instance.saga_id,
            status,
            data,
            failure: instance.failure.clone(),
            instance,
        }))
    }

    /// Every message of the topics named `topics` is delivered twice: the kit produces a copy of each (same
    /// key, headers and payload, and a header of its own, `x-saga-duplicate`), as a producer's retry
    /// would; those already there are copied too. The quiet-wait includes the copying, and
    /// [`SagaTest::published`] leaves the copies out. Call it once, with every topic to duplicate: a second
    /// call is refused.
    pub fn duplicate_deliveries(&mut self, topics: &[&str]) -> Result<(), KitError> {
        if self.duplicator.is_some() {
            return Err(KitError::Unsupported(
                "duplicate_deliveries was called already: call it once, with every topic to duplicate"
                    .to_owned(),
            ));
        }
        for topic in topics {
            self.cluster.create_topic(topic)?;
        }
        let stop = CancellationToken::new();
        let duplicator = Duplicator::start(
            &KafkaConfig::new(self.cluster.brokers()),
            &format!("{}.duplicator", self.name),
            topics,
            stop.clone().cancelled_owned(),
        )?;
        self.duplicator = Some((duplicator, stop));
        Ok(())
    }

    /// How many copies the duplicator made so far.
    pub fn duplicates(&self) -> u64 {
        self.duplicator.as_ref().map_or(0, |(d, _)| d.copies())
    }

    /// Simulates a crash of service `service` after its database commits and before its offset commits.
    /// It first waits until the system is quiet (failing as [`SagaTest::wait_quiet`] does if it is not),
    /// then stops the service, moves its group's committed offsets back to the start of every partition it
    /// reads (as if none of its offset commits had reached the broker), and starts it again from its
    /// setup. Every message it consumed is delivered again. Returns how many.
    pub async fn crash_before_offset_commit(&mut self, service: &str) -> Result<i64, KitError> {
        // Whatever it was in, it finishes first: the crash is of the offsets, not of a transaction.
        self.wait_quiet().await?;
        let running = find_mut(&mut self.services, service)?;
        running.stop().await?;
        let rewound = self.cluster.rewind(&running.group, &running.topics).await;
        // Started again whatever happened: a failed rewind is reported, not a service left stopped.
        running.run(&self.cluster).await?;
        self.ready(service).await?;
        rewound
    }

    /// The ops handle of service `service` (its metrics and readiness, as `/metrics` and `/readyz` serve
    /// them): `saga_consumer_duplicates_total` counts the redeliveries it skipped since it last started.
    pub fn ops(&self, service: &str) -> Result<saga_consumer::OpsHandle, KitError> {
        self.service_ref(service)?
            .ops()
            .ok_or_else(|| KitError::NoService(service.to_owned()))
    }

    /// Stops every service (each must stop cleanly) and drops their schemas.
    pub async fn stop(mut self) -> Result<(), KitError> {
        self.stopped = true;
        if let Some((_, stop)) = self.duplicator.take() {
            stop.cancel();
        }
        let mut first_error = None;
        for running in &mut self.services {
            if let Err(e) = running.stop().await {
                first_error.get_or_insert(e);
            }
        }
        let schemas: Vec<String> = self
            .services
            .iter()
            .map(|s| s.setup.schema().to_owned())
            .collect();
        if let Err(e) = drop_schemas(&self.database_url, &schemas).await {
            first_error.get_or_insert(e);
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// The service named `name` among `services` (a function of the field, so that the cluster can be borrowed
/// beside it).
fn find_mut<'a>(services: &'a mut [Running], name: &str) -> Result<&'a mut Running, KitError> {
    services
        .iter_mut()
        .find(|s| s.setup.name() == name)
        .ok_or_else(|| KitError::NoService(name.to_owned()))
}

/// A group's positions on its topics' partitions.
type Positions = BTreeMap<(String, i32), Position>;

/// `name`, lower-cased to what a schema and a topic accept, and made unique to this process and moment.
fn unique(name: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let clean: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(10)
        .collect();
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    // At most 41 bytes: with `_` and a service name of 20, a schema name within PostgreSQL's 63.
    format!(
        "sagakit_{clean}_{millis:x}_{:x}_{:x}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}
