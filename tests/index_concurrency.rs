//! The index under concurrent use (events apply while lookups run), and its
//! memory going back down when blocks and workers go away.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvselect::hash::{sequence_hashes, PUBLIC_SEED};
use kvselect::index::{Index, Overlap, StoredBlock, Tier, WorkerRank};

fn wr(w: u64) -> WorkerRank {
    WorkerRank {
        worker_id: w,
        dp_rank: 0,
    }
}

fn chain_blocks(engine_base: u64, local: &[u64]) -> Vec<StoredBlock> {
    local
        .iter()
        .enumerate()
        .map(|(i, &l)| StoredBlock {
            engine_hash: engine_base + i as u64,
            local_hash: l,
        })
        .collect()
}

#[test]
fn lookups_see_a_stable_worker_while_others_churn() {
    let ix = Arc::new(Index::new());
    let local: Vec<u64> = (1..=64).map(|i| i * 7919).collect();
    let mut keys = Vec::new();
    sequence_hashes(&local, PUBLIC_SEED, &mut keys);
    // Worker 0 holds the whole prompt on device for the whole test.
    ix.store(wr(0), Tier::Device, None, &chain_blocks(0, &local))
        .unwrap();
    let before = ix.stats();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..2u64)
        .map(|t| {
            let ix = ix.clone();
            let local = local.clone();
            std::thread::spawn(move || {
                for round in 0..300u64 {
                    for w in 1..=20u64 {
                        let id = t * 100 + w;
                        let n = 1 + ((round + w) % 64) as usize;
                        let tier = Tier::ALL[(round % 4) as usize];
                        ix.store(wr(id), tier, None, &chain_blocks(1000, &local[..n]))
                            .unwrap();
                        if round % 3 == 0 {
                            ix.remove(wr(id), tier, &[1000 + n as u64 / 2]);
                        }
                        if round % 7 == 0 {
                            ix.clear(wr(id));
                        }
                    }
                    if round % 11 == 0 {
                        ix.remove_worker(t * 100 + 5);
                    }
                }
            })
        })
        .collect();
    let reader = {
        let ix = ix.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut out = Vec::new();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) || n < 100 {
                ix.overlap(&keys, &mut out);
                let me = out.iter().find(|(w, _)| *w == wr(0)).map(|x| x.1);
                assert_eq!(
                    me,
                    Some(Overlap {
                        device: 64,
                        host_ext: 0,
                        disk_ext: 0
                    })
                );
                for (w, o) in &out {
                    assert!(o.device + o.host_ext + o.disk_ext <= 64, "{w:?} {o:?}");
                }
                n += 1;
            }
            n
        })
    };
    for w in writers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    assert!(reader.join().unwrap() >= 100);
    for t in 0..2u64 {
        for w in 1..=20u64 {
            ix.remove_worker(t * 100 + w);
        }
    }
    let after = ix.stats();
    assert_eq!((after.nodes, after.entries, after.ranks), (64, 64, 1));
    assert_eq!(
        (before.nodes, before.entries, before.ranks),
        (after.nodes, after.entries, after.ranks)
    );
}

#[test]
fn removing_blocks_and_workers_frees_memory() {
    let ix = Index::new();
    let empty = ix.stats().bytes;
    let mut grown = 0;
    for cycle in 0..3u64 {
        // 200 workers, each a shared 100-block prefix plus 100 own blocks,
        // on two tiers: shared nodes go dense, private ones stay inline.
        let shared: Vec<u64> = (0..100).map(|i| i + 1).collect();
        for w in 0..200u64 {
            let mut local = shared.clone();
            local.extend((0..100).map(|i| (w + 1) * 1_000_000 + i + cycle));
            ix.store(wr(w), Tier::Device, None, &chain_blocks(0, &local))
                .unwrap();
            ix.store(wr(w), Tier::HostPinned, None, &chain_blocks(0, &local))
                .unwrap();
        }
        let s = ix.stats();
        assert_eq!(s.nodes, 100 + 200 * 100);
        assert_eq!(s.entries, 2 * 200 * 200);
        grown = grown.max(s.bytes);
        // Half the workers go by block removal, half as whole workers.
        for w in 0..100u64 {
            let all: Vec<u64> = (0..200).collect();
            assert_eq!(ix.remove(wr(w), Tier::Device, &all), 200);
            assert_eq!(ix.remove(wr(w), Tier::HostPinned, &all), 200);
        }
        for w in 100..200u64 {
            ix.remove_worker(w);
        }
        for w in 0..100u64 {
            ix.clear(wr(w));
        }
        let s = ix.stats();
        assert_eq!((s.nodes, s.entries, s.ranks), (0, 0, 0));
        assert!(
            s.bytes <= empty + 4096,
            "cycle {cycle}: {} bytes left (empty {empty}, grown {grown})",
            s.bytes
        );
    }
    assert!(grown > 1_000_000);
}
