//! Supervising the service processes: start them, restart them when they die (a crash, an injected abort,
//! a SIGKILL), kill them on request, stop them gracefully at the end.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::process::Command;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

#[derive(Debug)]
struct Slot {
    kill: Arc<Notify>,
    handle: Option<JoinHandle<()>>,
}

/// The supervised processes of a run.
#[derive(Debug)]
pub struct Supervisor {
    log_dir: PathBuf,
    stopping: CancellationToken,
    slots: Mutex<HashMap<String, Slot>>,
    /// Abnormal exits (crashes and kills).
    pub deaths: Arc<AtomicU32>,
}

impl Supervisor {
    /// A supervisor writing each process's output to `{log_dir}/{name}.log`.
    pub fn new(log_dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(log_dir)?;
        Ok(Self {
            log_dir: log_dir.to_owned(),
            stopping: CancellationToken::new(),
            slots: Mutex::default(),
            deaths: Arc::default(),
        })
    }

    /// Where the logs are.
    pub fn log_dir(&self) -> &Path {
        &self.log_dir
    }

    /// Starts `name`, running the command `make` builds, and restarts it whenever it exits until
    /// [`Supervisor::stop`].
    pub fn spawn(&self, name: &str, make: impl Fn() -> Command + Send + 'static) {
        let kill = Arc::new(Notify::new());
        let log_path = self.log_dir.join(format!("{name}.log"));
        let (stopping, deaths) = (self.stopping.clone(), self.deaths.clone());
        let (task_name, task_kill) = (name.to_owned(), kill.clone());
        let handle = tokio::spawn(async move {
            while !stopping.is_cancelled() {
                let log = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log_path)
                    .expect("a log file");
                let mut command = make();
                command
                    .stdin(Stdio::null())
                    .stdout(log.try_clone().expect("log"))
                    .stderr(log)
                    .kill_on_drop(true);
                let mut child = match command.spawn() {
                    Ok(child) => child,
                    Err(e) => {
                        eprintln!("cannot start {task_name}: {e}");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                };
                let status = tokio::select! {
                    status = child.wait() => status,
                    () = task_kill.notified() => {
                        let _ = child.start_kill();
                        child.wait().await
                    }
                    () = stopping.cancelled() => {
                        terminate(&mut child).await;
                        break;
                    }
                };
                if !status.as_ref().is_ok_and(std::process::ExitStatus::success) {
                    deaths.fetch_add(1, Ordering::Relaxed);
                }
                if !stopping.is_cancelled() {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        });
        self.slots.lock().expect("slots").insert(
            name.to_owned(),
            Slot {
                kill,
                handle: Some(handle),
            },
        );
    }

    /// Kills process `name` with SIGKILL (it is restarted).
    pub fn kill(&self, name: &str) {
        if let Some(slot) = self.slots.lock().expect("slots").get(name) {
            slot.kill.notify_one();
        }
    }

    /// The names of the supervised processes.
    pub fn names(&self) -> Vec<String> {
        self.slots.lock().expect("slots").keys().cloned().collect()
    }

    /// Stops every process gracefully (SIGTERM, then SIGKILL after 30 s) and waits for them.
    pub async fn stop(&self) {
        self.stopping.cancel();
        let handles: Vec<JoinHandle<()>> = self
            .slots
            .lock()
            .expect("slots")
            .values_mut()
            .filter_map(|s| s.handle.take())
            .collect();
        for handle in handles {
            let _ = handle.await;
        }
    }
}

/// SIGTERM, then SIGKILL if the process has not exited within 30 seconds.
async fn terminate(child: &mut tokio::process::Child) {
    if let Some(pid) = child.id() {
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .await;
        if tokio::time::timeout(Duration::from_secs(30), child.wait())
            .await
            .is_ok()
        {
            return;
        }
    }
    let _ = child.start_kill();
    let _ = child.wait().await;
}
