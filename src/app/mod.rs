//! The selection service's behaviour, one method per route, independent of
//! any transport: typed request views in, typed replies (all `Serialize`) or
//! a [`ServiceError`] out. The HTTP front door (`http`) and the embedded
//! Python selector (the `python/` crate) both drive this one engine; neither
//! re-implements a rule.
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | [`App`]: construction, readiness, the worker catalog routes, the sweep |
//! | `prompt.rs` | the prompt group (§4.7): tokens or given hashes -> index keys and booking identities, hashed once |
//! | `selection.rs` | /select and /select_and_reserve: candidates, one index walk, loads, the choice, the booking |
//! | `reservations.rs` | /reservations (replay and explicit forms) and the lifecycle calls |
//! | `reports.rs` | /loads, /potential_loads, /overlap_scores, /dump |
//!
//! The request path is parse -> normalise the prompt (hash once) -> resolve
//! the partition and candidates -> one index walk -> loads -> cost -> choice
//! -> (book) -> reply. The public sequence-hash chain of the prompt serves
//! both as the index lookup keys and, in the default tracking mode, as the
//! booking identities, so a token prompt is hashed exactly once.

pub mod admission;
pub mod freshness;
mod prompt;
mod reports;
mod reservations;
mod selection;

pub use prompt::MAX_ISL_TOKENS;
pub use reports::{LoadRow, OverlapRow, OverlapScores, PartitionLoads, SharedCache};
pub use reservations::Reservation;
pub use selection::{OverlapOut, Selection, WorkerLoad};

use crate::catalog::{partition_display, Catalog, Snapshot, WorkerRecord};
use crate::config::Config;
use crate::ingest::{IngestConfig, IngestHub};
use crate::mesh::affinity::Affinity;
use crate::mesh::{BookMeta, BookingsSnapshot, Mesh, MeshConfig};
use crate::parse::{ParseError, ParseLimits, Parser, WorkerFields};
use crate::pool::Pool;
use crate::reserve::{Booking, Ledger, PendingCache, ReserveError};
use serde::Serialize;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// Why a request failed, in domain terms. The HTTP layer
/// (`http::error`) and the Python binding each choose their status or
/// exception for it in one exhaustive match.
#[derive(Debug)]
pub enum ServiceError {
    /// The body (or dict) is not valid JSON, or not the expected shape.
    Parse(ParseError),
    /// The request is well formed but breaks a rule (a length mismatch, a
    /// value out of range, a field required in this form).
    Invalid(String),
    /// The request is valid, but the selection cannot honour it (a pinned
    /// worker outside the allowed set): 400, as `Invalid`, over HTTP; the
    /// embedded selector raises it as the scheduler's error, not a
    /// `ValueError`.
    Refused(String),
    /// No schedulable worker at all, or none in the request's partition.
    NoWorkers(String),
    /// Schedulable workers exist, but the request's filters left none.
    NoCandidates,
    /// The request names a worker (or worker rank) that is not there.
    UnknownWorker(String),
    /// The request names a worker that exists but not with that DP rank.
    UnknownRank(String),
    /// The request names a reservation or pending selection that is not there.
    UnknownSelection(String),
    /// The request names a replica-mesh peer that is not registered.
    UnknownPeer(String),
    /// The selection id is already booked, or being booked.
    AlreadyReserved(String),
    /// A replica-sync call on a service that runs no replica mesh.
    ReplicaSyncDisabled,
    /// The selection queue (`DYN_ROUTER_QUEUE_THRESHOLD`) did not admit the
    /// request: every candidate stayed busy past the wait bound, or the
    /// queue was full (429).
    Busy(String),
}

impl From<ParseError> for ServiceError {
    fn from(e: ParseError) -> Self {
        ServiceError::Parse(e)
    }
}

impl std::fmt::Display for ServiceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServiceError::Parse(e) => write!(f, "{e}"),
            ServiceError::Invalid(m)
            | ServiceError::Refused(m)
            | ServiceError::NoWorkers(m)
            | ServiceError::UnknownWorker(m)
            | ServiceError::UnknownRank(m)
            | ServiceError::UnknownSelection(m)
            | ServiceError::UnknownPeer(m)
            | ServiceError::AlreadyReserved(m)
            | ServiceError::Busy(m) => f.write_str(m),
            ServiceError::NoCandidates => f.write_str("no endpoints available to route work"),
            ServiceError::ReplicaSyncDisabled => f.write_str("replica sync is disabled"),
        }
    }
}

impl std::error::Error for ServiceError {}

pub type ServiceResult<T> = Result<T, ServiceError>;

/// GET /ready: readiness and the catalog.
#[derive(Debug, Serialize)]
pub struct Readiness {
    pub ready: bool,
    pub schedulable_workers: usize,
    pub workers: Vec<WorkerRecord>,
}

pub struct App {
    pub config: Config,
    pub parser: Parser,
    pub catalog: Catalog,
    pub ledger: Arc<Ledger>,
    pub pending: PendingCache,
    /// Session bindings, with `--session-affinity-ttl-secs`.
    pub affinity: Option<Affinity>,
    /// The selection queue, with `DYN_ROUTER_QUEUE_THRESHOLD`.
    pub queue: Option<Arc<admission::Queue>>,
    /// The freshness gate's counters (`freshness.rs`).
    pub gate: freshness::GateCounters,
    /// The replica mesh, once [`App::start_mesh`] started it.
    mesh: OnceLock<Arc<Mesh>>,
    shutting_down: AtomicBool,
}

impl App {
    pub fn new(config: Config) -> App {
        let ledger = Arc::new(Ledger::new(config.booking_expiry));
        let queue = config
            .router
            .queue_threshold
            .map(|_| Arc::new(admission::Queue::new(config.queue)));
        if let Some(q) = &queue {
            let q = Arc::clone(q);
            ledger.set_on_release(Box::new(move || q.released()));
        }
        // Size the ZMQ context from the fd limit in force (the binary has
        // raised it already), keeping --max-connections plus headroom free.
        let fd_limit = crate::runtime::fd_limit().unwrap_or(1024);
        let reserved = config.limits.max_connections as u64 + crate::runtime::FD_HEADROOM;
        let hub = IngestHub::new(IngestConfig {
            threads: config.ingest_threads,
            max_sockets: IngestConfig::sockets_for_fds(fd_limit, reserved),
            ..IngestConfig::default()
        });
        let parser = Parser::new(
            ParseLimits {
                max_depth: config.max_depth,
                max_tokens: config.max_tokens,
            },
            Pool::new(
                4 * config.threads + 4,
                crate::pool::DEFAULT_MAX_CAPACITY * 4,
            ),
            Pool::new(16 * config.threads + 16, crate::pool::DEFAULT_MAX_CAPACITY),
        )
        .with_number_path(config.number_path);
        App {
            pending: PendingCache::new(
                config.selection_cache_ttl,
                config.selection_cache_max_entries,
                config.selection_cache_max_bytes,
            ),
            catalog: Catalog::new(
                hub,
                Arc::clone(&ledger),
                config.allow_ipc_endpoints,
                config.router.queue_threshold.is_some(),
            ),
            ledger,
            parser,
            affinity: config.session_affinity_ttl.map(Affinity::new),
            queue,
            gate: freshness::GateCounters::default(),
            mesh: OnceLock::new(),
            config,
            shutting_down: AtomicBool::new(false),
        }
    }

    /// From now on the service reports itself not ready.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    // ----- health and catalog -----

    pub fn readiness(&self) -> Readiness {
        self.readiness_when(self.is_shutting_down())
    }

    /// Readiness as of a shutdown flag the caller has already read, so one
    /// response does not mix two readings of it.
    pub fn readiness_when(&self, shutting_down: bool) -> Readiness {
        let snap = self.catalog.snapshot();
        Readiness {
            ready: !shutting_down && snap.schedulable_workers > 0,
            schedulable_workers: snap.schedulable_workers,
            workers: self.catalog.list(None, None),
        }
    }

    pub fn upsert_worker(&self, fields: WorkerFields) -> WorkerRecord {
        let r = self.catalog.upsert(fields);
        self.room_made();
        r
    }

    pub fn patch_worker(
        &self,
        worker_id: u64,
        fields: WorkerFields,
    ) -> ServiceResult<WorkerRecord> {
        let r = self
            .catalog
            .patch(worker_id, fields)
            .ok_or_else(|| worker_not_found(worker_id));
        self.room_made();
        r
    }

    pub fn delete_worker(&self, worker_id: u64) -> ServiceResult<WorkerRecord> {
        let r = self
            .catalog
            .delete(worker_id)
            .ok_or_else(|| worker_not_found(worker_id));
        // Its bookings went through the ledger; the candidates changed too.
        self.room_made();
        r
    }

    pub fn list_workers(&self, model: Option<&str>, group: Option<&str>) -> Vec<WorkerRecord> {
        self.catalog.list(model, group)
    }

    // ----- the replica mesh -----

    /// Starts the replica mesh when the configuration asks for one
    /// (`replica_sync_port`); `http` is where this process serves
    /// `GET /replica_sync/bookings` for peers' repairs (`None`: not served).
    /// Returns the mesh, or `None` when replica sync is off. Idempotent.
    pub fn start_mesh(
        self: &Arc<Self>,
        http: Option<SocketAddr>,
    ) -> Result<Option<Arc<Mesh>>, String> {
        let Some(port) = self.config.replica_sync_port else {
            return Ok(None);
        };
        if let Some(m) = self.mesh.get() {
            return Ok(Some(Arc::clone(m)));
        }
        let mesh = Mesh::start(
            self,
            MeshConfig {
                port,
                bind_ip: self.config.addr.ip(),
                peers: self.config.replica_sync_peers.clone(),
                heartbeat: self.config.replica_heartbeat,
                lease: self.config.replica_lease,
                drop_rate: self.config.replica_fault_drop_rate,
            },
        )?;
        mesh.set_http(http.map(|a| format!("http://{a}")));
        let _ = self.mesh.set(Arc::clone(&mesh));
        Ok(Some(mesh))
    }

    pub fn mesh(&self) -> Option<&Arc<Mesh>> {
        self.mesh.get()
    }

    /// GET /replica_sync/peers: sorted, `[]` when replica sync is off.
    pub fn replica_peers(&self) -> Vec<String> {
        self.mesh().map(|m| m.peers()).unwrap_or_default()
    }

    /// POST /replica_sync/register_peer: `true` when the peer is new.
    pub fn register_replica_peer(&self, endpoint: &str) -> ServiceResult<bool> {
        let m = self.mesh().ok_or(ServiceError::ReplicaSyncDisabled)?;
        m.register_peer(endpoint).map_err(ServiceError::Invalid)
    }

    /// POST /replica_sync/deregister_peer.
    pub fn deregister_replica_peer(&self, endpoint: &str) -> ServiceResult<()> {
        let m = self.mesh().ok_or(ServiceError::ReplicaSyncDisabled)?;
        if m.deregister_peer(endpoint) {
            Ok(())
        } else {
            Err(ServiceError::UnknownPeer("peer not found".into()))
        }
    }

    /// GET /replica_sync/bookings: this replica's live bookings, for peers'
    /// repairs.
    pub fn replica_bookings(&self) -> ServiceResult<BookingsSnapshot> {
        let m = self.mesh().ok_or(ServiceError::ReplicaSyncDisabled)?;
        Ok(m.snapshot(&self.ledger, self.affinity.as_ref()))
    }

    /// Books through the mesh (which publishes) when it runs.
    fn book(&self, b: Booking<'_>, meta: &BookMeta<'_>) -> Result<(), ReserveError> {
        match self.mesh() {
            Some(m) => m.book_local(&self.ledger, b, meta),
            None => self.ledger.book(b),
        }
    }

    fn ledger_prefill_complete(&self, id: &str) -> Result<(), ReserveError> {
        match self.mesh() {
            Some(m) => m.prefill_local(&self.ledger, id),
            None => self.ledger.prefill_complete(id),
        }
    }

    fn ledger_free(&self, id: &str) -> Result<(), ReserveError> {
        match self.mesh() {
            Some(m) => m.free_local(&self.ledger, id),
            None => self.ledger.free(id).map(drop),
        }
    }

    /// Wakes queued selections after a worker change (a new worker or new
    /// capacity may be room); released load wakes them through the ledger.
    fn room_made(&self) {
        if let Some(q) = &self.queue {
            q.released();
        }
    }

    /// Binds `session` to `wr` (with session affinity on) and tells the
    /// mesh when the binding is new or moved.
    fn bind_session(&self, model: &str, group: &str, session: &str, wr: crate::index::WorkerRank) {
        let Some(aff) = &self.affinity else {
            return;
        };
        if let Some(b) = aff.bind(model, group, session, wr, Instant::now()) {
            if let Some(m) = self.mesh() {
                m.publish_binding(crate::mesh::wire::Binding {
                    model_name: model.to_string(),
                    routing_group: group.to_string(),
                    session_id: session.to_string(),
                    worker_id: b.wr.worker_id,
                    dp_rank: b.wr.dp_rank,
                    sequence: b.sequence,
                    writer_id: m.router_id(),
                    seq: None,
                });
            }
        }
    }

    /// A booking of `chosen` for a session bound to `bound` elsewhere: the
    /// reference refuses it and drops the binding (here, locally), so that
    /// the session's next booking binds afresh.
    fn refuse_bound_elsewhere(
        &self,
        model: &str,
        group: &str,
        session: &str,
        bound: crate::index::WorkerRank,
        chosen: crate::index::WorkerRank,
    ) -> ServiceError {
        if let Some(aff) = &self.affinity {
            aff.unbind(model, group, session);
        }
        ServiceError::Invalid(format!(
            "session {session} is bound to worker {}, not {}",
            bound.worker_id, chosen.worker_id
        ))
    }

    /// Drops bookings older than the expiry and idle session bindings; the
    /// server calls it periodically.
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        if let Some(a) = &self.affinity {
            a.sweep(now);
        }
        self.ledger.sweep_expired(now)
    }
}

fn worker_not_found(worker_id: u64) -> ServiceError {
    ServiceError::UnknownWorker(format!("worker {worker_id} not found"))
}

fn no_schedulable(snap: &Snapshot, model: &str, group: &str) -> ServiceError {
    if snap.schedulable_workers == 0 {
        ServiceError::NoWorkers("no schedulable workers are available".into())
    } else {
        ServiceError::NoWorkers(format!(
            "no schedulable workers for {}",
            partition_display(model, group)
        ))
    }
}
