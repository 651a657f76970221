//! The selection hot path's question: for each candidate rank, how many of
//! a prompt's identities are not active there ([`Ledger::new_blocks`]).
//!
//! Owns: the query and its per-thread scratch (hit counts per slot, runs of
//! identical holder lists). Does not: change any booking, hold, or weight
//! (except moving a rank into the table, which `table_rank` does).

use std::cell::RefCell;

use super::{IdentityForm, Ledger};
use crate::index::WorkerRank;

/// A queried rank that the table does not answer for (idle, or answered
/// from its chains).
const NO_QUERY: u32 = u32::MAX;

thread_local! {
    /// Scratch for `new_blocks`: hit counts per slot, the slots of the
    /// queried ranks, and the current run of identical holder lists.
    #[allow(clippy::type_complexity)]
    static SLOT_HITS: RefCell<(Vec<u32>, Vec<u32>, Vec<u32>)> =
        const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Holder lists at least this long are compared with the previous one so that
/// runs of identities held by the same ranks are counted once.
const RUN_MIN_HOLDERS: usize = 8;

/// Adds `times` hits to each of `slots` (slots past the table cannot have
/// been queried: they were allocated after the query was mapped).
#[inline]
fn add_hits(hits: &mut [u32], slots: &[u32], times: u32) {
    if times == 0 {
        return;
    }
    for &s in slots {
        if let Some(n) = hits.get_mut(s as usize) {
            *n += times;
        }
    }
}

impl Ledger {
    /// For each rank of `ranks`, how many of `identities` (assumed distinct)
    /// are not active on it; `out[i]` answers `ranks[i]`.
    ///
    /// A chained query on a chained rank costs O(bookings on the rank x log
    /// identities) (module docs). The table answers for the other ranks in
    /// O(identities + hits), and less for shared prefixes: each identity is
    /// looked up once in the global index, its holders' hit counters are
    /// bumped, and a run of identities with the very same holder list (a
    /// prefix active on many ranks) is counted with one comparison per
    /// identity. All-idle candidates skip the lookups. An `Arbitrary` query
    /// first moves every busy rank it asks about into the table (for the
    /// life of the rank's entry: until its bookings drain).
    ///
    /// Like every read here it is not a snapshot: bookings that change during
    /// the call may or may not be counted (the same as one read earlier or later).
    pub fn new_blocks(
        &self,
        ranks: &[WorkerRank],
        identities: &[u64],
        form: IdentityForm,
        out: &mut Vec<u64>,
    ) {
        out.clear();
        out.resize(ranks.len(), identities.len() as u64);
        if ranks.is_empty() || identities.is_empty() {
            return;
        }
        SLOT_HITS.with(|t| {
            let (hits, qslots, run) = &mut *t.borrow_mut();
            qslots.clear();
            // Chained ranks mostly share one prefix with the query (the
            // system prompt): each rank's answer is the next one's guess.
            let mut hint = 0;
            // A rank in chained mode answers a chained query from its lists;
            // the table answers for the others (an arbitrary query first
            // moves a chained rank's bookings into the table).
            for (o, &wr) in out.iter_mut().zip(ranks) {
                let Some(cell) = self.cell_of(wr) else {
                    qslots.push(NO_QUERY);
                    continue;
                };
                let mut chains = cell.chains.lock();
                if !chains.tabled && form == IdentityForm::Chained {
                    *o -= chains.max_lcp(identities, &mut hint) as u64;
                    qslots.push(NO_QUERY);
                } else {
                    self.table_rank(&mut chains, &cell);
                    qslots.push(cell.slot);
                }
            }
            // Idle candidates hold nothing: skip the identity lookups.
            let Some(&max) = qslots.iter().filter(|&&s| s != NO_QUERY).max() else {
                return;
            };
            // Hits are counted for every holder, queried or not: a plain
            // increment is cheaper than asking whether the slot was queried.
            hits.clear();
            hits.resize(max as usize + 1, 0);
            run.clear();
            let mut run_len = 0u32;
            self.by_ident_shard(identities, |map, x, m| {
                let Some(h) = map.get(x, m) else {
                    return;
                };
                let slots = h.slots();
                if slots.len() < RUN_MIN_HOLDERS {
                    add_hits(hits, slots, 1);
                } else if run_len > 0 && slots == &run[..] {
                    // A shared prefix: many identities with the very same
                    // holders. A memcmp is far cheaper than the increments.
                    run_len += 1;
                } else {
                    add_hits(hits, run, run_len);
                    run.clear();
                    run.extend_from_slice(slots);
                    run_len = 1;
                }
            });
            add_hits(hits, run, run_len);
            for (o, &s) in out.iter_mut().zip(qslots.iter()) {
                if let Some(&n) = hits.get(s as usize) {
                    *o = o.saturating_sub(u64::from(n));
                }
            }
        });
    }
}
