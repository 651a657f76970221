//! The per-(worker, rank, tier) map engine hash -> node key.
//!
//! Why not `HashMap<u64, u64>`: every holding has one entry here, so this map
//! is a large share of the index's memory. hashbrown keeps its load between
//! 7/16 and 7/8 (it doubles), and at 1,000 entries sits at 0.49 (35 B per
//! entry). This table is linear probing over 16-byte (key, value) buckets
//! with a non-power-of-two capacity (multiply-shift range reduction), so past
//! `DOUBLE_UNTIL` buckets it grows by 1.25x and its load stays between 0.7
//! and 0.875 (18-23 B per entry).
//!
//! Invariants: a bucket is vacant iff its key is 0 (the engine hash 0 is kept
//! apart in `zero`); no vacant bucket lies between an entry's home bucket and
//! its bucket (backward-shift deletion keeps that, so there are no
//! tombstones); the load stays at most 7/8, so a probe always meets a vacancy.

#[derive(Default)]
pub(crate) struct EngineMap {
    buckets: Vec<(u64, u64)>,
    /// Entries in `buckets` (not counting `zero`).
    len: usize,
    /// The value of engine hash 0, which cannot live in a bucket.
    zero: Option<u64>,
}

/// Doubling below this many buckets (few rehashes while small), 1.25x above.
const DOUBLE_UNTIL: usize = 1024;
const MIN_CAPACITY: usize = 8;

/// Home bucket: the key mixed (`crate::fold`), then a multiply-shift range
/// reduction to `0..n`.
#[inline]
fn home(key: u64, n: usize) -> usize {
    ((crate::fold::mix(key, 0) as u128 * n as u128) >> 64) as usize
}

impl EngineMap {
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len + self.zero.is_some() as usize
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Heap bytes of the bucket array.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<(u64, u64)>()
    }

    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        let n = self.buckets.len();
        if n == 0 {
            return None;
        }
        let mut i = home(key, n);
        loop {
            let k = self.buckets[i].0;
            if k == key {
                return Some(i);
            }
            if k == 0 {
                return None;
            }
            i += 1;
            if i == n {
                i = 0;
            }
        }
    }

    #[inline]
    pub(crate) fn get(&self, key: &u64) -> Option<&u64> {
        if *key == 0 {
            return self.zero.as_ref();
        }
        self.find(*key).map(|i| &self.buckets[i].1)
    }

    /// Hints the CPU to fetch `key`'s home bucket, ahead of an `insert` or
    /// `remove` of it.
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        let n = self.buckets.len();
        if n > 0 {
            super::table::prefetch_ptr(self.buckets.as_ptr().wrapping_add(home(key, n)));
        }
    }

    /// Sets `key` to `value`; returns the previous value.
    pub(crate) fn insert(&mut self, key: u64, value: u64) -> Option<u64> {
        if key == 0 {
            return self.zero.replace(value);
        }
        if let Some(i) = self.find(key) {
            return Some(std::mem::replace(&mut self.buckets[i].1, value));
        }
        if (self.len + 1) * 8 > self.buckets.len() * 7 {
            let n = self.buckets.len();
            let cap = if n < DOUBLE_UNTIL {
                (n * 2).max(MIN_CAPACITY)
            } else {
                n + n / 4
            };
            self.resize(cap);
        }
        self.place(key, value);
        self.len += 1;
        None
    }

    /// Puts a key known to be absent into the first vacancy from its home.
    fn place(&mut self, key: u64, value: u64) {
        let n = self.buckets.len();
        let mut i = home(key, n);
        while self.buckets[i].0 != 0 {
            i += 1;
            if i == n {
                i = 0;
            }
        }
        self.buckets[i] = (key, value);
    }

    pub(crate) fn remove(&mut self, key: &u64) -> Option<u64> {
        if *key == 0 {
            return self.zero.take();
        }
        let mut i = self.find(*key)?;
        let value = self.buckets[i].1;
        // Backward-shift deletion: pull back each following entry whose home
        // is not in (i, j], so no probe crosses the hole.
        let n = self.buckets.len();
        let mut j = i;
        loop {
            j += 1;
            if j == n {
                j = 0;
            }
            let k = self.buckets[j].0;
            if k == 0 {
                break;
            }
            let h = home(k, n);
            // Distance from home to j vs from i to j (cyclic).
            let dj = (j + n - h) % n;
            let dij = (j + n - i) % n;
            if dj >= dij {
                self.buckets[i] = self.buckets[j];
                i = j;
            }
        }
        self.buckets[i] = (0, 0);
        self.len -= 1;
        Some(value)
    }

    /// Gives memory back: frees an empty table, halves one at < 1/4 load.
    pub(crate) fn shrink(&mut self) {
        if self.len == 0 {
            self.buckets = Vec::new();
        } else if self.buckets.len() > 4 * MIN_CAPACITY && self.len * 4 < self.buckets.len() {
            self.resize(self.len * 2);
        }
    }

    fn resize(&mut self, cap: usize) {
        let old = std::mem::replace(&mut self.buckets, vec![(0, 0); cap]);
        for (k, v) in old {
            if k != 0 {
                self.place(k, v);
            }
        }
    }

    /// All (engine hash, node key) entries, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.zero
            .map(|v| (0, v))
            .into_iter()
            .chain(self.buckets.iter().copied().filter(|&(k, _)| k != 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn matches_a_hashmap_through_growth_and_shrink() {
        let mut t = EngineMap::default();
        let mut m = HashMap::new();
        let mut x = 99u64;
        for round in 0..40_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Few distinct keys (so removals hit), including 0.
            let key = (x % 5000).wrapping_mul(0x2545_F491_4F6C_DD1D) * !x.is_multiple_of(7) as u64;
            if round % 3 == 2 || (round > 30_000 && round % 3 != 0) {
                assert_eq!(t.remove(&key), m.remove(&key));
                t.shrink();
            } else {
                assert_eq!(t.insert(key, round), m.insert(key, round));
            }
            assert_eq!(t.len(), m.len());
        }
        for k in 0..5000u64 {
            let key = k.wrapping_mul(0x2545_F491_4F6C_DD1D);
            assert_eq!(t.get(&key), m.get(&key), "{k}");
        }
        let mut all: Vec<_> = t.iter().collect();
        all.sort_unstable();
        let mut want: Vec<_> = m.iter().map(|(&k, &v)| (k, v)).collect();
        want.sort_unstable();
        assert_eq!(all, want);
        for k in want {
            assert_eq!(t.remove(&k.0), Some(k.1));
            t.shrink();
        }
        assert!(t.is_empty());
        assert_eq!(t.heap_bytes(), 0);
    }
}
