//! Per-stream freshness (issue #17 item 1, issue #15 item 6) against the real
//! binary on loopback with real ZMQ publishers: the age of the newest applied
//! batch grows while a stream is silent and resets when an event arrives, the
//! engine-to-index delay comes from the batch's own `ts`, gaps, replays and
//! malformed messages are counted per stream, the received-but-unapplied
//! queue drains back to 0, and /metrics carries the same figures (accepted by
//! `promtool check metrics`).

#[path = "common/process.rs"]
mod process;

use kvselect::index::Tier;
use kvselect::ingest::decode::{Group, KvEvent, Stored};
use kvselect::ingest::encode::{encode_batch, EventForm};
use process::{promtool, request, Binary};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const BS: u32 = 16;
const WAIT: Duration = Duration::from_secs(15);

fn get(addr: SocketAddr, path: &str) -> String {
    let r = request(addr, "GET", path, &[], b"");
    assert_eq!(r.status, 200, "{path}");
    String::from_utf8(r.body).unwrap()
}

fn register(addr: SocketAddr, id: u64, kv: &str, replay: Option<&str>) {
    let mut body = json!({"worker_id": id, "model_name": "m", "endpoint": format!("http://w{id}"),
                          "block_size": BS, "kv_events_endpoints": {"0": kv}});
    if let Some(r) = replay {
        body["replay_endpoint"] = json!(r);
    }
    let r = request(
        addr,
        "POST",
        "/workers",
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
}

/// The `kv_streams` entry of (worker, rank 0) in GET /workers.
fn stream(addr: SocketAddr, id: u64) -> Value {
    let v: Value = serde_json::from_str(&get(addr, "/workers")).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == id)
        .and_then(|w| w["kv_streams"].get(0).cloned())
        .unwrap_or_else(|| panic!("no stream for worker {id}: {v}"))
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("timed out waiting for {what}");
}

/// Waits until worker `w`'s stream applied `seq` and is live with nothing
/// queued, and the delay histogram counts `observed` batches. The listener
/// writes the last seq first, then the state and the queue, and flushes
/// the histograms at the end of its round.
fn wait_settled(addr: SocketAddr, w: u64, seq: u64, observed: f64) {
    wait_for(&format!("worker {w} settled at seq {seq}"), || {
        let s = stream(addr, w);
        s["last_seq"] == seq
            && s["state"] == "live"
            && s["queued_batches"] == 0
            && metric(
                &get(addr, "/metrics"),
                "kvselect_ingest_apply_delay_seconds_count",
                "",
            ) == Some(observed)
    });
}

fn now_ts() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// One batch storing block `key + 1` (16 tokens), stamped `ts`.
fn batch(key: u64, ts: f64) -> Vec<u8> {
    let ev = KvEvent::Stored(Stored {
        block_hashes: vec![key + 1],
        parent_hash: None,
        token_ids: (0..BS).map(|t| t + 100 * key as u32).collect(),
        eagle: false,
        block_size: BS,
        medium: Tier::Device,
        lora_name: None,
        cache_salt: None,
        mm_hashes: None,
        group: Group::default(),
    });
    let mut p = Vec::new();
    encode_batch(&mut p, ts, &[ev], None, EventForm::Map);
    p
}

/// An XPUB on loopback, so the test knows when the server has subscribed.
struct Publisher {
    socket: zmq::Socket,
    endpoint: String,
    _ctx: zmq::Context,
}

impl Publisher {
    fn bind() -> Publisher {
        let ctx = zmq::Context::new();
        let socket = ctx.socket(zmq::XPUB).unwrap();
        socket.set_linger(0).unwrap();
        socket.set_sndhwm(1_000_000).unwrap();
        socket.bind("tcp://127.0.0.1:0").unwrap();
        let endpoint = socket.get_last_endpoint().unwrap().unwrap();
        Publisher {
            socket,
            endpoint,
            _ctx: ctx,
        }
    }

    fn wait_subscriber(&self) {
        self.socket.set_rcvtimeo(WAIT.as_millis() as i32).unwrap();
        let sub = self.socket.recv_bytes(0).expect("subscription");
        assert_eq!(sub.first(), Some(&1), "a subscribe message");
    }

    fn send(&self, seq: u64, payload: &[u8]) {
        self.socket
            .send_multipart([&b""[..], &seq.to_be_bytes()[..], payload], 0)
            .unwrap();
    }
}

/// Sum of a metric family's samples whose labels contain `label`; `None`
/// when no sample matches.
fn metric(text: &str, name: &str, label: &str) -> Option<f64> {
    let v: Vec<f64> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .collect();
    (!v.is_empty()).then(|| v.iter().sum())
}

fn f(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} not a number: {v}"))
}

#[test]
fn age_gaps_malformed_and_queue_follow_the_stream() {
    let server = Binary::start(&[]);
    let addr = server.addr;
    let publisher = Publisher::bind();
    register(addr, 1, &publisher.endpoint, None);
    publisher.wait_subscriber();

    // Before the first batch: no age, no delay, nothing counted.
    let s = stream(addr, 1);
    assert_eq!(s["last_applied_age_seconds"], Value::Null, "{s}");
    assert_eq!(s["engine_delay_seconds"], Value::Null, "{s}");
    assert_eq!(s["queued_batches"], 0, "{s}");
    assert_eq!(
        (s["gaps"].clone(), s["replays"].clone()),
        (json!(0), json!(0))
    );

    publisher.send(0, &batch(0, now_ts()));
    // The last seq is written before the age and the engine delay.
    wait_for("seq 0 applied", || {
        let s = stream(addr, 1);
        s["last_seq"] == 0 && s["engine_delay_seconds"].is_number()
    });
    let s = stream(addr, 1);
    let fresh = f(&s, "last_applied_age_seconds");
    assert!((0.0..2.0).contains(&fresh), "{s}");
    let delay = f(&s, "engine_delay_seconds");
    assert!((0.0..2.0).contains(&delay), "engine delay from ts: {s}");

    // Silent: the age grows.
    std::thread::sleep(Duration::from_millis(1500));
    let silent = f(&stream(addr, 1), "last_applied_age_seconds");
    assert!(silent >= 1.4 && silent > fresh, "{silent} after {fresh}");

    // An event resets it. A batch stamped 30 s ago shows that delay.
    publisher.send(1, &batch(1, now_ts() - 30.0));
    wait_for("seq 1 applied", || {
        let s = stream(addr, 1);
        s["last_seq"] == 1 && s["engine_delay_seconds"].as_f64() >= Some(30.0)
    });
    let s = stream(addr, 1);
    let reset = f(&s, "last_applied_age_seconds");
    assert!(reset < silent && reset < 1.0, "{reset} after {silent}: {s}");
    let delay = f(&s, "engine_delay_seconds");
    assert!((30.0..35.0).contains(&delay), "{s}");
    assert_eq!(s["gaps"], 0, "{s}");

    // Seq 2..4 skipped (no replay endpoint: the gap is counted, 5 applies).
    publisher.send(5, &batch(5, now_ts()));
    wait_for("seq 5 applied", || stream(addr, 1)["last_seq"] == 5);
    let s = stream(addr, 1);
    assert_eq!(
        (s["gaps"].clone(), s["replays"].clone()),
        (json!(1), json!(0))
    );

    // A message that does not decode is dropped and counted.
    publisher.send(6, b"\xc1not msgpack");
    wait_for("malformed counted", || stream(addr, 1)["malformed"] == 1);

    // A burst: every batch is applied, then the queue is back to 0.
    let n = 3000u64;
    for seq in 6..6 + n {
        publisher.send(seq, &batch(seq, now_ts()));
    }
    let last = 5 + n;
    // Every batch observed: 3 singles and the burst.
    let applied = 3.0 + n as f64;
    wait_settled(addr, 1, last, applied);
    let s = stream(addr, 1);
    assert_eq!(s["queued_batches"], 0, "{s}");
    assert_eq!(s["gaps"], 1, "{s}");
    assert_eq!(s["state"], "live", "{s}");

    let text = get(addr, "/metrics");
    let w = "worker_id=\"1\"";
    for (name, want) in [
        ("kvselect_kv_stream_gaps_total", Some(1.0)),
        ("kvselect_kv_stream_replays_total", Some(0.0)),
        ("kvselect_kv_stream_malformed_total", Some(1.0)),
        ("kvselect_kv_stream_queued_batches", Some(0.0)),
        ("kvselect_ingest_queued_batches", Some(0.0)),
    ] {
        assert_eq!(
            metric(&text, name, if name.contains("stream") { w } else { "" }),
            want,
            "{name}\n{text}"
        );
    }
    let age = metric(&text, "kvselect_kv_stream_last_applied_age_seconds", w).expect("age");
    assert!((0.0..5.0).contains(&age), "{age}");
    assert!(metric(&text, "kvselect_kv_stream_engine_delay_seconds", w).is_some());
    assert_eq!(
        metric(&text, "kvselect_ingest_apply_delay_seconds_count", ""),
        Some(applied)
    );
    assert_eq!(
        metric(&text, "kvselect_ingest_engine_delay_seconds_count", ""),
        Some(applied)
    );
    // The 30 s old batch is in the engine delay's top buckets only.
    assert_eq!(
        metric(
            &text,
            "kvselect_ingest_engine_delay_seconds_bucket",
            "le=\"10\""
        ),
        Some(applied - 1.0)
    );
    if let Some((ok, msg)) = promtool(&text) {
        assert!(ok, "promtool check metrics failed:\n{msg}\n{text}");
    }
}

/// A ROUTER answering one replay request with seqs `[start, upto)` and the
/// end marker, in vLLM 0.34's 4-frame form.
fn replay_server(ctx: &zmq::Context, upto: u64) -> (String, std::thread::JoinHandle<u64>) {
    let router = ctx.socket(zmq::ROUTER).unwrap();
    router.set_linger(0).unwrap();
    router.bind("tcp://127.0.0.1:0").unwrap();
    router.set_rcvtimeo(WAIT.as_millis() as i32).unwrap();
    let endpoint = router.get_last_endpoint().unwrap().unwrap();
    let h = std::thread::spawn(move || {
        let req = router.recv_multipart(0).expect("replay request");
        let start = u64::from_be_bytes(req[2].as_slice().try_into().unwrap());
        let id = req[0].clone();
        for seq in start..upto {
            let p = batch(seq, now_ts());
            router
                .send_multipart([&id[..], b"", b"kv", &seq.to_be_bytes(), &p], 0)
                .unwrap();
        }
        router
            .send_multipart([&id[..], b"", b"", &u64::MAX.to_be_bytes(), b""], 0)
            .unwrap();
        std::thread::sleep(Duration::from_millis(300));
        start
    });
    (endpoint, h)
}

#[test]
fn a_replayed_gap_counts_one_gap_and_one_replay() {
    let server = Binary::start(&[]);
    let addr = server.addr;
    let ctx = zmq::Context::new();
    let publisher = Publisher::bind();
    let (replay, served) = replay_server(&ctx, 3);
    register(addr, 2, &publisher.endpoint, Some(&replay));
    publisher.wait_subscriber();

    publisher.send(0, &batch(0, now_ts()));
    wait_for("seq 0 applied", || stream(addr, 2)["last_seq"] == 0);
    // Seq 1 and 2 are missed; the replay brings them, then 3 applies.
    publisher.send(3, &batch(3, now_ts()));
    // The replay is done, and 3 applied after it.
    wait_settled(addr, 2, 3, 4.0);
    assert_eq!(served.join().unwrap(), 1, "replay asked from seq 1");
    let s = stream(addr, 2);
    assert_eq!(
        (s["gaps"].clone(), s["replays"].clone()),
        (json!(1), json!(1)),
        "{s}"
    );
    assert_eq!(s["queued_batches"], 0, "{s}");
    assert_eq!(s["malformed"], 0, "{s}");
    let text = get(addr, "/metrics");
    let w = "worker_id=\"2\"";
    assert_eq!(
        metric(&text, "kvselect_kv_stream_replays_total", w),
        Some(1.0)
    );
    assert_eq!(metric(&text, "kvselect_kv_stream_gaps_total", w), Some(1.0));
    // seq 0, the replayed 1 and 2, and the parked 3.
    assert_eq!(
        metric(&text, "kvselect_ingest_apply_delay_seconds_count", ""),
        Some(4.0)
    );
}

#[test]
fn a_gap_waiting_for_its_replay_shows_in_the_queue_until_it_is_given_up() {
    let server = Binary::start(&[]);
    let addr = server.addr;
    let ctx = zmq::Context::new();
    // A replay endpoint that accepts the request and never answers.
    let silent = ctx.socket(zmq::ROUTER).unwrap();
    silent.set_linger(0).unwrap();
    silent.bind("tcp://127.0.0.1:0").unwrap();
    silent.set_rcvtimeo(WAIT.as_millis() as i32).unwrap();
    let replay = silent.get_last_endpoint().unwrap().unwrap();
    let publisher = Publisher::bind();
    register(addr, 3, &publisher.endpoint, Some(&replay));
    publisher.wait_subscriber();

    publisher.send(0, &batch(0, now_ts()));
    wait_for("seq 0 applied", || stream(addr, 3)["last_seq"] == 0);
    // Seq 1 is missed: seq 2 waits, received but unapplied, for the replay.
    publisher.send(2, &batch(2, now_ts()));
    // The queue is published after the state.
    wait_for("replaying", || {
        let s = stream(addr, 3);
        s["state"] == "replaying" && s["queued_batches"] == 1
    });
    let s = stream(addr, 3);
    assert_eq!(s["queued_batches"], 1, "{s}");
    assert_eq!(s["last_seq"], 0, "{s}");
    assert_eq!(s["gaps"], 1, "{s}");
    let text = get(addr, "/metrics");
    assert_eq!(
        metric(
            &text,
            "kvselect_kv_stream_queued_batches",
            "worker_id=\"3\""
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(&text, "kvselect_ingest_queued_batches", ""),
        Some(1.0)
    );
    let silent_req = silent.recv_multipart(0).expect("replay request");
    assert_eq!(silent_req.len(), 3);

    // The replay times out (2 s): the gap is given up, seq 2 applies and
    // its receipt-to-application delay shows the wait.
    wait_settled(addr, 3, 2, 2.0);
    let s = stream(addr, 3);
    assert_eq!(s["queued_batches"], 0, "{s}");
    assert_eq!(
        (s["gaps"].clone(), s["replays"].clone()),
        (json!(1), json!(0))
    );
    let text = get(addr, "/metrics");
    assert_eq!(
        metric(&text, "kvselect_ingest_queued_batches", ""),
        Some(0.0)
    );
    let waited = metric(
        &text,
        "kvselect_ingest_apply_delay_seconds_bucket",
        "le=\"1\"",
    );
    assert_eq!(waited, Some(1.0), "only seq 0 applied within 1 s:\n{text}");
    assert_eq!(
        metric(&text, "kvselect_ingest_apply_delay_seconds_count", ""),
        Some(2.0)
    );
}
