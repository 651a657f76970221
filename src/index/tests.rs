//! Unit tests of the index through its public calls, plus the run records
//! a long store leaves (read through the walk's own probe).

use super::holders::{DEV, HOST};
use super::*;
use crate::hash::sequence_hashes;

fn wr(w: u64) -> WorkerRank {
    WorkerRank {
        worker_id: w,
        dp_rank: 0,
    }
}

fn blocks(engine: &[u64], local: &[u64]) -> Vec<StoredBlock> {
    engine
        .iter()
        .zip(local)
        .map(|(&e, &l)| StoredBlock {
            engine_hash: e,
            local_hash: l,
        })
        .collect()
}

fn keys(local: &[u64]) -> Vec<u64> {
    let mut k = Vec::new();
    sequence_hashes(local, PUBLIC_SEED, &mut k);
    k
}

fn ov(ix: &Index, local: &[u64]) -> Vec<(WorkerRank, Overlap)> {
    let mut out = Vec::new();
    ix.overlap(&keys(local), &mut out);
    out.sort_by_key(|x| x.0);
    out
}

fn o(device: u32, host_ext: u32, disk_ext: u32) -> Overlap {
    Overlap {
        device,
        host_ext,
        disk_ext,
    }
}

/// What the walk would read at `key`'s node: blocks of a whole run
/// ahead of it, and the run's last key.
fn run_ahead(ix: &Index, key: u64, need: u8) -> Option<(usize, u64)> {
    let g = ix.nodes[node_shard(key)].0.read();
    let n = table::probe_likely(g.nodes.buckets(), g.nodes.home_of(key), key)?;
    ix.runs.ahead(n.holders.run_tag()?, need)
}

#[test]
fn long_stores_make_runs_that_stop_at_holes_and_other_tiers() {
    let local: Vec<u64> = (1..=100).collect();
    let engine: Vec<u64> = (1001..=1100).collect();
    let k = keys(&local);
    let ix = Index::new();
    ix.store(wr(1), Tier::Device, None, &blocks(&engine, &local))
        .unwrap();
    assert_eq!(run_ahead(&ix, k[1], DEV), Some((98, k[99])));
    assert_eq!(run_ahead(&ix, k[1], HOST), None, "the run is on device");
    assert_eq!(ov(&ix, &local), vec![(wr(1), o(100, 0, 0))]);
    // A hole: the run is no longer whole, the walk stops at it.
    assert_eq!(ix.remove(wr(1), Tier::Device, &[1051]), 1);
    assert_eq!(run_ahead(&ix, k[1], DEV), None);
    assert_eq!(ov(&ix, &local), vec![(wr(1), o(50, 0, 0))]);
    // A second holder untags the nodes it shares.
    ix.store(wr(1), Tier::Device, Some(1050), &blocks(&[1051], &[51]))
        .unwrap();
    ix.store(
        wr(2),
        Tier::Device,
        None,
        &blocks(&engine[..40], &local[..40]),
    )
    .unwrap();
    assert_eq!(
        ov(&ix, &local),
        vec![(wr(1), o(100, 0, 0)), (wr(2), o(40, 0, 0))]
    );
    ix.clear(wr(1));
    ix.clear(wr(2));
    assert_eq!(ix.runs.heap_bytes(), 0, "no live run keeps its segment");

    // Device for 60 blocks, then host for all 100: the host run's first
    // 60 nodes are on device too, but a device walk may not pass the
    // host run.
    ix.store(
        wr(1),
        Tier::Device,
        None,
        &blocks(&engine[..60], &local[..60]),
    )
    .unwrap();
    ix.store(wr(1), Tier::HostPinned, None, &blocks(&engine, &local))
        .unwrap();
    assert_eq!(run_ahead(&ix, k[1], DEV), None);
    assert_eq!(run_ahead(&ix, k[1], DEV | HOST), Some((98, k[99])));
    assert_eq!(ov(&ix, &local), vec![(wr(1), o(60, 40, 0))]);
    // A store longer than MAX_RUN is cut: 512 blocks, then 88; a tail
    // shorter than MIN_RUN makes no run.
    for (n, tail_run) in [(600usize, true), (530, false)] {
        let ix = Index::new();
        let local: Vec<u64> = (1..=n as u64).collect();
        let engine: Vec<u64> = (1..=n as u64).map(|e| e + 10_000).collect();
        let k = keys(&local);
        ix.store(wr(1), Tier::Device, None, &blocks(&engine, &local))
            .unwrap();
        assert_eq!(run_ahead(&ix, k[1], DEV), Some((510, k[511])));
        assert_eq!(
            run_ahead(&ix, k[512], DEV),
            tail_run.then(|| (n - 513, k[n - 1]))
        );
        assert_eq!(ov(&ix, &local), vec![(wr(1), o(n as u32, 0, 0))]);
        assert_eq!(ix.remove(wr(1), Tier::Device, &[10_000 + n as u64]), 1);
        assert_eq!(ov(&ix, &local), vec![(wr(1), o(n as u32 - 1, 0, 0))]);
    }
    // Stores shorter than MIN_RUN make no run.
    let ix = Index::new();
    ix.store(
        wr(1),
        Tier::Device,
        None,
        &blocks(&engine[..31], &local[..31]),
    )
    .unwrap();
    assert_eq!(run_ahead(&ix, k[1], DEV), None);
    assert_eq!(ix.runs.heap_bytes(), 0);
}

#[test]
fn spec_tier_example_and_cumulative_semantics() {
    // selection-api §7.3: A device 2; B device 1 + host 3 + disk 2; C host 4.
    let ix = Index::new();
    let local: Vec<u64> = (1..=8).collect();
    ix.store(wr(1), Tier::Device, None, &blocks(&[11, 12], &local[..2]))
        .unwrap();
    ix.store(wr(2), Tier::Device, None, &blocks(&[21], &local[..1]))
        .unwrap();
    ix.store(
        wr(2),
        Tier::HostPinned,
        Some(21),
        &blocks(&[22, 23, 24], &local[1..4]),
    )
    .unwrap();
    ix.store(wr(2), Tier::Disk, Some(24), &blocks(&[25], &local[4..5]))
        .unwrap();
    ix.store(
        wr(2),
        Tier::External,
        Some(25),
        &blocks(&[26], &local[5..6]),
    )
    .unwrap();
    ix.store(
        wr(3),
        Tier::HostPinned,
        None,
        &blocks(&[31, 32, 33, 34], &local[..4]),
    )
    .unwrap();
    assert_eq!(
        ov(&ix, &local),
        vec![
            (wr(1), o(2, 0, 0)),
            (wr(2), o(1, 3, 2)),
            (wr(3), o(0, 4, 0))
        ]
    );
    // kv-events §5.7: removing the GPU copy of a chain also on CPU -> (0, 4, 4)
    let ix = Index::new();
    ix.store(
        wr(1),
        Tier::Device,
        None,
        &blocks(&[1, 2, 3, 4], &local[..4]),
    )
    .unwrap();
    ix.store(
        wr(1),
        Tier::HostPinned,
        None,
        &blocks(&[1, 2, 3, 4], &local[..4]),
    )
    .unwrap();
    assert_eq!(ov(&ix, &local[..4]), vec![(wr(1), o(4, 0, 0))]);
    assert_eq!(ix.remove(wr(1), Tier::Device, &[1, 2, 3, 4]), 4);
    assert_eq!(ov(&ix, &local[..4]), vec![(wr(1), o(0, 4, 0))]);
}

#[test]
fn store_errors_and_idempotence() {
    let ix = Index::new();
    let b = blocks(&[1, 2, 3], &[10, 20, 30]);
    assert_eq!(
        ix.store(wr(1), Tier::Device, Some(9), &b),
        Err(StoreError::UnknownParent)
    );
    assert_eq!(
        ix.store(wr(1), Tier::Device, None, &blocks(&[1, 1], &[10, 20])),
        Err(StoreError::SelfReference)
    );
    assert_eq!(
        ix.store(wr(1), Tier::Device, Some(2), &blocks(&[1, 2], &[10, 20])),
        Err(StoreError::SelfReference)
    );
    assert_eq!(ix.stats().ranks, 0);
    assert_eq!(ix.store(wr(1), Tier::Device, None, &b), Ok(3));
    assert_eq!(ix.store(wr(1), Tier::Device, None, &b), Ok(0));
    assert_eq!(ix.stats().entries, 3);
    // The parent may live on another tier of the same rank only.
    assert_eq!(
        ix.store(wr(1), Tier::Disk, Some(3), &blocks(&[4], &[40])),
        Ok(1)
    );
    assert_eq!(
        ix.store(wr(2), Tier::Device, Some(3), &blocks(&[4], &[40])),
        Err(StoreError::UnknownParent)
    );
    assert_eq!(ov(&ix, &[10, 20, 30, 40]), vec![(wr(1), o(3, 0, 1))]);
}

#[test]
fn removing_a_root_hides_descendants_and_restoring_it_shows_them() {
    let ix = Index::new();
    ix.store(
        wr(1),
        Tier::Device,
        None,
        &blocks(&[1, 2, 3], &[10, 20, 30]),
    )
    .unwrap();
    ix.store(wr(2), Tier::Device, None, &blocks(&[7], &[10]))
        .unwrap();
    assert_eq!(ix.remove(wr(1), Tier::Device, &[1, 99]), 1);
    assert_eq!(ov(&ix, &[10, 20, 30]), vec![(wr(2), o(1, 0, 0))]);
    ix.store(wr(1), Tier::Device, None, &blocks(&[1], &[10]))
        .unwrap();
    assert_eq!(
        ov(&ix, &[10, 20, 30]),
        vec![(wr(1), o(3, 0, 0)), (wr(2), o(1, 0, 0))]
    );
}

#[test]
fn two_engine_hashes_for_one_block_need_two_removals() {
    let ix = Index::new();
    ix.store(wr(1), Tier::Device, None, &blocks(&[1], &[10]))
        .unwrap();
    assert_eq!(
        ix.store(wr(1), Tier::Device, None, &blocks(&[2], &[10])),
        Ok(1)
    );
    assert_eq!(ix.stats().entries, 1);
    ix.remove(wr(1), Tier::Device, &[1]);
    assert_eq!(ov(&ix, &[10]), vec![(wr(1), o(1, 0, 0))]);
    ix.remove(wr(1), Tier::Device, &[2]);
    assert_eq!(ov(&ix, &[10]), vec![]);
    assert_eq!(ix.stats().nodes, 0);
}

#[test]
fn clear_and_remove_worker_touch_only_their_ranks() {
    let ix = Index::new();
    let r0 = WorkerRank {
        worker_id: 5,
        dp_rank: 0,
    };
    let r1 = WorkerRank {
        worker_id: 5,
        dp_rank: 1,
    };
    for r in [r0, r1, wr(6)] {
        ix.store(r, Tier::Device, None, &blocks(&[1, 2], &[10, 20]))
            .unwrap();
        ix.store(r, Tier::Disk, None, &blocks(&[1, 2], &[10, 20]))
            .unwrap();
    }
    ix.clear(r0);
    assert_eq!(
        ov(&ix, &[10, 20]),
        vec![(r1, o(2, 0, 0)), (wr(6), o(2, 0, 0))]
    );
    ix.remove_worker(5);
    assert_eq!(ov(&ix, &[10, 20]), vec![(wr(6), o(2, 0, 0))]);
    ix.remove_worker(6);
    let s = ix.stats();
    assert_eq!((s.nodes, s.entries, s.ranks), (0, 0, 0));
}

#[test]
fn dump_lists_parents_before_children() {
    let ix = Index::new();
    ix.store(
        wr(200),
        Tier::Device,
        None,
        &blocks(&[1001, 1002, 1003], &[1, 2, 3]),
    )
    .unwrap();
    ix.store(wr(200), Tier::Device, Some(1001), &blocks(&[1102], &[5]))
        .unwrap();
    ix.store(
        wr(200),
        Tier::HostPinned,
        Some(1003),
        &blocks(&[2004], &[4]),
    )
    .unwrap();
    let d = ix.dump();
    assert_eq!(d.len(), 3);
    assert_eq!(d[0].parent_engine_hash, None);
    assert_eq!(d[0].blocks.len(), 3);
    assert_eq!(d[1].parent_engine_hash, Some(1001));
    assert_eq!(d[2].tier, Tier::HostPinned);
    assert_eq!(d[2].parent_engine_hash, Some(1003));
}

/// Workers 0..n each store the shared prefix `1..=len` on device (engine
/// hashes `w * 1000 + i`), then a suffix of 10 blocks of their own.
fn shared_prefix(ix: &Index, workers: std::ops::Range<u64>, len: u64) -> Vec<u64> {
    let prefix: Vec<u64> = (1..=len).collect();
    for w in workers {
        let engine: Vec<u64> = (1..=len).map(|i| w * 1000 + i).collect();
        ix.store(wr(w), Tier::Device, None, &blocks(&engine, &prefix))
            .unwrap();
        let sfx = suffix(w);
        let engine: Vec<u64> = (1..=10).map(|i| w * 1000 + 500 + i).collect();
        ix.store(
            wr(w),
            Tier::Device,
            Some(w * 1000 + len),
            &blocks(&engine, &sfx),
        )
        .unwrap();
    }
    prefix
}

fn suffix(w: u64) -> Vec<u64> {
    (0..10).map(|i| 100_000 + w * 100 + i).collect()
}

#[test]
fn a_shared_prefix_walk_starts_from_the_kept_state_while_it_is_current() {
    let ix = Index::new();
    let prefix = shared_prefix(&ix, 0..10, 70);
    let prompt = [prefix.clone(), suffix(0)].concat();
    let all = |w0: u32| -> Vec<(WorkerRank, Overlap)> {
        (0..10)
            .map(|w| (wr(w), o(if w == 0 { w0 } else { 70 }, 0, 0)))
            .collect()
    };
    assert_eq!(ov(&ix, &prompt), all(80));
    assert_eq!(ix.stats().prefix_memo_hits, 0);
    // The same prefix again (another worker's suffix): from the kept state.
    assert_eq!(
        ov(&ix, &[prefix.clone(), suffix(3)].concat())[3],
        (wr(3), o(80, 0, 0))
    );
    assert_eq!(ov(&ix, &prompt), all(80));
    assert_eq!(ix.stats().prefix_memo_hits, 2);
    // Three holders (the list form) are shared too.
    let three = Index::new();
    let p3 = shared_prefix(&three, 0..3, 70);
    ov(&three, &p3);
    assert_eq!(ov(&three, &p3).len(), 3);
    assert_eq!(three.stats().prefix_memo_hits, 1);
    // A shared node that falls back to two holders (inline) is a change too.
    assert_eq!(three.remove(wr(2), Tier::Device, &[2030]), 1);
    assert_eq!(ov(&three, &p3)[2], (wr(2), o(29, 0, 0)));
    // A prompt that is the prefix alone, or shorter than it.
    assert_eq!(ov(&ix, &prefix), all(70));
    assert_eq!(ov(&ix, &prefix[..66]).len(), 10);
    // A hole in one worker's copy of the prefix is seen at once.
    assert_eq!(ix.remove(wr(5), Tier::Device, &[5030]), 1);
    let got = ov(&ix, &prompt);
    assert_eq!(got[5], (wr(5), o(29, 0, 0)));
    assert_eq!(got[0], (wr(0), o(80, 0, 0)));
    // Its host copy counts on the host tier.
    ix.store(
        wr(5),
        Tier::HostPinned,
        None,
        &blocks(&[5901, 5902], &prefix[..2]),
    )
    .unwrap();
    let hosted: Vec<u64> = (3..=70).map(|i| 5900 + i).collect();
    ix.store(
        wr(5),
        Tier::HostPinned,
        Some(5902),
        &blocks(&hosted, &prefix[2..]),
    )
    .unwrap();
    assert_eq!(ov(&ix, &prompt)[5], (wr(5), o(29, 41, 0)));
    // A worker removed, and its slot reused by a worker that holds none of
    // the prefix: never credited with the old worker's blocks.
    let hits = ix.stats().prefix_memo_hits;
    assert_eq!(ov(&ix, &prompt), ov(&ix, &prompt));
    assert!(
        ix.stats().prefix_memo_hits > hits,
        "the state is kept again"
    );
    ix.remove_worker(9);
    ix.store(wr(42), Tier::Device, None, &blocks(&[1], &[777]))
        .unwrap();
    let got = ov(&ix, &prompt);
    assert_eq!(got.len(), 9);
    assert!(got
        .iter()
        .all(|(w, _)| w.worker_id != 9 && w.worker_id != 42));
    // Two holders keep their blocks inline, as a session's history: no state
    // is kept.
    let small = Index::new();
    let prefix = shared_prefix(&small, 0..2, 70);
    ov(&small, &prefix);
    ov(&small, &prefix);
    assert_eq!(small.stats().prefix_memo_hits, 0);
}

/// One change to the index in the prefix memo's property test.
#[derive(Debug, Clone)]
enum PrefixOp {
    /// Worker `w` drops prefix block `i` from `tier`.
    Remove { w: u64, tier: usize, i: u64 },
    /// Worker `w` stores prefix blocks `from..from + n` on `tier`, chained
    /// under block `from - 1` (refused when that is not there).
    Store {
        w: u64,
        tier: usize,
        from: u64,
        n: u64,
    },
    /// Worker `w` is removed; it stores its whole prefix again later only
    /// through `Store`.
    Clear { w: u64 },
}

fn prefix_op() -> impl proptest::strategy::Strategy<Value = PrefixOp> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (0..12u64, 0..3usize, 1..=70u64).prop_map(|(w, tier, i)| PrefixOp::Remove { w, tier, i }),
        4 => (0..12u64, 0..3usize, 1..=70u64, 1..70u64).prop_map(|(w, tier, from, n)| PrefixOp::Store {
            w,
            tier,
            from,
            n: n.min(71 - from),
        }),
        1 => (0..12u64).prop_map(|w| PrefixOp::Clear { w }),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Whatever changes the prefix goes through, a walk that starts from a
    /// kept state answers what a walk from the root answers.
    #[test]
    fn the_prefix_memo_never_changes_an_answer(
        workers in proptest::prop_oneof![proptest::strategy::Just(4u64), proptest::strategy::Just(12)],
        ops in proptest::collection::vec(prefix_op(), 1..40),
    ) {
        // 4 workers hold the prefix in the list form, 12 in the bitset form.
        let memo = Index::new();
        let reference = Index::without_prefix_memo();
        let prefix = shared_prefix(&memo, 0..workers, 70);
        shared_prefix(&reference, 0..workers, 70);
        let tiers = [Tier::Device, Tier::HostPinned, Tier::Disk];
        let prompts = [
            [prefix.clone(), suffix(0)].concat(),
            [prefix.clone(), suffix(7)].concat(),
            prefix.clone(),
            prefix[..66].to_vec(),
        ];
        for p in &prompts {
            proptest::prop_assert_eq!(ov(&memo, p), ov(&reference, p));
        }
        for op in ops {
            for ix in [&memo, &reference] {
                match op {
                    PrefixOp::Remove { w, tier, i } => {
                        ix.remove(wr(w), tiers[tier], &[w * 1000 + i]);
                    }
                    PrefixOp::Store { w, tier, from, n } => {
                        let local: Vec<u64> = (from..from + n).collect();
                        let engine: Vec<u64> = local.iter().map(|i| w * 1000 + i).collect();
                        let parent = (from > 1).then(|| w * 1000 + from - 1);
                        let _ = ix.store(wr(w), tiers[tier], parent, &blocks(&engine, &local));
                    }
                    PrefixOp::Clear { w } => ix.clear(wr(w)),
                }
            }
            for p in &prompts {
                proptest::prop_assert_eq!(ov(&memo, p), ov(&reference, p));
            }
        }
        proptest::prop_assert!(memo.stats().prefix_memo_hits > 0);
    }
}
