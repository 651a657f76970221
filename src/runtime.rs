//! The tokio runtime, sized by `--http-threads` and optionally pinned to `--cores`,
//! and the process's file-descriptor limit.
//!
// getrlimit/setrlimit for the fd limit: two libc calls, each with its SAFETY note.
#![allow(unsafe_code)]

use crate::config::Config;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The name of the runtime's threads (the HTTP workers), as `/proc` shows it.
pub const WORKER_THREAD: &str = "kvselect-worker";

/// Voluntary context switches of process `pid`'s HTTP worker threads, from
/// `/proc`: each is a park in `epoll_wait` with nothing to do. For tests and
/// the harness (`select_cpu`).
#[cfg(all(target_os = "linux", any(test, feature = "testkit")))]
pub fn worker_parks(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    let mut parks = 0;
    for task in tasks.flatten() {
        let dir = task.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if comm.trim() != WORKER_THREAD {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
        parks += status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
    }
    parks
}

/// Builds a multi-threaded runtime. With `--cores`, worker thread *i* is pinned
/// to core `cores[i % cores.len()]`.
pub fn build(config: &Config) -> std::io::Result<tokio::runtime::Runtime> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    b.worker_threads(config.threads)
        .thread_name(WORKER_THREAD)
        .enable_all();
    if let Some(cores) = config.cores.clone() {
        let available: Vec<usize> = core_affinity::get_core_ids()
            .unwrap_or_default()
            .into_iter()
            .map(|c| c.id)
            .collect();
        if let Some(missing) = cores.iter().find(|c| !available.contains(c)) {
            return Err(std::io::Error::other(format!(
                "--cores names core {missing}, but this machine offers {available:?}"
            )));
        }
        let next = Arc::new(AtomicUsize::new(0));
        b.on_thread_start(move || {
            // Blocking-pool threads start here too; they share the cores.
            let i = next.fetch_add(1, Ordering::Relaxed);
            let core = cores[i % cores.len()];
            if !core_affinity::set_for_current(core_affinity::CoreId { id: core }) {
                tracing::warn!(core, "could not pin thread");
            }
        });
    }
    b.build()
}

/// File descriptors kept beyond --max-connections for the listener, peers,
/// files and libzmq's own; the rest of the fd limit sizes the KV-event
/// streams (two descriptors per ZMQ socket).
pub const FD_HEADROOM: u64 = 256;

/// The soft `RLIMIT_NOFILE` in force.
pub fn fd_limit() -> std::io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(lim.rlim_cur)
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (at least towards
/// `want`) and returns the soft limit now in force. Each connection costs
/// one file descriptor and each KV-event stream two; when they run out,
/// accept fails and streams cannot open.
pub fn raise_fd_limit(want: u64) -> std::io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // rlim_t is u64 on Linux.
    let want: libc::rlim_t = want;
    if lim.rlim_cur >= lim.rlim_max {
        return Ok(lim.rlim_cur);
    }
    let raised = libc::rlimit {
        rlim_cur: lim.rlim_max,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: `raised` is a valid rlimit; lowering or keeping the hard limit
    // needs no privilege.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
        return Ok(raised.rlim_cur);
    }
    // Some systems refuse an unlimited or very large soft limit; ask for
    // what this process needs instead.
    if lim.rlim_cur >= want {
        return Ok(lim.rlim_cur);
    }
    let raised = libc::rlimit {
        rlim_cur: want.min(lim.rlim_max),
        rlim_max: lim.rlim_max,
    };
    // SAFETY: `raised` is a valid rlimit; lowering or keeping the hard limit
    // needs no privilege.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(raised.rlim_cur)
}
