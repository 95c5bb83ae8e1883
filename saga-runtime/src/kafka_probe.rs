//! The start-up check of the broker: a metadata request, and what the client's errors say about the setting
//! at fault. A refused password, a certificate the client cannot verify, a plaintext client at a TLS
//! listener are reported at once, as one line naming the setting (they do not mend themselves by waiting);
//! a broker that does not answer is reported once the start-up timeout is up.

use std::sync::Mutex;
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
    reasons: Mutex<Vec<String>>,
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
            .push(text);
    }

    fn reasons(&self) -> Vec<String> {
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

/// How long one metadata request of the probe may take before the client's reports are read again.
const ATTEMPT: Duration = Duration::from_millis(500);

/// The most reports (error events, log lines) read after each request.
const EVENTS_PER_ATTEMPT: usize = 256;

/// Checks that a broker answers a metadata request at `config.brokers` within [`STARTUP_TIMEOUT`], with the
/// configured security; `var` names the setting that chose the brokers. A client that the broker refuses
/// (its credentials, its certificate, its protocol) is a [`ConfigProblem`] naming the setting to change, as
/// soon as the client says so.
pub async fn probe(config: &KafkaConfig, var: &str) -> Result<(), ConfigProblem> {
    let client: BaseConsumer<ProbeContext> = client_config(config)
        // Informational lines and worse reach the context, which keeps what the diagnosis reads (the level
        // is set on the client after its properties: `log_level` would be overridden).
        .set_log_level(RDKafkaLogLevel::Info)
        .create_with_context(ProbeContext::default())
        .map_err(|e| creation_problem(&e, var))?;
    let checked = config.clone();
    let outcome = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            let attempt = client.fetch_metadata(None, ATTEMPT);
            if attempt.is_ok() {
                return Outcome::Answered;
            }
            // Error events and log lines reach the context only when the client is polled, one per call.
            for _ in 0..EVENTS_PER_ATTEMPT {
                let _ = client.poll(Duration::ZERO);
            }
            let reasons = client.context().reasons();
            if let Some(problem) = diagnose(&reasons, &checked) {
                return Outcome::Refused(problem);
            }
            if Instant::now() >= deadline {
                // What the client said last of a broker (not only that they are down), or the request's
                // own error.
                let detail = reasons
                    .iter()
                    .rev()
                    .find(|r| !r.contains("brokers are down"))
                    .or(reasons.last())
                    .cloned()
                    .or_else(|| attempt.err().map(|e| e.to_string()));
                return Outcome::Unanswered(detail.unwrap_or_else(|| "no answer".to_owned()));
            }
        }
    })
    .await
    .map_err(|e| unanswered(config, var, &e.to_string()))?;
    match outcome {
        Outcome::Answered => Ok(()),
        Outcome::Refused(problem) => Err(problem),
        Outcome::Unanswered(detail) => Err(unanswered(config, var, &detail)),
    }
}

/// How the probe ended.
enum Outcome {
    /// A broker answered the metadata request.
    Answered,
    /// The broker refused the client: the setting to change.
    Refused(ConfigProblem),
    /// Nothing answered within the start-up timeout: what the client said last.
    Unanswered(String),
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

/// The setting a refusal names, what happened and what to do, from the client's reasons; `None` when they
/// say nothing decisive yet (a broker that is starting may still answer).
fn diagnose(reasons: &[String], config: &KafkaConfig) -> Option<ConfigProblem> {
    refusal(reasons, config).or_else(|| closed_at_first_request(reasons, config))
}

/// A listener that closes the connection at the client's first request, again and again, does not speak
/// the client's protocol: a TLS listener reached in plaintext says nothing else (librdkafka's hint, "connecting
/// to a SSL listener?", is gone from its newer versions).
fn closed_at_first_request(reasons: &[String], config: &KafkaConfig) -> Option<ConfigProblem> {
    let closed: Vec<&String> = reasons
        .iter()
        .filter(|r| {
            let r = r.to_ascii_lowercase();
            r.contains("disconnected") && r.contains("state apiversion_query")
        })
        .collect();
    (closed.len() >= 2).then(|| {
        ConfigProblem::new(
            "KAFKA_SECURITY_PROTOCOL",
            format!(
                "the listener at {} closes the connection at the client's first request; it takes another \
                 protocol, most likely TLS ({})",
                config.brokers,
                shown(closed[0])
            ),
            "set it to what the listener takes (ssl or sasl_ssl for a TLS listener)",
        )
    })
}

/// A refusal one reason names for certain.
fn refusal(reasons: &[String], config: &KafkaConfig) -> Option<ConfigProblem> {
    let at = &config.brokers;
    reasons.iter().find_map(|reason| {
        let r = reason.to_ascii_lowercase();
        let (setting, what, fix) = if r.contains("sasl authentication error")
            || r.contains("authentication failed")
            || r.contains("invalid credentials")
        {
            (
                "KAFKA_SASL_PASSWORD",
                format!("the broker at {at} refused the SASL credentials"),
                "check KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD (and KAFKA_SASL_MECHANISM)",
            )
        } else if r.contains("unsupported sasl mechanism") {
            (
                "KAFKA_SASL_MECHANISM",
                format!("the broker at {at} does not take this SASL mechanism"),
                "set it to one the broker lists",
            )
        } else if r.contains("certificate required")
            || r.contains("peer did not return a certificate")
        {
            (
                "KAFKA_SSL_CERTIFICATE_LOCATION",
                format!("the broker at {at} asks for a client certificate (mutual TLS)"),
                "set KAFKA_SSL_CERTIFICATE_LOCATION and KAFKA_SSL_KEY_LOCATION",
            )
        } else if r.contains("certificate verify failed") || r.contains("could not be verified") {
            (
                "KAFKA_SSL_CA_LOCATION",
                format!(
                    "the certificate of the broker at {at} is not signed by a CA the client trusts"
                ),
                "point KAFKA_SSL_CA_LOCATION at the CA that signed it",
            )
        } else if r.contains("connecting to a ssl listener")
            || r.contains("connecting to a plaintext")
            || r.contains("wrong version number")
            || r.contains("packet length too long")
        {
            (
                "KAFKA_SECURITY_PROTOCOL",
                format!("the client and the listener at {at} do not speak the same protocol"),
                "set it to what the listener takes (ssl or sasl_ssl for a TLS listener)",
            )
        } else if r.contains("ssl handshake failed") {
            (
                "KAFKA_SSL_CA_LOCATION",
                format!("the TLS handshake with the broker at {at} failed"),
                "check KAFKA_SSL_CA_LOCATION, the client certificate and KAFKA_SECURITY_PROTOCOL",
            )
        } else {
            return None;
        };
        Some(ConfigProblem::new(
            setting,
            format!("{what} ({})", shown(reason)),
            fix,
        ))
    })
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

    fn diagnosed(reason: &str) -> Option<String> {
        diagnose(&[reason.to_owned()], &KafkaConfig::new("127.0.0.1:9093")).map(|p| p.setting)
    }

    #[test]
    fn each_refusal_names_its_setting() {
        let cases = [
            (
                "SASL authentication error: Authentication failed during authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512",
                Some("KAFKA_SASL_PASSWORD"),
            ),
            (
                "ssl://127.0.0.1:9093/bootstrap: SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: broker certificate could not be verified, verify that ssl.ca.location is correctly configured or root CA certificates are installed",
                Some("KAFKA_SSL_CA_LOCATION"),
            ),
            (
                "127.0.0.1:9093/bootstrap: Disconnected while requesting ApiVersion: might be caused by incorrect security.protocol configuration (connecting to a SSL listener?) or broker version is < 0.10 (see api.version.request)",
                Some("KAFKA_SECURITY_PROTOCOL"),
            ),
            (
                "SSL handshake failed: error:0A00045C:SSL routines::tlsv13 alert certificate required",
                Some("KAFKA_SSL_CERTIFICATE_LOCATION"),
            ),
            (
                "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused",
                None,
            ),
        ];
        for (reason, setting) in cases {
            assert_eq!(diagnosed(reason).as_deref(), setting, "{reason}");
        }
    }

    #[test]
    fn a_listener_closing_every_first_request_is_a_protocol_mismatch_one_close_is_not() {
        let closed = "127.0.0.1:9093/bootstrap: Disconnected: connection closed by peer: receive 0 after \
                      POLLIN (after 0ms in state APIVERSION_QUERY)";
        let config = KafkaConfig::new("127.0.0.1:9093");
        assert!(
            diagnose(&[closed.to_owned()], &config).is_none(),
            "a broker restarting"
        );
        let twice = diagnose(&[closed.to_owned(), closed.to_owned()], &config).unwrap();
        assert_eq!(twice.setting, "KAFKA_SECURITY_PROTOCOL", "{twice}");
    }

    #[test]
    fn a_reason_is_shown_bounded_and_without_control_characters() {
        let long = format!("a\u{1b}[31mb\n{}", "x".repeat(1_000));
        let shown = shown(&long);
        assert!(!shown.chars().any(char::is_control), "{shown:?}");
        assert_eq!(shown.chars().count(), 301);
    }
}
