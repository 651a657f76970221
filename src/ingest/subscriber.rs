//! The ingestion hub: ZMQ SUB listeners, one per (worker, dp rank), feeding
//! their partition's [`Index`].
//!
//! Owns: sockets, sequence cursors, gap replay, engine-restart detection and
//! listener lifetimes (`kv-events.md` §5.1, §5.5, §6.7).
//!
//! Threading: ZMQ sockets are not thread-safe, so a fixed pool of OS threads
//! each *own* their listeners' sockets and poll their descriptors (`ZMQ_FD`,
//! edge-triggered; see `Thread::run`). The hub talks to a
//! thread through a command channel plus an inproc "doorbell" socket that is
//! part of the poll set, so a command wakes the thread at once; every command
//! is acknowledged, which makes stopping synchronous: once `set_worker` /
//! `remove_worker` returns, a stopped listener has dropped its sockets and
//! applies nothing more.
//!
//! Sequence rules per listener:
//! - first batch seq 0 -> apply; first seq > 0 or `seq > last + 1` -> a gap:
//!   replay `[expected, seq)` through a DEALER (async: the listener's SUB is
//!   left unread, so live batches queue in order behind the replay), or, with
//!   no replay endpoint, count the loss and go on;
//! - `seq <= last` -> stale, dropped (batches already applied by a replay);
//! - but a seq that does not increase *on the live stream itself* can only come
//!   from a new publisher process (a PUB socket delivers in order): the engine
//!   restarted, its block ids start over, so the listener clears its ranks and
//!   restarts its cursor. This covers Dynamo's restart hazard (§5.5), including
//!   a restart whose seq 0 we missed.

use super::apply::{Applier, ApplyCounts};
use super::decode::{decode_batch, decode_message, decode_replay_reply, KvBatch, ReplayReply};
use crate::index::Index;
use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Hub tuning. Every default is a named constant.
#[derive(Debug, Clone)]
pub struct IngestConfig {
    /// Ingest OS threads (each owns a share of the listeners).
    pub threads: usize,
    /// ZMQ reconnect interval and its cap (exponential in between); also the
    /// backoff for a failed socket creation or a failed replay.
    pub reconnect_min: Duration,
    pub reconnect_max: Duration,
    /// A replay with no reply for this long is abandoned (the gap is counted
    /// as lost and the listener goes back to live batches).
    pub replay_timeout: Duration,
    /// ZMQ heartbeat interval and timeout on SUB sockets.
    pub heartbeat_ivl: Duration,
    pub heartbeat_timeout: Duration,
    /// SUB receive high-water mark (messages). vLLM's PUB uses 100 000.
    pub rcvhwm: i32,
    /// Messages handled per socket per poll round, so one busy engine cannot
    /// starve the other listeners of its thread.
    pub max_msgs_per_round: usize,
    /// Largest message frame accepted (ZMQ_MAXMSGSIZE); a bigger one makes
    /// ZMQ drop the connection (it then reconnects). Bounds the memory a
    /// broken or hostile publisher can make us hold.
    pub max_msg_bytes: i64,
}

pub const DEFAULT_THREADS: usize = 2;
pub const DEFAULT_RECONNECT_MIN: Duration = Duration::from_millis(100);
pub const DEFAULT_RECONNECT_MAX: Duration = Duration::from_secs(5);
pub const DEFAULT_REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
pub const DEFAULT_HEARTBEAT_IVL: Duration = Duration::from_secs(5);
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(15);
pub const DEFAULT_RCVHWM: i32 = 100_000;
pub const DEFAULT_MAX_MSGS_PER_ROUND: usize = 256;
pub const DEFAULT_MAX_MSG_BYTES: i64 = 64 << 20;
/// Longest a poll sleeps with nothing scheduled (commands wake it anyway).
const IDLE_POLL: Duration = Duration::from_secs(1);
/// How long the hub waits for a thread to acknowledge a command.
const ACK_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for IngestConfig {
    fn default() -> Self {
        IngestConfig {
            threads: DEFAULT_THREADS,
            reconnect_min: DEFAULT_RECONNECT_MIN,
            reconnect_max: DEFAULT_RECONNECT_MAX,
            replay_timeout: DEFAULT_REPLAY_TIMEOUT,
            heartbeat_ivl: DEFAULT_HEARTBEAT_IVL,
            heartbeat_timeout: DEFAULT_HEARTBEAT_TIMEOUT,
            rcvhwm: DEFAULT_RCVHWM,
            max_msgs_per_round: DEFAULT_MAX_MSGS_PER_ROUND,
            max_msg_bytes: DEFAULT_MAX_MSG_BYTES,
        }
    }
}

/// One listener a worker wants: the KV-events endpoint of one dp rank.
#[derive(Clone)]
pub struct ListenerSpec {
    pub dp_rank: u32,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub index: Arc<Index>,
    pub block_size: u32,
}

impl std::fmt::Debug for ListenerSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerSpec")
            .field("dp_rank", &self.dp_rank)
            .field("endpoint", &self.endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .field("index", &Arc::as_ptr(&self.index))
            .field("block_size", &self.block_size)
            .finish()
    }
}

impl ListenerSpec {
    /// Whether a running listener for `self` can keep serving `other`.
    fn same(&self, other: &ListenerSpec) -> bool {
        self.dp_rank == other.dp_rank
            && self.endpoint == other.endpoint
            && self.replay_endpoint == other.replay_endpoint
            && Arc::ptr_eq(&self.index, &other.index)
            && self.block_size == other.block_size
    }
}

/// Checks a ZMQ endpoint's syntax (no network access), with Dynamo's message
/// shape: "invalid ZMQ endpoint `not-a-url`: missing scheme".
pub fn validate_endpoint(s: &str) -> Result<(), String> {
    let fail = |why: String| Err(format!("invalid ZMQ endpoint `{s}`: {why}"));
    let Some((scheme, addr)) = s.split_once("://") else {
        return fail("missing scheme".into());
    };
    if scheme.is_empty() {
        return fail("missing scheme".into());
    }
    let needs_port = match scheme {
        "tcp" | "udp" | "pgm" | "epgm" | "norm" | "ws" | "wss" => true,
        "ipc" | "inproc" | "vmci" | "tipc" => false,
        other => return fail(format!("unsupported scheme `{other}`")),
    };
    if addr.is_empty() {
        return fail("missing address".into());
    }
    if needs_port {
        // ws/wss may carry a path after the port.
        let hostport = addr.split('/').next().unwrap_or("");
        let Some((host, port)) = hostport.rsplit_once(':') else {
            return fail("missing port".into());
        };
        if host.is_empty() {
            return fail("missing host".into());
        }
        if port != "*" && port.parse::<u16>().is_err() {
            return fail(format!("invalid port `{port}`"));
        }
    }
    Ok(())
}

/// Hub-wide counters (monotonic since start).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IngestCounters {
    /// Live messages received on SUB sockets.
    pub messages: u64,
    /// Batches applied (live and replayed).
    pub batches_applied: u64,
    pub apply: ApplyCounts,
    /// Messages or replay replies that failed to decode (dropped).
    pub malformed: u64,
    /// Sequence gaps seen on live streams (incl. a first seq > 0).
    pub gaps: u64,
    /// Gaps (or parts of gaps) that could not be recovered.
    pub gaps_lost: u64,
    pub replays_started: u64,
    pub replays_completed: u64,
    /// Replays abandoned (timeout or socket error).
    pub replays_failed: u64,
    pub replayed_batches: u64,
    /// Engine restarts detected (live seq went backwards).
    pub restarts: u64,
    /// Batches at or below the cursor (already applied by a replay).
    pub stale_dropped: u64,
    /// Socket creation / connect failures (retried with backoff).
    pub connect_errors: u64,
    pub listeners_started: u64,
    pub listeners_stopped: u64,
}

/// Where a listener is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenerState {
    /// Waiting to (re)create its socket after an error.
    Connecting,
    Live,
    Replaying,
}

/// A snapshot of one listener.
#[derive(Debug, Clone)]
pub struct ListenerStats {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub endpoint: String,
    pub state: ListenerState,
    /// Last applied seq (`None` before the first batch).
    pub last_seq: Option<u64>,
}

#[derive(Debug, Clone, Default)]
pub struct IngestStats {
    pub counters: IngestCounters,
    /// Sorted by (worker_id, dp_rank).
    pub listeners: Vec<ListenerStats>,
}

#[derive(Default)]
struct Counters {
    messages: AtomicU64,
    batches_applied: AtomicU64,
    events_applied: AtomicU64,
    blocks_stored: AtomicU64,
    blocks_removed: AtomicU64,
    clears: AtomicU64,
    stores_dropped_block_size: AtomicU64,
    stores_dropped_shape: AtomicU64,
    stores_dropped_self_reference: AtomicU64,
    stores_dropped_unknown_parent: AtomicU64,
    stores_dropped_other: AtomicU64,
    events_ignored_group: AtomicU64,
    events_dropped_unknown_medium: AtomicU64,
    events_dropped_non_local: AtomicU64,
    events_dropped_unknown_type: AtomicU64,
    malformed: AtomicU64,
    gaps: AtomicU64,
    gaps_lost: AtomicU64,
    replays_started: AtomicU64,
    replays_completed: AtomicU64,
    replays_failed: AtomicU64,
    replayed_batches: AtomicU64,
    restarts: AtomicU64,
    stale_dropped: AtomicU64,
    connect_errors: AtomicU64,
    listeners_started: AtomicU64,
    listeners_stopped: AtomicU64,
}

fn inc(a: &AtomicU64) {
    a.fetch_add(1, Relaxed);
}

fn add(a: &AtomicU64, v: u64) {
    if v != 0 {
        a.fetch_add(v, Relaxed);
    }
}

impl Counters {
    fn add_apply(&self, c: &ApplyCounts) {
        add(&self.events_applied, c.events_applied);
        add(&self.blocks_stored, c.blocks_stored);
        add(&self.blocks_removed, c.blocks_removed);
        add(&self.clears, c.clears);
        add(&self.stores_dropped_block_size, c.stores_dropped_block_size);
        add(&self.stores_dropped_shape, c.stores_dropped_shape);
        add(
            &self.stores_dropped_self_reference,
            c.stores_dropped_self_reference,
        );
        add(
            &self.stores_dropped_unknown_parent,
            c.stores_dropped_unknown_parent,
        );
        add(&self.stores_dropped_other, c.stores_dropped_other);
        add(&self.events_ignored_group, c.events_ignored_group);
        add(
            &self.events_dropped_unknown_medium,
            c.events_dropped_unknown_medium,
        );
        add(&self.events_dropped_non_local, c.events_dropped_non_local);
        add(
            &self.events_dropped_unknown_type,
            c.events_dropped_unknown_type,
        );
    }

    fn snapshot(&self) -> IngestCounters {
        let g = |a: &AtomicU64| a.load(Relaxed);
        IngestCounters {
            messages: g(&self.messages),
            batches_applied: g(&self.batches_applied),
            apply: ApplyCounts {
                events_applied: g(&self.events_applied),
                blocks_stored: g(&self.blocks_stored),
                blocks_removed: g(&self.blocks_removed),
                clears: g(&self.clears),
                stores_dropped_block_size: g(&self.stores_dropped_block_size),
                stores_dropped_shape: g(&self.stores_dropped_shape),
                stores_dropped_self_reference: g(&self.stores_dropped_self_reference),
                stores_dropped_unknown_parent: g(&self.stores_dropped_unknown_parent),
                stores_dropped_other: g(&self.stores_dropped_other),
                events_ignored_group: g(&self.events_ignored_group),
                events_dropped_unknown_medium: g(&self.events_dropped_unknown_medium),
                events_dropped_non_local: g(&self.events_dropped_non_local),
                events_dropped_unknown_type: g(&self.events_dropped_unknown_type),
            },
            malformed: g(&self.malformed),
            gaps: g(&self.gaps),
            gaps_lost: g(&self.gaps_lost),
            replays_started: g(&self.replays_started),
            replays_completed: g(&self.replays_completed),
            replays_failed: g(&self.replays_failed),
            replayed_batches: g(&self.replayed_batches),
            restarts: g(&self.restarts),
            stale_dropped: g(&self.stale_dropped),
            connect_errors: g(&self.connect_errors),
            listeners_started: g(&self.listeners_started),
            listeners_stopped: g(&self.listeners_stopped),
        }
    }
}

/// What a listener publishes for `stats()` without a round trip to its thread.
struct Shared {
    state: AtomicU8,
    /// `u64::MAX` = no batch yet (a real seq never reaches it: it is the
    /// replay end marker).
    last_seq: AtomicU64,
}

const NO_SEQ: u64 = u64::MAX;

fn state_code(s: ListenerState) -> u8 {
    match s {
        ListenerState::Connecting => 0,
        ListenerState::Live => 1,
        ListenerState::Replaying => 2,
    }
}

fn state_of(c: u8) -> ListenerState {
    match c {
        1 => ListenerState::Live,
        2 => ListenerState::Replaying,
        _ => ListenerState::Connecting,
    }
}

enum Cmd {
    Add(Box<Listener>, SyncSender<()>),
    /// Stop a listener and clear the ranks it fed.
    Remove(u64, SyncSender<()>),
    Shutdown,
}

struct Worker {
    tx: Sender<Cmd>,
    /// PUSH side of the thread's inproc doorbell.
    doorbell: Mutex<zmq::Socket>,
    join: Mutex<Option<JoinHandle<()>>>,
}

/// A running listener as the hub's registry knows it.
struct Active {
    id: u64,
    thread: usize,
    spec: ListenerSpec,
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Registry {
    workers: HashMap<u64, Vec<Active>>,
    /// Listeners per thread, to place new ones on the least loaded.
    load: Vec<usize>,
    next_id: u64,
}

/// The ingestion hub (see the module docs).
pub struct IngestHub {
    ctx: zmq::Context,
    threads: Vec<Worker>,
    registry: Mutex<Registry>,
    counters: Arc<Counters>,
    config: IngestConfig,
}

static HUB_SEQ: AtomicU64 = AtomicU64::new(0);

impl IngestHub {
    /// Starts the ingest threads.
    ///
    /// # Panics
    /// If the OS refuses to create a thread or an inproc socket at startup
    /// (no useful way to run without them).
    pub fn new(config: IngestConfig) -> IngestHub {
        let ctx = zmq::Context::new();
        let counters = Arc::new(Counters::default());
        let hub_id = HUB_SEQ.fetch_add(1, Relaxed);
        let n = config.threads.max(1);
        let mut threads = Vec::with_capacity(n);
        for i in 0..n {
            let addr = format!(
                "inproc://kvselect-ingest-{}-{hub_id}-{i}",
                std::process::id()
            );
            let pull = ctx.socket(zmq::PULL).expect("inproc PULL socket");
            pull.bind(&addr).expect("bind ingest doorbell");
            let push = ctx.socket(zmq::PUSH).expect("inproc PUSH socket");
            push.set_linger(0).ok();
            push.connect(&addr).expect("connect ingest doorbell");
            let (tx, rx) = mpsc::channel();
            let mut th = Thread {
                env: Env {
                    ctx: ctx.clone(),
                    counters: counters.clone(),
                    config: config.clone(),
                },
                rx,
                doorbell: pull,
                listeners: Vec::new(),
            };
            let join = std::thread::Builder::new()
                .name(format!("kv-ingest-{i}"))
                .spawn(move || th.run())
                .expect("spawn ingest thread");
            threads.push(Worker {
                tx,
                doorbell: Mutex::new(push),
                join: Mutex::new(Some(join)),
            });
        }
        IngestHub {
            ctx,
            threads,
            registry: Mutex::new(Registry {
                load: vec![0; n],
                ..Registry::default()
            }),
            counters,
            config,
        }
    }

    /// The ZMQ context of the hub's sockets (an `inproc://` publisher must
    /// share it).
    pub fn context(&self) -> &zmq::Context {
        &self.ctx
    }

    /// Makes `worker_id`'s listeners exactly `listeners`. A listener whose
    /// (dp_rank, endpoint, replay_endpoint, index, block_size) is unchanged
    /// keeps its socket, cursor and state; the others stop (clearing the
    /// ranks they fed, since a new endpoint is a new source of truth) and new
    /// ones start. When this returns, stopped listeners apply nothing more.
    pub fn set_worker(&self, worker_id: u64, listeners: Vec<ListenerSpec>) {
        let mut reg = lock(&self.registry);
        let mut old: Vec<Option<Active>> = reg
            .workers
            .remove(&worker_id)
            .unwrap_or_default()
            .into_iter()
            .map(Some)
            .collect();
        let mut kept = Vec::with_capacity(listeners.len());
        let mut to_start = Vec::new();
        for spec in listeners {
            let hit = old
                .iter_mut()
                .find(|a| a.as_ref().is_some_and(|a| a.spec.same(&spec)));
            match hit.and_then(Option::take) {
                Some(a) => kept.push(a),
                None => to_start.push(spec),
            }
        }
        for a in old.into_iter().flatten() {
            self.stop(&mut reg, a);
        }
        for spec in to_start {
            kept.push(self.start(&mut reg, worker_id, spec));
        }
        if !kept.is_empty() {
            reg.workers.insert(worker_id, kept);
        }
    }

    /// Stops every listener of `worker_id` (clearing the ranks they fed).
    pub fn remove_worker(&self, worker_id: u64) {
        let mut reg = lock(&self.registry);
        for a in reg.workers.remove(&worker_id).unwrap_or_default() {
            self.stop(&mut reg, a);
        }
    }

    pub fn stats(&self) -> IngestStats {
        let reg = lock(&self.registry);
        let mut listeners: Vec<ListenerStats> = reg
            .workers
            .iter()
            .flat_map(|(&worker_id, v)| {
                v.iter().map(move |a| {
                    let seq = a.shared.last_seq.load(Relaxed);
                    ListenerStats {
                        worker_id,
                        dp_rank: a.spec.dp_rank,
                        endpoint: a.spec.endpoint.clone(),
                        state: state_of(a.shared.state.load(Relaxed)),
                        last_seq: (seq != NO_SEQ).then_some(seq),
                    }
                })
            })
            .collect();
        drop(reg);
        listeners.sort_by_key(|l| (l.worker_id, l.dp_rank));
        IngestStats {
            counters: self.counters.snapshot(),
            listeners,
        }
    }

    fn start(&self, reg: &mut Registry, worker_id: u64, spec: ListenerSpec) -> Active {
        let id = reg.next_id;
        reg.next_id += 1;
        let thread = (0..reg.load.len())
            .min_by_key(|&i| reg.load[i])
            .unwrap_or(0);
        reg.load[thread] += 1;
        let shared = Arc::new(Shared {
            state: AtomicU8::new(state_code(ListenerState::Connecting)),
            last_seq: AtomicU64::new(NO_SEQ),
        });
        let listener = Listener::new(id, worker_id, spec.clone(), shared.clone(), &self.config);
        self.send(thread, |ack| Cmd::Add(Box::new(listener), ack));
        inc(&self.counters.listeners_started);
        Active {
            id,
            thread,
            spec,
            shared,
        }
    }

    fn stop(&self, reg: &mut Registry, a: Active) {
        reg.load[a.thread] = reg.load[a.thread].saturating_sub(1);
        self.send(a.thread, |ack| Cmd::Remove(a.id, ack));
        inc(&self.counters.listeners_stopped);
    }

    /// Sends a command and waits for the thread's acknowledgement.
    fn send(&self, thread: usize, make: impl FnOnce(SyncSender<()>) -> Cmd) {
        let w = &self.threads[thread];
        let (ack_tx, ack_rx) = mpsc::sync_channel(1);
        if w.tx.send(make(ack_tx)).is_err() {
            tracing::error!(thread, "ingest thread is gone; command dropped");
            return;
        }
        ring(&w.doorbell);
        if ack_rx.recv_timeout(ACK_TIMEOUT).is_err() {
            tracing::error!(thread, "ingest thread did not acknowledge a command");
        }
    }
}

impl IngestHub {
    /// Stops every ingest thread and waits for them: their sockets and ZMQ
    /// contexts close, and no event is applied afterwards. Idempotent; the
    /// hub is inert after it (dropping it also shuts it down).
    pub fn shutdown(&self) {
        for w in &self.threads {
            let _ = w.tx.send(Cmd::Shutdown);
            ring(&w.doorbell);
        }
        for w in &self.threads {
            if let Some(j) = lock(&w.join).take() {
                let _ = j.join();
            }
        }
    }
}

impl Drop for IngestHub {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data; keep going.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn ring(doorbell: &Mutex<zmq::Socket>) {
    // A full doorbell queue already guarantees a wake-up.
    let _ = lock(doorbell).send(&[][..], zmq::DONTWAIT);
}

/// What every listener of a thread needs besides itself.
struct Env {
    ctx: zmq::Context,
    counters: Arc<Counters>,
    config: IngestConfig,
}

/// One ingest OS thread and the listeners it owns.
struct Thread {
    env: Env,
    rx: Receiver<Cmd>,
    doorbell: zmq::Socket,
    listeners: Vec<Listener>,
}

/// Which socket of a listener is in the poll set.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Watch {
    None,
    Sub,
    Dealer,
}

impl Thread {
    fn run(&mut self) {
        let mut frames = Frames::default();
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut last_sweep = Instant::now();
        loop {
            let now = Instant::now();
            let mut timeout = IDLE_POLL;
            for l in &mut self.listeners {
                if let Some(at) = l.tick(now, &self.env) {
                    timeout = timeout.min(at.saturating_duration_since(now));
                }
            }
            // Sockets are polled through their descriptors (ZMQ_FD), not
            // with `zmq::poll` on the sockets: that asks every socket for
            // ZMQ_EVENTS after every wake-up, one syscall each, so one
            // message cost ~70 syscalls with 32 listeners per thread. A
            // ZMQ_FD is edge-triggered: it signals new commands, not
            // readable messages. So a socket whose descriptor fired is asked
            // for its events once (which processes its commands) and read
            // until empty; a socket left unemptied (the per-round cap, a
            // parked SUB) or new to the poll set is `hot` and checked next
            // round without waiting.
            fds.clear();
            fds.push(pollfd(self.doorbell.get_fd().ok()));
            for l in &mut self.listeners {
                let w = l.watch();
                let fd = l.watched(w).and_then(|s| s.get_fd().ok());
                if l.polled != (w, fd) {
                    l.polled = (w, fd);
                    l.hot = true;
                }
                fds.push(pollfd(fd));
            }
            let any_hot = self
                .listeners
                .iter()
                .any(|l| l.hot && l.polled.0 != Watch::None);
            // Round up so a 0.4 ms deadline does not spin at 0 ms.
            let ms = if any_hot {
                0
            } else {
                timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
            };
            // SAFETY: `fds` is a live, exclusively borrowed array of
            // `fds.len()` pollfd structs for the duration of the call.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if rc < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::warn!(error = %e, "poll failed");
                }
            }
            // Once per IDLE_POLL, busy or not, every socket is checked, so
            // a missed edge could never stall a listener (or the doorbell)
            // for longer than that.
            let after = Instant::now();
            let sweep = after.duration_since(last_sweep) >= IDLE_POLL;
            if sweep {
                last_sweep = after;
                for l in &mut self.listeners {
                    l.hot = true;
                }
            }
            let fired = |i: usize| fds[i].revents != 0;
            for (i, l) in self.listeners.iter_mut().enumerate() {
                let w = l.polled.0;
                if w == Watch::None || !(l.hot || fired(i + 1)) {
                    continue;
                }
                let readable = l
                    .watched(w)
                    .and_then(|s| s.get_events().ok())
                    .is_some_and(|ev| ev.contains(zmq::POLLIN));
                l.hot = readable
                    && !match w {
                        Watch::Sub => l.drain_sub(&mut frames, &self.env),
                        _ => l.drain_dealer(&mut frames, &self.env),
                    };
            }
            if fired(0) || sweep {
                let _ = self.doorbell.get_events();
                while self.doorbell.recv_bytes(zmq::DONTWAIT).is_ok() {}
            }
            // Commands are checked every round, not only on a doorbell: the
            // doorbell is only a wake-up.
            loop {
                match self.rx.try_recv() {
                    Ok(Cmd::Add(l, ack)) => {
                        let mut l = *l;
                        l.tick(Instant::now(), &self.env);
                        self.listeners.push(l);
                        let _ = ack.send(());
                    }
                    Ok(Cmd::Remove(id, ack)) => {
                        if let Some(pos) = self.listeners.iter().position(|l| l.id == id) {
                            let mut l = self.listeners.swap_remove(pos);
                            l.close();
                            l.applier.clear_all(&l.spec.index);
                        }
                        let _ = ack.send(());
                    }
                    Ok(Cmd::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => {
                        for l in &mut self.listeners {
                            l.close();
                        }
                        return;
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
        }
    }
}

/// A poll entry for readability of `fd`; a negative fd (no socket) is
/// ignored by `poll`.
fn pollfd(fd: Option<RawFd>) -> libc::pollfd {
    libc::pollfd {
        fd: fd.unwrap_or(-1),
        events: libc::POLLIN,
        revents: 0,
    }
}

/// Reusable frame buffers for one multipart message.
#[derive(Default)]
struct Frames {
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
    fn recv(&mut self, s: &zmq::Socket) -> Result<bool, zmq::Error> {
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
    fn slices(&self) -> ([&[u8]; MAX_FRAMES], usize) {
        let mut out: [&[u8]; MAX_FRAMES] = [&[]; MAX_FRAMES];
        for (o, m) in out.iter_mut().zip(&self.msgs[..self.len]) {
            *o = m;
        }
        (out, self.len)
    }
}

/// A gap being recovered through the replay socket.
struct Replay {
    /// No reply for `replay_timeout` after this -> abandon.
    deadline: Instant,
    /// The live batch that revealed the gap; applied after the replay if still
    /// newer than the cursor.
    pending: Option<(u64, KvBatch)>,
}

struct Listener {
    id: u64,
    spec: ListenerSpec,
    sub: Option<zmq::Socket>,
    /// When to (re)try creating the SUB socket after an error.
    sub_retry: Option<Instant>,
    sub_backoff: Duration,
    dealer: Option<zmq::Socket>,
    replay: Option<Replay>,
    /// No replay before this (after a failed one).
    replay_not_before: Option<Instant>,
    replay_backoff: Duration,
    /// Last applied seq.
    cursor: Option<u64>,
    /// Last seq seen on the live SUB stream (restart detection).
    live_last: Option<u64>,
    applier: Applier,
    shared: Arc<Shared>,
    /// The socket in this round's poll set (kind and descriptor), set when
    /// the set is built; when it changes, the new one is `hot`.
    polled: (Watch, Option<RawFd>),
    /// Check the watched socket this round without waiting for its
    /// descriptor: it may hold messages that no longer signal (see
    /// `Thread::run`).
    hot: bool,
}

impl Listener {
    fn new(
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
            sub: None,
            sub_retry: Some(Instant::now()),
            sub_backoff: config.reconnect_min,
            dealer: None,
            replay: None,
            replay_not_before: None,
            replay_backoff: config.reconnect_min,
            cursor: None,
            live_last: None,
            shared,
            polled: (Watch::None, None),
            hot: false,
        }
    }

    /// The socket to poll this round, if any.
    fn watched(&self, w: Watch) -> Option<&zmq::Socket> {
        match w {
            Watch::Sub => self.sub.as_ref(),
            Watch::Dealer => self.dealer.as_ref(),
            Watch::None => None,
        }
    }

    fn watch(&self) -> Watch {
        if self.replay.is_some() {
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
        let s = if self.replay.is_some() {
            ListenerState::Replaying
        } else if self.sub.is_some() {
            ListenerState::Live
        } else {
            ListenerState::Connecting
        };
        self.shared.state.store(state_code(s), Relaxed);
    }

    fn close(&mut self) {
        self.sub = None;
        self.dealer = None;
        self.replay = None;
    }

    /// Timers: socket (re)creation and replay deadlines. Returns the next
    /// instant this listener needs a tick.
    fn tick(&mut self, now: Instant, env: &Env) -> Option<Instant> {
        if self.sub_retry.is_some_and(|at| now >= at) {
            match open_sub(&env.ctx, &self.spec.endpoint, &env.config) {
                Ok(s) => {
                    self.sub = Some(s);
                    self.sub_retry = None;
                    self.sub_backoff = env.config.reconnect_min;
                }
                Err(e) => {
                    inc(&env.counters.connect_errors);
                    tracing::warn!(endpoint = %self.spec.endpoint, error = %e,
                        "cannot open KV-events SUB socket; retrying");
                    self.sub_retry = Some(now + self.sub_backoff);
                    self.sub_backoff = (self.sub_backoff * 2).min(env.config.reconnect_max);
                }
            }
            self.set_state();
        }
        if self.replay.as_ref().is_some_and(|r| now >= r.deadline) {
            tracing::warn!(endpoint = ?self.spec.replay_endpoint, "replay timed out");
            self.finish_replay(false, env);
        }
        let replay_deadline = self.replay.as_ref().map(|r| r.deadline);
        match (self.sub_retry, replay_deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Reads and applies up to `max_msgs_per_round` messages; true when the
    /// SUB was read until it had none left.
    fn drain_sub(&mut self, frames: &mut Frames, env: &Env) -> bool {
        for _ in 0..env.config.max_msgs_per_round {
            // A replay started by the previous message parks the SUB.
            if self.replay.is_some() {
                return false;
            }
            let Some(sub) = &self.sub else { return false };
            match frames.recv(sub) {
                Ok(true) => {}
                Ok(false) => return true,
                Err(e) => {
                    tracing::warn!(error = %e, "KV-events recv failed");
                    return false;
                }
            }
            inc(&env.counters.messages);
            let (f, n) = frames.slices();
            let msg = if frames.extra > 0 {
                Err(None)
            } else {
                decode_message(&f[..n]).map_err(Some)
            };
            match msg {
                Ok(m) => self.on_live(m.seq, m.batch, env),
                Err(e) => {
                    inc(&env.counters.malformed);
                    tracing::debug!(worker = self.applier.worker_id(), error = ?e,
                        frames = n + frames.extra, "malformed KV-event message dropped");
                }
            }
        }
        false
    }

    fn on_live(&mut self, seq: u64, batch: KvBatch, env: &Env) {
        if self.live_last.is_some_and(|l| seq <= l) {
            // A PUB delivers in order, so a non-increasing seq on the live
            // stream is a new publisher process: forget the old one's blocks.
            inc(&env.counters.restarts);
            tracing::info!(endpoint = %self.spec.endpoint, seq, "engine restart detected; clearing");
            self.applier.clear_all(&self.spec.index);
            self.cursor = None;
        }
        self.live_last = Some(seq);
        let expected = self.cursor.map_or(0, |c| c + 1);
        if seq == expected {
            self.apply(seq, &batch, &env.counters);
        } else if seq < expected {
            inc(&env.counters.stale_dropped);
        } else {
            inc(&env.counters.gaps);
            self.start_replay(expected, seq, batch, env);
        }
    }

    fn apply(&mut self, seq: u64, batch: &KvBatch, counters: &Counters) {
        let mut c = ApplyCounts::default();
        self.applier.apply(&self.spec.index, batch, &mut c);
        counters.add_apply(&c);
        inc(&counters.batches_applied);
        self.cursor = Some(seq);
        self.shared.last_seq.store(seq, Relaxed);
    }

    /// Asks the replay endpoint for `[expected, ..)`; without one (or while
    /// backing off after a failure) the gap is lost and `batch` applies now.
    fn start_replay(&mut self, expected: u64, seq: u64, batch: KvBatch, env: &Env) {
        let now = Instant::now();
        let backing_off = self.replay_not_before.is_some_and(|t| now < t);
        if let (Some(ep), false, None) = (&self.spec.replay_endpoint, backing_off, &self.dealer) {
            match open_dealer(&env.ctx, ep, &env.config) {
                Ok(d) => self.dealer = Some(d),
                Err(e) => {
                    inc(&env.counters.connect_errors);
                    tracing::warn!(endpoint = %ep, error = %e, "cannot open replay socket");
                    self.replay_failed(now, &env.config);
                }
            }
        }
        let sent = !backing_off
            && self.dealer.as_ref().is_some_and(|d| {
                d.send_multipart([&[][..], &expected.to_be_bytes()[..]], zmq::DONTWAIT)
                    .is_ok()
            });
        if !sent {
            if self.spec.replay_endpoint.is_none() {
                tracing::debug!(expected, seq, "no replay endpoint configured; batches lost");
            }
            inc(&env.counters.gaps_lost);
            self.apply(seq, &batch, &env.counters);
            return;
        }
        inc(&env.counters.replays_started);
        self.replay = Some(Replay {
            deadline: now + env.config.replay_timeout,
            pending: Some((seq, batch)),
        });
        self.set_state();
    }

    fn replay_failed(&mut self, now: Instant, config: &IngestConfig) {
        // Late replies on the old socket would confuse the next replay.
        self.dealer = None;
        self.replay_not_before = Some(now + self.replay_backoff);
        self.replay_backoff = (self.replay_backoff * 2).min(config.reconnect_max);
    }

    /// Reads up to `max_msgs_per_round` replay replies; true when the DEALER
    /// was read until it had none left.
    fn drain_dealer(&mut self, frames: &mut Frames, env: &Env) -> bool {
        let counters = &env.counters;
        for _ in 0..env.config.max_msgs_per_round {
            let Some(d) = &self.dealer else { return false };
            match frames.recv(d) {
                Ok(true) => {}
                Ok(false) => return true,
                Err(e) => {
                    tracing::warn!(error = %e, "replay recv failed");
                    self.finish_replay(false, env);
                    return false;
                }
            }
            if let Some(r) = &mut self.replay {
                r.deadline = Instant::now() + env.config.replay_timeout;
            }
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
                    let expected = self.cursor.map_or(0, |c| c + 1);
                    if seq < expected {
                        inc(&counters.stale_dropped);
                        continue;
                    }
                    if seq > expected {
                        // The engine's buffer no longer holds [expected, seq).
                        inc(&counters.gaps_lost);
                    }
                    match decode_batch(payload) {
                        Ok(b) => {
                            self.apply(seq, &b, counters);
                            inc(&counters.replayed_batches);
                        }
                        Err(_) => {
                            inc(&counters.malformed);
                            self.cursor = Some(seq);
                        }
                    }
                }
                None => inc(&counters.malformed),
            }
        }
        false
    }

    fn finish_replay(&mut self, ok: bool, env: &Env) {
        let Some(r) = self.replay.take() else { return };
        if ok {
            inc(&env.counters.replays_completed);
            self.replay_backoff = env.config.reconnect_min;
            self.replay_not_before = None;
        } else {
            inc(&env.counters.replays_failed);
            self.replay_failed(Instant::now(), &env.config);
        }
        if let Some((seq, batch)) = r.pending {
            let expected = self.cursor.map_or(0, |c| c + 1);
            if seq < expected {
                inc(&env.counters.stale_dropped);
            } else {
                if seq > expected {
                    inc(&env.counters.gaps_lost);
                }
                self.apply(seq, &batch, &env.counters);
            }
        }
        self.set_state();
    }
}

fn open_sub(
    ctx: &zmq::Context,
    endpoint: &str,
    c: &IngestConfig,
) -> Result<zmq::Socket, zmq::Error> {
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

fn open_dealer(
    ctx: &zmq::Context,
    endpoint: &str,
    c: &IngestConfig,
) -> Result<zmq::Socket, zmq::Error> {
    let s = ctx.socket(zmq::DEALER)?;
    s.set_linger(0)?;
    s.set_maxmsgsize(c.max_msg_bytes)?;
    s.connect(endpoint)?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_validation_messages() {
        assert_eq!(
            validate_endpoint("not-a-url").unwrap_err(),
            "invalid ZMQ endpoint `not-a-url`: missing scheme"
        );
        for ok in [
            "tcp://127.0.0.1:5557",
            "tcp://*:5557",
            "tcp://[::1]:5557",
            "tcp://engine-0.svc:5557",
            "ipc:///tmp/kv.sock",
            "inproc://kv-events",
            "ws://host:80/path",
            "epgm://eth0;239.192.1.1:5555",
        ] {
            assert_eq!(validate_endpoint(ok), Ok(()), "{ok}");
        }
        for (bad, why) in [
            ("://x:1", "missing scheme"),
            ("http://x:1", "unsupported scheme `http`"),
            ("tcp://", "missing address"),
            ("tcp://host", "missing port"),
            ("tcp://:5557", "missing host"),
            ("tcp://host:http", "invalid port `http`"),
            ("tcp://host:70000", "invalid port `70000`"),
        ] {
            assert_eq!(
                validate_endpoint(bad).unwrap_err(),
                format!("invalid ZMQ endpoint `{bad}`: {why}")
            );
        }
    }
}
