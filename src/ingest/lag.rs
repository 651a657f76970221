//! How far the index is behind the KV events that reached the process: the
//! input of the freshness gate (`app/freshness.rs`, issue #17 items 2-3).
//!
//! Each ingest thread publishes one instant: when it last stopped being
//! caught up. A thread is caught up when a round of its poll loop ended
//! with every socket it read emptied and every batch it read applied; it is
//! then about to sleep in its wait (`poll.rs`), and anything that arrives
//! wakes it. When the wait returns with work (a descriptor fired, or a socket left unread by
//! the per-round cap), the thread is behind from that instant until a round
//! ends caught up again. The index's lag is the longest such time over the
//! threads, read live (`now - since`), so a thread stuck in a long apply
//! shows a growing lag without publishing anything.
//!
//! This counts what libzmq holds unread, unlike the receipt-to-application
//! histogram, which starts when a batch is read: a backlog that never gets
//! read is exactly what makes an index stale. It is exact to within one
//! round (a batch that arrived while the previous round was applying is
//! counted from the next wait's return). What it cannot see is a thread
//! that the kernel has woken but not yet run: the appliers run at the same
//! scheduling priority as the HTTP threads, so on a busy core that wait
//! lasts until the scheduler gets to them. Ingest threads on cores of
//! their own (README, "Deployment") keep it short. A stream whose replay is
//! running parks its batches outside this measure; it is the stream-level
//! staleness of `/workers` instead.
//!
//! Catching up wakes the waiting requests (a `tokio::sync::Notify` for the
//! HTTP path, a condition variable for blocking callers), only when
//! someone waits, so the poll loop pays one atomic load per round otherwise.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The ingest threads' published catch-up state (module docs).
pub struct Lag {
    epoch: Instant,
    /// Per thread: nanoseconds after `epoch` (plus one) since when it is
    /// behind; 0 while it is caught up.
    behind_since: Box<[AtomicU64]>,
    /// Per thread: nanoseconds after `epoch` (plus one) when it last caught
    /// up after being behind.
    caught_up_at: Box<[AtomicU64]>,
    waiters: AtomicUsize,
    notify: tokio::sync::Notify,
    generation: Mutex<u64>,
    caught_up: Condvar,
}

impl Lag {
    pub(super) fn new(threads: usize) -> Lag {
        Lag {
            epoch: Instant::now(),
            behind_since: (0..threads).map(|_| AtomicU64::new(0)).collect(),
            caught_up_at: (0..threads).map(|_| AtomicU64::new(0)).collect(),
            waiters: AtomicUsize::new(0),
            notify: tokio::sync::Notify::new(),
            generation: Mutex::new(0),
            caught_up: Condvar::new(),
        }
    }

    /// Thread `i` has work it has not finished since `at` (kept if it was
    /// already behind: the oldest unfinished work counts).
    pub(super) fn behind(&self, i: usize, at: Instant) {
        let ns = self.ns(at);
        let _ = self.behind_since[i].compare_exchange(0, ns, Ordering::Release, Ordering::Relaxed);
    }

    /// Thread `i` applied everything it had read and emptied every socket
    /// it read.
    pub(super) fn caught_up(&self, i: usize) {
        if self.behind_since[i].swap(0, Ordering::Release) == 0 {
            return;
        }
        self.caught_up_at[i].store(self.ns(Instant::now()), Ordering::Release);
        if self.waiters.load(Ordering::Acquire) > 0 {
            self.notify.notify_waiters();
            *self.generation.lock().unwrap_or_else(|p| p.into_inner()) += 1;
            self.caught_up.notify_all();
        }
    }

    fn ns(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch).as_nanos() as u64 + 1
    }

    /// Whether every event that reached the process before `t` has been
    /// applied: each thread is caught up now, or caught up after `t`.
    pub fn applied_before(&self, t: Instant) -> bool {
        let t = self.ns(t);
        self.behind_since
            .iter()
            .zip(self.caught_up_at.iter())
            .all(|(b, c)| b.load(Ordering::Acquire) == 0 || c.load(Ordering::Acquire) >= t)
    }

    /// The index's lag now: the longest time any ingest thread has been
    /// behind (zero when all are caught up).
    pub fn now(&self) -> Duration {
        let now = self.epoch.elapsed().as_nanos() as u64 + 1;
        let oldest = self
            .behind_since
            .iter()
            .map(|a| a.load(Ordering::Acquire))
            .filter(|&ns| ns != 0)
            .min();
        oldest.map_or(Duration::ZERO, |ns| {
            Duration::from_nanos(now.saturating_sub(ns))
        })
    }

    /// Waits (without blocking the thread) until the lag is at most
    /// `bound`, or every event that reached the process before `arrived`
    /// is applied, or `deadline` passes: `Ok(lag)` or `Err(lag)` then.
    ///
    /// The second condition keeps waiting fair under a sustained load:
    /// with several threads, the moments when all of them are within the
    /// bound at once can be rare, but each thread finishes its rounds, so a
    /// waiter needs at most one round of each.
    pub async fn wait_within(
        &self,
        bound: Duration,
        arrived: Instant,
        deadline: Instant,
    ) -> Result<Duration, Duration> {
        let _w = Waiter::new(self);
        loop {
            // Registered before the look, so a catch-up between the look
            // and the wait still wakes it.
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let nap = match self.look(bound, arrived, deadline) {
                Look::Done(r) => return r,
                Look::Nap(nap) => nap,
            };
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep(nap) => {}
            }
        }
    }

    /// As [`Lag::wait_within`], blocking the calling thread.
    pub fn wait_within_blocking(
        &self,
        bound: Duration,
        arrived: Instant,
        deadline: Instant,
    ) -> Result<Duration, Duration> {
        let _w = Waiter::new(self);
        loop {
            // Read under the lock a catch-up takes, so none is missed.
            let g = self.generation.lock().unwrap_or_else(|p| p.into_inner());
            let seen = *g;
            let nap = match self.look(bound, arrived, deadline) {
                Look::Done(r) => return r,
                Look::Nap(nap) => nap,
            };
            let _ = self
                .caught_up
                .wait_timeout_while(g, nap, |gen| *gen == seen)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// One look for a waiter: done, or how long to nap at most.
    fn look(&self, bound: Duration, arrived: Instant, deadline: Instant) -> Look {
        // The catch-up test first, the lag after it: a catch-up between two
        // reads in the other order answered "applied" with the lag from
        // before it (about 1 look in 75 in a loop of the test below).
        let applied = self.applied_before(arrived);
        let lag = self.now();
        if lag <= bound || applied {
            return Look::Done(Ok(lag));
        }
        let now = Instant::now();
        if now >= deadline {
            return Look::Done(Err(lag));
        }
        Look::Nap(RECHECK.min(deadline - now))
    }
}

enum Look {
    Done(Result<Duration, Duration>),
    Nap(Duration),
}

/// A waiter looks again at least this often even without a catch-up (a
/// safety net; catching up wakes it at once).
const RECHECK: Duration = Duration::from_millis(10);

/// Counts a waiter for as long as it waits, so catching up notifies only
/// when someone listens.
struct Waiter<'a>(&'a Lag);

impl<'a> Waiter<'a> {
    fn new(lag: &'a Lag) -> Self {
        lag.waiters.fetch_add(1, Ordering::AcqRel);
        Waiter(lag)
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_is_the_oldest_unfinished_work() {
        let lag = Lag::new(2);
        assert_eq!(lag.now(), Duration::ZERO);
        let t0 = Instant::now();
        lag.behind(0, t0);
        std::thread::sleep(Duration::from_millis(20));
        lag.behind(1, Instant::now());
        // Thread 0's older start counts; a second `behind` keeps it.
        lag.behind(0, Instant::now());
        assert!(lag.now() >= Duration::from_millis(20), "{:?}", lag.now());
        lag.caught_up(0);
        // Thread 1 started at least 20 ms after t0.
        let now = lag.now();
        assert!(now + Duration::from_millis(19) <= t0.elapsed(), "{now:?}");
        lag.caught_up(1);
        assert_eq!(lag.now(), Duration::ZERO);
    }

    #[test]
    fn a_waiter_needs_one_catch_up_of_each_thread() {
        let lag = Lag::new(2);
        let early = Instant::now() - Duration::from_secs(1);
        lag.behind(0, early);
        lag.behind(1, early);
        let arrived = Instant::now();
        assert!(!lag.applied_before(arrived));
        lag.caught_up(0);
        // Thread 0 is done with what came before; thread 1 is not.
        assert!(!lag.applied_before(arrived));
        lag.behind(0, Instant::now());
        lag.caught_up(1);
        // Thread 0 is behind again, but only with newer work.
        assert!(lag.applied_before(arrived));
    }

    #[test]
    fn catching_up_wakes_a_blocking_waiter() {
        let lag = std::sync::Arc::new(Lag::new(1));
        lag.behind(0, Instant::now());
        std::thread::sleep(Duration::from_millis(5));
        let l = lag.clone();
        let t = std::thread::spawn(move || {
            let now = Instant::now();
            l.wait_within_blocking(Duration::ZERO, now, now + Duration::from_secs(30))
        });
        let give_up = Instant::now() + Duration::from_secs(10);
        while lag.waiters.load(Ordering::Acquire) == 0 {
            assert!(
                !t.is_finished() && Instant::now() < give_up,
                "the waiter never waited"
            );
            std::thread::yield_now();
        }
        lag.caught_up(0);
        assert_eq!(t.join().unwrap(), Ok(Duration::ZERO));
        assert!(lag.applied_before(Instant::now()));
        // Past the deadline, the lag comes back as an error.
        lag.behind(0, Instant::now());
        std::thread::sleep(Duration::from_millis(5));
        let now = Instant::now();
        let r = lag.wait_within_blocking(Duration::ZERO, now, now);
        assert!(r.is_err_and(|l| l >= Duration::from_millis(5)), "{r:?}");
    }
}
