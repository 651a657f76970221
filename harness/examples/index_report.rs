//! Short measurement run of the hashing and index hot paths.
//!
//! `cargo run --release --example index_report` prints details first and, as
//! its last four lines, `hash_gbps=`, `apply_blocks_per_s=`,
//! `overlap_us_100k_1024w=` and `bytes_per_entry=` (the worse of the
//! shared-prefix and all-distinct layouts at 1M entries, measured with the
//! counting allocator below: requested bytes live in the index, not estimates).
//! Times are medians of several runs; the machine may be shared.

// A counting `GlobalAlloc` measures the index's heap.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;

use kvselect::hash::{local_and_sequence_hashes, local_block_hashes, sequence_hashes, PUBLIC_SEED};
use kvselect::index::{Index, StoredBlock, Tier, WorkerRank};
use rand::{Rng, SeedableRng};

/// Counts live heap bytes (as requested by the program).
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards every call to `System` unchanged; only adds bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// This thread's CPU time in seconds: on a shared machine, time spent
/// preempted is not ours.
fn cpu_now() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; the clock id is a constant.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn wr(w: u64) -> WorkerRank {
    WorkerRank {
        worker_id: w,
        dp_rank: 0,
    }
}

/// GB/s of token bytes for a 100k-token prompt at bs 16: (the two calls
/// `local_block_hashes` + `sequence_hashes`, the fused
/// `local_and_sequence_hashes`).
fn hash_gbps() -> (f64, f64) {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
    let tokens: Vec<u32> = (0..100_000).map(|_| rng.random()).collect();
    let (mut local, mut seq) = (Vec::with_capacity(6250), Vec::with_capacity(6250));
    let (mut two, mut fused) = (Vec::new(), Vec::new());
    for _ in 0..15 {
        let t = cpu_now();
        for _ in 0..20 {
            local.clear();
            seq.clear();
            local_block_hashes(&tokens, 16, false, PUBLIC_SEED, None, &mut local);
            sequence_hashes(&local, PUBLIC_SEED, &mut seq);
            std::hint::black_box(&seq);
        }
        two.push(20.0 * 400_000.0 / (cpu_now() - t) / 1e9);
        let t = cpu_now();
        for _ in 0..20 {
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
            std::hint::black_box(&seq);
        }
        fused.push(20.0 * 400_000.0 / (cpu_now() - t) / 1e9);
    }
    (median(two), median(fused))
}

/// Stores of 16 blocks per event (one vLLM step), per worker: a 64-block
/// prefix shared by all workers, then `own` blocks of its own.
fn events(worker: u64, own: u64) -> Vec<(Option<u64>, Vec<StoredBlock>)> {
    let blocks: Vec<StoredBlock> = (0..64 + own)
        .map(|i| StoredBlock {
            engine_hash: (worker << 32) | i,
            local_hash: if i < 64 {
                i + 1
            } else {
                (worker << 32) ^ (i * 0x9E37_79B9)
            },
        })
        .collect();
    blocks
        .chunks(16)
        .map(|c| {
            let parent = (c[0].engine_hash & 0xFFFF_FFFF > 0).then(|| c[0].engine_hash - 1);
            (parent, c.to_vec())
        })
        .collect()
}

fn apply_rate(threads: u64) -> f64 {
    let workers = 64u64;
    let per: Vec<Vec<_>> = (0..workers).map(|w| events(w, 1536)).collect();
    let total: usize = per
        .iter()
        .flat_map(|e| e.iter().map(|(_, b)| b.len()))
        .sum();
    let per = Arc::new(per);
    let mut runs = Vec::new();
    for _ in 0..7 {
        let ix = Arc::new(Index::new());
        let hs: Vec<_> = (0..threads)
            .map(|th| {
                let (ix, per) = (ix.clone(), per.clone());
                std::thread::spawn(move || {
                    let c = cpu_now();
                    for w in (th..workers).step_by(threads as usize) {
                        for (parent, b) in &per[w as usize] {
                            ix.store(wr(w), Tier::Device, *parent, b).unwrap();
                        }
                    }
                    cpu_now() - c
                })
            })
            .collect();
        // The slowest thread's CPU time bounds the run (time preempted by
        // other processes on this shared machine is not counted).
        let cpu = hs
            .into_iter()
            .map(|h| h.join().unwrap())
            .fold(0.0, f64::max);
        runs.push(total as f64 / cpu);
        drop(ix);
    }
    median(runs)
}

/// 1,024 workers share a 1,000-block prefix; each has 250 blocks of its own
/// after it, except worker 0, which holds the whole 6,250-block prompt.
fn overlap_us() -> (f64, usize) {
    overlap_us_with(1024, 250, 6250)
}

/// Stores `local` as one chain of worker `w` (engine hashes 0, 1, ...).
fn store_chain(ix: &Index, w: u64, local: &[u64]) {
    let blocks: Vec<StoredBlock> = local
        .iter()
        .enumerate()
        .map(|(i, &l)| StoredBlock {
            engine_hash: i as u64,
            local_hash: l,
        })
        .collect();
    ix.store(wr(w), Tier::Device, None, &blocks).unwrap();
}

fn overlap_us_with(workers: u64, own: u64, query: usize) -> (f64, usize) {
    let ix = Index::new();
    let prompt: Vec<u64> = (0..6250u64).map(|i| i * 0x1_0000_0001 + 7).collect();
    for w in 0..workers {
        let mut local = prompt[..1000].to_vec();
        if w == 0 {
            local.extend_from_slice(&prompt[1000..]);
        } else {
            local.extend((0..own).map(|i| (w << 40) | i));
        }
        store_chain(&ix, w, &local);
    }
    let mut keys = Vec::new();
    sequence_hashes(&prompt[..query], PUBLIC_SEED, &mut keys);
    let mut out = Vec::new();
    let mut runs = Vec::new();
    for _ in 0..15 {
        let t = cpu_now();
        for _ in 0..20 {
            ix.overlap(&keys, &mut out);
        }
        runs.push((cpu_now() - t) * 1e6 / 20.0);
    }
    (median(runs), out.len())
}

/// The load harness's shape: 64 workers, each holding the 1,000-block prefix
/// and 30,000 blocks of its own (a 2M-node index, far beyond L2), worker 0's
/// own blocks continuing the prompt; 32 MiB of other memory is written
/// between queries, as other requests' bodies do in the server.
fn overlap_cold_us() -> f64 {
    let ix = Index::new();
    let prompt: Vec<u64> = (0..31_000u64).map(|i| i * 0x1_0000_0001 + 7).collect();
    for w in 0..64u64 {
        let local: Vec<u64> = if w == 0 {
            prompt.clone()
        } else {
            prompt[..1000]
                .iter()
                .copied()
                .chain((0..30_000u64).map(|i| (w << 40) | i))
                .collect()
        };
        store_chain(&ix, w, &local);
    }
    let mut keys = Vec::new();
    sequence_hashes(&prompt, PUBLIC_SEED, &mut keys);
    let mut junk = vec![0u8; 32 << 20];
    let mut out = Vec::new();
    let mut runs = Vec::new();
    for q in 0..60usize {
        for (i, b) in junk.iter_mut().enumerate().step_by(64) {
            *b = (i ^ q) as u8;
        }
        std::hint::black_box(&junk);
        // A different 6,250-block window of worker 0's chain each time
        // (its keys are not in cache), always from the root.
        let n = 6250 + (q % 4) * 6000;
        let t = cpu_now();
        ix.overlap(&keys[..n], &mut out);
        runs.push((cpu_now() - t) * 1e6 * 6250.0 / n as f64);
    }
    median(runs)
}

/// Live bytes per (block, worker, tier) entry at ~1M entries.
fn bytes_per_entry(shared: bool) -> (f64, usize) {
    let before = LIVE.load(Ordering::Relaxed);
    let ix = Index::new();
    let (workers, len) = (1000u64, 1000u64);
    for w in 0..workers {
        let blocks: Vec<StoredBlock> = (0..len)
            .map(|i| StoredBlock {
                engine_hash: i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ w,
                local_hash: if shared { i + 1 } else { (w << 32) | i },
            })
            .collect();
        ix.store(wr(w), Tier::Device, None, &blocks).unwrap();
    }
    let entries = ix.stats().entries;
    let after = LIVE.load(Ordering::Relaxed);
    drop(ix);
    ((after - before) as f64 / entries as f64, entries)
}

fn main() {
    // Profiling aid: `INDEX_REPORT_ONLY=overlap` runs just that part, longer.
    if std::env::var("INDEX_REPORT_ONLY").as_deref() == Ok("hash") {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
        let tokens: Vec<u32> = (0..100_000).map(|_| rng.random()).collect();
        let (mut local, mut seq) = (Vec::with_capacity(6250), Vec::with_capacity(6250));
        for _ in 0..5 {
            let t = cpu_now();
            for _ in 0..100 {
                local.clear();
                local_block_hashes(&tokens, 16, false, PUBLIC_SEED, None, &mut local);
            }
            let l = cpu_now() - t;
            let t = cpu_now();
            for _ in 0..100 {
                seq.clear();
                sequence_hashes(&local, PUBLIC_SEED, &mut seq);
            }
            let q = cpu_now() - t;
            println!(
                "local {:.2} GB/s, seq {:.2} GB/s",
                4e7 / l / 1e9,
                4e7 / q / 1e9
            );
        }
        return;
    }
    if std::env::var("INDEX_REPORT_ONLY").as_deref() == Ok("apply") {
        println!("apply 1 thread {:.2} M blocks/s", apply_rate(1) / 1e6);
        return;
    }
    if std::env::var("INDEX_REPORT_ONLY").as_deref() == Ok("overlap1") {
        for _ in 0..30 {
            println!("  1 worker, 6250: {:.1} us", overlap_us_with(1, 0, 6250).0);
        }
        return;
    }
    if std::env::var("INDEX_REPORT_ONLY").as_deref() == Ok("overlapcold") {
        for _ in 0..3 {
            println!("cold overlap {:.1} us", overlap_cold_us());
        }
        return;
    }
    if std::env::var("INDEX_REPORT_ONLY").as_deref() == Ok("overlap") {
        for _ in 0..3 {
            println!("overlap {:.1} us", overlap_us().0);
            println!("  1 worker, 6250: {:.1} us", overlap_us_with(1, 0, 6250).0);
            println!(
                "  1024 workers, no suffix, 1000: {:.1} us",
                overlap_us_with(1024, 0, 1000).0
            );
            println!(
                "  1024 workers, own 250, 1000: {:.1} us",
                overlap_us_with(1024, 250, 1000).0
            );
        }
        return;
    }
    let (gbps, fused) = hash_gbps();
    println!(
        "hashing 100k tokens, bs 16: local_block_hashes + sequence_hashes {gbps:.2} GB/s, fused local_and_sequence_hashes {fused:.2} GB/s (token bytes, CPU time)"
    );
    let a1 = apply_rate(1);
    let a2 = apply_rate(2);
    println!(
        "apply: 64 workers x 1,600 blocks in 16-block stores: 1 thread {:.2} M blocks/s, 2 threads {:.2} M blocks/s",
        a1 / 1e6,
        a2 / 1e6
    );
    let (us, rows) = overlap_us();
    println!(
        "overlap: 6,250-block prompt, 1,024 workers sharing 1,000 blocks: {us:.1} us ({rows} rows)"
    );
    let (shared, n1) = bytes_per_entry(true);
    let (distinct, n2) = bytes_per_entry(false);
    println!("memory: shared-prefix {shared:.1} B/entry ({n1} entries), all-distinct {distinct:.1} B/entry ({n2} entries)");
    println!("hash_gbps={gbps:.2}");
    println!("apply_blocks_per_s={a1:.0}");
    println!("overlap_us_100k_1024w={us:.1}");
    println!("bytes_per_entry={:.1}", shared.max(distinct));
}
