//! The `/dump` walk: the index read back as stored chains, per (worker,
//! rank, tier), parents before children, each chain's first parent named by
//! an engine hash that a store's parent lookup resolves to the same block.
//!
//! Owns: [`Index::dump`]. Does not: format JSON or load a dump (`dump.rs`),
//! or run on the hot path (it locks each rank and node shard in turn).

use std::sync::Arc;

use parking_lot::Mutex;

use super::ranks::RankState;
use super::{node_shard, DumpChain, FoldMap, Index, StoredBlock, Tier, WorkerRank};

impl Index {
    /// Reconstruction of the index as stored chains, for GET /dump: per
    /// (worker, rank, tier), parents before children within a tier (a chain
    /// may name a parent held on another tier of the same rank). Blocks whose
    /// parent the rank no longer holds are left out: no walk reaches them.
    pub fn dump(&self) -> Vec<DumpChain> {
        let mut ranks: Vec<(WorkerRank, Arc<Mutex<RankState>>)> = Vec::new();
        for sh in self.ranks.iter() {
            ranks.extend(sh.0.read().iter().map(|(wr, r)| (*wr, r.clone())));
        }
        ranks.sort_by_key(|(wr, _)| *wr);
        let mut out = Vec::new();
        for (wr, rank) in ranks {
            let st = rank.lock();
            if st.dead {
                continue;
            }
            self.dump_rank(wr, &st, &mut out);
        }
        out
    }

    fn dump_rank(&self, wr: WorkerRank, st: &RankState, out: &mut Vec<DumpChain>) {
        // key -> engine hash, per tier (first engine hash wins for dups).
        let mut rev: [FoldMap<u64, u64>; 4] = Default::default();
        for (t, m) in st.tiers.iter().enumerate() {
            for (e, k) in m.iter() {
                rev[t].entry(k).or_insert(e);
            }
        }
        // Per tier: engine -> (local hash, parent as (tier it resolves on,
        // engine hash)). Blocks whose parent the rank no longer holds are
        // left out.
        type Info = FoldMap<u64, (u64, Option<(usize, u64)>)>;
        let mut info: [Info; 4] = Default::default();
        for (t, m) in st.tiers.iter().enumerate() {
            for (e, k) in m.iter() {
                let Some((local, parent_key)) = self.node_info(k) else {
                    continue;
                };
                let parent = if parent_key == k {
                    None
                } else {
                    // Name the parent by an engine hash that a store's parent
                    // lookup (this tier first) resolves to that very key.
                    let cand = std::iter::once(t)
                        .chain((0..4).filter(|&u| u != t))
                        .filter_map(|u| rev[u].get(&parent_key).copied())
                        .find_map(|pe| match st.resolve(t, pe) {
                            Some((u, k)) if k == parent_key => Some((u, pe)),
                            _ => None,
                        });
                    match cand {
                        Some(p) => Some(p),
                        None => continue,
                    }
                };
                info[t].insert(e, (local, parent));
            }
        }
        // Keep only blocks whose whole ancestry is dumped, so a loader can
        // apply every chain.
        let mut ok: [FoldMap<u64, bool>; 4] = Default::default();
        for t in 0..4 {
            for &e in info[t].keys() {
                let mut path = Vec::new();
                let mut cur = (t, e);
                let verdict = loop {
                    if let Some(&v) = ok[cur.0].get(&cur.1) {
                        break v;
                    }
                    if path.contains(&cur) || path.len() > 1 << 20 {
                        break false;
                    }
                    path.push(cur);
                    match info[cur.0].get(&cur.1) {
                        None => break false,
                        Some((_, None)) => break true,
                        Some((_, Some(p))) => cur = *p,
                    }
                };
                for p in path {
                    ok[p.0].insert(p.1, verdict);
                }
            }
        }
        for (t, tier) in Tier::ALL.into_iter().enumerate() {
            let mut children: FoldMap<u64, Vec<u64>> = FoldMap::default();
            let mut starts: Vec<u64> = Vec::new();
            for (&e, &(_, parent)) in &info[t] {
                if ok[t].get(&e) != Some(&true) {
                    continue;
                }
                match parent {
                    Some((u, pe)) if u == t => children.entry(pe).or_default().push(e),
                    _ => starts.push(e),
                }
            }
            starts.sort_unstable();
            let mut stack: Vec<(Option<u64>, u64)> = starts
                .iter()
                .rev()
                .map(|&e| (info[t][&e].1.map(|(_, p)| p), e))
                .collect();
            while let Some((parent, first)) = stack.pop() {
                let mut blocks = Vec::new();
                let mut cur = Some(first);
                while let Some(e) = cur {
                    blocks.push(StoredBlock {
                        engine_hash: e,
                        local_hash: info[t][&e].0,
                    });
                    cur = None;
                    if let Some(kids) = children.get_mut(&e) {
                        kids.sort_unstable();
                        for &k in kids.iter().skip(1).rev() {
                            stack.push((Some(e), k));
                        }
                        cur = kids.first().copied();
                    }
                }
                out.push(DumpChain {
                    wr,
                    tier,
                    parent_engine_hash: parent,
                    blocks,
                });
            }
        }
    }

    fn node_info(&self, key: u64) -> Option<(u64, u64)> {
        let g = self.nodes[node_shard(key)].0.read();
        g.nodes.info(key)
    }
}
