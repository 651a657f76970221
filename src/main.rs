//! The kvselect binary: command line -> config, tracing, a runtime whose
//! worker threads may be pinned to cores, then serve until SIGINT/SIGTERM.

use clap::Parser as _;
use kvselect::app::App;
use kvselect::config::{Cli, Config};
use kvselect::http::Server;
use std::sync::Arc;
use std::time::Duration;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How often stale bookings are swept.
const SWEEP_INTERVAL: Duration = Duration::from_secs(5);

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let config = match Config::from_cli(Cli::parse()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvselect: {e}");
            std::process::exit(2);
        }
    };
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
}

async fn run(config: Config) -> Result<(), String> {
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .map_err(|e| format!("cannot bind {}: {e}", config.addr))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let peers = config.indexer_peers.clone();
    let app = Arc::new(App::new(config));
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
    tracing::info!(addr = %local, "kvselect listening");
    Server::new(Arc::clone(&app))
        .serve(listener, kvselect::runtime::shutdown_signal())
        .await;
    sweeper.abort();
    tracing::info!("kvselect stopped");
    Ok(())
}
