//! `kvselect-loadgen`: runs an in-process mock fleet and agentic sessions
//! against one already running selector and prints a table and a JSON line.
//!
//! Example (2-core machine, server pinned to core 0 elsewhere):
//! `kvselect-loadgen --url 127.0.0.1:8092 --server-pid $PID --client-cores 1`

use clap::Parser;
use kvselect_harness::bench::{self, LoadArgs};
use kvselect_harness::loadgen;

#[derive(Parser, Debug)]
#[command(about = "Agentic-session load generator with mock vLLM workers")]
struct Cli {
    /// Selector address (`127.0.0.1:PORT`; an `http://` prefix is accepted).
    #[arg(long, default_value = "127.0.0.1:8092")]
    url: String,
    /// Selector pid, for its CPU accounting.
    #[arg(long)]
    server_pid: Option<u32>,
    /// Label of the server in the report.
    #[arg(long, default_value = "server")]
    name: String,
    #[command(flatten)]
    load: LoadArgs,
}

fn main() {
    let cli = Cli::parse();
    let addr = cli
        .url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    if !addr.starts_with("127.0.0.1:") && !addr.starts_with("localhost:") {
        eprintln!("kvselect-loadgen only sends traffic to loopback (got {addr})");
        std::process::exit(2);
    }
    let wl = match cli.load.workload(&addr) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    if let Some(c) = &cli.load.client_cores {
        if let Err(e) = bench::pin_self(c) {
            eprintln!("{e}");
        }
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cli.load.client_threads.max(1))
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tokio runtime: {e}");
            std::process::exit(1);
        }
    };
    match rt.block_on(bench::run_against(&cli.name, &wl, cli.server_pid)) {
        Ok(mut rep) => {
            rep.pinning = cli
                .load
                .client_cores
                .as_ref()
                .map(|c| format!("client {c}"));
            print!("{}", loadgen::table(std::slice::from_ref(&rep)));
            println!("{}", serde_json::to_string(&rep).unwrap_or_default());
            if rep.errors > 0 {
                std::process::exit(1);
            }
        }
        Err(e) => {
            eprintln!("run failed: {e}");
            std::process::exit(1);
        }
    }
}
