//! The tokio runtime, sized by `--threads` and optionally pinned to `--cores`,
//! and the shutdown signal.

use crate::config::Config;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Builds a multi-threaded runtime. With `--cores`, worker thread *i* is pinned
/// to core `cores[i % cores.len()]`.
pub fn build(config: &Config) -> std::io::Result<tokio::runtime::Runtime> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    b.worker_threads(config.threads)
        .thread_name("kvselect-worker")
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

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
