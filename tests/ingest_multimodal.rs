//! Multimodal blocks, cache salts and LoRA names in KV events, end to end:
//! the release binary subscribed to a real ZMQ PUB that sends the bytes
//! engines send, queried over HTTP. The expected overlaps are what Dynamo
//! 1.6.1 answered for the same publications (ARCHITECTURE.md, "Multimodal
//! blocks in KV events").

#[path = "common/process.rs"]
mod process;

use process::{request, Binary};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const BS: u64 = 4;
const WAIT: Duration = Duration::from_secs(10);

/// A msgpack value, spelt the way engines build events.
enum V {
    Nil,
    U(u64),
    S(&'static str),
    A(Vec<V>),
    M(Vec<(&'static str, V)>),
}

fn enc(v: &V, out: &mut Vec<u8>) {
    use rmp::encode as w;
    match v {
        V::Nil => w::write_nil(out).unwrap(),
        V::U(x) => drop(w::write_uint(out, *x).unwrap()),
        V::S(s) => w::write_str(out, s).unwrap(),
        V::A(xs) => {
            w::write_array_len(out, xs.len() as u32).unwrap();
            xs.iter().for_each(|x| enc(x, out));
        }
        V::M(kv) => {
            w::write_map_len(out, kv.len() as u32).unwrap();
            for (k, x) in kv {
                w::write_str(out, k).unwrap();
                enc(x, out);
            }
        }
    }
}

fn toks(a: u64, b: u64) -> Vec<u64> {
    (a..=b).collect()
}

/// vLLM 0.34's `BlockStored`: msgspec's declaration order under a map16
/// header, `extra_keys` always present, then `more` keys (a TRT-LLM bridge
/// adds `cache_salt` / `block_mm_infos`).
fn store(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u64],
    extra_keys: V,
    more: Vec<(&'static str, V)>,
) -> Vec<u8> {
    let mut kv = vec![
        ("type", V::S("BlockStored")),
        (
            "block_hashes",
            V::A(hashes.iter().map(|&h| V::U(h)).collect()),
        ),
        ("parent_block_hash", parent.map_or(V::Nil, V::U)),
        ("token_ids", V::A(tokens.iter().map(|&t| V::U(t)).collect())),
        ("block_size", V::U(BS)),
        ("lora_id", V::Nil),
        ("medium", V::S("GPU")),
    ];
    let lora = more.iter().position(|(k, _)| *k == "lora_name");
    let mut more = more;
    kv.push(("lora_name", lora.map_or(V::Nil, |i| more.remove(i).1)));
    kv.push(("extra_keys", extra_keys));
    kv.extend(more);
    kv.push(("group_idx", V::U(0)));
    kv.push(("kv_cache_spec_kind", V::S("full_attention")));
    let mut ev = vec![0xde];
    ev.extend_from_slice(&(kv.len() as u16).to_be_bytes());
    for (k, x) in &kv {
        rmp::encode::write_str(&mut ev, k).unwrap();
        enc(x, &mut ev);
    }
    ev
}

fn removed(hash: u64) -> Vec<u8> {
    let mut ev = Vec::new();
    enc(
        &V::M(vec![
            ("type", V::S("BlockRemoved")),
            ("block_hashes", V::A(vec![V::U(hash)])),
            ("medium", V::S("GPU")),
        ]),
        &mut ev,
    );
    ev
}

/// vLLM's per-block `extra_keys`: `None` for a plain block, else the items.
fn extra_keys(blocks: Vec<Option<Vec<V>>>) -> V {
    V::A(blocks.into_iter().map(|b| b.map_or(V::Nil, V::A)).collect())
}

/// vLLM's `(mm_identifier, offset)` item.
fn image(id: &'static str, offset: u64) -> V {
    V::A(vec![V::S(id), V::U(offset)])
}

/// `block_mm_infos` as Dynamo's TRT-LLM bridge sends it.
fn mm_infos(blocks: &[Option<&[u64]>]) -> V {
    V::A(
        blocks
            .iter()
            .map(|b| match b {
                None => V::Nil,
                Some(hs) => V::M(vec![(
                    "mm_objects",
                    V::A(
                        hs.iter()
                            .map(|&h| {
                                V::M(vec![
                                    ("mm_hash", V::U(h)),
                                    ("offsets", V::A(vec![V::A(vec![V::U(0), V::U(3)])])),
                                ])
                            })
                            .collect(),
                    ),
                )]),
            })
            .collect(),
    )
}

/// The same per-block images as a request's JSON `block_mm_infos`.
fn req_mm(blocks: &[Option<&[u64]>]) -> Value {
    blocks
        .iter()
        .map(|b| match b {
            None => Value::Null,
            Some(hs) => json!({"mm_objects": hs.iter()
                .map(|h| json!({"mm_hash": h, "offsets": [[1, 2]]}))
                .collect::<Vec<_>>()}),
        })
        .collect()
}

struct Engine {
    socket: zmq::Socket,
    seq: u64,
    _ctx: zmq::Context,
}

impl Engine {
    /// Binds a PUB and registers `worker_id` on it.
    fn register(addr: SocketAddr, worker_id: u64) -> Engine {
        let ctx = zmq::Context::new();
        let socket = ctx.socket(zmq::PUB).unwrap();
        socket.set_linger(0).unwrap();
        socket.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = socket.get_last_endpoint().unwrap().unwrap();
        post(
            addr,
            "/workers",
            &json!({"worker_id": worker_id, "endpoint": "http://127.0.0.1:1",
                    "kv_events_endpoint": endpoint, "block_size": BS,
                    "total_kv_blocks": 1000, "max_num_batched_tokens": 8192}),
        );
        let mut e = Engine {
            socket,
            seq: 0,
            _ctx: ctx,
        };
        // ZMQ slow joiner: publish a probe block until it is indexed.
        let probe = toks(900_001, 900_004);
        let deadline = Instant::now() + WAIT;
        loop {
            e.send(&[store(&[u64::MAX - 1], None, &probe, V::Nil, vec![])]);
            if overlap(addr, worker_id, json!({"token_ids": probe})) == 1 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "worker {worker_id} never connected"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        e.send(&[removed(u64::MAX - 1)]);
        e
    }

    /// One batch `[ts, events, 0]` with the next seq.
    fn send(&mut self, events: &[Vec<u8>]) {
        let mut p = vec![0x93, 0xcb];
        p.extend_from_slice(&1.7e9f64.to_bits().to_be_bytes());
        rmp::encode::write_array_len(&mut p, events.len() as u32).unwrap();
        for e in events {
            p.extend_from_slice(e);
        }
        p.push(0x00);
        self.send_raw(&p);
    }

    fn send_raw(&mut self, payload: &[u8]) {
        self.socket
            .send_multipart([&b""[..], &self.seq.to_be_bytes()[..], payload], 0)
            .unwrap();
        self.seq += 1;
    }
}

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

/// `device_blocks` of `worker_id` in /overlap_scores for `body`.
fn overlap(addr: SocketAddr, worker_id: u64, body: Value) -> u64 {
    let v = post(addr, "/overlap_scores", &body);
    v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == worker_id)
        .map_or(0, |w| w["device_blocks"].as_u64().unwrap())
}

fn metric(addr: SocketAddr, name: &str) -> u64 {
    let r = request(addr, "GET", "/metrics", &[], b"");
    let text = String::from_utf8(r.body).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no {name}")) as u64
}

/// Waits until `f` holds (events are applied asynchronously).
fn eventually(mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

const IMG_A: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

/// A store whose block 1 holds an image (`block_mm_infos` mm_hash 42, with
/// vLLM's `[identifier, offset]` in `extra_keys` beside it) matches a request
/// carrying the same image all the way, and one with another image or none
/// only up to the image block.
#[test]
fn an_image_store_matches_requests_with_the_same_images() {
    let server = Binary::start(&[]);
    let addr = server.addr;
    let mut e = Engine::register(addr, 1);
    let t = toks(1, 12);
    let img: &[Option<&[u64]>] = &[None, Some(&[42]), None];
    e.send(&[store(
        &[11, 12, 13],
        None,
        &t,
        extra_keys(vec![None, Some(vec![image(IMG_A, 2)]), None]),
        vec![("block_mm_infos", mm_infos(img))],
    )]);
    let same = json!({"mm_routing_info": {"routing_token_ids": t, "block_mm_infos": req_mm(img)}});
    assert!(eventually(|| overlap(addr, 1, same.clone()) == 3));
    let top_level = json!({"token_ids": t, "block_mm_infos": req_mm(img)});
    assert_eq!(overlap(addr, 1, top_level), 3);
    let other: &[Option<&[u64]>] = &[None, Some(&[43]), None];
    let other =
        json!({"mm_routing_info": {"routing_token_ids": t, "block_mm_infos": req_mm(other)}});
    assert_eq!(overlap(addr, 1, other), 1);
    assert_eq!(overlap(addr, 1, json!({"token_ids": t})), 1);

    // Two images in one block: hashed sorted, so order does not matter.
    let mut e2 = Engine::register(addr, 2);
    let t2 = toks(101, 108);
    e2.send(&[store(
        &[21, 22],
        None,
        &t2,
        extra_keys(vec![Some(vec![image("b", 0), image("a", 2)]), None]),
        vec![("block_mm_infos", mm_infos(&[Some(&[7, 3]), None]))],
    )]);
    let swapped = json!({"token_ids": t2, "block_mm_infos": req_mm(&[Some(&[3, 7]), None])});
    assert!(eventually(|| overlap(addr, 2, swapped.clone()) == 2));
    let one = json!({"token_ids": t2, "block_mm_infos": req_mm(&[Some(&[7]), None])});
    assert_eq!(overlap(addr, 2, one), 0);
}

/// vLLM puts images, the cache salt and the LoRA name only in `extra_keys`.
/// Dynamo 1.6.1 hashes none of them, so such a store matches the plain
/// tokens and nothing that carries images, a salt or a LoRA name.
#[test]
fn vllm_extra_keys_alone_change_no_hash() {
    let server = Binary::start(&[]);
    let addr = server.addr;
    let mut e = Engine::register(addr, 3);
    let t = toks(201, 208);
    e.send(&[store(
        &[31, 32],
        None,
        &t,
        extra_keys(vec![
            Some(vec![V::S("adapter-a"), image(IMG_A, 0), V::S("tenant-a")]),
            Some(vec![V::S("adapter-a")]),
        ]),
        vec![],
    )]);
    assert!(eventually(|| overlap(addr, 3, json!({"token_ids": t})) == 2));
    let img = json!({"token_ids": t, "block_mm_infos": req_mm(&[Some(&[42]), None])});
    assert_eq!(overlap(addr, 3, img), 0);
    assert_eq!(
        overlap(addr, 3, json!({"token_ids": t, "cache_salt": "tenant-a"})),
        0
    );
    assert_eq!(
        overlap(addr, 3, json!({"token_ids": t, "lora_name": "adapter-a"})),
        0
    );
}

/// `cache_salt` carries to child stores that name none; `lora_name` does not.
#[test]
fn salt_is_inherited_by_children_and_lora_is_not() {
    let server = Binary::start(&[]);
    let addr = server.addr;
    let mut e = Engine::register(addr, 4);
    let t = toks(301, 312);
    e.send(&[
        store(
            &[41],
            None,
            &t[..4],
            V::Nil,
            vec![("cache_salt", V::S("A"))],
        ),
        store(&[42], Some(41), &t[4..8], V::Nil, vec![]),
        store(&[43], Some(42), &t[8..], V::Nil, vec![]),
    ]);
    let salted = json!({"token_ids": t, "cache_salt": "A"});
    assert!(eventually(|| overlap(addr, 4, salted.clone()) == 3));
    assert_eq!(overlap(addr, 4, json!({"token_ids": t})), 0);

    let u = toks(401, 412);
    e.send(&[
        store(&[51], None, &u[..4], V::Nil, vec![("lora_name", V::S("L"))]),
        store(&[52], Some(51), &u[4..8], V::Nil, vec![]),
    ]);
    let lora = json!({"token_ids": u, "lora_name": "L"});
    assert!(eventually(|| overlap(addr, 4, lora.clone()) == 1));
    // The children were hashed plain, after a LoRA root no plain prompt meets.
    assert_eq!(overlap(addr, 4, json!({"token_ids": u})), 0);
}

/// A batch whose `extra_keys` or `block_mm_infos` breaks the grammar is
/// counted and dropped whole, as Dynamo drops it; the next batch applies.
#[test]
fn malformed_extra_keys_are_counted_and_dropped() {
    let server = Binary::start(&[]);
    let addr = server.addr;
    let mut e = Engine::register(addr, 5);
    let name = "kvselect_ingest_malformed_dropped_total";
    let before = metric(addr, name);
    let t = toks(501, 508);
    // A map item, then a `[1, "h"]` pair: neither is an item vLLM writes.
    e.send(&[store(
        &[61, 62],
        None,
        &t,
        extra_keys(vec![Some(vec![V::M(vec![("a", V::U(1))])]), None]),
        vec![],
    )]);
    e.send(&[store(
        &[61, 62],
        None,
        &t,
        extra_keys(vec![Some(vec![V::A(vec![V::U(1), V::S("h")])]), None]),
        vec![],
    )]);
    // `offsets` missing from an mm object.
    let bad_mm = V::A(vec![V::M(vec![(
        "mm_objects",
        V::A(vec![V::M(vec![("mm_hash", V::U(42))])]),
    )])]);
    e.send(&[store(
        &[61, 62],
        None,
        &t,
        V::Nil,
        vec![("block_mm_infos", bad_mm)],
    )]);
    let u = toks(601, 608);
    e.send(&[store(
        &[71, 72],
        None,
        &u,
        extra_keys(vec![Some(vec![image(IMG_A, 0)]), None]),
        vec![],
    )]);
    assert!(eventually(|| overlap(addr, 5, json!({"token_ids": u})) == 2));
    assert_eq!(metric(addr, name), before + 3);
    assert_eq!(overlap(addr, 5, json!({"token_ids": t})), 0);
    // The first one is logged as a warning naming the stream; the next two,
    // within 10 s, are only counted (a broken publisher does not flood).
    // A worker joining now writes a later line to the same stream; once the
    // reader has it, it has every line before it.
    let _later = Engine::register(addr, 6);
    // (The server logs to stdout only, so the reader keeps its order.)
    assert!(eventually(|| server.log_text().lines().any(|l| l
        .contains("worker joined")
        && l.contains("worker_id=6"))));
    let log = server.log_text();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("malformed KV-event message dropped"))
        .collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(
        lines[0].contains("WARN") && lines[0].contains("worker_id=5"),
        "{}",
        lines[0]
    );
}
