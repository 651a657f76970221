//! End-to-end ingestion over real ZMQ sockets on 127.0.0.1: a publisher sends
//! engine-format frames, the real `IngestHub` applies them to the real
//! `Index`, and the tests read the result through `Index::overlap`.
//!
//! Slow joiner: publishers are XPUB sockets with `xpub_verbose`, so a test
//! waits until the hub's subscription has actually arrived before sending;
//! every wait is bounded.

use kvselect::hash::{local_block_hashes, salt_seed, sequence_hashes, PUBLIC_SEED};
use kvselect::index::{Index, Overlap, Tier, WorkerRank};
use kvselect::ingest::decode::{Group, KvEvent, Removed, Stored};
use kvselect::ingest::encode::{encode_batch, EventForm};
use kvselect::ingest::{IngestConfig, IngestHub, ListenerSpec, ListenerState};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BS: u32 = 16;
const WAIT: Duration = Duration::from_secs(10);

struct Publisher {
    sock: zmq::Socket,
    endpoint: String,
}

impl Publisher {
    fn bind(ctx: &zmq::Context, at: &str) -> Publisher {
        let sock = ctx.socket(zmq::XPUB).unwrap();
        sock.set_xpub_verbose(true).unwrap();
        sock.set_linger(0).unwrap();
        // Rebinding a just-closed port: ZMQ releases it asynchronously.
        let end = Instant::now() + WAIT;
        while let Err(e) = sock.bind(at) {
            assert!(Instant::now() < end, "bind {at}: {e}");
            std::thread::sleep(Duration::from_millis(10));
        }
        let endpoint = sock.get_last_endpoint().unwrap().unwrap();
        Publisher { sock, endpoint }
    }

    fn new(ctx: &zmq::Context) -> Publisher {
        Self::bind(ctx, "tcp://127.0.0.1:0")
    }

    /// Blocks until a subscription message arrives (bounded).
    fn wait_subscriber(&self) {
        self.sock.set_rcvtimeo(WAIT.as_millis() as i32).unwrap();
        loop {
            let m = self.sock.recv_bytes(0).expect("no subscriber within 10 s");
            if m.first() == Some(&1) {
                return;
            }
        }
    }

    fn send(&self, seq: u64, payload: &[u8]) {
        self.sock
            .send_multipart([&b""[..], &seq.to_be_bytes(), payload], 0)
            .unwrap();
    }

    fn send_frames(&self, frames: &[&[u8]]) {
        self.sock.send_multipart(frames, 0).unwrap();
    }
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn range(a: u32, b: u32) -> Vec<u32> {
    (a..=b).collect()
}

/// The overlap rows of a prompt, as a request would compute its keys.
fn overlap(index: &Index, tokens: &[u32]) -> Vec<(WorkerRank, Overlap)> {
    let mut local = Vec::new();
    local_block_hashes(tokens, BS, false, salt_seed(None, None), None, &mut local);
    let mut keys = Vec::new();
    sequence_hashes(&local, PUBLIC_SEED, &mut keys);
    let mut out = Vec::new();
    index.overlap(&keys, &mut out);
    out.sort_by_key(|(wr, _)| *wr);
    out
}

fn device_of(index: &Index, tokens: &[u32], worker_id: u64, dp_rank: u32) -> u32 {
    overlap(index, tokens)
        .into_iter()
        .find(|(wr, _)| *wr == WorkerRank { worker_id, dp_rank })
        .map_or(0, |(_, o)| o.device)
}

fn spec(index: &Arc<Index>, endpoint: &str, replay: Option<&str>) -> ListenerSpec {
    ListenerSpec {
        dp_rank: 0,
        endpoint: endpoint.to_string(),
        replay_endpoint: replay.map(str::to_string),
        index: index.clone(),
        block_size: BS,
    }
}

fn store(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> KvEvent {
    KvEvent::Stored(Stored {
        block_hashes: hashes.to_vec(),
        parent_hash: parent,
        token_ids: tokens,
        eagle: false,
        block_size: BS,
        medium: Tier::Device,
        lora_name: None,
        cache_salt: None,
        mm_hashes: None,
        group: Group::default(),
    })
}

fn batch(events: &[KvEvent], dp: Option<u32>) -> Vec<u8> {
    let mut p = Vec::new();
    encode_batch(&mut p, 1.0, events, dp, EventForm::Map);
    p
}

// ---- hand-written vLLM bytes (kv-events.md §3) ----

fn s(out: &mut Vec<u8>, text: &str) {
    out.push(0xa0 | text.len() as u8);
    out.extend_from_slice(text.as_bytes());
}

fn u64_(out: &mut Vec<u8>, v: u64) {
    out.push(0xcf);
    out.extend_from_slice(&v.to_be_bytes());
}

fn ts(out: &mut Vec<u8>) {
    out.push(0xcb);
    out.extend_from_slice(&1_777_000_000.5f64.to_be_bytes());
}

const H: [u64; 4] = [
    1615469113370930379,
    16535740676137596535,
    0x8000_0000_0000_0001,
    42,
];

/// vLLM 0.34: `[ts, [BlockStored map16], 0]`, 2 GPU blocks, tokens 1..=32.
fn vllm_0_34_store() -> Vec<u8> {
    let mut p = vec![0x93];
    ts(&mut p);
    p.extend_from_slice(&[0x91, 0xde, 0x00, 0x0b]);
    s(&mut p, "type");
    s(&mut p, "BlockStored");
    s(&mut p, "block_hashes");
    p.push(0x92);
    u64_(&mut p, H[0]);
    u64_(&mut p, H[1]);
    s(&mut p, "parent_block_hash");
    p.push(0xc0);
    s(&mut p, "token_ids");
    p.extend_from_slice(&[0xdc, 0x00, 0x20]);
    p.extend(1u8..=32);
    s(&mut p, "block_size");
    p.push(16);
    s(&mut p, "lora_id");
    p.push(0xc0);
    s(&mut p, "medium");
    s(&mut p, "GPU");
    s(&mut p, "lora_name");
    p.push(0xc0);
    s(&mut p, "extra_keys");
    p.extend_from_slice(&[0x92, 0xc0, 0xc0]);
    s(&mut p, "group_idx");
    p.push(0);
    s(&mut p, "kv_cache_spec_kind");
    s(&mut p, "full_attention");
    p.push(0x00);
    p
}

/// vLLM 0.23: 12-element array BlockStored, tokens 33..=64 under `H[1]`.
fn vllm_0_23_store() -> Vec<u8> {
    let mut p = vec![0x93];
    ts(&mut p);
    p.extend_from_slice(&[0x91, 0x9c]);
    s(&mut p, "BlockStored");
    p.push(0x92);
    u64_(&mut p, H[2]);
    u64_(&mut p, H[3]);
    u64_(&mut p, H[1]);
    p.extend_from_slice(&[0xdc, 0x00, 0x20]);
    p.extend(33u8..=64);
    p.push(16);
    p.push(0xc0);
    s(&mut p, "GPU");
    p.extend_from_slice(&[0xc0, 0xc0, 0x00]);
    s(&mut p, "full_attention");
    p.push(0xc0);
    p.push(0x00);
    p
}

/// The spec's BlockRemoved frame layout, as a 2-element (vLLM 0.9) batch
/// removing `H[3]` with a 0.11-style array event.
fn two_element_remove() -> Vec<u8> {
    let mut p = vec![0x92];
    ts(&mut p);
    p.extend_from_slice(&[0x91, 0x93]);
    s(&mut p, "BlockRemoved");
    p.push(0x91);
    u64_(&mut p, H[3]);
    s(&mut p, "GPU");
    p
}

fn hub(threads: usize) -> IngestHub {
    hub_with(threads, IngestConfig::default().replay_timeout)
}

fn hub_with(threads: usize, replay_timeout: Duration) -> IngestHub {
    IngestHub::new(IngestConfig {
        threads,
        replay_timeout,
        ..IngestConfig::default()
    })
}

#[test]
fn vllm_wire_forms_reach_the_index() {
    let ctx = zmq::Context::new();
    let p = Publisher::new(&ctx);
    let index = Arc::new(Index::new());
    let hub = hub(1);
    hub.set_worker(1, vec![spec(&index, &p.endpoint, None)]);
    p.wait_subscriber();
    let prompt = range(1, 64);

    p.send(0, &vllm_0_34_store());
    wait_until("0.34 map store", || device_of(&index, &prompt, 1, 0) == 2);
    p.send(1, &vllm_0_23_store());
    wait_until("0.23 array store", || device_of(&index, &prompt, 1, 0) == 4);
    p.send(2, &two_element_remove());
    wait_until("0.9 batch removal", || {
        device_of(&index, &prompt, 1, 0) == 3
    });

    // The batch's data_parallel_rank wins over the listener's rank 0.
    p.send(3, &batch(&[store(&[77], None, range(1, 16))], Some(5)));
    wait_until("rank-5 store", || device_of(&index, &prompt, 1, 5) == 1);
    assert_eq!(device_of(&index, &prompt, 1, 0), 3);
    // The index moves before the counters; the last seq is written last.
    wait_until("counters of seq 3", || {
        hub.stats().listeners[0].last_seq == Some(3)
    });

    let st = hub.stats();
    assert_eq!(st.counters.batches_applied, 4);
    assert_eq!(st.counters.apply.blocks_stored, 5);
    assert_eq!(st.counters.apply.blocks_removed, 1);
    assert_eq!(st.counters.malformed + st.counters.gaps, 0);
    assert_eq!(st.listeners.len(), 1);
    assert_eq!(st.listeners[0].last_seq, Some(3));
    assert_eq!(st.listeners[0].state, ListenerState::Live);

    // A store with another block size is dropped and counted.
    let mut bs32 = vec![0x93];
    ts(&mut bs32);
    bs32.push(0x91);
    bs32.push(0x85);
    s(&mut bs32, "type");
    s(&mut bs32, "BlockStored");
    s(&mut bs32, "block_hashes");
    bs32.extend_from_slice(&[0x91, 0x09]);
    s(&mut bs32, "parent_block_hash");
    bs32.push(0xc0);
    s(&mut bs32, "token_ids");
    bs32.extend_from_slice(&[0xdc, 0x00, 0x20]);
    bs32.extend(1u8..=32);
    s(&mut bs32, "block_size");
    bs32.push(32);
    bs32.push(0xc0);
    p.send(4, &bs32);
    wait_until("block-size drop", || {
        hub.stats().counters.apply.stores_dropped_block_size == 1
    });
}

/// A ROUTER that answers replay requests from a fixed buffer, as vLLM does:
/// 4-frame replies (0.34, with topic) or 3-frame replies (<= 0.24).
fn replay_server(
    ctx: &zmq::Context,
    buffer: Vec<(u64, Vec<u8>)>,
    with_topic: bool,
) -> (String, std::thread::JoinHandle<usize>) {
    let router = ctx.socket(zmq::ROUTER).unwrap();
    router.set_linger(0).unwrap();
    router.bind("tcp://127.0.0.1:0").unwrap();
    router.set_rcvtimeo(WAIT.as_millis() as i32).unwrap();
    let endpoint = router.get_last_endpoint().unwrap().unwrap();
    let h = std::thread::spawn(move || {
        // Serve one request.
        let req = router.recv_multipart(0).expect("replay request");
        assert_eq!(req.len(), 3, "[identity, \"\", start_seq]");
        assert!(req[1].is_empty());
        let start = u64::from_be_bytes(req[2].as_slice().try_into().unwrap());
        let id = req[0].clone();
        let mut sent = 0;
        for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
            let seq = seq.to_be_bytes();
            if with_topic {
                router
                    .send_multipart([&id[..], b"", b"kv", &seq, payload], 0)
                    .unwrap();
            } else {
                router
                    .send_multipart([&id[..], b"", &seq, payload], 0)
                    .unwrap();
            }
            sent += 1;
        }
        let end = u64::MAX.to_be_bytes();
        if with_topic {
            router
                .send_multipart([&id[..], b"", b"", &end, b""], 0)
                .unwrap();
        } else {
            router.send_multipart([&id[..], b"", &end, b""], 0).unwrap();
        }
        // Keep the socket open until the reply is surely flushed.
        std::thread::sleep(Duration::from_millis(200));
        sent
    });
    (endpoint, h)
}

/// Four chained stores of prompt 1..=64, one block per batch.
fn chain_batches() -> Vec<(u64, Vec<u8>)> {
    (0..4u64)
        .map(|i| {
            let parent = (i > 0).then(|| 1000 + i - 1);
            let t0 = i as u32 * BS + 1;
            (
                i,
                batch(&[store(&[1000 + i], parent, range(t0, t0 + BS - 1))], None),
            )
        })
        .collect()
}

#[test]
fn gaps_are_recovered_through_real_router_replay() {
    let ctx = zmq::Context::new();
    let index = Arc::new(Index::new());
    let hub = hub(2);
    let prompt = range(1, 64);
    let buf = chain_batches();

    // Worker 1, 4-frame replies (vLLM 0.34): seq 0 live, then seq 3 -> a gap
    // [1, 3) -> replay from 1 returns 1, 2, 3; the live 3 is then stale.
    let p1 = Publisher::new(&ctx);
    let (r1, h1) = replay_server(&ctx, buf.clone(), true);
    hub.set_worker(1, vec![spec(&index, &p1.endpoint, Some(&r1))]);
    p1.wait_subscriber();
    p1.send(0, &buf[0].1);
    wait_until("seq 0", || device_of(&index, &prompt, 1, 0) == 1);
    p1.send(3, &buf[3].1);
    wait_until("replayed chain", || device_of(&index, &prompt, 1, 0) == 4);
    assert_eq!(h1.join().unwrap(), 3);

    // Worker 2, 3-frame replies (vLLM <= 0.24), late joiner: its first live
    // batch is seq 3, so it replays from 0.
    let p2 = Publisher::new(&ctx);
    let (r2, h2) = replay_server(&ctx, buf.clone(), false);
    hub.set_worker(2, vec![spec(&index, &p2.endpoint, Some(&r2))]);
    p2.wait_subscriber();
    p2.send(3, &buf[3].1);
    wait_until("late joiner replay", || {
        device_of(&index, &prompt, 2, 0) == 4
    });
    assert_eq!(h2.join().unwrap(), 4);

    wait_until("replay counters", || {
        let c = hub.stats().counters;
        c.replays_completed == 2 && c.stale_dropped == 2
    });
    let c = hub.stats().counters;
    assert_eq!(c.gaps, 2);
    assert_eq!(c.replays_started, 2);
    assert_eq!(c.replayed_batches, 7);
    assert_eq!(c.gaps_lost, 0);
    assert_eq!(c.replays_failed, 0);
    assert_eq!(c.apply.stores_dropped_unknown_parent, 0);
    // Both listeners continue live after the replay.
    p1.send(4, &batch(&[KvEvent::Cleared], None));
    wait_until("live after replay", || {
        device_of(&index, &prompt, 1, 0) == 0
    });
    assert_eq!(device_of(&index, &prompt, 2, 0), 4);
}

#[test]
fn dead_replay_socket_times_out_without_stalling_the_thread() {
    let ctx = zmq::Context::new();
    let index = Arc::new(Index::new());
    // Both workers on the same ingest thread. The timeout is long enough that
    // worker 2's batch surely lands while worker 1 still waits, even on a
    // loaded machine.
    let hub = hub_with(1, Duration::from_secs(2));
    let prompt = range(1, 64);
    let buf = chain_batches();
    // A ROUTER that accepts connections and never answers.
    let silent = ctx.socket(zmq::ROUTER).unwrap();
    silent.set_linger(0).unwrap();
    silent.bind("tcp://127.0.0.1:0").unwrap();
    let silent_ep = silent.get_last_endpoint().unwrap().unwrap();

    let p1 = Publisher::new(&ctx);
    let p2 = Publisher::new(&ctx);
    hub.set_worker(1, vec![spec(&index, &p1.endpoint, Some(&silent_ep))]);
    hub.set_worker(2, vec![spec(&index, &p2.endpoint, None)]);
    p1.wait_subscriber();
    p2.wait_subscriber();

    let started = Instant::now();
    p1.send(2, &batch(&[store(&[5], None, range(1, 16))], None));
    wait_until("replay under way", || {
        hub.stats().counters.replays_started == 1
    });
    // Worker 2 is served while worker 1 waits for its replay.
    p2.send(0, &buf[0].1);
    wait_until("other listener live", || {
        device_of(&index, &prompt, 2, 0) == 1
    });
    assert_eq!(device_of(&index, &prompt, 1, 0), 0, "pending until timeout");
    // After the timeout the pending batch applies and the gap is lost.
    wait_until("replay timeout", || device_of(&index, &prompt, 1, 0) == 1);
    assert!(started.elapsed() >= Duration::from_millis(1900));
    let c = hub.stats().counters;
    assert_eq!(c.replays_failed, 1);
    assert_eq!(c.gaps_lost, 1);
    // Without a replay endpoint a gap is counted and the batch still applies.
    p2.send(5, &batch(&[store(&[6], None, range(1, 16))], None));
    // `gaps` moves first, then `gaps_lost` when the batch applies alone.
    wait_until("gap without replay", || hub.stats().counters.gaps_lost == 2);
    assert_eq!(hub.stats().counters.gaps, 2);
}

#[test]
fn engine_restart_and_malformed_messages_are_survived() {
    let ctx = zmq::Context::new();
    let index = Arc::new(Index::new());
    let hub = hub(2);
    let prompt = range(1, 64);
    let other = range(101, 132);
    let p1 = Publisher::new(&ctx);
    let p2 = Publisher::new(&ctx);
    hub.set_worker(1, vec![spec(&index, &p1.endpoint, None)]);
    hub.set_worker(2, vec![spec(&index, &p2.endpoint, None)]);
    p1.wait_subscriber();
    p2.wait_subscriber();
    let full = batch(&[store(&[1, 2, 3, 4], None, prompt.clone())], None);
    p1.send(0, &full);
    p2.send(0, &full);
    wait_until("both stored", || {
        device_of(&index, &prompt, 1, 0) == 4 && device_of(&index, &prompt, 2, 0) == 4
    });

    // Garbage payload, 2 frames, a 7-byte seq, 5 frames: all dropped.
    p1.send(1, b"\xc1\xc1garbage");
    p1.send_frames(&[b"", &2u64.to_be_bytes()]);
    p1.send_frames(&[b"", b"1234567", &full]);
    p1.send_frames(&[b"", &1u64.to_be_bytes(), &full, b"x", b"y"]);
    // The stream keeps flowing: seq 1 (the garbage one did not advance the
    // cursor) removes block 4.
    let rm = batch(
        &[KvEvent::Removed(Removed {
            block_hashes: vec![4],
            medium: Tier::Device,
            group: Group::default(),
        })],
        None,
    );
    p1.send(1, &rm);
    wait_until("removal after garbage", || {
        device_of(&index, &prompt, 1, 0) == 3
    });
    assert_eq!(hub.stats().counters.malformed, 4);

    // Restart worker 1's engine for real: a new publisher process on the same
    // port, seq back to 0, with different blocks.
    let ep = p1.endpoint.clone();
    drop(p1);
    let p1 = Publisher::bind(&ctx, &ep);
    p1.wait_subscriber();
    p1.send(0, &batch(&[store(&[1, 2], None, other.clone())], None));
    wait_until("restart applied", || device_of(&index, &other, 1, 0) == 2);
    assert_eq!(
        device_of(&index, &prompt, 1, 0),
        0,
        "old engine's blocks cleared"
    );
    assert_eq!(device_of(&index, &prompt, 2, 0), 4, "worker 2 untouched");
    let c = hub.stats().counters;
    assert_eq!(c.restarts, 1);
    // Seq 1 of the new engine applies normally.
    p1.send(1, &batch(&[KvEvent::Cleared], None));
    wait_until("post-restart clear", || {
        device_of(&index, &other, 1, 0) == 0
    });
    assert_eq!(device_of(&index, &prompt, 2, 0), 4);
}

#[test]
fn endpoint_change_and_removal_stop_the_old_listener() {
    let ctx = zmq::Context::new();
    let index = Arc::new(Index::new());
    let hub = hub(2);
    let prompt = range(1, 64);
    let pa = Publisher::new(&ctx);
    let pb = Publisher::new(&ctx);
    hub.set_worker(7, vec![spec(&index, &pa.endpoint, None)]);
    pa.wait_subscriber();
    pa.send(0, &batch(&[store(&[1, 2], None, range(1, 32))], None));
    wait_until("store on A", || device_of(&index, &prompt, 7, 0) == 2);

    // Same spec again: the listener (cursor, blocks) is kept.
    hub.set_worker(7, vec![spec(&index, &pa.endpoint, None)]);
    assert_eq!(hub.stats().counters.listeners_started, 1);
    assert_eq!(device_of(&index, &prompt, 7, 0), 2);
    pa.send(1, &batch(&[store(&[3], Some(2), range(33, 48))], None));
    wait_until("kept listener continues", || {
        device_of(&index, &prompt, 7, 0) == 3
    });

    // Endpoint change: old listener stopped and its blocks cleared before
    // set_worker returns.
    hub.set_worker(7, vec![spec(&index, &pb.endpoint, None)]);
    assert_eq!(device_of(&index, &prompt, 7, 0), 0);
    let st = hub.stats();
    assert_eq!(st.counters.listeners_stopped, 1);
    assert_eq!(st.listeners.len(), 1);
    assert_eq!(st.listeners[0].endpoint, pb.endpoint);
    pa.send(2, &batch(&[store(&[9], None, range(1, 16))], None));
    pb.wait_subscriber();
    pb.send(
        0,
        &batch(&[store(&[1, 2, 3, 4], None, prompt.clone())], None),
    );
    wait_until("store on B", || device_of(&index, &prompt, 7, 0) == 4);
    // The index moves before the counters.
    wait_until("counters of B's store", || {
        hub.stats().counters.batches_applied >= 3
    });
    let c = hub.stats().counters;
    assert_eq!(c.batches_applied, 3, "nothing from A after the change");
    assert_eq!(c.messages, 3);

    // Removal: blocks gone, B's messages no longer applied.
    hub.remove_worker(7);
    assert_eq!(device_of(&index, &prompt, 7, 0), 0);
    assert!(hub.stats().listeners.is_empty());
    pb.send(1, &batch(&[store(&[5], None, range(1, 16))], None));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(device_of(&index, &prompt, 7, 0), 0);
    assert_eq!(hub.stats().counters.messages, 3);
}

#[test]
fn unreachable_endpoint_does_not_block_registration() {
    // Nothing listens: ZMQ connects lazily, registration returns at once and
    // the listener stays live, reconnecting in the background.
    let index = Arc::new(Index::new());
    let hub = hub(1);
    let t = Instant::now();
    hub.set_worker(3, vec![spec(&index, "tcp://127.0.0.1:9", None)]);
    assert!(t.elapsed() < Duration::from_secs(2));
    assert_eq!(hub.stats().listeners[0].state, ListenerState::Live);
    hub.remove_worker(3);
    assert!(hub.stats().listeners.is_empty());
}

#[test]
fn dp_ranks_are_independent_listeners_and_upsert_keeps_unchanged_ones() {
    let ctx = zmq::Context::new();
    let index = Arc::new(Index::new());
    let hub = hub(2);
    let prompt = range(1, 64);
    let (p0, p1, p1b) = (
        Publisher::new(&ctx),
        Publisher::new(&ctx),
        Publisher::new(&ctx),
    );
    let ranked = |rank: u32, ep: &str| ListenerSpec {
        dp_rank: rank,
        ..spec(&index, ep, None)
    };
    hub.set_worker(4, vec![ranked(0, &p0.endpoint), ranked(1, &p1.endpoint)]);
    p0.wait_subscriber();
    p1.wait_subscriber();
    // Batches without data_parallel_rank land on the listener's rank.
    p0.send(0, &batch(&[store(&[1, 2], None, range(1, 32))], None));
    p1.send(0, &batch(&[store(&[1, 2, 3], None, range(1, 48))], None));
    wait_until("both ranks", || {
        device_of(&index, &prompt, 4, 0) == 2 && device_of(&index, &prompt, 4, 1) == 3
    });
    // Move only rank 1: rank 0 keeps its listener, cursor and blocks.
    hub.set_worker(4, vec![ranked(0, &p0.endpoint), ranked(1, &p1b.endpoint)]);
    assert_eq!(device_of(&index, &prompt, 4, 0), 2);
    assert_eq!(device_of(&index, &prompt, 4, 1), 0, "moved rank cleared");
    let st = hub.stats();
    assert_eq!(
        (st.counters.listeners_started, st.counters.listeners_stopped),
        (3, 1)
    );
    assert_eq!(st.listeners[0].last_seq, Some(0), "rank 0 cursor kept");
    assert_eq!(st.listeners[1].last_seq, None, "rank 1 starts fresh");
    p0.send(1, &batch(&[store(&[3], Some(2), range(33, 48))], None));
    p1b.wait_subscriber();
    p1b.send(0, &batch(&[store(&[7], None, range(1, 16))], None));
    wait_until("after partial move", || {
        device_of(&index, &prompt, 4, 0) == 3 && device_of(&index, &prompt, 4, 1) == 1
    });
    assert_eq!(hub.stats().counters.gaps, 0);
}

/// A listener that stops after one message per round (the cap) must come
/// back for the rest at once: its socket's descriptor does not signal again
/// for messages already queued. A missed wake-up would wait for the 1 s idle
/// poll per message, so 200 queued batches would take minutes, not the
/// wait's 10 s.
#[test]
fn queued_messages_beyond_the_round_cap_are_read_without_new_signals() {
    let ctx = zmq::Context::new();
    let p = Publisher::new(&ctx);
    let index = Arc::new(Index::new());
    let hub = IngestHub::new(IngestConfig {
        threads: 1,
        max_msgs_per_round: 1,
        ..IngestConfig::default()
    });
    hub.set_worker(1, vec![spec(&index, &p.endpoint, None)]);
    p.wait_subscriber();
    let before = hub.stats().counters.batches_applied;
    // One burst, queued in the SUB before the thread reads the first.
    let n = 200u64;
    for seq in 0..n {
        let t0 = seq as u32 * BS + 1;
        let b = batch(&[store(&[5000 + seq], None, range(t0, t0 + BS - 1))], None);
        p.send(seq, &b);
    }
    let started = Instant::now();
    wait_until("every queued batch applied", || {
        hub.stats().counters.batches_applied == before + n
    });
    // Far below one idle poll (1 s) per message.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(hub.stats().counters.gaps, 0);
}

/// Streams removed and added on one thread: a new socket's descriptor often
/// gets the number of one just closed (a ZMQ_FD closes with its socket), and
/// the thread's epoll set must then watch the new socket rather than lose it
/// to the old listener's bookkeeping. A socket missing from the set is still
/// read by the once-a-second sweep, so the test times round trips: four
/// messages in a row to each stream, each sent when the last was applied,
/// take milliseconds when every socket is watched and about a second each
/// when one is not.
#[test]
fn streams_added_after_removals_are_woken_at_once() {
    let ctx = zmq::Context::new();
    let index = Arc::new(Index::new());
    let hub = hub(1);
    let mut live: Vec<(u64, Publisher)> = Vec::new();
    let mut worker = 100u64;
    for _ in 0..3 {
        // Keep one stream, replace the others; each removal's descriptors
        // are closed (by libzmq's reaper) before the next stream opens.
        let keep = live.len().min(1);
        for (w, _) in live.drain(keep..) {
            hub.remove_worker(w);
            std::thread::sleep(Duration::from_millis(20));
        }
        while live.len() < 4 {
            let p = Publisher::new(&ctx);
            worker += 1;
            hub.set_worker(worker, vec![spec(&index, &p.endpoint, None)]);
            p.wait_subscriber();
            live.push((worker, p));
        }
    }
    let mut applied = hub.stats().counters.batches_applied;
    let mut trips = Vec::new();
    for (k, (_, p)) in live.iter().enumerate() {
        for seq in 0..4 {
            let h = 9000 + 16 * k as u64 + seq;
            let t0 = h as u32 * BS;
            let sent = Instant::now();
            p.send(
                seq,
                &batch(&[store(&[h], None, range(t0, t0 + BS - 1))], None),
            );
            applied += 1;
            wait_until("batch applied", || {
                hub.stats().counters.batches_applied == applied
            });
            trips.push(sent.elapsed());
        }
    }
    // A stream left out of the set waits for the sweep: at least three of
    // its four round trips take about a second. One slow trip on a loaded
    // machine is not that.
    let slow = trips
        .iter()
        .filter(|t| **t > Duration::from_millis(600))
        .count();
    assert!(slow <= 1, "round trips {trips:?}");
    assert_eq!(hub.stats().counters.gaps, 0);
}
