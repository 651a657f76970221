//! Hot paths of hashing and the KV index, each next to a simple peer in the
//! same run (the machine is shared, so compare ratios, not absolute times):
//!
//! - `hash/100k_bs16`: local block hashes + public sequence chain of a
//!   100k-token prompt (throughput in token bytes); peer `hash/xxh3_plain`
//!   calls xxhash-rust's one-shot `xxh3_64_with_seed` per block and per link;
//!   `hash/100k_bs16_fused` is `local_and_sequence_hashes` (one pass).
//! - `apply/1_thread`, `apply/2_threads`: 16-block stores of 64 workers
//!   (throughput in blocks).
//! - `churn/store_remove_1000`: the seed profile's steady state: 128
//!   workers each holding 8,000 blocks (1M nodes, far past the caches); one
//!   round is a worker storing a 1,000-block chain under its newest block and
//!   removing its 1,000 oldest (throughput in block operations); peer
//!   `churn/store_remove_1000_single` removes them one call per block.
//! - `overlap/cold_two_holders`: 1,500-block prompts of 512 sessions, each
//!   held by two workers and stored 16 blocks at a time (no runs), walked in
//!   turn so that every probe misses the caches.
//! - `overlap/100k_1024w`: a 6,250-block prompt against 1,024 workers sharing
//!   a 1,000-block prefix (each with 250 own blocks; worker 0 holds the whole
//!   prompt); peer `overlap/naive_per_worker`: a `HashMap<key, Vec<(slot,
//!   tiers)>>` walked once per worker.
//!
//! Run: `cargo bench --bench index`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvselect::hash::{
    chain, local_and_sequence_hashes, local_block_hashes, sequence_hashes, PUBLIC_SEED,
};
use kvselect::index::{Index, StoredBlock, Tier, WorkerRank};
use rand::{Rng, SeedableRng};
use xxhash_rust::xxh3::xxh3_64_with_seed;

fn wr(w: u64) -> WorkerRank {
    WorkerRank {
        worker_id: w,
        dp_rank: 0,
    }
}

fn bench_hash(c: &mut Criterion) {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
    let tokens: Vec<u32> = (0..100_000).map(|_| rng.random()).collect();
    let mut g = c.benchmark_group("hash");
    g.throughput(Throughput::Bytes(400_000));
    let (mut local, mut seq) = (Vec::with_capacity(6250), Vec::with_capacity(6250));
    g.bench_function("100k_bs16", |b| {
        b.iter(|| {
            local.clear();
            seq.clear();
            local_block_hashes(&tokens, 16, false, PUBLIC_SEED, None, &mut local);
            sequence_hashes(&local, PUBLIC_SEED, &mut seq);
            seq.last().copied()
        })
    });
    g.bench_function("100k_bs16_fused", |b| {
        b.iter(|| {
            local.clear();
            seq.clear();
            local_and_sequence_hashes(
                &tokens,
                16,
                false,
                PUBLIC_SEED,
                PUBLIC_SEED,
                None,
                &mut local,
                &mut seq,
            );
            seq.last().copied()
        })
    });
    g.bench_function("xxh3_plain", |b| {
        b.iter(|| {
            let bytes: &[u8] = bytemuck::cast_slice(&tokens);
            let mut prev = 0;
            for (i, w) in bytes.chunks_exact(64).enumerate() {
                let h = xxh3_64_with_seed(w, PUBLIC_SEED);
                prev = if i == 0 {
                    h
                } else {
                    let mut buf = [0u8; 16];
                    buf[..8].copy_from_slice(&u64::to_le_bytes(prev));
                    buf[8..].copy_from_slice(&h.to_le_bytes());
                    xxh3_64_with_seed(&buf, PUBLIC_SEED)
                };
            }
            prev
        })
    });
    g.finish();
}

type Events = Vec<Vec<(Option<u64>, Vec<StoredBlock>)>>;

/// Per worker, stores of 16 blocks: a 64-block prefix shared by all, then
/// 1,536 blocks of its own.
fn events(workers: u64) -> (Events, u64) {
    let mut total = 0;
    let per = (0..workers)
        .map(|w| {
            let blocks: Vec<StoredBlock> = (0..1600u64)
                .map(|i| StoredBlock {
                    engine_hash: (w << 32) | i,
                    local_hash: if i < 64 {
                        i + 1
                    } else {
                        (w << 32) ^ i.wrapping_mul(0x9E37_79B9)
                    },
                })
                .collect();
            total += blocks.len() as u64;
            blocks
                .chunks(16)
                .map(|c| {
                    let parent = (c[0].engine_hash & 0xFFFF_FFFF > 0).then(|| c[0].engine_hash - 1);
                    (parent, c.to_vec())
                })
                .collect()
        })
        .collect();
    (per, total)
}

fn apply(ix: &Index, per: &Events, threads: u64) {
    std::thread::scope(|s| {
        for th in 0..threads {
            s.spawn(move || {
                for w in (th..per.len() as u64).step_by(threads as usize) {
                    for (parent, b) in &per[w as usize] {
                        ix.store(wr(w), Tier::Device, *parent, b).unwrap();
                    }
                }
            });
        }
    });
}

fn bench_apply(c: &mut Criterion) {
    let (per, total) = events(64);
    let per = Arc::new(per);
    let mut g = c.benchmark_group("apply");
    g.throughput(Throughput::Elements(total));
    for threads in [1u64, 2] {
        let name = if threads == 1 {
            "1_thread"
        } else {
            "2_threads"
        };
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    let ix = Index::new();
                    let t = Instant::now();
                    apply(&ix, &per, threads);
                    spent += t.elapsed();
                }
                spent
            })
        });
    }
    g.finish();
}

/// One worker's blocks in the churn bench: engine hashes `(w << 40) | n` for
/// `n` in `oldest..next`.
struct ChurnWorker {
    oldest: u64,
    next: u64,
}

fn churn_blocks(w: u64, from: u64, n: u64) -> Vec<StoredBlock> {
    (from..from + n)
        .map(|i| StoredBlock {
            engine_hash: (w << 40) | i,
            local_hash: ((w << 40) | i).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
        })
        .collect()
}

fn bench_churn(c: &mut Criterion) {
    const WORKERS: u64 = 128;
    const HELD: u64 = 8000;
    const ROUND: u64 = 1000;
    let ix = Index::new();
    let mut ws: Vec<ChurnWorker> = (0..WORKERS)
        .map(|w| {
            ix.store(wr(w), Tier::Device, None, &churn_blocks(w, 0, HELD))
                .unwrap();
            ChurnWorker {
                oldest: 0,
                next: HELD,
            }
        })
        .collect();
    let mut round = 0u64;
    let mut removed: Vec<u64> = Vec::with_capacity(ROUND as usize);
    let mut g = c.benchmark_group("churn");
    g.throughput(Throughput::Elements(2 * ROUND));
    // The peer removes one hash per call, as applying vLLM's one
    // BlockRemoved per block event by event would.
    for (name, per_call) in [
        ("store_remove_1000", ROUND),
        ("store_remove_1000_single", 1),
    ] {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    let w = round % WORKERS;
                    round += 1;
                    let st = &mut ws[w as usize];
                    let blocks = churn_blocks(w, st.next, ROUND);
                    removed.clear();
                    removed.extend((st.oldest..st.oldest + ROUND).map(|i| (w << 40) | i));
                    let parent = Some((w << 40) | (st.next - 1));
                    let t = Instant::now();
                    let added = ix.store(wr(w), Tier::Device, parent, &blocks).unwrap();
                    let gone: usize = removed
                        .chunks(per_call as usize)
                        .map(|c| ix.remove(wr(w), Tier::Device, c))
                        .sum();
                    spent += t.elapsed();
                    assert_eq!((added, gone), (ROUND as usize, ROUND as usize));
                    st.next += ROUND;
                    st.oldest += ROUND;
                }
                spent
            })
        });
    }
    g.finish();
}

/// Cold walks of prompts held block by block: 512 sessions of 1,500 blocks,
/// each stored by two workers in 16-block stores (no runs), so every block
/// is a probe of a node far past the caches; each iteration walks the next
/// session's prompt.
fn bench_overlap_cold(c: &mut Criterion) {
    const SESSIONS: u64 = 512;
    const BLOCKS: u64 = 1500;
    let ix = Index::new();
    let prompts: Vec<Vec<u64>> = (0..SESSIONS)
        .map(|s| {
            let local: Vec<u64> = (0..BLOCKS)
                .map(|i| ((s << 32) | i).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
                .collect();
            for w in [s % 128, (s + 1) % 128] {
                for (k, c) in local.chunks(16).enumerate() {
                    let first = (s << 32) | (k as u64 * 16);
                    let blocks: Vec<StoredBlock> = c
                        .iter()
                        .enumerate()
                        .map(|(j, &l)| StoredBlock {
                            engine_hash: first + j as u64 + 1,
                            local_hash: l,
                        })
                        .collect();
                    let parent = (k > 0).then_some(first);
                    ix.store(wr(w), Tier::Device, parent, &blocks).unwrap();
                }
            }
            let mut keys = Vec::new();
            sequence_hashes(&local, PUBLIC_SEED, &mut keys);
            keys
        })
        .collect();
    let mut g = c.benchmark_group("overlap");
    let mut out = Vec::new();
    let mut next = 0;
    g.bench_function(BenchmarkId::new("cold_two_holders", BLOCKS), |b| {
        b.iter(|| {
            next = (next + 1) % prompts.len();
            ix.overlap(&prompts[next], &mut out);
            assert_eq!(out.len(), 2);
            out.len()
        })
    });
    g.finish();
}

fn bench_overlap(c: &mut Criterion) {
    let ix = Index::new();
    let prompt: Vec<u64> = (0..6250u64).map(|i| i * 0x1_0000_0001 + 7).collect();
    // The naive peer: key -> holder list, walked once per worker.
    let mut naive: HashMap<u64, Vec<(u32, u8)>> = HashMap::new();
    for w in 0..1024u64 {
        let mut local = prompt[..1000].to_vec();
        if w == 0 {
            local.extend_from_slice(&prompt[1000..]);
        } else {
            local.extend((0..250u64).map(|i| (w << 40) | i));
        }
        let blocks: Vec<StoredBlock> = local
            .iter()
            .enumerate()
            .map(|(i, &l)| StoredBlock {
                engine_hash: i as u64,
                local_hash: l,
            })
            .collect();
        ix.store(wr(w), Tier::Device, None, &blocks).unwrap();
        let mut k = 0;
        for (i, &l) in local.iter().enumerate() {
            k = if i == 0 { l } else { chain(k, l, PUBLIC_SEED) };
            naive.entry(k).or_default().push((w as u32, 1));
        }
    }
    let mut keys = Vec::new();
    sequence_hashes(&prompt, PUBLIC_SEED, &mut keys);
    let mut g = c.benchmark_group("overlap");
    let mut out = Vec::new();
    g.bench_function(BenchmarkId::new("100k_1024w", 6250), |b| {
        b.iter(|| {
            ix.overlap(&keys, &mut out);
            out.len()
        })
    });
    g.bench_function(BenchmarkId::new("naive_per_worker", 6250), |b| {
        b.iter(|| {
            let mut rows = 0;
            for w in 0..1024u32 {
                let depth = keys
                    .iter()
                    .take_while(|k| {
                        naive
                            .get(k)
                            .is_some_and(|v| v.iter().any(|&(s, m)| s == w && m & 1 != 0))
                    })
                    .count();
                rows += (depth > 0) as usize;
            }
            rows
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = bench_hash, bench_apply, bench_churn, bench_overlap, bench_overlap_cold
}
criterion_main!(benches);
