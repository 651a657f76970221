//! The KV index of one partition (model_name, routing_group): which blocks each
//! (worker, dp rank) holds, per tier, and the overlap of a request with them.
//!
//! Owns: the node table, the per-rank engine-hash maps, the dense slot ids.
//! Does not: hash tokens (callers pass local hashes and the request's public
//! sequence-hash chain), decode events, or do I/O (see `dump` for the /dump
//! JSON, which is plain serde on the ops path).
//!
//! Layout:
//! - A *node* is one block position, keyed by the public sequence hash of its
//!   prefix: `key(root) = local`, `key(b) = hash::chain(key(parent), local,
//!   PUBLIC_SEED)`. Nodes live in a flat table split into `NODE_SHARDS`
//!   `RwLock` shards chosen by the key's high bits (the key is already a hash).
//!   A node stores its local hash, its parent's key (itself for a root) and its
//!   holders (`holders.rs`). A request's booking hashes are its lookup keys.
//! - Each (worker, rank) gets a dense slot id and a `RankState` behind its own
//!   mutex: per tier, engine hash -> node key (parent lookup and
//!   `BlockRemoved`), plus a count of extra engine hashes naming a key that is
//!   already held (so one removal does not drop a block still named twice).
//! - A store of `runs::MIN_RUN` blocks or more records *runs* (`runs.rs`), so
//!   that the walk passes a single-holder stretch of a prompt a run at a time.
//!
//! Locking: no global lock. A store locks its rank, then one node shard at a
//! time, for one block at a time (short write sections). An overlap walk takes
//! shard read locks lazily with `read_recursive` (so holding several can never
//! deadlock against a queued writer) and drops them all every `WALK_CHUNK`
//! blocks, so a writer waits at most one chunk. Guards never leave this module.
//! Lock order: rank registry shard -> rank -> node shard -> run records
//! (`runs.rs`: allocator -> segments); the slot table is taken alone.

/// One scheduling candidate: a worker's data-parallel rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerRank {
    pub worker_id: u64,
    pub dp_rank: u32,
}

/// Where a block lives. `External` counts with `Disk` in overlap answers but
/// keeps its own name in /dump.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Device,
    HostPinned,
    Disk,
    External,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Device, Tier::HostPinned, Tier::Disk, Tier::External];

    /// The name used by /dump's `storage_tier`.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::HostPinned => "host_pinned",
            Tier::Disk => "disk",
            Tier::External => "external",
        }
    }

    pub fn from_dump_name(s: &str) -> Option<Tier> {
        Tier::ALL.into_iter().find(|t| t.as_str() == s)
    }
}

/// One block of a store: the engine's opaque id and our content hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StoredBlock {
    pub engine_hash: u64,
    pub local_hash: u64,
}

/// Matched prefix of one (worker, rank), in blocks, with cumulative tiers:
/// `device` leading blocks on GPU; then `host_ext` more that are on GPU or
/// host; then `disk_ext` more on any tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overlap {
    pub device: u32,
    pub host_ext: u32,
    pub disk_ext: u32,
}

mod engine;
mod holders;
mod runs;
mod table;
mod walk;

pub mod dump;

use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};

use crate::fold::FoldBuild;
use crate::hash::{chain, PUBLIC_SEED};
use holders::{Change, Holders, MAX_SLOT};
#[cfg(test)]
use holders::{DEV, HOST};

/// Why a store was refused (nothing of it is indexed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    /// The parent engine hash is not held by that (worker, rank) on any tier.
    UnknownParent,
    /// The store repeats an engine hash, or repeats its parent.
    SelfReference,
    /// The partition already has 2^28 (worker, rank) pairs.
    TooManyRanks,
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StoreError::UnknownParent => "failed to find parent block; skipping store operation",
            StoreError::SelfReference => "self-referencing block",
            StoreError::TooManyRanks => "too many (worker, rank) pairs in this partition",
        })
    }
}

impl std::error::Error for StoreError {}

/// One chain of a /dump reconstruction: consecutive blocks of one (worker,
/// rank, tier), the first one's parent given by engine hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DumpChain {
    pub wr: WorkerRank,
    pub tier: Tier,
    pub parent_engine_hash: Option<u64>,
    pub blocks: Vec<StoredBlock>,
}

/// Size figures of one index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct block positions held by anyone.
    pub nodes: usize,
    /// (block, worker rank, tier) holdings.
    pub entries: usize,
    /// (worker, rank) pairs with state.
    pub ranks: usize,
    /// Approximate heap bytes (table capacities, holder lists, run records).
    pub bytes: usize,
}

const NODE_SHARD_BITS: u32 = 6;
const NODE_SHARDS: usize = 1 << NODE_SHARD_BITS;
const RANK_SHARDS: usize = 64;
/// Blocks walked per batch of held shard read locks.
const WALK_CHUNK: usize = 2048;
/// How many keys ahead the walk prefetches.
const PREFETCH_AHEAD: usize = 32;

/// Maps keyed by hashes or small ids (`crate::fold`).
type FoldMap<K, V> = HashMap<K, V, FoldBuild>;

#[derive(Default)]
struct NodeTable {
    nodes: table::NodeTable,
    entries: usize,
    heap: usize,
}

/// Cache-line aligned so neighbouring shards' lock words do not share a line.
#[repr(align(128))]
#[derive(Default)]
struct NodeShard(RwLock<NodeTable>);

#[repr(align(128))]
#[derive(Default)]
struct RankShard(RwLock<FoldMap<WorkerRank, Arc<Mutex<RankState>>>>);

struct RankState {
    slot: u32,
    /// Set when the rank was cleared or removed; a store that raced with that
    /// retries with a fresh state.
    dead: bool,
    /// Per tier: engine hash -> node key.
    tiers: [engine::EngineMap; 4],
    /// (tier, key) -> number of engine hashes naming the key beyond the first.
    dups: FoldMap<(u8, u64), u32>,
}

#[derive(Default)]
struct Slots {
    owners: Vec<Option<WorkerRank>>,
    /// Freed slots, lowest first, so bitsets stay short.
    free: BinaryHeap<std::cmp::Reverse<u32>>,
}

/// The KV index of one partition. `Send + Sync`; share it as `Arc<Index>`.
pub struct Index {
    nodes: Box<[NodeShard]>,
    ranks: Box<[RankShard]>,
    slots: RwLock<Slots>,
    runs: runs::Runs,
}

impl Default for Index {
    fn default() -> Self {
        Index::new()
    }
}

#[inline]
fn node_shard(key: u64) -> usize {
    (key >> (64 - NODE_SHARD_BITS)) as usize
}

#[inline]
fn rank_shard(worker_id: u64) -> usize {
    (crate::fold::mix(worker_id, 0) >> 32) as usize % RANK_SHARDS
}

#[inline]
fn tier_bit(t: usize) -> u8 {
    1 << t
}

/// The one way the index changes a node's holders: any run tag comes off
/// first (the node is no longer as its run's store left it, `runs.rs`), then
/// `f` runs, and the table's heap count follows the holders' allocation.
fn change_holders(
    runs: &runs::Runs,
    heap: &mut usize,
    holders: &mut Holders,
    f: impl FnOnce(&mut Holders) -> Change,
) -> Change {
    if let Some(old) = holders.untag() {
        runs.untagged(old);
    }
    let before = holders.heap_bytes();
    let change = f(holders);
    *heap = *heap + holders.heap_bytes() - before;
    change
}

/// A store may not name one engine hash twice, nor its own parent.
fn check_self_reference(parent: Option<u64>, blocks: &[StoredBlock]) -> Result<(), StoreError> {
    if blocks.len() <= 32 {
        for (i, b) in blocks.iter().enumerate() {
            if Some(b.engine_hash) == parent
                || blocks[i + 1..]
                    .iter()
                    .any(|c| c.engine_hash == b.engine_hash)
            {
                return Err(StoreError::SelfReference);
            }
        }
        return Ok(());
    }
    let mut seen: Vec<u64> = blocks.iter().map(|b| b.engine_hash).collect();
    seen.sort_unstable();
    if seen.windows(2).any(|w| w[0] == w[1])
        || parent.is_some_and(|p| seen.binary_search(&p).is_ok())
    {
        return Err(StoreError::SelfReference);
    }
    Ok(())
}

fn shrink<K: Eq + std::hash::Hash, V>(m: &mut FoldMap<K, V>) {
    if m.is_empty() {
        if m.capacity() > 0 {
            *m = FoldMap::default();
        }
    } else if m.capacity() > 64 && m.len() * 4 < m.capacity() {
        m.shrink_to(m.len() * 2);
    }
}

impl Index {
    pub fn new() -> Index {
        Index {
            nodes: (0..NODE_SHARDS).map(|_| NodeShard::default()).collect(),
            ranks: (0..RANK_SHARDS).map(|_| RankShard::default()).collect(),
            slots: RwLock::new(Slots::default()),
            runs: runs::Runs::default(),
        }
    }

    /// Indexes a chain of blocks stored by `wr` on `tier` under the block with
    /// engine hash `parent_engine_hash` (`None`: from the root). Returns how
    /// many blocks were newly indexed (an engine hash already naming the same
    /// block counts 0).
    pub fn store(
        &self,
        wr: WorkerRank,
        tier: Tier,
        parent_engine_hash: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<usize, StoreError> {
        check_self_reference(parent_engine_hash, blocks)?;
        loop {
            let rank = match parent_engine_hash {
                // A child store needs an existing rank; don't create one only
                // to refuse it.
                Some(_) => self.rank(wr).ok_or(StoreError::UnknownParent)?,
                None if blocks.is_empty() => return Ok(0),
                None => self.rank_or_insert(wr)?,
            };
            let mut st = rank.lock();
            if st.dead {
                continue;
            }
            return self.store_locked(&mut st, tier as usize, parent_engine_hash, blocks);
        }
    }

    fn store_locked(
        &self,
        st: &mut RankState,
        t: usize,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<usize, StoreError> {
        let mut prev = match parent {
            None => None,
            Some(p) => Some(st.find(t, p).ok_or(StoreError::UnknownParent)?),
        };
        let RankState {
            slot, tiers, dups, ..
        } = st;
        let mut added = 0;
        // Long stores are cut into runs of at most MAX_RUN blocks (the last
        // one only if it has MIN_RUN blocks); see `runs.rs`.
        let mut run: Option<(u32, usize)> = None;
        let mut run_end = 0;
        for (i, b) in blocks.iter().enumerate() {
            let key = match prev {
                None => b.local_hash,
                Some(p) => chain(p, b.local_hash, PUBLIC_SEED),
            };
            if i == run_end && blocks.len() - i >= runs::MIN_RUN {
                run_end = (i + runs::MAX_RUN).min(blocks.len());
                run = self.runs.begin(run_end - i, tier_bit(t)).map(|id| (id, i));
            }
            let last_of_run = i + 1 == run_end;
            if let (Some((id, _)), true) = (run, last_of_run) {
                self.runs.last_key(id, key);
            }
            let tag = run.map(|(id, first)| runs::tag_of(id, i - first));
            let parent_key = prev.unwrap_or(key);
            match tiers[t].insert(b.engine_hash, key) {
                Some(old) if old == key => {}
                old => {
                    if let Some(old) = old {
                        self.release(*slot, dups, t, old);
                    }
                    self.acquire(*slot, dups, t, key, b.local_hash, parent_key, tag);
                    added += 1;
                }
            }
            prev = Some(key);
            if let (Some((id, _)), true) = (run, last_of_run) {
                self.runs.end(id);
                run = None;
            }
        }
        Ok(added)
    }

    #[allow(clippy::too_many_arguments)]
    fn acquire(
        &self,
        slot: u32,
        dups: &mut FoldMap<(u8, u64), u32>,
        t: usize,
        key: u64,
        local: u64,
        parent: u64,
        tag: Option<u32>,
    ) {
        let mut g = self.nodes[node_shard(key)].0.write();
        let table = &mut *g;
        let node = table.nodes.entry(key, local, parent);
        let change = change_holders(&self.runs, &mut table.heap, &mut node.holders, |h| {
            h.set(slot, tier_bit(t))
        });
        if let Some(tag) = tag {
            if node.holders.tag(tag) {
                self.runs.tagged(tag);
            }
        }
        if change == Change::Changed {
            table.entries += 1;
        } else {
            drop(g);
            *dups.entry((t as u8, key)).or_insert(0) += 1;
        }
    }

    fn release(&self, slot: u32, dups: &mut FoldMap<(u8, u64), u32>, t: usize, key: u64) {
        if let Some(c) = dups.get_mut(&(t as u8, key)) {
            *c -= 1;
            if *c == 0 {
                dups.remove(&(t as u8, key));
                shrink(dups);
            }
            return;
        }
        let mut g = self.nodes[node_shard(key)].0.write();
        let table = &mut *g;
        let heap = &mut table.heap;
        let change = table.nodes.update(key, |node| {
            change_holders(&self.runs, heap, &mut node.holders, |h| {
                h.clear(slot, tier_bit(t))
            })
        });
        if change == Some(Change::Changed) {
            table.entries -= 1;
        }
    }

    /// Unindexes blocks of `wr` on `tier` by engine hash; unknown hashes are
    /// ignored. Returns how many were removed. Descendants stay indexed but
    /// no walk from the root reaches them through a missing block.
    pub fn remove(&self, wr: WorkerRank, tier: Tier, engine_hashes: &[u64]) -> usize {
        let Some(rank) = self.rank(wr) else {
            return 0;
        };
        let mut st = rank.lock();
        if st.dead {
            return 0;
        }
        let t = tier as usize;
        let RankState {
            slot, tiers, dups, ..
        } = &mut *st;
        let mut n = 0;
        for h in engine_hashes {
            if let Some(key) = tiers[t].remove(h) {
                self.release(*slot, dups, t, key);
                n += 1;
            }
        }
        tiers[t].shrink();
        n
    }

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
    fn retire(&self, wr: WorkerRank, rank: &Mutex<RankState>) {
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

    fn rank(&self, wr: WorkerRank) -> Option<Arc<Mutex<RankState>>> {
        self.ranks[rank_shard(wr.worker_id)]
            .0
            .read()
            .get(&wr)
            .cloned()
    }

    fn rank_or_insert(&self, wr: WorkerRank) -> Result<Arc<Mutex<RankState>>, StoreError> {
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

    /// Fills `out` (cleared first) with the overlap of every (worker, rank)
    /// matching at least one leading block of `seq_keys`, the request's public
    /// sequence-hash chain. Order of `out` is unspecified.
    pub fn overlap(&self, seq_keys: &[u64], out: &mut Vec<(WorkerRank, Overlap)>) {
        out.clear();
        let mut walk = walk::Walk::new();
        let mut walked = seq_keys.len();
        // Set once a single slot is left (typically the one worker holding a
        // long tail): then a block that slot holds on a good enough tier
        // needs no walk step at all, only one probe and one mask test.
        let mut single: Option<(u32, u8)> = None;
        // Home bucket of each key of the chunk, computed in one pass (the
        // multiplies pipeline) that also takes the shard read locks needed.
        let mut homes: Vec<usize> = Vec::with_capacity(WALK_CHUNK.min(seq_keys.len()));
        let mut start = 0;
        // Chunks grow from 32 to WALK_CHUNK blocks, so a walk that ends early
        // does not pay for locking and hashing keys it never reaches.
        let mut chunk = 32;
        'chunks: while start < seq_keys.len() {
            let end = (start + chunk).min(seq_keys.len());
            chunk = (chunk * 4).min(WALK_CHUNK);
            let keys = &seq_keys[start..end];
            let mut guards: [Option<RwLockReadGuard<'_, NodeTable>>; NODE_SHARDS] =
                std::array::from_fn(|_| None);
            homes.clear();
            for (j, &key) in keys.iter().enumerate() {
                let s = node_shard(key);
                let g = guards[s].get_or_insert_with(|| self.nodes[s].0.read_recursive());
                let h = g.nodes.home_of(key);
                if j < PREFETCH_AHEAD {
                    table::prefetch_at(g.nodes.buckets(), h);
                }
                homes.push(h);
            }
            let tables: [&[table::Node]; NODE_SHARDS] =
                std::array::from_fn(|s| guards[s].as_ref().map_or(&[][..], |g| g.nodes.buckets()));
            for (j, &key) in keys.iter().enumerate() {
                // The keys are known in advance: fetch a later bucket while
                // this one is worked on (the walk is bound by cache misses).
                if let Some(&ahead) = keys.get(j + PREFETCH_AHEAD) {
                    table::prefetch_at(tables[node_shard(ahead)], homes[j + PREFETCH_AHEAD]);
                }
                let node = table::probe_likely(tables[node_shard(key)], homes[j], key);
                if let (Some((slot, need)), Some(n)) = (single, node) {
                    if n.holders.mask(slot) & need != 0 {
                        // Held inline by `slot` alone: a whole run it heads
                        // into (runs.rs) is passed in one step.
                        if let Some((more, last)) =
                            n.holders.run_tag().and_then(|t| self.runs.ahead(t, need))
                        {
                            let to = start + j + more;
                            if more > 0 && seq_keys.get(to) == Some(&last) {
                                // The next block is likely another run's
                                // head: a short chunk, so that few keys are
                                // hashed and prefetched for nothing.
                                start = to + 1;
                                chunk = 4;
                                continue 'chunks;
                            }
                        }
                        continue;
                    }
                }
                let i = start + j;
                walk.step(i as u32, node.map(|n| &n.holders));
                if walk.done() {
                    walked = i;
                    break 'chunks;
                }
                single = walk.single();
            }
            start = end;
        }
        walk.end(walked as u32);
        let slots = self.slots.read();
        walk.results(|slot, [device, host_ext, disk_ext]| {
            if let Some(Some(wr)) = slots.owners.get(slot as usize) {
                out.push((
                    *wr,
                    Overlap {
                        device,
                        host_ext,
                        disk_ext,
                    },
                ));
            }
        });
    }

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

    /// Size figures (walks every shard briefly; not for the hot path).
    pub fn stats(&self) -> IndexStats {
        let mut s = IndexStats {
            bytes: self.runs.heap_bytes(),
            ..IndexStats::default()
        };
        for sh in self.nodes.iter() {
            let g = sh.0.read();
            s.nodes += g.nodes.len();
            s.entries += g.entries;
            s.bytes += g.nodes.bucket_bytes() + g.heap;
        }
        let dup_bucket = std::mem::size_of::<((u8, u64), u32)>() + 1;
        let mut ranks = Vec::new();
        for sh in self.ranks.iter() {
            let g = sh.0.read();
            s.bytes += g.capacity() * (std::mem::size_of::<(WorkerRank, usize)>() + 1);
            ranks.extend(g.values().cloned());
        }
        for r in ranks {
            let st = r.lock();
            s.ranks += 1;
            s.bytes += std::mem::size_of::<RankState>() + 16;
            s.bytes += st.tiers.iter().map(|m| m.heap_bytes()).sum::<usize>();
            s.bytes += st.dups.capacity() * dup_bucket;
        }
        let slots = self.slots.read();
        s.bytes += slots.owners.capacity() * std::mem::size_of::<Option<WorkerRank>>()
            + slots.free.capacity() * 4;
        s
    }
}

impl RankState {
    /// Where a store on tier `t` naming parent `engine` finds it: (tier, key).
    fn resolve(&self, t: usize, engine: u64) -> Option<(usize, u64)> {
        std::iter::once(t)
            .chain((0..4).filter(|&u| u != t))
            .find_map(|u| self.tiers[u].get(&engine).map(|&k| (u, k)))
    }

    /// Node key of the block this rank stored as `engine`, looking in tier `t`
    /// first, then the other tiers in `Tier::ALL` order.
    fn find(&self, t: usize, engine: u64) -> Option<u64> {
        self.tiers[t].get(&engine).copied().or_else(|| {
            (0..4)
                .filter(|&u| u != t)
                .find_map(|u| self.tiers[u].get(&engine).copied())
        })
    }
}

#[cfg(test)]
mod tests {
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
}
