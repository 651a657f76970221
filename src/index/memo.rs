//! The walk state after a prompt's leading shared blocks, kept for the next
//! walk of the same prefix.
//!
//! Most prompts of a fleet begin with blocks that many workers hold (a system
//! prompt, tool definitions): *shared* nodes, whose holders are in the list or
//! bitset form (three or more slots, `holders.rs`). Every walk probes them
//! again, and those probes miss the cache: in the paced seed profile (a
//! 16k-token prefix held by all 128 workers), 1,000 of a walk's 1,100 probes
//! were the prefix's, and they were most of the walk's time.
//!
//! An entry is the walk's state after its first `k` blocks, all of them shared
//! nodes, keyed by the public sequence key of block `k - 1` (which commits to
//! the whole prefix) and by the index's *shared epoch* when it was taken. The
//! epoch counts the changes to the holders of nodes that were or became
//! shared (`change_holders` in `mod.rs`, the one way holders change); the
//! nodes of a session's own history (one or two holders, inline) do not move
//! it. The state after blocks that are all shared depends only on those
//! nodes' holders, so an entry whose epoch is the current one is the state a
//! walk would reach now, and the walk goes on from block `k`. A slot is
//! reused only after its worker's blocks were all released (`ranks.rs`,
//! `retire`), which changed every shared node it held, so a state never
//! credits a new worker with an old one's blocks.
//!
//! Consistency: a walk reads the epoch before its first lock and offers its
//! state only if the epoch has not moved when it ends, so a change applied
//! during the walk leaves no entry; a change bumps the epoch under the shard's
//! write lock, after the holders changed. A walk that uses an entry while a
//! change is being applied is ordered before that change, as a walk that
//! reached that node a moment earlier would be.

use super::walk::Walk;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Shortest shared prefix worth an entry (blocks).
pub(crate) const MIN_BLOCKS: usize = 64;
/// Entries kept (distinct shared prefixes, for example one per system prompt),
/// most recently used first.
const ENTRIES: usize = 8;

struct Entry {
    /// Public sequence key of block `k - 1`.
    key: u64,
    k: usize,
    epoch: u64,
    walk: Walk,
}

#[derive(Default)]
pub(crate) struct PrefixMemo {
    epoch: AtomicU64,
    entries: Mutex<Vec<Entry>>,
    hits: AtomicU64,
    /// Tests compare against an index that never keeps a state.
    #[cfg(test)]
    pub(crate) off: bool,
}

impl PrefixMemo {
    /// The shared epoch now (read before a walk takes its first lock).
    #[inline]
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// A shared node's holders changed (called under its shard's write lock).
    #[inline]
    pub(crate) fn bump(&self) {
        self.epoch.fetch_add(1, Ordering::Release);
    }

    /// The longest entry of epoch `epoch` that `seq_keys` begins with: its
    /// length and a copy of its state.
    pub(crate) fn find(&self, seq_keys: &[u64], epoch: u64) -> Option<(usize, Walk)> {
        #[cfg(test)]
        if self.off {
            return None;
        }
        let mut entries = self.entries.lock();
        let i = entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.epoch == epoch && seq_keys.get(e.k.wrapping_sub(1)) == Some(&e.key))
            .max_by_key(|(_, e)| e.k)
            .map(|(i, _)| i)?;
        entries[..=i].rotate_right(1);
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some((entries[0].k, entries[0].walk.clone()))
    }

    /// Keeps `walk`, the state after the first `k` blocks of `seq_keys`
    /// (all shared), if the epoch is still `epoch`, the one read before the
    /// walk began.
    pub(crate) fn offer(&self, seq_keys: &[u64], k: usize, epoch: u64, walk: Walk) {
        debug_assert!(k >= 1 && k <= seq_keys.len());
        let key = seq_keys[k - 1];
        let mut entries = self.entries.lock();
        if self.epoch() != epoch {
            return;
        }
        // Entries of an older epoch are of no use any more.
        entries.retain(|e| e.epoch == epoch && e.key != key);
        entries.truncate(ENTRIES - 1);
        entries.insert(
            0,
            Entry {
                key,
                k,
                epoch,
                walk,
            },
        );
    }

    /// Walks that began from an entry.
    pub(crate) fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }
}
