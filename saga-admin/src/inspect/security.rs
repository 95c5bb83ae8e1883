//! Who may drive the inspector, checked on every request before any page is rendered.
//!
//! - **Host.** A request must name this inspector: its listening address, `localhost`, `127.0.0.1` or
//!   `[::1]` at its port, or a configured public name. A page of another site that rebinds its own name to
//!   127.0.0.1 (DNS rebinding) sends its own name, and is refused.
//! - **Tokens.** With tokens configured (`SAGA_ADMIN_TOKEN`, or `SAGA_ADMIN_TOKENS=name:token,…`), every
//!   request presents one: `?token=` once (answered with a session of its own, in a cookie that expires
//!   after 12 hours and never holds the token, and a redirect to the same page of this inspector without
//!   it, so the token leaves the address bar and the history), that session's cookie, or
//!   `Authorization: Bearer`. Tokens are compared in constant time; the name of the one presented is the
//!   operator recorded with a replay. A `?token=` link that would replace a live session of another name
//!   (login CSRF) is refused with a page that offers to sign out first (`POST /logout` from that page). A
//!   link the browser does not say was typed or followed from the inspector's own pages (`Sec-Fetch-Site`)
//!   signs in only from a page of the inspector's own (`/login?n=`, a one-time reference, not the token),
//!   whose form the browser sends with its cookies.
//! - **State-changing requests.** A POST must come from this inspector's own page: its `Origin` (or, where
//!   a browser sends none, its `Referer`) must name this inspector (a POST with neither is refused), and it
//!   must carry the session's CSRF token, a value only this inspector's pages contain. A script calling the
//!   API presents its token as `Authorization: Bearer` instead, which a browser never sends on its own:
//!   such a POST needs neither. A read-only inspector refuses every POST.
//! - **Reads from other sites.** A GET another site's page makes (an image, a script, a fetch, a frame),
//!   as the browser's `Sec-Fetch-Site` or an `Origin` says, is refused: only a top-level navigation (a link
//!   followed) may come from elsewhere.
//! - **Every response** forbids framing (`frame-ancestors 'none'`, `X-Frame-Options: DENY`), loads
//!   nothing from elsewhere, and is not cached. Cookies are `HttpOnly; SameSite=Strict`, and `Secure`
//!   when the inspector is told it is served over TLS.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Response};
use sha2::{Digest, Sha256};

use super::pages;

/// The cookie of a signed-in session (a random id the inspector keeps in memory, never the token itself);
/// `__Host-` prefixed when cookies are `Secure`.
const LOGIN_COOKIE: &str = "saga_admin_login";
const SESSION_COOKIE: &str = "saga_admin_session";
/// The most sessions kept at once.
const MAX_LOGINS: usize = 1_000;
/// The most sessions one token keeps at once: past it, that token's own oldest session ends, so that a token
/// holder opening sessions in a loop never signs another operator out.
const MAX_LOGINS_PER_TOKEN: usize = 32;
/// How long a sign-in with `?token=` lasts.
const LOGIN_TTL: std::time::Duration = std::time::Duration::from_secs(12 * 3600);
/// The path that ends a sign-in (a POST from the inspector's own page).
const LOGOUT_PATH: &str = "/logout";
/// The path that finishes a sign-in whose link was followed from another site (a POST from the page that
/// asks).
const LOGIN_PATH: &str = "/login";
/// The form field carrying the CSRF token.
pub(super) const CSRF_FIELD: &str = "csrf";
/// The largest form a POST may carry.
const MAX_FORM_BYTES: usize = 16 * 1024;

/// A token and the name it stands for.
#[derive(Clone)]
#[non_exhaustive]
pub struct NamedToken {
    /// Who presents it: recorded as the operator of the replays made with it.
    pub name: String,
    token: String,
}

impl std::fmt::Debug for NamedToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NamedToken")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl NamedToken {
    /// The shortest token accepted.
    pub const MIN_LEN: usize = 16;

    /// Token `token` of `name`. Fails, saying why, if the name is empty or holds `:` or `,`, or the token
    /// is shorter than [`NamedToken::MIN_LEN`] characters or holds anything but visible ASCII.
    pub fn new(name: &str, token: &str) -> Result<Self, String> {
        if name.trim().is_empty() || name.contains([':', ',']) {
            return Err(format!("{name:?} is no token name"));
        }
        if token.len() < Self::MIN_LEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!(
                "the token of {name} must be at least {} visible ASCII characters",
                Self::MIN_LEN
            ));
        }
        Ok(Self {
            name: name.to_owned(),
            token: token.to_owned(),
        })
    }

    /// Parses `name:token,name:token,…` (`SAGA_ADMIN_TOKENS`).
    pub fn parse_list(list: &str) -> Result<Vec<Self>, String> {
        list.split(',')
            .filter(|item| !item.trim().is_empty())
            .map(|item| {
                let (name, token) = item
                    .trim()
                    .split_once(':')
                    .ok_or_else(|| format!("{:?} is not name:token", redacted(item)))?;
                Self::new(name, token)
            })
            .collect()
    }
}

/// An item of a token list, shown without its token.
fn redacted(item: &str) -> String {
    item.split_once(':')
        .map_or_else(|| "…".to_owned(), |(name, _)| format!("{name}:…"))
}

/// What the guard knows of the inspector.
pub(super) struct Guard {
    /// `host:port` values a request's `Host` may name.
    hosts: Vec<String>,
    /// Public names without a port: any port is accepted with them (a proxy in front decides).
    names: Vec<String>,
    tokens: Vec<NamedToken>,
    read_only: bool,
    secure_cookies: bool,
    /// The secret the sessions' CSRF tokens are derived from, new at every start.
    secret: String,
    /// Who a replay is recorded as when no token names the caller.
    local_operator: String,
    /// Signed-in sessions: their id (the login cookie's value), by the name of the token that signed in,
    /// until when.
    logins: std::sync::Mutex<Logins>,
    /// Sign-ins waiting for their page's button: a one-time reference, by the name it signs in as, where to
    /// go then, until when.
    pending: std::sync::Mutex<Pending>,
}

/// Signed-in sessions: id → (the token's name, until when, when last used).
type Logins = std::collections::HashMap<String, (String, std::time::Instant, std::time::Instant)>;

/// How many sessions `name` holds.
fn sessions_of(logins: &Logins, name: &str) -> usize {
    logins.values().filter(|(n, _, _)| n == name).count()
}

/// Ends `name`'s session used least recently.
fn end_oldest(logins: &mut Logins, name: &str) {
    let oldest = logins
        .iter()
        .filter(|(_, (n, _, _))| n == name)
        .min_by_key(|(_, (_, _, used))| *used)
        .map(|(id, _)| id.clone());
    if let Some(id) = oldest {
        logins.remove(&id);
    }
}

/// The name of the token holding the most sessions.
fn busiest(logins: &Logins) -> Option<String> {
    let mut counts: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for (name, _, _) in logins.values() {
        *counts.entry(name).or_default() += 1;
    }
    counts
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .map(|(name, _)| name.to_owned())
}

/// Sign-ins waiting for their page's button (see [`Guard::pend`]).
type Pending = std::collections::HashMap<String, (String, String, std::time::Instant)>;

impl Guard {
    pub(super) fn new(
        bound: SocketAddr,
        public_names: &[String],
        tokens: Vec<NamedToken>,
        read_only: bool,
        secure_cookies: bool,
    ) -> Self {
        let port = bound.port();
        let mut hosts = vec![
            format!("localhost:{port}"),
            format!("127.0.0.1:{port}"),
            format!("[::1]:{port}"),
            bound.to_string(),
        ];
        let mut names = Vec::new();
        for name in public_names {
            let name = name.trim().to_ascii_lowercase();
            if name.contains(':') && !name.ends_with(']') {
                hosts.push(name);
            } else {
                names.push(name);
            }
        }
        Self {
            hosts,
            names,
            tokens,
            read_only,
            secure_cookies,
            secret: random_hex(),
            local_operator: format!("inspector:{}", crate::dlq::os_user()),
            logins: std::sync::Mutex::default(),
            pending: std::sync::Mutex::default(),
        }
    }

    /// A one-time reference to a sign-in as `name`, going to `location`, for five minutes.
    fn pend(&self, name: &str, location: &str) -> String {
        let reference = random_hex();
        let now = std::time::Instant::now();
        let mut pending = self
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        pending.retain(|_, (_, _, until)| *until > now);
        // As sessions are: one token's pending sign-ins never crowd out another's.
        if pending.values().filter(|(n, _, _)| n == name).count() >= MAX_LOGINS_PER_TOKEN {
            let oldest = pending
                .iter()
                .filter(|(_, (n, _, _))| n == name)
                .min_by_key(|(_, (_, _, until))| *until)
                .map(|(id, _)| id.clone());
            if let Some(id) = oldest {
                pending.remove(&id);
            }
        }
        if pending.len() < MAX_LOGINS {
            pending.insert(
                reference.clone(),
                (
                    name.to_owned(),
                    location.to_owned(),
                    now + std::time::Duration::from_secs(300),
                ),
            );
        }
        reference
    }

    /// The name a pending sign-in of `reference` signs in as.
    fn pending_name(&self, reference: &str) -> Option<String> {
        let pending = self
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        pending
            .get(reference)
            .filter(|(_, _, until)| *until > std::time::Instant::now())
            .map(|(name, _, _)| name.clone())
    }

    /// The pending sign-in of `reference` (its name and where to go), taken: it is used once.
    fn take_pending(&self, reference: &str) -> Option<(String, String)> {
        let mut pending = self
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        pending
            .remove(reference)
            .filter(|(_, _, until)| *until > std::time::Instant::now())
            .map(|(name, location, _)| (name, location))
    }

    /// The login cookie's name: `__Host-` prefixed (bound to this host and path `/`, never set by a
    /// sibling domain) when cookies are `Secure`, which that prefix requires.
    fn login_cookie(&self) -> &'static str {
        if self.secure_cookies {
            "__Host-saga_admin_login"
        } else {
            LOGIN_COOKIE
        }
    }

    /// The name the live session of `headers`' login cookie signed in as.
    fn signed_in(&self, headers: &HeaderMap) -> Option<String> {
        let id = cookie_value(headers, self.login_cookie())?;
        let mut logins = self
            .logins
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = std::time::Instant::now();
        let (name, _, used) = logins.get_mut(&id).filter(|(_, until, _)| *until > now)?;
        *used = now;
        Some(name.clone())
    }

    /// A new session signed in as `name`: its id.
    fn sign_in(&self, name: &str) -> String {
        let id = random_hex();
        let now = std::time::Instant::now();
        let mut logins = self
            .logins
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        logins.retain(|_, (_, until, _)| *until > now);
        // Bounded per token: past its cap, this token's own session used least recently ends.
        while sessions_of(&logins, name) >= MAX_LOGINS_PER_TOKEN {
            end_oldest(&mut logins, name);
        }
        // Bounded in all: past the cap, the least recently used session of the token holding the most ends.
        while logins.len() >= MAX_LOGINS {
            let Some(busiest) = busiest(&logins) else {
                break;
            };
            end_oldest(&mut logins, &busiest);
        }
        logins.insert(id.clone(), (name.to_owned(), now + LOGIN_TTL, now));
        id
    }

    /// Ends the session of `headers`' login cookie.
    fn sign_out(&self, headers: &HeaderMap) {
        if let Some(id) = cookie_value(headers, self.login_cookie()) {
            self.logins
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&id);
        }
    }

    /// Whether `host` (a `Host` header, or an origin's authority) names this inspector.
    fn knows(&self, host: &str) -> bool {
        let host = host.trim().to_ascii_lowercase();
        if self.hosts.contains(&host) {
            return true;
        }
        let without_port = match host.rsplit_once(':') {
            Some((h, port)) if !h.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => h,
            _ => host.as_str(),
        };
        self.names.iter().any(|n| *n == host || *n == without_port)
    }

    /// The CSRF token of session `session`.
    fn csrf_of(&self, session: &str) -> String {
        hex(&Sha256::digest(format!("csrf\0{}\0{session}", self.secret)))
    }

    /// The token presented, by name, if it is one of the inspector's.
    fn token_named(&self, presented: &str) -> Option<&NamedToken> {
        // Every token is compared, in constant time, whatever matched before.
        let mut found = None;
        for t in &self.tokens {
            if constant_time_eq(presented.as_bytes(), t.token.as_bytes()) {
                found = Some(t);
            }
        }
        found
    }

    /// Sets the cookie of `new_session` (a session this answer opens) on `response`.
    fn set_session(&self, response: &mut Response, new_session: Option<&str>) {
        if let Some(new) = new_session
            && let Some(cookie) = self.cookie(SESSION_COOKIE, new)
        {
            response.headers_mut().append(header::SET_COOKIE, cookie);
        }
    }

    fn cookie(&self, name: &str, value: &str) -> Option<HeaderValue> {
        self.cookie_for(name, value, None)
    }

    /// A cookie that expires after `max_age` (zero: at once).
    fn cookie_for(
        &self,
        name: &str,
        value: &str,
        max_age: Option<std::time::Duration>,
    ) -> Option<HeaderValue> {
        let secure = if self.secure_cookies { "; Secure" } else { "" };
        let max_age = max_age.map_or_else(String::new, |d| format!("; Max-Age={}", d.as_secs()));
        HeaderValue::from_str(&format!(
            "{name}={value}; HttpOnly; SameSite=Strict; Path=/{secure}{max_age}"
        ))
        .ok()
    }
}

/// What a request may do, for the pages and the replay: who it is, and its CSRF token.
#[derive(Debug, Clone)]
pub(super) struct Caller {
    /// The operator a replay is recorded as.
    pub operator: String,
    /// The CSRF token the session's forms carry.
    pub csrf: String,
    /// Whether replays are off.
    pub read_only: bool,
    /// Whether a script made the request (its token in `Authorization: Bearer`), not a browser's page.
    pub scripted: bool,
}

/// The fields of a POST's form, as the guard read them (the handler gets an empty body).
#[derive(Debug, Clone, Default)]
pub(super) struct FormFields(Vec<(String, String)>);

impl FormFields {
    /// The (percent-decoded) value of field `name`.
    pub(super) fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The guard as a middleware: see the module documentation.
pub(super) async fn guard(
    State(guard): State<Arc<Guard>>,
    mut request: Request,
    next: Next,
) -> Response {
    let mut response = match check(&guard, &mut request).await {
        Err(refusal) => refusal,
        Ok(Checked::Redirect(response)) => response,
        Ok(Checked::Pass { new_session }) => {
            let mut response = next.run(request).await;
            guard.set_session(&mut response, new_session.as_deref());
            response
        }
    };
    harden(response.headers_mut());
    response
}

enum Checked {
    /// Go on; set this new session's cookie on the answer.
    Pass { new_session: Option<String> },
    /// Answer with this (a sign-in's redirect, or why it was refused; a sign-out's redirect).
    Redirect(Response),
}

async fn check(guard: &Guard, request: &mut Request) -> Result<Checked, Response> {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    if !guard.knows(&host) {
        return Err(refused(
            StatusCode::MISDIRECTED_REQUEST,
            "Refused",
            "This inspector does not answer to that host name.",
        ));
    }

    if cross_site_read(guard, request) {
        return Err(refused(
            StatusCode::FORBIDDEN,
            "Refused",
            "Another site's page asked for this one: open the inspector directly.",
        ));
    }

    let existing = cookie_value(request.headers(), SESSION_COOKIE)
        .filter(|s| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()));
    let new_session = existing.is_none().then(random_hex);
    let session = existing.clone().or(new_session.clone()).unwrap_or_default();

    let mut operator = None;
    // Whether the token came in the Authorization header: a script's request, not a browser's.
    let mut bearer = false;
    if !guard.tokens.is_empty() {
        if let Some(presented) = query_value(request.uri().query(), "token") {
            let Some(named) = guard.token_named(&presented) else {
                return Err(unauthorized());
            };
            let location = without_query_param(request.uri(), "token");
            // A link followed from another site carries no cookie of this one (they are SameSite=Strict),
            // so whether a session would be replaced cannot be seen; a browser that does not say where a
            // navigation came from is taken to be such a link. The sign-in is then finished by this
            // inspector's own form, which the browser sends with its cookies, on a page whose address holds
            // a one-time reference instead of the token.
            if !typed_or_same_origin(request.headers()) {
                let pending = guard.pend(&named.name, &location);
                return Ok(Checked::Redirect(
                    (
                        StatusCode::SEE_OTHER,
                        [(header::LOCATION, format!("{LOGIN_PATH}?n={pending}"))],
                    )
                        .into_response(),
                ));
            }
            return Ok(Checked::Redirect(login(
                guard,
                request.headers(),
                &named.name,
                &location,
                &session,
                new_session.as_deref(),
            )));
        }
        if request.uri().path() == LOGIN_PATH {
            let answer = login_page(
                guard,
                request,
                existing.is_some(),
                &session,
                new_session.as_deref(),
            );
            return Ok(Checked::Redirect(answer.await?));
        }
        let headers = request.headers();
        let authorization = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::to_owned);
        bearer = authorization.is_some();
        let name = match authorization {
            Some(token) => guard.token_named(&token).map(|named| named.name.clone()),
            None => guard.signed_in(headers),
        };
        match name {
            Some(name) => operator = Some(name),
            None => return Err(unauthorized()),
        }
    }

    if request.method() != Method::GET && request.method() != Method::HEAD {
        if guard.read_only {
            return Err(refused(
                StatusCode::FORBIDDEN,
                "Refused",
                "This inspector is read-only.",
            ));
        }
        // A script with a token in the Authorization header: no browser attached it, so no other site can
        // have made this request. Every other POST comes from this inspector's own form, or is refused.
        if !bearer {
            check_own_form(guard, request, existing.is_some(), &session).await?;
        }
    }

    if request.method() == Method::POST && request.uri().path() == LOGOUT_PATH {
        return Ok(Checked::Redirect(signed_out(guard, request.headers())));
    }

    request.extensions_mut().insert(Caller {
        operator: operator.unwrap_or_else(|| guard.local_operator.clone()),
        csrf: guard.csrf_of(&session),
        read_only: guard.read_only,
        scripted: bearer,
    });
    Ok(Checked::Pass { new_session })
}

/// Ends the session of `headers`' login cookie: the answer expires the cookie and goes to the overview.
fn signed_out(guard: &Guard, headers: &HeaderMap) -> Response {
    guard.sign_out(headers);
    let mut response = (StatusCode::SEE_OTHER, [(header::LOCATION, "/")]).into_response();
    if let Some(cookie) =
        guard.cookie_for(guard.login_cookie(), "", Some(std::time::Duration::ZERO))
    {
        response.headers_mut().append(header::SET_COOKIE, cookie);
    }
    response
}

/// The sign-in page of a link followed from another site ([`LOGIN_PATH`]): a GET shows the button that
/// finishes the sign-in, with the session's CSRF token; its POST (this inspector's own form) signs in.
async fn login_page(
    guard: &Guard,
    request: &mut Request,
    existing: bool,
    session: &str,
    new_session: Option<&str>,
) -> Result<Response, Response> {
    let reference = query_value(request.uri().query(), "n").unwrap_or_default();
    if request.method() == Method::POST {
        check_own_form(guard, request, existing, session).await?;
        let fields = request
            .extensions()
            .get::<FormFields>()
            .cloned()
            .unwrap_or_default();
        return Ok(
            match guard.take_pending(fields.get("n").unwrap_or_default()) {
                Some((name, location)) => {
                    login(guard, request.headers(), &name, &location, session, None)
                }
                None => expired_sign_in(),
            },
        );
    }
    Ok(match guard.pending_name(&reference) {
        Some(name) => {
            let mut response = Html(pages::confirm_login(
                &name,
                LOGIN_PATH,
                &[
                    (CSRF_FIELD, guard.csrf_of(session).as_str()),
                    ("n", reference.as_str()),
                ],
            ))
            .into_response();
            guard.set_session(&mut response, new_session);
            response
        }
        None => expired_sign_in(),
    })
}

/// A sign-in as `name` (whose token was presented): a session of its own (the token never goes into a
/// cookie), and a redirect to `location`, a path of this inspector. A sign-in that would replace a live
/// session of another name (an attacker's link, so that the victim acts under the attacker's name) is
/// refused with a page that says so and offers to sign out first. The answer, whichever.
fn login(
    guard: &Guard,
    headers: &HeaderMap,
    name: &str,
    location: &str,
    session: &str,
    new_session: Option<&str>,
) -> Response {
    if let Some(current) = guard.signed_in(headers)
        && current != name
    {
        let mut response = (
            StatusCode::CONFLICT,
            Html(pages::replace_login(
                &current,
                name,
                LOGOUT_PATH,
                CSRF_FIELD,
                &guard.csrf_of(session),
            )),
        )
            .into_response();
        guard.set_session(&mut response, new_session);
        return response;
    }
    let mut response = (StatusCode::SEE_OTHER, [(header::LOCATION, location)]).into_response();
    // Signed in as this name already: the session goes on, no second one is opened.
    if guard.signed_in(headers).is_some() {
        return response;
    }
    let id = guard.sign_in(name);
    if let Some(cookie) = guard.cookie_for(guard.login_cookie(), &id, Some(LOGIN_TTL)) {
        response.headers_mut().append(header::SET_COOKIE, cookie);
    }
    response
}

fn expired_sign_in() -> Response {
    refused(
        StatusCode::UNAUTHORIZED,
        "Sign-in expired",
        "This sign-in link was used or has expired: open the link with the token again.",
    )
}

/// Whether the browser says this navigation was typed (or bookmarked) or made from this inspector's own
/// pages (`Sec-Fetch-Site: none` or `same-origin`).
fn typed_or_same_origin(headers: &HeaderMap) -> bool {
    headers
        .get("sec-fetch-site")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|site| {
            site.eq_ignore_ascii_case("same-origin") || site.eq_ignore_ascii_case("none")
        })
}

/// `path` as a path of this inspector: leading slashes and backslashes become one slash.
fn local_path(path: &str) -> String {
    format!("/{}", path.trim_start_matches(['/', '\\']))
}

/// Refuses a POST that does not come from this inspector's own page: its origin (see [`same_origin`]) and
/// the session's CSRF token in its form, which is read here (the handler gets an empty body).
async fn check_own_form(
    guard: &Guard,
    request: &mut Request,
    has_session: bool,
    session: &str,
) -> Result<(), Response> {
    if !same_origin(guard, request.headers()) {
        return Err(refused(
            StatusCode::FORBIDDEN,
            "Refused",
            "A replay must come from this inspector's own page.",
        ));
    }
    let body = std::mem::replace(request.body_mut(), Body::empty());
    let form = axum::body::to_bytes(body, MAX_FORM_BYTES)
        .await
        .unwrap_or_default();
    let presented = form_value(&form, CSRF_FIELD).unwrap_or_default();
    let valid =
        has_session && constant_time_eq(presented.as_bytes(), guard.csrf_of(session).as_bytes());
    if valid {
        let fields = std::str::from_utf8(&form)
            .unwrap_or_default()
            .split('&')
            .filter(|pair| !pair.is_empty())
            .map(|pair| {
                let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
                (percent_decode(name), percent_decode(value))
            })
            .collect();
        request.extensions_mut().insert(FormFields(fields));
        Ok(())
    } else {
        Err(refused(
            StatusCode::FORBIDDEN,
            "Refused",
            "The form's token is missing or stale: open the page again and confirm from there.",
        ))
    }
}

/// Whether a read (GET or HEAD) was made by another site's page, as a browser says it: `Sec-Fetch-Site`
/// other than `same-origin` or `none` (typed, bookmarked) for anything but a top-level navigation (a link
/// followed, which shows the page to its user only), or an `Origin` that does not name this inspector. An
/// image, a script, a fetch or a frame of another site is refused; a script or Prometheus, which send
/// neither header, is not.
fn cross_site_read(guard: &Guard, request: &Request) -> bool {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return false;
    }
    let headers = request.headers();
    let value = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_ascii_lowercase)
    };
    if let Some(site) = value("sec-fetch-site")
        && site != "same-origin"
        && site != "none"
    {
        let navigation = value("sec-fetch-mode").as_deref() == Some("navigate")
            && value("sec-fetch-dest").is_none_or(|d| d == "document");
        if !navigation {
            return true;
        }
    }
    match value("origin") {
        Some(origin) => {
            let authority = origin.split_once("://").map_or("", |(_, rest)| {
                rest.split(['/', '?', '#']).next().unwrap_or("")
            });
            origin == "null" || authority.contains('@') || !guard.knows(authority)
        }
        None => false,
    }
}

/// Whether a state-changing request comes from this inspector's own page: its `Origin`, or else its
/// `Referer`, names a host the inspector answers to. Neither: refused.
fn same_origin(guard: &Guard, headers: &HeaderMap) -> bool {
    let header_value = |name| {
        headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
    };
    let source = header_value(header::ORIGIN)
        .filter(|o| *o != "null")
        .or_else(|| header_value(header::REFERER));
    let Some(source) = source else {
        return false;
    };
    let Some((scheme, rest)) = source.split_once("://") else {
        return false;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host = header_value(header::HOST).unwrap_or_default();
    matches!(scheme, "http" | "https")
        && !authority.contains('@')
        && authority.eq_ignore_ascii_case(host)
        && guard.knows(authority)
}

/// The headers every answer carries.
fn harden(headers: &mut HeaderMap) {
    for (name, value) in [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'; \
             frame-ancestors 'none'; base-uri 'none'",
        ),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "same-origin"),
        (header::CACHE_CONTROL, "no-store"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
}

fn refused(status: StatusCode, title: &str, text: &str) -> Response {
    (status, Html(pages::message(title, text))).into_response()
}

fn unauthorized() -> Response {
    refused(
        StatusCode::UNAUTHORIZED,
        "Token required",
        "This inspector requires a token: open it as /?token=… once.",
    )
}

/// The value of `name` in cookie headers.
fn cookie_value(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| {
            c.trim()
                .strip_prefix(name)
                .and_then(|rest| rest.strip_prefix('='))
                .map(str::to_owned)
        })
}

/// The (percent-decoded) value of `name` in a query string.
fn query_value(query: Option<&str>, name: &str) -> Option<String> {
    form_value(query?.as_bytes(), name)
}

/// The (percent-decoded) value of `name` in an `application/x-www-form-urlencoded` text.
fn form_value(form: &[u8], name: &str) -> Option<String> {
    let text = std::str::from_utf8(form).ok()?;
    text.split('&').find_map(|pair| {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        (percent_decode(key) == name).then(|| percent_decode(value))
    })
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len()
                && bytes[i + 1].is_ascii_hexdigit()
                && bytes[i + 2].is_ascii_hexdigit() =>
            {
                let digit = |b: u8| match b {
                    b'0'..=b'9' => b - b'0',
                    b'a'..=b'f' => b - b'a' + 10,
                    _ => b - b'A' + 10,
                };
                out.push(digit(bytes[i + 1]) * 16 + digit(bytes[i + 2]));
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The request's path and query without parameter `name` (however its name is encoded), as a path of this
/// inspector: leading slashes and backslashes become one slash, so that `//evil.example/` is no address of
/// another host.
fn without_query_param(uri: &axum::http::Uri, name: &str) -> String {
    let kept: Vec<&str> = uri
        .query()
        .unwrap_or_default()
        .split('&')
        .filter(|pair| {
            !pair.is_empty() && percent_decode(pair.split('=').next().unwrap_or_default()) != name
        })
        .collect();
    let path = local_path(uri.path());
    if kept.is_empty() {
        path
    } else {
        format!("{path}?{}", kept.join("&"))
    }
}

/// Whether `a` and `b` are equal, in a time that depends on their lengths only: both are hashed first, and
/// the digests compared without stopping at the first difference.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let (a, b) = (Sha256::digest(a), Sha256::digest(b));
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

/// 32 random bytes as hex.
fn random_hex() -> String {
    let mut bytes = Vec::with_capacity(32);
    bytes.extend_from_slice(uuid::Uuid::new_v4().as_bytes());
    bytes.extend_from_slice(uuid::Uuid::new_v4().as_bytes());
    hex(&bytes)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(public: &[&str]) -> Guard {
        Guard::new(
            "127.0.0.1:8081".parse().unwrap(),
            &public.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>(),
            Vec::new(),
            false,
            false,
        )
    }

    #[test]
    fn a_token_opening_sessions_in_a_loop_signs_no_one_else_out() {
        let g = guard(&[]);
        let alice = g.sign_in("alice");
        let mallory: Vec<String> = (0..MAX_LOGINS + 10).map(|_| g.sign_in("mallory")).collect();
        let logins = g.logins.lock().unwrap();
        assert!(logins.contains_key(&alice), "alice's session survives");
        assert_eq!(sessions_of(&logins, "mallory"), MAX_LOGINS_PER_TOKEN);
        assert!(
            logins.contains_key(mallory.last().unwrap()),
            "the newest session of the busy token is kept"
        );
        assert!(!logins.contains_key(&mallory[0]), "its oldest ended");
        drop(logins);
        // A session in use outlives idle ones of its token: its oldest, just used, is kept; the least
        // recently used ends first.
        let mut used = axum::http::HeaderMap::new();
        used.insert(
            axum::http::header::COOKIE,
            format!(
                "{LOGIN_COOKIE}={}",
                mallory[MAX_LOGINS + 10 - MAX_LOGINS_PER_TOKEN]
            )
            .parse()
            .unwrap(),
        );
        assert_eq!(g.signed_in(&used).as_deref(), Some("mallory"));
        g.sign_in("mallory");
        assert_eq!(
            g.signed_in(&used).as_deref(),
            Some("mallory"),
            "in use, kept"
        );
    }

    #[test]
    fn only_the_inspectors_own_names_are_known_hosts() {
        let g = guard(&["inspector.example.com", "ops.internal:9000"]);
        for ok in [
            "127.0.0.1:8081",
            "localhost:8081",
            "LOCALHOST:8081",
            "[::1]:8081",
            "inspector.example.com",
            "inspector.example.com:443",
            "ops.internal:9000",
        ] {
            assert!(g.knows(ok), "{ok}");
        }
        for refused in [
            "",
            "evil.example:8081",
            "127.0.0.1:8082",
            "localhost",
            "ops.internal:9001",
            "inspector.example.com.evil.example",
        ] {
            assert!(!g.knows(refused), "{refused}");
        }
    }

    #[test]
    fn tokens_parse_by_name_and_short_or_malformed_ones_are_refused() {
        let tokens =
            NamedToken::parse_list("alice:aaaaaaaaaaaaaaaaaaaa, bob:bbbbbbbbbbbbbbbbbbbb").unwrap();
        assert_eq!(
            tokens.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
            ["alice", "bob"]
        );
        let short = NamedToken::parse_list("alice:short").unwrap_err();
        assert!(short.contains("at least 16"), "{short}");
        let no_name = NamedToken::parse_list("aaaaaaaaaaaaaaaaaaaaaaaa").unwrap_err();
        assert!(
            !no_name.contains("aaaa"),
            "the token is not echoed: {no_name}"
        );
        assert!(constant_time_eq(b"same", b"same"));
        assert!(!constant_time_eq(b"same", b"sane"));
        assert!(!constant_time_eq(b"same", b"same-but-longer"));
    }

    #[test]
    fn a_token_in_the_address_is_removed_from_it_and_forms_decode() {
        let uri: axum::http::Uri = "/dlq/t?token=abc&x=1".parse().unwrap();
        assert_eq!(without_query_param(&uri, "token"), "/dlq/t?x=1");
        let uri: axum::http::Uri = "/?token=abc".parse().unwrap();
        assert_eq!(without_query_param(&uri, "token"), "/");
        // However the name is encoded; and never to another host.
        let uri: axum::http::Uri = "/?%74oken=abc&x=1".parse().unwrap();
        assert_eq!(without_query_param(&uri, "token"), "/?x=1");
        for (address, local) in [
            ("//evil.example/?token=abc", "/evil.example/"),
            ("/\\evil.example/?token=abc", "/evil.example/"),
            ("///evil.example?token=abc", "/evil.example"),
        ] {
            let uri: axum::http::Uri = address.parse().unwrap();
            assert_eq!(without_query_param(&uri, "token"), local, "{address}");
        }
        assert_eq!(
            form_value(b"a=1&csrf=ab%2Fcd+e&z", "csrf").as_deref(),
            Some("ab/cd e")
        );
        assert_eq!(form_value(b"a=1", "csrf"), None);
        assert_eq!(percent_decode("100%"), "100%");
    }
}
