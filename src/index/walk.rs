//! The overlap walk: intersects holder sets block by block along a request's
//! key chain, keeping the three cumulative active sets (device; device or
//! host; any tier) as bitsets over slots, and recording the depth at which each
//! slot drops out of each set.
//!
//! Because a node's device holders are a subset of its device-or-host holders,
//! which are a subset of all its holders, the three active sets stay nested
//! (`dev ⊆ host ⊆ any`), so only the `any` set's non-zero word range is
//! scanned.

use super::holders::{Holders, DEV, HOST};

/// Scratch state of one walk (cloned to keep a shared prefix's, `memo.rs`).
#[derive(Default, Clone)]
pub(crate) struct Walk {
    /// Active sets: `set[0]` device, `set[1]` device|host, `set[2]` any.
    set: [Vec<u64>; 3],
    /// Sparse holders scattered into words (same layout as `set`).
    tmp: [Vec<u64>; 3],
    /// The slots that matched block 0 (all others stay at depth 0).
    first: Vec<u64>,
    /// Per slot, the block count where it left each set.
    depth: Vec<[u32; 3]>,
    lo: usize,
    hi: usize,
    started: bool,
    /// List mode, once few slots are left: (slot, which of the three sets it
    /// is still in, as bits 0..3). The bitsets are stale from then on.
    few: Vec<(u32, u8)>,
    listing: bool,
    /// The three active sets are equal (every active slot has matched on
    /// device so far): then a block changes nothing iff every active slot
    /// holds it on device, one AND-NOT per word.
    uniform: bool,
}

/// At most this many active slots switch the walk to list mode, where a step
/// costs a holder lookup per slot instead of a pass over bitset words.
const FEW: u32 = 4;

impl Walk {
    pub(crate) fn new() -> Walk {
        Walk::default()
    }

    /// True once no slot is active any more.
    #[inline]
    pub(crate) fn done(&self) -> bool {
        self.started
            && if self.listing {
                self.few.is_empty()
            } else {
                self.lo >= self.hi
            }
    }

    /// When exactly one slot is still active (list mode): that slot and the
    /// tier mask a block must intersect for it to stay in every set it is
    /// still in. The sets are nested, so one mask says it: device if it is
    /// still in the device set, else device|host if in that one, else any.
    /// A block that meets it changes nothing, so the caller may skip `step`.
    #[inline]
    pub(crate) fn single(&self) -> Option<(u32, u8)> {
        if !self.listing || self.few.len() != 1 {
            return None;
        }
        let (slot, state) = self.few[0];
        let need = if state & 1 != 0 {
            DEV
        } else if state & 2 != 0 {
            DEV | HOST
        } else {
            0xF
        };
        Some((slot, need))
    }

    /// Applies block `i` held by `holders` (`None`: nobody holds it).
    pub(crate) fn step(&mut self, i: u32, holders: Option<&Holders>) {
        let Some(h) = holders else {
            self.end(i);
            return;
        };
        if !self.started {
            self.start(h);
            self.maybe_list();
            return;
        }
        if self.listing {
            let mut j = 0;
            while j < self.few.len() {
                let (slot, mut state) = self.few[j];
                let m = h.mask(slot);
                let keep = (m & DEV != 0) as u8
                    | ((m & (DEV | HOST) != 0) as u8) << 1
                    | ((m != 0) as u8) << 2;
                let mut gone = state & !keep;
                if gone != 0 {
                    state &= keep;
                    while gone != 0 {
                        let k = gone.trailing_zeros() as usize;
                        gone &= gone - 1;
                        self.depth[slot as usize][k] = i;
                    }
                    if state == 0 {
                        self.few.swap_remove(j);
                        continue;
                    }
                    self.few[j].1 = state;
                }
                j += 1;
            }
            return;
        }
        match h.dense() {
            Some(d) => {
                let (lo, hi) = (self.lo, self.hi);
                let mid = hi.min(d.groups.len()).max(lo);
                if self.uniform && mid == hi {
                    let miss = d.groups[lo..hi]
                        .iter()
                        .zip(&self.set[2][lo..hi])
                        .fold(0, |m, (g, &a)| m | (a & !g[0]));
                    if miss == 0 {
                        return;
                    }
                }
                let [s0, s1, s2] = &mut self.set;
                let mut changed = false;
                // Intersect word by word; look for drop-outs only if some
                // word changed (rare in a long shared prefix).
                for (w, g) in d.groups[lo..mid]
                    .iter()
                    .enumerate()
                    .map(|(k, g)| (lo + k, g))
                {
                    let nd = g[0];
                    let nh = nd | g[1];
                    let na = nh | g[2] | g[3];
                    let (od, oh, oa) = (s0[w], s1[w], s2[w]);
                    changed |= (od & !nd) | (oh & !nh) | (oa & !na) != 0;
                }
                if changed {
                    for w in lo..mid {
                        let g = d.groups[w];
                        self.combine(i, w, [g[0], g[0] | g[1], g[0] | g[1] | g[2] | g[3]]);
                    }
                }
                for w in mid..hi {
                    self.combine(i, w, [0, 0, 0]);
                }
            }
            None => {
                let (lo, hi) = (self.lo, self.hi);
                h.for_each(|s, m| {
                    let w = s as usize / 64;
                    if w >= lo && w < hi {
                        let bit = 1u64 << (s % 64);
                        if m & DEV != 0 {
                            self.tmp[0][w] |= bit;
                        }
                        if m & (DEV | HOST) != 0 {
                            self.tmp[1][w] |= bit;
                        }
                        self.tmp[2][w] |= bit;
                    }
                });
                for w in lo..hi {
                    let n = [self.tmp[0][w], self.tmp[1][w], self.tmp[2][w]];
                    self.tmp[0][w] = 0;
                    self.tmp[1][w] = 0;
                    self.tmp[2][w] = 0;
                    self.combine(i, w, n);
                }
            }
        }
        while self.lo < self.hi && self.set[2][self.lo] == 0 {
            self.lo += 1;
        }
        while self.hi > self.lo && self.set[2][self.hi - 1] == 0 {
            self.hi -= 1;
        }
        self.check_uniform();
        self.maybe_list();
    }

    fn check_uniform(&mut self) {
        let [s0, s1, s2] = &self.set;
        let r = self.lo..self.hi;
        self.uniform = s0[r.clone()] == s2[r.clone()] && s1[r.clone()] == s2[r];
    }

    /// Switches to list mode once few slots are active.
    fn maybe_list(&mut self) {
        if self.hi - self.lo > FEW as usize {
            return;
        }
        let n: u32 = self.set[2][self.lo..self.hi]
            .iter()
            .map(|w| w.count_ones())
            .sum();
        if n > FEW {
            return;
        }
        self.few.clear();
        for w in self.lo..self.hi {
            let mut m = self.set[2][w];
            while m != 0 {
                let b = m.trailing_zeros() as usize;
                m &= m - 1;
                let bit = 1u64 << b;
                let state = (self.set[0][w] & bit != 0) as u8
                    | ((self.set[1][w] & bit != 0) as u8) << 1
                    | 1 << 2;
                self.few.push(((w * 64 + b) as u32, state));
            }
        }
        self.listing = true;
    }

    #[inline]
    fn combine(&mut self, i: u32, w: usize, n: [u64; 3]) {
        for (k, &nk) in n.iter().enumerate() {
            let old = self.set[k][w];
            let new = old & nk;
            let mut gone = old & !new;
            self.set[k][w] = new;
            while gone != 0 {
                let b = gone.trailing_zeros() as usize;
                gone &= gone - 1;
                self.depth[w * 64 + b][k] = i;
            }
        }
    }

    fn start(&mut self, h: &Holders) {
        let mut max = 0;
        h.for_each(|s, _| max = max.max(s));
        let words = max as usize / 64 + 1;
        for v in self.set.iter_mut().chain(self.tmp.iter_mut()) {
            v.clear();
            v.resize(words, 0);
        }
        self.depth.clear();
        self.depth.resize(words * 64, [0; 3]);
        h.for_each(|s, m| {
            let (w, bit) = (s as usize / 64, 1u64 << (s % 64));
            if m & DEV != 0 {
                self.set[0][w] |= bit;
            }
            if m & (DEV | HOST) != 0 {
                self.set[1][w] |= bit;
            }
            self.set[2][w] |= bit;
        });
        self.first.clear();
        self.first.extend_from_slice(&self.set[2]);
        self.started = true;
        self.listing = false;
        self.lo = 0;
        self.hi = words;
        while self.lo < self.hi && self.set[2][self.lo] == 0 {
            self.lo += 1;
        }
        while self.hi > self.lo && self.set[2][self.hi - 1] == 0 {
            self.hi -= 1;
        }
        self.check_uniform();
    }

    /// Every still-active slot leaves every set at block count `len`.
    pub(crate) fn end(&mut self, len: u32) {
        if !self.started {
            self.started = true;
            self.lo = 0;
            self.hi = 0;
            return;
        }
        if self.listing {
            for (slot, state) in self.few.drain(..) {
                for k in 0..3 {
                    if state >> k & 1 == 1 {
                        self.depth[slot as usize][k] = len;
                    }
                }
            }
            return;
        }
        for w in self.lo..self.hi {
            self.combine(len, w, [0, 0, 0]);
        }
        self.lo = self.hi;
    }

    /// Calls `f(slot, [device, host_ext, disk_ext])` for every slot that
    /// matched at least one block. Call after `end`.
    pub(crate) fn results(&self, mut f: impl FnMut(u32, [u32; 3])) {
        for (w, &word) in self.first.iter().enumerate() {
            let mut m = word;
            while m != 0 {
                let b = m.trailing_zeros() as usize;
                m &= m - 1;
                let [d, h, a] = self.depth[w * 64 + b];
                f(
                    (w * 64 + b) as u32,
                    [d, h.saturating_sub(d), a.saturating_sub(h)],
                );
            }
        }
    }
}
