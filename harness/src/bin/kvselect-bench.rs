//! `kvselect-bench`: the issue-5 experiment in one command. Starts each
//! selector in turn (kvselect, then the Dynamo reference), pinned to the
//! server cores or not (`--unpinned`), drives the same workload against it
//! from this process (pinned to the client cores or not), stops it, and
//! prints a side-by-side table and one JSON line per server.
//!
//! `cargo run --release --bin kvselect-bench -- --profile small --server-cores 0 --client-cores 1`
//! `cargo run --release --bin kvselect-bench -- --profile seed --unpinned`

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use kvselect_harness::bench::{self, LoadArgs, DEFAULT_VENV};
use kvselect_harness::loadgen::{self, Report};

#[derive(Parser, Debug)]
#[command(about = "kvselect vs Dynamo selection service, same load, one run")]
struct Cli {
    /// Servers to measure, in order.
    #[arg(long, value_delimiter = ',', default_value = "kvselect,reference")]
    servers: Vec<String>,
    /// kvselect binary (started as `BIN --port N ARGS`).
    #[arg(long, default_value = "target/release/kvselect")]
    kvselect_bin: PathBuf,
    /// Extra arguments for kvselect, whitespace separated (e.g. `--cores 1`).
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    kvselect_args: String,
    /// Venv of the reference (created and filled with ai-dynamo-runtime when
    /// missing).
    #[arg(long, default_value = DEFAULT_VENV)]
    ref_venv: PathBuf,
    /// Cores for the server under test (taskset list, e.g. `0`).
    #[arg(long, conflicts_with = "unpinned")]
    server_cores: Option<String>,
    /// Pin the server to core 0 and this harness to core 1 (the split of
    /// the 2-core runs; `--server-cores`/`--client-cores` choose others).
    #[arg(long, conflicts_with = "unpinned")]
    pinned: bool,
    /// Pin nothing: the server and this harness share every core, with no
    /// `taskset` and no `--cores` for kvselect (the saturated closed loop
    /// of issue 17 ran so).
    #[arg(long)]
    unpinned: bool,
    /// Server logs go here.
    #[arg(long, default_value = "/tmp/kvselect-bench")]
    log_dir: PathBuf,
    #[command(flatten)]
    load: LoadArgs,
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.1}x", a / b),
        _ => "n/a".into(),
    }
}

fn fmt_opt(v: Option<f64>, prec: usize) -> String {
    v.map(|v| format!("{v:.prec$}"))
        .unwrap_or_else(|| "n/a".into())
}

fn main() {
    let mut cli = Cli::parse();
    if cli.unpinned {
        if cli.load.client_cores.is_some() {
            eprintln!("--unpinned and --client-cores exclude each other");
            std::process::exit(2);
        }
        if cli
            .kvselect_args
            .split_whitespace()
            .any(|a| a == "--cores" || a.starts_with("--cores="))
        {
            eprintln!("--unpinned: leave --cores out of --kvselect-args");
            std::process::exit(2);
        }
    }
    if cli.pinned {
        cli.server_cores.get_or_insert_with(|| "0".into());
        cli.load.client_cores.get_or_insert_with(|| "1".into());
    }
    let pinning = match (&cli.server_cores, &cli.load.client_cores) {
        (None, None) => "unpinned".to_string(),
        (s, c) => format!(
            "server {}, client {}",
            s.as_deref().unwrap_or("any"),
            c.as_deref().unwrap_or("any")
        ),
    };
    if let Some(c) = &cli.load.client_cores {
        if let Err(e) = bench::pin_self(c) {
            eprintln!("warning: {e}");
        }
    }
    let _ = std::fs::create_dir_all(&cli.log_dir);
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
    let mut load = cli.load.clone();
    if cli.servers.iter().any(|s| s == "reference") {
        // The reference needs ~22 fds per worker; past the limit it stops
        // accepting connections. Both servers get the same clamped fleet.
        if let (Some(limit), Ok(wl)) = (bench::open_files_limit(), load.workload("127.0.0.1:1")) {
            let max = bench::reference_max_workers(limit, wl.load.max_inflight);
            if wl.mocker.workers > max {
                eprintln!(
                    "note: open-files limit {limit} lets the reference hold at most {max} workers \
                     ({} fds each); running {max} workers for every server instead of {}",
                    bench::REFERENCE_FDS_PER_WORKER,
                    wl.mocker.workers
                );
                load.workers = Some(max);
            }
        }
    }
    let mut reports: Vec<Report> = Vec::new();
    for name in &cli.servers {
        let port = match bench::free_port() {
            Ok(p) => p,
            Err(e) => {
                eprintln!("no free port: {e}");
                std::process::exit(1);
            }
        };
        let cmd: Vec<String> = match name.as_str() {
            "kvselect" => {
                if !cli.kvselect_bin.exists() {
                    eprintln!(
                        "skipping kvselect: {} not found (cargo build --release --bin kvselect)",
                        cli.kvselect_bin.display()
                    );
                    continue;
                }
                let mut c = vec![
                    cli.kvselect_bin.display().to_string(),
                    "--port".into(),
                    port.to_string(),
                ];
                c.extend(cli.kvselect_args.split_whitespace().map(String::from));
                c
            }
            "reference" => match bench::ensure_reference(&cli.ref_venv) {
                Ok(py) => vec![
                    py.display().to_string(),
                    "-m".into(),
                    "dynamo.select_service".into(),
                    "--port".into(),
                    port.to_string(),
                ],
                Err(e) => {
                    eprintln!("skipping reference: {e}");
                    continue;
                }
            },
            other => {
                eprintln!("skipping unknown server {other:?} (kvselect | reference)");
                continue;
            }
        };
        let addr = format!("127.0.0.1:{port}");
        let wl = match load.workload(&addr) {
            Ok(w) => w,
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(2);
            }
        };
        let log = cli.log_dir.join(format!("{name}.log"));
        eprintln!(
            "== {name}: {} (cores {}), log {}",
            cmd.join(" "),
            cli.server_cores.as_deref().unwrap_or("any"),
            log.display()
        );
        let mut server =
            match bench::spawn_server(name, &cmd, cli.server_cores.as_deref(), port, &log) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("skipping {name}: {e}");
                    continue;
                }
            };
        if let Err(e) = rt.block_on(bench::wait_ready(&mut server, Duration::from_secs(60))) {
            eprintln!("skipping {name}: {e} (see {})", log.display());
            server.stop(Duration::from_secs(5));
            continue;
        }
        let pid = server.pid();
        let r = rt.block_on(bench::run_against(name, &wl, Some(pid)));
        server.stop(Duration::from_secs(10));
        match r {
            Ok(mut rep) => {
                rep.pinning = Some(pinning.clone());
                eprint!("{}", loadgen::table(std::slice::from_ref(&rep)));
                reports.push(rep);
            }
            Err(e) => eprintln!("{name} run failed: {e}"),
        }
    }
    if reports.is_empty() {
        eprintln!("no server was measured");
        std::process::exit(1);
    }
    let w = &reports[0];
    println!(
        "\nprofile {}: {} mock workers, {} sessions, prefix {} tokens, mean ISL {} (observed {:.0}), flow {}, {}{}, {pinning}\n",
        cli.load.profile,
        w.workers,
        w.sessions,
        cli.load.prefix_tokens.unwrap_or(16_384),
        w.mean_isl_target,
        w.mean_isl_observed,
        w.flow,
        match (w.offered_rate, w.think_ms) {
            (Some(r), _) => format!("offered {r} turns/s"),
            (None, 0) => "closed loop".to_string(),
            (None, t) => format!("unpaced, {t} ms think time"),
        },
        match w.decode_ms {
            0 => String::new(),
            d => format!(", {d} ms decode"),
        },
    );
    print!("{}", loadgen::table(&reports));
    let k = reports.iter().find(|r| r.server == "kvselect");
    let rf = reports.iter().find(|r| r.server == "reference");
    if let (Some(k), Some(rf)) = (k, rf) {
        println!(
            "\nreference / kvselect: CPU ms/request {}, p99 selection latency {}, requests/s {}",
            ratio(rf.server_cpu_ms_per_request, k.server_cpu_ms_per_request),
            ratio(Some(rf.select_p99_ms), Some(k.select_p99_ms)),
            ratio(Some(k.requests_per_s), Some(rf.requests_per_s))
                .replace('x', "x (kvselect/reference)"),
        );
        println!(
            "routing: KV hit ratio kvselect {:.3} vs reference {:.3}; session moves per request {} vs {}; blocks stored per request {} vs {}",
            k.kv_hit_ratio,
            rf.kv_hit_ratio,
            fmt_opt(k.session_moves_per_request, 3),
            fmt_opt(rf.session_moves_per_request, 3),
            fmt_opt(k.blocks_stored_per_request, 0),
            fmt_opt(rf.blocks_stored_per_request, 0),
        );
    }
    for r in &reports {
        println!("{}", serde_json::to_string(r).unwrap_or_default());
    }
    if reports.iter().any(|r| r.errors > 0) {
        std::process::exit(1);
    }
}
