//! The rank registry of one index: which (worker, dp rank) pairs have
//! state, their dense slot ids, and what each rank stored under which engine
//! hash.
//!
//! Owns: [`RankState`] (per tier engine hash -> node key, and the counts of
//! extra engine hashes naming a held key), the registry shards, the slot
//! table, and the lifecycle calls that create and retire ranks (`clear`,
//! `remove_worker`). Does not: change the node table except through
//! `Index::release`, or walk prompts.

use std::collections::BinaryHeap;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::holders::MAX_SLOT;
use super::{engine, shrink, FoldMap, Index, StoreError, WorkerRank, RANK_SHARDS};

/// Cache-line aligned so neighbouring shards' lock words do not share a line.
#[repr(align(128))]
#[derive(Default)]
pub(super) struct RankShard(pub(super) RwLock<FoldMap<WorkerRank, Arc<Mutex<RankState>>>>);

pub(super) struct RankState {
    pub(super) slot: u32,
    /// Set when the rank was cleared or removed; a store that raced with that
    /// retries with a fresh state.
    pub(super) dead: bool,
    /// Per tier: engine hash -> node key.
    pub(super) tiers: [engine::EngineMap; 4],
    /// (tier, key) -> number of engine hashes naming the key beyond the first.
    pub(super) dups: FoldMap<(u8, u64), u32>,
}

#[derive(Default)]
pub(super) struct Slots {
    pub(super) owners: Vec<Option<WorkerRank>>,
    /// Freed slots, lowest first, so bitsets stay short.
    pub(super) free: BinaryHeap<std::cmp::Reverse<u32>>,
}

/// Registry shard of a worker's ranks (all ranks of a worker share one, so
/// `remove_worker` locks one shard).
#[inline]
pub(super) fn rank_shard(worker_id: u64) -> usize {
    (crate::fold::mix(worker_id, 0) >> 32) as usize % RANK_SHARDS
}

impl Index {
    /// AllBlocksCleared: drops every tier of `wr`.
    pub fn clear(&self, wr: WorkerRank) {
        let taken = {
            let mut reg = self.ranks[rank_shard(wr.worker_id)].0.write();
            let r = reg.remove(&wr);
            shrink(&mut reg);
            r
        };
        if let Some(rank) = taken {
            self.retire(wr, &rank);
        }
    }

    /// Drops every rank and tier of a worker.
    pub fn remove_worker(&self, worker_id: u64) {
        let mut taken = Vec::new();
        {
            let mut reg = self.ranks[rank_shard(worker_id)].0.write();
            reg.retain(|wr, r| {
                if wr.worker_id == worker_id {
                    taken.push((*wr, r.clone()));
                    false
                } else {
                    true
                }
            });
            shrink(&mut reg);
        }
        for (wr, rank) in taken {
            self.retire(wr, &rank);
        }
    }

    /// Releases everything a rank (already out of the registry) holds, then
    /// its slot.
    pub(super) fn retire(&self, wr: WorkerRank, rank: &Mutex<RankState>) {
        let mut st = rank.lock();
        if st.dead {
            return;
        }
        st.dead = true;
        let RankState {
            slot, tiers, dups, ..
        } = &mut *st;
        for (t, m) in tiers.iter_mut().enumerate() {
            for (_, key) in std::mem::take(m).iter() {
                self.release(*slot, dups, t, key);
            }
        }
        *dups = FoldMap::default();
        let mut slots = self.slots.write();
        if slots.owners.get(*slot as usize) == Some(&Some(wr)) {
            slots.owners[*slot as usize] = None;
            slots.free.push(std::cmp::Reverse(*slot));
            if *slot as usize + 1 == slots.owners.len() {
                // Give the tail back so the table shrinks with the fleet.
                while slots.owners.last() == Some(&None) {
                    slots.owners.pop();
                }
                let len = slots.owners.len() as u32;
                slots.free.retain(|s| s.0 < len);
                if slots.owners.capacity() > 2 * slots.owners.len() + 16 {
                    slots.owners.shrink_to_fit();
                    slots.free.shrink_to_fit();
                }
            }
        }
    }

    pub(super) fn rank(&self, wr: WorkerRank) -> Option<Arc<Mutex<RankState>>> {
        self.ranks[rank_shard(wr.worker_id)]
            .0
            .read()
            .get(&wr)
            .cloned()
    }

    pub(super) fn rank_or_insert(
        &self,
        wr: WorkerRank,
    ) -> Result<Arc<Mutex<RankState>>, StoreError> {
        if let Some(r) = self.rank(wr) {
            return Ok(r);
        }
        let mut reg = self.ranks[rank_shard(wr.worker_id)].0.write();
        if let Some(r) = reg.get(&wr) {
            return Ok(r.clone());
        }
        let slot = {
            let mut slots = self.slots.write();
            let slot = match slots.free.pop() {
                Some(std::cmp::Reverse(s)) => s,
                None if slots.owners.len() as u64 > MAX_SLOT as u64 => {
                    return Err(StoreError::TooManyRanks)
                }
                None => {
                    slots.owners.push(None);
                    (slots.owners.len() - 1) as u32
                }
            };
            slots.owners[slot as usize] = Some(wr);
            slot
        };
        let r = Arc::new(Mutex::new(RankState {
            slot,
            dead: false,
            tiers: Default::default(),
            dups: FoldMap::default(),
        }));
        reg.insert(wr, r.clone());
        Ok(r)
    }
}

impl RankState {
    /// Where a store on tier `t` naming parent `engine` finds it: (tier, key).
    pub(super) fn resolve(&self, t: usize, engine: u64) -> Option<(usize, u64)> {
        std::iter::once(t)
            .chain((0..4).filter(|&u| u != t))
            .find_map(|u| self.tiers[u].get(&engine).map(|&k| (u, k)))
    }

    /// Node key of the block this rank stored as `engine`, looking in tier `t`
    /// first, then the other tiers in `Tier::ALL` order.
    pub(super) fn find(&self, t: usize, engine: u64) -> Option<u64> {
        self.tiers[t].get(&engine).copied().or_else(|| {
            (0..4)
                .filter(|&u| u != t)
                .find_map(|u| self.tiers[u].get(&engine).copied())
        })
    }
}
