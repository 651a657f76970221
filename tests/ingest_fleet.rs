//! Fleet-scale regression tests of issue #15 against the real binary on
//! loopback: past ~1,019 worker-ranks streams went blind (ZeroMQ's default
//! 1,023 sockets per context), register/delete churn leaked descriptors, and
//! a stream that could not open was logged per retry yet looked healthy.

#[path = "common/process.rs"]
mod process;

use kvselect::index::Tier;
use kvselect::ingest::decode::{Group, KvEvent, Stored};
use kvselect::ingest::encode::{encode_batch, EventForm};
use process::{raise_own_fd_limit, request, Binary};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const BS: u32 = 16;

fn post(addr: SocketAddr, path: &str, body: &Value) -> Value {
    let r = request(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    );
    assert!(
        r.status < 300,
        "{path}: {}",
        String::from_utf8_lossy(&r.body)
    );
    serde_json::from_slice(&r.body).unwrap()
}

fn send(addr: SocketAddr, method: &str, path: &str, body: &Value) -> Value {
    let r = request(
        addr,
        method,
        path,
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    );
    assert!(
        r.status < 300,
        "{path}: {}",
        String::from_utf8_lossy(&r.body)
    );
    serde_json::from_slice(&r.body).unwrap()
}

fn get(addr: SocketAddr, path: &str) -> String {
    let r = request(addr, "GET", path, &[], b"");
    assert_eq!(r.status, 200, "{path}");
    String::from_utf8(r.body).unwrap()
}

/// Sum of a metric family's samples whose labels contain `label`.
fn metric(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// (state, last_seq) of every KV stream in GET /workers.
fn streams(addr: SocketAddr) -> Vec<(String, Option<u64>)> {
    let v: Value = serde_json::from_str(&get(addr, "/workers")).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|w| w["kv_streams"].as_array().cloned().unwrap_or_default())
        .map(|s| {
            (
                s["state"].as_str().unwrap().to_string(),
                s["last_seq"].as_u64(),
            )
        })
        .collect()
}

fn store_batch(rank_key: u64) -> Vec<u8> {
    let ev = KvEvent::Stored(Stored {
        block_hashes: vec![rank_key + 1],
        parent_hash: None,
        token_ids: (0..BS).map(|t| t + rank_key as u32).collect(),
        eagle: false,
        block_size: BS,
        medium: Tier::Device,
        lora_name: None,
        cache_salt: None,
        mm_hashes: None,
        group: Group::default(),
    });
    let mut p = Vec::new();
    encode_batch(&mut p, 1.0, &[ev], None, EventForm::Map);
    p
}

const WORKERS: u64 = 1024;
const RANKS: u32 = 4;

/// 1,024 workers x 4 dp ranks, each rank with its own XPUB on its own tcp
/// port: every rank's store is applied.
#[test]
fn fleet_of_4096_ranks_all_receive_their_events() {
    let fds = raise_own_fd_limit();
    assert!(fds >= 16_384, "the test needs 16k fds, has {fds}");
    let server = Binary::start(&["--max-connections", "256"]);
    let addr = server.addr;
    // ZMQ contexts of the test, each below libzmq's 1,023-socket default.
    let ctxs: Vec<zmq::Context> = (0..6).map(|_| zmq::Context::new()).collect();
    let mut pubs = Vec::new();
    for i in 0..(WORKERS * RANKS as u64) as usize {
        let s = ctxs[i / 800].socket(zmq::XPUB).unwrap();
        s.set_xpub_verbose(true).unwrap();
        s.set_linger(0).unwrap();
        s.bind("tcp://127.0.0.1:0").unwrap();
        let ep = s.get_last_endpoint().unwrap().unwrap();
        pubs.push((s, ep, false));
    }
    let t0 = Instant::now();
    for w in 0..WORKERS {
        let eps: serde_json::Map<String, Value> = (0..RANKS)
            .map(|r| {
                (
                    r.to_string(),
                    json!(pubs[(w * RANKS as u64 + r as u64) as usize].1),
                )
            })
            .collect();
        let v = post(
            addr,
            "/workers",
            &json!({"worker_id": w, "endpoint": format!("http://w{w}"), "block_size": BS,
                "data_parallel_size": RANKS, "kv_events_endpoints": eps}),
        );
        assert_eq!(v["lifecycle"], "schedulable");
    }
    let registered = t0.elapsed();
    // Each publisher sends its store once the server's subscription arrived.
    let deadline = Instant::now() + Duration::from_secs(45);
    let mut left = pubs.len();
    while left > 0 {
        assert!(Instant::now() < deadline, "{left} ranks never subscribed");
        for (i, (s, _, sent)) in pubs.iter_mut().enumerate() {
            if *sent {
                continue;
            }
            if let Ok(m) = s.recv_bytes(zmq::DONTWAIT) {
                if m.first() == Some(&1) {
                    s.send_multipart(
                        [&b""[..], &0u64.to_be_bytes(), &store_batch(i as u64 * 1000)],
                        0,
                    )
                    .unwrap();
                    *sent = true;
                    left -= 1;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let all_subscribed = t0.elapsed();
    let want = pubs.len();
    loop {
        let s = streams(addr);
        let got = s.iter().filter(|(_, seq)| *seq == Some(0)).count();
        if got == want {
            assert!(s.iter().all(|(st, _)| st == "live"), "all live");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{got} of {want} ranks got their event"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let all_applied = t0.elapsed();
    let m = get(addr, "/metrics");
    assert_eq!(
        metric(&m, "kvselect_ingest_blocks_stored_total", ""),
        want as f64
    );
    assert_eq!(
        metric(&m, "kvselect_kv_stream_state", "state=\"live\""),
        want as f64
    );
    let log = server.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("KV-event streams that fit"))
        .expect("start-up capacity line")
        .to_string();
    eprintln!(
        "fleet: {want} ranks; registered in {registered:?}, all subscribed at {all_subscribed:?}, \
         all applied at {all_applied:?}; server RSS {} MiB, {} fds\nstart-up: {line}",
        server.rss() >> 20,
        server.fd_count()
    );
}

/// 1,100 register/delete cycles, with endpoints that fail validation and a
/// PATCH of the endpoint, leave the descriptor count where it started.
#[test]
fn register_delete_cycles_leak_no_fd() {
    let server = Binary::start(&[]);
    let addr = server.addr;
    // Nothing listens on these ports: the SUB sockets connect and retry.
    let worker = |id: u64, kv: &str| {
        json!({"worker_id": id, "endpoint": "http://w", "block_size": BS,
            "kv_events_endpoint": kv})
    };
    let cycle = |i: u64| {
        let id = i % 7;
        let kv = match i % 5 {
            0 => "inproc://x".to_string(),
            1 => "ipc:///tmp/kvselect-fleet-test.sock".to_string(),
            2 => "tcp://127.0.0.1:0".to_string(),
            _ => format!("tcp://127.0.0.1:{}", 19300 + i % 50),
        };
        post(addr, "/workers", &worker(id, &kv));
        if i.is_multiple_of(3) {
            send(
                addr,
                "PATCH",
                &format!("/workers/{id}"),
                &json!({"kv_events_endpoint": format!("tcp://127.0.0.1:{}", 19360 + i % 20)}),
            );
        }
        let r = request(addr, "DELETE", &format!("/workers/{id}"), &[], b"");
        assert_eq!(r.status, 200);
    };
    // Warm-up: ZMQ's I/O thread, the HTTP pools and the runtime settle.
    for i in 0..20 {
        cycle(i);
    }
    std::thread::sleep(Duration::from_millis(300));
    let before = server.fd_count();
    for i in 0..1_100 {
        cycle(i);
    }
    // libzmq's reaper closes a socket's descriptors asynchronously.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut after = server.fd_count();
    while after > before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        after = server.fd_count();
    }
    assert!(
        after <= before,
        "fds {before} -> {after} after 1,100 cycles"
    );
    let v: Value = serde_json::from_str(&get(addr, "/workers")).unwrap();
    assert_eq!(v, json!([]));
}

/// More streams than the ZMQ context holds: the ranks that cannot open are
/// `failed` in /workers and /metrics, retried, and logged once each.
#[test]
fn stream_open_failure_is_visible_and_logged_once() {
    // With 3,200 descriptors and --max-connections 1000 the context gets
    // libzmq's floor of 1,023 sockets: 1,019 streams (4 are the doorbells
    // of 2 ingest threads; the default is 4 threads).
    let server = Binary::start_limited(
        &["--max-connections", "1000", "--threads", "2"],
        &[],
        Some(3200),
    );
    let addr = server.addr;
    let ranks = 1030u32;
    let eps: serde_json::Map<String, Value> = (0..ranks)
        .map(|r| {
            (
                r.to_string(),
                json!(format!("tcp://127.0.0.1:{}", 19200 + r % 90)),
            )
        })
        .collect();
    let v = post(
        addr,
        "/workers",
        &json!({"worker_id": 1, "endpoint": "http://w", "block_size": BS,
            "data_parallel_size": ranks, "kv_events_endpoints": eps}),
    );
    assert_eq!(v["lifecycle"], "schedulable");
    let failed = |addr| {
        streams(addr)
            .iter()
            .filter(|(st, _)| st == "failed")
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while failed(addr) != 11 {
        assert!(
            Instant::now() < deadline,
            "failed streams: {}",
            failed(addr)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Several backoff rounds (100 ms doubling) pass; still one line each.
    std::thread::sleep(Duration::from_secs(2));
    let w: Value = serde_json::from_str(&get(addr, "/workers")).unwrap();
    let failed_streams: Vec<&Value> = w[0]["kv_streams"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["state"] == "failed")
        .collect();
    assert_eq!(failed_streams.len(), 11);
    assert!(
        failed_streams[0]["error"].as_str().unwrap_or("").len() > 3,
        "{}",
        failed_streams[0]
    );
    let m = get(addr, "/metrics");
    assert_eq!(
        metric(&m, "kvselect_kv_stream_state", "state=\"failed\""),
        11.0
    );
    assert!(
        metric(&m, "kvselect_ingest_connect_errors_total", "") > 11.0,
        "retried"
    );
    let log = server.log_text();
    let lines = log
        .lines()
        .filter(|l| l.contains("cannot open the KV-event stream"))
        .count();
    assert_eq!(lines, 11, "one line per failed stream");
    let line = log
        .lines()
        .find(|l| l.contains("KV-event streams that fit"))
        .unwrap();
    assert!(line.contains("kv_streams=1019"), "{line}");
}
