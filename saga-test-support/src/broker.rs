//! A broker process of the test's own, for tests that take the broker away and bring it back.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use tokio::process::{Child, Command};

use crate::env::unique_name;
use crate::kafka::client_config;

/// A Nisshi broker on a free port with its own sqlite storage under `target/test-brokers/`. Its data survives
/// [`PrivateBroker::stop`] and [`PrivateBroker::start`]. The process is killed when the value is dropped.
pub struct PrivateBroker {
    /// The broker's address, for `bootstrap.servers`.
    pub brokers: String,
    port: u16,
    /// The address the broker tells clients to use (its own, unless a front stands before it).
    advertised: String,
    dir: PathBuf,
    child: Option<Child>,
}

impl std::fmt::Debug for PrivateBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrivateBroker")
            .field("brokers", &self.brokers)
            .finish_non_exhaustive()
    }
}

impl PrivateBroker {
    /// Starts a new broker and waits until it answers a metadata request. Panics with installation advice
    /// if the `nisshi` binary cannot be found.
    pub async fn launch(name: &str) -> Self {
        Self::launch_behind(name, None).await
    }

    /// Like [`PrivateBroker::launch`], for a broker that clients reach through a front at `advertised`
    /// (such as a [`MutualTlsFront`](crate::MutualTlsFront)): the broker tells them that address.
    pub async fn launch_behind(name: &str, advertised: Option<String>) -> Self {
        let port = crate::free_local_addr().port();
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../target/test-brokers")
            .join(unique_name(name));
        std::fs::create_dir_all(&dir).expect("creating the broker's data folder");
        let mut broker = Self {
            brokers: format!("127.0.0.1:{port}"),
            port,
            advertised: advertised.unwrap_or_else(|| format!("127.0.0.1:{port}")),
            dir,
            child: None,
        };
        broker.start().await;
        broker
    }

    /// Starts the broker process (again) and waits until it answers.
    pub async fn start(&mut self) {
        assert!(self.child.is_none(), "the broker is already running");
        let binary = Self::binary().unwrap_or_else(|| {
            panic!(
                "this test starts a broker of its own and needs the `nisshi` binary; \
                 run `scripts/dev-services` once (it installs Nisshi 0.8.1) or set NISSHI_BIN"
            )
        });
        let listener = format!("tcp://127.0.0.1:{}", self.port);
        let advertised = format!("tcp://{}", self.advertised);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("broker.log"))
            .expect("broker log");
        let child = Command::new(&binary)
            .args([
                "broker",
                "--storage-engine",
                "sqlite://broker.db",
                "--listener-url",
                &listener,
                "--advertised-listener-url",
                &advertised,
                "--group-initial-rebalance-delay",
                "0s",
                "--group-poll-interval",
                "100ms",
            ])
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", binary.display()));
        self.child = Some(child);
        self.wait_ready().await;
    }

    /// Kills the broker process (SIGKILL) and waits for it to exit.
    pub async fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
    }

    async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let config = client_config(&self.brokers);
            let ok = tokio::task::spawn_blocking(move || {
                let probe: BaseConsumer = config.create().expect("client");
                probe.fetch_metadata(None, Duration::from_secs(2)).is_ok()
            })
            .await
            .unwrap_or(false);
            if ok {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the private broker on port {} did not start; see {}",
                self.port,
                self.dir.join("broker.log").display()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for PrivateBroker {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.start_kill();
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

impl PrivateBroker {
    /// The `nisshi` binary: `$NISSHI_BIN`, else on `PATH`, else in `~/.cargo/bin`; `None` if not installed.
    pub fn binary() -> Option<PathBuf> {
        if let Ok(path) = std::env::var("NISSHI_BIN") {
            return Some(PathBuf::from(path)).filter(|p| p.is_file());
        }
        let on_path = std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|p| p.join("nisshi"))
                .find(|p| p.is_file())
        });
        on_path.or_else(|| {
            std::env::var_os("HOME")
                .map(|home| PathBuf::from(home).join(".cargo/bin/nisshi"))
                .filter(|p| p.is_file())
        })
    }
}
