//! A rank's counters and its chained bookings (the ledger's prefix fast path,
//! module docs of `ledger`).
//!
//! Owns: [`RankCell`] (a rank's atomics and slot) and [`Chains`] (its
//! chained bookings as a trie of shared prefixes, found by binary search).
//! Does not: touch the identity table (a tabled rank's identities are held
//! in `holders.rs`), or take any lock but the caller's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::{RankLoad, WEIGHT_ONE};

/// One rank with live bookings: its counters, its slot in the identity
/// table's holder lists, and its chained bookings.
pub(super) struct RankCell {
    pub(super) slot: u32,
    /// Changed only under the rank shard lock (read lock to increment an
    /// existing cell, write lock to decrement), so "reached zero -> remove the
    /// cell" cannot race with a new booking.
    pub(super) requests: AtomicU64,
    pub(super) prefill: AtomicU64,
    /// Sum of the weights of the distinct identities held, in WEIGHT_ONE units.
    pub(super) weighted: AtomicU64,
    pub(super) chains: Mutex<Chains>,
}

/// A rank's chained bookings (module docs). While `tabled` is false every
/// booking on the rank is in `lists`, and `idents` holds none of their
/// booked identities (only output blocks); once true, `lists` is empty for
/// good and `idents` holds them all.
#[derive(Default)]
pub(super) struct Chains {
    pub(super) tabled: bool,
    pub(super) lists: Vec<Arc<[u64]>>,
    /// Distinct identities over `lists` (each counted with weight 1.0 in the
    /// rank's `weighted`).
    pub(super) distinct: u64,
}

/// The larger of `at_least` and the length of the common prefix of two
/// chained lists. Equality is monotone along two chains (equal at `i` implies
/// equal before `i`), so a binary search finds where the prefix ends, and a
/// list that differs at index `at_least` cannot beat it (one compare).
///
/// `hint` is a guess of the answer (the prefix found on the previous list,
/// usually the fleet's shared system prompt): two compares confirm it, and a
/// wrong guess still halves the range. Each probe of a booked list is a cache
/// miss, so the confirmed guess saves about a dozen of them.
#[inline]
fn chain_lcp(a: &[u64], b: &[u64], at_least: usize, hint: usize) -> usize {
    let n = a.len().min(b.len());
    if at_least >= n {
        return at_least;
    }
    // Equal before `lo`; the first difference (or n) lies in lo..=hi.
    let (mut lo, mut hi) = (at_least, n);
    if at_least < hint && hint <= n {
        // Agreeing just before the guess means agreeing on all before it:
        // the probe at `at_least` (the list's cold first line) is skipped.
        if a[hint - 1] == b[hint - 1] {
            lo = hint;
        } else {
            hi = hint - 1;
        }
    }
    // The next probe: just past a confirmed guess, else at `at_least` (a
    // list that differs there cannot beat the best so far).
    if lo < hi {
        if a[lo] == b[lo] {
            lo += 1;
        } else {
            hi = lo;
        }
    }
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if a[mid] == b[mid] {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

impl Chains {
    /// Longest common prefix of `ids` with any list. `hint` is a guess at
    /// it ([`chain_lcp`]); a query over many ranks passes the answer on from
    /// rank to rank.
    pub(super) fn max_lcp(&self, ids: &[u64], hint: &mut usize) -> usize {
        let mut best = 0;
        for l in &self.lists {
            let lcp = chain_lcp(ids, l, best, *hint);
            if lcp > best {
                best = lcp;
                *hint = lcp;
            }
            if best == ids.len() {
                break;
            }
        }
        best
    }

    pub(super) fn add(&mut self, ids: &Arc<[u64]>, cell: &RankCell) {
        let fresh = (ids.len() - self.max_lcp(ids, &mut 0)) as u64;
        self.lists.push(Arc::clone(ids));
        self.distinct += fresh;
        cell.weighted
            .fetch_add(fresh * u64::from(WEIGHT_ONE), Ordering::Relaxed);
    }

    pub(super) fn remove(&mut self, ids: &Arc<[u64]>, cell: &RankCell) {
        let Some(i) = self.lists.iter().position(|l| Arc::ptr_eq(l, ids)) else {
            debug_assert!(false, "chained booking not on its rank");
            return;
        };
        self.lists.swap_remove(i);
        // Exact for chains; capped so that identities that break the chain
        // property (a 64-bit hash collision) cannot wrap the counts.
        let gone = ((ids.len() - self.max_lcp(ids, &mut 0)) as u64).min(self.distinct);
        self.distinct -= gone;
        cell.weighted
            .fetch_sub(gone * u64::from(WEIGHT_ONE), Ordering::Relaxed);
    }
}

impl RankCell {
    pub(super) fn load(&self) -> RankLoad {
        let w = self.weighted.load(Ordering::Relaxed);
        RankLoad {
            prefill_tokens: self.prefill.load(Ordering::Relaxed),
            decode_blocks: w.saturating_add(u64::from(WEIGHT_ONE / 2)) / u64::from(WEIGHT_ONE),
            active_requests: self.requests.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The search with no usable guess (hint 0).
    fn lcp(a: &[u64], b: &[u64], at_least: usize) -> usize {
        chain_lcp(a, b, at_least, 0)
    }

    #[test]
    fn chain_lcp_binary_search() {
        let a = [1, 2, 3, 4, 5, 6, 7];
        assert_eq!(lcp(&a, &[1, 2, 3, 9, 9], 0), 3);
        assert_eq!(lcp(&a, &a, 0), 7);
        assert_eq!(lcp(&a, &a[..4], 0), 4);
        assert_eq!(lcp(&a, &[9, 9], 0), 0);
        assert_eq!(lcp(&a, &[], 0), 0);
        // A list that cannot beat the best so far is skipped with one compare.
        assert_eq!(lcp(&a, &[1, 2, 9], 5), 5);
        assert_eq!(lcp(&a, &[1, 2], 5), 5);
        assert_eq!(lcp(&a, &[1, 2, 3, 4, 5, 6, 0], 2), 6);
    }

    /// Every guess, right, wrong or out of range, gives the answer of the
    /// plain search, for every prefix length, list length and lower bound.
    #[test]
    fn chain_lcp_any_hint_gives_the_same_answer() {
        let a: Vec<u64> = (1..=12).collect();
        for len in 0..=14usize {
            for common in 0..=len.min(a.len()) {
                let b: Vec<u64> = (0..len)
                    .map(|i| if i < common { a[i] } else { 100 + i as u64 })
                    .collect();
                let n = common.min(a.len()).min(len);
                for at_least in 0..=15 {
                    let want = if at_least >= n { at_least } else { n };
                    assert_eq!(lcp(&a, &b, at_least), want, "len {len} common {common}");
                    for hint in 0..=16 {
                        assert_eq!(
                            chain_lcp(&a, &b, at_least, hint),
                            want,
                            "len {len} common {common} at_least {at_least} hint {hint}"
                        );
                    }
                }
            }
        }
    }

    /// The guess passed from list to list (and on to the next rank) never
    /// changes `max_lcp`'s answer.
    #[test]
    fn max_lcp_with_a_carried_hint() {
        let base: Vec<u64> = (1..=40).collect();
        let list = |common: usize| -> Arc<[u64]> {
            (0..40)
                .map(|i| if i < common { base[i] } else { 1000 + i as u64 })
                .collect()
        };
        let chains = |commons: &[usize]| Chains {
            tabled: false,
            lists: commons.iter().map(|&c| list(c)).collect(),
            distinct: 0,
        };
        let ranks = [
            chains(&[10, 3]),
            chains(&[10]),
            chains(&[2, 25, 25]),
            chains(&[]),
            chains(&[40, 10]),
            chains(&[0]),
        ];
        let want = [10, 10, 25, 0, 40, 0];
        for start in [0, 1, 10, 25, 39, 40, 41, 99] {
            let mut hint = start;
            for (c, &w) in ranks.iter().zip(&want) {
                assert_eq!(c.max_lcp(&base, &mut hint), w, "start hint {start}");
            }
        }
    }
}
