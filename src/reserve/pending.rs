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

use super::IdentityForm;
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
    pub identity_form: IdentityForm,
    pub isl_tokens: u64,
    pub effective_prefill_tokens: u64,
    pub expected_output_tokens: Option<u32>,
    pub track_prefill_tokens: bool,
    pub lora_name: Option<String>,
    /// The session a replay binds (session affinity on, not pinned).
    pub session_id: Option<String>,
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
            while g.map.len() >= self.max_entries || g.bytes.saturating_add(bytes) > self.max_bytes
            {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> PendingKey {
        PendingKey {
            model_name: "rv".into(),
            routing_group: "default".into(),
            selection_id: id.into(),
        }
    }

    fn sel(worker_id: u64, n: usize) -> PendingSelection {
        PendingSelection {
            wr: WorkerRank {
                worker_id,
                dp_rank: 0,
            },
            identities: (0..n as u64).collect(),
            identity_form: IdentityForm::Arbitrary,
            isl_tokens: 16 * n as u64,
            effective_prefill_tokens: 16,
            expected_output_tokens: Some(10),
            track_prefill_tokens: true,
            lora_name: None,
            session_id: None,
        }
    }

    fn take(c: &PendingCache, id: &str, now: Instant) -> Result<u64, ClaimError<()>> {
        c.claim(&key(id), now, |s| Ok::<_, ()>(s.wr.worker_id))
    }

    fn secs(t: f64) -> Duration {
        Duration::from_secs_f64(t)
    }

    #[test]
    fn ttl_hides_old_entries() {
        let c = PendingCache::new(secs(2.0), 10, 1 << 20);
        let t0 = Instant::now();
        c.insert(key("c1"), sel(1, 4), t0);
        assert_eq!(take(&c, "c1", t0 + secs(1.0)), Ok(1));
        c.insert(key("c1"), sel(1, 4), t0);
        assert_eq!(take(&c, "c1", t0 + secs(2.5)), Err(ClaimError::Missing));
        // exactly at the TTL the entry is already gone
        c.insert(key("c2"), sel(1, 4), t0);
        assert_eq!(take(&c, "c2", t0 + secs(2.0)), Err(ClaimError::Missing));
    }

    #[test]
    fn expired_entries_are_swept_on_insert() {
        let c = PendingCache::new(secs(2.0), 10, 1 << 20);
        let t0 = Instant::now();
        c.insert(key("a"), sel(1, 4), t0);
        c.insert(key("b"), sel(1, 4), t0 + secs(1.0));
        assert_eq!(c.len(), 2);
        c.insert(key("c"), sel(1, 4), t0 + secs(2.5)); // a expired, b not
        assert_eq!(c.len(), 2);
        assert_eq!(c.bytes(), 2 * entry_bytes(&key("b"), &sel(1, 4)));
        assert_eq!(take(&c, "b", t0 + secs(2.6)), Ok(1));
    }

    #[test]
    fn cap_two_evicts_oldest_first() {
        let c = PendingCache::new(secs(60.0), 2, 1 << 20);
        let t0 = Instant::now();
        for (i, id) in ["a", "b", "c"].into_iter().enumerate() {
            c.insert(key(id), sel(i as u64, 1), t0);
        }
        assert_eq!(c.len(), 2);
        assert_eq!(take(&c, "a", t0), Err(ClaimError::Missing));
        assert_eq!(take(&c, "b", t0), Ok(1));
        assert_eq!(take(&c, "c", t0), Ok(2));
    }

    #[test]
    fn byte_budget_evicts_oldest_and_oversized_entry_evicts_itself() {
        // id 1 + model 2 + group 7 + 4 identities x 16 = 74 bytes per entry
        let one = entry_bytes(&key("a"), &sel(0, 4));
        assert_eq!(one, 74);
        let c = PendingCache::new(secs(60.0), 100, 2 * one);
        let t0 = Instant::now();
        c.insert(key("a"), sel(1, 4), t0);
        c.insert(key("b"), sel(2, 4), t0);
        assert_eq!(c.bytes(), 2 * one);
        c.insert(key("c"), sel(3, 4), t0);
        assert_eq!((c.len(), c.bytes()), (2, 2 * one));
        assert_eq!(take(&c, "a", t0), Err(ClaimError::Missing));
        // larger than the whole budget: not kept, the others stay
        c.insert(key("d"), sel(4, 100), t0);
        assert_eq!(take(&c, "d", t0), Err(ClaimError::Missing));
        assert_eq!(take(&c, "b", t0), Ok(2));
        assert_eq!(take(&c, "c", t0), Ok(3));
        assert_eq!((c.len(), c.bytes()), (0, 0));
    }

    #[test]
    fn oversized_replacement_drops_the_old_entry() {
        let c = PendingCache::new(secs(60.0), 100, 100);
        let t0 = Instant::now();
        c.insert(key("a"), sel(1, 1), t0);
        c.insert(key("a"), sel(2, 100), t0);
        assert_eq!(take(&c, "a", t0), Err(ClaimError::Missing));
    }

    #[test]
    fn latest_wins() {
        let c = PendingCache::default();
        let t0 = Instant::now();
        c.insert(key("a"), sel(1, 4), t0);
        c.insert(key("a"), sel(2, 8), t0);
        assert_eq!(
            (c.len(), c.bytes()),
            (1, entry_bytes(&key("a"), &sel(2, 8)))
        );
        assert_eq!(take(&c, "a", t0), Ok(2));
    }

    #[test]
    fn partition_is_part_of_the_key() {
        let c = PendingCache::default();
        let t0 = Instant::now();
        c.insert(key("a"), sel(1, 4), t0);
        let other = PendingKey {
            model_name: "other".into(),
            ..key("a")
        };
        assert_eq!(
            c.claim(&other, t0, |_| Ok::<_, ()>(())),
            Err(ClaimError::Missing)
        );
        assert_eq!(take(&c, "a", t0), Ok(1));
    }

    #[test]
    fn rejected_claim_keeps_the_entry_and_success_is_single_use() {
        let c = PendingCache::default();
        let t0 = Instant::now();
        c.insert(key("a"), sel(7, 4), t0);
        let r: Result<(), _> = c.claim(&key("a"), t0, |s| Err(s.wr.worker_id));
        assert_eq!(r, Err(ClaimError::Rejected(7)));
        let r: Result<(), _> = c.claim(&key("a"), t0, |_| Err("503"));
        assert_eq!(r, Err(ClaimError::Rejected("503")));
        assert_eq!(take(&c, "a", t0), Ok(7));
        assert_eq!(take(&c, "a", t0), Err(ClaimError::Missing));
        assert_eq!((c.len(), c.bytes()), (0, 0));
    }

    #[test]
    fn discard_removes_the_entry() {
        let c = PendingCache::default();
        let t0 = Instant::now();
        c.insert(key("a"), sel(1, 4), t0);
        c.discard(&key("a"));
        c.discard(&key("never"));
        assert_eq!(take(&c, "a", t0), Err(ClaimError::Missing));
        assert!(c.is_empty());
    }

    #[test]
    fn zero_limits_keep_nothing() {
        let t0 = Instant::now();
        for c in [
            PendingCache::new(Duration::ZERO, 10, 1 << 20),
            PendingCache::new(secs(60.0), 0, 1 << 20),
            PendingCache::new(secs(60.0), 10, 0),
        ] {
            c.insert(key("a"), sel(1, 0), t0);
            assert_eq!(take(&c, "a", t0), Err(ClaimError::Missing));
            assert_eq!((c.len(), c.bytes()), (0, 0));
        }
    }

    #[test]
    fn concurrent_claim_sees_in_flight_and_lock_is_not_held_during_f() {
        let c = PendingCache::default();
        let t0 = Instant::now();
        c.insert(key("a"), sel(1, 4), t0);
        // The closure re-enters the cache: it would deadlock if claim held
        // the lock while running it.
        let r = c.claim(&key("a"), t0, |_| {
            assert_eq!(take(&c, "a", t0), Err(ClaimError::InFlight));
            assert_eq!(c.len(), 1);
            Ok::<_, ()>("booked")
        });
        assert_eq!(r, Ok("booked"));
        assert_eq!(take(&c, "a", t0), Err(ClaimError::Missing));
    }

    #[test]
    fn entry_replaced_during_claim_survives() {
        let c = PendingCache::default();
        let t0 = Instant::now();
        c.insert(key("a"), sel(1, 4), t0);
        let r = c.claim(&key("a"), t0, |s| {
            c.insert(key("a"), sel(2, 4), t0);
            Ok::<_, ()>(s.wr.worker_id)
        });
        assert_eq!(r, Ok(1));
        assert_eq!(take(&c, "a", t0), Ok(2));
    }

    #[test]
    fn panicking_claim_releases_the_entry() {
        let c = PendingCache::default();
        let t0 = Instant::now();
        c.insert(key("a"), sel(1, 4), t0);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = c.claim(&key("a"), t0, |_| -> Result<(), ()> { panic!("boom") });
        }));
        assert!(r.is_err());
        assert_eq!(take(&c, "a", t0), Ok(1));
    }

    #[test]
    fn concurrent_replays_book_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let c = PendingCache::default();
        let booked = AtomicUsize::new(0);
        let t0 = Instant::now();
        for round in 0..200 {
            let id = format!("r{round}");
            c.insert(key(&id), sel(1, 4), t0);
            std::thread::scope(|s| {
                for _ in 0..4 {
                    s.spawn(|| {
                        let r = c.claim(&key(&id), t0, |_| {
                            booked.fetch_add(1, Ordering::SeqCst);
                            Ok::<_, ()>(())
                        });
                        assert!(matches!(
                            r,
                            Ok(()) | Err(ClaimError::InFlight) | Err(ClaimError::Missing)
                        ));
                    });
                }
            });
        }
        assert_eq!(booked.load(Ordering::SeqCst), 200);
        assert!(c.is_empty());
    }
}
