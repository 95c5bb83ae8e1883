//! How a client reaches a secured broker: TLS (a CA file, a client certificate for mutual TLS), SASL
//! (PLAIN, SCRAM-SHA-256/512, OAUTHBEARER through librdkafka's own OIDC client), declared once in
//! [`KafkaArgs`](crate::KafkaArgs) and turned into librdkafka's properties here. Secrets are [`Secret`]s:
//! no `Debug`, log line or `--help` shows them.

use std::fmt;
use std::path::{Path, PathBuf};

use saga_config::{ConfigProblem, KafkaConfig};

/// A value that must not be shown: a password or a client secret. Its `Debug` says `<redacted>`, it has no
/// `Display`, and `--help` does not show the variable's value (`hide_env_values`).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// A secret holding `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value, for the client that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// clap's parser of a [`Secret`]: any text.
pub(crate) fn parse_secret(text: &str) -> Result<Secret, String> {
    Ok(Secret::new(text))
}

/// A file the client reads (a CA, a certificate, a key): it must exist and be readable when the process
/// starts, or the setting naming it is refused.
pub(crate) fn parse_readable_file(text: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(text);
    std::fs::File::open(&path)
        .map(|_| path)
        .map_err(|e| format!("cannot read {text}: {e}"))
}

/// `security.protocol`: how the client talks to the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[non_exhaustive]
pub enum SecurityProtocol {
    /// Neither TLS nor SASL (librdkafka's default).
    Plaintext,
    /// TLS, with a client certificate for mutual TLS.
    Ssl,
    /// SASL without TLS: the password crosses the network in clear with PLAIN.
    #[value(name = "sasl_plaintext")]
    SaslPlaintext,
    /// SASL over TLS: what managed clusters ask for.
    #[value(name = "sasl_ssl")]
    SaslSsl,
}

impl SecurityProtocol {
    /// librdkafka's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plaintext => "plaintext",
            Self::Ssl => "ssl",
            Self::SaslPlaintext => "sasl_plaintext",
            Self::SaslSsl => "sasl_ssl",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        <Self as clap::ValueEnum>::from_str(text.trim(), true).ok()
    }

    fn uses_tls(self) -> bool {
        matches!(self, Self::Ssl | Self::SaslSsl)
    }

    fn uses_sasl(self) -> bool {
        matches!(self, Self::SaslPlaintext | Self::SaslSsl)
    }
}

/// `sasl.mechanism`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[non_exhaustive]
pub enum SaslMechanism {
    /// A user name and password, sent as they are (use it over TLS only).
    #[value(name = "PLAIN", alias = "plain")]
    Plain,
    /// SCRAM with SHA-256: the password never crosses the network.
    #[value(name = "SCRAM-SHA-256", alias = "scram-sha-256")]
    ScramSha256,
    /// SCRAM with SHA-512.
    #[value(name = "SCRAM-SHA-512", alias = "scram-sha-512")]
    ScramSha512,
    /// OAuth bearer tokens, fetched by librdkafka itself from the OIDC token endpoint with the client
    /// credentials grant (`KAFKA_SASL_OAUTHBEARER_*`).
    #[value(name = "OAUTHBEARER", alias = "oauthbearer")]
    Oauthbearer,
}

impl SaslMechanism {
    /// librdkafka's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plain => "PLAIN",
            Self::ScramSha256 => "SCRAM-SHA-256",
            Self::ScramSha512 => "SCRAM-SHA-512",
            Self::Oauthbearer => "OAUTHBEARER",
        }
    }
}

/// The security settings of [`KafkaArgs`](crate::KafkaArgs), as the checks and the mapping read them.
pub(crate) struct Security<'a> {
    pub(crate) protocol: Option<SecurityProtocol>,
    pub(crate) mechanism: Option<SaslMechanism>,
    pub(crate) username: Option<&'a str>,
    pub(crate) password: Option<&'a Secret>,
    pub(crate) ca: Option<&'a Path>,
    pub(crate) certificate: Option<&'a Path>,
    pub(crate) key: Option<&'a Path>,
    pub(crate) key_password: Option<&'a Secret>,
    pub(crate) oidc_endpoint: Option<&'a str>,
    pub(crate) oidc_client_id: Option<&'a str>,
    pub(crate) oidc_client_secret: Option<&'a Secret>,
    pub(crate) oidc_scope: Option<&'a str>,
}

fn problem(setting: &str, what: impl Into<String>, fix: impl Into<String>) -> ConfigProblem {
    ConfigProblem::new(setting, what, fix)
}

/// A `sasl.mechanism` as librdkafka will see it: one of the settings' values, or another that only a
/// `KAFKA_PROPERTY_SASL_MECHANISM` can name (GSSAPI), whose needs are librdkafka's to check.
#[derive(Clone, Copy)]
enum Mechanism {
    Known(SaslMechanism),
    Other,
}

/// The settings as librdkafka will see them: a `KAFKA_PROPERTY_*` property comes after the settings, so
/// where both name a property the escape hatch's (its last one) wins, and a property the hatch alone sets
/// counts as set.
struct Effective<'a> {
    protocol: SecurityProtocol,
    mechanism: Option<Mechanism>,
    hatch: &'a [(String, String)],
}

impl<'a> Effective<'a> {
    fn new(security: &Security<'_>, hatch: &'a [(String, String)]) -> Self {
        // A property under any of librdkafka's names for it (`sasl.mechanisms` is its first name,
        // `sasl.mechanism` an alias): the last one set wins.
        let last = |aliases: &[&str]| {
            hatch
                .iter()
                .rev()
                .find(|(name, _)| aliases.contains(&name.as_str()))
                .map(|(_, value)| value.trim())
        };
        let protocol = match last(&["security.protocol"]) {
            // An unknown protocol is librdkafka's to refuse; the settings' checks read it as unset.
            Some(value) => SecurityProtocol::parse(value).or(security.protocol),
            None => security.protocol,
        }
        .unwrap_or(SecurityProtocol::Plaintext);
        let mechanism = match last(&["sasl.mechanism", "sasl.mechanisms"]) {
            Some(value) => Some(
                <SaslMechanism as clap::ValueEnum>::from_str(value, true)
                    .map_or(Mechanism::Other, Mechanism::Known),
            ),
            None => security.mechanism.map(Mechanism::Known),
        };
        Self {
            protocol,
            mechanism,
            hatch,
        }
    }

    /// Whether a setting (`typed`) or one of the escape hatch's `properties` gives a value.
    fn set(&self, typed: bool, properties: &[&str]) -> bool {
        typed
            || self
                .hatch
                .iter()
                .any(|(name, _)| properties.contains(&name.as_str()))
    }
}

impl Security<'_> {
    /// Adds the properties to `config` (whose `KAFKA_PROPERTY_*` properties it already holds, and which
    /// stay last, as the escape hatch), after checking that the settings and the hatch's properties make
    /// one coherent whole.
    pub(crate) fn apply(&self, mut config: KafkaConfig) -> Result<KafkaConfig, ConfigProblem> {
        self.check(&Effective::new(self, &config.properties))?;
        let mut set: Vec<(&str, String)> = Vec::new();
        if let Some(p) = self.protocol {
            set.push(("security.protocol", p.as_str().to_owned()));
        }
        if let Some(m) = self.mechanism {
            set.push(("sasl.mechanism", m.as_str().to_owned()));
        }
        let text = |v: Option<&str>| v.map(str::to_owned);
        let path = |p: Option<&Path>| p.map(|p| p.display().to_string());
        let secret = |s: Option<&Secret>| s.map(|s| s.expose().to_owned());
        for (name, value) in [
            ("sasl.username", text(self.username)),
            ("sasl.password", secret(self.password)),
            ("ssl.ca.location", path(self.ca)),
            ("ssl.certificate.location", path(self.certificate)),
            ("ssl.key.location", path(self.key)),
            ("ssl.key.password", secret(self.key_password)),
            (
                "sasl.oauthbearer.token.endpoint.url",
                text(self.oidc_endpoint),
            ),
            ("sasl.oauthbearer.client.id", text(self.oidc_client_id)),
            (
                "sasl.oauthbearer.client.secret",
                secret(self.oidc_client_secret),
            ),
            ("sasl.oauthbearer.scope", text(self.oidc_scope)),
        ] {
            if let Some(value) = value {
                set.push((name, value));
            }
        }
        if self.oidc_endpoint.is_some() {
            set.push(("sasl.oauthbearer.method", "oidc".to_owned()));
        }
        // The typed settings go before the escape hatch's properties, which stay last.
        let hatch = std::mem::take(&mut config.properties);
        for (name, value) in set {
            config = config.with_property(name, value);
        }
        config.properties.extend(hatch);
        Ok(config)
    }

    /// Refuses settings that cannot work together, naming the one to change.
    fn check(&self, e: &Effective<'_>) -> Result<(), ConfigProblem> {
        let protocol = e.protocol;
        let certificate = e.set(
            self.certificate.is_some(),
            &["ssl.certificate.location", "ssl.certificate.pem"],
        );
        let key = e.set(self.key.is_some(), &["ssl.key.location", "ssl.key.pem"]);
        let tls_files = [
            (
                "KAFKA_SSL_CA_LOCATION",
                e.set(self.ca.is_some(), &["ssl.ca.location", "ssl.ca.pem"]),
            ),
            ("KAFKA_SSL_CERTIFICATE_LOCATION", certificate),
            ("KAFKA_SSL_KEY_LOCATION", key),
        ];
        if !protocol.uses_tls()
            && let Some((setting, _)) = tls_files.iter().find(|(_, set)| *set)
        {
            return Err(problem(
                setting,
                format!(
                    "is set, but KAFKA_SECURITY_PROTOCOL is {}",
                    protocol.as_str()
                ),
                "set KAFKA_SECURITY_PROTOCOL to ssl or sasl_ssl",
            ));
        }
        match (certificate, key) {
            (true, false) => {
                return Err(problem(
                    "KAFKA_SSL_KEY_LOCATION",
                    "is not set, but KAFKA_SSL_CERTIFICATE_LOCATION is",
                    "give the client certificate's private key too (mutual TLS needs both)",
                ));
            }
            (false, true) => {
                return Err(problem(
                    "KAFKA_SSL_CERTIFICATE_LOCATION",
                    "is not set, but KAFKA_SSL_KEY_LOCATION is",
                    "give the client certificate too (mutual TLS needs both)",
                ));
            }
            _ => {}
        }
        if e.set(self.key_password.is_some(), &["ssl.key.password"]) && !key {
            return Err(problem(
                "KAFKA_SSL_KEY_PASSWORD",
                "is set, but KAFKA_SSL_KEY_LOCATION is not",
                "set the key's file, or unset its password",
            ));
        }
        self.check_sasl(e)
    }

    fn check_sasl(&self, e: &Effective<'_>) -> Result<(), ConfigProblem> {
        let protocol = e.protocol;
        let sasl_settings = [
            ("KAFKA_SASL_MECHANISM", e.mechanism.is_some()),
            (
                "KAFKA_SASL_USERNAME",
                e.set(self.username.is_some(), &["sasl.username"]),
            ),
            (
                "KAFKA_SASL_PASSWORD",
                e.set(self.password.is_some(), &["sasl.password"]),
            ),
            (
                "KAFKA_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL",
                e.set(
                    self.oidc_endpoint.is_some(),
                    &["sasl.oauthbearer.token.endpoint.url"],
                ),
            ),
        ];
        if !protocol.uses_sasl() {
            return match sasl_settings.iter().find(|(_, set)| *set) {
                Some((setting, _)) => Err(problem(
                    setting,
                    format!(
                        "is set, but KAFKA_SECURITY_PROTOCOL is {}",
                        protocol.as_str()
                    ),
                    "set KAFKA_SECURITY_PROTOCOL to sasl_ssl (or sasl_plaintext)",
                )),
                None => Ok(()),
            };
        }
        match e.mechanism {
            None => Err(problem(
                "KAFKA_SASL_MECHANISM",
                format!(
                    "is not set, but KAFKA_SECURITY_PROTOCOL is {}",
                    protocol.as_str()
                ),
                "set it to SCRAM-SHA-512, SCRAM-SHA-256, PLAIN or OAUTHBEARER",
            )),
            Some(Mechanism::Other) => Ok(()),
            Some(Mechanism::Known(SaslMechanism::Oauthbearer)) => self.check_oidc(e),
            Some(Mechanism::Known(mechanism)) => self.check_password(e, mechanism),
        }
    }

    /// OAUTHBEARER through librdkafka's OIDC client needs its endpoint and client credentials (unless the
    /// escape hatch chose librdkafka's other token source, `sasl.oauthbearer.method=default`).
    fn check_oidc(&self, e: &Effective<'_>) -> Result<(), ConfigProblem> {
        let hatch = |property: &str| {
            e.hatch
                .iter()
                .rev()
                .find(|(n, _)| n == property)
                .map(|(_, v)| v.trim())
        };
        // librdkafka's other token sources need no client secret: its default (unsecured) tokens, the JWT
        // bearer grant (a signed assertion), and Azure's instance metadata service.
        let default_method =
            hatch("sasl.oauthbearer.method").is_some_and(|v| v.eq_ignore_ascii_case("default"));
        let other_grant = hatch("sasl.oauthbearer.grant.type")
            .is_some_and(|v| !v.eq_ignore_ascii_case("client_credentials"));
        let metadata_service = hatch("sasl.oauthbearer.metadata.authentication.type")
            .is_some_and(|v| !v.eq_ignore_ascii_case("none"));
        if default_method || other_grant || metadata_service {
            return Ok(());
        }
        let oidc = [
            (
                "KAFKA_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL",
                e.set(
                    self.oidc_endpoint.is_some(),
                    &["sasl.oauthbearer.token.endpoint.url"],
                ),
            ),
            (
                "KAFKA_SASL_OAUTHBEARER_CLIENT_ID",
                e.set(
                    self.oidc_client_id.is_some(),
                    &[
                        "sasl.oauthbearer.client.id",
                        "sasl.oauthbearer.client.credentials.client.id",
                    ],
                ),
            ),
            (
                "KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET",
                e.set(
                    self.oidc_client_secret.is_some(),
                    &[
                        "sasl.oauthbearer.client.secret",
                        "sasl.oauthbearer.client.credentials.client.secret",
                    ],
                ),
            ),
        ];
        match oidc.iter().find(|(_, set)| !*set) {
            Some((setting, _)) => Err(problem(
                setting,
                "is not set, but KAFKA_SASL_MECHANISM is OAUTHBEARER",
                "set the token endpoint, the client id and its secret (librdkafka fetches the tokens)",
            )),
            None => Ok(()),
        }
    }

    /// PLAIN and SCRAM need a user name and its password.
    fn check_password(
        &self,
        e: &Effective<'_>,
        mechanism: SaslMechanism,
    ) -> Result<(), ConfigProblem> {
        let needed = [
            (
                "KAFKA_SASL_USERNAME",
                e.set(self.username.is_some(), &["sasl.username"]),
                "set the user name and KAFKA_SASL_PASSWORD",
            ),
            (
                "KAFKA_SASL_PASSWORD",
                e.set(self.password.is_some(), &["sasl.password"]),
                "set the user's password",
            ),
        ];
        match needed.iter().find(|(_, set, _)| !*set) {
            Some((setting, _, fix)) => Err(problem(
                setting,
                format!(
                    "is not set, but KAFKA_SASL_MECHANISM is {}",
                    mechanism.as_str()
                ),
                *fix,
            )),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::KafkaArgs;

    const CANARY: &str = "canary-secret-4d21";

    fn args(vars: &[(&str, &str)]) -> Result<KafkaArgs, saga_config::ConfigProblem> {
        KafkaArgs::from_vars(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    fn readable_file() -> String {
        // Any file the test can read stands for a PEM file: the settings check that it can be read.
        env!("CARGO_MANIFEST_PATH").to_owned()
    }

    #[test]
    fn sasl_ssl_settings_become_librdkafkas_properties_and_no_debug_shows_a_secret() {
        let ca = readable_file();
        let args = args(&[
            ("KAFKA_BROKERS", "broker:9093"),
            ("KAFKA_SECURITY_PROTOCOL", "SASL_SSL"),
            ("KAFKA_SASL_MECHANISM", "scram-sha-512"),
            ("KAFKA_SASL_USERNAME", "svc"),
            ("KAFKA_SASL_PASSWORD", CANARY),
            ("KAFKA_SSL_CA_LOCATION", &ca),
        ])
        .unwrap();
        let config = args.config().unwrap();
        let property = |name: &str| {
            config
                .properties
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(property("security.protocol"), Some("sasl_ssl"));
        assert_eq!(property("sasl.mechanism"), Some("SCRAM-SHA-512"));
        assert_eq!(property("sasl.username"), Some("svc"));
        assert_eq!(property("sasl.password"), Some(CANARY));
        assert_eq!(property("ssl.ca.location"), Some(ca.as_str()));
        for shown in [
            format!("{args:?}"),
            format!("{config:?}"),
            format!("{config:#?}"),
        ] {
            assert!(
                !shown.contains(CANARY),
                "a Debug shows the password: {shown}"
            );
            assert!(shown.contains("redacted"), "{shown}");
        }
    }

    #[test]
    fn an_escape_hatch_property_comes_last_and_its_secret_is_not_shown_either() {
        let file = readable_file();
        let config = args(&[
            ("KAFKA_BROKERS", "broker:9093"),
            ("KAFKA_SECURITY_PROTOCOL", "ssl"),
        ])
        .unwrap()
        .secure(
            saga_config::KafkaConfig::new("broker:9093")
                .with_property("ssl.certificate.location", &file)
                .with_property("ssl.key.location", &file)
                .with_property("ssl.key.password", CANARY)
                .with_property("security.protocol", "ssl"),
        )
        .unwrap();
        assert_eq!(
            config.properties.last().map(|(n, _)| n.as_str()),
            Some("security.protocol"),
            "KAFKA_PROPERTY_* stay last: {config:?}"
        );
        assert!(!format!("{config:?}").contains(CANARY));
    }

    #[test]
    fn the_checks_read_what_librdkafka_will_the_escape_hatch_last() {
        let file = readable_file();
        let hatch = |properties: &[(&str, &str)]| {
            properties
                .iter()
                .fold(saga_config::KafkaConfig::new("broker:9093"), |c, (n, v)| {
                    c.with_property(*n, *v)
                })
        };
        let settings = |vars: &[(&str, &str)]| {
            let mut all = vec![("KAFKA_BROKERS", "broker:9093")];
            all.extend_from_slice(vars);
            args(&all).unwrap()
        };
        let sasl_ssl = [
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", "svc"),
            ("sasl.password", CANARY),
            ("ssl.ca.location", file.as_str()),
        ];
        // The hatch alone, complete: accepted, and passed on as it is.
        let config = settings(&[]).secure(hatch(&sasl_ssl)).unwrap();
        assert_eq!(config.properties.len(), sasl_ssl.len(), "{config:?}");
        // The hatch's protocol with the settings' credentials: accepted.
        settings(&[
            ("KAFKA_SASL_MECHANISM", "PLAIN"),
            ("KAFKA_SASL_USERNAME", "svc"),
            ("KAFKA_SASL_PASSWORD", CANARY),
        ])
        .secure(hatch(&[("security.protocol", "sasl_ssl")]))
        .unwrap();
        // librdkafka's first name for the mechanism, as Confluent's client snippets write it.
        settings(&[])
            .secure(hatch(&[
                ("security.protocol", "SASL_SSL"),
                ("sasl.mechanisms", "PLAIN"),
                ("sasl.username", "svc"),
                ("sasl.password", CANARY),
            ]))
            .unwrap();
        // OAUTHBEARER with a grant that needs no client secret.
        settings(&[])
            .secure(hatch(&[
                ("security.protocol", "sasl_ssl"),
                ("sasl.mechanism", "OAUTHBEARER"),
                ("sasl.oauthbearer.method", "oidc"),
                (
                    "sasl.oauthbearer.grant.type",
                    "urn:ietf:params:oauth:grant-type:jwt-bearer",
                ),
            ]))
            .unwrap();
        // A mechanism only the hatch can name is librdkafka's to check.
        settings(&[])
            .secure(hatch(&[
                ("security.protocol", "sasl_plaintext"),
                ("sasl.mechanism", "GSSAPI"),
            ]))
            .unwrap();
        type Pairs<'a> = &'a [(&'a str, &'a str)];
        let refused: [(Pairs<'_>, Pairs<'_>, &str); 4] = [
            // The hatch's protocol wins over the setting (it comes last): SASL settings without SASL.
            (
                &[
                    ("KAFKA_SECURITY_PROTOCOL", "sasl_ssl"),
                    ("KAFKA_SASL_MECHANISM", "PLAIN"),
                    ("KAFKA_SASL_USERNAME", "svc"),
                    ("KAFKA_SASL_PASSWORD", CANARY),
                ],
                &[("security.protocol", "ssl")],
                "KAFKA_SASL_MECHANISM",
            ),
            (&[], &sasl_ssl[..1], "KAFKA_SASL_MECHANISM"),
            (&[], &sasl_ssl[..4][..3], "KAFKA_SASL_PASSWORD"),
            (
                &[("KAFKA_SECURITY_PROTOCOL", "ssl")],
                &[("ssl.certificate.pem", "-----BEGIN CERTIFICATE-----")],
                "KAFKA_SSL_KEY_LOCATION",
            ),
        ];
        for (vars, properties, setting) in refused {
            let problem = settings(vars).secure(hatch(properties)).unwrap_err();
            assert_eq!(
                problem.setting, setting,
                "{vars:?} {properties:?}: {problem}"
            );
        }
    }

    #[test]
    fn settings_that_cannot_work_together_are_refused_naming_the_one_to_change() {
        let file = readable_file();
        let cases: [(&[(&str, &str)], &str); 6] = [
            (
                &[("KAFKA_SECURITY_PROTOCOL", "sasl_ssl")],
                "KAFKA_SASL_MECHANISM",
            ),
            (
                &[
                    ("KAFKA_SECURITY_PROTOCOL", "sasl_ssl"),
                    ("KAFKA_SASL_MECHANISM", "PLAIN"),
                ],
                "KAFKA_SASL_USERNAME",
            ),
            (
                &[
                    ("KAFKA_SECURITY_PROTOCOL", "sasl_ssl"),
                    ("KAFKA_SASL_MECHANISM", "SCRAM-SHA-256"),
                    ("KAFKA_SASL_USERNAME", "svc"),
                ],
                "KAFKA_SASL_PASSWORD",
            ),
            (&[("KAFKA_SASL_USERNAME", "svc")], "KAFKA_SASL_USERNAME"),
            (&[("KAFKA_SSL_CA_LOCATION", &file)], "KAFKA_SSL_CA_LOCATION"),
            (
                &[
                    ("KAFKA_SECURITY_PROTOCOL", "ssl"),
                    ("KAFKA_SSL_CERTIFICATE_LOCATION", &file),
                ],
                "KAFKA_SSL_KEY_LOCATION",
            ),
        ];
        for (vars, setting) in cases {
            let mut all = vec![("KAFKA_BROKERS", "broker:9093")];
            all.extend_from_slice(vars);
            let problem = args(&all).unwrap().config().unwrap_err();
            assert_eq!(problem.setting, setting, "{vars:?}: {problem}");
        }
        let problem = args(&[
            ("KAFKA_BROKERS", "broker:9093"),
            ("KAFKA_SECURITY_PROTOCOL", "sasl_ssl"),
            ("KAFKA_SASL_MECHANISM", "OAUTHBEARER"),
            (
                "KAFKA_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL",
                "https://idp/token",
            ),
            ("KAFKA_SASL_OAUTHBEARER_CLIENT_ID", "svc"),
        ])
        .unwrap()
        .config()
        .unwrap_err();
        assert_eq!(problem.setting, "KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET");
    }

    #[test]
    fn oauthbearer_asks_librdkafka_for_its_own_oidc_client() {
        let config = args(&[
            ("KAFKA_BROKERS", "broker:9093"),
            ("KAFKA_SECURITY_PROTOCOL", "sasl_ssl"),
            ("KAFKA_SASL_MECHANISM", "OAUTHBEARER"),
            (
                "KAFKA_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL",
                "https://idp/token",
            ),
            ("KAFKA_SASL_OAUTHBEARER_CLIENT_ID", "svc"),
            ("KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET", CANARY),
        ])
        .unwrap()
        .config()
        .unwrap();
        assert!(
            config
                .properties
                .contains(&("sasl.oauthbearer.method".into(), "oidc".into()))
        );
        assert!(!format!("{config:?}").contains(CANARY));
    }

    #[test]
    fn a_file_that_cannot_be_read_or_an_unknown_protocol_is_refused_naming_its_variable() {
        let problem = args(&[("KAFKA_SSL_CA_LOCATION", "/no/such/ca.pem")]).unwrap_err();
        assert_eq!(problem.setting, "KAFKA_SSL_CA_LOCATION", "{problem}");
        assert!(
            problem.to_string().contains("cannot read /no/such/ca.pem"),
            "the reason stays: {problem}"
        );
        let problem = args(&[("KAFKA_SECURITY_PROTOCOL", "tls")]).unwrap_err();
        assert_eq!(problem.setting, "KAFKA_SECURITY_PROTOCOL", "{problem}");
    }
}
