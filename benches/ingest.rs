//! Ingestion throughput: decode only, decode + apply to the real Index, and
//! end to end over real ZMQ sockets (XPUB on 127.0.0.1 -> IngestHub -> Index).
//!
//! Workload per batch (one engine step): a `BlockStored` of 4 blocks (64
//! tokens, block size 16, vLLM 0.34 map form) and a `BlockRemoved` of the
//! previous step's 4 blocks, so the index stays at a steady size. Throughput is
//! counted in events (2 per batch, 4 blocks each).
//!
//! Run: `CARGO_BUILD_JOBS=1 cargo bench --bench ingest`

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvselect::index::{Index, Tier};
use kvselect::ingest::apply::{Applier, ApplyCounts};
use kvselect::ingest::decode::{decode_batch, Group, KvEvent, Removed, Stored};
use kvselect::ingest::encode::{encode_batch, EventForm};
use kvselect::ingest::{IngestConfig, IngestHub, ListenerSpec};
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

const BS: u32 = 16;
const BLOCKS: u64 = 4;
/// Distinct batches cycled through (distinct content and hashes).
const RING: u64 = 1024;

fn payload(i: u64, form: EventForm) -> Vec<u8> {
    let base = (i % RING) * BLOCKS;
    let prev = ((i + RING - 1) % RING) * BLOCKS;
    let t0 = (i % RING) as u32 * 1000;
    let events = vec![
        KvEvent::Stored(Stored {
            block_hashes: (0..BLOCKS).map(|b| (base + b) | 1 << 63).collect(),
            parent_hash: None,
            token_ids: (t0..t0 + (BLOCKS as u32) * BS).collect(),
            eagle: false,
            block_size: BS,
            medium: Tier::Device,
            lora_name: None,
            cache_salt: None,
            mm_hashes: None,
            group: Group::default(),
        }),
        KvEvent::Removed(Removed {
            block_hashes: (0..BLOCKS).map(|b| (prev + b) | 1 << 63).collect(),
            medium: Tier::Device,
            group: Group::default(),
        }),
    ];
    let mut p = Vec::new();
    encode_batch(&mut p, 1.0, &events, Some(0), form);
    p
}

fn decode_and_apply(c: &mut Criterion) {
    let map: Vec<Vec<u8>> = (0..RING).map(|i| payload(i, EventForm::Map)).collect();
    let arr: Vec<Vec<u8>> = (0..RING).map(|i| payload(i, EventForm::Array)).collect();
    let bytes: usize = map.iter().map(Vec::len).sum();
    let mut g = c.benchmark_group("ingest_decode");
    g.throughput(Throughput::Elements(2 * RING));
    g.bench_function("decode_map_form", |b| {
        b.iter(|| {
            for p in &map {
                black_box(decode_batch(p).unwrap());
            }
        })
    });
    g.bench_function("decode_array_form", |b| {
        b.iter(|| {
            for p in &arr {
                black_box(decode_batch(p).unwrap());
            }
        })
    });
    g.bench_function("decode_and_apply_map_form", |b| {
        b.iter_batched_ref(
            || (Index::new(), Applier::new(1, 0, BS)),
            |(index, ap)| {
                let mut counts = ApplyCounts::default();
                for p in &map {
                    ap.apply(index, &decode_batch(p).unwrap(), &mut counts);
                }
                black_box(counts)
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
    eprintln!(
        "ingest bench: {} map-form batches = {bytes} bytes ({} bytes/batch)",
        RING,
        bytes / RING as usize
    );
}

fn end_to_end(c: &mut Criterion) {
    let ctx = zmq::Context::new();
    let publ = ctx.socket(zmq::XPUB).unwrap();
    publ.set_xpub_verbose(true).unwrap();
    publ.set_sndhwm(1_000_000).unwrap();
    publ.set_linger(0).unwrap();
    publ.bind("tcp://127.0.0.1:0").unwrap();
    let ep = publ.get_last_endpoint().unwrap().unwrap();
    let index = Arc::new(Index::new());
    let hub = IngestHub::new(IngestConfig {
        threads: 1,
        ..IngestConfig::default()
    });
    hub.set_worker(
        1,
        vec![ListenerSpec {
            dp_rank: 0,
            endpoint: ep,
            replay_endpoint: None,
            index,
            block_size: BS,
        }],
    );
    publ.set_rcvtimeo(10_000).unwrap();
    let sub = publ.recv_bytes(0).expect("subscriber within 10 s");
    assert_eq!(sub.first(), Some(&1));
    let payloads: Vec<Vec<u8>> = (0..RING).map(|i| payload(i, EventForm::Map)).collect();
    let mut seq = 0u64;
    let mut g = c.benchmark_group("ingest_e2e_zmq");
    g.throughput(Throughput::Elements(2 * RING));
    g.bench_function("pub_to_index_1_listener", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                for p in &payloads {
                    publ.send_multipart([&b""[..], &seq.to_be_bytes(), p], 0)
                        .unwrap();
                    seq += 1;
                }
            }
            let deadline = Instant::now() + Duration::from_secs(60);
            while hub.stats().counters.batches_applied < seq {
                assert!(Instant::now() < deadline, "hub fell behind");
                std::thread::sleep(Duration::from_micros(200));
            }
            start.elapsed()
        })
    });
    g.finish();
    let c = hub.stats().counters;
    assert_eq!(c.gaps + c.malformed, 0, "{c:?}");
    eprintln!(
        "ingest bench e2e: {} batches, {} blocks stored, {} removed, gaps {}",
        c.batches_applied, c.apply.blocks_stored, c.apply.blocks_removed, c.gaps
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = decode_and_apply, end_to_end
}
criterion_main!(benches);
