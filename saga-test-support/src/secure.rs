//! The secured services `scripts/dev-services` starts: the local CA and its certificates, the broker that
//! takes only TLS with SASL/SCRAM users, and a mutual-TLS front for a broker of the test's own.

use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The default address of the secured broker (`KAFKA_SECURE_BROKERS`).
const DEFAULT_SECURE_BROKERS: &str = "127.0.0.1:9093";

/// The SCRAM-SHA-512 user the secured broker knows (and `saga256`, its SCRAM-SHA-256 twin).
pub const SECURE_USER: &str = "saga";
/// The users' password: the local test broker's, known to every test.
pub const SECURE_PASSWORD: &str = "saga-dev-password";
/// The passphrase of `client-encrypted.key`.
pub const KEY_PASSPHRASE: &str = "saga-dev-key";

/// The folder of the local CA and certificates (`SAGA_DEV_TLS_DIR`, else
/// `~/.cache/saga-dev-services/tls`): `ca.pem`, `server.pem`/`.key`, `client.pem`/`.key`,
/// `client-encrypted.key`, `other-ca.pem`.
pub fn tls_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SAGA_DEV_TLS_DIR") {
        return PathBuf::from(dir);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    cache.join("saga-dev-services/tls")
}

/// A file of [`tls_dir`], which must exist (else the test fails saying how to make it).
pub fn tls_file(name: &str) -> PathBuf {
    let path = tls_dir().join(name);
    assert!(
        path.is_file(),
        "{} is missing: run `scripts/dev-services` once (it makes the local CA and certificates)",
        path.display()
    );
    path
}

/// The secured broker's address (`KAFKA_SECURE_BROKERS`, else 127.0.0.1:9093).
pub fn secure_brokers() -> String {
    std::env::var("KAFKA_SECURE_BROKERS").unwrap_or_else(|_| DEFAULT_SECURE_BROKERS.to_owned())
}

/// The settings, as environment variables, of a client of the secured broker: SASL_SSL with SCRAM-SHA-512
/// as [`SECURE_USER`], the local CA.
pub fn sasl_ssl_env() -> Vec<(&'static str, String)> {
    vec![
        ("KAFKA_BROKERS", secure_brokers()),
        ("KAFKA_SECURITY_PROTOCOL", "sasl_ssl".to_owned()),
        ("KAFKA_SASL_MECHANISM", "SCRAM-SHA-512".to_owned()),
        ("KAFKA_SASL_USERNAME", SECURE_USER.to_owned()),
        ("KAFKA_SASL_PASSWORD", SECURE_PASSWORD.to_owned()),
        (
            "KAFKA_SSL_CA_LOCATION",
            tls_file("ca.pem").display().to_string(),
        ),
    ]
}

/// The librdkafka properties of [`sasl_ssl_env`], for the tests' own clients.
pub fn sasl_ssl_properties() -> Vec<(String, String)> {
    vec![
        ("security.protocol".into(), "sasl_ssl".into()),
        ("sasl.mechanism".into(), "SCRAM-SHA-512".into()),
        ("sasl.username".into(), SECURE_USER.into()),
        ("sasl.password".into(), SECURE_PASSWORD.into()),
        (
            "ssl.ca.location".into(),
            tls_file("ca.pem").display().to_string(),
        ),
    ]
}

/// A TLS front that asks every client for a certificate signed by the local CA (mutual TLS) and passes
/// the bytes on, in clear, to a broker of the test's own, which advertises the front's address. Nisshi
/// serves TLS but does not ask for client certificates; the handshake librdkafka makes here is a real
/// mutual-TLS handshake. Stops when dropped.
#[derive(Debug)]
pub struct MutualTlsFront {
    /// The front's address, for `bootstrap.servers`.
    pub brokers: String,
    task: tokio::task::JoinHandle<()>,
}

impl MutualTlsFront {
    /// Listens on `listener` and forwards each connection that presents a certificate of the local CA to
    /// `upstream`.
    pub fn start(listener: std::net::TcpListener, upstream: String) -> Self {
        let brokers = listener.local_addr().expect("bound").to_string();
        listener.set_nonblocking(true).expect("non-blocking");
        let listener = TcpListener::from_std(listener).expect("tokio listener");
        let acceptor = TlsAcceptor::from(Arc::new(server_config()));
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    // A client without a valid certificate fails its handshake here, as at a broker that
                    // asks for one.
                    let Ok(mut tls) = acceptor.accept(client).await else {
                        return;
                    };
                    let Ok(mut broker) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut broker).await;
                });
            }
        });
        Self { brokers, task }
    }
}

impl Drop for MutualTlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn server_config() -> rustls::ServerConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_file_iter(tls_file("ca.pem")).expect("ca.pem") {
        roots.add(ca.expect("a CA certificate")).expect("the CA");
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .expect("a client verifier");
    let chain = CertificateDer::pem_file_iter(tls_file("server.pem"))
        .expect("server.pem")
        .collect::<Result<Vec<_>, _>>()
        .expect("the server's certificate");
    let key = PrivateKeyDer::from_pem_file(tls_file("server.key")).expect("server.key");
    rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .expect("the server's certificate and key")
}
