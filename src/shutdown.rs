//! Process signals for a graceful drain.
//!
//! The first SIGTERM or SIGINT resolves [`drain_signal`]'s future; the server
//! then drains (see `http::Server::serve`: the listener closes, /ready
//! turns 503, in-flight requests finish with `Connection: close`, the process
//! exits by `--shutdown-timeout-secs` at the latest). A second SIGTERM or
//! SIGINT exits at once with status 130: an operator who presses Ctrl-C
//! twice means it.
//!
//! SIGHUP runs a reload callback (the auth tokens) instead of its default
//! action, which would end the process.

use std::future::Future;

/// Exit status after a second signal.
pub const FORCED_EXIT_STATUS: i32 = 130;

/// Installs the handlers now (a signal that arrives before the future is
/// polled is not lost) and returns a future that resolves on the first
/// SIGTERM or SIGINT. Must be called inside a tokio runtime.
pub fn drain_signal() -> std::io::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        let first = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(
            signal = first,
            "draining: /ready answers 503, no new connections, in-flight requests finish; a second signal exits at once"
        );
        tokio::spawn(async move {
            let second = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            tracing::warn!(signal = second, "second signal: exiting now");
            std::process::exit(FORCED_EXIT_STATUS);
        });
    })
}

/// Runs `reload` on every SIGHUP. Must be called inside a tokio runtime.
pub fn on_sighup(reload: impl Fn() + Send + 'static) -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = signal(SignalKind::hangup())?;
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            reload();
        }
    });
    Ok(())
}
