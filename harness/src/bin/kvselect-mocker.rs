//! `kvselect-mocker`: a standalone fleet of mock vLLM workers.
//!
//! Binds N workers (PUB + replay ROUTER on loopback), optionally registers
//! them with a selector, prints one JSON line per worker with its endpoints,
//! then serves prompts read from stdin, one JSON object per line:
//! `{"worker_id": W, "token_ids": [...]}` (or `{"worker_id": W, "clear": true}`),
//! answering each with a JSON line describing the events it published. It
//! exits at end of input or after `--run-for-s`.
//!
//! With `--stdin-binary` the commands are binary frames instead, so that a
//! driver can hand over 100k-token prompts without encoding JSON: each frame
//! is `worker_id: u64 LE`, `n: u32 LE`, then `n` tokens as u32 LE; `n =
//! 0xFFFF_FFFF` (no tokens follow) clears the worker. Binary mode writes no
//! per-command replies; at the end it prints one JSON summary line
//! (`commands`, `errors`, `hit_blocks`, `stored_blocks`, `removed_blocks`).

use std::io::{BufRead, Read, Write};
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
    /// Read length-prefixed binary frames from stdin instead of JSON lines
    /// (see the module doc); no per-command replies.
    #[arg(long)]
    stdin_binary: bool,
}

/// Binary-mode `n` that asks for a clear.
const CLEAR_FRAME: u32 = u32::MAX;

/// Serves binary frames from stdin until end of input (or a truncated
/// frame), then prints one JSON summary line.
fn serve_binary(m: &Mocker) {
    let stdin = std::io::stdin();
    let mut input = std::io::BufReader::with_capacity(1 << 20, stdin.lock());
    let mut head = [0u8; 12];
    let mut raw: Vec<u8> = Vec::new();
    let mut tokens: Vec<u32> = Vec::new();
    let (mut commands, mut errors) = (0u64, 0u64);
    let (mut hit, mut stored, mut removed) = (0u64, 0u64, 0u64);
    let mut first_error: Option<String> = None;
    while input.read_exact(&mut head).is_ok() {
        let worker_id = u64::from_le_bytes(head[..8].try_into().unwrap_or([0; 8]));
        let n = u32::from_le_bytes(head[8..].try_into().unwrap_or([0; 4]));
        commands += 1;
        let r = if n == CLEAR_FRAME {
            m.clear(worker_id).map(|_| ())
        } else {
            raw.resize(n as usize * 4, 0);
            if input.read_exact(&mut raw).is_err() {
                break;
            }
            tokens.clear();
            tokens.extend(
                raw.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
            m.serve(worker_id, &tokens).map(|o| {
                hit += o.hit_blocks as u64;
                stored += o.stored_blocks as u64;
                removed += o.removed_blocks as u64;
            })
        };
        if let Err(e) = r {
            errors += 1;
            first_error.get_or_insert_with(|| e.to_string());
        }
    }
    let line = serde_json::json!({
        "commands": commands,
        "errors": errors,
        "first_error": first_error,
        "hit_blocks": hit,
        "stored_blocks": stored,
        "removed_blocks": removed,
    });
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
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
    let binary = cli.stdin_binary;
    std::thread::spawn(move || {
        if binary {
            serve_binary(&m);
            let _ = done_tx.send(());
            return;
        }
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
