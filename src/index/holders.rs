//! Who holds one node, on which tiers.
//!
//! A holder is a dense per-partition *slot* (a `u32` standing for one
//! (worker, rank)) plus a 4-bit tier mask. A node held by one or two slots keeps
//! them inline (the common case for unshared suffixes); a few more go to a small
//! sorted list; many go to a bitset with, per 64 slots, one word per tier, so
//! the overlap walk can intersect 64 candidates per instruction.
//!
//! Invariant: a slot appears at most once and its mask is never 0 (a slot
//! whose last tier is cleared is removed).

/// Tier bits of a holder mask, in `Tier::ALL` order.
pub(crate) const DEV: u8 = 1;
pub(crate) const HOST: u8 = 2;

/// Largest slot number a holder entry can carry (28 bits; the low 4 are the
/// tier mask).
pub(crate) const MAX_SLOT: u32 = (1 << 28) - 1;

#[inline]
fn pack(slot: u32, mask: u8) -> u32 {
    (slot << 4) | mask as u32
}

#[inline]
pub(crate) fn unpack(e: u32) -> (u32, u8) {
    (e >> 4, (e & 0xF) as u8)
}

/// One word group of the dense form: slots `64*w .. 64*w+64`, one bit per
/// slot for each tier (device, host, disk, external).
pub(crate) type Group = [u64; 4];

#[derive(Debug)]
pub(crate) struct Dense {
    /// Number of slots with a non-zero mask.
    count: u32,
    pub(crate) groups: Vec<Group>,
}

#[derive(Debug)]
pub(crate) enum Holders {
    /// Up to two packed entries; `n` of `e` are used, sorted by slot.
    Inline {
        n: u8,
        e: [u32; 2],
    },
    /// Sorted packed entries, more than two and few compared to the slot range.
    /// Boxed on purpose: it keeps `Holders` at 16 bytes, and every node pays
    /// for the enum while few nodes have more than two holders.
    #[allow(clippy::box_collection)]
    Sparse(Box<Vec<u32>>),
    Dense(Box<Dense>),
}

/// What a change did to one (slot, tier) bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change {
    Changed,
    Unchanged,
}

impl Default for Holders {
    fn default() -> Self {
        Holders::Inline { n: 0, e: [0; 2] }
    }
}

/// Dense groups needed for slot numbers up to `max_slot`.
#[inline]
fn groups_for(max_slot: u32) -> usize {
    max_slot as usize / 64 + 1
}

impl Holders {
    pub(crate) fn is_empty(&self) -> bool {
        match self {
            Holders::Inline { n, .. } => *n == 0,
            Holders::Sparse(v) => v.is_empty(),
            Holders::Dense(d) => d.count == 0,
        }
    }

    /// Heap bytes owned (for stats).
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Holders::Inline { .. } => 0,
            Holders::Sparse(v) => std::mem::size_of::<Vec<u32>>() + v.capacity() * 4,
            Holders::Dense(d) => {
                std::mem::size_of::<Dense>() + d.groups.capacity() * std::mem::size_of::<Group>()
            }
        }
    }

    /// Tier mask of `slot` (0 if absent).
    #[cfg(test)]
    pub(crate) fn mask(&self, slot: u32) -> u8 {
        match self {
            Holders::Inline { n, e } => e[..*n as usize]
                .iter()
                .map(|&x| unpack(x))
                .find(|&(s, _)| s == slot)
                .map_or(0, |(_, m)| m),
            Holders::Sparse(v) => match v.binary_search_by_key(&slot, |&x| x >> 4) {
                Ok(i) => unpack(v[i]).1,
                Err(_) => 0,
            },
            Holders::Dense(d) => {
                let (w, b) = (slot as usize / 64, slot % 64);
                d.groups.get(w).map_or(0, |g| {
                    (0..4).fold(0u8, |m, t| m | ((((g[t] >> b) & 1) as u8) << t))
                })
            }
        }
    }

    /// Sets tier bit `tier_bit` (one of the four mask bits) for `slot`.
    pub(crate) fn set(&mut self, slot: u32, tier_bit: u8) -> Change {
        debug_assert!(slot <= MAX_SLOT);
        match self {
            Holders::Inline { n, e } => {
                let used = *n as usize;
                for x in e[..used].iter_mut() {
                    let (s, m) = unpack(*x);
                    if s == slot {
                        if m & tier_bit != 0 {
                            return Change::Unchanged;
                        }
                        *x = pack(s, m | tier_bit);
                        return Change::Changed;
                    }
                }
                if used < 2 {
                    e[used] = pack(slot, tier_bit);
                    *n += 1;
                    e[..=used].sort_unstable();
                    return Change::Changed;
                }
                let mut v = Vec::with_capacity(4);
                v.extend_from_slice(&e[..]);
                *self = Holders::Sparse(Box::new(v));
                self.set(slot, tier_bit)
            }
            Holders::Sparse(v) => {
                match v.binary_search_by_key(&slot, |&x| x >> 4) {
                    Ok(i) => {
                        let (s, m) = unpack(v[i]);
                        if m & tier_bit != 0 {
                            return Change::Unchanged;
                        }
                        v[i] = pack(s, m | tier_bit);
                        return Change::Changed;
                    }
                    Err(i) => v.insert(i, pack(slot, tier_bit)),
                }
                // Dense costs 32 bytes per 64 slots, sparse 4 bytes per holder.
                let max = v.last().map_or(0, |&x| x >> 4);
                if v.len() > 8 * groups_for(max) {
                    let mut d = Dense {
                        count: 0,
                        groups: vec![[0; 4]; groups_for(max)],
                    };
                    for &x in v.iter() {
                        let (s, m) = unpack(x);
                        d.put(s, m);
                    }
                    *self = Holders::Dense(Box::new(d));
                }
                Change::Changed
            }
            Holders::Dense(d) => {
                let (w, b) = (slot as usize / 64, slot % 64);
                if w >= d.groups.len() {
                    d.groups.resize(w + 1, [0; 4]);
                }
                let g = &mut d.groups[w];
                let t = tier_bit.trailing_zeros() as usize;
                if g[t] >> b & 1 == 1 {
                    return Change::Unchanged;
                }
                let was = (g[0] | g[1] | g[2] | g[3]) >> b & 1;
                g[t] |= 1 << b;
                d.count += 1 - was as u32;
                Change::Changed
            }
        }
    }

    /// Clears tier bit `tier_bit` of `slot`.
    pub(crate) fn clear(&mut self, slot: u32, tier_bit: u8) -> Change {
        match self {
            Holders::Inline { n, e } => {
                let used = *n as usize;
                let Some(i) = e[..used].iter().position(|&x| x >> 4 == slot) else {
                    return Change::Unchanged;
                };
                let (s, m) = unpack(e[i]);
                if m & tier_bit == 0 {
                    return Change::Unchanged;
                }
                let m = m & !tier_bit;
                if m != 0 {
                    e[i] = pack(s, m);
                } else {
                    e.copy_within(i + 1..used, i);
                    *n -= 1;
                    e[*n as usize] = 0;
                }
                Change::Changed
            }
            Holders::Sparse(v) => {
                let Ok(i) = v.binary_search_by_key(&slot, |&x| x >> 4) else {
                    return Change::Unchanged;
                };
                let (s, m) = unpack(v[i]);
                if m & tier_bit == 0 {
                    return Change::Unchanged;
                }
                let m = m & !tier_bit;
                if m != 0 {
                    v[i] = pack(s, m);
                } else {
                    v.remove(i);
                    if v.len() <= 2 {
                        let mut e = [0; 2];
                        e[..v.len()].copy_from_slice(v);
                        *self = Holders::Inline {
                            n: v.len() as u8,
                            e,
                        };
                    } else if v.capacity() > 4 * v.len() {
                        v.shrink_to(2 * v.len());
                    }
                }
                Change::Changed
            }
            Holders::Dense(d) => {
                let (w, b) = (slot as usize / 64, slot % 64);
                let Some(g) = d.groups.get_mut(w) else {
                    return Change::Unchanged;
                };
                let t = tier_bit.trailing_zeros() as usize;
                if g[t] >> b & 1 == 0 {
                    return Change::Unchanged;
                }
                g[t] &= !(1 << b);
                let still = (g[0] | g[1] | g[2] | g[3]) >> b & 1;
                d.count -= 1 - still as u32;
                // Back to a list (with hysteresis) once it is clearly smaller.
                while d.groups.last().is_some_and(|g| g.iter().all(|&x| x == 0)) {
                    d.groups.pop();
                }
                if (d.count as usize) < 4 * d.groups.len().max(1) {
                    let mut v = Vec::with_capacity(d.count as usize);
                    d.for_each(|s, m| v.push(pack(s, m)));
                    *self = if v.len() <= 2 {
                        let mut e = [0; 2];
                        e[..v.len()].copy_from_slice(&v);
                        Holders::Inline {
                            n: v.len() as u8,
                            e,
                        }
                    } else {
                        Holders::Sparse(Box::new(v))
                    };
                }
                Change::Changed
            }
        }
    }

    /// Calls `f(slot, mask)` for every holder, in slot order.
    pub(crate) fn for_each(&self, mut f: impl FnMut(u32, u8)) {
        match self {
            Holders::Inline { n, e } => e[..*n as usize].iter().for_each(|&x| {
                let (s, m) = unpack(x);
                f(s, m)
            }),
            Holders::Sparse(v) => v.iter().for_each(|&x| {
                let (s, m) = unpack(x);
                f(s, m)
            }),
            Holders::Dense(d) => d.for_each(f),
        }
    }
}

impl Dense {
    fn put(&mut self, slot: u32, mask: u8) {
        let (w, b) = (slot as usize / 64, slot % 64);
        let g = &mut self.groups[w];
        for (t, word) in g.iter_mut().enumerate() {
            if mask >> t & 1 == 1 {
                *word |= 1 << b;
            }
        }
        self.count += 1;
    }

    fn for_each(&self, mut f: impl FnMut(u32, u8)) {
        for (w, g) in self.groups.iter().enumerate() {
            let mut any = g[0] | g[1] | g[2] | g[3];
            while any != 0 {
                let b = any.trailing_zeros();
                any &= any - 1;
                let m = (0..4).fold(0u8, |m, t| m | ((((g[t] >> b) & 1) as u8) << t));
                f(w as u32 * 64 + b, m);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn snapshot(h: &Holders) -> BTreeMap<u32, u8> {
        let mut m = BTreeMap::new();
        h.for_each(|s, k| {
            assert!(k != 0);
            assert!(m.insert(s, k).is_none());
        });
        m
    }

    #[test]
    fn grows_to_dense_and_shrinks_back_to_inline() {
        let mut h = Holders::default();
        let mut model = BTreeMap::new();
        for s in (0..300u32).rev() {
            let bit = 1 << (s % 4);
            assert_eq!(h.set(s, bit), Change::Changed);
            assert_eq!(h.set(s, bit), Change::Unchanged);
            model.insert(s, bit);
        }
        assert!(matches!(h, Holders::Dense(_)));
        assert_eq!(snapshot(&h), model);
        for s in 0..300u32 {
            assert_eq!(h.mask(s), model[&s]);
        }
        for s in 0..299u32 {
            assert_eq!(h.clear(s, 1 << (s % 4)), Change::Changed);
            model.remove(&s);
            assert_eq!(snapshot(&h), model);
        }
        assert!(matches!(h, Holders::Inline { n: 1, .. }));
        assert_eq!(h.clear(299, 1 << (299 % 4)), Change::Changed);
        assert!(h.is_empty());
        assert_eq!(h.heap_bytes(), 0);
    }

    #[test]
    fn tier_bits_are_independent() {
        let mut h = Holders::default();
        h.set(5, DEV);
        h.set(5, HOST);
        assert_eq!(h.mask(5), DEV | HOST);
        assert_eq!(h.clear(5, 4), Change::Unchanged);
        assert_eq!(h.clear(5, DEV), Change::Changed);
        assert_eq!(h.mask(5), HOST);
        assert!(!h.is_empty());
        assert_eq!(h.clear(7, HOST), Change::Unchanged);
    }
}
