//! `kvselect-mocker`: a standalone fleet of mock vLLM workers.
//!
//! Binds N workers (PUB + replay ROUTER on loopback), optionally registers
//! them with a selector, prints one JSON line per worker with its endpoints,
//! then serves prompts read from stdin, one JSON object per line:
//! `{"worker_id": W, "token_ids": [...]}` (or `{"worker_id": W, "clear": true}`),
//! answering each with a JSON line describing the events it published. It
//! exits at end of input or after `--run-for-s`.

use std::io::{BufRead, Write};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use kvselect_harness::loadgen;
use kvselect_harness::mocker::{Mocker, MockerConfig};

#[derive(Parser, Debug)]
#[command(about = "Mock vLLM workers publishing KV events over ZMQ")]
struct Cli {
    #[arg(long, default_value_t = 1024)]
    workers: usize,
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    #[arg(long, default_value_t = 32_768)]
    capacity_blocks: usize,
    #[arg(long, default_value_t = 1)]
    worker_id_base: u64,
    /// Register the workers with this selector (`127.0.0.1:PORT`).
    #[arg(long)]
    register: Option<String>,
    /// Exit after this many seconds even if stdin stays open.
    #[arg(long, default_value_t = 3600.0)]
    run_for_s: f64,
}

#[derive(serde::Deserialize)]
struct Command {
    worker_id: u64,
    #[serde(default)]
    token_ids: Vec<u32>,
    #[serde(default)]
    clear: bool,
}

fn main() {
    let cli = Cli::parse();
    let cfg = MockerConfig {
        workers: cli.workers,
        block_size: cli.block_size.max(1),
        capacity_blocks: cli.capacity_blocks,
        worker_id_base: cli.worker_id_base,
        ..MockerConfig::default()
    };
    let mocker = match Mocker::start(cfg) {
        Ok(m) => Arc::new(m),
        Err(e) => {
            eprintln!("mocker: {e}");
            std::process::exit(1);
        }
    };
    if let Some(addr) = &cli.register {
        let addr = addr.trim_start_matches("http://").trim_end_matches('/');
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build();
        let r = match rt {
            Ok(rt) => rt.block_on(loadgen::register_workers(
                addr,
                &mocker,
                Duration::from_secs(60),
            )),
            Err(e) => Err(loadgen::LoadError(e.to_string())),
        };
        if let Err(e) = r {
            eprintln!("registration failed: {e}");
            std::process::exit(1);
        }
    }
    {
        let mut out = std::io::stdout().lock();
        for ep in mocker.endpoints() {
            let line = serde_json::json!({
                "worker_id": ep.worker_id,
                "kv_events_endpoint": ep.kv_events,
                "replay_endpoint": ep.replay,
            });
            let _ = writeln!(out, "{line}");
        }
        let _ = out.flush();
    }
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let m = Arc::clone(&mocker);
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        for line in stdin.lock().lines() {
            let Ok(line) = line else { break };
            if line.trim().is_empty() {
                continue;
            }
            let reply = match serde_json::from_str::<Command>(&line) {
                Ok(c) if c.clear => match m.clear(c.worker_id) {
                    Ok(seq) => {
                        serde_json::json!({"worker_id": c.worker_id, "cleared": true, "seq": seq})
                    }
                    Err(e) => serde_json::json!({"error": e.to_string()}),
                },
                Ok(c) => match m.serve(c.worker_id, &c.token_ids) {
                    Ok(o) => serde_json::json!({
                        "worker_id": c.worker_id,
                        "hit_blocks": o.hit_blocks,
                        "stored_blocks": o.stored_blocks,
                        "removed_blocks": o.removed_blocks,
                        "seq": o.seq,
                    }),
                    Err(e) => serde_json::json!({"error": e.to_string()}),
                },
                Err(e) => serde_json::json!({"error": format!("bad command: {e}")}),
            };
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{reply}");
            let _ = out.flush();
        }
        let _ = done_tx.send(());
    });
    let _ = done_rx.recv_timeout(Duration::from_secs_f64(cli.run_for_s.clamp(0.0, 86_400.0)));
    drop(mocker);
}
