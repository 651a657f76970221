//! The pending-selection cache behind the replay form of `POST /reservations`
//! (spec §6.1, §6.2).
//!
//! A `/select` carrying a `selection_id` stores its booking inputs under
//! `(model_name, routing_group, selection_id)`; a later replay books exactly
//! those inputs. Rules:
//!
//! * latest wins: a second insert of a key replaces the first;
//! * single use: a successful claim removes the entry; a rejected one (the
//!   caller's booking failed with 409/503/404) keeps it for a retry;
//! * TTL: an entry whose age is >= the TTL is invisible (so TTL 0 keeps
//!   nothing); expired entries are swept on insert;
//! * capacity: beyond `max_entries`, or over the byte budget, the oldest
//!   entries are evicted first; an entry larger than the whole budget is not
//!   kept (and evicts nothing else);
//! * a claim runs the caller's booking closure WITHOUT the lock held: the
//!   entry is marked in flight, so a concurrent claim of the same key gets
//!   [`ClaimError::InFlight`] instead of booking twice.
//!
//! One mutex guards the map and its age order: eviction is global
//! oldest-first, which a sharded layout could not do exactly, and every
//! critical section is O(log n) with the payload allocated and freed outside.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::index::WorkerRank;

/// Default lifetime of an unclaimed pending selection (`--selection-cache-ttl-secs`).
pub const DEFAULT_PENDING_TTL: Duration = Duration::from_secs(120);
/// Default cap on pending selections (`--selection-cache-max-entries`).
pub const DEFAULT_PENDING_MAX_ENTRIES: usize = 4096;
/// Default byte budget for pending selections (`--selection-cache-max-bytes`).
pub const DEFAULT_PENDING_MAX_BYTES: usize = 268_435_456;

/// Cache key: the partition and the selection id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PendingKey {
    pub model_name: String,
    pub routing_group: String,
    pub selection_id: String,
}

/// The booking inputs a `/select` chose (everything a replay books).
#[derive(Debug, Clone, PartialEq)]
pub struct PendingSelection {
    pub wr: WorkerRank,
    pub identities: Vec<u64>,
    pub isl_tokens: u64,
    pub effective_prefill_tokens: u64,
    pub expected_output_tokens: Option<u32>,
    pub track_prefill_tokens: bool,
    pub lora_name: Option<String>,
}

/// Why a claim did not book.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimError<E> {
    /// No visible entry: never selected, expired, already used, evicted or
    /// discarded (404 `no pending selection ...`).
    Missing,
    /// Another claim of the same key is running its booking right now; the
    /// id is "being reserved" (409).
    InFlight,
    /// The caller's closure refused; the entry is kept for a retry.
    Rejected(E),
}

/// The pending-selection cache. See the module docs.
pub struct PendingCache {
    ttl: Duration,
    max_entries: usize,
    max_bytes: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    map: HashMap<Arc<PendingKey>, Slot>,
    /// Insertion sequence -> key; the first entry is the oldest.
    order: BTreeMap<u64, Arc<PendingKey>>,
    next_seq: u64,
    bytes: usize,
}

struct Slot {
    sel: Arc<PendingSelection>,
    inserted: Instant,
    seq: u64,
    bytes: usize,
    in_flight: bool,
}

impl Inner {
    /// Removes `key`'s entry; returns its payload so the caller can free it
    /// after unlocking.
    fn remove(&mut self, key: &PendingKey) -> Option<Arc<PendingSelection>> {
        let slot = self.map.remove(key)?;
        self.order.remove(&slot.seq);
        self.bytes -= slot.bytes;
        Some(slot.sel)
    }

    fn pop_oldest(&mut self) -> Option<Arc<PendingSelection>> {
        let (_, key) = self.order.pop_first()?;
        let slot = self.map.remove(&key)?;
        self.bytes -= slot.bytes;
        Some(slot.sel)
    }
}

/// Approximate bytes one entry costs (spec §6.2): identities counted twice
/// (the cached copy and the booking made from it) plus the strings.
fn entry_bytes(key: &PendingKey, sel: &PendingSelection) -> usize {
    sel.identities
        .len()
        .saturating_mul(16)
        .saturating_add(key.selection_id.len())
        .saturating_add(key.model_name.len())
        .saturating_add(key.routing_group.len())
        .saturating_add(sel.lora_name.as_ref().map_or(0, String::len))
}

impl Default for PendingCache {
    fn default() -> Self {
        PendingCache::new(
            DEFAULT_PENDING_TTL,
            DEFAULT_PENDING_MAX_ENTRIES,
            DEFAULT_PENDING_MAX_BYTES,
        )
    }
}

impl PendingCache {
    /// `ttl` 0, `max_entries` 0 or `max_bytes` 0 are accepted: nothing survives.
    pub fn new(ttl: Duration, max_entries: usize, max_bytes: usize) -> PendingCache {
        PendingCache {
            ttl,
            max_entries,
            max_bytes,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn expired(&self, inserted: Instant, now: Instant) -> bool {
        now.saturating_duration_since(inserted) >= self.ttl
    }

    /// Stores `sel` under `key` (replacing any previous entry), sweeping
    /// expired entries and evicting the oldest ones to stay within limits.
    pub fn insert(&self, key: PendingKey, sel: PendingSelection, now: Instant) {
        let bytes = entry_bytes(&key, &sel);
        let key = Arc::new(key);
        let sel = Arc::new(sel);
        // Payloads leave the lock in here and are freed after it.
        let mut freed: Vec<Arc<PendingSelection>> = Vec::new();
        let mut g = self.inner.lock();
        while let Some((_, k)) = g.order.first_key_value() {
            let inserted = g.map.get(&**k).map(|s| s.inserted);
            if inserted.is_some_and(|t| !self.expired(t, now)) {
                break;
            }
            freed.extend(g.pop_oldest());
        }
        freed.extend(g.remove(&key));
        let keep = !self.ttl.is_zero() && self.max_entries > 0 && bytes <= self.max_bytes;
        if keep {
            while g.map.len() >= self.max_entries || g.bytes + bytes > self.max_bytes {
                match g.pop_oldest() {
                    Some(old) => freed.push(old),
                    None => break,
                }
            }
            let seq = g.next_seq;
            g.next_seq += 1;
            g.order.insert(seq, Arc::clone(&key));
            g.bytes += bytes;
            g.map.insert(
                key,
                Slot {
                    sel,
                    inserted: now,
                    seq,
                    bytes,
                    in_flight: false,
                },
            );
        }
        drop(g);
        drop(freed);
    }

    /// Runs `f` on the entry for `key` (the caller books inside it). On `Ok`
    /// the entry is removed (single use); on `Err` it is kept and the error
    /// comes back as [`ClaimError::Rejected`]. The lock is not held while `f`
    /// runs; concurrent claims of the same key get [`ClaimError::InFlight`].
    pub fn claim<T, E>(
        &self,
        key: &PendingKey,
        now: Instant,
        f: impl FnOnce(&PendingSelection) -> Result<T, E>,
    ) -> Result<T, ClaimError<E>> {
        let (sel, seq) = {
            let mut g = self.inner.lock();
            let Some(slot) = g.map.get(key) else {
                return Err(ClaimError::Missing);
            };
            if self.expired(slot.inserted, now) {
                let old = g.remove(key);
                drop(g);
                drop(old);
                return Err(ClaimError::Missing);
            }
            let Some(slot) = g.map.get_mut(key) else {
                return Err(ClaimError::Missing);
            };
            if slot.in_flight {
                return Err(ClaimError::InFlight);
            }
            slot.in_flight = true;
            (Arc::clone(&slot.sel), slot.seq)
        };
        // Unmarks the entry if `f` panics, so the key does not stay "being
        // reserved" until its TTL runs out.
        let mut guard = InFlight {
            cache: self,
            key,
            seq,
            armed: true,
        };
        let r = f(&sel);
        guard.armed = false;
        let mut g = self.inner.lock();
        // Only touch the entry this claim marked: it may have been replaced
        // (latest wins), discarded or evicted meanwhile.
        let same = g.map.get(key).is_some_and(|s| s.seq == seq);
        let old = match (&r, same) {
            (Ok(_), true) => g.remove(key),
            (Err(_), true) => {
                if let Some(s) = g.map.get_mut(key) {
                    s.in_flight = false;
                }
                None
            }
            (_, false) => None,
        };
        drop(g);
        drop(old);
        r.map_err(ClaimError::Rejected)
    }

    /// Removes the entry for `key` (an explicit booking of the id discards it).
    pub fn discard(&self, key: &PendingKey) {
        let old = self.inner.lock().remove(key);
        drop(old);
    }

    /// Entries stored (expired ones count until swept).
    pub fn len(&self) -> usize {
        self.inner.lock().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Approximate bytes held, by the §6.2 formula.
    pub fn bytes(&self) -> usize {
        self.inner.lock().bytes
    }
}

struct InFlight<'a> {
    cache: &'a PendingCache,
    key: &'a PendingKey,
    seq: u64,
    armed: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut g = self.cache.inner.lock();
        if let Some(s) = g.map.get_mut(self.key) {
            if s.seq == self.seq {
                s.in_flight = false;
            }
        }
    }
}
