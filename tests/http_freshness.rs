//! The freshness gate (issue #17 items 2-3) against the real binary on
//! loopback, with 1,024 real ZMQ publishers.
//!
//! A burst of KV events from 1,024 workers, more than one ingest thread
//! applies in the wait bound, puts the index behind. Meanwhile a probe
//! stores a fresh marker prompt on one worker, behind that worker's share
//! of the burst, waits past the freshness bound, and selects the marker
//! prompt. (The burst is a few large batches per worker, so it reaches the
//! process several times faster than it can be applied: the marker is in
//! the process, behind the applier, not in transit.) With the gate,
//! every 200 answer has seen the marker (the marker's worker, its full
//! overlap), and the load past what the index can follow is answered 429.
//! With the gate off, the same probes get answers from the stale index:
//! the control that shows the test can fail.

mod common;
#[path = "common/process.rs"]
mod process;

use common::{removed, stored};
use kvselect::ingest::decode::KvEvent;
use kvselect::ingest::encode::{encode_batch, EventForm};
use process::{raise_own_fd_limit, request, Binary};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const BS: u32 = 16;
const WORKERS: u64 = 1024;
/// Burst batches per worker: a store of `BURST_BLOCKS` chained blocks,
/// then their removal, alternately.
const BURST_BATCHES: u64 = 16;
const BURST_BLOCKS: u64 = 1024;
const MARKER_BLOCKS: u32 = 4;

fn post_raw(addr: SocketAddr, path: &str, body: &Value) -> process::RawResponse {
    request(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    )
}

fn metric(addr: SocketAddr, name: &str) -> f64 {
    let r = request(addr, "GET", "/metrics", &[], b"");
    String::from_utf8(r.body)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

fn batch(events: &[KvEvent]) -> Vec<u8> {
    let mut p = Vec::new();
    encode_batch(&mut p, 1.0, events, None, EventForm::Map);
    p
}

/// `n` engine block hashes from `first`.
fn hashes(first: u64, n: u64) -> Vec<u64> {
    (first..first + n).collect()
}

/// The probe's prompt: tokens no burst batch holds.
fn marker_tokens(probe: u32) -> Vec<u32> {
    (0..MARKER_BLOCKS * BS)
        .map(|i| 1_000_000 + probe * 1000 + i)
        .collect()
}

struct Fleet {
    _ctxs: Vec<zmq::Context>,
    /// One XPUB per worker, and the next sequence number it sends.
    pubs: Vec<(zmq::Socket, u64)>,
}

impl Fleet {
    /// 1,024 workers registered, each with its own publisher, all
    /// subscribed.
    fn register(addr: SocketAddr) -> Fleet {
        let ctxs: Vec<zmq::Context> = (0..2).map(|_| zmq::Context::new()).collect();
        let mut pubs = Vec::new();
        for w in 0..WORKERS {
            let s = ctxs[(w / 600) as usize].socket(zmq::XPUB).unwrap();
            s.set_xpub_verbose(true).unwrap();
            s.set_linger(0).unwrap();
            // Never drop a batch at the publisher: the marker must arrive.
            s.set_sndhwm(0).unwrap();
            s.bind("tcp://127.0.0.1:0").unwrap();
            let ep = s.get_last_endpoint().unwrap().unwrap();
            let r = post_raw(
                addr,
                "/workers",
                &json!({"worker_id": w, "endpoint": format!("http://w{w}"), "block_size": BS,
                    "kv_events_endpoints": {"0": ep}}),
            );
            assert!(r.status < 300, "{}", String::from_utf8_lossy(&r.body));
            pubs.push((s, 0));
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut subscribed = vec![false; pubs.len()];
        let mut left = pubs.len();
        while left > 0 {
            assert!(Instant::now() < deadline, "{left} workers never subscribed");
            for (i, (s, _)) in pubs.iter().enumerate() {
                if !subscribed[i]
                    && s.recv_bytes(zmq::DONTWAIT)
                        .is_ok_and(|m| m.first() == Some(&1))
                {
                    subscribed[i] = true;
                    left -= 1;
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Fleet { _ctxs: ctxs, pubs }
    }

    fn send(&mut self, w: usize, payload: &[u8]) {
        let (s, seq) = &mut self.pubs[w];
        s.send_multipart([&b""[..], &seq.to_be_bytes(), payload], 0)
            .unwrap();
        *seq += 1;
    }
}

#[derive(Debug, Default)]
struct Outcome {
    /// 200 answers that saw the marker.
    fresh: u32,
    /// 200 answers that did not.
    stale: u32,
    /// 429 answers.
    shed: u32,
    /// 200 answers' `x-kvselect-index-lag-ms`.
    lags_ms: Vec<f64>,
    /// Share of the batches applied within 50 ms of being read.
    applied_within_bound: f64,
}

/// Starts the server with `args`, floods it, probes it; the probes' tally.
fn burst_and_probe(args: &[&str]) -> Outcome {
    let fds = raise_own_fd_limit();
    assert!(fds >= 8_192, "the test needs 8k fds, has {fds}");
    let mut all = vec!["--threads", "1", "--max-connections", "256"];
    all.extend_from_slice(args);
    let server = Binary::start(&all);
    let addr = server.addr;
    let mut fleet = Fleet::register(addr);

    // The burst: stores of fresh blocks and their removals, alternately,
    // the same payloads for every worker (the index keys blocks per
    // worker), queued at once: far more than one thread applies in the
    // wait bound.
    let payloads: Vec<Vec<u8>> = (0..BURST_BATCHES)
        .map(|b| {
            let first = 1 + (b / 2) * BURST_BLOCKS;
            if b % 2 == 0 {
                let tokens: Vec<u32> = (0..(BURST_BLOCKS as u32 * BS))
                    .map(|t| (t + b as u32) % 100)
                    .collect();
                batch(&[stored(
                    &hashes(first, BURST_BLOCKS),
                    None,
                    &tokens,
                    BS,
                    "GPU",
                )])
            } else {
                batch(&[removed(&hashes(first, BURST_BLOCKS), "GPU")])
            }
        })
        .collect();
    for p in &payloads {
        for w in 0..WORKERS as usize {
            fleet.send(w, p);
        }
    }

    // Probes while the burst is applied: a marker on worker w, behind w's
    // share of the burst, a wait past the bound, then the select.
    let mut out = Outcome::default();
    let started = Instant::now();
    // The senders' and the server's I/O threads move the burst first; a
    // marker sent now could wait behind that, outside the process.
    std::thread::sleep(Duration::from_millis(150));
    let mut probe = 0u32;
    while probe < 12 || (metric(addr, "kvselect_index_lag_seconds") > 0.0 && probe < 400) {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the burst never drained"
        );
        let w = (probe as usize * 389) % WORKERS as usize;
        let m = marker_tokens(probe);
        let hash = 10_000_000 + u64::from(probe) * 100;
        let marker = stored(&hashes(hash, u64::from(MARKER_BLOCKS)), None, &m, BS, "GPU");
        fleet.send(w, &batch(&[marker]));
        std::thread::sleep(Duration::from_millis(80));
        let t = Instant::now();
        let r = post_raw(addr, "/select", &json!({"token_ids": m}));
        eprintln!(
            "probe {probe} at {:?}: {} in {:?}",
            started.elapsed(),
            r.status,
            t.elapsed()
        );
        match r.status {
            200 => {
                let v: Value = serde_json::from_slice(&r.body).unwrap();
                let saw = v["worker_id"] == json!(w)
                    && v["overlap"]["longest_matched"] == json!(MARKER_BLOCKS * BS);
                if saw {
                    out.fresh += 1;
                } else {
                    out.stale += 1;
                }
                let lag = r
                    .header("x-kvselect-index-lag-ms")
                    .expect("the lag header on every selection");
                out.lags_ms.push(lag.parse().unwrap());
            }
            429 => {
                assert!(r.header("retry-after").is_some());
                let v: Value = serde_json::from_slice(&r.body).unwrap();
                assert!(
                    v["error"].as_str().unwrap().contains("behind its events"),
                    "{v}"
                );
                out.shed += 1;
            }
            s => panic!("{s}: {}", String::from_utf8_lossy(&r.body)),
        }
        probe += 1;
    }
    // The index drains; once it has, every marker is there and answers
    // come at once.
    let m = marker_tokens(0);
    let r = post_raw(addr, "/select", &json!({"token_ids": m}));
    assert_eq!(r.status, 200);
    assert_eq!(metric(addr, "kvselect_ingest_malformed_dropped_total"), 0.0);
    let all = metric(addr, "kvselect_ingest_apply_delay_seconds_count");
    let within = metric(
        addr,
        "kvselect_ingest_apply_delay_seconds_bucket{le=\"0.05\"}",
    );
    eprintln!("apply delay: {within} of {all} within 50 ms");
    out.applied_within_bound = within / all;
    out
}

#[test]
fn a_burst_past_what_one_core_applies_sheds_load_instead_of_answering_stale() {
    let gated = burst_and_probe(&["--max-index-lag-ms", "50", "--index-lag-max-wait-ms", "300"]);
    eprintln!("gate on: {gated:?}");
    assert_eq!(
        gated.stale, 0,
        "an answer missed an event older than the bound: {gated:?}"
    );
    assert!(gated.fresh > 0, "{gated:?}");
    assert!(
        gated.shed > 0,
        "the burst never outlasted the wait bound: {gated:?}"
    );

    let open = burst_and_probe(&["--max-index-lag-ms", "0"]);
    eprintln!("gate off: {open:?}");
    assert_eq!(open.shed, 0, "{open:?}");
    assert!(
        open.stale > 0,
        "without the gate the burst should have produced stale answers: {open:?}"
    );
}
