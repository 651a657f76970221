//! Per-connection bounds: what a connection is doing, and when the server
//! closes it on its own.
//!
//! hyper's own HTTP/1 header timeout also runs while a keep-alive connection
//! waits for its next request, so it cannot be longer than the idle timeout;
//! and hyper has no idle timeout. Both are therefore kept here, by one
//! watchdog per connection (all of them ticking together, see
//! [`Activity::watchdog`]) reading an [`Activity`] that three parties update:
//! the socket wrapper [`Tracked`] (bytes read and written), the service
//! (requests in flight) and the drain (see `http::Server::serve`).
//!
//! The rules, checked by [`Activity::verdict`] (pure, unit-tested below):
//! - a request in flight is never cut here (its body has its own timeout in
//!   `Server::body`, its handler is bounded by the drain deadline);
//! - HTTP/1: once the first byte of a request head arrives (or the connection
//!   opens), the head must be complete within the header timeout;
//! - no request in flight and nothing written for the idle timeout: close;
//! - draining: HTTP/2 connections get GOAWAY at once (open streams finish);
//!   an HTTP/1 connection is closed once it has been quiet for
//!   [`DRAIN_QUIET`] between requests, and every response while draining
//!   carries `Connection: close`, so a client in the middle of a
//!   request/response loop gets its answer rather than a reset.
//!
//! At `--max-connections`, a new connection takes the slot of the open one
//! that has been quiet longest with no request in flight ([`Open`]): that
//! one is closed as by the idle timeout (a keep-alive client reconnects, as
//! it must after any idle close), and the new one is served once its slot is
//! free. So idle keep-alive pools and half-sent heads cannot lock out
//! `/health` or new clients. Only when every open connection has a request
//! in flight is the new one closed on accept. At most [`EVICT_WAITERS`]
//! accepted sockets wait for a freed slot, each at most [`EVICT_WAIT`].

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant as TokioInstant, Interval, MissedTickBehavior};

pub use crate::config::HttpLimits;

/// While draining, an HTTP/1 connection with no request in flight and no
/// bytes moving for this long is closed.
pub const DRAIN_QUIET: Duration = Duration::from_millis(250);

/// After the server starts closing a connection because of a timeout, it
/// drops the socket if the connection has not ended by then.
pub const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Accepted sockets waiting, at most, for a slot an eviction frees.
pub const EVICT_WAITERS: usize = 64;
/// How long such a socket waits before it is closed after all.
pub const EVICT_WAIT: Duration = Duration::from_millis(500);

/// The open connections of one listener, for eviction at the cap.
#[derive(Default)]
pub struct Open {
    conns: parking_lot::Mutex<HashMap<u64, Arc<Conn>>>,
    next: AtomicU64,
}

/// One open connection, as [`Open`] sees it.
pub struct Conn {
    activity: Arc<Activity>,
    /// Signalled to close this connection; its watchdog waits on it.
    pub evict: tokio::sync::Notify,
    evicting: AtomicBool,
}

/// Removes its connection from [`Open`] when dropped.
pub struct Registered<'a> {
    open: &'a Open,
    id: u64,
    pub conn: Arc<Conn>,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.open.conns.lock().remove(&self.id);
    }
}

impl Open {
    pub fn register(&self, activity: Arc<Activity>) -> Registered<'_> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            activity,
            evict: tokio::sync::Notify::new(),
            evicting: AtomicBool::new(false),
        });
        self.conns.lock().insert(id, Arc::clone(&conn));
        Registered {
            open: self,
            id,
            conn,
        }
    }

    /// Asks the connection quiet the longest, among those with no request
    /// in flight and not already asked, to close. False when there is none.
    pub fn evict_quietest(&self) -> bool {
        let victim = self
            .conns
            .lock()
            .values()
            .filter(|c| !c.evicting.load(Ordering::Relaxed))
            .filter_map(|c| c.activity.quiet_since().map(|t| (t, c)))
            .min_by_key(|(t, _)| *t)
            .map(|(_, c)| Arc::clone(c));
        let Some(c) = victim else {
            return false;
        };
        c.evicting.store(true, Ordering::Relaxed);
        c.evict.notify_one();
        true
    }
}

/// Milliseconds since the connection opened; 0 means "not set".
type Ms = u64;

/// What one connection is doing; shared by its socket, service and watchdog.
pub struct Activity {
    opened: Instant,
    /// Last successful write of at least one byte.
    last_write: AtomicU64,
    /// First byte of a request head not yet complete (HTTP/1), else 0.
    head_since: AtomicU64,
    /// When the last request in flight ended (or the connection opened).
    idle_since: AtomicU64,
    in_flight: AtomicU32,
    http2: AtomicBool,
}

/// What the watchdog should do with a connection now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Keep,
    HeaderTimeout,
    IdleTimeout,
    /// Draining: close gracefully (GOAWAY for HTTP/2).
    DrainClose,
    /// A connection beyond the cap took this idle one's slot ([`Open`]).
    Evicted,
}

impl Default for Activity {
    fn default() -> Self {
        Activity::new()
    }
}

impl Activity {
    pub fn new() -> Activity {
        Activity {
            opened: Instant::now(),
            last_write: AtomicU64::new(0),
            // The connection's first head is due from the moment it opens.
            head_since: AtomicU64::new(1),
            idle_since: AtomicU64::new(1),
            in_flight: AtomicU32::new(0),
            http2: AtomicBool::new(false),
        }
    }

    /// Now, in ms since the connection opened, never 0.
    pub fn now_ms(&self) -> Ms {
        self.opened.elapsed().as_millis() as u64 + 1
    }

    fn on_read(&self) {
        if self.in_flight.load(Ordering::Relaxed) == 0 {
            let _ = self.head_since.compare_exchange(
                0,
                self.now_ms(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    fn on_write(&self) {
        self.last_write.store(self.now_ms(), Ordering::Relaxed);
    }

    /// A request's head is complete and its handler starts; the guard ends it.
    pub fn begin(self: &Arc<Self>, http2: bool) -> InFlight {
        if http2 {
            self.http2.store(true, Ordering::Relaxed);
        }
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.head_since.store(0, Ordering::Relaxed);
        InFlight(Arc::clone(self))
    }

    /// With no request in flight: since when an HTTP/1 request head has
    /// been pending (`None` if none is), and since when the connection has
    /// been quiet (the later of the last request's end and the last write).
    fn idle(&self) -> Option<(Option<Ms>, Ms)> {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let head_since = self.head_since.load(Ordering::Relaxed);
        // HTTP/2 has no head rule: its frames are bounded by the h2 codec.
        let head = (!self.is_http2() && head_since != 0).then_some(head_since);
        let quiet = self
            .idle_since
            .load(Ordering::Relaxed)
            .max(self.last_write.load(Ordering::Relaxed));
        Some((head, quiet))
    }

    /// Since when the connection has done nothing, for eviction: `None`
    /// while a request is in flight; else the start of a pending HTTP/1
    /// head, or the time it went quiet.
    pub fn quiet_since(&self) -> Option<Instant> {
        let (head, quiet) = self.idle()?;
        Some(self.opened + Duration::from_millis(head.unwrap_or(quiet)))
    }

    pub fn is_http2(&self) -> bool {
        self.http2.load(Ordering::Relaxed)
    }

    /// The rules of the module doc, at `now` (ms since the connection opened).
    pub fn verdict(&self, now: Ms, limits: &HttpLimits, draining: bool) -> Verdict {
        let Some((head, quiet_since)) = self.idle() else {
            return Verdict::Keep;
        };
        let since = |t: Ms| Duration::from_millis(now.saturating_sub(t));
        let head_pending = head.is_some();
        if head.is_some_and(|h| since(h) >= limits.header_read_timeout) {
            return Verdict::HeaderTimeout;
        }
        if draining && (self.is_http2() || (!head_pending && since(quiet_since) >= DRAIN_QUIET)) {
            return Verdict::DrainClose;
        }
        if !head_pending && since(quiet_since) >= limits.idle_timeout {
            return Verdict::IdleTimeout;
        }
        Verdict::Keep
    }

    /// How often the watchdog should look.
    pub fn check_period(limits: &HttpLimits, draining: bool) -> Duration {
        if draining {
            return DRAIN_QUIET / 2;
        }
        (limits.header_read_timeout.min(limits.idle_timeout) / 4)
            .clamp(Duration::from_millis(20), Duration::from_secs(1))
    }

    /// The watchdog's ticker, every [`Activity::check_period`]. Every
    /// connection ticks on one grid of that period (counted from the
    /// process's first watchdog), so the timer wakes a worker once for all
    /// of them rather than once per connection: 256 idle keep-alive
    /// connections cost one wake-up a second, not 256.
    pub fn watchdog(limits: &HttpLimits, draining: bool) -> Interval {
        static GRID: OnceLock<TokioInstant> = OnceLock::new();
        let period = Activity::check_period(limits, draining);
        let origin = *GRID.get_or_init(TokioInstant::now);
        let next = next_on_grid(origin, TokioInstant::now(), period);
        let mut tick = tokio::time::interval_at(next, period);
        // Skip keeps later ticks on the grid after a late one.
        tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
        tick
    }
}

/// The first multiple of `period` after `origin` that is later than `now`.
fn next_on_grid(origin: TokioInstant, now: TokioInstant, period: Duration) -> TokioInstant {
    let p = period.as_nanos().max(1);
    let steps = now.saturating_duration_since(origin).as_nanos() / p + 1;
    origin + Duration::from_nanos(u64::try_from(steps * p).unwrap_or(u64::MAX))
}

/// A request in flight; ending it marks the connection idle from now.
pub struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let a = &self.0;
        a.idle_since.store(a.now_ms(), Ordering::Relaxed);
        a.head_since.store(0, Ordering::Relaxed);
        a.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A socket that reports its reads and writes to an [`Activity`].
pub struct Tracked<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S> Tracked<S> {
    pub fn new(inner: S, activity: Arc<Activity>) -> Tracked<S> {
        Tracked { inner, activity }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Tracked<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.on_read();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tracked<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.on_write();
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.on_write();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> HttpLimits {
        HttpLimits {
            header_read_timeout: Duration::from_millis(100),
            idle_timeout: Duration::from_millis(1000),
            ..HttpLimits::default()
        }
    }

    #[test]
    fn the_next_tick_is_the_first_grid_point_after_now() {
        let o = TokioInstant::now();
        let p = Duration::from_millis(250);
        let at = |ms| o + Duration::from_millis(ms);
        assert_eq!(next_on_grid(o, at(0), p), at(250));
        assert_eq!(next_on_grid(o, at(10), p), at(250));
        assert_eq!(next_on_grid(o, at(249), p), at(250));
        assert_eq!(next_on_grid(o, at(250), p), at(500));
        assert_eq!(next_on_grid(o, at(1_001), p), at(1_250));
    }

    /// Connections opened at different times tick at the same instants, so
    /// one timer wake-up serves all of their watchdogs.
    #[tokio::test]
    async fn watchdogs_opened_apart_tick_together() {
        let l = HttpLimits {
            header_read_timeout: Duration::from_secs(2),
            ..HttpLimits::default()
        };
        let mut first = Activity::watchdog(&l, false);
        tokio::time::sleep(Duration::from_millis(70)).await;
        let mut second = Activity::watchdog(&l, false);
        let period = Activity::check_period(&l, false);
        assert_eq!(period, Duration::from_millis(500));
        // A tick reports the instant it was due.
        let (mut a, mut b) = (first.tick().await, second.tick().await);
        // The first may be one grid point behind the second; never off it.
        if a < b {
            assert_eq!(b - a, period);
            a = first.tick().await;
        }
        assert_eq!(a, b);
        b = second.tick().await;
        assert_eq!(first.tick().await, b);
        let draining = Activity::watchdog(&l, true);
        let d = draining.period();
        assert_eq!(d, DRAIN_QUIET / 2);
    }

    #[test]
    fn a_silent_new_connection_meets_the_header_timeout() {
        let a = Activity::new();
        assert_eq!(a.verdict(50, &limits(), false), Verdict::Keep);
        assert_eq!(a.verdict(102, &limits(), false), Verdict::HeaderTimeout);
    }

    #[test]
    fn an_idle_keep_alive_connection_meets_the_idle_timeout_only() {
        let a = Arc::new(Activity::new());
        drop(a.begin(false)); // one request served at ~1 ms
        assert_eq!(a.verdict(500, &limits(), false), Verdict::Keep);
        assert_eq!(a.verdict(1100, &limits(), false), Verdict::IdleTimeout);
        // A head starting at 200 ms is due at 300 ms.
        a.head_since.store(200, Ordering::Relaxed);
        assert_eq!(a.verdict(250, &limits(), false), Verdict::Keep);
        assert_eq!(a.verdict(301, &limits(), false), Verdict::HeaderTimeout);
    }

    #[test]
    fn requests_in_flight_are_never_cut() {
        let a = Arc::new(Activity::new());
        let _g = a.begin(false);
        assert_eq!(a.verdict(1_000_000, &limits(), true), Verdict::Keep);
    }

    #[test]
    fn draining_closes_quiet_http1_and_any_idle_http2() {
        let a = Arc::new(Activity::new());
        drop(a.begin(false));
        let t = a.idle_since.load(Ordering::Relaxed);
        assert_eq!(a.verdict(t + 10, &limits(), true), Verdict::Keep);
        assert_eq!(a.verdict(t + 260, &limits(), true), Verdict::DrainClose);
        let b = Arc::new(Activity::new());
        drop(b.begin(true));
        assert_eq!(b.verdict(2, &limits(), true), Verdict::DrainClose);
        b.on_read();
        assert_eq!(b.verdict(500, &limits(), false), Verdict::Keep);
        assert_eq!(b.verdict(1100, &limits(), false), Verdict::IdleTimeout);
    }
}
