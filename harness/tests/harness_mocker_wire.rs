//! The mock workers' ZMQ output, read by real SUB and DEALER sockets and
//! decoded with the independent `rmp` reader: vLLM 0.34 framing, map events,
//! parent chaining, LRU evictions and the 4-frame replay protocol.

use std::time::Duration;

use kvselect::hash;
use kvselect_harness::mocker::{Mocker, MockerConfig};
use rmp::Marker;

#[derive(Debug, Clone, PartialEq)]
enum V {
    Nil,
    U(u64),
    F(f64),
    S(String),
    A(Vec<V>),
    M(Vec<(String, V)>),
}

fn take<'a>(rd: &mut &'a [u8], n: usize) -> &'a [u8] {
    let (a, b) = rd.split_at(n);
    *rd = b;
    a
}

fn be(rd: &mut &[u8], n: usize) -> u64 {
    take(rd, n)
        .iter()
        .fold(0u64, |acc, &b| (acc << 8) | b as u64)
}

fn value(rd: &mut &[u8]) -> V {
    let m = rmp::decode::read_marker(rd).expect("marker");
    match m {
        Marker::Null => V::Nil,
        Marker::FixPos(v) => V::U(v as u64),
        Marker::U8 => V::U(be(rd, 1)),
        Marker::U16 => V::U(be(rd, 2)),
        Marker::U32 => V::U(be(rd, 4)),
        Marker::U64 => V::U(be(rd, 8)),
        Marker::F64 => V::F(f64::from_bits(be(rd, 8))),
        Marker::FixStr(n) => V::S(String::from_utf8(take(rd, n as usize).to_vec()).unwrap()),
        Marker::Str8 => {
            let n = be(rd, 1) as usize;
            V::S(String::from_utf8(take(rd, n).to_vec()).unwrap())
        }
        Marker::FixArray(n) => V::A((0..n).map(|_| value(rd)).collect()),
        Marker::Array16 => {
            let n = be(rd, 2);
            V::A((0..n).map(|_| value(rd)).collect())
        }
        Marker::Array32 => {
            let n = be(rd, 4);
            V::A((0..n).map(|_| value(rd)).collect())
        }
        Marker::FixMap(n) => V::M((0..n).map(|_| kv(rd)).collect()),
        Marker::Map16 => {
            let n = be(rd, 2);
            V::M((0..n).map(|_| kv(rd)).collect())
        }
        other => panic!("unexpected marker {other:?}"),
    }
}

fn kv(rd: &mut &[u8]) -> (String, V) {
    match value(rd) {
        V::S(k) => (k, value(rd)),
        other => panic!("non-string key {other:?}"),
    }
}

fn decode(payload: &[u8]) -> V {
    let mut rd = payload;
    let v = value(&mut rd);
    assert!(rd.is_empty(), "trailing bytes after the batch");
    v
}

fn get<'a>(m: &'a V, key: &str) -> &'a V {
    let V::M(kvs) = m else {
        panic!("not a map: {m:?}")
    };
    &kvs.iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("no {key}"))
        .1
}

fn keys(m: &V) -> Vec<&str> {
    let V::M(kvs) = m else { panic!("not a map") };
    kvs.iter().map(|(k, _)| k.as_str()).collect()
}

fn uints(v: &V) -> Vec<u64> {
    let V::A(a) = v else {
        panic!("not an array: {v:?}")
    };
    a.iter()
        .map(|x| match x {
            V::U(u) => *u,
            o => panic!("not a uint: {o:?}"),
        })
        .collect()
}

fn events(batch: &V) -> &[V] {
    let V::A(b) = batch else {
        panic!("batch not an array")
    };
    assert_eq!(b.len(), 3, "batch is [ts, events, dp_rank]");
    assert!(
        matches!(b[0], V::F(ts) if ts > 1.6e9),
        "ts is a float64 epoch"
    );
    assert_eq!(b[2], V::U(0), "dp rank 0");
    let V::A(ev) = &b[1] else {
        panic!("events not an array")
    };
    ev
}

fn seq_hashes(tokens: &[u32], bs: u32) -> Vec<u64> {
    let mut local = Vec::new();
    hash::local_block_hashes(tokens, bs, false, hash::PUBLIC_SEED, None, &mut local);
    let mut seq = Vec::new();
    hash::sequence_hashes(&local, hash::PUBLIC_SEED, &mut seq);
    seq
}

fn recv3(sub: &zmq::Socket) -> (Vec<u8>, u64, Vec<u8>) {
    let frames = sub
        .recv_multipart(0)
        .expect("live message within the timeout");
    assert_eq!(frames.len(), 3, "vLLM sends exactly 3 frames");
    let seq: [u8; 8] = frames[1].as_slice().try_into().expect("8-byte seq");
    (
        frames[0].clone(),
        u64::from_be_bytes(seq),
        frames[2].clone(),
    )
}

#[test]
fn mock_worker_publishes_vllm_034_events_and_answers_replay() {
    let bs = 4;
    let mocker = Mocker::start(MockerConfig {
        workers: 2,
        block_size: bs,
        capacity_blocks: 8,
        worker_id_base: 10,
        ..MockerConfig::default()
    })
    .expect("mocker");
    let eps = mocker.endpoints();
    assert_eq!(eps[0].worker_id, 10);
    assert_eq!(eps[1].worker_id, 11);
    assert!(eps[0].kv_events.starts_with("tcp://127.0.0.1:"));

    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).unwrap();
    sub.set_rcvtimeo(5000).unwrap();
    sub.set_subscribe(b"").unwrap();
    sub.connect(&eps[0].kv_events).unwrap();
    // A second worker's stream must not leak into the first one.
    let sub_other = ctx.socket(zmq::SUB).unwrap();
    sub_other.set_rcvtimeo(300).unwrap();
    sub_other.set_subscribe(b"").unwrap();
    sub_other.connect(&eps[1].kv_events).unwrap();
    // Loopback connect completes well within this (PUB drops messages sent
    // before a subscriber is attached).
    std::thread::sleep(Duration::from_millis(500));

    // 1. A cold prompt of 4 full blocks plus 2 partial tokens.
    let t1: Vec<u32> = (1..=18).collect();
    let o = mocker.serve(10, &t1).unwrap();
    assert_eq!(
        (o.hit_blocks, o.stored_blocks, o.removed_blocks, o.seq),
        (0, 4, 0, Some(0))
    );
    let (topic, seq, payload) = recv3(&sub);
    assert!(topic.is_empty());
    assert_eq!(seq, 0);
    // msgspec writes 0.34's BlockStored with a map16 header.
    assert_eq!(&payload[10..14], &[0x91, 0xde, 0x00, 0x0b]);
    let batch = decode(&payload);
    let ev = events(&batch);
    assert_eq!(ev.len(), 1);
    let stored = &ev[0];
    assert_eq!(
        keys(stored),
        [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind"
        ]
    );
    assert_eq!(get(stored, "type"), &V::S("BlockStored".into()));
    let chain = seq_hashes(&t1, bs);
    assert_eq!(uints(get(stored, "block_hashes")), chain);
    assert_eq!(get(stored, "parent_block_hash"), &V::Nil);
    assert_eq!(
        uints(get(stored, "token_ids")),
        (1..=16).collect::<Vec<u64>>()
    );
    assert_eq!(get(stored, "block_size"), &V::U(4));
    assert_eq!(get(stored, "lora_id"), &V::Nil);
    assert_eq!(get(stored, "medium"), &V::S("GPU".into()));
    assert_eq!(get(stored, "lora_name"), &V::Nil);
    assert_eq!(get(stored, "extra_keys"), &V::A(vec![V::Nil; 4]));
    assert_eq!(get(stored, "group_idx"), &V::U(0));
    assert_eq!(
        get(stored, "kv_cache_spec_kind"),
        &V::S("full_attention".into())
    );

    // 2. The same prompt grown by 2 blocks: only the new blocks, chained.
    let t2: Vec<u32> = (1..=24).collect();
    let o = mocker.serve(10, &t2).unwrap();
    assert_eq!(
        (o.hit_blocks, o.stored_blocks, o.removed_blocks, o.seq),
        (4, 2, 0, Some(1))
    );
    let (_, seq, payload1) = recv3(&sub);
    assert_eq!(seq, 1);
    let batch = decode(&payload1);
    let stored = &events(&batch)[0];
    let chain2 = seq_hashes(&t2, bs);
    assert_eq!(uints(get(stored, "block_hashes")), chain2[4..]);
    assert_eq!(get(stored, "parent_block_hash"), &V::U(chain2[3]));
    assert_eq!(
        uints(get(stored, "token_ids")),
        (17..=24).collect::<Vec<u64>>()
    );

    // 3. Serving it again changes nothing and publishes nothing.
    let o = mocker.serve(10, &t2).unwrap();
    assert_eq!(
        (o.hit_blocks, o.stored_blocks, o.removed_blocks, o.seq),
        (6, 0, 0, None)
    );

    // 4. A new 4-block prompt into a full-to-8 cache evicts the 2 oldest
    //    blocks, leaves first, one BlockRemoved each, before the store.
    let t3: Vec<u32> = (100..116).collect();
    let o = mocker.serve(10, &t3).unwrap();
    assert_eq!(
        (o.hit_blocks, o.stored_blocks, o.removed_blocks, o.seq),
        (0, 4, 2, Some(2))
    );
    let (_, seq, payload2) = recv3(&sub);
    assert_eq!(seq, 2);
    let batch = decode(&payload2);
    let ev = events(&batch);
    assert_eq!(ev.len(), 3);
    for (e, want) in ev[..2].iter().zip([chain2[5], chain2[4]]) {
        assert_eq!(keys(e), ["type", "block_hashes", "medium", "group_idx"]);
        assert_eq!(get(e, "type"), &V::S("BlockRemoved".into()));
        assert_eq!(uints(get(e, "block_hashes")), [want]);
        assert_eq!(get(e, "medium"), &V::S("GPU".into()));
    }
    assert_eq!(get(&ev[2], "parent_block_hash"), &V::Nil);
    assert_eq!(uints(get(&ev[2], "block_hashes")), seq_hashes(&t3, bs));
    assert_eq!(mocker.cached_blocks(10).unwrap(), 8);
    // The surviving prefix still hits.
    let o = mocker.serve(10, &t1).unwrap();
    assert_eq!((o.hit_blocks, o.stored_blocks), (4, 0));

    assert!(
        sub_other.recv_multipart(0).is_err(),
        "worker 11 published nothing"
    );
    assert!(mocker.serve(99, &t1).is_err(), "unknown worker is an error");

    // 5. Replay: a malformed request is ignored; ["", 1] gets seq 1 and 2 as
    //    ["", topic, seq, payload] and then the end marker.
    let dealer = ctx.socket(zmq::DEALER).unwrap();
    dealer.set_rcvtimeo(5000).unwrap();
    dealer.connect(&eps[0].replay).unwrap();
    dealer.send_multipart([&b""[..], &b"bad"[..]], 0).unwrap();
    dealer
        .send_multipart([&b""[..], &1u64.to_be_bytes()[..]], 0)
        .unwrap();
    for (want_seq, want_payload) in [(1u64, &payload1), (2, &payload2)] {
        let f = dealer.recv_multipart(0).expect("replay reply");
        assert_eq!(f.len(), 4, "0.34 replay reply has a topic frame");
        assert!(f[0].is_empty() && f[1].is_empty());
        assert_eq!(f[2], want_seq.to_be_bytes());
        assert_eq!(&f[3], want_payload);
    }
    let end = dealer.recv_multipart(0).expect("end marker");
    assert_eq!(end, vec![vec![], vec![], vec![0xff; 8], vec![]]);

    // 6. A clear is one AllBlocksCleared batch.
    assert_eq!(mocker.clear(10).unwrap(), 3);
    let (_, seq, payload) = recv3(&sub);
    assert_eq!(seq, 3);
    let batch = decode(&payload);
    assert_eq!(
        events(&batch),
        [V::M(vec![("type".into(), V::S("AllBlocksCleared".into()))])]
    );
    assert_eq!(mocker.cached_blocks(10).unwrap(), 0);
}
