//! The replica mesh over real sockets: kvselect replicas (in-process `App`
//! and `Server` on 127.0.0.1:0, each with its own PUB port) under load, with
//! and without dropped messages; a late replica; leases; the peer routes;
//! Dynamo's captured bytes in both directions; session affinity.

mod common;

use common::*;
use kvselect::config::Config;
use kvselect::mesh::wire;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

const WORKERS: [u64; 4] = [11, 12, 13, 14];

fn mesh_config(drop_rate: f64) -> Config {
    Config {
        replica_sync_port: Some(0),
        replica_fault_drop_rate: drop_rate,
        session_affinity_ttl: Some(Duration::from_secs(30)),
        ..test_config()
    }
}

/// A replica: server started, workers registered, then the mesh.
async fn replica(config: Config) -> TestServer {
    let s = start_with(config).await;
    for w in WORKERS {
        s.worker(w, "m", 16, &unused_endpoint()).await;
    }
    s.app.start_mesh(Some(s.addr)).unwrap().unwrap();
    s
}

fn pub_endpoint(s: &TestServer) -> String {
    s.app.mesh().unwrap().endpoint().to_string()
}

/// Connects every replica to every other one through the HTTP route.
async fn full_mesh(rs: &[&TestServer]) {
    for a in rs {
        for b in rs {
            if !std::ptr::eq(*a, *b) {
                let r = a
                    .post(
                        "/replica_sync/register_peer",
                        &json!({"endpoint": pub_endpoint(b)}),
                    )
                    .await;
                assert_eq!(r.status, 201, "{}", r.text());
            }
        }
    }
    // Until each has heard every other's heartbeat: its subscriptions are
    // in place, so nothing published from now on is lost to a slow join.
    for r in rs {
        let heard = eventually(Duration::from_secs(5), || async {
            let text = r.get("/metrics").await.text();
            let peers = text
                .lines()
                .filter(|l| l.starts_with("kvselect_replica_peer_silence_seconds{"))
                .count();
            peers == rs.len() - 1
        })
        .await;
        assert!(heard, "{}", r.get("/metrics").await.text());
    }
}

/// `/loads` with rows sorted (their order is unspecified).
async fn loads(s: &TestServer) -> Value {
    let mut v = s.get("/loads").await.json();
    for p in v.as_array_mut().unwrap() {
        p["loads"]
            .as_array_mut()
            .unwrap()
            .sort_by_key(|r| (r["worker_id"].as_u64(), r["dp_rank"].as_u64()));
    }
    v
}

async fn agree(rs: &[&TestServer]) -> bool {
    let first = loads(rs[0]).await;
    for r in &rs[1..] {
        if loads(r).await != first {
            return false;
        }
    }
    true
}

/// Waits until all replicas show the same `/loads` with `total` live
/// bookings in all; the time it took. Agreeing is not enough: with one
/// message in flight each way, replicas can agree while each is one
/// booking short.
async fn converge(rs: &[&TestServer], total: u64, limit: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if agree(rs).await && total_active(&loads(rs[0]).await) == total {
            return Some(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

/// Waits (2 s at most each) until `b` shows `a`'s `/loads` with `live`
/// bookings, and holds `bindings` session bindings.
async fn caught_up(a: &TestServer, b: &TestServer, live: u64, bindings: u64) {
    assert!(converge(&[a, b], live, Duration::from_secs(2))
        .await
        .is_some());
    assert!(
        eventually(Duration::from_secs(2), || async {
            b.metric("kvselect_session_bindings").await == bindings
        })
        .await
    );
}

fn total_active(v: &Value) -> u64 {
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["loads"].as_array().unwrap().iter())
        .map(|r| r["active_requests"].as_u64().unwrap())
        .sum()
}

/// Per replica, `n` clients each making `per_client` bookings; most are
/// prefill-completed and freed on the replica that booked them, some stay.
async fn load(rs: &[Arc<TestServer>], clients: usize, per_client: usize) {
    let mut tasks = Vec::new();
    for (ri, r) in rs.iter().enumerate() {
        for c in 0..clients {
            let r = Arc::clone(r);
            tasks.push(tokio::spawn(async move {
                for i in 0..per_client {
                    let id = format!("r{ri}-c{c}-{i}");
                    // Shared prefixes of different lengths.
                    let prefix = (i % 5) as u32 * 1000;
                    let len = 32 + 16 * (i % 8) as u32;
                    let mut toks = tokens(prefix, prefix + len);
                    toks.push(ri as u32 * 100_000 + c as u32 * 1000 + i as u32);
                    let resp = r
                        .post(
                            "/select_and_reserve",
                            &json!({"model_name": "m", "selection_id": id, "token_ids": toks}),
                        )
                        .await;
                    assert_eq!(resp.status, 200, "{}", resp.text());
                    if i % 4 != 3 {
                        let p = r
                            .post(&format!("/reservations/{id}/prefill_complete"), &json!({}))
                            .await;
                        assert_eq!(p.status, 200);
                    }
                    if i % 5 != 4 {
                        let d = r.delete(&format!("/reservations/{id}")).await;
                        assert_eq!(d.status, 200, "{}", d.text());
                    }
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
}

async fn metric_sum(s: &TestServer, prefix: &str) -> f64 {
    let text = s.get("/metrics").await.text();
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_with_5pct_dropped_converge_within_2s() {
    let rs: Vec<Arc<TestServer>> = vec![
        Arc::new(replica(mesh_config(0.05)).await),
        Arc::new(replica(mesh_config(0.05)).await),
        Arc::new(replica(mesh_config(0.05)).await),
    ];
    let refs: Vec<&TestServer> = rs.iter().map(|r| &**r).collect();
    full_mesh(&refs).await;
    load(&rs, 4, 60).await;
    let took = converge(&refs, 3 * 4 * 12, Duration::from_secs(2)).await;
    let l = loads(&rs[0]).await;
    assert!(
        took.is_some(),
        "no convergence in 2 s:\n{}\n{}\n{}",
        l,
        loads(&rs[1]).await,
        loads(&rs[2]).await
    );
    // 3 replicas x 4 clients x 12 bookings left live.
    assert_eq!(total_active(&l), 3 * 4 * 12, "{l}");
    let dropped: f64 = metric_sum(&rs[0], "kvselect_replica_fault_dropped_total").await
        + metric_sum(&rs[1], "kvselect_replica_fault_dropped_total").await
        + metric_sum(&rs[2], "kvselect_replica_fault_dropped_total").await;
    let repairs: f64 = metric_sum(&rs[0], "kvselect_replica_peer_repairs_total").await
        + metric_sum(&rs[1], "kvselect_replica_peer_repairs_total").await
        + metric_sum(&rs[2], "kvselect_replica_peer_repairs_total").await;
    assert!(
        dropped > 0.0 && repairs > 0.0,
        "dropped {dropped} repairs {repairs}"
    );
    eprintln!("converged {took:?} after the load; {dropped} dropped, {repairs} repairs");
    // Each replica holds the other two's live bookings.
    let held = metric_sum(&rs[0], "kvselect_replica_peer_bookings{").await;
    assert_eq!(held, 2.0 * 4.0 * 12.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_without_drops_agree_with_no_gaps() {
    let rs: Vec<Arc<TestServer>> = vec![
        Arc::new(replica(mesh_config(0.0)).await),
        Arc::new(replica(mesh_config(0.0)).await),
        Arc::new(replica(mesh_config(0.0)).await),
    ];
    let refs: Vec<&TestServer> = rs.iter().map(|r| &**r).collect();
    full_mesh(&refs).await;
    load(&rs, 4, 40).await;
    let took = converge(&refs, 3 * 4 * 8, Duration::from_secs(2)).await;
    assert!(took.is_some(), "replicas disagree 2 s after the load");
    eprintln!("converged {took:?} after the load");
    for r in &rs {
        assert_eq!(metric_sum(r, "kvselect_replica_peer_gaps_total").await, 0.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_replica_catches_up_on_live_bookings() {
    let a = Arc::new(replica(mesh_config(0.0)).await);
    let b = Arc::new(replica(mesh_config(0.0)).await);
    full_mesh(&[&a, &b]).await;
    load(&[Arc::clone(&a), Arc::clone(&b)], 2, 20).await;
    let took = converge(&[&a, &b], 2 * 2 * 4, Duration::from_secs(1)).await;
    assert!(took.is_some(), "{}\n{}", loads(&a).await, loads(&b).await);
    let live = total_active(&loads(&a).await);
    assert_eq!(live, 2 * 2 * 4);

    // C starts now, subscribed to A and B from the command line's peers.
    let c = replica(Config {
        replica_sync_peers: vec![pub_endpoint(&a), pub_endpoint(&b)],
        ..mesh_config(0.0)
    })
    .await;
    let took = converge(&[&a, &b, &c], 2 * 2 * 4, Duration::from_secs(2)).await;
    assert!(took.is_some(), "late replica: {}", loads(&c).await);
    // A booked id of A's is taken on C.
    let r = c
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "selection_id": "r0-c0-4", "token_ids": [1]}),
        )
        .await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(
        r.error(),
        "selection r0-c0-4 is already reserved or being reserved"
    );
    // And a later free on A reaches C.
    assert_eq!(a.delete("/reservations/r0-c0-4").await.status, 200);
    assert!(converge(&[&a, &c], 2 * 2 * 4 - 1, Duration::from_secs(1))
        .await
        .is_some());
}

/// Three pinned bookings on worker `w`, so that a request no session steers
/// goes elsewhere.
async fn load_up(s: &TestServer, w: &Value) {
    for i in 0..3 {
        let r = s
            .post(
                "/select_and_reserve",
                &json!({"model_name": "m", "pinned_worker": {"worker_id": w, "dp_rank": 0}, "token_ids": tokens(5000 + 100 * i, 5064 + 100 * i)}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
}

/// The worker `/select` picks for a short prompt, in `session` if given.
async fn picked(s: &TestServer, session: Option<&str>) -> Value {
    let mut body = json!({"model_name": "m", "token_ids": [7, 8, 9]});
    if let Some(id) = session {
        body["session_id"] = json!(id);
    }
    s.post("/select", &body).await.json()["worker_id"].clone()
}

/// Session bindings ride the repair snapshot: a replica that starts after
/// a session was bound sends that session to the same worker, although the
/// binding message went out before it existed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_replica_learns_the_session_bindings() {
    let a = replica(mesh_config(0.0)).await;
    let first = a
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "session_id": "L", "token_ids": tokens(1, 64)}),
        )
        .await;
    assert_eq!(first.status, 200, "{}", first.text());
    let w = first.json()["worker_id"].clone();
    load_up(&a, &w).await;

    let c = replica(Config {
        replica_sync_peers: vec![pub_endpoint(&a)],
        ..mesh_config(0.0)
    })
    .await;
    // The first booking and load_up's three.
    caught_up(&a, &c, 4, 1).await;
    assert_ne!(picked(&c, None).await, w, "w carries the load on C too");
    assert_eq!(picked(&c, Some("L")).await, w);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_replicas_bookings_expire_with_its_lease() {
    let cfg = || Config {
        replica_lease: Duration::from_millis(600),
        ..mesh_config(0.0)
    };
    let a = replica(cfg()).await;
    let b = replica(cfg()).await;
    full_mesh(&[&a, &b]).await;
    let r = a
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "selection_id": "x", "token_ids": tokens(1, 64)}),
        )
        .await;
    assert_eq!(r.status, 200);
    assert!(converge(&[&a, &b], 1, Duration::from_secs(1))
        .await
        .is_some());
    assert_eq!(total_active(&loads(&b).await), 1);
    drop(a);
    let t0 = Instant::now();
    assert!(
        eventually(Duration::from_secs(3), || async {
            total_active(&loads(&b).await) == 0
        })
        .await
    );
    assert!(t0.elapsed() >= Duration::from_millis(300));
    assert_eq!(
        b.metric("kvselect_replica_lease_expired_bookings_total")
            .await,
        1
    );
}

#[tokio::test]
async fn peer_routes_follow_dynamo_statuses() {
    let s = replica(mesh_config(0.0)).await;
    let ep = "tcp://127.0.0.1:19097";
    let reg = |body: Value| {
        let s = &s;
        async move { s.post("/replica_sync/register_peer", &body).await }
    };
    let r = reg(json!({"endpoint": ep})).await;
    assert_eq!((r.status, r.json()), (201, json!({"status": "ok"})));
    let r = reg(json!({"endpoint": ep})).await;
    assert_eq!((r.status, r.json()), (200, json!({"status": "ok"})));
    reg(json!({"endpoint": "tcp://127.0.0.1:19096"})).await;
    let r = reg(json!({"endpoint": "bogus"})).await;
    assert_eq!(
        (r.status, r.error()),
        (
            400,
            "invalid ZMQ endpoint `bogus`: missing scheme".to_string()
        )
    );
    let r = reg(json!({})).await;
    assert_eq!(r.status, 422);
    let r = s.get("/replica_sync/peers").await;
    assert_eq!(
        r.json(),
        json!(["tcp://127.0.0.1:19096", "tcp://127.0.0.1:19097"])
    );
    let r = s
        .post("/replica_sync/deregister_peer", &json!({"endpoint": ep}))
        .await;
    assert_eq!((r.status, r.json()), (200, json!({"status": "ok"})));
    let r = s
        .post("/replica_sync/deregister_peer", &json!({"endpoint": ep}))
        .await;
    assert_eq!((r.status, r.error()), (404, "peer not found".to_string()));
    let r = s.get("/replica_sync/bookings").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["bookings"], json!([]));
    // Without a mesh the repair source is refused like the other routes.
    let off = start().await;
    let r = off.get("/replica_sync/bookings").await;
    assert_eq!(
        (r.status, r.error()),
        (409, "replica sync is disabled".to_string())
    );
}

// ----- Dynamo's captured bytes (replica-sync.md) -----

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

const ADD_R1: &str = "84aa6d6f64656c5f6e616d65a16dad726f7574696e675f67726f7570a764656661756c74aa626c6f636b5f73697a6510
a56576656e7485aa726571756573745f6964a27231a6776f726b657282a9776f726b65725f69640ba764705f72616e6b00
a46461746181aa4164645265717565737484ae746f6b656e5f73657175656e636594cfea06fc71a5ee6e88cfad01835a37
dd294ccf0d55e56c2bccbd1acf445502a8048d6688b4747261636b5f70726566696c6c5f746f6b656e73c3b66578706563
7465645f6f75747075745f746f6b656e73c0b170726566696c6c5f6c6f61645f68696e7482d920696e697469616c5f6566
666563746976655f70726566696c6c5f746f6b656e7340b965787065637465645f70726566696c6c5f6475726174696f6e
c0a9726f757465725f6964cf57ec890614cfb59fa96c6f72615f6e616d65c0";
const FREE_R1: &str = "84aa6d6f64656c5f6e616d65a16dad726f7574696e675f67726f7570a764656661756c74aa626c6f636b5f73697a6510
a56576656e7485aa726571756573745f6964a27231a6776f726b657282a9776f726b65725f69640ba764705f72616e6b00
a464617461a446726565a9726f757465725f6964cf57ec890614cfb59fa96c6f72615f6e616d65c0";
const BIND_S1: &str = "87aa6d6f64656c5f6e616d65a16dad726f7574696e675f67726f7570a764656661756c74aa73657373696f6e5f6964a253
31a9776f726b65725f69640ba764705f72616e6b00a873657175656e6365cf18edcfd873dc854ea97772697465725f6964
cf57ec890614cfb59f";
const DYNAMO_ROUTER: u64 = 6335589435015411103;

/// A ZMQ XPUB playing a Dynamo replica that `s` subscribes to, returned
/// once the subscription arrived (a PUB drops what it sends before, and a
/// best-effort peer is never repaired).
async fn dynamo_pub(s: &TestServer) -> zmq::Socket {
    let ctx = zmq::Context::new();
    let p = ctx.socket(zmq::XPUB).unwrap();
    p.bind("tcp://127.0.0.1:*").unwrap();
    let ep = p.get_last_endpoint().unwrap().unwrap();
    let r = s
        .post("/replica_sync/register_peer", &json!({"endpoint": ep}))
        .await;
    assert_eq!(r.status, 201);
    let p = tokio::task::spawn_blocking(move || {
        p.set_rcvtimeo(10_000).unwrap();
        let sub = p.recv_bytes(0).expect("the server subscribes");
        assert_eq!(sub.first(), Some(&1), "a subscription");
        p
    })
    .await
    .unwrap();
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captured_dynamo_messages_book_free_and_bind_here() {
    let s = replica(mesh_config(0.0)).await;
    let p = dynamo_pub(&s).await;
    p.send_multipart([wire::SLOT_TOPIC.as_bytes(), &hex(ADD_R1)], 0)
        .unwrap();
    assert!(
        eventually(Duration::from_secs(2), || async {
            s.load_row("m", 11, 0).await["active_requests"] == 1
        })
        .await
    );
    assert_eq!(
        s.load_row("m", 11, 0).await,
        json!({"worker_id":11,"dp_rank":0,"potential_prefill_tokens":64,"potential_decode_blocks":4,"active_requests":1})
    );
    // The id is taken.
    let r = s
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "selection_id": "r1", "token_ids": [1]}),
        )
        .await;
    assert_eq!(r.status, 409);
    // Prefill completion (Dynamo's unit variant) and the captured free.
    let mut pc = hex(FREE_R1);
    let at = pc.windows(5).position(|w| w == b"\xa4Free").unwrap();
    pc.splice(at..at + 5, b"\xb4MarkPrefillCompleted".iter().copied());
    p.send_multipart([wire::SLOT_TOPIC.as_bytes(), &pc], 0)
        .unwrap();
    assert!(
        eventually(Duration::from_secs(2), || async {
            s.load_row("m", 11, 0).await["potential_prefill_tokens"] == 0
        })
        .await
    );
    p.send_multipart([wire::SLOT_TOPIC.as_bytes(), &hex(FREE_R1)], 0)
        .unwrap();
    assert!(
        eventually(Duration::from_secs(2), || async {
            s.load_row("m", 11, 0).await["active_requests"] == 0
        })
        .await
    );
    // Logged and counted as a best-effort peer.
    let text = s.get("/metrics").await.text();
    assert!(
        text.contains(&format!(
            "kvselect_replica_peer_best_effort{{router_id=\"{DYNAMO_ROUTER}\"}} 1"
        )),
        "{text}"
    );

    // The captured binding of S1 to worker 11 steers S1's selects there,
    // although 11 is the busiest worker.
    for i in 0..3 {
        let r = s
            .post(
                "/select_and_reserve",
                &json!({"model_name": "m", "token_ids": tokens(500 + i * 100, 600 + i * 100), "pinned_worker": {"worker_id": 11, "dp_rank": 0}}),
            )
            .await;
        assert_eq!(r.status, 200);
    }
    p.send_multipart([wire::AFFINITY_TOPIC.as_bytes(), &hex(BIND_S1)], 0)
        .unwrap();
    assert!(
        eventually(Duration::from_secs(2), || async {
            s.metric("kvselect_session_bindings").await == 1
        })
        .await
    );
    for i in 0..3 {
        let r = s
            .post(
                "/select",
                &json!({"model_name": "m", "session_id": "S1", "token_ids": tokens(i, i + 64)}),
            )
            .await;
        assert_eq!(r.json()["worker_id"], 11);
    }
    let r = s
        .post(
            "/select",
            &json!({"model_name": "m", "token_ids": tokens(1, 64)}),
        )
        .await;
    assert_ne!(r.json()["worker_id"], 11);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_messages_have_dynamos_layout() {
    let s = replica(mesh_config(0.0)).await;
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).unwrap();
    sub.set_subscribe(b"dynamo.").unwrap();
    sub.set_subscribe(wire::HEARTBEAT_TOPIC.as_bytes()).unwrap();
    sub.set_rcvtimeo(3000).unwrap();
    sub.connect(&pub_endpoint(&s)).unwrap();
    // A heartbeat shows the subscription is in place; later ones are
    // skipped.
    let heartbeat = |f: &[Vec<u8>]| f[0] == wire::HEARTBEAT_TOPIC.as_bytes();
    assert!(heartbeat(&sub.recv_multipart(0).unwrap()));
    let next = || loop {
        let f = sub.recv_multipart(0).unwrap();
        if !heartbeat(&f) {
            return f;
        }
    };
    let router = s.app.mesh().unwrap().router_id();

    // The captured booking: r1, 64 tokens 1..=64 on worker 11, explicit.
    let r = s
        .post(
            "/reservations",
            &json!({"model_name": "m", "selection_id": "r1", "worker_id": 11, "dp_rank": 0,
                    "token_ids": tokens(1, 64), "effective_prefill_tokens": 64}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let frames = next();
    assert_eq!(frames[0], wire::SLOT_TOPIC.as_bytes());
    // Dynamo's bytes with our router id, then kvselect's two extra keys.
    let mut want = hex(ADD_R1);
    let rid = DYNAMO_ROUTER.to_be_bytes();
    let at = want.windows(8).position(|w| w == rid).unwrap();
    want[at..at + 8].copy_from_slice(&router.to_be_bytes());
    want[0] = 0x86;
    let got = &frames[1];
    assert_eq!(&got[..want.len()], &want[..]);
    assert_eq!(&got[want.len()..], b"\xa3seq\x01\xa7chained\xc3");

    // The free: Dynamo's captured free with our router id, then `seq`.
    assert_eq!(s.delete("/reservations/r1").await.status, 200);
    let frames = next();
    let mut want = hex(FREE_R1);
    let at = want.windows(8).position(|w| w == rid).unwrap();
    want[at..at + 8].copy_from_slice(&router.to_be_bytes());
    want[0] = 0x85;
    assert_eq!(&frames[1][..want.len()], &want[..]);
    assert_eq!(&frames[1][want.len()..], b"\xa3seq\x02");

    // A session binding: Dynamo's field layout, then `seq`.
    let r = s
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "session_id": "S1", "token_ids": tokens(1, 64)}),
        )
        .await;
    let worker = r.json()["worker_id"].as_u64().unwrap();
    let mut topics = Vec::new();
    for _ in 0..2 {
        topics.push(next());
    }
    let bind = topics
        .iter()
        .find(|f| f[0] == wire::AFFINITY_TOPIC.as_bytes())
        .expect("a binding message");
    let wire::Message::Binding(b) = wire::decode(&bind[0], &bind[1]).unwrap() else {
        panic!()
    };
    assert_eq!(
        (b.session_id.as_str(), b.worker_id, b.writer_id),
        ("S1", worker, router)
    );
    // Dynamo's captured bytes with our worker, sequence and writer id,
    // then `seq` (4: after r1's add and free, and this booking's add).
    let mut want = hex(BIND_S1);
    want[0] = 0x88;
    let wpos = want
        .windows(10)
        .position(|x| x == b"\xa9worker_id")
        .unwrap()
        + 10;
    assert!(worker < 128);
    want[wpos] = worker as u8;
    let spos = want.windows(9).position(|x| x == b"\xa8sequence").unwrap() + 10;
    want[spos..spos + 8].copy_from_slice(&b.sequence.to_be_bytes());
    let rpos = want
        .windows(10)
        .position(|x| x == b"\xa9writer_id")
        .unwrap()
        + 11;
    want[rpos..rpos + 8].copy_from_slice(&router.to_be_bytes());
    want.extend_from_slice(b"\xa3seq\x04");
    assert_eq!(bind[1], want);
}

// ----- session affinity -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_stick_to_their_booked_worker_and_travel_the_mesh() {
    let a = replica(mesh_config(0.0)).await;
    let b = replica(mesh_config(0.0)).await;
    full_mesh(&[&a, &b]).await;
    let first = a
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "session_id": "S", "token_ids": tokens(1, 64)}),
        )
        .await
        .json();
    let w = first["worker_id"].clone();
    // Different prompts, growing load on w: still w.
    for i in 0..4 {
        let r = a
            .post(
                "/select_and_reserve",
                &json!({"model_name": "m", "session_id": "S", "token_ids": tokens(1000 * i, 1000 * i + 128)}),
            )
            .await;
        assert_eq!(r.json()["worker_id"], w);
    }
    // session_context.session_id wins over session_id.
    let r = a
        .post(
            "/select",
            &json!({"model_name": "m", "session_id": "other", "session_context": {"session_id": "S"}, "token_ids": [1, 2, 3]}),
        )
        .await;
    assert_eq!(r.json()["worker_id"], w);
    // An unrelated request avoids the loaded worker.
    let r = a
        .post(
            "/select",
            &json!({"model_name": "m", "token_ids": [7, 8, 9]}),
        )
        .await;
    assert_ne!(r.json()["worker_id"], w);
    // The binding reached B.
    assert!(
        eventually(Duration::from_secs(2), || async {
            b.post(
                "/select",
                &json!({"model_name": "m", "session_id": "S", "token_ids": [5]}),
            )
            .await
            .json()["worker_id"]
                == w
        })
        .await
    );
    // A bound worker that leaves is replaced at the next booking.
    let wid = w.as_u64().unwrap();
    assert_eq!(a.delete(&format!("/workers/{wid}")).await.status, 200);
    let r = a
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "session_id": "S", "token_ids": [9]}),
        )
        .await;
    assert_eq!(r.status, 200);
    let w2 = r.json()["worker_id"].clone();
    assert_ne!(w2, w);
    let r = a
        .post(
            "/select",
            &json!({"model_name": "m", "session_id": "S", "token_ids": [4]}),
        )
        .await;
    assert_eq!(r.json()["worker_id"], w2);
}

/// `/select` with a session and a selection id, then the replay: the
/// booking binds the session, as Dynamo's does, and the binding travels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_reservation_binds_its_session() {
    let a = replica(mesh_config(0.0)).await;
    let b = replica(mesh_config(0.0)).await;
    full_mesh(&[&a, &b]).await;
    let sel = a
        .post(
            "/select",
            &json!({"model_name": "m", "session_id": "R", "selection_id": "x1", "token_ids": tokens(1, 64)}),
        )
        .await
        .json();
    let w = sel["worker_id"].clone();
    assert_eq!(
        a.metric("kvselect_session_bindings").await,
        0,
        "a select binds nothing"
    );
    let r = a
        .post(
            "/reservations",
            &json!({"model_name": "m", "selection_id": "x1"}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["worker_id"], w);
    load_up(&a, &w).await;
    // B holds x1 and the three pinned bookings, and the binding: until then
    // its idle workers tie, and a pick can land on w by chance.
    caught_up(&a, &b, 4, 1).await;
    for s in [&a, &b] {
        assert!(
            eventually(Duration::from_secs(2), || async {
                picked(s, Some("R")).await == w
            })
            .await
        );
        assert_ne!(picked(s, None).await, w);
    }
}

#[tokio::test]
async fn affinity_target_steers_and_bindings_idle_out() {
    let s = start_with(Config {
        session_affinity_ttl: Some(Duration::from_secs(1)),
        ..test_config()
    })
    .await;
    for w in WORKERS {
        s.worker(w, "m", 16, &unused_endpoint()).await;
    }
    for _ in 0..3 {
        let r = s
            .post(
                "/select_and_reserve",
                &json!({"model_name": "m", "affinity_target": {"worker_id": 13}, "token_ids": tokens(1, 64)}),
            )
            .await;
        assert_eq!(r.json()["worker_id"], 13);
    }
    // A booking steered by a target binds nothing (measured on Dynamo: the
    // session's next select goes by cost).
    let r = s
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "session_id": "T", "affinity_target": {"worker_id": 12, "dp_rank": 0}, "token_ids": [1]}),
        )
        .await;
    assert_eq!(r.json()["worker_id"], 12);
    assert_eq!(s.metric("kvselect_session_bindings").await, 0);
    // A plain booking binds; then load its worker so that only the binding
    // keeps the session there.
    let r = s
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "session_id": "T", "token_ids": [1]}),
        )
        .await;
    let w = r.json()["worker_id"].clone();
    assert_eq!(s.metric("kvselect_session_bindings").await, 1);
    load_up(&s, &w).await;
    assert_eq!(picked(&s, Some("T")).await, w);
    // An explicit target wins over the binding, and with a target the
    // binding is not followed even when the target is not a candidate.
    let other = WORKERS.iter().copied().find(|x| json!(x) != w).unwrap();
    let r = s
        .post(
            "/select",
            &json!({"model_name": "m", "session_id": "T", "affinity_target": {"worker_id": other}, "token_ids": [1]}),
        )
        .await;
    assert_eq!(r.json()["worker_id"], other);
    let r = s
        .post(
            "/select",
            &json!({"model_name": "m", "session_id": "T", "affinity_target": {"worker_id": 99}, "token_ids": [1]}),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_ne!(r.json()["worker_id"], w);
    // A pinned booking binds nothing (as in Dynamo).
    let r = s
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "session_id": "P", "pinned_worker": {"worker_id": 14, "dp_rank": 0}, "token_ids": [1]}),
        )
        .await;
    assert_eq!(r.json()["worker_id"], 14);
    assert_eq!(s.metric("kvselect_session_bindings").await, 1);
    // Idle past the TTL: the cost decides again (w is the busiest).
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..10 {
        let r = s
            .post(
                "/select",
                &json!({"model_name": "m", "session_id": "T", "token_ids": [2]}),
            )
            .await;
        seen.insert(r.json()["worker_id"].as_u64().unwrap());
    }
    assert!(!seen.contains(&w.as_u64().unwrap()), "{seen:?}");
    // Without the flag session ids are ignored.
    let off = start().await;
    for w in WORKERS {
        off.worker(w, "m", 16, &unused_endpoint()).await;
    }
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..8 {
        let r = off
            .post(
                "/select_and_reserve",
                &json!({"model_name": "m", "session_id": "S", "token_ids": tokens(100 * i, 100 * i + 64)}),
            )
            .await;
        seen.insert(r.json()["worker_id"].as_u64().unwrap());
    }
    assert!(seen.len() > 1);
}

/// A booking whose own constraints leave out its session's bound worker is
/// refused, books nothing and drops the binding, so that the next booking
/// binds afresh; a `/select` or a pinned booking leaves the binding alone.
/// The sequence and the texts are Dynamo 1.6.1's, measured.
#[tokio::test]
async fn a_booking_that_excludes_its_sessions_worker_is_refused_and_unbinds() {
    let s = start_with(Config {
        session_affinity_ttl: Some(Duration::from_secs(60)),
        ..test_config()
    })
    .await;
    for w in WORKERS {
        s.worker(w, "m", 16, &unused_endpoint()).await;
    }
    let r = s
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "session_id": "S", "token_ids": tokens(1, 64)}),
        )
        .await;
    let w = r.json()["worker_id"].as_u64().unwrap();
    load_up(&s, &json!(w)).await;
    let other = WORKERS.iter().copied().find(|x| *x != w).unwrap();
    let loads = s.get("/loads").await.text();
    // Neither a select nor a pinned booking elsewhere moves the binding.
    let r = s
        .post(
            "/select",
            &json!({"model_name": "m", "session_id": "S", "allowed_worker_ids": [other], "token_ids": [1]}),
        )
        .await;
    assert_eq!(r.json()["worker_id"], other);
    let r = s
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "selection_id": "p", "session_id": "S", "pinned_worker": {"worker_id": other, "dp_rank": 0}, "token_ids": [1]}),
        )
        .await;
    assert_eq!(r.json()["worker_id"], other);
    assert_eq!(s.delete("/reservations/p").await.status, 200);
    assert_eq!(picked(&s, Some("S")).await, json!(w));
    // The refusal, in either session form.
    for body in [
        json!({"model_name": "m", "selection_id": "c", "session_id": "S", "allowed_worker_ids": [other], "token_ids": [1]}),
        json!({"model_name": "m", "selection_id": "c", "session_context": {"session_id": "S"}, "allowed_worker_ids": [other], "token_ids": [1]}),
    ] {
        let r = s.post("/select_and_reserve", &body).await;
        assert_eq!(r.status, 400);
        assert_eq!(
            r.json()["error"],
            format!("session S is bound to worker {w}, not {other}")
        );
        assert_eq!(s.get("/loads").await.text(), loads, "nothing booked");
        assert_eq!(s.delete("/reservations/c").await.status, 404);
        assert_eq!(s.metric("kvselect_session_bindings").await, 0, "unbound");
        assert_ne!(picked(&s, Some("S")).await, json!(w), "the cost decides");
        // The same booking now succeeds and binds the session afresh.
        let r = s.post("/select_and_reserve", &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["worker_id"], other);
        assert_eq!(s.delete("/reservations/c").await.status, 200);
        assert_eq!(picked(&s, Some("S")).await, json!(other));
        // Back to w for the second round: refused once (bound to other
        // now), then bound.
        let back = json!({"model_name": "m", "selection_id": "c", "session_id": "S", "allowed_worker_ids": [w], "token_ids": [1]});
        let r = s.post("/select_and_reserve", &back).await;
        assert_eq!(r.status, 400, "{}", r.text());
        let r = s.post("/select_and_reserve", &back).await;
        assert_eq!(r.json()["worker_id"], w);
        assert_eq!(s.delete("/reservations/c").await.status, 200);
        assert_eq!(picked(&s, Some("S")).await, json!(w));
    }
    // The replay of a select that went elsewhere: refused, unbound, and the
    // selection used up.
    let r = s
        .post(
            "/select",
            &json!({"model_name": "m", "selection_id": "q", "session_id": "S", "allowed_worker_ids": [other], "token_ids": [1]}),
        )
        .await;
    assert_eq!(r.json()["worker_id"], other);
    let replay = json!({"model_name": "m", "selection_id": "q"});
    let r = s.post("/reservations", &replay).await;
    assert_eq!(r.status, 400);
    assert_eq!(
        r.json()["error"],
        format!("session S is bound to worker {w}, not {other}")
    );
    assert_eq!(s.metric("kvselect_session_bindings").await, 0);
    assert_eq!(s.post("/reservations", &replay).await.status, 404);
    // A targeted select's replay books and binds nothing.
    let r = s
        .post(
            "/select",
            &json!({"model_name": "m", "selection_id": "q2", "session_id": "S", "affinity_target": {"worker_id": w}, "token_ids": [1]}),
        )
        .await;
    assert_eq!(r.json()["worker_id"], w);
    let r = s
        .post(
            "/reservations",
            &json!({"model_name": "m", "selection_id": "q2"}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(s.metric("kvselect_session_bindings").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_booking_a_replica_drops_without_a_free_is_freed_on_its_peers() {
    let a = replica(mesh_config(0.0)).await;
    let b = replica(mesh_config(0.0)).await;
    full_mesh(&[&a, &b]).await;
    let r = a
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "selection_id": "w", "token_ids": tokens(1, 64),
                    "pinned_worker": {"worker_id": 12, "dp_rank": 0}}),
        )
        .await;
    assert_eq!(r.status, 200);
    assert!(
        eventually(Duration::from_secs(1), || async {
            b.load_row("m", 12, 0).await["active_requests"] == 1
        })
        .await
    );
    // Worker 12 leaves A only: A drops the booking without a lifecycle
    // call, and tells B.
    assert_eq!(a.delete("/workers/12").await.status, 200);
    assert!(
        eventually(Duration::from_secs(4), || async {
            b.load_row("m", 12, 0).await["active_requests"] == 0
        })
        .await
    );
    let r = b
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "selection_id": "w", "token_ids": [1]}),
        )
        .await;
    assert_eq!(r.status, 200, "the id is free again: {}", r.text());
}
