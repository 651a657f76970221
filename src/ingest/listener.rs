//! One listener: the SUB socket of one (worker, dp rank)'s KV-event stream,
//! the DEALER that asks its replay endpoint for a gap, and the applier that
//! turns its batches into index calls.
//!
//! Owns: the sockets and their (re)creation backoff, reading whole
//! multipart messages, and carrying out what the stream's [`Sequence`]
//! decides (apply, drop, replay, clear on restart), counting each outcome.
//! Does not: decide from sequence numbers itself (`sequence.rs`), poll
//! (`poll.rs`), or outlive its thread's command to stop.
//!
//! Reading and applying are two steps: [`Listener::fill_sub`] reads up to
//! `max_msgs_per_round` live messages off the SUB socket (fewer when the
//! thread's byte budget for the round, `max_bytes_per_round`, runs out:
//! that bounds the delay below under a burst), decodes them and
//! queues them in the listener's inbox stamped with the time they were
//! read; [`Listener::apply_inbox`] then applies the inbox in order. The poll
//! loop runs the first step for every ready listener of its thread before
//! the second, so a batch's receipt-to-application delay includes the time
//! it waited for the thread's other streams: that is the in-process
//! backlog, published as the stream's `queued` count and the delay
//! histogram. (Messages libzmq holds but nobody has read yet are invisible
//! in-process; the engine-to-index delay from the batch's `ts` covers them.)
//! While a replay runs the inbox waits, as the live stream always did.

use super::apply::{Applier, ApplyCounts};
use super::decode::{decode_batch, decode_message, decode_replay_reply, KvBatch, ReplayReply};
use super::poll::Env;
use super::sequence::{Catchup, LiveAction, ReplayTiming, Sequence};
use super::spec::{IngestConfig, ListenerSpec};
use super::stats::{inc, state_code, Counters, ListenerState, Shared};
use super::zctx::{Ctx, Socket};
use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Which socket of a listener is in the poll set.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Watch {
    None,
    Sub,
    Dealer,
}

/// The socket a listener has in its thread's poll set, as the poll loop
/// last saw it (`poll.rs`).
#[derive(Clone, Copy)]
pub(super) struct Polled {
    pub(super) watch: Watch,
    /// The watched socket's [`Slot`] serial: a change means another socket.
    pub(super) serial: u64,
    /// Its descriptor (ZMQ_FD), asked for once per socket.
    pub(super) fd: Option<RawFd>,
}

/// One socket of a listener and a serial number bumped whenever the socket
/// is put in or taken out, so the poll loop can tell a replaced socket from
/// the same one without asking it for its descriptor. (The descriptor number
/// cannot tell: a new socket may get the number of one just closed.)
#[derive(Default)]
struct Slot {
    sock: Option<Socket>,
    serial: u64,
}

impl Slot {
    fn set(&mut self, sock: Option<Socket>) {
        self.sock = sock;
        self.serial = self.serial.wrapping_add(1);
    }

    fn get(&self) -> Option<&Socket> {
        self.sock.as_ref()
    }

    fn is_some(&self) -> bool {
        self.sock.is_some()
    }
}

/// Reusable frame buffers for one multipart message.
#[derive(Default)]
pub(super) struct Frames {
    msgs: Vec<zmq::Message>,
    /// Valid frames in `msgs`.
    len: usize,
    /// Frames beyond `MAX_FRAMES` (counted, not kept).
    extra: usize,
}

const MAX_FRAMES: usize = 4;

impl Frames {
    /// Receives one whole multipart message without blocking. `Ok(false)`
    /// when nothing is queued.
    pub(super) fn recv(&mut self, s: &zmq::Socket) -> Result<bool, zmq::Error> {
        let mut n = 0;
        self.extra = 0;
        loop {
            if n == self.msgs.len() && n < MAX_FRAMES {
                self.msgs.push(zmq::Message::new());
            }
            let flags = if n == 0 { zmq::DONTWAIT } else { 0 };
            let r = if n < MAX_FRAMES {
                s.recv(&mut self.msgs[n], flags)
            } else {
                // Drain and drop the excess frames.
                s.recv_bytes(flags).map(|_| ())
            };
            match r {
                Ok(()) => {}
                Err(zmq::Error::EAGAIN) if n == 0 => return Ok(false),
                Err(e) => return Err(e),
            }
            if n < MAX_FRAMES {
                n += 1;
            } else {
                self.extra += 1;
            }
            if !s.get_rcvmore()? {
                break;
            }
        }
        self.len = n;
        Ok(true)
    }

    /// The received frames as byte slices (`len` of them are meaningful).
    pub(super) fn slices(&self) -> ([&[u8]; MAX_FRAMES], usize) {
        let mut out: [&[u8]; MAX_FRAMES] = [&[]; MAX_FRAMES];
        for (o, m) in out.iter_mut().zip(&self.msgs[..self.len]) {
            *o = m;
        }
        (out, self.len)
    }
}

/// A batch read off a socket and not yet applied.
pub(super) struct Held {
    /// When it was read.
    at: Instant,
    batch: KvBatch,
}

pub(super) struct Listener {
    pub(super) id: u64,
    spec: ListenerSpec,
    sub: Slot,
    /// When to (re)try creating the SUB socket after an error.
    sub_retry: Option<Instant>,
    sub_backoff: Duration,
    /// The SUB socket could not be opened at the last attempt (logged once
    /// when this turns true, once when it turns false again).
    failing: bool,
    dealer: Slot,
    /// Cursor, restart detection, the replay in progress and its backoff.
    seq: Sequence<Held>,
    /// Live messages read and decoded, not yet applied (module docs).
    inbox: VecDeque<(u64, Held)>,
    applier: Applier,
    shared: Arc<Shared>,
    /// The socket in the thread's poll set, updated by the poll loop when
    /// [`Listener::watching`] changes; a newly watched socket is `hot`.
    pub(super) polled: Polled,
    /// Check the watched socket this round without waiting for its
    /// descriptor: it may hold messages that no longer signal (see
    /// `poll.rs`).
    pub(super) hot: bool,
    /// Malformed messages are logged at most once per
    /// [`MALFORMED_LOG_INTERVAL`] per stream.
    malformed_log: MalformedLog,
}

/// When the last malformed-message line went out, and how many were
/// dropped since without a line.
#[derive(Default)]
struct MalformedLog {
    logged: Option<Instant>,
    unlogged: u64,
}

/// A stream that sends garbage costs one warning per this interval.
const MALFORMED_LOG_INTERVAL: Duration = Duration::from_secs(10);

impl Listener {
    pub(super) fn new(
        id: u64,
        worker_id: u64,
        spec: ListenerSpec,
        shared: Arc<Shared>,
        config: &IngestConfig,
    ) -> Listener {
        Listener {
            id,
            applier: Applier::new(worker_id, spec.dp_rank, spec.block_size),
            spec,
            sub: Slot::default(),
            sub_retry: Some(Instant::now()),
            sub_backoff: config.reconnect_min,
            failing: false,
            dealer: Slot::default(),
            seq: Sequence::new(ReplayTiming {
                timeout: config.replay_timeout,
                backoff_min: config.reconnect_min,
                backoff_max: config.reconnect_max,
            }),
            inbox: VecDeque::new(),
            shared,
            polled: Polled {
                watch: Watch::None,
                serial: 0,
                fd: None,
            },
            hot: false,
            malformed_log: MalformedLog::default(),
        }
    }

    /// Counts a malformed message and warns about it, rate-limited per
    /// stream (a broken publisher must not flood the log). Takes the fields
    /// it needs, so a socket of `self` may stay borrowed.
    fn malformed(
        log: &mut MalformedLog,
        shared: &Shared,
        counters: &Counters,
        (worker_id, dp_rank): (u64, u32),
        what: &str,
        error: &dyn std::fmt::Debug,
    ) {
        inc(&counters.malformed);
        inc(&shared.malformed);
        log.unlogged += 1;
        let now = Instant::now();
        if log
            .logged
            .is_none_or(|t| now.duration_since(t) >= MALFORMED_LOG_INTERVAL)
        {
            tracing::warn!(
                worker_id,
                dp_rank,
                dropped = log.unlogged,
                error = ?error,
                "malformed KV-event {what} dropped (counted in kvselect_ingest_malformed_dropped_total; at most one line per stream per 10 s)"
            );
            log.logged = Some(now);
            log.unlogged = 0;
        }
    }

    /// The socket to poll this round, if any.
    pub(super) fn watched(&self, w: Watch) -> Option<&zmq::Socket> {
        match w {
            Watch::Sub => self.sub.get().map(|s| &**s),
            Watch::Dealer => self.dealer.get().map(|s| &**s),
            Watch::None => None,
        }
    }

    /// The socket to poll and its serial: the same pair means the same
    /// socket (and so the same descriptor) as when last seen.
    pub(super) fn watching(&self) -> (Watch, u64) {
        let w = self.watch();
        let serial = match w {
            Watch::Sub => self.sub.serial,
            Watch::Dealer => self.dealer.serial,
            Watch::None => 0,
        };
        (w, serial)
    }

    fn watch(&self) -> Watch {
        if self.seq.replaying() {
            if self.dealer.is_some() {
                Watch::Dealer
            } else {
                Watch::None
            }
        } else if self.sub.is_some() {
            Watch::Sub
        } else {
            Watch::None
        }
    }

    fn set_state(&self) {
        let s = if self.seq.replaying() {
            ListenerState::Replaying
        } else if self.sub.is_some() {
            ListenerState::Live
        } else if self.failing {
            ListenerState::Failed
        } else {
            ListenerState::Connecting
        };
        self.shared.state.store(state_code(s), Relaxed);
    }

    pub(super) fn close(&mut self) {
        self.sub.set(None);
        self.dealer.set(None);
        self.seq.abandon();
        self.inbox.clear();
        self.publish_queued();
    }

    /// Whether the inbox has batches that may be applied now.
    pub(super) fn ready(&self) -> bool {
        !self.inbox.is_empty() && !self.seq.replaying()
    }

    /// Publishes the received-but-unapplied count: the inbox and the live
    /// batch parked while a replay runs.
    fn publish_queued(&self) {
        let n = self.inbox.len() + usize::from(self.seq.replaying());
        self.shared.queued.store(n as u64, Relaxed);
    }

    /// Clears every rank this listener fed (it stops, or its source changed).
    pub(super) fn clear_ranks(&mut self) {
        self.applier.clear_all(&self.spec.index);
    }

    /// Timers: socket (re)creation and replay deadlines. Returns the next
    /// instant this listener needs a tick.
    pub(super) fn tick(&mut self, now: Instant, env: &Env) -> Option<Instant> {
        if self.sub_retry.is_some_and(|at| now >= at) {
            match open_sub(&env.ctx, &self.spec.endpoint, &env.config) {
                Ok(s) => {
                    self.sub.set(Some(s));
                    self.sub_retry = None;
                    self.sub_backoff = env.config.reconnect_min;
                    if self.failing {
                        self.failing = false;
                        *super::hub::lock(&self.shared.error) = None;
                        tracing::info!(worker_id = self.applier.worker_id(),
                            dp_rank = self.spec.dp_rank, endpoint = %self.spec.endpoint,
                            "KV-event stream opened");
                    }
                }
                Err(e) => {
                    inc(&env.counters.connect_errors);
                    if !self.failing {
                        self.failing = true;
                        *super::hub::lock(&self.shared.error) = Some(e.to_string());
                        tracing::warn!(worker_id = self.applier.worker_id(),
                            dp_rank = self.spec.dp_rank, endpoint = %self.spec.endpoint,
                            error = %e,
                            "cannot open the KV-event stream; retrying with backoff (logged again when it opens)");
                    }
                    self.sub_retry = Some(now + self.sub_backoff);
                    self.sub_backoff = (self.sub_backoff * 2).min(env.config.reconnect_max);
                }
            }
            self.set_state();
        }
        if self.seq.timed_out(now) {
            tracing::warn!(endpoint = ?self.spec.replay_endpoint, "replay timed out");
            self.finish_replay(false, env);
        }
        let replay_deadline = self.seq.deadline();
        match (self.sub_retry, replay_deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Reads and decodes live messages into the inbox until it holds
    /// `max_msgs_per_round` or the round's byte `budget` is spent; true
    /// when the SUB was read until it had none left. Applies nothing (see
    /// [`Listener::apply_inbox`]).
    pub(super) fn fill_sub(&mut self, frames: &mut Frames, env: &Env, budget: &mut usize) -> bool {
        // A replay parks the SUB: its messages wait in the socket.
        if self.seq.replaying() {
            return false;
        }
        let Some(sub) = self.sub.get() else {
            return false;
        };
        let at = Instant::now();
        let before = self.inbox.len();
        let mut emptied = false;
        while self.inbox.len() < env.config.max_msgs_per_round && *budget > 0 {
            match frames.recv(sub) {
                Ok(true) => {}
                Ok(false) => {
                    emptied = true;
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "KV-events recv failed");
                    break;
                }
            }
            inc(&env.counters.messages);
            let (f, n) = frames.slices();
            *budget = budget.saturating_sub(f[..n].iter().map(|b| b.len()).sum());
            let msg = if frames.extra > 0 {
                Err(None)
            } else {
                decode_message(&f[..n]).map_err(Some)
            };
            match msg {
                Ok(m) => self.inbox.push_back((m.seq, Held { at, batch: m.batch })),
                Err(e) => {
                    let frames = n + frames.extra;
                    let who = (self.applier.worker_id(), self.spec.dp_rank);
                    Self::malformed(
                        &mut self.malformed_log,
                        &self.shared,
                        &env.counters,
                        who,
                        "message",
                        &(e, frames),
                    );
                }
            }
        }
        if self.inbox.len() != before {
            self.publish_queued();
        }
        emptied
    }

    /// Applies the inbox in order until it is empty or a gap starts a
    /// replay (the rest waits for the replay's end).
    pub(super) fn apply_inbox(&mut self, env: &Env) {
        while !self.seq.replaying() {
            let Some((seq, held)) = self.inbox.pop_front() else {
                break;
            };
            self.on_live(seq, held, env);
        }
        self.publish_queued();
    }

    fn on_live(&mut self, seq: u64, held: Held, env: &Env) {
        let live = self.seq.live(seq);
        if live.restart {
            // A PUB delivers in order, so a non-increasing seq on the live
            // stream is a new publisher process: forget the old one's blocks.
            inc(&env.counters.restarts);
            tracing::info!(endpoint = %self.spec.endpoint, seq, "engine restart detected; clearing");
            self.applier.clear_all(&self.spec.index);
        }
        match live.action {
            LiveAction::Apply => self.apply(seq, &held, env),
            LiveAction::Stale => inc(&env.counters.stale_dropped),
            LiveAction::Gap { expected } => {
                inc(&env.counters.gaps);
                inc(&self.shared.gaps);
                self.start_replay(expected, seq, held, env);
            }
        }
    }

    fn apply(&mut self, seq: u64, held: &Held, env: &Env) {
        let counters = &env.counters;
        let mut c = ApplyCounts::default();
        self.applier.apply(&self.spec.index, &held.batch, &mut c);
        counters.add_apply(&c);
        inc(&counters.batches_applied);
        self.seq.applied(seq);
        self.shared.last_seq.store(seq, Relaxed);
        let now = Instant::now();
        env.apply_delay
            .observe(now.saturating_duration_since(held.at).as_secs_f64());
        let ts = held.batch.ts;
        let engine_delay = (ts.is_finite() && ts > 0.0)
            .then(|| SystemTime::now().duration_since(UNIX_EPOCH).ok())
            .flatten()
            .map(|wall| wall.as_secs_f64() - ts);
        if let Some(d) = engine_delay {
            env.engine_delay.observe(d.max(0.0));
        }
        self.shared.applied(now, engine_delay);
    }

    /// Asks the replay endpoint for `[expected, ..)`; without one (or while
    /// backing off after a failure) the gap is lost and `batch` applies now.
    fn start_replay(&mut self, expected: u64, seq: u64, held: Held, env: &Env) {
        let now = Instant::now();
        let backing_off = !self.seq.may_replay(now);
        if let (Some(ep), false, false) = (
            &self.spec.replay_endpoint,
            backing_off,
            self.dealer.is_some(),
        ) {
            match open_dealer(&env.ctx, ep, &env.config) {
                Ok(d) => self.dealer.set(Some(d)),
                Err(e) => {
                    inc(&env.counters.connect_errors);
                    tracing::warn!(endpoint = %ep, error = %e, "cannot open replay socket");
                    self.replay_failed(now);
                }
            }
        }
        let sent = !backing_off
            && self.dealer.get().is_some_and(|d| {
                d.send_multipart([&[][..], &expected.to_be_bytes()[..]], zmq::DONTWAIT)
                    .is_ok()
            });
        if !sent {
            if self.spec.replay_endpoint.is_none() {
                tracing::debug!(expected, seq, "no replay endpoint configured; batches lost");
            }
            inc(&env.counters.gaps_lost);
            self.apply(seq, &held, env);
            return;
        }
        inc(&env.counters.replays_started);
        self.seq.replay_sent(now, seq, held);
        self.set_state();
    }

    fn replay_failed(&mut self, now: Instant) {
        // Late replies on the old socket would confuse the next replay.
        self.dealer.set(None);
        self.seq.replay_failed(now);
    }

    /// Reads up to `max_msgs_per_round` replay replies; true when the DEALER
    /// was read until it had none left.
    pub(super) fn drain_dealer(&mut self, frames: &mut Frames, env: &Env) -> bool {
        let counters = &env.counters;
        for _ in 0..env.config.max_msgs_per_round {
            let Some(d) = self.dealer.get() else {
                return false;
            };
            match frames.recv(d) {
                Ok(true) => {}
                Ok(false) => return true,
                Err(e) => {
                    tracing::warn!(error = %e, "replay recv failed");
                    self.finish_replay(false, env);
                    return false;
                }
            }
            let at = Instant::now();
            self.seq.replay_reply(at);
            let (f, n) = frames.slices();
            let reply = if frames.extra > 0 {
                None
            } else {
                decode_replay_reply(&f[..n]).ok()
            };
            match reply {
                Some(ReplayReply::End) => {
                    self.finish_replay(true, env);
                    return false;
                }
                Some(ReplayReply::Batch { seq, payload }) => {
                    match self.seq.catchup(seq) {
                        Catchup::Stale => {
                            inc(&counters.stale_dropped);
                            continue;
                        }
                        // The engine's buffer no longer holds [expected, seq).
                        Catchup::Apply { lost: true } => inc(&counters.gaps_lost),
                        Catchup::Apply { lost: false } => {}
                    }
                    match decode_batch(payload) {
                        Ok(batch) => {
                            self.apply(seq, &Held { at, batch }, env);
                            inc(&counters.replayed_batches);
                        }
                        Err(e) => {
                            let who = (self.applier.worker_id(), self.spec.dp_rank);
                            Self::malformed(
                                &mut self.malformed_log,
                                &self.shared,
                                counters,
                                who,
                                "replayed batch",
                                &e,
                            );
                            self.seq.applied(seq);
                        }
                    }
                }
                None => {
                    let who = (self.applier.worker_id(), self.spec.dp_rank);
                    Self::malformed(
                        &mut self.malformed_log,
                        &self.shared,
                        counters,
                        who,
                        "replay reply",
                        &"unreadable frames",
                    );
                }
            }
        }
        false
    }

    fn finish_replay(&mut self, ok: bool, env: &Env) {
        let now = Instant::now();
        let Some(done) = self.seq.finish_replay(ok, now) else {
            return;
        };
        if ok {
            inc(&env.counters.replays_completed);
            inc(&self.shared.replays);
        } else {
            inc(&env.counters.replays_failed);
            // Late replies on the old socket would confuse the next replay.
            self.dealer.set(None);
        }
        match done.catchup {
            Catchup::Stale => inc(&env.counters.stale_dropped),
            Catchup::Apply { lost } => {
                if lost {
                    inc(&env.counters.gaps_lost);
                }
                self.apply(done.seq, &done.batch, env);
            }
        }
        self.set_state();
        self.publish_queued();
    }
}

fn open_sub(ctx: &Ctx, endpoint: &str, c: &IngestConfig) -> Result<Socket, zmq::Error> {
    let s = ctx.socket(zmq::SUB)?;
    s.set_linger(0)?;
    s.set_reconnect_ivl(c.reconnect_min.as_millis() as i32)?;
    s.set_reconnect_ivl_max(c.reconnect_max.as_millis() as i32)?;
    s.set_rcvhwm(c.rcvhwm)?;
    s.set_maxmsgsize(c.max_msg_bytes)?;
    // Keepalive and heartbeats notice a silently dead peer; older libzmq may
    // lack heartbeats, which only costs that detection.
    let _ = s.set_tcp_keepalive(1);
    let _ = s.set_heartbeat_ivl(c.heartbeat_ivl.as_millis() as i32);
    let _ = s.set_heartbeat_timeout(c.heartbeat_timeout.as_millis() as i32);
    s.set_subscribe(b"")?;
    s.connect(endpoint)?;
    Ok(s)
}

fn open_dealer(ctx: &Ctx, endpoint: &str, c: &IngestConfig) -> Result<Socket, zmq::Error> {
    let s = ctx.socket(zmq::DEALER)?;
    s.set_linger(0)?;
    s.set_maxmsgsize(c.max_msg_bytes)?;
    s.connect(endpoint)?;
    Ok(s)
}
