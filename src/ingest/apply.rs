//! Applying decoded batches to a partition's KV index.
//!
//! Owns: the per-listener rules between "an event was decoded" and "the index
//! changed" (`kv-events.md` §5.3-§5.7): attention-group filtering (including
//! kinds learnt from earlier stores), the block-size check, recomputing our
//! content hashes from the event's tokens (with its LoRA name, its cache salt
//! or the one inherited from its parent, and its `block_mm_infos`), and which
//! (worker, rank) an event lands on (the batch's `data_parallel_rank` wins
//! over the listener's rank). It does no I/O and keeps no sequence state.

use super::decode::{Group, KvBatch, KvEvent, Stored};
use crate::hash::{local_block_hashes, salt_term, seed_with_salt_term};
use crate::index::{Index, StoreError, StoredBlock, Tier, WorkerRank};
use std::collections::HashMap;

/// What applying batches did; plain counters, summed into the hub's atomics
/// once per batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyCounts {
    pub events_applied: u64,
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    pub clears: u64,
    /// Event `block_size` differs from the partition's.
    pub stores_dropped_block_size: u64,
    /// Full blocks of `token_ids` do not match the number of hashes.
    pub stores_dropped_shape: u64,
    /// A hash repeats within the store or equals its parent (the index
    /// refuses the cycle).
    pub stores_dropped_self_reference: u64,
    /// The parent engine hash is not indexed for this (worker, rank, tier).
    pub stores_dropped_unknown_parent: u64,
    /// Any other refusal by the index.
    pub stores_dropped_other: u64,
    /// Events of a non-main attention group (sliding window, mamba, ...).
    pub events_ignored_group: u64,
    pub events_dropped_unknown_medium: u64,
    pub events_dropped_non_local: u64,
    pub events_dropped_unknown_type: u64,
}

/// Per-listener application state.
#[derive(Debug)]
pub struct Applier {
    worker_id: u64,
    /// The rank the listener was registered for; used when a batch has none.
    dp_rank: u32,
    block_size: u32,
    /// Attention-group kinds taught by stores: `(group_idx, is_main)`. A later
    /// event carrying only `group_idx` (BlockRemoved has no kind) is judged by
    /// it. Hybrid models have a handful of groups, so a Vec beats a map.
    learnt_groups: Vec<(u32, bool)>,
    /// Every rank this listener has written to, so a restart or a stop can
    /// clear exactly those.
    ranks: Vec<u32>,
    /// The cache-salt term of every indexed block stored with a salt, by
    /// (rank, tier, engine hash). Dynamo 1.6.1 hashes a child store that
    /// names no salt (absent or `""`) with its parent's salt, generation after
    /// generation; its LoRA name is not inherited (verified, see
    /// ARCHITECTURE.md). Entries leave with their block (BlockRemoved, clear),
    /// and only salted blocks have one, so unsalted fleets pay nothing.
    salts: HashMap<(u32, Tier, u64), u64>,
    local: Vec<u64>,
    blocks: Vec<StoredBlock>,
    /// Engine hashes of a run of removals (reused).
    removed: Vec<u64>,
}

impl Applier {
    pub fn new(worker_id: u64, dp_rank: u32, block_size: u32) -> Applier {
        Applier {
            worker_id,
            dp_rank,
            block_size,
            learnt_groups: Vec::new(),
            ranks: vec![dp_rank],
            salts: HashMap::new(),
            local: Vec::new(),
            blocks: Vec::new(),
            removed: Vec::new(),
        }
    }

    pub fn worker_id(&self) -> u64 {
        self.worker_id
    }

    /// The ranks this listener has written to (its own rank first).
    pub fn ranks(&self) -> &[u32] {
        &self.ranks
    }

    /// Clears, on every tier, every rank this listener has fed: used when the
    /// engine restarted (its block ids start over) and when the listener stops.
    pub fn clear_all(&mut self, index: &Index) {
        for &r in &self.ranks {
            index.clear(WorkerRank {
                worker_id: self.worker_id,
                dp_rank: r,
            });
        }
        self.ranks.truncate(1);
        self.learnt_groups.clear();
        self.salts = HashMap::new();
    }

    fn rank_of(&mut self, batch: &KvBatch) -> WorkerRank {
        let dp_rank = batch.dp_rank.unwrap_or(self.dp_rank);
        if !self.ranks.contains(&dp_rank) {
            self.ranks.push(dp_rank);
        }
        WorkerRank {
            worker_id: self.worker_id,
            dp_rank,
        }
    }

    fn is_main(&mut self, g: &Group) -> bool {
        if let (Some(idx), Some(kind)) = (g.idx, g.kind) {
            let main = kind == super::decode::GroupKind::MainAttention;
            match self.learnt_groups.iter_mut().find(|(i, _)| *i == idx) {
                Some(e) => e.1 = main,
                None => self.learnt_groups.push((idx, main)),
            }
        }
        match g.is_main() {
            Some(m) => m,
            None => g
                .idx
                .is_some_and(|idx| self.learnt_groups.iter().any(|&(i, main)| i == idx && main)),
        }
    }

    /// Applies every event of `batch` in order.
    pub fn apply(&mut self, index: &Index, batch: &KvBatch, c: &mut ApplyCounts) {
        c.events_dropped_unknown_medium += batch.dropped.unknown_medium as u64;
        c.events_dropped_non_local += batch.dropped.non_local as u64;
        c.events_dropped_unknown_type += batch.dropped.unknown_type as u64;
        if batch.events.is_empty() {
            return;
        }
        let wr = self.rank_of(batch);
        let mut events = batch.events.iter().peekable();
        while let Some(ev) = events.next() {
            match ev {
                KvEvent::Stored(s) => {
                    if !self.is_main(&s.group) {
                        c.events_ignored_group += 1;
                        continue;
                    }
                    self.store(index, wr, s, c);
                }
                KvEvent::Removed(r) => {
                    if !self.is_main(&r.group) {
                        c.events_ignored_group += 1;
                        continue;
                    }
                    // vLLM sends one BlockRemoved per evicted block: the run
                    // of removals from this tier that follows is one index
                    // call (the same result, in the same order), which lets
                    // the index prefetch across them.
                    let mut hashes = std::mem::take(&mut self.removed);
                    hashes.clear();
                    hashes.extend_from_slice(&r.block_hashes);
                    c.events_applied += 1;
                    while let Some(KvEvent::Removed(next)) = events.peek() {
                        if next.medium != r.medium || !self.is_main(&next.group) {
                            break;
                        }
                        hashes.extend_from_slice(&next.block_hashes);
                        c.events_applied += 1;
                        events.next();
                    }
                    c.blocks_removed += index.remove(wr, r.medium, &hashes) as u64;
                    if !self.salts.is_empty() {
                        for &h in &hashes {
                            self.salts.remove(&(wr.dp_rank, r.medium, h));
                        }
                    }
                    self.removed = hashes;
                }
                KvEvent::Cleared => {
                    index.clear(wr);
                    if !self.salts.is_empty() {
                        self.salts.retain(|&(rank, _, _), _| rank != wr.dp_rank);
                    }
                    c.clears += 1;
                    c.events_applied += 1;
                }
            }
        }
    }

    fn store(&mut self, index: &Index, wr: WorkerRank, s: &Stored, c: &mut ApplyCounts) {
        if s.block_size != self.block_size {
            c.stores_dropped_block_size += 1;
            return;
        }
        let salt = s.cache_salt.as_deref().and_then(salt_term).or_else(|| {
            let parent = s.parent_hash?;
            if self.salts.is_empty() {
                return None;
            }
            // The parent on the store's own tier first, else on any tier (as
            // the index finds parents).
            std::iter::once(s.medium)
                .chain(Tier::ALL)
                .find_map(|t| self.salts.get(&(wr.dp_rank, t, parent)).copied())
        });
        self.local.clear();
        local_block_hashes(
            &s.token_ids,
            s.block_size,
            s.eagle,
            seed_with_salt_term(s.lora_name.as_deref(), salt),
            s.mm_hashes.as_deref(),
            &mut self.local,
        );
        if self.local.len() != s.block_hashes.len() {
            c.stores_dropped_shape += 1;
            return;
        }
        if s.block_hashes.is_empty() {
            c.events_applied += 1;
            return;
        }
        self.blocks.clear();
        self.blocks
            .extend(
                s.block_hashes
                    .iter()
                    .zip(&self.local)
                    .map(|(&engine_hash, &local_hash)| StoredBlock {
                        engine_hash,
                        local_hash,
                    }),
            );
        match index.store(wr, s.medium, s.parent_hash, &self.blocks) {
            Ok(n) => {
                c.blocks_stored += n as u64;
                c.events_applied += 1;
                if let Some(term) = salt {
                    for &h in &s.block_hashes {
                        self.salts.insert((wr.dp_rank, s.medium, h), term);
                    }
                }
            }
            Err(StoreError::UnknownParent) => c.stores_dropped_unknown_parent += 1,
            Err(StoreError::SelfReference) => c.stores_dropped_self_reference += 1,
            Err(StoreError::TooManyRanks) => c.stores_dropped_other += 1,
        }
    }
}
