//! CPU accounting of a process from `/proc/<pid>/stat` (Linux).
//!
//! Owns reading `utime + stime` (fields 14 and 15, in clock ticks) and the
//! tick rate. The comm field may contain spaces and parentheses, so fields are
//! counted after the last `)`.

use std::process::Command;

/// Clock ticks per second (`getconf CLK_TCK`, 100 on every Linux we run on).
pub fn clock_ticks() -> u64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .filter(|&t: &u64| t > 0)
        .unwrap_or(100)
}

/// User + system CPU seconds used so far by `pid` (all its threads), or
/// `None` when the process is gone or the file does not parse.
pub fn cpu_seconds(pid: u32, ticks: u64) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_cpu_ticks(&stat).map(|t| t as f64 / ticks as f64)
}

/// `utime + stime` from the text of a `/proc/<pid>/stat` file.
pub fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After the comm: state(3) ppid(4) ... utime(14) stime(15); `rest`
    // starts at field 3.
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// Busy CPU seconds of the whole machine so far (all cores; `/proc/stat`
/// user + nice + system + irq + softirq + steal), so a report can show how
/// much of the machine other processes took during a run.
pub fn machine_busy_seconds(ticks: u64) -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    parse_machine_busy(&stat).map(|t| t as f64 / ticks as f64)
}

/// Busy ticks from the aggregate `cpu` line of `/proc/stat`.
pub fn parse_machine_busy(stat: &str) -> Option<u64> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal ...
    let get = |i: usize| v.get(i).copied().unwrap_or(0);
    Some(get(0) + get(1) + get(2) + get(5) + get(6) + get(7))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_comm_with_spaces() {
        let s = "1234 (a b) c) S 1 1 1 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 4 0";
        assert_eq!(parse_cpu_ticks(s), Some(300));
        assert_eq!(parse_cpu_ticks("garbage"), None);
    }

    #[test]
    fn machine_busy_skips_idle_and_iowait() {
        let s = "cpu  10 1 5 1000 7 2 3 4 0 0\ncpu0 1 1 1 1 1 1 1 1 0 0\n";
        assert_eq!(parse_machine_busy(s), Some(25));
        assert_eq!(parse_machine_busy("intr 1 2"), None);
    }

    #[test]
    fn own_process_has_a_cpu_reading() {
        let t = clock_ticks();
        assert!(cpu_seconds(std::process::id(), t).is_some());
    }
}
