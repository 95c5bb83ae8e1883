//! The start-up check of the broker: a metadata request, and what the client's errors say about the setting
//! at fault. A refused password, a certificate the client cannot verify, a plaintext client at a TLS
//! listener are reported at once, as one line naming the setting (they do not mend themselves by waiting);
//! a broker that does not answer is reported once the start-up timeout is up.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;

use crate::config::{ConfigProblem, STARTUP_TIMEOUT};
use crate::kafka::{KafkaConfig, client_config};

/// What the probe's client reported (its error events and its error log lines), as they came.
#[derive(Default)]
struct ProbeContext {
    reasons: Mutex<Vec<Reason>>,
}

/// One report of the client, and when it came.
#[derive(Clone, Debug)]
struct Reason {
    at: Instant,
    text: String,
}

impl ProbeContext {
    fn push(&self, text: String) {
        // librdkafka's thread prefix (`[thrd:…]: `) says nothing to an operator.
        let text = match text
            .strip_prefix("[thrd:")
            .and_then(|t| t.split_once("]: "))
        {
            Some((_, rest)) => rest.to_owned(),
            None => text,
        };
        self.reasons
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(Reason {
                at: Instant::now(),
                text,
            });
    }

    fn reasons(&self) -> Vec<Reason> {
        self.reasons
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

impl ClientContext for ProbeContext {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        // Kept for the diagnosis, not logged: the line the probe ends with says what matters. A failed
        // connection (`FAIL`) is logged at the informational level, with librdkafka's hint at its cause.
        let worth = match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error
            | RDKafkaLogLevel::Warning => true,
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => facility == "FAIL",
            RDKafkaLogLevel::Debug => false,
        };
        if worth {
            self.push(message.to_owned());
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.push(if reason.is_empty() {
            error.to_string()
        } else {
            reason.to_owned()
        });
    }
}

impl ConsumerContext for ProbeContext {}

/// How long the first metadata request of the probe may take before the client's reports are read.
const ATTEMPT: Duration = Duration::from_millis(500);

/// The most reports (error events, log lines) read each time.
const EVENTS_PER_ATTEMPT: usize = 256;

/// Checks that a broker answers a metadata request at `config.brokers` within [`STARTUP_TIMEOUT`], with the
/// configured security; `var` names the setting that chose the brokers. A client that the broker refuses
/// (its credentials, its certificate, its protocol) is a [`ConfigProblem`] naming the setting to change, as
/// soon as the client says so; so is a broker that does not answer in time. The check stops where the
/// future is dropped (a shutdown racing it).
pub async fn probe(config: &KafkaConfig, var: &str) -> Result<(), ConfigProblem> {
    match attempt(config, var).await? {
        Outcome::Answered | Outcome::Stopped => Ok(()),
        Outcome::Refused(problem) | Outcome::Suspected(problem) => Err(problem),
        Outcome::Unanswered(detail) => Err(unanswered(config, var, &detail)),
    }
}

/// Like [`probe`], but a broker that does not answer is logged and waited out by the caller's clients:
/// only a refusal (credentials, certificate, protocol) is a [`ConfigProblem`]. For what runs in a library
/// whose documentation promises that an outage of the broker is never fatal.
pub async fn refusal(config: &KafkaConfig, var: &str) -> Result<(), ConfigProblem> {
    match attempt(config, var).await? {
        Outcome::Answered | Outcome::Stopped => Ok(()),
        Outcome::Refused(problem) => Err(problem),
        // What a broker that is down or starting can also cause is waited out here, named in the log.
        Outcome::Suspected(problem) => {
            tracing::warn!(
                brokers = %config.brokers,
                suspected = %problem,
                "no Kafka broker answers yet; waiting for one"
            );
            Ok(())
        }
        Outcome::Unanswered(detail) => {
            tracing::warn!(
                brokers = %config.brokers,
                detail = %shown(&detail),
                "no Kafka broker answers yet; waiting for one"
            );
            Ok(())
        }
    }
}

/// Sets its flag when dropped: the probe's thread stops at its next attempt.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Asks for metadata until a broker answers, refuses the client, the start-up timeout passes or the
/// caller's future is dropped.
async fn attempt(config: &KafkaConfig, var: &str) -> Result<Outcome, ConfigProblem> {
    let client: BaseConsumer<ProbeContext> = client_config(config)
        // Informational lines and worse reach the context, which keeps what the diagnosis reads (the level
        // is set on the client after its properties: `log_level` would be overridden).
        .set_log_level(RDKafkaLogLevel::Info)
        .create_with_context(ProbeContext::default())
        .map_err(|e| creation_problem(&e, var))?;
    let checked = config.clone();
    let stop = StopOnDrop(Arc::new(AtomicBool::new(false)));
    let stopped = stop.0.clone();
    let outcome = tokio::task::spawn_blocking(move || watch(&client, &checked, &stopped))
        .await
        .map_err(|e| unanswered(config, var, &e.to_string()))?;
    drop(stop);
    Ok(outcome)
}

/// Metadata requests until one is answered, each waiting twice as long as the one before (from
/// [`ATTEMPT`]: a large cluster's answer may take a while), the client's reports read between them for a
/// refusal. The requests run on this thread, so the client ends with the outcome: a refused login is not
/// retried behind the caller's back.
fn watch(
    client: &BaseConsumer<ProbeContext>,
    config: &KafkaConfig,
    stopped: &AtomicBool,
) -> Outcome {
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    let mut wait = ATTEMPT;
    loop {
        if stopped.load(Ordering::Relaxed) {
            return Outcome::Stopped;
        }
        let asked = Instant::now();
        let left = deadline.saturating_duration_since(asked);
        let answered = client
            .fetch_metadata(None, wait.min(left).max(Duration::from_millis(1)))
            .map(drop)
            .map_err(|e| e.to_string());
        // Error events and log lines reach the context only when the client is polled, one per call.
        for _ in 0..EVENTS_PER_ATTEMPT {
            let _ = client.poll(Duration::ZERO);
        }
        let reasons = client.context().reasons();
        match answered {
            Ok(()) => return Outcome::Answered,
            Err(error) if Instant::now() >= deadline => return timed_out(&reasons, config, error),
            Err(_) => {}
        }
        if let Some(outcome) = diagnose(&reasons, config) {
            return outcome;
        }
        // A request refused at once (no broker up yet) is not repeated in a busy loop.
        std::thread::sleep(ATTEMPT.saturating_sub(asked.elapsed()).min(left));
        wait = (wait * 2).min(Duration::from_secs(4));
    }
}

/// The outcome once the metadata request failed (`error`): a refusal the reports name, else what the
/// client said last of a broker (not only that they are down), or the request's own error.
fn timed_out(reasons: &[Reason], config: &KafkaConfig, error: String) -> Outcome {
    if let Some(outcome) = diagnose(reasons, config) {
        return outcome;
    }
    if let Some(problem) = diagnose_at_timeout(reasons, config) {
        return Outcome::Suspected(problem);
    }
    let detail = reasons
        .iter()
        .rev()
        .find(|r| !r.text.contains("brokers are down"))
        .or(reasons.last())
        .map_or(error, |r| r.text.clone());
    Outcome::Unanswered(detail)
}

/// How the probe ended.
enum Outcome {
    /// A broker answered the metadata request.
    Answered,
    /// The broker refused the client: the setting to change.
    Refused(ConfigProblem),
    /// A cause a broker that is down or restarting can also produce persisted: a refusal where the broker
    /// must answer at start, waited out where an outage is never fatal ([`refusal`]).
    Suspected(ConfigProblem),
    /// Nothing answered within the start-up timeout: what the client said last.
    Unanswered(String),
    /// The caller stopped waiting.
    Stopped,
}

/// No broker answered at `config.brokers`, named by `var`.
fn unanswered(config: &KafkaConfig, var: &str, detail: &str) -> ConfigProblem {
    ConfigProblem::new(
        var,
        format!(
            "no Kafka broker answers at {} ({})",
            config.brokers,
            shown(detail)
        ),
        format!("start the broker or point {var} at a running one"),
    )
}

/// A client that librdkafka would not create: a file it could not read or parse, a property it refuses.
fn creation_problem(error: &KafkaError, var: &str) -> ConfigProblem {
    let text = match error {
        // A refused property's value could be a secret: name the property only.
        KafkaError::ClientConfig(_, description, name, _) => {
            format!("{description} (property {name})")
        }
        other => other.to_string(),
    };
    let setting = [
        ("ssl.key", "KAFKA_SSL_KEY_LOCATION"),
        ("ssl.certificate", "KAFKA_SSL_CERTIFICATE_LOCATION"),
        ("ssl.ca", "KAFKA_SSL_CA_LOCATION"),
        ("sasl.mechanism", "KAFKA_SASL_MECHANISM"),
        ("security.protocol", "KAFKA_SECURITY_PROTOCOL"),
    ]
    .iter()
    .find(|(property, _)| text.contains(property))
    .map_or(var, |(_, setting)| setting);
    let fix = if text.contains("bad decrypt") {
        "check KAFKA_SSL_KEY_PASSWORD, the passphrase of the key"
    } else {
        "fix the setting (the Kafka client could not be created)"
    };
    ConfigProblem::new(setting, shown(&text), fix)
}

/// How long a cause that a restarting broker could also produce must keep being reported before it is
/// taken for the client's setting.
const PERSISTENCE: Duration = Duration::from_secs(2);

/// How many times such a cause must be reported, at least, within [`PERSISTENCE`] or more (a report that
/// says librdkafka suppressed identical ones counts them too).
const PERSISTENT_REPORTS: usize = 3;

/// How many times a report stands for: itself, and the identical ones librdkafka says it suppressed
/// (`…, 2 identical error(s) suppressed)`).
fn weight(text: &str) -> usize {
    text.split_once(" identical error(s) suppressed")
        .and_then(|(before, _)| before.rsplit([' ', '(']).next())
        .and_then(|n| n.parse::<usize>().ok())
        .map_or(1, |n| n.saturating_add(1))
}

/// The setting a refusal names, what happened and what to do, from the client's reasons; `None` when they
/// say nothing decisive yet (a broker that is starting may still answer). A cause only a client's setting
/// produces is decisive at once; one that a broker restarting or a network dropping connections can also
/// produce (a connection closed at the first request, a handshake cut short, a token endpoint that does
/// not answer) only once it persisted.
fn diagnose(reasons: &[Reason], config: &KafkaConfig) -> Option<Outcome> {
    let oauthbearer = config
        .properties
        .iter()
        .rev()
        .find(|(name, _)| name == "sasl.mechanism" || name == "sasl.mechanisms")
        .is_some_and(|(_, value)| value.trim().eq_ignore_ascii_case("OAUTHBEARER"));
    let causes: Vec<(&Reason, Cause)> = reasons
        .iter()
        .filter_map(|r| Cause::of(&r.text, oauthbearer).map(|c| (r, c)))
        .collect();
    if let Some((reason, cause)) = causes.iter().find(|(_, c)| c.decisive()) {
        return Some(Outcome::Refused(
            cause.problem(&reason.text, &config.brokers),
        ));
    }
    persistent(&causes, PERSISTENT_REPORTS, PERSISTENCE)
        .map(|(reason, cause)| Outcome::Suspected(cause.problem(&reason.text, &config.brokers)))
}

/// The first cause reported at least `reports` times (suppressed ones counted) over at least `span`.
fn persistent<'a>(
    causes: &[(&'a Reason, Cause)],
    reports: usize,
    span: Duration,
) -> Option<(&'a Reason, Cause)> {
    causes.iter().find_map(|(first, cause)| {
        let same: Vec<&Reason> = causes
            .iter()
            .filter(|(_, c)| c == cause)
            .map(|(r, _)| *r)
            .collect();
        let last = same.last()?;
        let count: usize = same.iter().map(|r| weight(&r.text)).sum();
        (count >= reports && last.at.duration_since(first.at) >= span).then_some((*first, *cause))
    })
}

/// At the start-up timeout: a cause a restarting broker could also produce, reported twice or more in all
/// that time with no answer between, is taken for the setting rather than for a broker that is down.
fn diagnose_at_timeout(reasons: &[Reason], config: &KafkaConfig) -> Option<ConfigProblem> {
    let causes: Vec<(&Reason, Cause)> = reasons
        .iter()
        .filter_map(|r| Cause::of(&r.text, false).map(|c| (r, c)))
        .collect();
    persistent(&causes, 2, Duration::ZERO)
        .map(|(reason, cause)| cause.problem(&reason.text, &config.brokers))
}

/// What a client's report says about its settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    /// The broker refused the user name and password (decisive).
    Credentials,
    /// The broker refused the OAuth token (decisive).
    Token,
    /// The broker does not take the mechanism (decisive).
    Mechanism,
    /// The broker's certificate could not be verified (decisive).
    BrokerCertificate,
    /// The broker refused the client's certificate, or asked for one (decisive).
    ClientCertificate,
    /// The client's key could not be decrypted (decisive).
    KeyPassword,
    /// A plaintext client at a TLS or SASL listener: the connection closes at the first requests.
    PlaintextAtSecured,
    /// A TLS client at a plaintext listener.
    TlsAtPlaintext,
    /// A TLS handshake that failed without saying why.
    Handshake,
    /// librdkafka's OIDC client got no token from the endpoint.
    NoToken,
}

impl Cause {
    /// The cause one report names, if any; `oauthbearer` when the client authenticates by token.
    fn of(text: &str, oauthbearer: bool) -> Option<Self> {
        let r = text.to_ascii_lowercase();
        let has = |words: &[&str]| words.iter().any(|w| r.contains(w));
        Some(if has(&["failed to acquire sasl oauthbearer token"]) {
            Self::NoToken
        } else if has(&[
            "sasl authentication error",
            "authentication failed",
            "invalid credentials",
        ]) {
            if oauthbearer {
                Self::Token
            } else {
                Self::Credentials
            }
        } else if has(&["unsupported sasl mechanism"]) {
            Self::Mechanism
        } else if has(&["bad decrypt"]) {
            Self::KeyPassword
        } else if has(&[
            "certificate required",
            "peer did not return a certificate",
            "alert unknown ca",
            "alert bad certificate",
            "alert certificate unknown",
        ]) {
            Self::ClientCertificate
        } else if has(&["certificate verify failed", "could not be verified"]) {
            Self::BrokerCertificate
        } else if has(&[
            "connecting to a plaintext",
            "wrong version number",
            "packet length too long",
        ]) {
            Self::TlsAtPlaintext
        } else if has(&["connecting to a ssl listener", "might require sasl"])
            || (r.contains("disconnected") && r.contains("state apiversion_query"))
        {
            Self::PlaintextAtSecured
        } else if has(&["ssl handshake failed"]) {
            Self::Handshake
        } else {
            return None;
        })
    }

    /// Whether only the client's settings produce it (else it must persist to count).
    fn decisive(self) -> bool {
        !matches!(
            self,
            Self::PlaintextAtSecured | Self::TlsAtPlaintext | Self::Handshake | Self::NoToken
        )
    }

    /// The line naming the setting, with the report (`text`) as it came, for the brokers `at`.
    fn problem(self, text: &str, at: &str) -> ConfigProblem {
        let (setting, what, fix): (&str, String, &str) = match self {
            Self::Credentials => (
                "KAFKA_SASL_PASSWORD",
                format!("the broker at {at} refused the SASL credentials"),
                "check KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD (and KAFKA_SASL_MECHANISM)",
            ),
            Self::Token => (
                "KAFKA_SASL_OAUTHBEARER_CLIENT_ID",
                format!("the broker at {at} refused the OAuth token"),
                "check the client id, its secret and KAFKA_SASL_OAUTHBEARER_SCOPE, and that the broker \
                 trusts the token endpoint's issuer",
            ),
            Self::Mechanism => (
                "KAFKA_SASL_MECHANISM",
                format!("the broker at {at} does not take this SASL mechanism"),
                "set it to one the broker lists",
            ),
            Self::BrokerCertificate => (
                "KAFKA_SSL_CA_LOCATION",
                format!(
                    "the certificate of the broker at {at} could not be verified: its CA is not one the \
                     client trusts, or it names another host, or it expired"
                ),
                "point KAFKA_SSL_CA_LOCATION at the CA that signed it, and the brokers' addresses at the \
                 names it holds",
            ),
            Self::ClientCertificate => (
                "KAFKA_SSL_CERTIFICATE_LOCATION",
                format!(
                    "the broker at {at} refused the client certificate, or asks for one (mutual TLS)"
                ),
                "set KAFKA_SSL_CERTIFICATE_LOCATION and KAFKA_SSL_KEY_LOCATION to a certificate signed by \
                 a CA the broker trusts",
            ),
            Self::KeyPassword => (
                "KAFKA_SSL_KEY_PASSWORD",
                "the client's private key could not be decrypted".to_owned(),
                "check KAFKA_SSL_KEY_PASSWORD, the passphrase of KAFKA_SSL_KEY_LOCATION",
            ),
            Self::PlaintextAtSecured => (
                "KAFKA_SECURITY_PROTOCOL",
                format!(
                    "the listener at {at} keeps closing the connection at the client's first requests; it \
                     takes another protocol, most likely TLS or SASL"
                ),
                "set it to what the listener takes (ssl or sasl_ssl for a TLS listener)",
            ),
            Self::TlsAtPlaintext => (
                "KAFKA_SECURITY_PROTOCOL",
                format!("the listener at {at} does not speak TLS"),
                "set it to what the listener takes (plaintext or sasl_plaintext)",
            ),
            Self::Handshake => (
                "KAFKA_SSL_CA_LOCATION",
                format!("the TLS handshake with the broker at {at} keeps failing"),
                "check KAFKA_SSL_CA_LOCATION, the client certificate and KAFKA_SECURITY_PROTOCOL",
            ),
            Self::NoToken => (
                "KAFKA_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL",
                "librdkafka's OIDC client gets no token from the endpoint".to_owned(),
                "check the endpoint, KAFKA_SASL_OAUTHBEARER_CLIENT_ID and its secret",
            ),
        };
        ConfigProblem::new(setting, format!("{what} ({})", shown(text)), fix)
    }
}

/// A reason as a line may show it: what the broker or the client said is bounded and has no control
/// characters (a broker's error text is input like any other).
fn shown(reason: &str) -> String {
    const MOST: usize = 300;
    let clean: String = reason
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    match clean.char_indices().nth(MOST) {
        Some((cut, _)) => format!("{}…", &clean[..cut]),
        None => clean,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reports `texts`, `every` apart.
    fn reports(texts: &[&str], every: Duration) -> Vec<Reason> {
        let start = Instant::now();
        (0u32..)
            .zip(texts)
            .map(|(i, text)| Reason {
                at: start + every * i,
                text: (*text).to_owned(),
            })
            .collect()
    }

    fn diagnosed(texts: &[&str], every: Duration, config: &KafkaConfig) -> Option<String> {
        diagnose(&reports(texts, every), config).and_then(|o| match o {
            Outcome::Refused(p) | Outcome::Suspected(p) => Some(p.setting),
            _ => None,
        })
    }

    const VERIFY: &str = "ssl://127.0.0.1:9093/bootstrap: SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: broker certificate could not be verified, verify that ssl.ca.location is correctly configured or root CA certificates are installed";
    const TO_SSL: &str = "127.0.0.1:9093/bootstrap: Disconnected while requesting ApiVersion: might be caused by incorrect security.protocol configuration (connecting to a SSL listener?) or broker version is < 0.10 (see api.version.request)";
    const CLOSED: &str = "127.0.0.1:9093/bootstrap: Disconnected: connection closed by peer: receive 0 after POLLIN (after 0ms in state APIVERSION_QUERY)";

    #[test]
    fn a_refusal_only_a_setting_makes_names_its_setting_at_once() {
        let plain = KafkaConfig::new("127.0.0.1:9093");
        let cases = [
            (
                "SASL authentication error: Authentication failed during authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512",
                "KAFKA_SASL_PASSWORD",
            ),
            (VERIFY, "KAFKA_SSL_CA_LOCATION"),
            (
                "SSL handshake failed: error:0A00045C:SSL routines::tlsv13 alert certificate required",
                "KAFKA_SSL_CERTIFICATE_LOCATION",
            ),
            (
                "SSL handshake failed: error:0A000418:SSL routines::tlsv1 alert unknown ca",
                "KAFKA_SSL_CERTIFICATE_LOCATION",
            ),
            (
                "ssl.key.location failed: error:1C800064:Provider routines::bad decrypt",
                "KAFKA_SSL_KEY_PASSWORD",
            ),
            (
                "Unsupported SASL mechanism: broker only supports PLAIN",
                "KAFKA_SASL_MECHANISM",
            ),
        ];
        for (reason, setting) in cases {
            assert_eq!(
                diagnosed(&[reason], Duration::ZERO, &plain).as_deref(),
                Some(setting),
                "{reason}"
            );
        }
        let by_token =
            KafkaConfig::new("127.0.0.1:9093").with_property("sasl.mechanism", "OAUTHBEARER");
        assert_eq!(
            diagnosed(&[cases[0].0], Duration::ZERO, &by_token).as_deref(),
            Some("KAFKA_SASL_OAUTHBEARER_CLIENT_ID")
        );
        assert_eq!(
            diagnosed(
                &["127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused";
                    9],
                Duration::from_secs(1),
                &plain
            ),
            None,
            "a broker that is down is waited for"
        );
    }

    #[test]
    fn what_a_restarting_broker_also_causes_counts_only_once_it_persisted() {
        let config = KafkaConfig::new("127.0.0.1:9093");
        for reason in [
            TO_SSL,
            CLOSED,
            "127.0.0.1:9093/bootstrap: Disconnected: verify that security.protocol is correctly configured, broker might require SASL authentication",
            "127.0.0.1:9092/bootstrap: SSL handshake failed: Disconnected: connecting to a PLAINTEXT broker listener?",
            "127.0.0.1:9093/bootstrap: SSL handshake failed: error:0A000410:SSL routines::sslv3 alert handshake failure",
            "Failed to acquire SASL OAUTHBEARER token: Failed to retrieve OIDC token from \"https://idp/token\": 503",
        ] {
            // A broker restarting: a few closes within a second.
            assert_eq!(
                diagnosed(&[reason; 4], Duration::from_millis(200), &config),
                None,
                "{reason}"
            );
            // Two reports far apart are not yet a pattern.
            assert_eq!(
                diagnosed(&[reason; 2], Duration::from_secs(5), &config),
                None,
                "{reason}"
            );
            assert!(
                diagnosed(&[reason; 4], Duration::from_secs(1), &config).is_some(),
                "{reason}"
            );
            // Persisted, it is a suspicion: fatal where a broker must answer at start, waited out by a
            // library (`refusal`), where an outage is never fatal.
            assert!(
                matches!(
                    diagnose(&reports(&[reason; 4], Duration::from_secs(1)), &config),
                    Some(Outcome::Suspected(_))
                ),
                "{reason}"
            );
        }
        assert_eq!(
            diagnosed(&[TO_SSL; 4], Duration::from_secs(1), &config).as_deref(),
            Some("KAFKA_SECURITY_PROTOCOL")
        );
        // librdkafka folds identical reports into one that says how many it suppressed.
        let folded = "127.0.0.1:9093/bootstrap: Disconnected: connection closed by peer: receive 0 after POLLIN (after 0ms in state APIVERSION_QUERY, 1 identical error(s) suppressed)";
        assert_eq!(weight(folded), 2);
        assert_eq!(
            diagnosed(&[CLOSED, folded], Duration::from_secs(3), &config).as_deref(),
            Some("KAFKA_SECURITY_PROTOCOL")
        );
        // At the start-up timeout, twice in all that time is enough.
        assert!(
            diagnose_at_timeout(&reports(&[CLOSED, CLOSED], Duration::ZERO), &config).is_some()
        );
        assert!(diagnose_at_timeout(&reports(&[CLOSED], Duration::ZERO), &config).is_none());
    }

    #[test]
    fn a_reason_is_shown_bounded_and_without_control_characters() {
        let long = format!("a\u{1b}[31mb\n{}", "x".repeat(1_000));
        let shown = shown(&long);
        assert!(!shown.chars().any(char::is_control), "{shown:?}");
        assert_eq!(shown.chars().count(), 301);
    }
}
