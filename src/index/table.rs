//! The node table of one shard: open addressing with Robin Hood linear
//! probing, keyed by the node key (a hash), storing nodes inline.
//!
//! Why not `HashMap`: an overlap walk does thousands of lookups whose keys it
//! knows in advance, so it prefetches the home bucket of key `i + D` while it
//! works on key `i`; that needs the bucket address. Inline buckets make a hit
//! one cache miss (SwissTable: control bytes, then the bucket). A bucket holds
//! only what the walk reads (key and holders, 16 bytes: four per cache line,
//! so a probe past the home bucket rarely needs a second line); the local
//! hash and parent key, read only by stores, removals and /dump, live in a
//! parallel array moved in lockstep. Capacities are
//! not powers of two (the home bucket is a multiply-shift range reduction), so
//! growth by 1.5x (past 4,096 buckets) keeps the load between 0.58 and 0.875,
//! which bounds the memory per node.
//!
//! Invariants: a bucket is vacant iff its node's holder set is empty (a node
//! nobody holds is removed at once, with backward-shift deletion, so there are
//! no tombstones); Robin Hood order holds, so a lookup stops at the first
//! bucket whose resident is closer to its home than the probe is.

// Prefetching a bucket address computed ahead of the walk.
#![allow(unsafe_code)]

use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicPtr, AtomicUsize};

use super::holders::Holders;

pub(crate) struct Node {
    pub(crate) key: u64,
    pub(crate) holders: Holders,
}

/// The rest of a node, at the same index of `NodeTable::cold`.
#[derive(Clone, Copy, Default)]
struct Cold {
    local: u64,
    /// Key of the parent node; equal to `key` for a root.
    parent: u64,
}

impl Node {
    fn vacant() -> Node {
        Node {
            key: 0,
            holders: Holders::default(),
        }
    }

    /// Reads only the bucket itself: a node with list or bitset holders always
    /// has more than two of them (smaller sets go back inline).
    #[inline]
    fn is_vacant(&self) -> bool {
        self.holders.is_inline_empty()
    }
}

#[derive(Default)]
pub(crate) struct NodeTable {
    buckets: Vec<Node>,
    /// `cold[i]` belongs to `buckets[i]` (meaningless where it is vacant).
    cold: Vec<Cold>,
    len: usize,
}

/// The key mixed (`crate::fold`) spreads every key bit over the high half,
/// which the range reduction uses (the shard already fixed the key's own
/// high bits).
#[inline]
fn home(key: u64, n: usize) -> usize {
    ((crate::fold::mix(key, 0) as u128 * n as u128) >> 64) as usize
}

const MIN_CAPACITY: usize = 8;

/// Next capacity: doubling while small (fewer rehashes, little memory at
/// stake), then 1.5x so a big table's load stays between 0.58 and 0.875.
fn grown(cap: usize) -> usize {
    if cap < 4096 {
        (cap * 2).max(MIN_CAPACITY)
    } else {
        cap + cap / 2
    }
}

/// Probes `buckets` (a table's bucket array) for `key` from `start` (the key's
/// home bucket, `NodeTable::home_of`), for keys that are usually present (the
/// overlap walk, whose first miss ends it): probes until the key or a vacant
/// bucket without the Robin Hood distance test, which costs a hash of each
/// resident passed. Correct because no vacant bucket lies between a node's
/// home and its bucket (insertion and backward-shift deletion keep that), and
/// the load stays below 1, so a vacant bucket exists.
#[inline]
pub(crate) fn probe_likely(buckets: &[Node], start: usize, key: u64) -> Option<&Node> {
    let n = buckets.len();
    let b0 = buckets.get(start)?;
    // Most keys sit in their home bucket or the next one: test both without
    // a branch between them (an unpredictable branch costs more than the
    // second compare).
    let b1 = &buckets[if start + 1 == n { 0 } else { start + 1 }];
    let hit0 = (b0.key == key) & !b0.is_vacant();
    let hit1 = (b1.key == key) & !b1.is_vacant();
    if hit0 | hit1 {
        return Some(if hit0 { b0 } else { b1 });
    }
    if b0.is_vacant() | b1.is_vacant() {
        return None;
    }
    // Tables have at least `MIN_CAPACITY` buckets, so one wrap suffices.
    let mut i = start + 2;
    if i >= n {
        i -= n;
    }
    loop {
        let b = &buckets[i];
        if b.key == key && !b.is_vacant() {
            return Some(b);
        }
        if b.is_vacant() {
            return None;
        }
        i += 1;
        if i == n {
            i = 0;
        }
    }
}

/// Hints the CPU to fetch the line at `p`. Any address will do: a prefetch
/// never faults, so `p` may be stale or dangling.
#[inline]
pub(crate) fn prefetch_ptr<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetching is a hint that never faults and reads nothing.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Where a shard's table kept its arrays when its write lock was last
/// released, so that a writer can prefetch the buckets of its next keys
/// before it takes the lock. Read without the lock: the addresses may be
/// stale by the time they are used, which only wastes the prefetch.
#[derive(Default)]
pub(crate) struct Hint {
    buckets: AtomicPtr<Node>,
    cold: AtomicPtr<Cold>,
    len: AtomicUsize,
}

impl Hint {
    /// Records `t`'s arrays; writes only when they moved (the line is read
    /// by other writers' prefetches).
    #[inline]
    pub(crate) fn publish(&self, t: &NodeTable) {
        let b = t.buckets.as_ptr() as *mut Node;
        if self.buckets.load(Relaxed) != b || self.len.load(Relaxed) != t.buckets.len() {
            self.buckets.store(b, Relaxed);
            self.cold.store(t.cold.as_ptr() as *mut Cold, Relaxed);
            self.len.store(t.buckets.len(), Relaxed);
        }
    }

    /// Prefetches the home bucket of `key` and its cold half (an insert
    /// writes both; a removal shifts both).
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        let n = self.len.load(Relaxed);
        if n == 0 {
            return;
        }
        let i = home(key, n);
        prefetch_ptr(self.buckets.load(Relaxed).wrapping_add(i));
        prefetch_ptr(self.cold.load(Relaxed).wrapping_add(i));
    }
}

/// Hints the CPU to fetch bucket `i` of `buckets` (no-op when out of range).
#[inline]
pub(crate) fn prefetch_at(buckets: &[Node], i: usize) {
    let p = buckets.as_ptr().wrapping_add(i);
    if i >= buckets.len() {
        return;
    }
    // A probe often reads the next bucket too: fetch its line, which is
    // this line for three buckets of four (the prefetch then merges).
    prefetch_ptr(p);
    prefetch_ptr(p.wrapping_add(1));
}

impl NodeTable {
    /// The bucket array, for `probe_likely` / `prefetch_at`.
    #[inline]
    pub(crate) fn buckets(&self) -> &[Node] {
        &self.buckets
    }

    /// Home bucket of `key` (0 for an empty table, where any probe misses).
    #[inline]
    pub(crate) fn home_of(&self, key: u64) -> usize {
        home(key, self.buckets.len())
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.buckets.len()
    }

    /// Heap bytes of the bucket arrays.
    pub(crate) fn bucket_bytes(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<Node>()
            + self.cold.capacity() * std::mem::size_of::<Cold>()
    }

    #[inline]
    fn dist(&self, i: usize) -> usize {
        let n = self.buckets.len();
        let h = home(self.buckets[i].key, n);
        if i >= h {
            i - h
        } else {
            i + n - h
        }
    }

    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        let n = self.buckets.len();
        if n == 0 {
            return None;
        }
        let mut i = home(key, n);
        let mut d = 0;
        loop {
            let b = &self.buckets[i];
            // Vacant buckets have key 0, so test vacancy only on a key match
            // or before giving up.
            if b.key == key && !b.is_vacant() {
                return Some(i);
            }
            if b.is_vacant() {
                return None;
            }
            if self.dist(i) < d {
                return None;
            }
            d += 1;
            i += 1;
            if i == n {
                i = 0;
            }
        }
    }

    /// `(local, parent)` of the node of `key`.
    #[inline]
    pub(crate) fn info(&self, key: u64) -> Option<(u64, u64)> {
        self.find(key)
            .map(|i| (self.cold[i].local, self.cold[i].parent))
    }

    /// Swaps buckets `i` and `j` with their cold halves.
    #[inline]
    fn swap(&mut self, i: usize, j: usize) {
        self.buckets.swap(i, j);
        self.cold.swap(i, j);
    }

    /// The node of `key`, inserted with `local` and `parent` (and no holders)
    /// if absent. The caller must give it a holder before releasing the table
    /// (an empty node reads as a vacant bucket).
    pub(crate) fn entry(&mut self, key: u64, local: u64, parent: u64) -> &mut Node {
        // Grow first (possibly one insert early when `key` is present): the
        // probe below then both finds and inserts.
        if (self.len + 1) * 8 > self.buckets.len() * 7 {
            let cap = grown(self.buckets.len());
            self.resize(cap);
        }
        let n = self.buckets.len();
        let mut i = home(key, n);
        let mut d = 0;
        loop {
            let b = &self.buckets[i];
            if b.is_vacant() {
                break;
            }
            if b.key == key {
                return &mut self.buckets[i];
            }
            if self.dist(i) < d {
                break;
            }
            d += 1;
            i += 1;
            if i == n {
                i = 0;
            }
        }
        // Absent: ours goes to bucket `i`; Robin Hood moves the residents
        // from there on. (Until the caller gives it a holder the new node
        // reads as vacant; only buckets ahead are probed here.)
        let at = i;
        let mut cur = std::mem::replace(
            &mut self.buckets[i],
            Node {
                key,
                holders: Holders::default(),
            },
        );
        let mut cur_cold = std::mem::replace(&mut self.cold[i], Cold { local, parent });
        if !cur.is_vacant() {
            d = self.dist_of(cur.key, i);
            loop {
                d += 1;
                i += 1;
                if i == n {
                    i = 0;
                }
                if self.buckets[i].is_vacant() {
                    self.buckets[i] = cur;
                    self.cold[i] = cur_cold;
                    break;
                }
                let di = self.dist(i);
                if di < d {
                    std::mem::swap(&mut self.buckets[i], &mut cur);
                    std::mem::swap(&mut self.cold[i], &mut cur_cold);
                    d = di;
                }
            }
        }
        self.len += 1;
        &mut self.buckets[at]
    }

    #[inline]
    fn dist_of(&self, key: u64, i: usize) -> usize {
        let n = self.buckets.len();
        let h = home(key, n);
        if i >= h {
            i - h
        } else {
            i + n - h
        }
    }

    /// Applies `f` to the node of `key`, if present, and removes the node if
    /// `f` left it without holders.
    pub(crate) fn update<R>(&mut self, key: u64, f: impl FnOnce(&mut Node) -> R) -> Option<R> {
        let i = self.find(key)?;
        let r = f(&mut self.buckets[i]);
        if self.buckets[i].is_vacant() {
            self.remove_at(i);
        }
        Some(r)
    }

    fn remove_at(&mut self, mut i: usize) {
        let n = self.buckets.len();
        loop {
            let j = if i + 1 == n { 0 } else { i + 1 };
            if self.buckets[j].is_vacant() || self.dist(j) == 0 {
                break;
            }
            self.swap(i, j);
            i = j;
        }
        self.buckets[i] = Node::vacant();
        self.len -= 1;
        if self.len == 0 {
            self.buckets = Vec::new();
            self.cold = Vec::new();
        } else if self.buckets.len() > 4 * MIN_CAPACITY && self.len * 4 < self.buckets.len() {
            self.resize(self.len * 2);
        }
    }

    fn resize(&mut self, cap: usize) {
        let old = std::mem::take(&mut self.buckets);
        let old_cold = std::mem::take(&mut self.cold);
        let mut buckets = Vec::with_capacity(cap);
        buckets.resize_with(cap, Node::vacant);
        self.buckets = buckets;
        self.cold = vec![Cold::default(); cap];
        debug_assert_eq!(old.len(), old_cold.len());
        for (node, cold) in old.into_iter().zip(old_cold) {
            if !node.is_vacant() {
                self.place(node, cold);
            }
        }
    }

    /// Inserts a node known to be absent (during resize).
    fn place(&mut self, mut cur: Node, mut cur_cold: Cold) {
        let n = self.buckets.len();
        let mut i = home(cur.key, n);
        let mut d = 0;
        loop {
            if self.buckets[i].is_vacant() {
                self.buckets[i] = cur;
                self.cold[i] = cur_cold;
                return;
            }
            let di = self.dist(i);
            if di < d {
                std::mem::swap(&mut self.buckets[i], &mut cur);
                std::mem::swap(&mut self.cold[i], &mut cur_cold);
                d = di;
            }
            d += 1;
            i += 1;
            if i == n {
                i = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn a_bucket_is_16_bytes_plus_16_cold() {
        // Four walked buckets per cache line; the memory figures depend on
        // both sizes.
        assert_eq!(std::mem::size_of::<Node>(), 16);
        assert_eq!(std::mem::size_of::<Cold>(), 16);
    }

    #[test]
    fn matches_a_hashmap_through_growth_and_shrink() {
        let mut t = NodeTable::default();
        let mut m = HashMap::new();
        let mut x = 12345u64;
        for round in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Keys with equal high bits, as within one shard; few distinct.
            let key = (x % 3000) | (5 << 58);
            if round % 3 == 2 {
                t.update(key, |n| n.holders.clear(1, 1));
                m.remove(&key);
            } else {
                let n = t.entry(key, key + 1, key + 2);
                n.holders.set(1, 1);
                m.insert(key, ());
            }
            assert_eq!(t.len(), m.len());
        }
        for k in 0..3000u64 {
            let key = k | (5 << 58);
            assert_eq!(t.info(key).is_some(), m.contains_key(&key), "{k}");
            if let Some(info) = t.info(key) {
                assert_eq!(info, (key + 1, key + 2));
            }
        }
        for k in 0..3000u64 {
            let key = k | (5 << 58);
            t.update(key, |n| n.holders.clear(1, 1));
        }
        assert_eq!((t.len(), t.capacity()), (0, 0));
    }
}
