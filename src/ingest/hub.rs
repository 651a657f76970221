//! The ingestion hub: ZMQ SUB listeners, one per (worker, dp rank), feeding
//! their partition's [`Index`](crate::index::Index).
//!
//! Owns: the listener registry (which listeners run, on which thread), the
//! ingest threads' lifetimes and the command round trip to them. Does not:
//! touch a socket of a listener (each thread owns its listeners' sockets,
//! `poll.rs`), or decide what a batch means (`sequence.rs`, `listener.rs`).
//!
//! Threading: ZMQ sockets are not thread-safe, so a fixed pool of OS threads
//! each *own* their listeners' sockets and wait on their descriptors
//! (`ZMQ_FD`, in an epoll set; see `poll.rs`). The hub talks to a
//! thread through a command channel plus an inproc "doorbell" socket that is
//! part of that set, so a command wakes the thread at once; every command
//! is acknowledged, which makes stopping synchronous: once `set_worker` /
//! `remove_worker` returns, a stopped listener has dropped its sockets and
//! applies nothing more.

use super::listener::Listener;
use super::poll::{Cmd, Env, Thread};
use super::spec::{IngestConfig, ListenerSpec};
use super::stats::{
    inc, state_of, Counters, Delays, IngestStats, ListenerState, ListenerStats, Shared,
    StreamHealth, NO_SEQ,
};
use super::zctx::{Ctx, Socket};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{self, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long the hub waits for a thread to acknowledge a command.
const ACK_TIMEOUT: Duration = Duration::from_secs(10);

struct Worker {
    tx: Sender<Cmd>,
    /// PUSH side of the thread's inproc doorbell.
    doorbell: Mutex<Socket>,
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
    /// ZMQ_MAX_SOCKETS in force on the hub's context.
    max_sockets: i32,
    threads: Vec<Worker>,
    registry: Mutex<Registry>,
    counters: Arc<Counters>,
    delays: Delays,
    lag: Arc<super::lag::Lag>,
    config: IngestConfig,
}

static HUB_SEQ: AtomicU64 = AtomicU64::new(0);

impl IngestHub {
    /// Starts the ingest threads.
    ///
    /// # Panics
    /// If the OS refuses to create a thread, an inproc socket or an epoll
    /// descriptor at startup (no useful way to run without them).
    pub fn new(config: IngestConfig) -> IngestHub {
        let (ctx, max_sockets) = Ctx::new(config.max_sockets);
        let counters = Arc::new(Counters::default());
        let delays = Delays::new();
        let hub_id = HUB_SEQ.fetch_add(1, Relaxed);
        let n = config.threads.max(1);
        let lag = Arc::new(super::lag::Lag::new(n));
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
            let mut th = Thread::new(
                Env {
                    ctx: ctx.clone(),
                    counters: counters.clone(),
                    apply_delay: delays.apply.local(),
                    engine_delay: delays.engine.local(),
                    config: config.clone(),
                    lag: Arc::clone(&lag),
                    slot: i,
                },
                rx,
                pull,
            );
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
            max_sockets,
            threads,
            registry: Mutex::new(Registry {
                load: vec![0; n],
                ..Registry::default()
            }),
            counters,
            delays,
            lag,
            config,
        }
    }

    /// How far the index is behind the events that reached the process
    /// (`lag.rs`).
    pub fn lag(&self) -> &Arc<super::lag::Lag> {
        &self.lag
    }

    /// The hub-wide receipt-to-application and engine-to-index delay
    /// histograms (shared handles: register them in a scrape's registry).
    pub fn delays(&self) -> &Delays {
        &self.delays
    }

    /// ZMQ_MAX_SOCKETS in force, and how many KV-event streams fit in it
    /// (each ingest thread's doorbell takes two sockets; a stream with a
    /// replay endpoint takes one more than this counts).
    pub fn capacity(&self) -> (i32, usize) {
        let internal = 2 * self.threads.len();
        let streams = (self.max_sockets.max(0) as usize).saturating_sub(internal);
        (self.max_sockets, streams)
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

    /// Health handles of `worker_id`'s streams, by dp rank.
    pub fn health(&self, worker_id: u64) -> Vec<(u32, StreamHealth)> {
        let reg = lock(&self.registry);
        reg.workers
            .get(&worker_id)
            .map(|v| {
                v.iter()
                    .map(|a| (a.spec.dp_rank, StreamHealth(Arc::clone(&a.shared))))
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn stats(&self) -> IngestStats {
        let reg = lock(&self.registry);
        let now = Instant::now();
        let mut listeners: Vec<ListenerStats> = reg
            .workers
            .iter()
            .flat_map(|(&worker_id, v)| {
                v.iter().map(move |a| {
                    let sh = &a.shared;
                    let seq = sh.last_seq.load(Relaxed);
                    ListenerStats {
                        worker_id,
                        dp_rank: a.spec.dp_rank,
                        endpoint: a.spec.endpoint.clone(),
                        state: state_of(sh.state.load(Relaxed)),
                        last_seq: (seq != NO_SEQ).then_some(seq),
                        error: lock(&sh.error).clone(),
                        last_applied_age: sh.applied_age(now),
                        engine_delay: sh.engine_delay(),
                        queued: sh.queued.load(Relaxed),
                        gaps: sh.gaps.load(Relaxed),
                        replays: sh.replays.load(Relaxed),
                        malformed: sh.malformed.load(Relaxed),
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
        let shared = Arc::new(Shared::new(ListenerState::Connecting));
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

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data; keep going.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn ring(doorbell: &Mutex<Socket>) {
    // A full doorbell queue already guarantees a wake-up.
    let _ = lock(doorbell).send(&[][..], zmq::DONTWAIT);
}
