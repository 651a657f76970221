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
#[inline]
fn chain_lcp(a: &[u64], b: &[u64], at_least: usize) -> usize {
    let n = a.len().min(b.len());
    if at_least >= n || a[at_least] != b[at_least] {
        return at_least;
    }
    let (mut lo, mut hi) = (at_least + 1, n);
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
    /// Longest common prefix of `ids` with any list.
    pub(super) fn max_lcp(&self, ids: &[u64]) -> usize {
        let mut best = 0;
        for l in &self.lists {
            best = chain_lcp(ids, l, best);
            if best == ids.len() {
                break;
            }
        }
        best
    }

    pub(super) fn add(&mut self, ids: &Arc<[u64]>, cell: &RankCell) {
        let fresh = (ids.len() - self.max_lcp(ids)) as u64;
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
        let gone = ((ids.len() - self.max_lcp(ids)) as u64).min(self.distinct);
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

    #[test]
    fn chain_lcp_binary_search() {
        let a = [1, 2, 3, 4, 5, 6, 7];
        assert_eq!(chain_lcp(&a, &[1, 2, 3, 9, 9], 0), 3);
        assert_eq!(chain_lcp(&a, &a, 0), 7);
        assert_eq!(chain_lcp(&a, &a[..4], 0), 4);
        assert_eq!(chain_lcp(&a, &[9, 9], 0), 0);
        assert_eq!(chain_lcp(&a, &[], 0), 0);
        // A list that cannot beat the best so far is skipped with one compare.
        assert_eq!(chain_lcp(&a, &[1, 2, 9], 5), 5);
        assert_eq!(chain_lcp(&a, &[1, 2], 5), 5);
        assert_eq!(chain_lcp(&a, &[1, 2, 3, 4, 5, 6, 0], 2), 6);
    }
}
