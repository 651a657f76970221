//! Running servers under test: workload profiles and CLI flags shared by the
//! harness binaries, spawning a selector pinned to given cores, health
//! waiting, graceful stop (SIGINT, as the reference expects), the reference's
//! Python venv, and one complete measured run against one server.
//!
//! Owns process management only; the load itself is `harness::loadgen`.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::http::HttpConn;
use super::loadgen::{self, Flow, LoadConfig, Report};
use super::mocker::{Mocker, MockerConfig};

/// PyPI requirement of the reference selector.
pub const REFERENCE_REQUIREMENT: &str = "ai-dynamo-runtime==1.6.1";
pub const DEFAULT_VENV: &str = "/opt/dynamo-venv";

/// Workload knobs shared by `kvselect-loadgen` and `kvselect-bench`. A
/// profile fills the unset ones.
#[derive(Debug, Clone, clap::Args)]
pub struct LoadArgs {
    /// Workload profile: `small` (fits 2 cores), `seed` (the seed-like
    /// agentic profile of issues 14 and 17: 128 workers, 256 sessions in a
    /// closed loop) or `full` (the maintainers' setup: 1,024 workers, 8,192
    /// sessions).
    #[arg(long, default_value = "small")]
    pub profile: String,
    /// Mock workers.
    #[arg(long)]
    pub workers: Option<usize>,
    /// Concurrent agentic sessions.
    #[arg(long)]
    pub sessions: Option<usize>,
    /// Shared system-prompt tokens.
    #[arg(long)]
    pub prefix_tokens: Option<usize>,
    /// Mean prompt length (tokens).
    #[arg(long)]
    pub mean_isl: Option<usize>,
    /// Tokens a session's history grows by per turn.
    #[arg(long)]
    pub turn_growth: Option<usize>,
    /// `output_block` calls per turn.
    #[arg(long, default_value_t = 3)]
    pub output_blocks: usize,
    /// `reserve` (select_and_reserve) or `ray` (select + POST /reservations).
    #[arg(long, default_value = "reserve")]
    pub flow: Flow,
    /// Seconds before measuring starts.
    #[arg(long)]
    pub warmup_s: Option<f64>,
    /// Measured seconds.
    #[arg(long)]
    pub duration_s: Option<f64>,
    /// Upper bound on turns (all sessions).
    #[arg(long, default_value_t = 10_000_000)]
    pub max_requests: u64,
    /// Pause between a session's turns, ms (default: 0 for `small`, 20 s
    /// for `full`).
    #[arg(long)]
    pub think_ms: Option<u64>,
    /// Turns started per second, all sessions together (default: none,
    /// each session goes on as soon as its last turn ends). A rate below
    /// both servers' capacity compares latency at the same offered load.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Milliseconds a turn holds its reservation between its last output
    /// block and the free (the engine's decode; default 0).
    #[arg(long)]
    pub decode_ms: Option<u64>,
    /// Seconds of server CPU sampled after the load stops (the work it left
    /// behind, e.g. a backlog of KV events); 0 skips it.
    #[arg(long, default_value_t = 5.0)]
    pub tail_s: f64,
    /// Turns in progress at once (default: all sessions for `small`, 256
    /// for `full`).
    #[arg(long)]
    pub max_inflight: Option<usize>,
    /// KV cache capacity of each mock worker, in blocks.
    #[arg(long)]
    pub capacity_blocks: Option<usize>,
    /// Block size the mock workers register and publish.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Client tokio worker threads.
    #[arg(long, default_value_t = 1)]
    pub client_threads: usize,
    /// Cores for the harness process (taskset list, e.g. `1`).
    #[arg(long)]
    pub client_cores: Option<String>,
    /// Memory budget for per-session cached prompts, MiB (0 = regenerate
    /// every prompt each turn).
    #[arg(long, default_value_t = 1024)]
    pub json_cache_mb: usize,
    /// Seconds to wait after registration for the selector's subscribers.
    #[arg(long)]
    pub settle_s: Option<f64>,
}

/// Bounds of `--rate` (turns/s): one turn a day to a million a second.
const MIN_RATE: f64 = 1.0 / 86_400.0;
const MAX_RATE: f64 = 1e6;

/// A fully resolved workload.
#[derive(Debug, Clone)]
pub struct Workload {
    pub mocker: MockerConfig,
    pub load: LoadConfig,
    pub settle: Duration,
}

impl LoadArgs {
    /// Resolves the profile and the overrides into a workload against `addr`.
    pub fn workload(&self, addr: &str) -> Result<Workload, String> {
        // (workers, sessions, warmup, duration, capacity blocks, think ms,
        // max in flight)
        let (w, s, warm, dur, cap, think, infl) = match self.profile.as_str() {
            "small" => (64, 64, 10.0, 40.0, 32_768, 0, usize::MAX),
            "seed" => (128, 256, 10.0, 30.0, 32_768, 0, usize::MAX),
            "full" => (1024, 8192, 20.0, 60.0, 32_768, 20_000, 256),
            p => return Err(format!("unknown profile {p:?} (small | seed | full)")),
        };
        let workers = self.workers.unwrap_or(w);
        let sessions = self.sessions.unwrap_or(s);
        if workers == 0 || sessions == 0 || self.block_size == 0 {
            return Err("workers, sessions and block size must be > 0".into());
        }
        if let Some(r) = self.rate {
            if !(r.is_finite() && (MIN_RATE..=MAX_RATE).contains(&r)) {
                return Err(format!(
                    "--rate must be between {MIN_RATE} and {MAX_RATE} turns/s, not {r}"
                ));
            }
        }
        let mocker = MockerConfig {
            workers,
            block_size: self.block_size,
            capacity_blocks: self.capacity_blocks.unwrap_or(cap),
            ..MockerConfig::default()
        };
        for (flag, v) in [
            ("--warmup-s", self.warmup_s),
            ("--duration-s", self.duration_s),
            ("--settle-s", self.settle_s),
            ("--tail-s", Some(self.tail_s)),
        ] {
            if v.is_some_and(f64::is_nan) {
                return Err(format!("{flag} must be a number of seconds"));
            }
        }
        let secs = |v: f64| Duration::from_secs_f64(v.clamp(0.0, 86_400.0));
        let load = LoadConfig {
            addr: addr.to_string(),
            sessions,
            prefix_tokens: self.prefix_tokens.unwrap_or(16_384),
            mean_isl: self.mean_isl.unwrap_or(99_000),
            turn_growth: self.turn_growth.unwrap_or(2_048).max(1),
            output_blocks: self.output_blocks,
            flow: self.flow,
            warmup: secs(self.warmup_s.unwrap_or(warm)),
            duration: secs(self.duration_s.unwrap_or(dur)),
            max_requests: self.max_requests,
            think: Duration::from_millis(self.think_ms.unwrap_or(think)),
            json_cache_bytes: self.json_cache_mb << 20,
            max_inflight: self.max_inflight.unwrap_or(infl).min(sessions).max(1),
            rate: self.rate,
            decode: Duration::from_millis(self.decode_ms.unwrap_or(0).min(3_600_000)),
            tail: secs(self.tail_s),
            ..LoadConfig::default()
        };
        let settle = secs(self.settle_s.unwrap_or(1.0 + workers as f64 / 256.0));
        Ok(Workload {
            mocker,
            load,
            settle,
        })
    }
}

/// File descriptors the reference holds per registered worker (measured on
/// 1.6.1: 64 workers took 1,408 more fds).
pub const REFERENCE_FDS_PER_WORKER: usize = 22;

/// Soft limit on open files of this process (inherited by the servers).
pub fn open_files_limit() -> Option<usize> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// Most workers the reference can hold under `fd_limit` while `conns`
/// client connections are open.
pub fn reference_max_workers(fd_limit: usize, conns: usize) -> usize {
    fd_limit.saturating_sub(conns + 512) / REFERENCE_FDS_PER_WORKER
}

/// Pins every thread of this process to `cores` (a taskset list).
pub fn pin_self(cores: &str) -> Result<(), String> {
    let st = Command::new("taskset")
        .args(["-a", "-p", "-c", cores, &std::process::id().to_string()])
        .stdout(Stdio::null())
        .status()
        .map_err(|e| format!("taskset: {e}"))?;
    if st.success() {
        Ok(())
    } else {
        Err(format!("taskset -c {cores} failed"))
    }
}

/// A free loopback TCP port (bound and released; fine for a test rig).
pub fn free_port() -> std::io::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// A selector process under test.
pub struct ServerProc {
    pub name: String,
    pub child: Child,
    pub addr: String,
}

impl ServerProc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGINT (the reference shuts down gracefully only on it), then SIGKILL
    /// after `grace`.
    pub fn stop(mut self, grace: Duration) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        let _ = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `cmd` (optionally under `taskset -c cores`) with output to `log`.
pub fn spawn_server(
    name: &str,
    cmd: &[String],
    cores: Option<&str>,
    port: u16,
    log: &Path,
) -> Result<ServerProc, String> {
    let out = File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = out.try_clone().map_err(|e| e.to_string())?;
    let (prog, args): (&str, Vec<&str>) = match cores {
        Some(c) => (
            "taskset",
            ["-c", c]
                .into_iter()
                .chain(cmd.iter().map(String::as_str))
                .collect(),
        ),
        None => (
            cmd.first().map(String::as_str).unwrap_or(""),
            cmd.iter().skip(1).map(String::as_str).collect(),
        ),
    };
    let child = Command::new(prog)
        .args(&args)
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn()
        .map_err(|e| format!("spawn {name} ({prog}): {e}"))?;
    Ok(ServerProc {
        name: name.to_string(),
        child,
        addr: format!("127.0.0.1:{port}"),
    })
}

/// Polls `GET /health` until 200, failing early when the server process
/// exits, or after `timeout`.
pub async fn wait_ready(server: &mut ServerProc, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(Some(st)) = server.child.try_wait() {
            return Err(format!("{} exited before serving ({st})", server.name));
        }
        if wait_health(&server.addr, Duration::from_millis(300)).await {
            return Ok(());
        }
    }
    Err(format!(
        "{} gave no /health answer within {} s",
        server.name,
        timeout.as_secs()
    ))
}

/// Polls `GET /health` until 200 or `timeout`.
pub async fn wait_health(addr: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(mut c) = HttpConn::connect(addr).await {
            if let Ok(200) = c
                .request("GET", "/health", None, Duration::from_secs(2))
                .await
            {
                return true;
            }
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn venv_has_reference(python: &Path) -> bool {
    Command::new(python)
        .args(["-c", "import dynamo.select_service"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Returns the venv's python with `dynamo.select_service` importable,
/// creating the venv and installing the reference into it when missing.
pub fn ensure_reference(venv: &Path) -> Result<PathBuf, String> {
    let python = venv.join("bin/python");
    if venv_has_reference(&python) {
        return Ok(python);
    }
    if !python.exists() {
        eprintln!("creating venv {}", venv.display());
        let st = Command::new("python3")
            .args(["-m", "venv"])
            .arg(venv)
            .status()
            .map_err(|e| format!("python3 -m venv: {e}"))?;
        if !st.success() {
            return Err(format!("python3 -m venv {} failed", venv.display()));
        }
    }
    eprintln!(
        "pip install {REFERENCE_REQUIREMENT} into {}",
        venv.display()
    );
    let st = Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", REFERENCE_REQUIREMENT])
        .status()
        .map_err(|e| format!("pip: {e}"))?;
    if !st.success() || !venv_has_reference(&python) {
        return Err(format!(
            "could not install {REFERENCE_REQUIREMENT} into {}",
            venv.display()
        ));
    }
    Ok(python)
}

/// One measured run against the selector at `addr` (already healthy): a
/// fresh mock fleet, registration, settle, load, report.
pub async fn run_against(
    name: &str,
    wl: &Workload,
    server_pid: Option<u32>,
) -> Result<Report, String> {
    let mocker = Arc::new(Mocker::start(wl.mocker.clone()).map_err(|e| e.to_string())?);
    loadgen::register_workers(&wl.load.addr, &mocker, Duration::from_secs(60))
        .await
        .map_err(|e| e.to_string())?;
    tokio::time::sleep(wl.settle).await;
    let mut cfg = wl.load.clone();
    cfg.server_pid = server_pid;
    Ok(loadgen::run(cfg, mocker, name).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_fleet_fits_the_fd_limit() {
        assert_eq!(reference_max_workers(20_000, 256), 874);
        assert_eq!(reference_max_workers(100, 256), 0);
        assert!(open_files_limit().is_some());
    }

    #[test]
    fn profiles_resolve_and_reject_unknown_names() {
        // LoadArgs is an Args group; parse it through a wrapper.
        #[derive(clap::Parser)]
        struct W {
            #[command(flatten)]
            l: LoadArgs,
        }
        let w = <W as clap::Parser>::parse_from(["x", "--tail-s", "NaN"]);
        assert!(w.l.workload("127.0.0.1:1").is_err());
        for bad in ["0", "-1", "NaN", "inf", "1e-30"] {
            let arg = format!("--rate={bad}");
            let w = <W as clap::Parser>::parse_from(["x", arg.as_str()]);
            assert!(w.l.workload("127.0.0.1:1").is_err(), "--rate {bad}");
        }
        let w = <W as clap::Parser>::parse_from(["x", "--rate", "12.5"]);
        assert_eq!(w.l.workload("127.0.0.1:1").unwrap().load.rate, Some(12.5));
        let w = <W as clap::Parser>::parse_from(["x", "--profile", "full", "--sessions", "10"]);
        let wl = w.l.workload("127.0.0.1:1").unwrap();
        assert_eq!(wl.mocker.workers, 1024);
        assert_eq!(wl.load.sessions, 10);
        assert_eq!(wl.load.max_inflight, 10);
        assert_eq!(wl.load.think, Duration::from_secs(20));
        // The seed-like profile of issues 14 and 17, and #14's paced
        // variant through the flags.
        let w = <W as clap::Parser>::parse_from(["x", "--profile", "seed"]);
        let wl = w.l.workload("127.0.0.1:1").unwrap();
        assert_eq!((wl.mocker.workers, wl.load.sessions), (128, 256));
        assert_eq!((wl.load.prefix_tokens, wl.load.mean_isl), (16_384, 99_000));
        assert_eq!((wl.load.rate, wl.load.think), (None, Duration::ZERO));
        assert_eq!(
            (wl.load.decode, wl.load.max_inflight),
            (Duration::ZERO, 256)
        );
        assert_eq!(wl.load.tail, Duration::from_secs(5));
        let w = <W as clap::Parser>::parse_from([
            "x",
            "--profile",
            "seed",
            "--rate",
            "60",
            "--decode-ms",
            "1000",
            "--tail-s",
            "0",
        ]);
        let wl = w.l.workload("127.0.0.1:1").unwrap();
        assert_eq!(wl.load.rate, Some(60.0));
        assert_eq!(wl.load.decode, Duration::from_secs(1));
        assert_eq!(wl.load.tail, Duration::ZERO);
        let w = <W as clap::Parser>::parse_from(["x", "--profile", "huge"]);
        assert!(w.l.workload("127.0.0.1:1").is_err());
    }
}
