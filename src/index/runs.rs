//! Runs: the chain of blocks one `BlockStored` put on one (rank, tier),
//! recorded so that the overlap walk passes a long single-holder stretch of a
//! prompt with one check instead of one node probe per block (each probe is a
//! cache and TLB miss on a random page; an agentic session's history is
//! thousands of such blocks, held by its one worker).
//!
//! A run is `len` blocks (`MIN_RUN..=MAX_RUN`; longer stores make several
//! runs) with the key of its last block. Each of its nodes that is held
//! inline by exactly one slot carries a tag, (run id, offset in the run), in
//! its holder word (`Holders::tag`). Any later change to a tagged node's
//! holders first removes the tag (`Holders::untag`) and counts it off the run.
//! So a run whose `tagged` count equals its length has every block still held
//! exactly as the store left it: by that one slot, on the store's tier.
//!
//! The walk, at a node tagged (id, off) at prompt position `i`, may skip to
//! position `i + len - 1 - off` if the run is whole and the prompt's key
//! there is the run's last key. Keys are chain hashes (a key determines all
//! keys before it), so an equal last key means the prompt follows the run's
//! blocks from `i` on.
//!
//! Records are reused. A record is freed when its last tag is removed, not
//! before, so a tagged node always names a live record of its own run (the
//! walk reads a record only while it holds the read lock of such a node's
//! shard). The `CREATING` bit keeps a run that has no tag yet (in the middle
//! of its store) from being freed; `end` clears it. When no record is live
//! (so no node is tagged), the record segments are given back.
//!
//! Lock order: node shard -> `alloc` -> `segments`.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock};

use super::holders::MAX_TAG;

/// Stores shorter than this make no run (so short chains cost no memory).
pub(crate) const MIN_RUN: usize = 32;
/// Longest run (the offset has `OFF_BITS` bits).
pub(crate) const MAX_RUN: usize = 1 << OFF_BITS;
const OFF_BITS: u32 = 9;
/// Record ids: the tag's remaining bits.
const IDS: usize = (MAX_TAG as usize >> OFF_BITS) + 1;
const SEGMENT: usize = 1024;

/// `state` bits: length, tagged nodes, the store's tier bit, CREATING.
const LEN_MASK: u64 = 0xFFFF;
const TAGGED_ONE: u64 = 1 << 16;
const TIER_SHIFT: u32 = 32;
const CREATING: u64 = 1 << 40;

#[derive(Default)]
struct Record {
    last_key: AtomicU64,
    state: AtomicU64,
}

#[derive(Default)]
struct Alloc {
    next: u32,
    free: Vec<u32>,
}

#[derive(Default)]
pub(crate) struct Runs {
    /// Record `id` is `segments[id / SEGMENT][id % SEGMENT]`; ids are handed
    /// out densely, so segments are added at the end.
    segments: RwLock<Vec<Box<[Record]>>>,
    alloc: Mutex<Alloc>,
}

/// The tag of block `off` of run `id`.
#[inline]
pub(crate) fn tag_of(id: u32, off: usize) -> u32 {
    debug_assert!(off < MAX_RUN);
    id << OFF_BITS | off as u32
}

#[inline]
fn split(tag: u32) -> (u32, usize) {
    (tag >> OFF_BITS, (tag & (MAX_RUN as u32 - 1)) as usize)
}

impl Runs {
    #[inline]
    fn with<R>(&self, id: u32, f: impl FnOnce(&Record) -> R) -> Option<R> {
        let segs = self.segments.read();
        let r = segs
            .get(id as usize / SEGMENT)?
            .get(id as usize % SEGMENT)?;
        Some(f(r))
    }

    /// Puts `id` back; the last live record takes the segments with it.
    fn free(&self, id: u32) {
        let mut a = self.alloc.lock();
        a.free.push(id);
        if a.free.len() == a.next as usize {
            *a = Alloc::default();
            *self.segments.write() = Vec::new();
        }
    }

    /// Starts a run of `len` blocks on tier `tier_bit`; `None` when every
    /// record id is in use. Tag its nodes with `tag_of`, counting each with
    /// `tagged`, give its last key with `last_key` before tagging its last
    /// node (the run cannot be whole before that), then call `end`.
    pub(crate) fn begin(&self, len: usize, tier_bit: u8) -> Option<u32> {
        debug_assert!((MIN_RUN..=MAX_RUN).contains(&len));
        let mut a = self.alloc.lock();
        let id = match a.free.pop() {
            Some(id) => id,
            None if (a.next as usize) < IDS => {
                a.next += 1;
                let id = a.next - 1;
                if (id as usize).is_multiple_of(SEGMENT) {
                    self.segments
                        .write()
                        .push((0..SEGMENT).map(|_| Record::default()).collect());
                }
                id
            }
            None => return None,
        };
        drop(a);
        self.with(id, |r| {
            r.last_key.store(0, Ordering::Relaxed);
            r.state.store(
                len as u64 | u64::from(tier_bit) << TIER_SHIFT | CREATING,
                Ordering::Release,
            );
        });
        Some(id)
    }

    /// The key of run `id`'s last block (published to walkers by the last
    /// node's `tagged`, which makes the run whole).
    pub(crate) fn last_key(&self, id: u32, key: u64) {
        self.with(id, |r| r.last_key.store(key, Ordering::Relaxed));
    }

    /// One more node carries `tag` (of a run that has not ended).
    pub(crate) fn tagged(&self, tag: u32) {
        self.with(split(tag).0, |r| {
            r.state.fetch_add(TAGGED_ONE, Ordering::Release)
        });
    }

    /// A node's tag was removed; frees the record with its last tag.
    pub(crate) fn untagged(&self, tag: u32) {
        let (id, _) = split(tag);
        let Some(prev) = self.with(id, |r| r.state.fetch_sub(TAGGED_ONE, Ordering::AcqRel)) else {
            debug_assert!(false, "a tag names no record");
            return;
        };
        debug_assert!(prev >> 16 & 0xFFFF > 0, "untagged more often than tagged");
        if prev >> 16 & 0xFFFF == 1 && prev & CREATING == 0 {
            self.free(id);
        }
    }

    /// The store that began run `id` is done tagging.
    pub(crate) fn end(&self, id: u32) {
        let Some(prev) = self.with(id, |r| r.state.fetch_and(!CREATING, Ordering::AcqRel)) else {
            return;
        };
        if prev >> 16 & 0xFFFF == 0 {
            self.free(id);
        }
    }

    /// For a node tagged `tag`: if its run is whole and on a tier in `need`,
    /// how many blocks of the run follow the node, and the run's last key.
    #[inline]
    pub(crate) fn ahead(&self, tag: u32, need: u8) -> Option<(usize, u64)> {
        let (id, off) = split(tag);
        self.with(id, |r| {
            let s = r.state.load(Ordering::Acquire);
            let len = (s & LEN_MASK) as usize;
            let whole = s >> 16 & 0xFFFF == len as u64;
            let tier = (s >> TIER_SHIFT) as u8 & 0xF;
            (whole && tier & need != 0 && off < len)
                .then(|| (len - 1 - off, r.last_key.load(Ordering::Relaxed)))
        })?
    }

    /// Heap bytes of the allocated segments.
    pub(crate) fn heap_bytes(&self) -> usize {
        let segs = self.segments.read();
        segs.len() * SEGMENT * std::mem::size_of::<Record>()
            + segs.capacity() * std::mem::size_of::<Box<[Record]>>()
    }

    /// Records in use (tests).
    #[cfg(test)]
    pub(crate) fn live(&self) -> usize {
        let a = self.alloc.lock();
        a.next as usize - a.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_lives_until_its_last_tag_goes() {
        let runs = Runs::default();
        let id = runs.begin(40, 1).unwrap();
        runs.last_key(id, 77);
        assert_eq!(runs.ahead(tag_of(id, 0), 1), None, "no tags yet");
        for k in 0..40 {
            runs.tagged(tag_of(id, k));
        }
        assert_eq!(runs.ahead(tag_of(id, 0), 1), Some((39, 77)));
        assert_eq!(runs.ahead(tag_of(id, 39), 1 | 2), Some((0, 77)));
        assert_eq!(runs.ahead(tag_of(id, 3), 2), None, "other tier");
        runs.end(id);
        runs.untagged(tag_of(id, 5));
        assert_eq!(runs.ahead(tag_of(id, 0), 1), None, "a hole");
        for k in (0..40).filter(|&k| k != 5) {
            assert_eq!(runs.live(), 1);
            runs.untagged(tag_of(id, k));
        }
        assert_eq!((runs.live(), runs.heap_bytes()), (0, 0), "all given back");
        // A freed id is reused while others are live.
        let a = runs.begin(32, 1).unwrap();
        let b = runs.begin(32, 1).unwrap();
        runs.tagged(tag_of(b, 0));
        runs.end(b);
        runs.end(a);
        assert_eq!(runs.live(), 1);
        assert_eq!(runs.begin(32, 1), Some(a));
        // A run that tagged nothing is freed by `end`.
        runs.end(a);
        assert_eq!(runs.live(), 1);
        runs.untagged(tag_of(b, 0));
        assert_eq!(runs.live(), 0);
    }

    #[test]
    fn an_untag_during_the_store_does_not_free_the_record() {
        let runs = Runs::default();
        let id = runs.begin(32, 1).unwrap();
        runs.tagged(tag_of(id, 0));
        runs.untagged(tag_of(id, 0));
        assert_eq!(runs.live(), 1);
        runs.tagged(tag_of(id, 1));
        runs.end(id);
        assert_eq!(runs.live(), 1);
        runs.untagged(tag_of(id, 1));
        assert_eq!(runs.live(), 0);
    }
}
