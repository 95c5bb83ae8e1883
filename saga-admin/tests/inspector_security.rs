//! Who may drive the inspector page, over HTTP with requests written by hand (every header the test's
//! choice, as an attacker's page or tool would send them): the Host check (DNS rebinding), the origin and
//! CSRF checks of a replay, tokens by name (constant-time, swapped for a cookie and removed from the
//! address), the headers that forbid framing, the read-only mode, the `saga inspect` command's refusal
//! to listen beyond localhost without a token, and the JSON API and `/metrics` a script or Prometheus reads
//! with a bearer token.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use saga_admin::inspect::{self, InspectOptions, NamedToken};
use saga_config::KafkaConfig;
use saga_test_support::{TestDb, TestKafka, expect_usage_error};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use common::Target;

/// An answer: status, headers (names lower-case), body.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn cookie(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .filter(|(n, _)| n == "set-cookie")
            .find_map(|(_, v)| {
                v.strip_prefix(&format!("{name}="))
                    .map(|rest| rest.split(';').next().unwrap_or_default().to_owned())
            })
    }

    /// The value of the page's hidden field `name`.
    fn field(&self, name: &str) -> String {
        let marker = format!("name=\"{name}\" value=\"");
        let at = self
            .body
            .find(&marker)
            .unwrap_or_else(|| panic!("no field {name} in {}", self.body));
        let rest = &self.body[at + marker.len()..];
        rest[..rest.find('"').unwrap()].to_owned()
    }

    /// The CSRF token of the page's form.
    fn csrf(&self) -> String {
        let at = self
            .body
            .find("name=\"csrf\" value=\"")
            .unwrap_or_else(|| panic!("no CSRF field in {}", self.body));
        let rest = &self.body[at + "name=\"csrf\" value=\"".len()..];
        rest[..rest.find('"').unwrap()].to_owned()
    }
}

/// Sends `method path` to `addr` with exactly `headers` (no Host unless given) and `body`.
async fn raw(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut request = format!("{method} {path} HTTP/1.1\r\nconnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    if !body.is_empty() {
        request.push_str(&format!(
            "content-type: application/x-www-form-urlencoded\r\ncontent-length: {}\r\n",
            body.len()
        ));
    }
    request.push_str("\r\n");
    request.push_str(body);
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut bytes = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut bytes))
        .await
        .expect("an answer within a minute")
        .unwrap();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Answer {
        status,
        headers,
        body: body.to_owned(),
    }
}

/// Writes a dead letter of `group` for key `key` (its message at `offset` of `topic`) to `dlq`, failed
/// with `card declined`.
async fn letter(kafka: &TestKafka, dlq: &str, topic: &str, group: &str, key: &str, offset: i64) {
    let failed_at = chrono::Utc::now().to_rfc3339();
    let offset = offset.to_string();
    kafka
        .produce(
            &kafka.producer(),
            dlq,
            Some(key),
            &[
                ("idempotency-key", key),
                ("ce_type", "OrderCreated"),
                ("dlq-original-topic", topic),
                ("dlq-original-partition", "0"),
                ("dlq-original-offset", &offset),
                ("dlq-consumer-group", group),
                ("dlq-step", "process-payment"),
                ("dlq-reason", "handler-failed"),
                ("dlq-error", "card declined"),
                ("dlq-attempts", "1"),
                ("dlq-failed-at", &failed_at),
            ],
            b"{}",
        )
        .await;
}

/// A service's schema with one dead letter of its group, and an inspector over it.
struct Inspector {
    db: TestDb,
    kafka: TestKafka,
    addr: SocketAddr,
    topic: String,
    group: String,
    dlq: String,
    retry: String,
    stop: CancellationToken,
}

impl Inspector {
    async fn start(name: &str, options: InspectOptions) -> Self {
        let db = TestDb::with(
            name,
            &[
                saga_consumer::migrate::migrator(),
                saga_orchestrator::migrate::migrator(),
                saga_admin::dlq::migrator(),
            ],
        )
        .await;
        let kafka = TestKafka::new().await;
        let topic = kafka.topic(name, 1).await;
        let group = format!("{topic}-group");
        let (dlq, retry) = (format!("{group}.dlq"), format!("{group}.retry"));
        kafka.create_topic(&dlq, 1).await;
        kafka.create_topic(&retry, 1).await;
        sqlx::query(
            "INSERT INTO saga_consumer_groups (group_id, dlq_topic, retry_topic, topics) \
             VALUES ($1, $2, $3, ARRAY[$4])",
        )
        .bind(&group)
        .bind(&dlq)
        .bind(&retry)
        .bind(&topic)
        .execute(&db.pool)
        .await
        .unwrap();
        letter(&kafka, &dlq, &topic, &group, "order-7", 0).await;
        let mut options = options;
        options.dlq_topics = vec![dlq.clone()];
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        tokio::spawn(inspect::serve(
            listener,
            KafkaConfig::new(kafka.brokers.clone()),
            db.pool.clone(),
            options,
            stop.clone().cancelled_owned(),
        ));
        Self {
            db,
            kafka,
            addr,
            topic,
            group,
            dlq,
            retry,
            stop,
        }
    }

    fn host(&self) -> String {
        self.addr.to_string()
    }

    fn confirm_path(&self) -> String {
        format!("/dlq/{}/0/0/replay", self.dlq)
    }

    async fn sent(&self) -> i64 {
        self.kafka.end_offsets(&self.retry).await.values().sum()
    }

    async fn operators(&self) -> Vec<String> {
        saga_admin::dlq::replays(&self.db.pool, None, 10)
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.operator)
            .collect()
    }
}

impl Drop for Inspector {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn hardened(answer: &Answer) {
    assert_eq!(answer.header("x-frame-options"), Some("DENY"), "{answer:?}");
    let csp = answer.header("content-security-policy").unwrap_or_default();
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_page_answers_its_own_host_only_and_replays_only_from_its_own_form() {
    let mut options = InspectOptions::default();
    options.public_names = vec!["inspector.example.com".to_owned()];
    let i = Inspector::start("inspect-csrf", options).await;
    let host = i.host();
    let origin = format!("http://{host}");
    let port = i.addr.port();

    // Another site's name, as a DNS-rebinding page sends it: refused, whatever the path or method.
    let rebound = format!("evil.example:{port}");
    let answer = raw(i.addr, "GET", "/", &[("host", &rebound)], "").await;
    assert_eq!(answer.status, 421, "{answer:?}");
    hardened(&answer);
    let answer = raw(
        i.addr,
        "POST",
        &i.confirm_path(),
        &[("host", &rebound), ("origin", &format!("http://{rebound}"))],
        "csrf=x",
    )
    .await;
    assert_eq!(answer.status, 421);
    assert_eq!(
        raw(i.addr, "GET", "/", &[], "").await.status,
        421,
        "no Host"
    );
    for known in [
        host.clone(),
        format!("localhost:{port}"),
        "inspector.example.com".to_owned(),
    ] {
        let answer = raw(i.addr, "GET", "/", &[("host", &known)], "").await;
        assert_eq!(answer.status, 200, "{known}: {answer:?}");
        hardened(&answer);
    }

    // Reads made by another site's page (an image, a fetch, a frame): refused, as the browser says them;
    // a link followed from elsewhere, a typed address, and a script without browser headers are read.
    let letters = format!("/api/dlq/{}", i.dlq);
    for (headers, status) in [
        (
            vec![
                ("sec-fetch-site", "cross-site"),
                ("sec-fetch-mode", "no-cors"),
                ("sec-fetch-dest", "image"),
            ],
            403,
        ),
        (
            vec![
                ("sec-fetch-site", "same-site"),
                ("sec-fetch-mode", "cors"),
                ("sec-fetch-dest", "empty"),
            ],
            403,
        ),
        (
            vec![
                ("sec-fetch-site", "cross-site"),
                ("sec-fetch-mode", "navigate"),
                ("sec-fetch-dest", "iframe"),
            ],
            403,
        ),
        (vec![("origin", "http://evil.example")], 403),
        (vec![("origin", "null")], 403),
        (
            vec![
                ("sec-fetch-site", "cross-site"),
                ("sec-fetch-mode", "navigate"),
                ("sec-fetch-dest", "document"),
            ],
            200,
        ),
        (vec![("sec-fetch-site", "none")], 200),
        (vec![("sec-fetch-site", "same-origin")], 200),
        (vec![], 200),
    ] {
        let mut all = vec![("host", host.as_str())];
        all.extend(headers.iter().copied());
        let answer = raw(i.addr, "GET", &letters, &all, "").await;
        assert_eq!(answer.status, status, "{headers:?}: {answer:?}");
        if status == 403 {
            assert!(!answer.body.contains("order-7"), "{answer:?}");
        } else {
            assert!(answer.body.contains("order-7"), "{answer:?}");
        }
    }

    // A session and its form's token.
    let first = raw(i.addr, "GET", &i.confirm_path(), &[("host", &host)], "").await;
    assert_eq!(first.status, 200, "{first:?}");
    let session = first
        .cookie("saga_admin_session")
        .expect("a session cookie");
    let set = first
        .headers
        .iter()
        .find(|(n, v)| n == "set-cookie" && v.starts_with("saga_admin_session="))
        .unwrap()
        .1
        .clone();
    assert!(
        set.contains("HttpOnly") && set.contains("SameSite=Strict") && !set.contains("Secure"),
        "{set}"
    );
    let csrf = first.csrf();
    let letter = first.field("letter");
    let cookie = format!("saga_admin_session={session}");

    // Refused: no Origin and no Referer; another origin; no token; a wrong token; another session's.
    let post = |headers: Vec<(&'static str, String)>, body: String| {
        let (addr, path) = (i.addr, i.confirm_path());
        async move {
            let headers: Vec<(&str, &str)> =
                headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
            raw(addr, "POST", &path, &headers, &body).await
        }
    };
    let with = |origin: Option<&str>, cookie: &str| {
        let mut headers = vec![("host", host.clone()), ("cookie", cookie.to_owned())];
        if let Some(origin) = origin {
            headers.push(("origin", origin.to_owned()));
        }
        headers
    };
    let refusals = [
        (with(None, &cookie), format!("csrf={csrf}")),
        (
            with(Some("http://evil.example"), &cookie),
            format!("csrf={csrf}"),
        ),
        (with(Some("null"), &cookie), format!("csrf={csrf}")),
        (with(Some(&origin), &cookie), String::new()),
        (
            with(Some(&origin), &cookie),
            "csrf=0123456789abcdef".to_owned(),
        ),
        (
            with(Some(&origin), "saga_admin_session=".to_owned().as_str()),
            format!("csrf={csrf}"),
        ),
        (
            with(
                Some(&origin),
                &format!("saga_admin_session={}", "ab".repeat(32)),
            ),
            format!("csrf={csrf}"),
        ),
    ];
    for (headers, body) in refusals {
        let answer = post(headers.clone(), body.clone()).await;
        assert_eq!(answer.status, 403, "{headers:?} {body}: {answer:?}");
    }
    assert_eq!(i.sent().await, 0, "nothing was replayed");

    // From its own form, but without the letter its page showed: refused.
    let answer = post(with(Some(&origin), &cookie), format!("csrf={csrf}")).await;
    assert_eq!(answer.status, 400, "{answer:?}");
    assert_eq!(i.sent().await, 0);
    // From its own form: replayed, once, recorded as the inspector's user.
    let answer = post(
        with(Some(&origin), &cookie),
        format!("csrf={csrf}&letter={letter}"),
    )
    .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert!(answer.body.contains("data-sent=\"1\""), "{}", answer.body);
    assert_eq!(i.sent().await, 1);
    // A browser that sends a Referer but no Origin is accepted too; the letter is not sent again.
    let mut headers = vec![("host", host.clone()), ("cookie", cookie.clone())];
    headers.push(("referer", format!("{origin}{}", i.confirm_path())));
    let answer = post(headers, format!("csrf={csrf}&letter={letter}")).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert!(answer.body.contains("data-sent=\"0\""));
    assert_eq!(i.sent().await, 1);
    let operators = i.operators().await;
    assert_eq!(operators.len(), 1);
    assert!(operators[0].starts_with("inspector:"), "{operators:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_tokens_each_request_presents_one_and_the_replay_is_recorded_under_its_name() {
    let alice = "alice-token-0123456789abcdef";
    let bob = "bob-token-0123456789abcdefgh";
    let mut options = InspectOptions::default();
    options.tokens = NamedToken::parse_list(&format!("alice:{alice},bob:{bob}")).unwrap();
    options.secure_cookies = true;
    let i = Inspector::start("inspect-tokens", options).await;
    let host = i.host();

    assert_eq!(
        raw(i.addr, "GET", "/", &[("host", &host)], "").await.status,
        401
    );
    assert_eq!(
        raw(
            i.addr,
            "GET",
            "/?token=wrong-token-0123456789",
            &[("host", &host)],
            ""
        )
        .await
        .status,
        401
    );
    // A token in the address: a session of its own in a cookie (never the token), and the same page without
    // it.
    let login_cookie = "__Host-saga_admin_login";
    let typed = ("sec-fetch-site", "none");
    let answer = raw(
        i.addr,
        "GET",
        &format!("/dlq/{}?token={alice}&x=1", i.dlq),
        &[("host", &host), typed],
        "",
    )
    .await;
    assert_eq!(answer.status, 303, "{answer:?}");
    assert_eq!(
        answer.header("location"),
        Some(format!("/dlq/{}?x=1", i.dlq).as_str())
    );
    let login = answer.cookie(login_cookie).expect("a login cookie");
    assert!(!login.contains(alice) && login.len() == 64, "{login}");
    let set = answer
        .headers
        .iter()
        .find(|(n, v)| n == "set-cookie" && v.starts_with(login_cookie))
        .unwrap()
        .1
        .clone();
    assert!(
        set.contains("HttpOnly")
            && set.contains("SameSite=Strict")
            && set.contains("Secure")
            && set.contains("Path=/;")
            && set.contains("Max-Age=43200"),
        "{set}"
    );
    let alices = format!("{login_cookie}={login}");
    let by_cookie = raw(
        i.addr,
        "GET",
        "/",
        &[("host", &host), ("cookie", &alices)],
        "",
    )
    .await;
    assert_eq!(by_cookie.status, 200);
    hardened(&by_cookie);
    // The raw token in a cookie is no credential.
    for cookie in [
        format!("{login_cookie}={alice}"),
        format!("saga_admin_token={alice}"),
    ] {
        let answer = raw(
            i.addr,
            "GET",
            "/",
            &[("host", &host), ("cookie", &cookie)],
            "",
        )
        .await;
        assert_eq!(answer.status, 401, "{cookie}");
    }

    // The token's name encoded, or the path made to look like another host: the redirect drops the token
    // and stays on this inspector.
    for (address, location) in [
        (format!("/?%74oken={alice}"), "/"),
        (format!("//evil.example/?token={alice}"), "/evil.example/"),
    ] {
        let answer = raw(i.addr, "GET", &address, &[("host", &host), typed], "").await;
        assert_eq!(answer.status, 303, "{address}: {answer:?}");
        assert_eq!(answer.header("location"), Some(location), "{address}");
    }

    // Bob's link followed in Alice's browser (login CSRF): refused, her session kept, a sign-out offered.
    let answer = raw(
        i.addr,
        "GET",
        &format!("/?token={bob}"),
        &[("host", &host), ("cookie", &alices), typed],
        "",
    )
    .await;
    assert_eq!(answer.status, 409, "{answer:?}");
    assert!(
        answer.body.contains("<b>alice</b>") && answer.body.contains("<b>bob</b>"),
        "{}",
        answer.body
    );
    assert!(answer.cookie(login_cookie).is_none(), "nothing replaced");
    assert!(!answer.body.contains(bob), "the token is not shown");
    let confirm_session = answer.cookie("saga_admin_session").unwrap();
    let still = raw(
        i.addr,
        "GET",
        "/",
        &[("host", &host), ("cookie", &alices)],
        "",
    )
    .await;
    assert_eq!(still.status, 200);
    // The same link followed from another site, whose navigation carries no cookie of the inspector (or from
    // a browser that does not say where it came from): it signs in no one by itself, but sends to a page of
    // the inspector's own, whose address holds a one-time reference instead of the token, and whose form
    // the browser sends with the cookies.
    for elsewhere in [
        vec![
            ("host", host.as_str()),
            ("sec-fetch-site", "cross-site"),
            ("sec-fetch-mode", "navigate"),
            ("sec-fetch-dest", "document"),
        ],
        vec![("host", host.as_str())],
    ] {
        let sent = raw(i.addr, "GET", &format!("/?token={bob}"), &elsewhere, "").await;
        assert_eq!(sent.status, 303, "{sent:?}");
        assert!(
            sent.cookie(login_cookie).is_none(),
            "no sign-in by a link alone"
        );
        let to = sent.header("location").unwrap().to_owned();
        assert!(to.starts_with("/login?n=") && !to.contains(bob), "{to}");
        let asked = raw(i.addr, "GET", &to, &elsewhere, "").await;
        assert_eq!(asked.status, 200, "{asked:?}");
        assert!(asked.body.contains("Sign in as bob"), "{}", asked.body);
        assert!(!asked.body.contains(bob), "the token is not on the page");
        let asked_session = asked.cookie("saga_admin_session").unwrap();
        let finish = |cookie: String| {
            let (addr, host, body) = (
                i.addr,
                host.clone(),
                format!("csrf={}&n={}", asked.csrf(), asked.field("n")),
            );
            async move {
                raw(
                    addr,
                    "POST",
                    "/login",
                    &[
                        ("host", &host),
                        ("origin", &format!("http://{host}")),
                        ("cookie", &cookie),
                    ],
                    &body,
                )
                .await
            }
        };
        // Pressed in Alice's browser (her session's cookie goes with the form): refused, as above; and the
        // reference is used up.
        let replaced = finish(format!("{alices}; saga_admin_session={asked_session}")).await;
        assert_eq!(replaced.status, 409, "{replaced:?}");
        assert!(replaced.cookie(login_cookie).is_none());
        let again = finish(format!("saga_admin_session={asked_session}")).await;
        assert_eq!(again.status, 401, "a reference signs in once: {again:?}");
    }
    // Pressed where no one is signed in: Bob's session.
    let sent = raw(
        i.addr,
        "GET",
        &format!("/?token={bob}"),
        &[("host", &host)],
        "",
    )
    .await;
    let to = sent.header("location").unwrap().to_owned();
    let asked = raw(i.addr, "GET", &to, &[("host", &host)], "").await;
    let asked_session = asked.cookie("saga_admin_session").unwrap();
    let signed = raw(
        i.addr,
        "POST",
        "/login",
        &[
            ("host", &host),
            ("origin", &format!("http://{host}")),
            ("cookie", &format!("saga_admin_session={asked_session}")),
        ],
        &format!("csrf={}&n={}", asked.csrf(), asked.field("n")),
    )
    .await;
    assert_eq!(signed.status, 303, "{signed:?}");
    assert_eq!(signed.header("location"), Some("/"));
    assert!(signed.cookie(login_cookie).is_some());

    // Her own sign-out, from that page's form: the session ends.
    let out = raw(
        i.addr,
        "POST",
        "/logout",
        &[
            ("host", &host),
            ("origin", &format!("http://{host}")),
            (
                "cookie",
                &format!("{alices}; saga_admin_session={confirm_session}"),
            ),
        ],
        &format!("csrf={}", answer.csrf()),
    )
    .await;
    assert_eq!(out.status, 303, "{out:?}");
    let ended = raw(
        i.addr,
        "GET",
        "/",
        &[("host", &host), ("cookie", &alices)],
        "",
    )
    .await;
    assert_eq!(ended.status, 401, "signed out");

    // Bob replays with a bearer token: recorded under his name.
    let bearer = format!("Bearer {bob}");
    let page = raw(
        i.addr,
        "GET",
        &i.confirm_path(),
        &[("host", &host), ("authorization", &bearer)],
        "",
    )
    .await;
    assert_eq!(page.status, 200, "{page:?}");
    assert!(page.body.contains(">bob<"), "the page says who will replay");
    let session = page.cookie("saga_admin_session").unwrap();
    let answer = raw(
        i.addr,
        "POST",
        &i.confirm_path(),
        &[
            ("host", &host),
            ("authorization", &bearer),
            ("origin", &format!("http://{host}")),
            ("cookie", &format!("saga_admin_session={session}")),
        ],
        &format!("csrf={}", page.csrf()),
    )
    .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(i.sent().await, 1);
    assert_eq!(i.operators().await, ["bob"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_only_inspector_shows_no_replay_button_and_refuses_every_post() {
    let mut options = InspectOptions::default();
    options.read_only = true;
    let i = Inspector::start("inspect-read-only", options).await;
    let host = i.host();
    for path in [format!("/dlq/{}", i.dlq), format!("/dlq/{}/0/0", i.dlq)] {
        let page = raw(i.addr, "GET", &path, &[("host", &host)], "").await;
        assert_eq!(page.status, 200);
        assert!(page.body.contains("order-7") || page.body.contains("card declined"));
        assert!(!page.body.contains("Replay…"), "{}", page.body);
    }
    assert_eq!(
        raw(i.addr, "GET", &i.confirm_path(), &[("host", &host)], "")
            .await
            .status,
        400
    );
    let answer = raw(
        i.addr,
        "POST",
        &i.confirm_path(),
        &[("host", &host), ("origin", &format!("http://{host}"))],
        "csrf=anything",
    )
    .await;
    assert_eq!(answer.status, 403);
    assert!(answer.body.contains("read-only"));
    assert_eq!(i.sent().await, 0);

    // A saga started by an HTTP request whose stored response holds what its client alone should see:
    // a viewer who may not act gets the key without it; one who may act, with it.
    let saga_id = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO saga_instances (saga_id, saga_type, tenant_id, idempotency_key, status, step_index, \
             data) VALUES ($1, 'order-saga', 'default', 'order-9', 'running', 1, '{}')",
    )
    .bind(saga_id)
    .execute(&i.db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO saga_idempotency_keys (tenant_id, step_key, status, outcome, request_hash) \
         VALUES ('default', 'order-9:create-order', 'completed', \
             '{\"status\": 201, \"headers\": [], \"body\": \"{\\\"card\\\": \\\"4111-secret\\\"}\"}', \
             '\\x01'::bytea)",
    )
    .execute(&i.db.pool)
    .await
    .unwrap();
    let path = format!("/api/sagas/{saga_id}");
    let seen = raw(
        i.addr,
        "GET",
        &path,
        &[("host", &host), ("accept", "application/json")],
        "",
    )
    .await;
    assert_eq!(seen.status, 200, "{seen:?}");
    assert!(!seen.body.contains("4111-secret"), "{}", seen.body);
    assert!(
        seen.body.contains("\"response_hidden\":true"),
        "{}",
        seen.body
    );
    let mut options = InspectOptions::default();
    options.dlq_topics = vec![i.dlq.clone()];
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let actor = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(inspect::serve(
        listener,
        KafkaConfig::new(i.kafka.brokers.clone()),
        i.db.pool.clone(),
        options,
        stop.clone().cancelled_owned(),
    ));
    let actor_host = actor.to_string();
    let seen = raw(
        actor,
        "GET",
        &path,
        &[("host", &actor_host), ("accept", "application/json")],
        "",
    )
    .await;
    stop.cancel();
    assert!(seen.body.contains("4111-secret"), "{}", seen.body);

    // A topic's letters come a page at a time: after a letter, the ones that follow it.
    letter(&i.kafka, &i.dlq, &i.topic, &i.group, "order-8", 1).await;
    let page = |query: &'static str| {
        let (addr, host, path) = (i.addr, host.clone(), format!("/api/dlq/{}{query}", i.dlq));
        async move {
            let answer = raw(addr, "GET", &path, &[("host", &host)], "").await;
            (
                answer.status,
                serde_json::from_str::<serde_json::Value>(&answer.body).unwrap_or_default(),
            )
        }
    };
    let keys = |letters: &serde_json::Value| -> Vec<String> {
        letters
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|l| l["idempotency_key"].as_str().unwrap_or_default().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    let (status, all) = page("").await;
    assert_eq!(
        (status, keys(&all)),
        (200, vec!["order-7".to_owned(), "order-8".to_owned()])
    );
    let (status, rest) = page("?after=0-0").await;
    assert_eq!((status, keys(&rest)), (200, vec!["order-8".to_owned()]));
    assert_eq!(page("?after=zero").await.0, 400);

    // Only the inspector's dead-letter topics are read: another, a business topic, the broker's own are
    // refused before anything is read; and a failure names no address of the broker.
    for topic in [
        "__consumer_offsets".to_owned(),
        "orders".to_owned(),
        format!("{}-other.dlq", i.group),
    ] {
        let answer = raw(
            i.addr,
            "GET",
            &format!("/api/dlq/{topic}"),
            &[("host", &host)],
            "",
        )
        .await;
        assert_eq!(answer.status, 400, "{topic}: {answer:?}");
        assert!(
            answer
                .body
                .contains("not a dead-letter topic this inspector shows"),
            "{}",
            answer.body
        );
        assert!(!answer.body.contains(&i.kafka.brokers), "{}", answer.body);
    }
}

#[tokio::test]
async fn saga_inspect_refuses_to_listen_beyond_localhost_without_a_token() {
    let db = TestDb::new("inspect-cli").await;
    let kafka = TestKafka::new().await;
    let saga = Target {
        database_url: TestDb::database_url(),
        schema: db.schema.clone(),
        brokers: kafka.brokers.clone(),
    };
    let mut open = saga.command(&["inspect", "--listen", "0.0.0.0:0"]);
    open.env_remove("SAGA_ADMIN_TOKENS");
    let line = expect_usage_error(open, "SAGA_ADMIN_TOKEN").await;
    assert!(line.contains("--insecure-no-token"), "{line}");
    // On localhost, but named as a proxy in front serves it: served to others, so a token is needed too.
    let mut proxied = saga.command(&[
        "inspect",
        "--listen",
        "127.0.0.1:0",
        "--public-name",
        "ops.example.com",
    ]);
    proxied.env_remove("SAGA_ADMIN_TOKENS");
    let line = expect_usage_error(proxied, "SAGA_ADMIN_TOKEN").await;
    assert!(line.contains("ops.example.com"), "{line}");
    let mut short = saga.command(&["inspect", "--listen", "0.0.0.0:0"]);
    short.env("SAGA_ADMIN_TOKENS", "alice:short");
    let line = expect_usage_error(short, "SAGA_ADMIN_TOKENS").await;
    assert!(!line.contains("short"), "the token is not echoed: {line}");

    // Told so, it listens; on localhost it needs nothing.
    for args in [
        &["inspect", "--listen", "0.0.0.0:0", "--insecure-no-token"][..],
        &["inspect", "--listen", "127.0.0.1:0"][..],
        &[
            "inspect",
            "--listen",
            "127.0.0.1:0",
            "--public-name",
            "ops.example.com",
            "--insecure-no-token",
        ][..],
    ] {
        let mut command = saga.command(args);
        command
            .env_remove("SAGA_ADMIN_TOKENS")
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true);
        let mut child = command.spawn().unwrap();
        let mut stdout = child.stdout.take().unwrap();
        let mut line = vec![0u8; 200];
        let n = tokio::time::timeout(Duration::from_secs(30), stdout.read(&mut line))
            .await
            .expect("the inspector starts")
            .unwrap();
        let line = String::from_utf8_lossy(&line[..n]);
        assert!(line.starts_with("inspector on http://"), "{args:?}: {line}");
        child.kill().await.unwrap();
    }
}

/// `GET path` with a bearer token; the answer's JSON.
async fn api_get(i: &Inspector, token: &str, path: &str) -> serde_json::Value {
    let answer = raw(
        i.addr,
        "GET",
        path,
        &[
            ("host", &i.host()),
            ("authorization", &format!("Bearer {token}")),
        ],
        "",
    )
    .await;
    assert_eq!(answer.status, 200, "{path}: {answer:?}");
    assert_eq!(
        answer.header("content-type"),
        Some("application/json"),
        "{path}"
    );
    serde_json::from_str(&answer.body).unwrap_or_else(|e| panic!("{path}: {e}: {}", answer.body))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_script_with_a_token_reads_the_api_and_replays_a_group_and_prometheus_reads_the_metrics()
{
    let token = "ops-token-0123456789abcdef";
    let mut options = InspectOptions::default();
    options.tokens = NamedToken::parse_list(&format!("ops:{token}")).unwrap();
    let i = Inspector::start("inspect-api", options).await;
    let host = i.host();
    // A saga its timer marked stuck, for the metrics.
    sqlx::query(
        "INSERT INTO saga_instances (saga_id, saga_type, tenant_id, idempotency_key, status, step_index, \
             data, stuck_reason) VALUES ($1, 'order-saga', 'default', 'k', 'running', 3, '{}', 'gone')",
    )
    .bind(uuid::Uuid::now_v7())
    .execute(&i.db.pool)
    .await
    .unwrap();

    let groups = api_get(&i, token, "/api/groups").await;
    let group = &groups[0];
    assert_eq!(
        (&group["open"], &group["cause"]),
        (&1.into(), &"card declined".into())
    );
    let id = group["id"].as_str().unwrap().to_owned();
    let plan = api_get(&i, token, &format!("/api/groups/{id}/plan?action=replay")).await;
    assert_eq!(plan["letters"].as_array().unwrap().len(), 1);
    let metrics = |token: Option<&'static str>| {
        let (addr, host) = (i.addr, host.clone());
        async move {
            let auth = token.map(|t| format!("Bearer {t}")).unwrap_or_default();
            let mut headers = vec![("host", host.as_str())];
            if token.is_some() {
                headers.push(("authorization", auth.as_str()));
            }
            raw(addr, "GET", "/metrics", &headers, "").await
        }
    };
    assert_eq!(
        metrics(None).await.status,
        401,
        "the metrics need the token too"
    );
    let before = metrics(Some("ops-token-0123456789abcdef")).await;
    assert_eq!(before.status, 200);
    assert!(
        before
            .header("content-type")
            .unwrap()
            .starts_with("text/plain; version=0.0.4"),
        "{before:?}"
    );
    let open_line = |body: &str| {
        body.lines()
            .find(|l| {
                l.starts_with("saga_dlq_open_letters{")
                    && l.contains(&format!("failure_group=\"{id}\""))
            })
            .map(str::to_owned)
    };
    assert!(
        open_line(&before.body).unwrap().ends_with(" 1"),
        "{}",
        before.body
    );
    assert!(
        before
            .body
            .contains("saga_sagas_stuck{saga_type=\"order-saga\"} 1"),
        "{}",
        before.body
    );
    assert!(
        before
            .body
            .contains("\nsaga_outbox_oldest_unpublished_age_seconds 0\n"),
        "{}",
        before.body
    );

    // A cookie is a browser's credential: without the form's CSRF token, the action is refused.
    let signed_in = raw(
        i.addr,
        "GET",
        &format!("/?token={token}"),
        &[("host", &host), ("sec-fetch-site", "none")],
        "",
    )
    .await;
    let login = format!(
        "saga_admin_login={}",
        signed_in
            .cookie("saga_admin_login")
            .expect("a login cookie")
    );
    let refused = raw(
        i.addr,
        "POST",
        &format!("/api/groups/{id}/replay"),
        &[
            ("host", &host),
            ("cookie", &login),
            ("origin", &format!("http://{host}")),
        ],
        "",
    )
    .await;
    assert_eq!(refused.status, 403, "{refused:?}");
    assert_eq!(i.sent().await, 0);

    // A bearer token is a script's: the replay starts, answered with the operation.
    let started = raw(
        i.addr,
        "POST",
        &format!("/api/groups/{id}/replay"),
        &[
            ("host", &host),
            ("authorization", &format!("Bearer {token}")),
        ],
        "",
    )
    .await;
    assert_eq!(started.status, 202, "{started:?}");
    let operation: serde_json::Value = serde_json::from_str(&started.body).unwrap();
    assert_eq!(operation["operation"]["operator"], "ops");
    let path = format!("/api/operations/{}", operation["operation"]["id"]);
    let done =
        saga_test_support::wait_until("the operation to end", Duration::from_secs(60), || async {
            let o = api_get(&i, token, &path).await;
            (o["operation"]["status"] == "done").then_some(o)
        })
        .await;
    assert_eq!(done["operation"]["done"], 1);
    assert_eq!(i.sent().await, 1);
    assert_eq!(i.operators().await, ["ops"]);
    let overview = api_get(&i, token, "/api/overview").await;
    assert_eq!(overview["failure_groups"][0]["open"], 0);
    assert_eq!(overview["operations"][0]["kind"], "replay");
    let after = metrics(Some("ops-token-0123456789abcdef")).await;
    assert!(
        open_line(&after.body).unwrap().ends_with(" 0"),
        "{}",
        after.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_the_broker_unreachable_the_metrics_keep_the_rest_and_say_what_is_missing() {
    let i = Inspector::start("inspect-metrics-down", InspectOptions::default()).await;
    // The same schema, served by an inspector whose broker does not answer.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(inspect::serve(
        listener,
        KafkaConfig::new("127.0.0.1:1"),
        i.db.pool.clone(),
        InspectOptions::default(),
        i.stop.clone().cancelled_owned(),
    ));
    let host = addr.to_string();
    let scraped = raw(addr, "GET", "/metrics", &[("host", host.as_str())], "").await;
    assert_eq!(scraped.status, 200, "{}", scraped.body);
    for line in [
        "saga_inspector_scrape_errors{part=\"dead_letters\"} 1",
        "saga_inspector_scrape_errors{part=\"outbox\"} 0",
        "# TYPE saga_sagas_stuck gauge",
    ] {
        assert!(
            scraped.body.lines().any(|l| l == line),
            "{line}:\n{}",
            scraped.body
        );
    }
    assert!(
        !scraped.body.contains("saga_dlq_open_letters{"),
        "no dead-letter series from an index that could not be brought up to date:\n{}",
        scraped.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_confirmation_acts_on_the_letters_its_preview_listed_or_on_none() {
    let i = Inspector::start("inspect-pinned", InspectOptions::default()).await;
    let host = i.host();
    let origin = format!("http://{host}");
    let groups: serde_json::Value = serde_json::from_str(
        &raw(
            i.addr,
            "GET",
            "/api/groups",
            &[("host", &host), ("accept", "application/json")],
            "",
        )
        .await
        .body,
    )
    .unwrap();
    let id = groups[0]["id"].as_str().unwrap().to_owned();
    let discards = || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM saga_dlq_discards WHERE dlq_topic = $1 AND undone_at IS NULL",
        )
        .bind(&i.dlq)
        .fetch_one(&i.db.pool)
        .await
        .unwrap_or(0);
        n
    };
    // The preview: discard 1. Its form carries the CSRF token and the preview's pin.
    let preview = |cookie: Option<String>| {
        let (addr, host, path) = (
            i.addr,
            host.clone(),
            format!("/groups/{id}/plan?action=discard"),
        );
        async move {
            let mut headers = vec![("host", host.as_str())];
            if let Some(cookie) = &cookie {
                headers.push(("cookie", cookie.as_str()));
            }
            raw(addr, "GET", &path, &headers, "").await
        }
    };
    let first = preview(None).await;
    assert_eq!(first.status, 200, "{first:?}");
    assert!(
        first.body.contains("data-would-act=\"1\""),
        "{}",
        first.body
    );
    let cookie = format!(
        "saga_admin_session={}",
        first.cookie("saga_admin_session").unwrap()
    );
    let (csrf, pin) = (first.csrf(), first.field("plan"));
    let confirm = |body: String| {
        let (addr, host, origin, cookie) = (i.addr, host.clone(), origin.clone(), cookie.clone());
        let path = format!("/api/groups/{id}/discard");
        async move {
            raw(
                addr,
                "POST",
                &path,
                &[
                    ("host", &host),
                    ("origin", &origin),
                    ("cookie", &cookie),
                    ("accept", "text/html"),
                ],
                &body,
            )
            .await
        }
    };

    // Four letters of the same cause arrive after the preview: the confirmation does nothing, and says so.
    for n in 1..=4 {
        letter(
            &i.kafka,
            &i.dlq,
            &i.topic,
            &i.group,
            &format!("order-{}", 7 + n),
            n,
        )
        .await;
    }
    let changed = confirm(format!("csrf={csrf}&plan={pin}")).await;
    assert_eq!(changed.status, 400, "{changed:?}");
    assert!(
        changed.body.contains("changed since the preview") && changed.body.contains("listed 1"),
        "{}",
        changed.body
    );
    assert_eq!(discards().await, 0, "nothing discarded");
    // Without the preview's pin, or with an expired or malformed one: refused too.
    let expired = pin.replacen(
        pin.split('.').next().unwrap(),
        &(chrono::Utc::now().timestamp() - 3600).to_string(),
        1,
    );
    for body in [
        format!("csrf={csrf}"),
        format!("csrf={csrf}&plan=x"),
        format!("csrf={csrf}&plan={expired}"),
    ] {
        let answer = confirm(body.clone()).await;
        assert_eq!(answer.status, 400, "{body}: {answer:?}");
    }
    assert_eq!(discards().await, 0);

    // Previewed again (5 letters), confirmed: exactly those five.
    let again = preview(Some(cookie.clone())).await;
    assert!(
        again.body.contains("data-would-act=\"5\""),
        "{}",
        again.body
    );
    let started = confirm(format!("csrf={csrf}&plan={}", again.field("plan"))).await;
    assert_eq!(started.status, 303, "{started:?}");
    saga_test_support::wait_until("the discard", Duration::from_secs(60), || async {
        (discards().await == 5).then_some(())
    })
    .await;

    // Its undo: previewed first (5 letters), pinned to them. One is opened again meanwhile (by another
    // undo): the confirmation does nothing, and says so; previewed again, confirmed, the four are opened.
    let operation = started.header("location").unwrap().to_owned();
    let undo_preview = raw(
        i.addr,
        "GET",
        &format!("{operation}/undo"),
        &[("host", &host), ("cookie", &cookie)],
        "",
    )
    .await;
    assert!(
        undo_preview.body.contains("data-would-act=\"5\""),
        "{}",
        undo_preview.body
    );
    sqlx::query(
        "UPDATE saga_dlq_discards SET undone_at = now() \
         WHERE ctid = (SELECT ctid FROM saga_dlq_discards WHERE undone_at IS NULL LIMIT 1)",
    )
    .execute(&i.db.pool)
    .await
    .unwrap();
    let undo = |pin: String| {
        let (addr, host, origin, cookie) = (i.addr, host.clone(), origin.clone(), cookie.clone());
        let (path, csrf) = (format!("/api{operation}/undo"), csrf.clone());
        async move {
            let headers = [
                ("host", host.as_str()),
                ("origin", origin.as_str()),
                ("cookie", cookie.as_str()),
                ("accept", "text/html"),
            ];
            raw(
                addr,
                "POST",
                &path,
                &headers,
                &format!("csrf={csrf}&plan={pin}"),
            )
            .await
        }
    };
    let stale = undo(undo_preview.field("plan")).await;
    assert_eq!(stale.status, 400, "{stale:?}");
    assert!(
        stale.body.contains("changed since the preview"),
        "{}",
        stale.body
    );
    assert_eq!(
        discards().await,
        4,
        "nothing opened by the stale confirmation"
    );
    let again = raw(
        i.addr,
        "GET",
        &format!("{operation}/undo"),
        &[("host", &host), ("cookie", &cookie)],
        "",
    )
    .await;
    assert!(
        again.body.contains("data-would-act=\"4\""),
        "{}",
        again.body
    );
    let undone = undo(again.field("plan")).await;
    assert_eq!(undone.status, 303, "{undone:?}");
    saga_test_support::wait_until("the undo", Duration::from_secs(60), || async {
        (discards().await == 0).then_some(())
    })
    .await;
}

/// A replay's confirmation is pinned to the keys it releases and the messages parked behind them: 2 parked
/// previewed, 502 parked at confirming, nothing is sent; the reason typed in the form is in the audit log.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replay_confirmation_is_pinned_to_what_it_releases_and_audited_with_its_reason() {
    let i = Inspector::start("inspect-pinned-held", InspectOptions::default()).await;
    let host = i.host();
    let origin = format!("http://{host}");
    let get = |path: String, cookie: Option<String>| {
        let (addr, host) = (i.addr, host.clone());
        async move {
            let mut headers = vec![("host", host.as_str())];
            if let Some(cookie) = &cookie {
                headers.push(("cookie", cookie.as_str()));
            }
            raw(addr, "GET", &path, &headers, "").await
        }
    };
    let groups: serde_json::Value = serde_json::from_str(
        &raw(
            i.addr,
            "GET",
            "/api/groups",
            &[("host", &host), ("accept", "application/json")],
            "",
        )
        .await
        .body,
    )
    .unwrap();
    let id = groups[0]["id"].as_str().unwrap().to_owned();
    // The letter heads its key, which holds two messages behind it.
    sqlx::query(
        "INSERT INTO saga_held_keys (group_id, key, cause, head_letter, head_topic, head_partition, \
             head_offset, parked) \
         SELECT $1, 'order-7'::bytea, 'dead-letter', letter_hash, dlq_topic, dlq_partition, dlq_offset, 2 \
         FROM saga_dead_letters WHERE dlq_topic = $2",
    )
    .bind(&i.group)
    .bind(&i.dlq)
    .execute(&i.db.pool)
    .await
    .unwrap();
    let preview = get(format!("/groups/{id}/plan?action=replay"), None).await;
    assert!(
        preview.body.contains("data-would-act=\"1\""),
        "{}",
        preview.body
    );
    let cookie = format!(
        "saga_admin_session={}",
        preview.cookie("saga_admin_session").unwrap()
    );
    let (csrf, pin) = (preview.csrf(), preview.field("plan"));
    let confirm = |pin: String| {
        let (addr, host, origin, cookie, csrf) = (
            i.addr,
            host.clone(),
            origin.clone(),
            cookie.clone(),
            csrf.clone(),
        );
        let path = format!("/api/groups/{id}/replay");
        async move {
            let headers = [
                ("host", host.as_str()),
                ("origin", origin.as_str()),
                ("cookie", cookie.as_str()),
                ("accept", "text/html"),
            ];
            let body = format!("csrf={csrf}&plan={pin}&reason=INC-9+gateway+fixed");
            raw(addr, "POST", &path, &headers, &body).await
        }
    };
    sqlx::query("UPDATE saga_held_keys SET parked = 502")
        .execute(&i.db.pool)
        .await
        .unwrap();
    let changed = confirm(pin).await;
    assert_eq!(changed.status, 400, "{changed:?}");
    assert!(
        changed.body.contains("changed since the preview") && changed.body.contains("502"),
        "{}",
        changed.body
    );
    assert_eq!(i.sent().await, 0, "nothing sent");

    let again = get(
        format!("/groups/{id}/plan?action=replay"),
        Some(cookie.clone()),
    )
    .await;
    let started = confirm(again.field("plan")).await;
    assert_eq!(started.status, 303, "{started:?}");
    saga_test_support::wait_until("the replay", Duration::from_secs(60), || async {
        (i.sent().await == 1).then_some(())
    })
    .await;
    let log = saga_admin::audit::list(&i.db.pool, &{
        let mut f = saga_admin::audit::AuditFilter::default();
        f.action = Some("dlq replay --group".to_owned());
        f.limit = 10;
        f
    })
    .await
    .unwrap();
    let outcomes: Vec<(&str, &str, &str, Option<&str>)> = log
        .iter()
        .map(|e| {
            (
                e.action.as_str(),
                e.via.as_str(),
                e.outcome.as_str(),
                e.reason.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        outcomes,
        [
            (
                "dlq replay --group",
                "page",
                "done",
                Some("INC-9 gateway fixed")
            ),
            (
                "dlq replay --group",
                "page",
                "refused",
                Some("INC-9 gateway fixed")
            ),
        ]
    );
    assert_eq!(log[0].target["group"], id.as_str());
    assert!(
        log[1].detail.as_deref().unwrap_or_default().contains("502"),
        "{:?}",
        log[1]
    );
}
