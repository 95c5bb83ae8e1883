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

impl CpuUse {
    /// The rate this machine's cores could sustain at this cost per message, every core busy: cores × 10⁶ ÷
    /// µs per message.
    pub fn bound_msgs_per_s(&self) -> f64 {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        #[allow(clippy::cast_precision_loss)]
        let cores = cores as f64;
        cores * 1e6 / self.machine_us_per_msg.max(f64::EPSILON)
    }

    /// Several phases' use taken together, as if one phase (`None` for none).
    pub fn sum(phases: &[Self]) -> Option<Self> {
        let messages: i64 = phases.iter().map(|p| p.messages).sum();
        let wall_s: f64 = phases.iter().map(|p| p.wall_s).sum();
        if phases.is_empty() || messages == 0 {
            return None;
        }
        #[allow(clippy::cast_precision_loss)]
        let weighted = |per_message: fn(&Self) -> f64| {
            phases
                .iter()
                .map(|p| per_message(p) * p.messages as f64)
                .sum::<f64>()
                / messages as f64
        };
        Some(Self {
            messages,
            wall_s,
            busy_cores: phases.iter().map(|p| p.busy_cores * p.wall_s).sum::<f64>()
                / wall_s.max(f64::EPSILON),
            machine_us_per_msg: weighted(|p| p.machine_us_per_msg),
            bench_process_us_per_msg: weighted(|p| p.bench_process_us_per_msg),
            postgres_us_per_msg: weighted(|p| p.postgres_us_per_msg),
        })
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
    fn phases_sum_to_their_messages_and_time_weighted() {
        let phase = |messages, wall_s, busy_cores, us| CpuUse {
            messages,
            wall_s,
            busy_cores,
            machine_us_per_msg: us,
            bench_process_us_per_msg: us / 2.0,
            postgres_us_per_msg: us / 4.0,
        };
        let sum = CpuUse::sum(&[phase(100, 1.0, 1.0, 10.0), phase(300, 3.0, 2.0, 30.0)]).unwrap();
        assert_eq!(sum.messages, 400);
        assert!((sum.wall_s - 4.0).abs() < 1e-9);
        assert!((sum.busy_cores - 1.75).abs() < 1e-9, "{sum}");
        assert!((sum.machine_us_per_msg - 25.0).abs() < 1e-9, "{sum}");
        assert!((sum.bench_process_us_per_msg - 12.5).abs() < 1e-9, "{sum}");
        assert!((sum.postgres_us_per_msg - 6.25).abs() < 1e-9, "{sum}");
        assert!(CpuUse::sum(&[]).is_none());
    }

    #[test]
    fn a_busy_loop_shows_in_this_process_and_the_machine() {
        let before = CpuSample::now().expect("Linux /proc");
        let started = Instant::now();
        let mut x = 0u64;
        // Spin until this process has had 300 ms of a core (on a loaded machine that takes longer than
        // 300 ms of wall time), or ten seconds passed.
        let used = loop {
            let spin = Instant::now();
            while spin.elapsed().as_millis() < 50 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
            let used = before.until(&CpuSample::now().unwrap(), 1);
            if used.bench_process_us_per_msg >= 300_000.0 || started.elapsed().as_secs() >= 10 {
                break used;
            }
        };
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
