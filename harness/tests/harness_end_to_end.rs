//! The load harness end to end against the real kvselect server on loopback:
//! mock workers with real ZMQ PUB/ROUTER sockets register through /workers,
//! agentic sessions run the whole reservation lifecycle, and the report
//! must show the selector followed the KV events (a high hit ratio). A paced
//! run must start turns at the offered rate, not as fast as it can.

#[path = "../../tests/common/mod.rs"]
mod common;

use clap::Parser;
use kvselect::reserve::LedgerStats;
use kvselect_harness::bench::{self, LoadArgs};
use kvselect_harness::loadgen::Report;

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    load: LoadArgs,
}

async fn run(server: &common::TestServer, sessions: &str, extra: &[&str]) -> Report {
    let mut argv = vec![
        "x",
        "--workers",
        "4",
        "--sessions",
        sessions,
        "--prefix-tokens",
        "512",
        "--mean-isl",
        "4096",
        "--turn-growth",
        "256",
        "--warmup-s",
        "0.5",
        "--duration-s",
        "3",
        "--settle-s",
        "0.5",
        "--capacity-blocks",
        "4096",
    ];
    argv.extend_from_slice(extra);
    let wl = Args::parse_from(argv)
        .load
        .workload(&server.addr.to_string())
        .unwrap();
    bench::run_against("kvselect", &wl, Some(std::process::id()))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_sessions_follow_the_cache_without_errors() {
    let server = common::start().await;
    let r = run(&server, "4", &[]).await;
    assert_eq!(r.errors, 0, "first error: {:?}", r.first_error);
    // The report names the token loop the server runs (from its /metrics).
    assert_eq!(
        r.simd_path.as_deref(),
        Some(server.app.config.number_path.effective_name())
    );
    // Far more than the paced test below allows, so that one can fail.
    assert!(r.requests > 60, "{r:?}");
    // Each turn extends the session's last prompt; a selector that indexes
    // the mock workers' events sends it back to the worker holding it.
    assert!(r.kv_hit_ratio > 0.6, "{r:?}");
    assert!(r.select_p50_ms > 0.0 && r.select_p50_ms <= r.select_p99_ms);
    assert_eq!(r.offered_rate, None);
    // Every reservation was freed: nothing stays booked, no identity is
    // left held on any rank.
    assert_eq!(server.app.ledger.stats(), LedgerStats::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paced_run_starts_turns_at_the_offered_rate() {
    let server = common::start().await;
    // 8 sessions, so that a slow machine still has a free session for
    // every start time (each needs a turn done within 1 s).
    let r = run(&server, "8", &["--rate", "8"]).await;
    assert_eq!(r.errors, 0, "first error: {:?}", r.first_error);
    assert_eq!(r.offered_rate, Some(8.0));
    // 8 turns/s over a 3 s window; turns straddling its edges are not
    // counted, so a little below, and never a burst above.
    assert!((16..=26).contains(&r.requests), "{r:?}");
    // Paced turns still follow the cache.
    assert!(r.kv_hit_ratio > 0.6, "{r:?}");
}
