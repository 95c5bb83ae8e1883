//! CPU accounting around a measured phase, from Linux's `/proc`: the whole machine's busy time, this
//! process's (the consumer, librdkafka and, on the mock cluster, the broker itself) and PostgreSQL's
//! processes'. Divided by the messages of the phase, it says what a message costs in CPU, which bounds the
//! rate when the cores are saturated.

use std::time::Instant;

use serde::Serialize;

/// Clock ticks per second of `/proc`'s times (`USER_HZ`, 100 on every Linux architecture in use).
const TICKS_PER_SECOND: f64 = 100.0;

/// CPU seconds used so far, read at one instant.
#[derive(Debug, Clone, Copy)]
pub struct CpuSample {
    at: Instant,
    machine: f64,
    this_process: f64,
    postgres: f64,
}

/// What a phase cost in CPU, microseconds per message, and how busy the machine was.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct CpuUse {
    /// Messages of the phase.
    pub messages: i64,
    /// Wall time of the phase, seconds.
    pub wall_s: f64,
    /// Cores busy on average over the phase (all processes).
    pub busy_cores: f64,
    /// Busy CPU of the whole machine per message.
    pub machine_us_per_msg: f64,
    /// This process's CPU per message.
    pub bench_process_us_per_msg: f64,
    /// PostgreSQL's processes' CPU per message.
    pub postgres_us_per_msg: f64,
}

impl CpuSample {
    /// Reads the counters now; `None` where `/proc` is not Linux's.
    pub fn now() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let machine = stat
            .lines()
            .next()?
            .strip_prefix("cpu ")?
            .split_whitespace()
            .enumerate()
            // user nice system idle iowait irq softirq steal: all but idle (3) and iowait (4) are busy.
            .filter(|(i, _)| *i < 8 && *i != 3 && *i != 4)
            .map(|(_, v)| v.parse::<f64>().unwrap_or(0.0))
            .sum::<f64>();
        let mut postgres = 0.0;
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let is_pid = entry
                .file_name()
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()));
            if is_pid
                && let Some((name, ticks)) = process_ticks(&entry.path().join("stat"))
                && name == "postgres"
            {
                postgres += ticks;
            }
        }
        let (_, this_process) = process_ticks(std::path::Path::new("/proc/self/stat"))?;
        Some(Self {
            at: Instant::now(),
            machine: machine / TICKS_PER_SECOND,
            this_process: this_process / TICKS_PER_SECOND,
            postgres: postgres / TICKS_PER_SECOND,
        })
    }

    /// The CPU used from `self` to `later`, over `messages` messages.
    pub fn until(&self, later: &Self, messages: i64) -> CpuUse {
        let per_message = |seconds: f64| seconds * 1e6 / messages.max(1) as f64;
        let wall_s = later.at.duration_since(self.at).as_secs_f64();
        CpuUse {
            messages,
            wall_s,
            busy_cores: (later.machine - self.machine) / wall_s.max(f64::EPSILON),
            machine_us_per_msg: per_message(later.machine - self.machine),
            bench_process_us_per_msg: per_message(later.this_process - self.this_process),
            postgres_us_per_msg: per_message(later.postgres - self.postgres),
        }
    }
}

/// The command name and the user + system ticks of the process whose `stat` file is `path`.
fn process_ticks(path: &std::path::Path) -> Option<(String, f64)> {
    let stat = std::fs::read_to_string(path).ok()?;
    // The name is in parentheses and may hold spaces; the fields after it are space-separated.
    let (head, rest) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1.to_owned();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the file, 12 and 13 after the name.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((name, utime + stime))
}

impl std::fmt::Display for CpuUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.1} µs CPU per message (PostgreSQL {:.1}, this process {:.1}), {:.2} cores busy over {:.1} s",
            self.machine_us_per_msg,
            self.postgres_us_per_msg,
            self.bench_process_us_per_msg,
            self.busy_cores,
            self.wall_s
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_loop_shows_in_this_process_and_the_machine() {
        let before = CpuSample::now().expect("Linux /proc");
        let started = Instant::now();
        let mut x = 0u64;
        while started.elapsed().as_millis() < 300 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let used = before.until(&CpuSample::now().unwrap(), 1);
        assert!(
            used.bench_process_us_per_msg >= 150_000.0,
            "300 ms of spinning counted: {used}"
        );
        assert!(
            used.machine_us_per_msg >= used.bench_process_us_per_msg * 0.9,
            "{used}"
        );
    }
}
