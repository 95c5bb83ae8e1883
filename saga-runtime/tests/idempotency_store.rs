//! The idempotency store against a real PostgreSQL.

use std::sync::Arc;
use std::time::{Duration, Instant};

use saga_core::{IdempotencyKey, StepKey, StepName, StepOutcome, TenantId};
use saga_runtime::store::idempotency::{
    self, Claim, KeyStatus, LeaseClaim, NewClaims, StoreError, claim_in_transaction, claim_lease,
    claim_new_in_transaction, complete_lease, record_outcomes, release_lease,
};
use saga_test_support::TestDb;
use sqlx::Connection;

fn key(original: &str, step: &str) -> StepKey {
    IdempotencyKey::new(original)
        .unwrap()
        .step_key(&StepName::new(step).unwrap())
}

fn tenant(name: &str) -> TenantId {
    TenantId::new(name).unwrap()
}

async fn effects_table(db: &TestDb) {
    sqlx::query("CREATE TABLE effects (step_key TEXT NOT NULL, worker INT NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_concurrent_claims_of_one_key_produce_one_effect() {
    let db = TestDb::new("store-concurrent").await;
    effects_table(&db).await;
    let step_key = key("order-1", "process-payment");
    let t = tenant("acme");
    // Every claimant holds a transaction (a connection) while it waits at the barrier.
    let pool = db.pool_of(24).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(20));
    let mut workers = Vec::new();
    for worker in 0..20 {
        let (pool, step_key, t, barrier) =
            (pool.clone(), step_key.clone(), t.clone(), barrier.clone());
        workers.push(tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            barrier.wait().await;
            let claim = claim_in_transaction(&mut tx, &[(t, step_key.clone())])
                .await
                .unwrap()
                .remove(0);
            if claim == Claim::New {
                sqlx::query("INSERT INTO effects VALUES ($1, $2)")
                    .bind(step_key.as_str())
                    .bind(worker)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                // Hold the claim a while so that the others queue up behind it.
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            tx.commit().await.unwrap();
            claim
        }));
    }
    let mut new = 0;
    let mut duplicates = 0;
    for w in workers {
        match w.await.unwrap() {
            Claim::New => new += 1,
            Claim::Duplicate(stored) => {
                assert_eq!(stored.status, KeyStatus::Completed);
                duplicates += 1;
            }
            other => panic!("unexpected claim {other:?}"),
        }
    }
    assert_eq!((new, duplicates), (1, 19));
    assert_eq!(db.count("effects").await, 1);
    assert_eq!(db.count("saga_idempotency_keys").await, 1);
}

#[tokio::test]
async fn a_rollback_releases_the_key() {
    let db = TestDb::new("store-rollback").await;
    let k = key("order-2", "arrange-shipment");
    let t = tenant("acme");
    let mut tx = db.pool.begin().await.unwrap();
    let claims = claim_in_transaction(&mut tx, &[(t.clone(), k.clone())])
        .await
        .unwrap();
    assert_eq!(claims, vec![Claim::New]);
    tx.rollback().await.unwrap();
    assert_eq!(db.count("saga_idempotency_keys").await, 0);

    let mut tx = db.pool.begin().await.unwrap();
    let claims = claim_in_transaction(&mut tx, &[(t.clone(), k.clone())])
        .await
        .unwrap();
    assert_eq!(
        claims,
        vec![Claim::New],
        "the key is free again after the rollback"
    );
    tx.commit().await.unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    let claims = claim_in_transaction(&mut tx, &[(t, k)]).await.unwrap();
    assert!(matches!(claims[0], Claim::Duplicate(_)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claiming_keys_as_new_writes_them_completed_and_reports_an_existing_one() {
    let db = TestDb::new("store-claim-new").await;
    let t = tenant("acme");
    let (a, b, c) = (key("n-1", "s"), key("n-2", "s"), key("n-3", "s"));
    let mut tx = db.pool.begin().await.unwrap();
    let claimed =
        claim_new_in_transaction(&mut tx, &[(t.clone(), a.clone()), (t.clone(), b.clone())])
            .await
            .unwrap();
    assert_eq!(claimed, NewClaims::Claimed);
    tx.commit().await.unwrap();
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT step_key, status FROM saga_idempotency_keys ORDER BY step_key")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        rows,
        vec![
            (a.to_string(), "completed".to_owned()),
            (b.to_string(), "completed".to_owned())
        ]
    );
    // The checking claim sees them as a duplicate.
    let mut tx = db.pool.begin().await.unwrap();
    let claims = claim_in_transaction(&mut tx, &[(t.clone(), a.clone())])
        .await
        .unwrap();
    assert!(matches!(claims[0], Claim::Duplicate(_)), "{claims:?}");
    tx.rollback().await.unwrap();

    // One existing key among new ones: reported, and the transaction keeps nothing.
    let mut tx = db.pool.begin().await.unwrap();
    let claimed =
        claim_new_in_transaction(&mut tx, &[(t.clone(), c.clone()), (t.clone(), b.clone())])
            .await
            .unwrap();
    assert_eq!(claimed, NewClaims::SomeExist);
    tx.rollback().await.unwrap();
    assert_eq!(db.count("saga_idempotency_keys").await, 2);

    // A key another transaction holds uncommitted is waited for, then reported once that one commits.
    let mut first = db.pool.begin().await.unwrap();
    claim_in_transaction(&mut first, &[(t.clone(), c.clone())])
        .await
        .unwrap();
    let pool = db.pool.clone();
    let (t2, c2, d) = (t.clone(), c.clone(), key("n-4", "s"));
    let second = tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        let claimed = claim_new_in_transaction(&mut tx, &[(t2.clone(), d), (t2, c2)])
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        claimed
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !second.is_finished(),
        "the second claim waits for the first transaction"
    );
    first.commit().await.unwrap();
    assert_eq!(second.await.unwrap(), NewClaims::SomeExist);
    assert_eq!(db.count("saga_idempotency_keys").await, 3);
}

#[tokio::test]
async fn outcomes_are_stored_and_replayed_to_duplicates() {
    let db = TestDb::new("store-outcomes").await;
    let t = tenant("acme");
    let (done, rejected, plain) = (key("o", "a"), key("o", "b"), key("o", "c"));
    let keys = vec![
        (t.clone(), done.clone()),
        (t.clone(), rejected.clone()),
        (t.clone(), plain.clone()),
    ];
    let mut tx = db.pool.begin().await.unwrap();
    assert_eq!(
        claim_in_transaction(&mut tx, &keys).await.unwrap(),
        vec![Claim::New; 3]
    );
    let completed = StepOutcome::Completed {
        result: Some(serde_json::json!({"payment_id": 7})),
    };
    let declined = StepOutcome::rejected("card declined");
    let plain_outcome = StepOutcome::completed();
    record_outcomes(
        &mut tx,
        &[
            (&t, &done, &completed),
            (&t, &rejected, &declined),
            (&t, &plain, &plain_outcome),
        ],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    let claims = claim_in_transaction(&mut tx, &keys).await.unwrap();
    let Claim::Duplicate(a) = &claims[0] else {
        panic!("{claims:?}")
    };
    assert_eq!(a.status, KeyStatus::Completed);
    assert_eq!(a.outcome, Some(serde_json::json!({"payment_id": 7})));
    let Claim::Duplicate(b) = &claims[1] else {
        panic!("{claims:?}")
    };
    assert_eq!(b.status, KeyStatus::Failed);
    assert_eq!(b.error.as_deref(), Some("card declined"));
    let Claim::Duplicate(c) = &claims[2] else {
        panic!("{claims:?}")
    };
    assert_eq!((c.status, c.outcome.clone()), (KeyStatus::Completed, None));
}

#[tokio::test]
async fn keys_of_two_tenants_are_isolated() {
    let db = TestDb::new("store-tenants").await;
    let k = key("same-client-key", "process-payment");
    let (acme, globex) = (tenant("acme"), tenant("globex"));

    let mut tx = db.pool.begin().await.unwrap();
    claim_in_transaction(&mut tx, &[(acme.clone(), k.clone())])
        .await
        .unwrap();
    record_outcomes(
        &mut tx,
        &[(
            &acme,
            &k,
            &StepOutcome::Completed {
                result: Some(serde_json::json!("acme's secret")),
            },
        )],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    let claims = claim_in_transaction(&mut tx, &[(globex.clone(), k.clone())])
        .await
        .unwrap();
    assert_eq!(
        claims,
        vec![Claim::New],
        "another tenant's key does not collide"
    );
    tx.commit().await.unwrap();

    let mut conn = db.pool.acquire().await.unwrap();
    let globex_record = idempotency::lookup(&mut conn, &globex, &k)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(globex_record.outcome, None, "and never sees its outcome");
    let acme_record = idempotency::lookup(&mut conn, &acme, &k)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        acme_record.outcome,
        Some(serde_json::json!("acme's secret"))
    );

    // A key's own step keys, exactly: not those of a longer key it prefixes with ':'.
    let longer = key("same-client-key:order-7", "process-payment");
    let mut tx = db.pool.begin().await.unwrap();
    claim_in_transaction(&mut tx, &[(acme.clone(), longer)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let all: Vec<String> = idempotency::keys_of(&mut conn, "same-client-key", None, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.step_key)
        .collect();
    assert_eq!(
        all,
        [k.as_str(), k.as_str()],
        "acme's and globex's, not the longer key's"
    );
    let acme_only = idempotency::keys_of(&mut conn, "same-client-key", Some(&acme), 10)
        .await
        .unwrap();
    assert_eq!(acme_only.len(), 1);
    // At most `limit`, the first by tenant.
    let first = idempotency::keys_of(&mut conn, "same-client-key", None, 1)
        .await
        .unwrap();
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].tenant, "acme");
}

#[tokio::test]
async fn an_expired_lease_is_taken_over_and_the_old_owner_is_fenced() {
    let db = TestDb::new("store-lease").await;
    let (t, k) = (tenant("acme"), key("order-3", "process-payment"));
    let mut conn = db.pool.acquire().await.unwrap();

    let first = acquire(
        &mut conn,
        &t,
        &k,
        Duration::from_millis(300),
        "the first claim gets the lease",
    )
    .await;
    assert_eq!(first.attempt, 1);

    // A live lease makes a second worker wait, not fail.
    let busy = claim_lease(&mut conn, &t, &k, Duration::from_secs(30), "worker@test/1")
        .await
        .unwrap();
    assert!(matches!(busy, LeaseClaim::Busy { until } if until == first.expires_at));

    tokio::time::sleep(Duration::from_millis(400)).await;
    let second = acquire(
        &mut conn,
        &t,
        &k,
        Duration::from_secs(30),
        "an expired lease is taken over",
    )
    .await;
    assert_eq!(second.attempt, 2);

    // The first worker comes back and tries to complete: fenced, and its writes roll back.
    let mut tx = db.pool.begin().await.unwrap();
    let err = complete_lease(&mut tx, &first, &StepOutcome::completed())
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::Fenced { attempt: 1, .. }),
        "{err}"
    );
    tx.rollback().await.unwrap();
    assert!(
        !release_lease(&mut conn, &first, "late").await.unwrap(),
        "a fenced worker cannot release the new owner's lease either"
    );

    let mut tx = db.pool.begin().await.unwrap();
    complete_lease(
        &mut tx,
        &second,
        &StepOutcome::Completed {
            result: Some(serde_json::json!({"charge": "ch_1"})),
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();

    let record = idempotency::lookup(&mut conn, &t, &k)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.status, KeyStatus::Completed);
    assert_eq!(record.attempts, 2);
    assert_eq!(record.lease_expires_at, None);
    let again = claim_lease(&mut conn, &t, &k, Duration::from_secs(30), "worker@test/1")
        .await
        .unwrap();
    assert!(
        matches!(&again, LeaseClaim::Duplicate(s) if s.outcome == Some(serde_json::json!({"charge": "ch_1"}))),
        "{again:?}"
    );
}

#[tokio::test]
async fn a_released_lease_is_retaken_at_once() {
    let db = TestDb::new("store-release").await;
    let (t, k) = (tenant("acme"), key("order-4", "process-payment"));
    let mut conn = db.pool.acquire().await.unwrap();
    let first = acquire(
        &mut conn,
        &t,
        &k,
        Duration::from_secs(60),
        "the lease is free",
    )
    .await;
    assert!(
        release_lease(&mut conn, &first, "gateway timeout")
            .await
            .unwrap()
    );
    let second = acquire(
        &mut conn,
        &t,
        &k,
        Duration::from_secs(60),
        "a released lease is free",
    )
    .await;
    assert_eq!(second.attempt, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_transactional_claim_waits_for_the_first_and_wins_if_it_rolls_back() {
    let db = TestDb::new("store-wait").await;
    let (t, k) = (tenant("acme"), key("order-5", "arrange-shipment"));
    let mut first = db.pool.begin().await.unwrap();
    assert_eq!(
        claim_in_transaction(&mut first, &[(t.clone(), k.clone())])
            .await
            .unwrap(),
        vec![Claim::New]
    );
    let pool = db.pool.clone();
    let (t2, k2) = (t.clone(), k.clone());
    // The first transaction holds the key for 300 ms from the moment the second one claims it: the wait
    // is measured from there, not from before its connection was opened.
    let (claiming, claims) = tokio::sync::oneshot::channel();
    let second = tokio::spawn(async move {
        let mut conn = pool.acquire().await.unwrap();
        let mut tx = conn.begin().await.unwrap();
        let started = Instant::now();
        claiming.send(()).unwrap();
        let claim = claim_in_transaction(&mut tx, &[(t2, k2)]).await.unwrap();
        tx.commit().await.unwrap();
        (claim, started.elapsed())
    });
    claims.await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.rollback().await.unwrap();
    let (claim, waited) = second.await.unwrap();
    assert_eq!(claim, vec![Claim::New]);
    assert!(
        waited >= Duration::from_millis(250),
        "waited only {waited:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_claim_answers_busy_at_once_instead_of_waiting() {
    let db = TestDb::new("store-try").await;
    let (t, k) = (tenant("acme"), key("http-1", "create-order"));
    let mut first = db.pool.begin().await.unwrap();
    let claim = idempotency::try_claim(&mut first, &t, &k, b"hash-a")
        .await
        .unwrap();
    assert_eq!(claim, idempotency::TryClaim::Claimed);

    let mut second = db.pool.begin().await.unwrap();
    let started = Instant::now();
    let claim = idempotency::try_claim(&mut second, &t, &k, b"hash-a")
        .await
        .unwrap();
    assert_eq!(claim, idempotency::TryClaim::Busy);
    assert!(started.elapsed() < Duration::from_millis(500));
    // The transaction is still usable after the busy answer.
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut *second)
        .await
        .unwrap();
    assert_eq!(one, 1);
    second.rollback().await.unwrap();

    first.commit().await.unwrap();
    let mut third = db.pool.begin().await.unwrap();
    let claim = idempotency::try_claim(&mut third, &t, &k, b"hash-b")
        .await
        .unwrap();
    let idempotency::TryClaim::Existing {
        stored,
        request_hash,
    } = claim
    else {
        panic!("{claim:?}")
    };
    assert_eq!(stored.status, KeyStatus::Completed);
    assert_eq!(request_hash.as_deref(), Some(&b"hash-a"[..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_lease_fences_a_worker_whose_lease_was_taken_over_and_makes_the_takeover_wait() {
    let db = TestDb::new("store-lock-lease").await;
    let (t, k) = (tenant("acme"), key("order-5", "process-payment"));
    let mut conn = db.pool.acquire().await.unwrap();
    let first = acquire(
        &mut conn,
        &t,
        &k,
        Duration::from_millis(200),
        "the lease is free",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = acquire(
        &mut conn,
        &t,
        &k,
        Duration::from_millis(200),
        "the expired lease is taken over",
    )
    .await;

    // The first worker's completing transaction is fenced at its first statement.
    let mut tx = db.pool.begin().await.unwrap();
    let err = idempotency::lock_lease(&mut tx, &first).await.unwrap_err();
    assert!(
        matches!(err, StoreError::Fenced { attempt: 1, .. }),
        "{err}"
    );
    tx.rollback().await.unwrap();

    // The current owner locks the key; a takeover (its lease runs out meanwhile) waits for that transaction.
    let mut tx = db.pool.begin().await.unwrap();
    idempotency::lock_lease(&mut tx, &second).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pool = db.pool.clone();
    let (t2, k2) = (t.clone(), k.clone());
    let takeover = tokio::spawn(async move {
        let mut conn = pool.acquire().await.unwrap();
        claim_lease(
            &mut conn,
            &t2,
            &k2,
            Duration::from_secs(30),
            "worker@test/1",
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !takeover.is_finished(),
        "the takeover waits for the locked key"
    );
    complete_lease(&mut tx, &second, &StepOutcome::completed())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let after = takeover.await.unwrap().unwrap();
    assert!(
        matches!(after, LeaseClaim::Duplicate(_)),
        "after the completion commits, the would-be takeover finds the step done: {after:?}"
    );
}

#[tokio::test]
async fn a_completion_after_garbage_collection_deleted_the_lease_is_recorded_not_dropped() {
    let db = TestDb::new("store-lease-gc").await;
    let (t, k) = (tenant("acme"), key("order-6", "process-payment"));
    let mut conn = db.pool.acquire().await.unwrap();
    let lease = acquire(
        &mut conn,
        &t,
        &k,
        Duration::from_secs(30),
        "the lease is free",
    )
    .await;
    // The external call runs long; garbage collection deletes the row as an abandoned lease.
    sqlx::query("DELETE FROM saga_idempotency_keys")
        .execute(&db.pool)
        .await
        .unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    idempotency::lock_lease(&mut tx, &lease)
        .await
        .expect("a deleted key is not taken over: nobody else holds it");
    complete_lease(
        &mut tx,
        &lease,
        &StepOutcome::Completed {
            result: Some(serde_json::json!({"charge": "ch_9"})),
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let record = idempotency::lookup(&mut conn, &t, &k)
        .await
        .unwrap()
        .expect("the key is back");
    assert_eq!(record.status, KeyStatus::Completed);
    assert_eq!(record.outcome, Some(serde_json::json!({"charge": "ch_9"})));

    // But a key that another worker claimed meanwhile is that worker's.
    sqlx::query("DELETE FROM saga_idempotency_keys")
        .execute(&db.pool)
        .await
        .unwrap();
    let other = acquire(
        &mut conn,
        &t,
        &k,
        Duration::from_secs(30),
        "the lease is free",
    )
    .await;
    assert_eq!(other.attempt, 1);
    let stale = idempotency::Lease {
        attempt: 7,
        ..other.clone()
    };
    let mut tx = db.pool.begin().await.unwrap();
    let err = idempotency::lock_lease(&mut tx, &stale).await.unwrap_err();
    assert!(matches!(err, StoreError::Fenced { .. }), "{err}");
}

#[tokio::test]
async fn a_client_clock_ahead_of_the_database_gets_busy_not_a_busy_loop() {
    let db = TestDb::new("store-clock-skew").await;
    let (t, k) = (tenant("acme"), key("order-7", "process-payment"));
    // A transaction's now() is its start time: inside one opened a while ago, the database's clock runs
    // behind the client's, as on a machine whose clock is ahead of the database server's.
    let mut behind = db.pool.begin().await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    sqlx::query(
        "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status, lease_expires_at) \
         VALUES ($1, $2, 'started', clock_timestamp() + interval '100 milliseconds')",
    )
    .bind(t.as_str())
    .bind(k.as_str())
    .execute(&db.pool)
    .await
    .unwrap();
    // By the client's clock the lease has expired; by the database's (the transaction's) it has not.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let claimed = tokio::time::timeout(
        Duration::from_secs(5),
        claim_lease(
            &mut behind,
            &t,
            &k,
            Duration::from_secs(30),
            "worker@test/1",
        ),
    )
    .await
    .expect("claim_lease returns instead of looping")
    .unwrap();
    assert!(matches!(claimed, LeaseClaim::Busy { .. }), "{claimed:?}");
    assert!(started.elapsed() < Duration::from_secs(1));
}

/// Claims a lease that must be free (`why` says why it is), for a test.
async fn acquire(
    conn: &mut sqlx::PgConnection,
    tenant: &TenantId,
    key: &StepKey,
    lease: Duration,
    why: &str,
) -> idempotency::Lease {
    match claim_lease(conn, tenant, key, lease, "worker@test/1")
        .await
        .unwrap()
    {
        LeaseClaim::Acquired(lease) => lease,
        other => panic!("{why}: {other:?}"),
    }
}
