//! The reservation index and the active load it implies (spec §4.9–§4.12, §6.3, §6.4).
//!
//! A booking puts one selection id on one (worker, dp rank) with a list of
//! identities (sequence hashes, or random ones) and optionally some prefill
//! tokens. Per rank the ledger keeps:
//!
//! * `active_requests` — live bookings on the rank;
//! * `prefill_tokens` — booked prefill not yet marked prefill-complete;
//! * `decode_blocks` — the weighted number of DISTINCT identities active on the
//!   rank, rounded. Two identical prompts on one rank share their blocks; each
//!   (identity, rank) has a refcount and a weight (1.0 unless an
//!   `output_block` call with `decay_fraction` re-weighted it).
//!
//! Layout (three sharded structures and a slot allocator):
//!
//! * `bookings`: id -> booking, sharded by a hash of the id. Holding a booking
//!   shard lock while applying or removing a booking's effects makes each
//!   booking's lifecycle (book, prefill_complete, output_block, free)
//!   serial, and makes "claim the id" and "apply the load" one atomic step
//!   (a concurrent booking of the same id waits and then gets `Duplicate`).
//!   The price: other ids of that shard (1/64 of them) wait for the length of
//!   one booking's effects, ~0.1-0.4 ms for a 6,250-identity prompt.
//! * `ranks`: WorkerRank -> counters (atomics) plus a dense `slot` number. A
//!   rank's entry exists while it has live bookings; its slot is then reused.
//! * `idents`: identity -> the slots holding it, each with refcount and weight.
//!   This global index is what makes [`Ledger::new_blocks`] cost
//!   O(identities + hits) instead of O(ranks x identities). Large prompts
//!   are grouped by identity shard first, so each shard is locked once per
//!   call, not once per identity.
//! * per rank, its `Chains`: the fast path for [`IdentityForm::Chained`]
//!   identities (sequence hashes kvselect computed, each one a hash of all
//!   before it). Two such lists are equal up to their longest common prefix
//!   and nowhere after it, so the distinct identities of a rank's chained
//!   bookings form a trie, and a list's blocks not yet active there are those
//!   past its longest common prefix with any booking there. That prefix is a
//!   binary search (equality is monotone along two chains), so booking,
//!   freeing and `new_blocks` cost O(bookings on the rank x log identities)
//!   instead of one identity-table operation per identity, each a cache miss.
//!   A rank leaves this mode for the life of its entry ("tabled": its
//!   bookings' identities go into `idents`) when a booking with
//!   [`IdentityForm::Arbitrary`] identities lands on it, when a
//!   `decay_fraction` re-weights one of its bookings (weights are per
//!   identity), or when an arbitrary query asks about it. Output blocks
//!   always go to `idents` (random, so never shared).
//!
//! Lock order: booking shard -> rank shard -> slot allocator, booking shard
//! -> a rank's chains -> identity shard, and rank shard -> a rank's chains
//! (`stats`). [`Ledger::new_blocks`] and [`Ledger::loads`] take rank shards
//! one at a time, and a rank's chains before identity shards. No lock is held while calling code
//! outside this module, and no guard is returned.
//!
//! Exactness: every counter is a sum of per-booking (or per-(identity, rank))
//! contributions, and each contribution is changed only under the lock that
//! owns it, so the totals are exact and never transiently negative; readers
//! may observe a booking half-applied.
//!
//! Weights are fixed point (`WEIGHT_ONE` = 1.0) so that adding and removing
//! the same blocks returns the sum to exactly zero, which `f64` would not.
//!
//! Files: this one holds the public types and [`Ledger`] (bookings, rank
//! registry, identity shards); `new_blocks.rs` the selection hot path's
//! query; `chains.rs` a rank's counters
//! and chained bookings; `holders.rs` the holder list of one identity and
//! the holds that move a rank's weight; `tests.rs` the unit tests.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::table::{Hint, IdentTable};
use super::ReserveError;
use crate::fold::{mix, shard_of, FoldBuild};
use crate::index::WorkerRank;

mod chains;
mod holders;
mod new_blocks;

use chains::{Chains, RankCell};
use holders::{hold, hold_unweighted, unhold, Holders};

/// Bookings older than this are force-expired by [`Ledger::sweep_expired`]
/// (the selection doc's `DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS` default).
pub const DEFAULT_BOOKING_EXPIRY: Duration = Duration::from_secs(300);

const BOOKING_SHARDS: usize = 64;
const RANK_SHARDS: usize = 64;
const IDENT_SHARDS: usize = 256;

/// Fixed-point 1.0 for block weights (24 fractional bits: exact for the
/// dyadic fractions clients use, ~6e-8 resolution otherwise).
const WEIGHT_ONE: u32 = 1 << 24;

/// What a list of identities is, which decides whether the ledger may take
/// its prefix fast path (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdentityForm {
    /// Each identity is a hash of all the identities before it (sequence
    /// hashes kvselect computed from tokens), or a random one: two such lists
    /// share a common prefix and no identity after it.
    Chained,
    /// Anything else, e.g. `sequence_hashes` as a client sent them.
    Arbitrary,
}

/// What to book: one id on one rank.
#[derive(Debug, Clone, Copy)]
pub struct Booking<'a> {
    pub selection_id: &'a str,
    pub wr: WorkerRank,
    /// Identities (sequence hashes or random ones) of the prompt's full blocks.
    pub identities: &'a [u64],
    pub form: IdentityForm,
    /// Prefill tokens to book; 0 = none booked.
    pub prefill_tokens: u64,
    pub now: Instant,
}

/// A booking as seen from outside (returned by lookup and free).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BookingInfo {
    pub wr: WorkerRank,
    /// Prompt identities booked (as given, duplicates included).
    pub identities: usize,
    /// Synthetic output blocks added by `output_block`.
    pub output_blocks: usize,
    /// Prefill tokens still outstanding (0 after prefill_complete).
    pub prefill_tokens: u64,
    /// Prefill tokens booked originally.
    pub booked_prefill_tokens: u64,
    pub booked_at: Instant,
}

/// Current active load of one rank (the `/loads` row).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankLoad {
    pub prefill_tokens: u64,
    /// Weighted distinct active blocks, rounded half away from zero.
    pub decode_blocks: u64,
    pub active_requests: u64,
}

/// Sizes of the internal maps, for metrics and for tests that check that
/// everything drains back to empty.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LedgerStats {
    pub bookings: usize,
    pub ranks: usize,
    /// Identities in the identity table: those of tabled ranks' bookings
    /// and output blocks (distinct, counted once for all ranks).
    pub identities: usize,
    /// Distinct identities of chained bookings, summed over ranks.
    pub chained_identities: usize,
    pub slots_in_use: usize,
}

/// Reservation index + active load. See the module docs.
pub struct Ledger {
    expiry: Duration,
    key: u64,
    bookings: Box<[BookingShard]>,
    ranks: Box<[RankShard]>,
    idents: Box<[IdentShard]>,
    slots: Mutex<SlotAlloc>,
    /// Called after load is released (a prefill completion, a free, a
    /// sweep or a dropped worker), whoever released it: the selection
    /// queue waits on it.
    on_release: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
}

type BookingShard = Mutex<HashMap<Box<str>, Entry>>;
type RankShard = RwLock<HashMap<WorkerRank, Arc<RankCell>, FoldBuild>>;
type IdentMap = IdentTable<Holders>;

/// One identity shard: its table, and the table's prefetch hint (read
/// without the lock).
struct IdentShard {
    table: Mutex<IdentMap>,
    hint: Arc<Hint<Holders>>,
}

struct Entry {
    wr: WorkerRank,
    cell: Arc<RankCell>,
    /// The booked identities (shared with the rank's `Chains` while the rank
    /// is not tabled), then the output identities: in this order for the
    /// "exclusive suffix" walk of `decay_fraction`.
    prompt: Arc<[u64]>,
    outputs: Vec<u64>,
    prefill: u64,
    booked_prefill: u64,
    booked_at: Instant,
}

impl Entry {
    fn info(&self) -> BookingInfo {
        BookingInfo {
            wr: self.wr,
            identities: self.prompt.len(),
            output_blocks: self.outputs.len(),
            prefill_tokens: self.prefill,
            booked_prefill_tokens: self.booked_prefill,
            booked_at: self.booked_at,
        }
    }
}

#[derive(Default)]
struct SlotAlloc {
    next: u32,
    free: Vec<u32>,
}

thread_local! {
    /// Scratch for `by_ident_shard`: (identity, mixed) grouped by shard.
    static BY_SHARD: RefCell<Vec<(u64, u64)>> = const { RefCell::new(Vec::new()) };
}

/// Below this many identities, locking per identity is cheaper than grouping.
const GROUP_MIN: usize = 64;

/// How many identities ahead `by_ident_shard` prefetches a home bucket.
const PREFETCH_AHEAD: usize = 16;

/// A decay fraction as a fixed-point weight, clamped to 0..=1; NaN is ignored.
fn weight_fp(f: f64) -> Option<u32> {
    if f.is_nan() {
        return None;
    }
    Some((f.clamp(0.0, 1.0) * f64::from(WEIGHT_ONE)).round() as u32)
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger::new(DEFAULT_BOOKING_EXPIRY)
    }
}

impl Ledger {
    pub fn new(expiry: Duration) -> Ledger {
        fn shards<T: Default>(n: usize) -> Box<[T]> {
            (0..n).map(|_| T::default()).collect()
        }
        let key = rand::random::<u64>();
        Ledger {
            expiry,
            key,
            bookings: shards(BOOKING_SHARDS),
            ranks: (0..RANK_SHARDS)
                .map(|_| RwLock::new(HashMap::with_hasher(FoldBuild { key })))
                .collect(),
            idents: (0..IDENT_SHARDS)
                .map(|_| {
                    let table = IdentTable::new(key);
                    IdentShard {
                        hint: table.hint(),
                        table: Mutex::new(table),
                    }
                })
                .collect(),
            slots: Mutex::new(SlotAlloc::default()),
            on_release: std::sync::OnceLock::new(),
        }
    }

    /// Sets the release callback (once; later calls are ignored).
    pub fn set_on_release(&self, f: Box<dyn Fn() + Send + Sync>) {
        let _ = self.on_release.set(f);
    }

    fn released(&self) {
        if let Some(f) = self.on_release.get() {
            f();
        }
    }

    pub fn expiry(&self) -> Duration {
        self.expiry
    }

    fn booking_shard(&self, id: &str) -> &BookingShard {
        let h = xxhash_rust::xxh3::xxh3_64(id.as_bytes());
        &self.bookings[(h >> 58) as usize & (BOOKING_SHARDS - 1)]
    }

    fn rank_shard(&self, wr: WorkerRank) -> &RankShard {
        let m = mix(
            wr.worker_id ^ u64::from(wr.dp_rank).rotate_left(32),
            self.key,
        );
        &self.ranks[shard_of(m, RANK_SHARDS)]
    }

    /// The shard of identity `x` and `x` mixed (its position there).
    fn ident_shard(&self, x: u64) -> (&IdentShard, u64) {
        let m = mix(x, self.key);
        (&self.idents[shard_of(m, IDENT_SHARDS)], m)
    }

    /// Atomically claims `b.selection_id` and applies its load.
    pub fn book(&self, b: Booking<'_>) -> Result<(), ReserveError> {
        let prompt: Arc<[u64]> = Arc::from(b.identities);
        let shard = self.booking_shard(b.selection_id);
        let mut g = shard.lock();
        if g.contains_key(b.selection_id) {
            return Err(ReserveError::Duplicate);
        }
        let cell = self.acquire_rank(b.wr);
        cell.prefill.fetch_add(b.prefill_tokens, Ordering::Relaxed);
        let mut chains = cell.chains.lock();
        if b.form == IdentityForm::Chained && !chains.tabled {
            chains.add(&prompt, &cell);
            drop(chains);
        } else {
            self.table_rank(&mut chains, &cell);
            drop(chains);
            self.by_ident_shard(b.identities, |map, x, m| hold(map, x, m, &cell));
        }
        g.insert(
            b.selection_id.into(),
            Entry {
                wr: b.wr,
                cell,
                prompt,
                outputs: Vec::new(),
                prefill: b.prefill_tokens,
                booked_prefill: b.prefill_tokens,
                booked_at: b.now,
            },
        );
        Ok(())
    }

    pub fn is_booked(&self, id: &str) -> bool {
        self.booking_shard(id).lock().contains_key(id)
    }

    pub fn lookup(&self, id: &str) -> Option<BookingInfo> {
        self.booking_shard(id).lock().get(id).map(Entry::info)
    }

    /// Removes the booking's outstanding prefill tokens. Idempotent.
    pub fn prefill_complete(&self, id: &str) -> Result<(), ReserveError> {
        let mut g = self.booking_shard(id).lock();
        let e = g.get_mut(id).ok_or(ReserveError::NotFound)?;
        if e.prefill > 0 {
            e.cell.prefill.fetch_sub(e.prefill, Ordering::Relaxed);
            e.prefill = 0;
            drop(g);
            self.released();
        }
        Ok(())
    }

    /// Adds one synthetic output block (random identity) to the booking. With
    /// `Some(f)` (the caller validated `0.0..=1.0`; out-of-range values are
    /// clamped and NaN is ignored) the booking's exclusive suffix — walking
    /// back from its newest block while no other booking on the rank holds the
    /// block — is re-weighted to `f`, as Dynamo does.
    pub fn output_block(&self, id: &str, decay_fraction: Option<f64>) -> Result<(), ReserveError> {
        let x = rand::random::<u64>();
        let mut g = self.booking_shard(id).lock();
        let e = g.get_mut(id).ok_or(ReserveError::NotFound)?;
        let (shard, m) = self.ident_shard(x);
        hold(&mut shard.table.lock(), x, m, &e.cell);
        e.outputs.push(x);
        if let Some(w) = decay_fraction.and_then(weight_fp) {
            // Weights are per identity: the rank's bookings go to the table.
            self.table_rank(&mut e.cell.chains.lock(), &e.cell);
            for &b in e.outputs.iter().rev().chain(e.prompt.iter().rev()) {
                if !self.reweight_if_exclusive(b, &e.cell, w) {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Frees everything the booking holds.
    pub fn free(&self, id: &str) -> Result<BookingInfo, ReserveError> {
        let mut g = self.booking_shard(id).lock();
        let e = g.remove(id).ok_or(ReserveError::NotFound)?;
        self.unload(&e);
        drop(g);
        self.released();
        Ok(e.info())
    }

    pub fn rank_load(&self, wr: WorkerRank) -> RankLoad {
        self.rank_shard(wr)
            .read()
            .get(&wr)
            .map(|c| c.load())
            .unwrap_or_default()
    }

    /// One [`RankLoad`] per rank of `ranks`, in order.
    pub fn loads(&self, ranks: &[WorkerRank], out: &mut Vec<RankLoad>) {
        out.clear();
        out.extend(ranks.iter().map(|&wr| self.rank_load(wr)));
    }

    /// Drops every booking on any rank of `worker_id`; returns how many.
    pub fn drop_worker(&self, worker_id: u64) -> usize {
        self.drop_where(|e| e.wr.worker_id == worker_id)
    }

    /// Drops every booking on `wr`; returns how many.
    pub fn drop_rank(&self, wr: WorkerRank) -> usize {
        self.drop_where(|e| e.wr == wr)
    }

    /// Drops bookings at least `expiry` old at `now`; returns how many. The
    /// ledger has no timer: the server calls this periodically.
    pub fn sweep_expired(&self, now: Instant) -> usize {
        let expiry = self.expiry;
        self.drop_where(|e| now.saturating_duration_since(e.booked_at) >= expiry)
    }

    pub fn stats(&self) -> LedgerStats {
        let slots = self.slots.lock();
        let slots_in_use = slots.next as usize - slots.free.len();
        drop(slots);
        LedgerStats {
            bookings: self.bookings.iter().map(|s| s.lock().len()).sum(),
            ranks: self.ranks.iter().map(|s| s.read().len()).sum(),
            identities: self.idents.iter().map(|s| s.table.lock().len()).sum(),
            chained_identities: self
                .ranks
                .iter()
                .map(|s| {
                    s.read()
                        .values()
                        .map(|c| c.chains.lock().distinct as usize)
                        .sum::<usize>()
                })
                .sum(),
            slots_in_use,
        }
    }

    fn drop_where(&self, pred: impl Fn(&Entry) -> bool) -> usize {
        let mut n = 0;
        for shard in self.bookings.iter() {
            shard.lock().retain(|_, e| {
                if pred(e) {
                    self.unload(e);
                    n += 1;
                    false
                } else {
                    true
                }
            });
        }
        if n > 0 {
            self.released();
        }
        n
    }

    fn cell_of(&self, wr: WorkerRank) -> Option<Arc<RankCell>> {
        self.rank_shard(wr).read().get(&wr).cloned()
    }

    /// Takes `cell`'s rank out of chained mode: its chained bookings'
    /// identities go into the identity table (`chains` is the cell's, locked).
    fn table_rank(&self, chains: &mut Chains, cell: &RankCell) {
        if chains.tabled {
            return;
        }
        chains.tabled = true;
        // Each distinct identity already counts 1.0 in `weighted`, the weight
        // its table entry starts with: the holds leave the sum alone, so
        // readers never see it change.
        for ids in chains.lists.drain(..) {
            self.by_ident_shard(&ids, |map, x, m| {
                hold_unweighted(map, x, m, cell);
            });
        }
        chains.distinct = 0;
    }

    /// Gets (or creates) the rank's cell and counts one more request on it.
    fn acquire_rank(&self, wr: WorkerRank) -> Arc<RankCell> {
        let shard = self.rank_shard(wr);
        if let Some(c) = shard.read().get(&wr) {
            c.requests.fetch_add(1, Ordering::Relaxed);
            return Arc::clone(c);
        }
        let mut g = shard.write();
        let c = g.entry(wr).or_insert_with(|| {
            Arc::new(RankCell {
                slot: self.alloc_slot(),
                requests: AtomicU64::new(0),
                prefill: AtomicU64::new(0),
                weighted: AtomicU64::new(0),
                chains: Mutex::new(Chains::default()),
            })
        });
        c.requests.fetch_add(1, Ordering::Relaxed);
        Arc::clone(c)
    }

    /// Counts one request less; the last one removes the cell and frees its
    /// slot (by then the bookings on it have released all their blocks).
    fn release_rank(&self, wr: WorkerRank, cell: &Arc<RankCell>) {
        let mut g = self.rank_shard(wr).write();
        if cell.requests.fetch_sub(1, Ordering::Relaxed) == 1
            && g.get(&wr).is_some_and(|c| Arc::ptr_eq(c, cell))
        {
            g.remove(&wr);
            self.slots.lock().free.push(cell.slot);
        }
    }

    fn alloc_slot(&self) -> u32 {
        let mut s = self.slots.lock();
        if let Some(slot) = s.free.pop() {
            return slot;
        }
        let slot = s.next;
        s.next += 1;
        slot
    }

    /// Calls `f(table, x, mix(x))` for every identity `x` of `xs` with its
    /// shard's table locked, locking each shard once (identities grouped by
    /// a counting sort) when there are enough identities for that to pay off.
    /// While working on one identity it prefetches the home bucket of the
    /// identity `PREFETCH_AHEAD` places later, in whatever shard that is.
    /// The order of the calls is not the order of `xs`.
    fn by_ident_shard(&self, xs: &[u64], mut f: impl FnMut(&mut IdentMap, u64, u64)) {
        if xs.len() < GROUP_MIN {
            for &x in xs {
                let (shard, m) = self.ident_shard(x);
                f(&mut shard.table.lock(), x, m);
            }
            return;
        }
        BY_SHARD.with(|t| {
            let grouped = &mut *t.borrow_mut();
            grouped.clear();
            grouped.resize(xs.len(), (0, 0));
            let mut starts = [0usize; IDENT_SHARDS + 1];
            for &x in xs {
                starts[shard_of(mix(x, self.key), IDENT_SHARDS) + 1] += 1;
            }
            for i in 0..IDENT_SHARDS {
                starts[i + 1] += starts[i];
            }
            let mut fill = starts;
            for &x in xs {
                let m = mix(x, self.key);
                let sh = shard_of(m, IDENT_SHARDS);
                grouped[fill[sh]] = (x, m);
                fill[sh] += 1;
            }
            for &(_, m) in grouped.iter().take(PREFETCH_AHEAD) {
                self.idents[shard_of(m, IDENT_SHARDS)].hint.prefetch(m);
            }
            for (sh, shard) in self.idents.iter().enumerate() {
                let (lo, hi) = (starts[sh], starts[sh + 1]);
                if lo == hi {
                    continue;
                }
                let mut g = shard.table.lock();
                for p in lo..hi {
                    if let Some(&(_, ahead)) = grouped.get(p + PREFETCH_AHEAD) {
                        self.idents[shard_of(ahead, IDENT_SHARDS)]
                            .hint
                            .prefetch(ahead);
                    }
                    let (x, m) = grouped[p];
                    f(&mut g, x, m);
                }
            }
        });
    }

    fn reweight_if_exclusive(&self, x: u64, cell: &RankCell, w: u32) -> bool {
        let (shard, m) = self.ident_shard(x);
        let mut g = shard.table.lock();
        let Some(old) = g
            .get_mut(x, m)
            .and_then(|h| h.reweight_if_exclusive(cell.slot, w))
        else {
            return false;
        };
        if w >= old {
            cell.weighted
                .fetch_add(u64::from(w - old), Ordering::Relaxed);
        } else {
            cell.weighted
                .fetch_sub(u64::from(old - w), Ordering::Relaxed);
        }
        true
    }

    /// Removes all effects of a booking (called with its booking shard locked).
    fn unload(&self, e: &Entry) {
        let mut chains = e.cell.chains.lock();
        if chains.tabled {
            drop(chains);
            self.by_ident_shard(&e.prompt, |map, x, m| unhold(map, x, m, &e.cell));
        } else {
            chains.remove(&e.prompt, &e.cell);
            drop(chains);
        }
        self.by_ident_shard(&e.outputs, |map, x, m| unhold(map, x, m, &e.cell));
        if e.prefill > 0 {
            e.cell.prefill.fetch_sub(e.prefill, Ordering::Relaxed);
        }
        self.release_rank(e.wr, &e.cell);
    }
}

#[cfg(test)]
mod tests;
