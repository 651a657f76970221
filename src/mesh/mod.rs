//! The replica mesh: bookings and session bindings shared between selector
//! replicas over ZeroMQ, wire-compatible with Dynamo 1.6.1
//! (`replica-sync.md`), plus what Dynamo's best effort lacks: per-origin
//! sequence numbers, repair from the origin's live bookings over HTTP,
//! booking leases, and divergence metrics.
//!
//! | file | owns | does NOT |
//! |---|---|---|
//! | `mod.rs` | [`Mesh`]: the booking journal (every booking the mesh knows, local or a peer's, with its origin), local bookings that publish, messages from peers applied to the ledger, counters | parse HTTP or touch sockets |
//! | `wire.rs` | msgpack encode/decode of the topics; the captured Dynamo bytes as tests | hold state |
//! | `replica.rs` | the PUB thread (bounded queue, heartbeats) and the SUB thread (peer set, per-origin sequence checks, leases) | decide what a message does to the ledger |
//! | `repair.rs` | the origin's snapshot (`GET /replica_sync/bookings`), the blocking fetch, replacing what is held for an origin | run on the request path |
//! | `affinity.rs` | session bindings, idle TTL, newest-wins | know the mesh |
//!
//! Invariants:
//! - Every ledger change of an id the mesh tracks happens under the id's
//!   journal shard lock, and a local change is queued for publishing under
//!   that same lock, so an origin's messages about one id leave in the order
//!   the changes happened, and a snapshot (all shards locked, then the
//!   sequence read) is exact: it reflects every message up to its sequence
//!   number and none after. Lock order: journal shard -> ledger -> publish
//!   queue.
//! - Bookings received from peers are never re-published, with one
//!   exception: when a peer completes or frees a booking that originated
//!   here, the origin repeats it under its own sequence, so receivers that
//!   missed the peer's message see a gap in the origin's stream.
//! - Publishing never blocks a booking: the queue to the PUB thread is
//!   bounded; when full the message is dropped and counted, and receivers
//!   repair through the sequence gap.

pub mod affinity;
mod repair;
mod replica;
pub mod wire;

pub use repair::{BookingsSnapshot, SnapshotBooking};

use crate::app::App;
use crate::index::WorkerRank;
use crate::reserve::{Booking, IdentityForm, Ledger, ReserveError};
use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Weak};
use std::time::{Duration, Instant};
use wire::{AddRequest, SlotData, SlotEvent};

/// Heartbeat period: how soon a lost tail is noticed.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_millis(200);
/// A kvselect peer's bookings are dropped once it has been silent this long.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(3);
/// Messages waiting for the PUB thread; beyond it they are dropped.
pub const PUBLISH_QUEUE: usize = 65_536;
const SHARDS: usize = 16;

/// What the mesh needs from the configuration.
#[derive(Debug, Clone)]
pub struct MeshConfig {
    /// PUB port; 0 picks a free one.
    pub port: u16,
    /// Address the PUB binds on.
    pub bind_ip: std::net::IpAddr,
    pub peers: Vec<String>,
    pub heartbeat: Duration,
    pub lease: Duration,
    /// Test-only fault injection: the share of received messages dropped.
    pub drop_rate: f64,
}

/// What a local booking publishes besides the ledger's view of it.
#[derive(Debug, Clone, Copy)]
pub struct BookMeta<'a> {
    pub model_name: &'a str,
    pub routing_group: &'a str,
    pub block_size: u32,
    pub lora_name: Option<&'a str>,
    pub track_prefill_tokens: bool,
    /// The prefill tokens the booking was priced with (booked only when
    /// tracked).
    pub effective_prefill_tokens: u64,
    pub expected_output_tokens: Option<u32>,
}

/// One booking known to the mesh.
#[derive(Debug, Clone)]
pub(crate) struct Held {
    /// The router id of the replica that booked it (ours for local ones).
    origin: u64,
    wr: WorkerRank,
    model: Arc<str>,
    group: Arc<str>,
    block_size: u32,
    identities: Arc<[u64]>,
    chained: bool,
    track: bool,
    effective_prefill: u64,
    expected_output_tokens: Option<u32>,
    lora: Option<Arc<str>>,
    prefill_done: bool,
}

impl Held {
    fn event(&self, id: &str, router_id: u64, data: SlotData) -> SlotEvent {
        SlotEvent {
            model_name: self.model.to_string(),
            routing_group: self.group.to_string(),
            block_size: self.block_size,
            request_id: id.to_string(),
            worker_id: self.wr.worker_id,
            dp_rank: self.wr.dp_rank,
            data,
            router_id,
            lora_name: self.lora.as_deref().map(str::to_string),
            seq: None,
            chained: self.chained,
        }
    }

    fn add_event(&self, id: &str, router_id: u64) -> SlotEvent {
        let data = SlotData::Add(AddRequest {
            token_sequence: self.identities.to_vec(),
            track_prefill_tokens: self.track,
            expected_output_tokens: self.expected_output_tokens,
            initial_effective_prefill_tokens: self.effective_prefill,
        });
        self.event(id, router_id, data)
    }

    fn form(&self) -> IdentityForm {
        if self.chained {
            IdentityForm::Chained
        } else {
            IdentityForm::Arbitrary
        }
    }

    fn booked_prefill(&self) -> u64 {
        if self.track {
            self.effective_prefill
        } else {
            0
        }
    }
}

/// One lock's share of the journal: selection id -> booking.
type Shard = Mutex<HashMap<Box<str>, Held>>;

/// What the PUB thread sends.
pub(crate) enum Outgoing {
    Slot(SlotEvent),
    Binding(wire::Binding),
}

struct Publisher {
    seq: u64,
    tx: mpsc::SyncSender<Outgoing>,
}

/// Counters for /metrics.
#[derive(Debug, Default)]
pub struct MeshCounters {
    pub published: AtomicU64,
    pub publish_queue_dropped: AtomicU64,
    pub received: AtomicU64,
    pub own_ignored: AtomicU64,
    pub fault_dropped: AtomicU64,
    pub malformed: AtomicU64,
    pub unknown_target_dropped: AtomicU64,
    pub conflicts: AtomicU64,
    pub stale_skipped: AtomicU64,
    pub lease_expired_bookings: AtomicU64,
}

/// What the mesh knows about one origin (a peer's router id).
#[derive(Debug, Clone)]
pub struct OriginState {
    pub router_id: u64,
    /// The last sequence number applied (`None`: never heard with one).
    pub last_seq: Option<u64>,
    /// A Dynamo peer: no sequence numbers, best effort only.
    pub best_effort: bool,
    pub http: Option<String>,
    pub last_heard: Instant,
    pub gaps: u64,
    pub repairs: u64,
    pub repair_failures: u64,
    pub needs_repair: bool,
    pub last_repair_attempt: Option<Instant>,
}

/// One peer's row of the divergence metrics.
#[derive(Debug, Clone)]
pub struct PeerMetrics {
    pub state: OriginState,
    /// Live bookings held for this origin.
    pub bookings: usize,
}

pub struct Mesh {
    router_id: u64,
    endpoint: String,
    cfg: MeshConfig,
    app: Weak<App>,
    http: Mutex<Option<String>>,
    shards: Box<[Shard]>,
    out: Mutex<Publisher>,
    /// The highest sequence number dropped because the queue was full.
    dropped_max: AtomicU64,
    peers: Mutex<BTreeSet<String>>,
    ctl: Mutex<mpsc::Sender<replica::Ctl>>,
    origins: Mutex<HashMap<u64, OriginState>>,
    /// Set by [`Mesh::stop`]; both threads check it every poll period.
    stopped: std::sync::atomic::AtomicBool,
    pub counters: MeshCounters,
}

impl Mesh {
    /// Stops both threads within a poll period (about 200 ms); their sockets
    /// and the ZeroMQ context close. Nothing is published or applied after
    /// it. The embedded selector's `shutdown()` calls it; the server's
    /// threads end with the process.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
    }

    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    /// Binds the PUB, connects the SUB to `cfg.peers` and starts both
    /// threads. They stop once `app` is dropped or [`Mesh::stop`] is called.
    pub fn start(app: &Arc<App>, cfg: MeshConfig) -> Result<Arc<Mesh>, String> {
        for p in &cfg.peers {
            crate::ingest::validate_endpoint(p).map_err(|e| e.to_string())?;
        }
        let ctx = zmq::Context::new();
        let (pub_socket, endpoint) = replica::bind_pub(&ctx, cfg.bind_ip, cfg.port)?;
        let (tx, rx) = mpsc::sync_channel(PUBLISH_QUEUE);
        let (ctl_tx, ctl_rx) = mpsc::channel();
        let mesh = Arc::new(Mesh {
            router_id: rand::random::<u64>().max(1),
            endpoint,
            app: Arc::downgrade(app),
            http: Mutex::new(None),
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            out: Mutex::new(Publisher { seq: 0, tx }),
            dropped_max: AtomicU64::new(0),
            peers: Mutex::new(cfg.peers.iter().cloned().collect()),
            ctl: Mutex::new(ctl_tx),
            origins: Mutex::new(HashMap::new()),
            stopped: std::sync::atomic::AtomicBool::new(false),
            counters: MeshCounters::default(),
            cfg,
        });
        replica::spawn(&mesh, ctx, pub_socket, rx, ctl_rx)?;
        tracing::info!(
            endpoint = %mesh.endpoint,
            router_id = mesh.router_id,
            peers = ?mesh.cfg.peers,
            "replica mesh started"
        );
        Ok(mesh)
    }

    pub fn router_id(&self) -> u64 {
        self.router_id
    }

    /// The bound PUB endpoint, e.g. `tcp://127.0.0.1:40123`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Announces where peers can fetch this replica's live bookings
    /// (`http://host:port`); without it peers cannot repair from us.
    pub fn set_http(&self, base: Option<String>) {
        *self.http.lock() = base;
    }

    fn shard(&self, id: &str) -> &Shard {
        let h = xxhash_rust::xxh3::xxh3_64(id.as_bytes());
        &self.shards[(h >> 60) as usize & (SHARDS - 1)]
    }

    fn publish(&self, mut ev: SlotEvent) {
        let mut p = self.out.lock();
        p.seq += 1;
        ev.seq = Some(p.seq);
        self.send(&mut p, Outgoing::Slot(ev));
    }

    pub(crate) fn publish_binding(&self, mut b: wire::Binding) {
        b.writer_id = self.router_id;
        let mut p = self.out.lock();
        p.seq += 1;
        b.seq = Some(p.seq);
        self.send(&mut p, Outgoing::Binding(b));
    }

    fn send(&self, p: &mut Publisher, msg: Outgoing) {
        let seq = p.seq;
        match p.tx.try_send(msg) {
            Ok(()) => {
                self.counters.published.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.counters
                    .publish_queue_dropped
                    .fetch_add(1, Ordering::Relaxed);
                self.dropped_max.fetch_max(seq, Ordering::Relaxed);
            }
        }
    }

    // ----- local changes (the request path) -----

    /// Books locally and publishes `AddRequest`.
    pub fn book_local(
        &self,
        ledger: &Ledger,
        b: Booking<'_>,
        meta: &BookMeta<'_>,
    ) -> Result<(), ReserveError> {
        let mut g = self.shard(b.selection_id).lock();
        ledger.book(b)?;
        let held = Held {
            origin: self.router_id,
            wr: b.wr,
            model: meta.model_name.into(),
            group: meta.routing_group.into(),
            block_size: meta.block_size,
            identities: b.identities.into(),
            chained: b.form == IdentityForm::Chained,
            track: meta.track_prefill_tokens,
            effective_prefill: meta.effective_prefill_tokens,
            expected_output_tokens: meta.expected_output_tokens,
            lora: meta.lora_name.map(Into::into),
            prefill_done: false,
        };
        self.publish(held.add_event(b.selection_id, self.router_id));
        g.insert(b.selection_id.into(), held);
        Ok(())
    }

    /// Prefill completion of any booking, local or a peer's; publishes
    /// `MarkPrefillCompleted` as Dynamo does.
    pub fn prefill_local(&self, ledger: &Ledger, id: &str) -> Result<(), ReserveError> {
        let mut g = self.shard(id).lock();
        ledger.prefill_complete(id)?;
        if let Some(h) = g.get_mut(id) {
            h.prefill_done = true;
            self.publish(h.event(id, self.router_id, SlotData::PrefillCompleted));
        }
        Ok(())
    }

    /// Frees any booking, local or a peer's; publishes `Free`.
    pub fn free_local(&self, ledger: &Ledger, id: &str) -> Result<(), ReserveError> {
        let mut g = self.shard(id).lock();
        ledger.free(id)?;
        if let Some(h) = g.remove(id) {
            self.publish(h.event(id, self.router_id, SlotData::Free));
        }
        Ok(())
    }

    // ----- messages from peers -----

    /// Applies one slot event of origin `ev.router_id` (already checked for
    /// order by the caller).
    fn apply_slot(&self, app: &App, ev: SlotEvent) {
        let id = ev.request_id.as_str();
        match &ev.data {
            SlotData::Add(a) => {
                let wr = WorkerRank {
                    worker_id: ev.worker_id,
                    dp_rank: ev.dp_rank,
                };
                if !known_target(app, &ev.model_name, &ev.routing_group, ev.block_size, wr) {
                    self.counters
                        .unknown_target_dropped
                        .fetch_add(1, Ordering::Relaxed);
                    return;
                }
                let held = Held {
                    origin: ev.router_id,
                    wr,
                    model: ev.model_name.as_str().into(),
                    group: ev.routing_group.as_str().into(),
                    block_size: ev.block_size,
                    identities: a.token_sequence.as_slice().into(),
                    chained: ev.chained,
                    track: a.track_prefill_tokens,
                    effective_prefill: a.initial_effective_prefill_tokens,
                    expected_output_tokens: a.expected_output_tokens,
                    lora: ev.lora_name.as_deref().map(Into::into),
                    prefill_done: false,
                };
                self.insert_held(&app.ledger, id, held);
            }
            SlotData::PrefillCompleted => {
                let mut g = self.shard(id).lock();
                if app.ledger.prefill_complete(id).is_ok() {
                    if let Some(h) = g.get_mut(id) {
                        h.prefill_done = true;
                        if h.origin == self.router_id {
                            self.publish(h.event(id, self.router_id, SlotData::PrefillCompleted));
                        }
                    }
                }
            }
            SlotData::Free => {
                let mut g = self.shard(id).lock();
                if app.ledger.free(id).is_ok() {
                    if let Some(h) = g.remove(id) {
                        if h.origin == self.router_id {
                            self.publish(h.event(id, self.router_id, SlotData::Free));
                        }
                    }
                }
            }
        }
    }

    /// Books a peer's booking; a taken id is counted as a conflict.
    fn insert_held(&self, ledger: &Ledger, id: &str, mut held: Held) -> bool {
        // Bounded as a local prompt's isl_tokens is, so that no peer's
        // figure (live or repaired) overflows the rank's prefill sum.
        held.effective_prefill = held.effective_prefill.min(crate::app::MAX_ISL_TOKENS);
        let mut g = self.shard(id).lock();
        let booked = ledger.book(Booking {
            selection_id: id,
            wr: held.wr,
            identities: &held.identities,
            form: held.form(),
            prefill_tokens: held.booked_prefill(),
            now: Instant::now(),
        });
        match booked {
            Ok(()) => {
                g.insert(id.into(), held);
                true
            }
            Err(_) => {
                self.counters.conflicts.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    fn apply_binding(&self, app: &App, b: &wire::Binding) {
        if let Some(aff) = &app.affinity {
            let wr = WorkerRank {
                worker_id: b.worker_id,
                dp_rank: b.dp_rank,
            };
            aff.apply_remote(
                &b.model_name,
                &b.routing_group,
                &b.session_id,
                wr,
                b.sequence,
                Instant::now(),
            );
        }
    }

    /// Frees everything held for `origin`; returns how many.
    fn drop_origin(&self, ledger: &Ledger, origin: u64) -> usize {
        let mut n = 0;
        for s in self.shards.iter() {
            let mut g = s.lock();
            g.retain(|id, h| {
                if h.origin != origin {
                    return true;
                }
                let _ = ledger.free(id);
                n += 1;
                false
            });
        }
        n
    }

    /// Forgets journal entries the ledger no longer has (expired, or their
    /// worker left or became incomplete). Local ones are announced as `Free`,
    /// so peers do not keep load this replica dropped.
    fn prune(&self, ledger: &Ledger) {
        for s in self.shards.iter() {
            s.lock().retain(|id, h| {
                if ledger.is_booked(id) {
                    return true;
                }
                if h.origin == self.router_id {
                    self.publish(h.event(id, self.router_id, SlotData::Free));
                }
                false
            });
        }
    }

    // ----- peers -----

    /// Sorted peer endpoints.
    pub fn peers(&self) -> Vec<String> {
        self.peers.lock().iter().cloned().collect()
    }

    /// Adds a peer; `Ok(true)` when it is new.
    pub fn register_peer(&self, endpoint: &str) -> Result<bool, String> {
        crate::ingest::validate_endpoint(endpoint).map_err(|e| e.to_string())?;
        let new = self.peers.lock().insert(endpoint.to_string());
        if new {
            let _ = self
                .ctl
                .lock()
                .send(replica::Ctl::Connect(endpoint.to_string()));
        }
        Ok(new)
    }

    /// Removes a peer; `false` when it was not there.
    pub fn deregister_peer(&self, endpoint: &str) -> bool {
        let removed = self.peers.lock().remove(endpoint);
        if removed {
            let _ = self
                .ctl
                .lock()
                .send(replica::Ctl::Disconnect(endpoint.to_string()));
        }
        removed
    }

    // ----- metrics -----

    /// Per origin: sequence, gaps, repairs and live bookings held.
    pub fn peer_metrics(&self) -> Vec<PeerMetrics> {
        let mut held: HashMap<u64, usize> = HashMap::new();
        for s in self.shards.iter() {
            for h in s.lock().values() {
                if h.origin != self.router_id {
                    *held.entry(h.origin).or_default() += 1;
                }
            }
        }
        let origins = self.origins.lock();
        let mut out: Vec<PeerMetrics> = origins
            .values()
            .map(|o| PeerMetrics {
                bookings: held.remove(&o.router_id).unwrap_or(0),
                state: o.clone(),
            })
            .collect();
        drop(origins);
        out.sort_by_key(|p| p.state.router_id);
        out
    }

    /// Local bookings known to the mesh.
    pub fn local_bookings(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                s.lock()
                    .values()
                    .filter(|h| h.origin == self.router_id)
                    .count()
            })
            .sum()
    }

    /// The last sequence number assigned.
    pub fn last_seq(&self) -> u64 {
        self.out.lock().seq
    }
}

/// The state of `router_id`, created on first contact.
fn replica_origin(origins: &mut HashMap<u64, OriginState>, router_id: u64) -> &mut OriginState {
    origins.entry(router_id).or_insert_with(|| OriginState {
        router_id,
        last_seq: None,
        best_effort: false,
        http: None,
        last_heard: Instant::now(),
        gaps: 0,
        repairs: 0,
        repair_failures: 0,
        needs_repair: false,
        last_repair_attempt: None,
    })
}

/// Whether `wr` is a schedulable rank of the partition, with that block size.
fn known_target(app: &App, model: &str, group: &str, block_size: u32, wr: WorkerRank) -> bool {
    let snap = app.catalog.snapshot();
    snap.partitions
        .get(&(model.to_string(), group.to_string()))
        .is_some_and(|v| v.partition.block_size == block_size && v.rank(wr).is_some())
}

/// The mesh's lines of /metrics: counters, and per peer (origin router id)
/// the divergence figures.
pub fn render_metrics(mesh: &Mesh, out: &mut String) {
    use std::fmt::Write;
    let c = &mesh.counters;
    let _ = writeln!(out, "# TYPE kvselect_replica_last_seq gauge");
    let _ = writeln!(out, "kvselect_replica_last_seq {}", mesh.last_seq());
    let _ = writeln!(out, "# TYPE kvselect_replica_local_bookings gauge");
    let _ = writeln!(
        out,
        "kvselect_replica_local_bookings {}",
        mesh.local_bookings()
    );
    for (name, v) in [
        ("published", &c.published),
        ("publish_queue_dropped", &c.publish_queue_dropped),
        ("received", &c.received),
        ("own_ignored", &c.own_ignored),
        ("fault_dropped", &c.fault_dropped),
        ("malformed", &c.malformed),
        ("unknown_target_dropped", &c.unknown_target_dropped),
        ("conflicts", &c.conflicts),
        ("stale_skipped", &c.stale_skipped),
        ("lease_expired_bookings", &c.lease_expired_bookings),
    ] {
        let _ = writeln!(out, "# TYPE kvselect_replica_{name}_total counter");
        let _ = writeln!(
            out,
            "kvselect_replica_{name}_total {}",
            v.load(Ordering::Relaxed)
        );
    }
    let peers = mesh.peer_metrics();
    for (name, kind) in [
        ("peer_last_seq", "gauge"),
        ("peer_gaps_total", "counter"),
        ("peer_repairs_total", "counter"),
        ("peer_repair_failures_total", "counter"),
        ("peer_bookings", "gauge"),
        ("peer_best_effort", "gauge"),
        ("peer_silence_seconds", "gauge"),
    ] {
        let _ = writeln!(out, "# TYPE kvselect_replica_{name} {kind}");
        for p in &peers {
            let s = &p.state;
            let v = match name {
                "peer_last_seq" => s.last_seq.unwrap_or(0) as f64,
                "peer_gaps_total" => s.gaps as f64,
                "peer_repairs_total" => s.repairs as f64,
                "peer_repair_failures_total" => s.repair_failures as f64,
                "peer_bookings" => p.bookings as f64,
                "peer_best_effort" => u8::from(s.best_effort) as f64,
                _ => s.last_heard.elapsed().as_secs_f64(),
            };
            let _ = writeln!(
                out,
                "kvselect_replica_{name}{{router_id=\"{}\"}} {v}",
                s.router_id
            );
        }
    }
}
