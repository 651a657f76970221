//! The ledger's identity table (one per identity shard): open addressing with
//! linear probing over a power-of-two bucket array, values inline, deletion by
//! backward shift (no tombstones).
//!
//! Why not `HashMap`: a booking touches thousands of identities whose keys it
//! knows in advance, and the live set (hundreds of thousands of identities)
//! is far larger than L2, so each touch is a cache miss. The ledger fetches
//! the home bucket of identity `i + D` while it works on identity `i`; that
//! needs the bucket address, which a `HashMap` does not expose. A table
//! publishes its bucket array's address and mask in a [`Hint`] whenever it
//! reallocates the array (atomics, so the ledger can prefetch into shards it
//! has not locked yet; a stale hint costs a useless prefetch, never a wrong
//! answer).
//!
//! Positions come from the identity mixed with the ledger's random key
//! (`crate::fold::mix`), so clients choosing identities cannot choose collisions.
//! The shard index uses bits 48..56 of the mixed value, the bucket its low
//! bits.

// Prefetching a bucket address published by the table (`Hint`).
#![allow(unsafe_code)]

use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// One bucket: an identity and its value; `None` marks a vacant bucket.
struct Bucket<V> {
    ident: u64,
    value: Option<V>,
}

pub(crate) struct IdentTable<V> {
    buckets: Vec<Bucket<V>>,
    len: usize,
    /// Mixing key (the ledger's), to find a resident's home when shifting.
    key: u64,
    /// Where `buckets` is, for prefetching by threads without the lock;
    /// updated here whenever `buckets` is reallocated.
    hint: Arc<Hint<V>>,
}

/// Where a table's buckets are, for prefetching without its lock. Only the
/// table writes it, when its bucket array changes; a stale or torn view
/// costs a useless prefetch, never a wrong answer.
pub(crate) struct Hint<V> {
    /// Address of the bucket array; 0 for a table without buckets (an empty
    /// `Vec`'s pointer is dangling and its mask would be all ones).
    base: AtomicUsize,
    mask: AtomicUsize,
    _buckets: PhantomData<fn() -> V>,
}

impl<V> Hint<V> {
    fn new() -> Hint<V> {
        Hint {
            base: AtomicUsize::new(0),
            mask: AtomicUsize::new(0),
            _buckets: PhantomData,
        }
    }

    fn set(&self, buckets: &[Bucket<V>]) {
        let (base, mask) = match buckets.len() {
            0 => (0, 0),
            n => (buckets.as_ptr() as usize, n - 1),
        };
        self.base.store(base, Ordering::Relaxed);
        self.mask.store(mask, Ordering::Relaxed);
    }

    /// Hints the CPU to fetch the home bucket of `mixed`. Never faults:
    /// prefetching is only a hint, even for a stale (freed) address.
    #[inline]
    pub(crate) fn prefetch(&self, mixed: u64) {
        let base = self.base.load(Ordering::Relaxed);
        if base == 0 {
            return;
        }
        // Wrapping: the two loads may come from different updates.
        let i = mixed as usize & self.mask.load(Ordering::Relaxed);
        let p = base.wrapping_add(i.wrapping_mul(std::mem::size_of::<Bucket<V>>()));
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `_mm_prefetch` does not access memory architecturally; it
        // cannot fault whatever the address.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }
}

const MIN_CAPACITY: usize = 16;

impl<V> IdentTable<V> {
    pub(crate) fn new(key: u64) -> IdentTable<V> {
        IdentTable {
            buckets: Vec::new(),
            len: 0,
            key,
            hint: Arc::new(Hint::new()),
        }
    }

    /// The table's prefetch hint, to keep outside its lock.
    pub(crate) fn hint(&self) -> Arc<Hint<V>> {
        Arc::clone(&self.hint)
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn mask(&self) -> usize {
        self.buckets.len().wrapping_sub(1)
    }

    #[inline]
    fn home(&self, ident: u64) -> usize {
        crate::fold::mix(ident, self.key) as usize & self.mask()
    }

    /// Bucket index of `ident` (`mixed` = `mix(ident, key)`), if present.
    #[inline]
    fn find(&self, ident: u64, mixed: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mask = self.mask();
        let mut i = mixed as usize & mask;
        loop {
            let b = &self.buckets[i];
            b.value.as_ref()?;
            if b.ident == ident {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    #[inline]
    pub(crate) fn get(&self, ident: u64, mixed: u64) -> Option<&V> {
        self.find(ident, mixed)
            .and_then(|i| self.buckets[i].value.as_ref())
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, ident: u64, mixed: u64) -> Option<&mut V> {
        self.find(ident, mixed)
            .and_then(|i| self.buckets[i].value.as_mut())
    }

    /// The value of `ident`, inserted with `make()` if absent; the flag says
    /// whether it was inserted.
    #[inline]
    pub(crate) fn get_or_insert_with(
        &mut self,
        ident: u64,
        mixed: u64,
        make: impl FnOnce() -> V,
    ) -> (&mut V, bool) {
        if (self.len + 1) * 2 > self.buckets.len() {
            self.grow();
        }
        let mask = self.mask();
        let mut i = mixed as usize & mask;
        loop {
            if self.buckets[i].value.is_none() {
                self.buckets[i] = Bucket {
                    ident,
                    value: Some(make()),
                };
                self.len += 1;
                return (self.buckets[i].value.as_mut().expect("just set"), true);
            }
            if self.buckets[i].ident == ident {
                return (self.buckets[i].value.as_mut().expect("occupied"), false);
            }
            i = (i + 1) & mask;
        }
    }

    /// Removes `ident`, returning its value.
    pub(crate) fn remove(&mut self, ident: u64, mixed: u64) -> Option<V> {
        let mut hole = self.find(ident, mixed)?;
        let out = self.buckets[hole].value.take();
        self.len -= 1;
        // Backward shift: pull later residents of the run into the hole
        // unless their home lies cyclically in (hole, j].
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            if self.buckets[j].value.is_none() {
                break;
            }
            let h = self.home(self.buckets[j].ident);
            let stays = if hole <= j {
                hole < h && h <= j
            } else {
                hole < h || h <= j
            };
            if !stays {
                self.buckets.swap(hole, j);
                hole = j;
            }
        }
        if self.len == 0 && self.buckets.len() > MIN_CAPACITY * 64 {
            // A drained big shard gives its memory back.
            self.buckets = Vec::new();
            self.hint.set(&self.buckets);
        }
        out
    }

    fn grow(&mut self) {
        let cap = (self.buckets.len() * 2).max(MIN_CAPACITY);
        let old = std::mem::replace(
            &mut self.buckets,
            (0..cap)
                .map(|_| Bucket {
                    ident: 0,
                    value: None,
                })
                .collect(),
        );
        let mask = cap - 1;
        for b in old {
            if let Some(v) = b.value {
                let mut i = self.home(b.ident);
                while self.buckets[i].value.is_some() {
                    i = (i + 1) & mask;
                }
                self.buckets[i] = Bucket {
                    ident: b.ident,
                    value: Some(v),
                };
            }
        }
        self.hint.set(&self.buckets);
    }

    /// Number of buckets.
    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.buckets.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fold::mix;
    use std::collections::HashMap;

    /// Random inserts and removes over few distinct keys (a small table
    /// churning through growth, probe runs and wrap-around), against a
    /// `HashMap` model.
    #[test]
    fn matches_a_hashmap_under_churn() {
        let key = 0x5eed;
        let mut t: IdentTable<u32> = IdentTable::new(key);
        let mut model: HashMap<u64, u32> = HashMap::new();
        let mut x = 0x1234_5678_u64;
        for step in 0..200_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let ident = x % 3000;
            let m = mix(ident, key);
            if x >> 60 < 9 {
                let (v, new) = t.get_or_insert_with(ident, m, || step);
                assert_eq!(new, !model.contains_key(&ident));
                *v = v.wrapping_add(1);
                *model.entry(ident).or_insert(step) += 1;
            } else {
                assert_eq!(t.remove(ident, m), model.remove(&ident));
            }
            assert_eq!(t.len(), model.len());
            if step % 10_000 == 0 {
                for (&k, &v) in &model {
                    assert_eq!(t.get(k, mix(k, key)), Some(&v));
                }
            }
        }
        for (&k, &v) in &model {
            assert_eq!(t.get(k, mix(k, key)).copied(), Some(v));
            assert_eq!(t.remove(k, mix(k, key)), Some(v));
        }
        assert_eq!(t.len(), 0);
        assert_eq!(t.get(1, mix(1, key)), None);
    }

    #[test]
    fn the_hint_follows_the_bucket_array_and_skips_empty_tables() {
        let key = 3;
        let mut t: IdentTable<u8> = IdentTable::new(key);
        let hint = t.hint();
        assert_eq!(hint.base.load(Ordering::Relaxed), 0);
        // Would overflow `mixed * stride` with an all-ones mask.
        hint.prefetch(u64::MAX);
        t.get_or_insert_with(5, mix(5, key), || 1);
        assert_eq!(
            hint.base.load(Ordering::Relaxed),
            t.buckets.as_ptr() as usize
        );
        assert_eq!(hint.mask.load(Ordering::Relaxed), t.capacity() - 1);
        hint.prefetch(u64::MAX);
        // Growth moves the array; a drained big table drops it: back to 0.
        for i in 0..5000u64 {
            t.get_or_insert_with(i, mix(i, key), || 0);
            assert_eq!(
                hint.base.load(Ordering::Relaxed),
                t.buckets.as_ptr() as usize
            );
            assert_eq!(hint.mask.load(Ordering::Relaxed), t.capacity() - 1);
        }
        for i in 0..5000u64 {
            t.remove(i, mix(i, key));
        }
        assert_eq!(t.capacity(), 0);
        assert_eq!(hint.base.load(Ordering::Relaxed), 0);
        hint.prefetch(u64::MAX);
    }

    #[test]
    fn load_stays_at_most_half_and_drained_tables_shrink() {
        let key = 9;
        let mut t: IdentTable<()> = IdentTable::new(key);
        for i in 0..100_000u64 {
            t.get_or_insert_with(i, mix(i, key), || ());
            assert!(t.len() * 2 <= t.capacity());
        }
        for i in 0..100_000u64 {
            assert!(t.remove(i, mix(i, key)).is_some());
        }
        assert_eq!(t.capacity(), 0);
    }
}
