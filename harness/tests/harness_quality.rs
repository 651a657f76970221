//! The harness's routing-quality figures against the real kvselect server on
//! loopback, each checked against a count made another way:
//! - session moves: 0 for a lone session that keeps its worker, exactly 1
//!   when the test removes that worker between two turns;
//! - blocks stored and removed: what ZMQ subscribers on the mock workers'
//!   PUB sockets decoded, and what the server's index counted;
//! - the server's freshness figures: present, and nothing left queued;
//! - 429s: counted apart from errors, the shed turns retried;
//! - the decode wait: the booking held until the free.

#[path = "../../tests/common/mod.rs"]
mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvselect::config::{Config, QueueLimits};
use kvselect::ingest::decode::{decode_batch, KvEvent};
use kvselect_harness::loadgen::{self, LoadConfig, Report};
use kvselect_harness::mocker::{Mocker, MockerConfig};
use serde_json::json;

fn fleet(workers: usize, capacity_blocks: usize) -> Arc<Mocker> {
    Arc::new(
        Mocker::start(MockerConfig {
            workers,
            capacity_blocks,
            ..MockerConfig::default()
        })
        .unwrap(),
    )
}

/// A small closed-loop workload against `server`, measured from its start.
fn load(server: &common::TestServer, sessions: usize) -> LoadConfig {
    LoadConfig {
        addr: server.addr.to_string(),
        sessions,
        prefix_tokens: 256,
        mean_isl: 2048,
        turn_growth: 128,
        output_blocks: 1,
        warmup: Duration::ZERO,
        duration: Duration::from_secs(3),
        tail: Duration::from_millis(300),
        server_pid: Some(std::process::id()),
        ..LoadConfig::default()
    }
}

/// One session with a long life (no restart within the run) and a pause
/// between turns, so the test can act between two of them.
fn lone_session(server: &common::TestServer) -> LoadConfig {
    LoadConfig {
        sessions: 1,
        prefix_tokens: 256,
        mean_isl: 40_000,
        turn_growth: 16,
        think: Duration::from_millis(250),
        duration: Duration::from_secs(3),
        ..load(server, 1)
    }
}

async fn run(cfg: LoadConfig, mocker: &Arc<Mocker>) -> Report {
    loadgen::run(cfg, Arc::clone(mocker), "kvselect").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_keeps_its_worker_makes_no_move() {
    let server = common::start().await;
    let mocker = fleet(2, 32_768);
    loadgen::register_workers(&server.addr.to_string(), &mocker, Duration::from_secs(10))
        .await
        .unwrap();
    let r = run(lone_session(&server), &mocker).await;
    assert_eq!(r.errors, 0, "first error: {:?}", r.first_error);
    // About 12 turns; every one after the first had a previous turn.
    assert!(r.session_turns_with_previous >= 5, "{r:?}");
    assert_eq!(r.session_turns_with_previous, r.requests - 1, "{r:?}");
    assert_eq!(r.session_moves, 0, "{r:?}");
    assert_eq!(r.session_moves_per_request, Some(0.0));
    // Only one worker ever served it.
    let served: Vec<usize> = (1..=2).map(|w| mocker.cached_blocks(w).unwrap()).collect();
    assert_eq!(served.iter().filter(|&&b| b > 0).count(), 1, "{served:?}");
}

/// Frees (`DELETE /reservations/{id}`) the server has answered, from its
/// /metrics.
async fn frees_answered(c: &mut kvselect_harness::http::HttpConn) -> u64 {
    let status = c
        .request("GET", "/metrics", None, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(status, 200);
    String::from_utf8_lossy(c.body())
        .lines()
        .filter(|l| {
            l.starts_with("kvselect_http_requests_total{")
                && l.contains("route=\"/reservations/{selection_id}\"")
        })
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_whose_worker_is_removed_moves_once() {
    let server = common::start().await;
    let mocker = fleet(2, 32_768);
    loadgen::register_workers(&server.addr.to_string(), &mocker, Duration::from_secs(10))
        .await
        .unwrap();
    let removed = Arc::new(AtomicU64::new(0));
    let forcing = {
        let (mocker, removed) = (Arc::clone(&mocker), Arc::clone(&removed));
        let addr = server.addr;
        tokio::spawn(async move {
            // After a few turns, right after one ends (its booking freed:
            // the session has just begun its 250 ms pause), remove the
            // worker holding the session's cache. A turn ends with its free
            // (`DELETE /reservations/{id}`), and a booking lives for less
            // than a millisecond, so the signal is the frees answered (a
            // count, which a poll cannot miss), not the bookings held.
            tokio::time::sleep(Duration::from_millis(1200)).await;
            let mut m = kvselect_harness::http::HttpConn::connect(&addr.to_string())
                .await
                .unwrap();
            let before = frees_answered(&mut m).await;
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while frees_answered(&mut m).await == before {
                assert!(std::time::Instant::now() < deadline, "no turn ended");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let w = (1..=2u64)
                .max_by_key(|&w| mocker.cached_blocks(w).unwrap())
                .unwrap();
            let mut c = kvselect_harness::http::HttpConn::connect(&addr.to_string())
                .await
                .unwrap();
            let status = c
                .request(
                    "DELETE",
                    &format!("/workers/{w}"),
                    None,
                    Duration::from_secs(5),
                )
                .await
                .unwrap();
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(c.body()));
            removed.store(w, Ordering::Relaxed);
        })
    };
    let r = run(lone_session(&server), &mocker).await;
    forcing.await.unwrap();
    let gone = removed.load(Ordering::Relaxed);
    assert_ne!(gone, 0);
    assert_eq!(r.errors, 0, "first error: {:?}", r.first_error);
    assert!(r.session_turns_with_previous >= 5, "{r:?}");
    // The turn after the removal went to the other worker, and the session
    // stayed there.
    assert_eq!(r.session_moves, 1, "{r:?}");
    let other = 3 - gone;
    assert!(mocker.cached_blocks(other).unwrap() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_stored_and_removed_are_what_the_engines_published() {
    let server = common::start().await;
    // 4 workers of 300 blocks; prompts of up to about 230 blocks, growing 8
    // blocks a turn, so the caches evict.
    let mocker = fleet(4, 300);
    // Independent count: SUB sockets on every worker's PUB socket.
    let ctx = zmq::Context::new();
    let subs: Vec<zmq::Socket> = mocker
        .endpoints()
        .iter()
        .map(|ep| {
            let s = ctx.socket(zmq::SUB).unwrap();
            s.set_subscribe(b"").unwrap();
            s.connect(&ep.kv_events).unwrap();
            s
        })
        .collect();
    loadgen::register_workers(&server.addr.to_string(), &mocker, Duration::from_secs(10))
        .await
        .unwrap();
    // The SUB sockets' subscriptions reach the publishers.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let counter = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let (mut stored, mut removed, mut batches) = (0u64, 0u64, 0u64);
            let mut quiet_since_stop = 0;
            loop {
                let mut got = false;
                for s in &subs {
                    while let Ok(frames) = s.recv_multipart(zmq::DONTWAIT) {
                        got = true;
                        batches += 1;
                        for e in decode_batch(&frames[2]).unwrap().events {
                            match e {
                                KvEvent::Stored(st) => stored += st.block_hashes.len() as u64,
                                KvEvent::Removed(rm) => removed += rm.block_hashes.len() as u64,
                                _ => {}
                            }
                        }
                    }
                }
                if !got {
                    if stop.load(Ordering::Relaxed) {
                        quiet_since_stop += 1;
                        if quiet_since_stop > 20 {
                            break;
                        }
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            (stored, removed, batches)
        })
    };
    let cfg = LoadConfig {
        max_requests: 300,
        duration: Duration::from_secs(20),
        ..load(&server, 4)
    };
    let r = run(cfg, &mocker).await;
    stop.store(true, Ordering::Relaxed);
    let (stored, removed, batches) = counter.join().unwrap();
    assert_eq!(r.errors, 0, "first error: {:?}", r.first_error);
    // Every turn ran inside the window (the run stopped at 300 turns).
    assert_eq!(r.requests, 300, "{r:?}");
    assert_eq!(r.kv_batches_published, batches);
    assert_eq!(r.blocks_stored, stored);
    assert_eq!(r.blocks_removed, removed);
    assert!(removed > 0, "the caches were meant to evict: {r:?}");
    assert_eq!(
        r.blocks_stored_per_request,
        Some(stored as f64 / r.requests as f64)
    );
    // The server's index counted the same blocks.
    assert!(
        common::eventually(Duration::from_secs(5), || async {
            server.metric("kvselect_ingest_blocks_stored_total").await == stored
                && server.metric("kvselect_ingest_blocks_removed_total").await == removed
        })
        .await,
        "server: stored {} removed {}, published stored {stored} removed {removed}",
        server.metric("kvselect_ingest_blocks_stored_total").await,
        server.metric("kvselect_ingest_blocks_removed_total").await,
    );
    // The server's own freshness figures over the window.
    let f = &r.freshness;
    let applied = f.batches_applied.expect("apply histogram read");
    assert!(applied > 0 && applied <= batches, "{f:?}");
    let (mean, p99) = (
        f.apply_delay_mean_ms.unwrap(),
        f.apply_delay_p99_ms.unwrap(),
    );
    assert!(mean >= 0.0 && (0.0..30_000.0).contains(&p99), "{f:?}");
    assert!(f.engine_delay_p99_ms.is_some(), "{f:?}");
    assert!(f.queued_batches_at_end.is_some(), "{f:?}");
    // Nothing left to apply after the tail.
    assert_eq!(f.queued_batches_after_tail, Some(0.0), "{f:?}");
    assert!(r.tail_s.is_some() && r.tail_server_cores_used.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shed_selections_are_counted_apart_and_retried() {
    // The selection queue: a worker is busy while any prefill is booked on
    // it; one selection may wait 20 ms, more are answered 429 at once.
    let mut config = common::test_config();
    config.router.queue_threshold = Some(0.001);
    config.queue = QueueLimits {
        max_wait: Duration::from_millis(20),
        max_len: 1,
    };
    let server = common::start_with(Config { ..config }).await;
    let mocker = fleet(1, 32_768);
    for ep in mocker.endpoints() {
        let r = server
            .post(
                "/workers",
                &json!({
                    "worker_id": ep.worker_id,
                    "endpoint": format!("http://127.0.0.1:9/mock/{}", ep.worker_id),
                    "block_size": 16,
                    "max_num_batched_tokens": 8192,
                    "kv_events_endpoints": {"0": ep.kv_events},
                    "replay_endpoint": ep.replay,
                }),
            )
            .await;
        assert_eq!(r.status, 201, "{}", r.text());
    }
    let r = run(load(&server, 6), &mocker).await;
    // Sheds are not errors; the turns went on after them.
    assert_eq!(r.errors, 0, "first error: {:?}", r.first_error);
    assert!(r.rejected_429 > 0, "{r:?}");
    assert!(r.requests > 0, "{r:?}");
    // The server counted at least as many 429s as the window saw.
    let text = server.get("/metrics").await.text();
    let served_429: f64 = text
        .lines()
        .filter(|l| l.starts_with("kvselect_http_requests_total{") && l.contains("status=\"429\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(served_429 >= r.rejected_429 as f64, "{served_429} < {r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_wait_holds_the_booking_before_the_free() {
    let server = common::start().await;
    let mocker = fleet(2, 32_768);
    loadgen::register_workers(&server.addr.to_string(), &mocker, Duration::from_secs(10))
        .await
        .unwrap();
    let cfg = LoadConfig {
        think: Duration::ZERO,
        decode: Duration::from_millis(300),
        duration: Duration::from_secs(2),
        ..lone_session(&server)
    };
    // Sample the ledger while the session runs: with a 300 ms decode per
    // turn of a few ms, it holds a booking nearly all the time.
    let sampler = {
        let app = Arc::clone(&server.app);
        tokio::spawn(async move {
            let (mut booked, mut samples) = (0u32, 0u32);
            tokio::time::sleep(Duration::from_millis(100)).await;
            for _ in 0..150 {
                samples += 1;
                booked += u32::from(app.ledger.stats().bookings > 0);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (booked, samples)
        })
    };
    let r = run(cfg, &mocker).await;
    let (booked, samples) = sampler.await.unwrap();
    assert_eq!(r.errors, 0, "first error: {:?}", r.first_error);
    assert_eq!(r.decode_ms, 300);
    // At most one turn per 300 ms in a 2 s window.
    assert!((3..=7).contains(&r.requests), "{r:?}");
    assert!(
        booked * 10 >= samples * 8,
        "booked in {booked} of {samples} samples"
    );
    // Every booking was freed in the end.
    assert_eq!(server.app.ledger.stats().bookings, 0);
}
