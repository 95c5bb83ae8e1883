//! A PostgreSQL cluster of the test's own, for tests that need a second server: one with a system
//! identifier of its own, say, or one to stop.

use std::path::PathBuf;
use std::process::Command;

use crate::env::unique_name;

/// A PostgreSQL cluster made by `initdb` in a temporary folder, listening on a free local port with trust
/// authentication for user `postgres`. Run as root, the server runs as the `postgres` user (PostgreSQL
/// refuses root). Stopped and removed when the value is dropped.
pub struct PrivatePostgres {
    port: u16,
    dir: PathBuf,
    bin: PathBuf,
    /// The user the server runs as, when it is not the test's own (`postgres` under root).
    run_as: Option<&'static str>,
}

impl std::fmt::Debug for PrivatePostgres {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrivatePostgres")
            .field("port", &self.port)
            .field("dir", &self.dir)
            .finish()
    }
}

impl PrivatePostgres {
    /// Creates and starts a cluster. Panics, saying what is missing, if PostgreSQL's server programs
    /// (`pg_config --bindir`) cannot be found.
    pub async fn start(name: &str) -> Self {
        let name = name.to_owned();
        tokio::task::spawn_blocking(move || Self::start_blocking(&name))
            .await
            .expect("starting a private PostgreSQL")
    }

    fn start_blocking(name: &str) -> Self {
        let bin = server_programs();
        let port = crate::free_local_addr().port();
        let dir = std::env::temp_dir().join(unique_name(&format!("saga-pg-{name}")));
        let root = output(Command::new("id").arg("-u")).trim() == "0";
        let cluster = Self {
            port,
            dir,
            bin,
            run_as: root.then_some("postgres"),
        };
        // initdb creates the folder itself (the temporary folder is writable by everybody).
        cluster.run(
            "initdb",
            &[
                "-D",
                &cluster.dir.display().to_string(),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
        );
        let options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            cluster.dir.display()
        );
        cluster.run(
            "pg_ctl",
            &[
                "-D",
                &cluster.dir.display().to_string(),
                "-o",
                &options,
                "-l",
                &cluster.dir.join("server.log").display().to_string(),
                "-w",
                "-t",
                "60",
                "start",
            ],
        );
        cluster
    }

    /// The URL of `database` on this cluster.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Runs server program `program` with `args`, as the server's user; panics with its output if it fails.
    fn run(&self, program: &str, args: &[&str]) {
        let path = self.bin.join(program);
        let mut command = match self.run_as {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(&path);
                c
            }
            None => Command::new(&path),
        };
        command.args(args);
        output(&mut command);
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        if self.dir.join("postmaster.pid").exists() {
            let dir = self.dir.display().to_string();
            let path = self.bin.join("pg_ctl");
            let mut command = match self.run_as {
                Some(user) => {
                    let mut c = Command::new("runuser");
                    c.args(["-u", user, "--"]).arg(&path);
                    c
                }
                None => Command::new(&path),
            };
            let _ = command
                .args(["-D", &dir, "-m", "immediate", "-w", "stop"])
                .output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The folder of PostgreSQL's server programs (`initdb`, `pg_ctl`).
fn server_programs() -> PathBuf {
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    from_pg_config
        .filter(|dir| dir.join("initdb").exists())
        .or_else(|| {
            std::fs::read_dir("/usr/lib/postgresql")
                .ok()?
                .filter_map(Result::ok)
                .map(|e| e.path().join("bin"))
                .find(|dir| dir.join("initdb").exists())
        })
        .unwrap_or_else(|| {
            panic!(
                "this test starts a PostgreSQL cluster of its own and needs initdb and pg_ctl \
                 (pg_config --bindir, or /usr/lib/postgresql/*/bin): install the PostgreSQL server"
            )
        })
}

/// Runs `command`, returning its standard output; panics with its output if it fails.
fn output(command: &mut Command) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("running {command:?}: {e}"));
    assert!(
        out.status.success(),
        "{command:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
