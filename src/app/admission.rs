//! The selection queue (`DYN_ROUTER_QUEUE_THRESHOLD`): admission control in
//! front of `/select` and `/select_and_reserve`.
//!
//! Dynamo 1.6.1's behaviour, established by experiment against
//! `python -m dynamo.select_service` with the variable set:
//! - a candidate rank is busy when its active prefill tokens exceed
//!   `threshold x max_num_batched_tokens` (strictly: 256 of 256 is not busy);
//! - a selection whose candidates are all busy waits, and is admitted when a
//!   free or a prefill completion gives one room; `/loads` counts the waiting
//!   ones in `pending_count` and their prompt tokens in `pending_isl_tokens`;
//! - waiting requests are served before new ones, `strict_priority` first,
//!   then by arrival moved earlier by `priority_jump` seconds;
//! - `advisory` selects, explicit reservations, `/overlap_scores` and
//!   `/potential_loads` never wait;
//! - a client that disconnects leaves the queue.
//!
//! Dynamo waits without a bound. kvselect bounds the queue: a selection that
//! waited `--router-queue-max-wait-secs` is answered 429, and one that finds
//! `--router-queue-max-len` selections waiting is answered 429 at once, so
//! an overloaded fleet sheds load instead of piling up connections.
//!
//! Owns: the order of waiting selections per partition, their tickets, the
//! wake-ups (a `tokio::sync::Notify` for the HTTP path, a condition variable
//! for blocking callers such as the Python binding) and the queue's counters.
//!
//! Does not own: the busy test itself (`selection.rs` applies it to the
//! request's candidates) or what releases room: the ledger calls
//! [`Queue::released`] after every release, whoever made it (a local call,
//! the replica mesh, the expiry sweep, a removed worker), and the app after
//! a worker change. The periodic re-check ([`RECHECK`]) is a safety net.

use crate::config::QueueLimits;
use parking_lot::Mutex;
use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A waiting selection re-checks at least this often even without a
/// release (a safety net; releases wake it at once).
pub const RECHECK: Duration = Duration::from_millis(100);

type Part = (String, String);
/// Queue order: higher `strict_priority` first, then earlier (arrival -
/// `priority_jump`, in microseconds), then the ticket number.
type Order = (Reverse<u32>, i64, u64);

#[derive(Default)]
struct Waiting {
    next_ticket: u64,
    /// Per partition: order -> the request's prompt tokens.
    parts: HashMap<Part, BTreeMap<Order, u64>>,
    len: usize,
}

/// Why a selection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejected {
    /// `--router-queue-max-len` selections were already waiting.
    Full,
    /// It waited `--router-queue-max-wait-secs`.
    Timeout,
}

/// Counters for `/metrics`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct QueueStats {
    pub waiting: u64,
    /// Selections that waited and were then admitted.
    pub admitted_after_wait: u64,
    pub rejected_full: u64,
    pub rejected_timeout: u64,
}

pub struct Queue {
    pub limits: QueueLimits,
    started: Instant,
    waiting: Mutex<Waiting>,
    notify: tokio::sync::Notify,
    generation: std::sync::Mutex<u64>,
    changed: std::sync::Condvar,
    admitted_after_wait: AtomicU64,
    rejected_full: AtomicU64,
    rejected_timeout: AtomicU64,
}

/// A place in the queue; leaving it (drop) wakes the others, so the next in
/// line tries at once.
pub struct Ticket<'q> {
    queue: &'q Queue,
    part: Part,
    order: Order,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        {
            let mut guard = self.queue.waiting.lock();
            let w = &mut *guard;
            if let Some(q) = w.parts.get_mut(&self.part) {
                if q.remove(&self.order).is_some() {
                    w.len -= 1;
                }
                if q.is_empty() {
                    w.parts.remove(&self.part);
                }
            }
        }
        self.queue.released();
    }
}

impl Ticket<'_> {
    /// First in its partition's line.
    pub fn is_first(&self) -> bool {
        let w = self.queue.waiting.lock();
        w.parts
            .get(&self.part)
            .and_then(|q| q.keys().next())
            .is_some_and(|o| *o == self.order)
    }

    /// Marks the selection admitted (counted) and leaves the queue.
    pub fn admitted(self) {
        self.queue
            .admitted_after_wait
            .fetch_add(1, Ordering::Relaxed);
    }
}

impl Queue {
    pub fn new(limits: QueueLimits) -> Queue {
        Queue {
            limits,
            started: Instant::now(),
            waiting: Mutex::new(Waiting::default()),
            notify: tokio::sync::Notify::new(),
            generation: std::sync::Mutex::new(0),
            changed: std::sync::Condvar::new(),
            admitted_after_wait: AtomicU64::new(0),
            rejected_full: AtomicU64::new(0),
            rejected_timeout: AtomicU64::new(0),
        }
    }

    /// Whether selections wait in `model`/`group` now (a new one then
    /// queues behind them).
    pub fn has_waiting(&self, model: &str, group: &str) -> bool {
        let w = self.waiting.lock();
        w.parts
            .get(&(model.to_string(), group.to_string()))
            .is_some_and(|q| !q.is_empty())
    }

    /// Joins the line, or [`Rejected::Full`].
    pub fn enqueue(
        &self,
        model: &str,
        group: &str,
        strict_priority: u32,
        priority_jump: f64,
        isl_tokens: u64,
    ) -> Result<Ticket<'_>, Rejected> {
        let mut w = self.waiting.lock();
        if w.len >= self.limits.max_len {
            drop(w);
            self.rejected_full.fetch_add(1, Ordering::Relaxed);
            return Err(Rejected::Full);
        }
        let ticket = w.next_ticket;
        w.next_ticket += 1;
        let arrival = self.started.elapsed().as_micros() as i64;
        let jump = if priority_jump.is_finite() {
            (priority_jump * 1e6).clamp(-1e15, 1e15) as i64
        } else {
            0
        };
        let order = (Reverse(strict_priority), arrival - jump, ticket);
        let part = (model.to_string(), group.to_string());
        w.parts
            .entry(part.clone())
            .or_default()
            .insert(order, isl_tokens);
        w.len += 1;
        Ok(Ticket {
            queue: self,
            part,
            order,
        })
    }

    /// Counts a selection that gave up waiting.
    pub fn timed_out(&self) {
        self.rejected_timeout.fetch_add(1, Ordering::Relaxed);
    }

    /// Room may have been made (a free, a prefill completion, a worker
    /// change): every waiting selection re-checks.
    pub fn released(&self) {
        self.notify.notify_waiters();
        let mut g = self.generation.lock().unwrap_or_else(|p| p.into_inner());
        *g = g.wrapping_add(1);
        self.changed.notify_all();
    }

    /// A future that completes at the next [`Queue::released`]; create it
    /// (and enable it) before checking, so no release is missed.
    pub fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.notify.notified()
    }

    /// The current release generation, for [`Queue::wait_blocking`].
    pub fn generation(&self) -> u64 {
        *self.generation.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks until a release after `seen`, or `timeout`.
    pub fn wait_blocking(&self, seen: u64, timeout: Duration) {
        let g = self.generation.lock().unwrap_or_else(|p| p.into_inner());
        let _ = self
            .changed
            .wait_timeout_while(g, timeout, |g| *g == seen)
            .unwrap_or_else(|p| p.into_inner());
    }

    /// `(pending_count, pending_isl_tokens)` of a partition, for `/loads`.
    pub fn pending(&self, model: &str, group: &str) -> (u64, u64) {
        let w = self.waiting.lock();
        w.parts
            .get(&(model.to_string(), group.to_string()))
            .map_or((0, 0), |q| (q.len() as u64, q.values().sum()))
    }

    pub fn stats(&self) -> QueueStats {
        QueueStats {
            waiting: self.waiting.lock().len as u64,
            admitted_after_wait: self.admitted_after_wait.load(Ordering::Relaxed),
            rejected_full: self.rejected_full.load(Ordering::Relaxed),
            rejected_timeout: self.rejected_timeout.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(max_len: usize) -> Queue {
        Queue::new(QueueLimits {
            max_wait: Duration::from_secs(1),
            max_len,
        })
    }

    #[test]
    fn strict_priority_then_jumped_arrival_order_the_line() {
        let q = queue(10);
        let plain = q.enqueue("m", "g", 0, 0.0, 10).unwrap();
        let jump = q.enqueue("m", "g", 0, 100.0, 20).unwrap();
        let strict = q.enqueue("m", "g", 5, 0.0, 30).unwrap();
        let behind = q.enqueue("m", "g", 0, -100.0, 40).unwrap();
        let other = q.enqueue("m", "other", 0, 0.0, 50).unwrap();
        assert_eq!(q.pending("m", "g"), (4, 100));
        assert_eq!(q.pending("m", "other"), (1, 50));
        assert!(other.is_first(), "partitions queue apart");
        assert!(strict.is_first());
        drop(strict);
        assert!(jump.is_first());
        jump.admitted();
        assert!(plain.is_first());
        drop(plain);
        assert!(behind.is_first());
        assert_eq!(q.stats().waiting, 2);
        assert_eq!(q.stats().admitted_after_wait, 1);
        drop(behind);
        assert!(!q.has_waiting("m", "g"));
        assert_eq!(q.pending("m", "g"), (0, 0));
    }

    #[test]
    fn a_full_queue_rejects_and_counts() {
        let q = queue(2);
        let _a = q.enqueue("m", "g", 0, 0.0, 1).unwrap();
        let _b = q.enqueue("m", "h", 0, f64::NAN, 1).unwrap();
        assert_eq!(q.enqueue("m", "g", 9, 0.0, 1).err(), Some(Rejected::Full));
        q.timed_out();
        let s = q.stats();
        assert_eq!((s.waiting, s.rejected_full, s.rejected_timeout), (2, 1, 1));
    }

    #[test]
    fn blocking_waiters_wake_on_release() {
        let q = std::sync::Arc::new(queue(4));
        let seen = q.generation();
        let q2 = std::sync::Arc::clone(&q);
        let t = std::thread::spawn(move || {
            q2.wait_blocking(seen, Duration::from_secs(30));
            q2.generation()
        });
        std::thread::sleep(Duration::from_millis(20));
        q.released();
        assert_eq!(t.join().unwrap(), seen + 1);
    }
}
