//! The kvselect binary: command line -> config, logging, a runtime whose
//! worker threads may be pinned to cores, then serve until SIGTERM/SIGINT and
//! drain (a second signal exits at once).

use clap::Parser as _;
use kvselect::app::App;
use kvselect::config::{Cli, Config, LogFormat};
use kvselect::http::Server;
use std::io::IsTerminal as _;
use std::sync::Arc;
use std::time::Duration;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How often stale bookings are swept.
const SWEEP_INTERVAL: Duration = Duration::from_secs(5);

use kvselect::runtime::FD_HEADROOM;

fn main() {
    let config = match Config::from_cli(Cli::parse()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvselect: {e}");
            std::process::exit(2);
        }
    };
    init_logging(config.log_format);
    for (name, value) in config.describe(|k| std::env::var(k).ok()) {
        tracing::info!(target: "kvselect::config", %value, "{name}");
    }
    let want = config.limits.max_connections as u64 + FD_HEADROOM;
    match kvselect::runtime::raise_fd_limit(want) {
        Ok(n) if n < want => tracing::warn!(
            fd_limit = n,
            max_connections = config.limits.max_connections,
            "the file-descriptor limit is below --max-connections plus headroom; raise it (ulimit -n / LimitNOFILE) or lower --max-connections"
        ),
        Ok(n) => tracing::debug!(fd_limit = n, "file-descriptor limit"),
        Err(e) => tracing::warn!(error = %e, "cannot read the file-descriptor limit"),
    }
    let runtime = match kvselect::runtime::build(&config) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvselect: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = runtime.block_on(run(config)) {
        eprintln!("kvselect: {e}");
        std::process::exit(1);
    }
    // Connections the drain deadline cut may still own tasks; do not wait.
    runtime.shutdown_timeout(Duration::from_millis(100));
}

/// `RUST_LOG` filters (default `info`); text lines carry ANSI colour only on
/// a terminal and without `NO_COLOR`.
fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Text => {
            let ansi = std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none();
            builder.with_ansi(ansi).init();
        }
        LogFormat::Json => builder.json().with_ansi(false).init(),
    }
}

async fn run(config: Config) -> Result<(), String> {
    let drain = kvselect::shutdown::drain_signal()
        .map_err(|e| format!("cannot install signal handlers: {e}"))?;
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .map_err(|e| format!("cannot bind {}: {e}", config.addr))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let peers = config.indexer_peers.clone();
    let app = Arc::new(App::new(config));
    let (max_sockets, streams) = app.catalog.hub().capacity();
    tracing::info!(
        kv_streams = streams,
        zmq_max_sockets = max_sockets,
        fd_limit = kvselect::runtime::fd_limit().unwrap_or(0),
        "KV-event streams that fit (a stream with a replay endpoint takes two sockets)"
    );
    let server = Server::from_config(Arc::clone(&app))?;
    let auth = server.auth().cloned();
    kvselect::shutdown::on_sighup(move || match &auth {
        Some(auth) => auth.reload_logged(),
        None => tracing::info!("SIGHUP: no --auth-token-file, nothing to reload"),
    })
    .map_err(|e| format!("cannot install the SIGHUP handler: {e}"))?;
    for peer in &peers {
        match kvselect::recovery::load_peer_dump(&app, peer).await {
            Ok(n) => tracing::info!(%peer, events = n, "recovered index from peer"),
            Err(e) => tracing::warn!(%peer, error = %e, "index recovery from peer failed"),
        }
    }
    app.start_mesh(Some(local))?;
    let sweeper = {
        let app = Arc::clone(&app);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_INTERVAL);
            loop {
                tick.tick().await;
                let n = app.sweep();
                if n > 0 {
                    tracing::info!(expired = n, "expired stale bookings");
                }
            }
        })
    };
    tracing::info!(
        addr = %local,
        tls = app.config.tls.is_some(),
        auth = server.auth().is_some(),
        simd = app.config.number_path.effective_name(),
        "kvselect listening"
    );
    if server.auth().is_none() && !local.ip().is_loopback() {
        tracing::warn!(
            addr = %local,
            "listening beyond loopback without --auth-token-file: anyone who reaches this port can change the worker catalog"
        );
    }
    server.serve(listener, drain).await;
    sweeper.abort();
    tracing::info!("kvselect stopped");
    Ok(())
}
