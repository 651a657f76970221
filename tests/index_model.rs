//! Model-based property test of the KV index: random stores, removals, clears
//! and worker removals applied to both `Index` and a plain `HashMap` model
//! (obviously correct, no sharing, no bitsets) must give the same store and
//! remove results and the same overlap answers. A second property checks that
//! /dump, loaded into a fresh index, answers the same overlaps.

use std::collections::HashMap;

use kvselect::hash::{chain, sequence_hashes, PUBLIC_SEED};
use kvselect::index::dump::{chains_json, load, parse_partition};
use kvselect::index::{Index, Overlap, StoreError, StoredBlock, Tier, WorkerRank};
use proptest::prelude::*;

/// (worker, rank, tier) -> engine hash -> node key (the public chain hash).
#[derive(Default)]
struct Model {
    m: HashMap<(WorkerRank, Tier), HashMap<u64, u64>>,
}

impl Model {
    fn find(&self, wr: WorkerRank, tier: Tier, engine: u64) -> Option<u64> {
        let order = std::iter::once(tier).chain(Tier::ALL.into_iter().filter(|&t| t != tier));
        for t in order {
            if let Some(k) = self.m.get(&(wr, t)).and_then(|m| m.get(&engine)) {
                return Some(*k);
            }
        }
        None
    }

    fn store(
        &mut self,
        wr: WorkerRank,
        tier: Tier,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<usize, StoreError> {
        for (i, b) in blocks.iter().enumerate() {
            if Some(b.engine_hash) == parent
                || blocks[..i].iter().any(|c| c.engine_hash == b.engine_hash)
            {
                return Err(StoreError::SelfReference);
            }
        }
        let mut prev = match parent {
            None => None,
            Some(p) => Some(self.find(wr, tier, p).ok_or(StoreError::UnknownParent)?),
        };
        let mut n = 0;
        for b in blocks {
            let key = match prev {
                None => b.local_hash,
                Some(p) => chain(p, b.local_hash, PUBLIC_SEED),
            };
            let m = self.m.entry((wr, tier)).or_default();
            if m.insert(b.engine_hash, key) != Some(key) {
                n += 1;
            }
            prev = Some(key);
        }
        Ok(n)
    }

    fn remove(&mut self, wr: WorkerRank, tier: Tier, engines: &[u64]) -> usize {
        let Some(m) = self.m.get_mut(&(wr, tier)) else {
            return 0;
        };
        engines.iter().filter(|e| m.remove(e).is_some()).count()
    }

    fn clear(&mut self, wr: WorkerRank) {
        self.m.retain(|(w, _), _| *w != wr);
    }

    fn remove_worker(&mut self, id: u64) {
        self.m.retain(|(w, _), _| w.worker_id != id);
    }

    fn holds(&self, wr: WorkerRank, tiers: &[Tier], key: u64) -> bool {
        tiers.iter().any(|t| {
            self.m
                .get(&(wr, *t))
                .is_some_and(|m| m.values().any(|&k| k == key))
        })
    }

    fn overlap(&self, keys: &[u64]) -> Vec<(WorkerRank, Overlap)> {
        let mut wrs: Vec<WorkerRank> = self.m.keys().map(|(w, _)| *w).collect();
        wrs.sort();
        wrs.dedup();
        let mut out = Vec::new();
        for wr in wrs {
            let depth = |tiers: &[Tier]| {
                keys.iter()
                    .take_while(|&&k| self.holds(wr, tiers, k))
                    .count() as u32
            };
            let d = depth(&[Tier::Device]);
            let h = depth(&[Tier::Device, Tier::HostPinned]);
            let a = depth(&Tier::ALL);
            if a > 0 {
                out.push((
                    wr,
                    Overlap {
                        device: d,
                        host_ext: h - d,
                        disk_ext: a - h,
                    },
                ));
            }
        }
        out
    }
}

#[derive(Debug, Clone)]
enum Op {
    Store {
        wr: WorkerRank,
        tier: Tier,
        parent: Option<u64>,
        blocks: Vec<StoredBlock>,
    },
    Remove {
        wr: WorkerRank,
        tier: Tier,
        engines: Vec<u64>,
    },
    Clear(WorkerRank),
    RemoveWorker(u64),
    Check(Vec<u64>),
}

fn tier() -> impl Strategy<Value = Tier> {
    prop::sample::select(Tier::ALL.to_vec())
}

/// Small alphabets on purpose: shared prefixes, reused engine hashes,
/// engine hashes naming different blocks on different tiers.
fn op(
    workers: u64,
    ranks: u32,
    engines: u64,
    parent_p: f64,
    locals: u64,
) -> impl Strategy<Value = Op> {
    let wr =
        (0..workers, 0..ranks).prop_map(|(worker_id, dp_rank)| WorkerRank { worker_id, dp_rank });
    let block = (0..engines, 1..1 + locals).prop_map(|(engine_hash, local_hash)| StoredBlock {
        engine_hash,
        local_hash,
    });
    prop_oneof![
        6 => (wr.clone(), tier(), prop::option::weighted(parent_p, 0..engines),
              prop::collection::vec(block, 0..6))
            .prop_map(|(wr, tier, parent, blocks)| Op::Store { wr, tier, parent, blocks }),
        2 => (wr.clone(), tier(), prop::collection::vec(0..engines, 0..4))
            .prop_map(|(wr, tier, engines)| Op::Remove { wr, tier, engines }),
        1 => wr.prop_map(Op::Clear),
        1 => (0..workers).prop_map(Op::RemoveWorker),
        3 => prop::collection::vec(1..4u64, 1..8).prop_map(Op::Check),
    ]
}

/// Long stores (runs: `MIN_RUN` = 32 blocks and more) along a few shared
/// paths (ones, then twos), removals that punch holes into them, and checks
/// along the same paths, on few ranks (so walks reach single-holder stretches).
fn long_op() -> impl Strategy<Value = Op> {
    let wr = (0..2u64).prop_map(|worker_id| WorkerRank {
        worker_id,
        dp_rank: 0,
    });
    let tier = || prop::sample::select(vec![Tier::Device, Tier::HostPinned]);
    let path = |ones: usize, twos: usize| -> Vec<u64> {
        std::iter::repeat_n(1, ones)
            .chain(std::iter::repeat_n(2, twos))
            .collect()
    };
    prop_oneof![
        4 => (wr.clone(), tier(), 0..120u64, 0..90usize, 0..60usize, prop::option::weighted(0.3, 0..120u64))
            .prop_filter_map("a long store", move |(wr, tier, base, ones, twos, parent)| {
                let local = path(ones, twos);
                (local.len() >= 32).then(|| Op::Store {
                    wr,
                    tier,
                    // Distinct within the store; not its parent.
                    parent: parent.filter(|&p| (p + 120 - base) % 120 >= local.len() as u64),
                    blocks: local
                        .iter()
                        .enumerate()
                        .map(|(i, &l)| StoredBlock { engine_hash: (base + i as u64) % 120, local_hash: l })
                        .collect(),
                })
            }),
        3 => (wr.clone(), tier(), prop::collection::vec(0..120u64, 1..6))
            .prop_map(|(wr, tier, engines)| Op::Remove { wr, tier, engines }),
        1 => wr.prop_map(Op::Clear),
        4 => (0..100usize, 0..70usize).prop_map(move |(ones, twos)| Op::Check(path(ones, twos))),
    ]
}

fn keys(local: &[u64]) -> Vec<u64> {
    let mut k = Vec::new();
    sequence_hashes(local, PUBLIC_SEED, &mut k);
    k
}

fn sorted(ix: &Index, keys: &[u64]) -> Vec<(WorkerRank, Overlap)> {
    let mut out = vec![(
        WorkerRank {
            worker_id: 999,
            dp_rank: 9,
        },
        Overlap::default(),
    )];
    ix.overlap(keys, &mut out);
    out.sort_by_key(|x| x.0);
    out
}

/// Every prompt of the alphabet up to length 4, plus a long one.
fn probe_prompts() -> Vec<Vec<u64>> {
    let mut all: Vec<Vec<u64>> = vec![vec![]];
    let mut frontier: Vec<Vec<u64>> = vec![vec![]];
    for _ in 0..4 {
        let mut next = Vec::new();
        for p in &frontier {
            for l in 1..4u64 {
                let mut q = p.clone();
                q.push(l);
                next.push(q);
            }
        }
        all.extend(next.iter().cloned());
        frontier = next;
    }
    all.push(vec![1, 2, 3, 1, 2, 3, 1, 2]);
    all
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let ix = Index::new();
    let mut model = Model::default();
    for op in &ops {
        match op {
            Op::Store {
                wr,
                tier,
                parent,
                blocks,
            } => {
                let got = ix.store(*wr, *tier, *parent, blocks);
                let want = model.store(*wr, *tier, *parent, blocks);
                prop_assert_eq!(got, want, "{:?}", op);
            }
            Op::Remove { wr, tier, engines } => {
                prop_assert_eq!(
                    ix.remove(*wr, *tier, engines),
                    model.remove(*wr, *tier, engines)
                );
            }
            Op::Clear(wr) => {
                ix.clear(*wr);
                model.clear(*wr);
            }
            Op::RemoveWorker(id) => {
                ix.remove_worker(*id);
                model.remove_worker(*id);
            }
            Op::Check(local) => {
                let k = keys(local);
                prop_assert_eq!(sorted(&ix, &k), model.overlap(&k), "{:?}", local);
            }
        }
    }
    for p in probe_prompts() {
        let k = keys(&p);
        prop_assert_eq!(sorted(&ix, &k), model.overlap(&k), "{:?}", p);
    }
    let entries: usize = model
        .m
        .values()
        .map(|m| {
            let mut v: Vec<u64> = m.values().copied().collect();
            v.sort();
            v.dedup();
            v.len()
        })
        .sum();
    prop_assert_eq!(ix.stats().entries, entries);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Few ranks: inline and sparse holder sets, pathological engine hashes.
    #[test]
    fn index_matches_model_few_ranks(ops in prop::collection::vec(op(3, 2, 10, 0.6, 3), 1..60)) {
        run(ops)?;
    }

    /// Long chains: the overlap walk passes whole runs in one step; holes,
    /// shared blocks and tier changes must stop it where the model stops.
    #[test]
    fn index_matches_model_long_chains(ops in prop::collection::vec(long_op(), 1..40)) {
        run(ops)?;
    }

    /// Many ranks on few blocks: holder sets go dense and back.
    #[test]
    fn index_matches_model_many_ranks(ops in prop::collection::vec(op(24, 1, 8, 0.15, 2), 1..300)) {
        run(ops)?;
    }

    /// /dump -> JSON -> load into a fresh index answers every probe the same,
    /// with engine hashes that, like a real engine's, name one block per rank.
    #[test]
    fn dump_round_trip_keeps_overlaps(
        stores in prop::collection::vec(
            (0..4u64, 0..2u32, tier(), prop::collection::vec(1..4u64, 1..6), 0..3usize),
            1..25),
        removals in prop::collection::vec((0..4u64, 0..2u32, tier(), prop::collection::vec(1..4u64, 1..4)), 0..6),
    ) {
        let ix = Index::new();
        // engine hash of a block = its key mixed with the worker rank
        let engine = |wr: WorkerRank, key: u64| key ^ (wr.worker_id << 40) ^ ((wr.dp_rank as u64) << 50);
        for (w, r, t, local, cut) in stores {
            let wr = WorkerRank { worker_id: w, dp_rank: r };
            let k = keys(&local);
            let cut = cut.min(k.len() - 1);
            let parent = (cut > 0).then(|| engine(wr, k[cut - 1]));
            let blocks: Vec<StoredBlock> = (cut..k.len())
                .map(|i| StoredBlock { engine_hash: engine(wr, k[i]), local_hash: local[i] })
                .collect();
            let _ = ix.store(wr, t, parent, &blocks);
        }
        for (w, r, t, local) in removals {
            let wr = WorkerRank { worker_id: w, dp_rank: r };
            let k = keys(&local);
            ix.remove(wr, t, &[engine(wr, *k.last().unwrap())]);
        }
        let text = chains_json(&ix.dump(), 16);
        let (bs, chains) = parse_partition(serde_json::from_str(&text).unwrap()).unwrap();
        prop_assert_eq!(bs, 16);
        let copy = Index::new();
        // Load in reverse to exercise the orphan retry.
        let mut rev = chains.clone();
        rev.reverse();
        let report = load(&copy, &rev);
        prop_assert_eq!(report.dropped, 0);
        for p in probe_prompts() {
            let k = keys(&p);
            prop_assert_eq!(sorted(&copy, &k), sorted(&ix, &k), "{:?}", p);
        }
        prop_assert_eq!(copy.stats().entries <= ix.stats().entries, true);
    }
}
