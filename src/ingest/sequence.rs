//! The sequence rules of one KV-event stream (`kv-events.md` §5.1, §5.5,
//! §6.7), as a pure state machine.
//!
//! Owns: the cursor (last applied seq), the last seq seen on the live
//! stream, the replay in progress (its deadline and the live batch that
//! revealed the gap) and the replay backoff. Decides, from sequence numbers
//! and the times it is given:
//! - first batch seq 0 -> apply; first seq > 0 or `seq > last + 1` -> a gap:
//!   replay `[expected, seq)` (the listener asks its replay endpoint; the
//!   live batch waits here until the replay ends), or, with no replay
//!   possible, count the loss and apply;
//! - `seq <= last` -> stale, dropped (batches already applied by a replay);
//! - but a seq that does not increase *on the live stream itself* can only
//!   come from a new publisher process (a PUB socket delivers in order): the
//!   engine restarted, its block ids start over, so the listener clears its
//!   ranks and the cursor restarts. This covers Dynamo's restart hazard
//!   (§5.5), including a restart whose seq 0 we missed;
//! - a replay with no reply for the timeout is abandoned; a failed replay
//!   backs off (doubling up to a cap) before the next one is tried.
//!
//! Does not: own sockets, read a clock (every time is an argument), apply
//! batches or count anything: it answers what to do, and the listener
//! (`listener.rs`) does it and keeps the counters. `P` is the parked live
//! batch (`KvBatch` there, anything in the tests).

use std::time::{Duration, Instant};

/// What to do with a batch from the live stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Live {
    /// The stream's seq did not increase: a new publisher. Clear the ranks
    /// this stream fed before acting on `action` (the cursor is already reset).
    pub(crate) restart: bool,
    pub(crate) action: LiveAction,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LiveAction {
    /// The next seq: apply it, then report [`Sequence::applied`].
    Apply,
    /// At or below the cursor: drop it.
    Stale,
    /// Batches `[expected, seq)` are missing: replay them if
    /// [`Sequence::may_replay`] and the request can be sent (then
    /// [`Sequence::replay_sent`]), else count them lost and apply this one.
    Gap { expected: u64 },
}

/// What to do with a batch a replay delivered, or with the parked live batch
/// when the replay ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Catchup {
    /// Apply it; `lost` when batches between the cursor and it are gone for
    /// good (the engine's buffer no longer holds them).
    Apply { lost: bool },
    /// At or below the cursor: drop it.
    Stale,
}

/// How a replay ended, and the parked live batch with what to do with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Finished<P> {
    pub(crate) ok: bool,
    pub(crate) seq: u64,
    pub(crate) batch: P,
    pub(crate) catchup: Catchup,
}

/// Replay timing, from the ingest config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReplayTiming {
    /// A replay with no reply for this long is abandoned.
    pub(crate) timeout: Duration,
    /// Backoff after a failed replay: starts at `backoff_min`, doubles per
    /// failure up to `backoff_max`, and resets on a completed replay.
    pub(crate) backoff_min: Duration,
    pub(crate) backoff_max: Duration,
}

struct Replay<P> {
    /// No reply by then -> abandon.
    deadline: Instant,
    /// The live batch that revealed the gap.
    pending: (u64, P),
}

/// One stream's sequence state (module docs).
pub(crate) struct Sequence<P> {
    timing: ReplayTiming,
    /// Last applied seq.
    cursor: Option<u64>,
    /// Last seq seen on the live stream (restart detection).
    live_last: Option<u64>,
    replay: Option<Replay<P>>,
    /// No replay before this (after a failed one).
    not_before: Option<Instant>,
    backoff: Duration,
}

impl<P> Sequence<P> {
    pub(crate) fn new(timing: ReplayTiming) -> Self {
        Sequence {
            timing,
            cursor: None,
            live_last: None,
            replay: None,
            not_before: None,
            backoff: timing.backoff_min,
        }
    }

    pub(crate) fn replaying(&self) -> bool {
        self.replay.is_some()
    }

    /// When the replay in progress times out.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.replay.as_ref().map(|r| r.deadline)
    }

    /// The seq that would apply next; `None` once the cursor is at
    /// `u64::MAX` (nothing can follow it).
    fn expected(&self) -> Option<u64> {
        match self.cursor {
            None => Some(0),
            Some(c) => c.checked_add(1),
        }
    }

    /// A batch `seq` from the live stream.
    pub(crate) fn live(&mut self, seq: u64) -> Live {
        let restart = self.live_last.is_some_and(|l| seq <= l);
        if restart {
            self.cursor = None;
        }
        self.live_last = Some(seq);
        let action = match self.expected() {
            Some(e) if seq == e => LiveAction::Apply,
            Some(e) if seq > e => LiveAction::Gap { expected: e },
            _ => LiveAction::Stale,
        };
        Live { restart, action }
    }

    /// Whether a gap may be replayed at `now` (not backing off after a
    /// failed replay).
    pub(crate) fn may_replay(&self, now: Instant) -> bool {
        self.not_before.is_none_or(|t| now >= t)
    }

    /// The replay request for the gap before live batch `seq` went out at
    /// `now`; `batch` waits for the replay's end.
    pub(crate) fn replay_sent(&mut self, now: Instant, seq: u64, batch: P) {
        self.replay = Some(Replay {
            deadline: now + self.timing.timeout,
            pending: (seq, batch),
        });
    }

    /// A reply came in at `now`: the replay is alive, its deadline moves.
    pub(crate) fn replay_reply(&mut self, now: Instant) {
        if let Some(r) = &mut self.replay {
            r.deadline = now + self.timing.timeout;
        }
    }

    /// A batch `seq` delivered by a replay (or a parked live batch).
    pub(crate) fn catchup(&self, seq: u64) -> Catchup {
        match self.expected() {
            Some(e) if seq >= e => Catchup::Apply { lost: seq > e },
            _ => Catchup::Stale,
        }
    }

    /// `seq` was applied, or skipped for good (a replayed batch that does
    /// not decode): the cursor moves to it.
    pub(crate) fn applied(&mut self, seq: u64) {
        self.cursor = Some(seq);
    }

    /// Whether the replay in progress is past its deadline at `now`.
    pub(crate) fn timed_out(&self, now: Instant) -> bool {
        self.replay.as_ref().is_some_and(|r| now >= r.deadline)
    }

    /// A replay could not run (its socket failed): no replay before
    /// `now + backoff`, and the backoff doubles (capped).
    pub(crate) fn replay_failed(&mut self, now: Instant) {
        self.not_before = Some(now + self.backoff);
        self.backoff = (self.backoff * 2).min(self.timing.backoff_max);
    }

    /// Ends the replay in progress: `ok` (the end marker came) resets the
    /// backoff, otherwise (timeout, socket error) it is a failure at `now`.
    /// Returns the parked live batch and what to do with it; `None` when no
    /// replay was in progress.
    pub(crate) fn finish_replay(&mut self, ok: bool, now: Instant) -> Option<Finished<P>> {
        let r = self.replay.take()?;
        if ok {
            self.backoff = self.timing.backoff_min;
            self.not_before = None;
        } else {
            self.replay_failed(now);
        }
        let (seq, batch) = r.pending;
        Some(Finished {
            ok,
            seq,
            catchup: self.catchup(seq),
            batch,
        })
    }

    /// Drops the replay in progress without a verdict (the listener stops).
    pub(crate) fn abandon(&mut self) {
        self.replay = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Catchup as C;
    use LiveAction::{Apply, Gap, Stale};

    const TIMING: ReplayTiming = ReplayTiming {
        timeout: Duration::from_secs(2),
        backoff_min: Duration::from_millis(100),
        backoff_max: Duration::from_millis(500),
    };

    fn at(cursor: Option<u64>, live_last: Option<u64>) -> Sequence<&'static str> {
        let mut s = Sequence::new(TIMING);
        s.cursor = cursor;
        s.live_last = live_last;
        s
    }

    fn live(restart: bool, action: LiveAction) -> Live {
        Live { restart, action }
    }

    /// (cursor, last live seq, seq, verdict, cursor after).
    type LiveRow = (Option<u64>, Option<u64>, u64, Live, Option<u64>);

    /// Every live transition: (cursor, last live seq, seq) -> verdict and
    /// the cursor after it (as the listener leaves it: moved to `seq` when
    /// it applies); the last live seq is then `seq`.
    #[test]
    fn live_table() {
        const M: u64 = u64::MAX;
        #[rustfmt::skip]
        let table: &[LiveRow] = &[
            // first batch
            (None,    None,    0, live(false, Apply),                 Some(0)),
            (None,    None,    5, live(false, Gap { expected: 0 }),   None),
            // in order, and a gap on a running stream
            (Some(3), Some(3), 4, live(false, Apply),                 Some(4)),
            (Some(3), Some(3), 6, live(false, Gap { expected: 4 }),   Some(3)),
            // a replay ran ahead of the live stream: stale until it catches up
            (Some(5), Some(3), 4, live(false, Stale),                 Some(5)),
            (Some(5), Some(3), 5, live(false, Stale),                 Some(5)),
            (Some(5), Some(3), 6, live(false, Apply),                 Some(6)),
            (Some(5), Some(3), 8, live(false, Gap { expected: 6 }),   Some(5)),
            // the live seq did not increase: a restarted engine
            (Some(5), Some(5), 0, live(true, Apply),                  Some(0)),
            (Some(5), Some(5), 5, live(true, Gap { expected: 0 }),    None),
            (Some(5), Some(7), 2, live(true, Gap { expected: 0 }),    None),
            // a restart whose seq 0 we saw after a gap was parked
            (None,    Some(9), 0, live(true, Apply),                  Some(0)),
            // the end of the seq space: nothing follows u64::MAX
            (Some(M - 1), Some(M - 1), M, live(false, Apply),         Some(M)),
            (Some(M), Some(2), 3, live(false, Stale),                 Some(M)),
            (Some(M), Some(M), M, live(true, Gap { expected: 0 }),    None),
        ];
        for &(cursor, last, seq, want, cursor_after) in table {
            let mut s = at(cursor, last);
            let got = s.live(seq);
            assert_eq!(got, want, "cursor {cursor:?} live {last:?} seq {seq}");
            if got.action == Apply {
                s.applied(seq);
            }
            assert_eq!(s.cursor, cursor_after, "cursor after seq {seq}");
            assert_eq!(s.live_last, Some(seq));
        }
    }

    /// Replayed (or parked) batches: (cursor, seq) -> verdict.
    #[test]
    fn catchup_table() {
        #[rustfmt::skip]
        let table: &[(Option<u64>, u64, Catchup)] = &[
            (None,           0, C::Apply { lost: false }),
            (None,           3, C::Apply { lost: true }),
            (Some(4),        5, C::Apply { lost: false }),
            (Some(4),        9, C::Apply { lost: true }),
            (Some(4),        4, C::Stale),
            (Some(4),        1, C::Stale),
            (Some(u64::MAX), 0, C::Stale),
        ];
        for &(cursor, seq, want) in table {
            assert_eq!(
                at(cursor, None).catchup(seq),
                want,
                "cursor {cursor:?} seq {seq}"
            );
        }
    }

    /// A gap replayed to the end: replies move the deadline, replayed
    /// batches move the cursor, and the parked live batch is resolved
    /// against the cursor the replay left.
    #[test]
    fn replay_lifecycle() {
        let t0 = Instant::now();
        let s100 = Duration::from_millis(100);
        let mut s = at(Some(3), Some(3));
        assert_eq!(s.live(8), live(false, Gap { expected: 4 }));
        assert!(s.may_replay(t0) && !s.replaying());
        s.replay_sent(t0, 8, "live 8");
        assert!(s.replaying());
        assert_eq!(s.deadline(), Some(t0 + TIMING.timeout));
        assert!(!s.timed_out(t0 + TIMING.timeout - s100));
        s.replay_reply(t0 + s100);
        assert_eq!(s.deadline(), Some(t0 + s100 + TIMING.timeout));
        assert!(!s.timed_out(t0 + TIMING.timeout));
        for seq in 4..=9 {
            assert_eq!(s.catchup(seq), C::Apply { lost: false });
            s.applied(seq);
        }
        // The replay went past the parked batch: it is stale now.
        assert_eq!(
            s.finish_replay(true, t0),
            Some(Finished {
                ok: true,
                seq: 8,
                batch: "live 8",
                catchup: C::Stale
            })
        );
        assert!(!s.replaying() && s.deadline().is_none());
        assert_eq!(s.finish_replay(true, t0), None, "no replay in progress");
        assert_eq!(s.cursor, Some(9));
    }

    /// The engine's buffer had lost the start of the gap, and the replay
    /// ended short of the parked batch: both losses are reported.
    #[test]
    fn replay_with_losses_then_the_parked_batch_applies() {
        let t0 = Instant::now();
        let mut s = at(Some(3), Some(3));
        assert_eq!(s.live(10), live(false, Gap { expected: 4 }));
        s.replay_sent(t0, 10, "live 10");
        assert_eq!(s.catchup(6), C::Apply { lost: true });
        s.applied(6);
        assert_eq!(s.catchup(7), C::Apply { lost: false });
        s.applied(7);
        let f = s.finish_replay(true, t0).unwrap();
        assert_eq!(
            (f.seq, f.batch, f.catchup),
            (10, "live 10", C::Apply { lost: true })
        );
        s.applied(f.seq);
        assert_eq!(s.live(11), live(false, Apply));
    }

    /// Timeouts and socket failures back off, doubling up to the cap; a
    /// completed replay resets the backoff.
    #[test]
    fn failed_replays_back_off_and_success_resets() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut s = at(Some(0), Some(0));
        s.replay_sent(t0, 5, "live 5");
        assert!(s.timed_out(t0 + TIMING.timeout));
        // Timed out: the parked batch applies with the gap lost.
        let f = s.finish_replay(false, t0 + TIMING.timeout).unwrap();
        assert_eq!((f.ok, f.catchup), (false, C::Apply { lost: true }));
        let t1 = t0 + TIMING.timeout;
        assert!(!s.may_replay(t1));
        assert!(!s.may_replay(t1 + ms(99)));
        assert!(s.may_replay(t1 + ms(100)));
        // Socket failures: 200, 400, then capped at 500.
        for (i, wait) in [200, 400, 500, 500].into_iter().enumerate() {
            let t = t1 + ms(1000 * (i as u64 + 1));
            s.replay_failed(t);
            assert!(!s.may_replay(t + ms(wait - 1)), "failure {i}");
            assert!(s.may_replay(t + ms(wait)), "failure {i}");
        }
        // Success: no wait, and the next failure starts from the minimum.
        let t2 = t1 + ms(10_000);
        s.replay_sent(t2, 9, "live 9");
        assert!(s.finish_replay(true, t2).unwrap().ok);
        assert!(s.may_replay(t2));
        s.replay_failed(t2);
        assert!(!s.may_replay(t2 + ms(99)) && s.may_replay(t2 + ms(100)));
    }

    #[test]
    fn abandon_drops_the_replay_without_a_verdict() {
        let t0 = Instant::now();
        let mut s = at(Some(1), Some(1));
        s.replay_sent(t0, 4, "live 4");
        s.abandon();
        assert!(!s.replaying() && !s.timed_out(t0 + TIMING.timeout));
        assert_eq!(s.finish_replay(false, t0), None);
        assert!(s.may_replay(t0), "abandoning is not a failure");
        assert_eq!(s.cursor, Some(1));
    }
}
