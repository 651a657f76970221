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

// Holder sets are a tagged pointer word (inline, sparse list or dense bitset).
#![allow(unsafe_code)]

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

/// The holder set of one node, in one word (so a node bucket is 32 bytes):
/// - `0`: empty (a vacant bucket);
/// - bit 0 set: inline, up to two packed entries of 31 bits each (bits 1..32
///   and 32..63; an entry of 0 is absent; sorted by slot), for slots below
///   2^27 (larger ones go to a list even when alone). With bit 63 set as
///   well there is one entry, and bits 32..63 are a run tag instead of a
///   second entry (see `runs.rs`);
/// - else a `Box<Vec<u32>>` (list form) or, with bit 1 set, a `Box<Dense>`;
///   both are 8-byte aligned, so the low bits are free for the tag.
///
/// Mutations decode to `Form` (no allocation: boxes move by pointer), run the
/// form's logic, and encode back.
#[derive(Default)]
pub(crate) struct Holders(u64);

const INLINE: u64 = 1;
const DENSE_TAG: u64 = 2;
const ENTRY_BITS: u64 = 0x7FFF_FFFF;
/// Inline with one entry and a run tag in the second entry's place.
const RUN_TAG: u64 = 1 << 63;
/// Largest run tag (31 bits).
pub(crate) const MAX_TAG: u32 = ENTRY_BITS as u32;

/// The second inline entry of word `w`; a run tag in its place reads as
/// absent (0).
#[inline]
fn second_entry(w: u64) -> u32 {
    if w & RUN_TAG != 0 {
        0
    } else {
        (w >> 32 & ENTRY_BITS) as u32
    }
}

impl Drop for Holders {
    fn drop(&mut self) {
        drop(self.take());
    }
}

impl std::fmt::Debug for Holders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.with(|form| form.fmt(f))
    }
}

impl Holders {
    /// Decodes the word, leaving `self` empty; the caller owns the boxes.
    fn take(&mut self) -> Form {
        let w = std::mem::take(&mut self.0);
        if w == 0 {
            return Form::default();
        }
        if w & INLINE != 0 {
            // A run tag is dropped with the word: mutations call `untag`
            // first, so that the run learns of it.
            let e = [(w >> 1 & ENTRY_BITS) as u32, second_entry(w)];
            let n = (e[0] != 0) as u8 + (e[1] != 0) as u8;
            return Form::Inline { n, e };
        }
        if w & DENSE_TAG != 0 {
            // SAFETY: a word with bit 1 set and bit 0 clear was made by
            // `put` from `Box::into_raw` of a `Box<Dense>` (8-byte aligned,
            // so `| DENSE_TAG` lost nothing), and `self.0` was just zeroed, so
            // this is the one owner.
            Form::Dense(unsafe { Box::from_raw((w & !DENSE_TAG) as usize as *mut Dense) })
        } else {
            // SAFETY: as above, from `Box::into_raw` of a `Box<Vec<u32>>`.
            Form::Sparse(unsafe { Box::from_raw(w as usize as *mut Vec<u32>) })
        }
    }

    /// Encodes `form` into `self` (which must be empty).
    fn put(&mut self, form: Form) {
        debug_assert_eq!(self.0, 0);
        self.0 = match form {
            Form::Inline { n: 0, .. } => 0,
            Form::Inline { n, e } if e[..n as usize].iter().all(|&x| x as u64 <= ENTRY_BITS) => {
                INLINE | (e[0] as u64) << 1 | (if n == 2 { e[1] as u64 } else { 0 }) << 32
            }
            Form::Inline { n, e } => {
                Box::into_raw(Box::new(e[..n as usize].to_vec())) as usize as u64
            }
            Form::Sparse(v) => Box::into_raw(v) as usize as u64,
            Form::Dense(d) => Box::into_raw(d) as usize as u64 | DENSE_TAG,
        };
    }

    /// Runs `f` on the decoded form without taking ownership.
    fn with<R>(&self, f: impl FnOnce(&Form) -> R) -> R {
        let mut copy = Holders(self.0);
        // `copy` aliases our boxes: it must not drop them.
        let form = std::mem::ManuallyDrop::new(copy.take());
        f(&form)
    }

    /// True when no slot holds the node (the only empty form a node keeps).
    #[inline]
    pub(crate) fn is_inline_empty(&self) -> bool {
        self.0 == 0
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.with(|f| f.is_empty())
    }

    /// Heap bytes owned (for stats).
    pub(crate) fn heap_bytes(&self) -> usize {
        if self.0 == 0 || self.0 & INLINE != 0 {
            return 0;
        }
        self.with(|f| f.heap_bytes())
    }

    /// Held in the list or bitset form: by three or more slots, as a shared
    /// prefix is (the nodes the prefix memo covers, `memo.rs`).
    #[inline]
    pub(crate) fn is_shared(&self) -> bool {
        self.0 != 0 && self.0 & INLINE == 0
    }

    /// The bitset form, if that is the current one.
    #[inline]
    pub(crate) fn dense(&self) -> Option<&Dense> {
        let w = self.0;
        if w & (INLINE | DENSE_TAG) != DENSE_TAG {
            return None;
        }
        // SAFETY: the tag says `w` is our `Box<Dense>`'s pointer (see
        // `take`); the box lives as long as `self` is not mutated, which the
        // returned borrow of `self` ensures.
        Some(unsafe { &*((w & !DENSE_TAG) as usize as *const Dense) })
    }

    /// Tier mask of `slot` (0 if absent).
    #[inline]
    pub(crate) fn mask(&self, slot: u32) -> u8 {
        let w = self.0;
        if w & INLINE != 0 {
            let (a, b) = ((w >> 1 & ENTRY_BITS) as u32, second_entry(w));
            // Absent entries are 0, whose mask bits are 0 too.
            let ma = if a >> 4 == slot { a & 0xF } else { 0 };
            let mb = if b >> 4 == slot { b & 0xF } else { 0 };
            return (ma | mb) as u8;
        }
        if w == 0 {
            return 0;
        }
        self.with(|f| f.mask(slot))
    }

    /// Tags a node held inline by exactly one slot (and not tagged yet) with
    /// `tag` (at most `MAX_TAG`); false if it is not in that form.
    pub(crate) fn tag(&mut self, tag: u32) -> bool {
        debug_assert!(tag <= MAX_TAG);
        let w = self.0;
        if w & (INLINE | RUN_TAG) != INLINE || w >> 32 & ENTRY_BITS != 0 {
            return false;
        }
        self.0 = w | RUN_TAG | (tag as u64) << 32;
        true
    }

    /// Removes the run tag, if any, and returns it.
    pub(crate) fn untag(&mut self) -> Option<u32> {
        let t = self.run_tag()?;
        self.0 &= !(RUN_TAG | ENTRY_BITS << 32);
        Some(t)
    }

    /// The run tag, if the node has one.
    #[inline]
    pub(crate) fn run_tag(&self) -> Option<u32> {
        let w = self.0;
        (w & (INLINE | RUN_TAG) == INLINE | RUN_TAG).then_some((w >> 32 & ENTRY_BITS) as u32)
    }

    /// Sets tier bit `tier_bit` (one of the four mask bits) for `slot`.
    pub(crate) fn set(&mut self, slot: u32, tier_bit: u8) -> Change {
        debug_assert!(self.run_tag().is_none(), "untag before mutating");
        let mut f = self.take();
        let c = f.set(slot, tier_bit);
        self.put(f);
        c
    }

    /// Clears tier bit `tier_bit` of `slot`.
    pub(crate) fn clear(&mut self, slot: u32, tier_bit: u8) -> Change {
        debug_assert!(self.run_tag().is_none(), "untag before mutating");
        let mut f = self.take();
        let c = f.clear(slot, tier_bit);
        self.put(f);
        c
    }

    /// Calls `f(slot, mask)` for every holder, in slot order.
    pub(crate) fn for_each(&self, f: impl FnMut(u32, u8)) {
        self.with(|form| form.for_each(f))
    }
}

#[derive(Debug)]
enum Form {
    /// Up to two packed entries; `n` of `e` are used, sorted by slot.
    Inline {
        n: u8,
        e: [u32; 2],
    },
    /// Sorted packed entries, few compared to the slot range (more than two,
    /// unless a slot is too large for the inline word).
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

impl Default for Form {
    fn default() -> Self {
        Form::Inline { n: 0, e: [0; 2] }
    }
}

/// Dense groups needed for slot numbers up to `max_slot`.
#[inline]
fn groups_for(max_slot: u32) -> usize {
    max_slot as usize / 64 + 1
}

impl Form {
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        match self {
            Form::Inline { n, .. } => *n == 0,
            Form::Sparse(v) => v.is_empty(),
            Form::Dense(d) => d.count == 0,
        }
    }

    /// Heap bytes owned (for stats).
    fn heap_bytes(&self) -> usize {
        match self {
            Form::Inline { .. } => 0,
            Form::Sparse(v) => std::mem::size_of::<Vec<u32>>() + v.capacity() * 4,
            Form::Dense(d) => {
                std::mem::size_of::<Dense>() + d.groups.capacity() * std::mem::size_of::<Group>()
            }
        }
    }

    /// Tier mask of `slot` (0 if absent).
    #[inline]
    fn mask(&self, slot: u32) -> u8 {
        match self {
            Form::Inline { n, e } => e[..*n as usize]
                .iter()
                .map(|&x| unpack(x))
                .find(|&(s, _)| s == slot)
                .map_or(0, |(_, m)| m),
            Form::Sparse(v) => match v.binary_search_by_key(&slot, |&x| x >> 4) {
                Ok(i) => unpack(v[i]).1,
                Err(_) => 0,
            },
            Form::Dense(d) => {
                let (w, b) = (slot as usize / 64, slot % 64);
                d.groups.get(w).map_or(0, |g| {
                    (0..4).fold(0u8, |m, t| m | ((((g[t] >> b) & 1) as u8) << t))
                })
            }
        }
    }

    /// Sets tier bit `tier_bit` (one of the four mask bits) for `slot`.
    fn set(&mut self, slot: u32, tier_bit: u8) -> Change {
        debug_assert!(slot <= MAX_SLOT);
        match self {
            Form::Inline { n, e } => {
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
                *self = Form::Sparse(Box::new(v));
                self.set(slot, tier_bit)
            }
            Form::Sparse(v) => {
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
                    *self = Form::Dense(Box::new(d));
                }
                Change::Changed
            }
            Form::Dense(d) => {
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
    fn clear(&mut self, slot: u32, tier_bit: u8) -> Change {
        match self {
            Form::Inline { n, e } => {
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
            Form::Sparse(v) => {
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
                        *self = Form::Inline {
                            n: v.len() as u8,
                            e,
                        };
                    } else if v.capacity() > 4 * v.len() {
                        v.shrink_to(2 * v.len());
                    }
                }
                Change::Changed
            }
            Form::Dense(d) => {
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
                        Form::Inline {
                            n: v.len() as u8,
                            e,
                        }
                    } else {
                        Form::Sparse(Box::new(v))
                    };
                }
                Change::Changed
            }
        }
    }

    /// Calls `f(slot, mask)` for every holder, in slot order.
    fn for_each(&self, mut f: impl FnMut(u32, u8)) {
        match self {
            Form::Inline { n, e } => e[..*n as usize].iter().for_each(|&x| {
                let (s, m) = unpack(x);
                f(s, m)
            }),
            Form::Sparse(v) => v.iter().for_each(|&x| {
                let (s, m) = unpack(x);
                f(s, m)
            }),
            Form::Dense(d) => d.for_each(f),
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
    #[test]
    fn a_run_tag_rides_on_a_single_inline_holder() {
        let mut h = Holders::default();
        assert!(!h.tag(5), "empty");
        h.set(7, DEV);
        assert!(h.tag(MAX_TAG));
        assert!(!h.tag(1), "already tagged");
        assert_eq!(h.run_tag(), Some(MAX_TAG));
        assert_eq!((h.mask(7), h.mask(0), h.mask(MAX_TAG >> 4)), (DEV, 0, 0));
        let mut n = 0;
        h.for_each(|s, m| {
            assert_eq!((s, m), (7, DEV));
            n += 1;
        });
        assert_eq!(n, 1);
        assert_eq!(h.untag(), Some(MAX_TAG));
        assert_eq!(h.untag(), None);
        h.set(9, HOST);
        assert!(!h.tag(3), "two holders");
        assert_eq!((h.mask(7), h.mask(9)), (DEV, HOST));
        h.clear(9, HOST);
        assert!(h.tag(0));
        assert_eq!(h.run_tag(), Some(0));
        assert_eq!(h.mask(7), DEV);
    }

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
        assert!(h.dense().is_some());
        assert_eq!(snapshot(&h), model);
        for s in 0..300u32 {
            assert_eq!(h.mask(s), model[&s]);
        }
        for s in 0..299u32 {
            assert_eq!(h.clear(s, 1 << (s % 4)), Change::Changed);
            model.remove(&s);
            assert_eq!(snapshot(&h), model);
        }
        assert!(h.0 & INLINE != 0 && h.0 >> 32 == 0);
        assert_eq!(h.clear(299, 1 << (299 % 4)), Change::Changed);
        assert!(h.is_empty());
        assert_eq!(h.heap_bytes(), 0);
    }

    #[test]
    fn slots_too_large_for_the_inline_word_go_to_a_list() {
        let mut h = Holders::default();
        let big = MAX_SLOT;
        assert_eq!(h.set(big, HOST), Change::Changed);
        assert!(h.0 & INLINE == 0 && h.heap_bytes() > 0);
        assert_eq!(h.set(3, DEV), Change::Changed);
        assert_eq!(h.set(big - 1, DEV), Change::Changed);
        assert_eq!((h.mask(big), h.mask(3), h.mask(big - 1)), (HOST, DEV, DEV));
        assert_eq!(h.clear(big, HOST), Change::Changed);
        assert_eq!(h.clear(big - 1, DEV), Change::Changed);
        // Only slot 3 is left: back to the inline word.
        assert!(h.0 & INLINE != 0 && h.heap_bytes() == 0);
        assert_eq!(snapshot(&h), BTreeMap::from([(3, DEV)]));
        assert_eq!(h.clear(3, DEV), Change::Changed);
        assert!(h.is_inline_empty());
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
