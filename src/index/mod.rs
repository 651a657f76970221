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
//! Stores and removals know their blocks in advance, so they prefetch the
//! engine-map and node buckets of the block `WRITE_AHEAD` ahead; each node
//! shard publishes where its arrays are (`table::Hint`) so that this happens
//! before its lock is taken.
//! Lock order: rank registry shard -> rank -> node shard -> run records
//! (`runs.rs`: allocator -> segments); the slot table is taken alone.
//!
//! Files: this one holds the public types, stores, removals, the overlap
//! walk's driver and `stats`; `ranks.rs` the rank registry and slot table;
//! `table.rs` the node table; `engine.rs` the engine-hash maps;
//! `holders.rs` a node's holder set; `runs.rs` run records; `walk.rs` the
//! overlap arithmetic; `reconstruct.rs` the `/dump` walk; `dump.rs` the
//! /dump JSON; `tests.rs` the unit tests.

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
mod memo;
mod ranks;
mod reconstruct;
mod runs;
mod table;
mod walk;

pub mod dump;

use std::collections::HashMap;

use parking_lot::{RwLock, RwLockReadGuard};

use crate::fold::FoldBuild;
use crate::hash::{chain, PUBLIC_SEED};
use holders::{Change, Holders};
use ranks::{RankShard, RankState, Slots};

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
    /// Walks that began from a kept state of their shared prefix (`memo.rs`).
    pub prefix_memo_hits: u64,
}

const NODE_SHARD_BITS: u32 = 6;
const NODE_SHARDS: usize = 1 << NODE_SHARD_BITS;
const RANK_SHARDS: usize = 64;
/// Blocks walked per batch of held shard read locks.
const WALK_CHUNK: usize = 2048;
/// How many keys ahead the walk prefetches.
const PREFETCH_AHEAD: usize = 32;
/// How many blocks ahead a store or removal prefetches its engine-map and
/// node buckets (each block costs a few hundred ns, mostly those misses).
const WRITE_AHEAD: usize = 8;

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
struct NodeShard(RwLock<NodeTable>, table::Hint);

/// The KV index of one partition. `Send + Sync`; share it as `Arc<Index>`.
pub struct Index {
    nodes: Box<[NodeShard]>,
    ranks: Box<[RankShard]>,
    slots: RwLock<Slots>,
    runs: runs::Runs,
    memo: memo::PrefixMemo,
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
fn tier_bit(t: usize) -> u8 {
    1 << t
}

/// The one way the index changes a node's holders: any run tag comes off
/// first (the node is no longer as its run's store left it, `runs.rs`), then
/// `f` runs, the table's heap count follows the holders' allocation, and a
/// change to a node that was or became shared moves the prefix memo's epoch
/// (`memo.rs`).
fn change_holders(
    runs: &runs::Runs,
    memo: &memo::PrefixMemo,
    heap: &mut usize,
    holders: &mut Holders,
    f: impl FnOnce(&mut Holders) -> Change,
) -> Change {
    if let Some(old) = holders.untag() {
        runs.untagged(old);
    }
    let was_shared = holders.is_shared();
    let before = holders.heap_bytes();
    let change = f(holders);
    *heap = *heap + holders.heap_bytes() - before;
    if change == Change::Changed && (was_shared || holders.is_shared()) {
        memo.bump();
    }
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
            memo: memo::PrefixMemo::default(),
        }
    }

    /// An index that never keeps a walk's prefix state: the reference the
    /// prefix memo's tests compare against.
    #[cfg(test)]
    pub(crate) fn without_prefix_memo() -> Index {
        let mut ix = Index::new();
        ix.memo.off = true;
        ix
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
        // The keys first (a cheap dependent chain), so that the loop below
        // can prefetch the buckets of the blocks `WRITE_AHEAD` ahead.
        let keys: Vec<u64> = blocks
            .iter()
            .scan(prev, |p, b| {
                let key = p.map_or(b.local_hash, |p| chain(p, b.local_hash, PUBLIC_SEED));
                *p = Some(key);
                Some(key)
            })
            .collect();
        for (b, &key) in blocks.iter().zip(&keys).take(WRITE_AHEAD) {
            tiers[t].prefetch(b.engine_hash);
            self.prefetch_node(key);
        }
        let mut added = 0;
        // Long stores are cut into runs of at most MAX_RUN blocks (the last
        // one only if it has MIN_RUN blocks); see `runs.rs`.
        let mut run: Option<(u32, usize)> = None;
        let mut run_end = 0;
        for (i, (b, &key)) in blocks.iter().zip(&keys).enumerate() {
            if let Some((ahead, &ahead_key)) =
                blocks.get(i + WRITE_AHEAD).zip(keys.get(i + WRITE_AHEAD))
            {
                tiers[t].prefetch(ahead.engine_hash);
                self.prefetch_node(ahead_key);
            }
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

    #[inline]
    fn prefetch_node(&self, key: u64) {
        self.nodes[node_shard(key)].1.prefetch(key);
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
        let shard = &self.nodes[node_shard(key)];
        let mut g = shard.0.write();
        let table = &mut *g;
        let node = table.nodes.entry(key, local, parent);
        let change = change_holders(
            &self.runs,
            &self.memo,
            &mut table.heap,
            &mut node.holders,
            |h| h.set(slot, tier_bit(t)),
        );
        if let Some(tag) = tag {
            if node.holders.tag(tag) {
                self.runs.tagged(tag);
            }
        }
        shard.1.publish(&table.nodes);
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
        let shard = &self.nodes[node_shard(key)];
        let mut g = shard.0.write();
        let table = &mut *g;
        let heap = &mut table.heap;
        let change = table.nodes.update(key, |node| {
            change_holders(&self.runs, &self.memo, heap, &mut node.holders, |h| {
                h.clear(slot, tier_bit(t))
            })
        });
        shard.1.publish(&table.nodes);
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
        // Two passes, each prefetching `WRITE_AHEAD` ahead: the engine map
        // gives the node keys, then the nodes are released in the same
        // order (a release reads only `dups` and the node table, so the
        // result is that of one interleaved pass).
        let map = &mut tiers[t];
        for &h in engine_hashes.iter().take(WRITE_AHEAD) {
            map.prefetch(h);
        }
        let mut keys = Vec::with_capacity(engine_hashes.len());
        for (i, h) in engine_hashes.iter().enumerate() {
            if let Some(&ahead) = engine_hashes.get(i + WRITE_AHEAD) {
                map.prefetch(ahead);
            }
            keys.extend(map.remove(h));
        }
        map.shrink();
        for &key in keys.iter().take(WRITE_AHEAD) {
            self.prefetch_node(key);
        }
        for (i, &key) in keys.iter().enumerate() {
            if let Some(&ahead) = keys.get(i + WRITE_AHEAD) {
                self.prefetch_node(ahead);
            }
            self.release(*slot, dups, t, key);
        }
        keys.len()
    }

    /// Fills `out` (cleared first) with the overlap of every (worker, rank)
    /// matching at least one leading block of `seq_keys`, the request's public
    /// sequence-hash chain. Order of `out` is unspecified.
    pub fn overlap(&self, seq_keys: &[u64], out: &mut Vec<(WorkerRank, Overlap)>) {
        out.clear();
        // A kept state of the prompt's shared prefix, if one is current
        // (`memo.rs`): the walk goes on after it. Otherwise the walk counts
        // its leading shared blocks (`shared_run`) and keeps its state where
        // they end.
        let epoch = self.memo.epoch();
        let (mut walk, mut start, mut shared_run) = match self.memo.find(seq_keys, epoch) {
            Some((k, w)) => (w, k, usize::MAX),
            None => (walk::Walk::new(), 0, 0),
        };
        let mut kept: Option<(usize, walk::Walk)> = None;
        let mut walked = seq_keys.len();
        // Set once a single slot is left (typically the one worker holding a
        // long tail): then a block that slot holds on a good enough tier
        // needs no walk step at all, only one probe and one mask test.
        let mut single: Option<(u32, u8)> = walk.single();
        // Home bucket of each key of the chunk, computed in one pass (the
        // multiplies pipeline) that also takes the shard read locks needed.
        let mut homes: Vec<usize> = Vec::with_capacity(WALK_CHUNK.min(seq_keys.len()));
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
                if shared_run == start + j {
                    if node.is_some_and(|n| n.holders.is_shared()) {
                        shared_run += 1;
                    } else {
                        if shared_run >= memo::MIN_BLOCKS {
                            kept = Some((shared_run, walk.clone()));
                        }
                        shared_run = usize::MAX;
                    }
                }
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
        if shared_run == seq_keys.len() && shared_run >= memo::MIN_BLOCKS && !walk.done() {
            kept = Some((shared_run, walk.clone()));
        }
        if let Some((k, w)) = kept {
            self.memo.offer(seq_keys, k, epoch, w);
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

    /// Size figures (walks every shard briefly; not for the hot path).
    pub fn stats(&self) -> IndexStats {
        let mut s = IndexStats {
            bytes: self.runs.heap_bytes(),
            prefix_memo_hits: self.memo.hits(),
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

#[cfg(test)]
mod tests;
