//! `kvselect._native`: the embedded selector, a drop-in for Dynamo 1.6.1's
//! `dynamo._core.SelectionService` (`selection-api.md`, Appendix B).
//!
//! It drives the same engine as the HTTP server (`kvselect::app::App`):
//! the same catalog, KV-event ingestion threads, index, ledger and pending
//! cache; only the edges differ. Requests come in as dicts read by typed
//! extraction (`extract`), replies go out through `pythonize` from the
//! engine's own reply types, and errors are mapped in one place (`errors`).
//!
//! Threads and the GIL: a call reads its dict with the GIL held (Python
//! objects cannot be read without it), then releases the GIL for the work
//! that costs (hashing, the index walk, the cost, the booking), then takes
//! it back to build the reply. That work runs on the calling thread: the
//! awaitable methods return an `asyncio.Future` that is already resolved,
//! which is cheaper than a hop to another thread and back, and keeps a
//! `delete_worker` or `add_output_block` that is never awaited (Ray does
//! that) effective at once. Another Python thread runs meanwhile; other
//! coroutines of the same event loop wait for the call, as for any
//! synchronous call, about a millisecond for a 100k-token prompt. The
//! running loop is looked up before any work: without one the call raises
//! `RuntimeError` having changed nothing.
//! KV-event ingestion, replay and recovery run on kvselect's own threads;
//! a sweeper thread expires stale bookings as the server does.

mod errors;
mod extract;

use errors::{shutting_down, to_py};
use kvselect::app::{App, Selection};
use kvselect::config::{Config, RouterConfig};
use kvselect::parse::SelectKind;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyTuple};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

pub use errors::SelectionServiceError;

/// How often stale bookings are swept (as in the server).
const SWEEP_INTERVAL: Duration = Duration::from_secs(5);

/// `SelectionCacheConfig(*, ttl_secs=None, max_entries=None, max_bytes=None)`:
/// limits of the pending-selection cache (the replay form of reservations).
#[pyclass(module = "kvselect._native", frozen)]
#[derive(Clone)]
pub struct SelectionCacheConfig {
    ttl_secs: Option<f64>,
    max_entries: Option<usize>,
    max_bytes: Option<usize>,
}

/// The keyword arguments' conversions: each as pyo3 converts it, with a
/// `TypeError` that names the argument as Dynamo's binding (an older pyo3)
/// words it (this pyo3 adds the name only as a note). `None` is absent for
/// the optional ones.
mod args {
    use super::{extract, SelectionCacheConfig};
    use pyo3::exceptions::PyTypeError;
    use pyo3::prelude::*;

    macro_rules! converted {
        ($($name:ident: $t:ty),* $(,)?) => {$(
            pub fn $name(v: &Bound<'_, PyAny>) -> PyResult<$t> {
                extract::named(stringify!($name), v.extract())
            }
        )*};
    }
    /// `name: T` converts as pyo3 does; `name: T = conv` with `conv(v, name)`.
    macro_rules! optional {
        ($($name:ident: $t:ty $(= $conv:path)?),* $(,)?) => {$(
            pub fn $name(v: &Bound<'_, PyAny>) -> PyResult<Option<$t>> {
                extract::some(v, |v| optional!(@conv v, stringify!($name) $(, $conv)?))
            }
        )*};
        (@conv $v:ident, $n:expr) => { extract::named($n, $v.extract()) };
        (@conv $v:ident, $n:expr, $conv:path) => { $conv($v, $n) };
    }

    fn text(v: &Bound<'_, PyAny>, name: &str) -> PyResult<String> {
        extract::str_arg(v, name).map(str::to_string)
    }

    converted!(
        indexer_threads: usize,
        allow_ipc_endpoints: bool,
        max_index_lag_ms: u64,
        index_lag_max_wait_ms: u64,
    );
    optional!(
        ttl_secs: f64,
        max_entries: usize,
        max_bytes: usize,
        replica_sync_port: u16,
        session_affinity_ttl_secs: f64,
        booking_expiry_secs: f64,
        max_tokens: usize,
        model_name: String = text,
        routing_group: String = text,
        simd: String = text,
        indexer_peers: Vec<String> = extract::strings_arg,
        replica_sync_peers: Vec<String> = extract::strings_arg,
    );

    pub fn endpoint(v: &Bound<'_, PyAny>) -> PyResult<String> {
        text(v, "endpoint")
    }

    pub fn peers(v: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
        extract::strings_arg(v, "peers")
    }

    pub fn replica_sync_host<'a>(v: &'a Bound<'_, PyAny>) -> PyResult<&'a str> {
        extract::str_arg(v, "replica_sync_host")
    }

    pub fn selection_cache<'py>(
        v: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, SelectionCacheConfig>>> {
        if v.is_none() {
            return Ok(None);
        }
        v.cast::<SelectionCacheConfig>().cloned().map(Some).map_err(|_| {
            PyTypeError::new_err(format!(
                "argument 'selection_cache': '{}' object cannot be converted to 'SelectionCacheConfig'",
                extract::type_name(v)
            ))
        })
    }
}

#[pymethods]
impl SelectionCacheConfig {
    #[new]
    #[pyo3(signature = (*, ttl_secs=None, max_entries=None, max_bytes=None))]
    fn new(
        #[pyo3(from_py_with = args::ttl_secs)] ttl_secs: Option<f64>,
        #[pyo3(from_py_with = args::max_entries)] max_entries: Option<usize>,
        #[pyo3(from_py_with = args::max_bytes)] max_bytes: Option<usize>,
    ) -> PyResult<Self> {
        if let Some(t) = ttl_secs {
            if !t.is_finite() || t < 0.0 {
                return Err(PyValueError::new_err(
                    "ttl_secs must be a finite, non-negative number",
                ));
            }
        }
        Ok(SelectionCacheConfig {
            ttl_secs,
            max_entries,
            max_bytes,
        })
    }
}

/// The sweeper thread's stop signal.
struct Sweeper {
    stop: Mutex<bool>,
    wake: Condvar,
}

/// The embedded selection service.
#[pyclass(module = "kvselect._native", frozen)]
pub struct SelectionService {
    app: Arc<App>,
    closed: AtomicBool,
    sweeper: Arc<Sweeper>,
    sweeper_thread: Mutex<Option<JoinHandle<()>>>,
}

/// `json.loads`, looked up once.
fn json_loads(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    static LOADS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    Ok(LOADS
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(py.import("json")?.getattr("loads")?.unbind())
        })?
        .bind(py)
        .clone())
}

/// `asyncio.get_running_loop`, looked up once.
fn running_loop(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    static GET: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    GET.get_or_try_init(py, || {
        Ok::<_, PyErr>(py.import("asyncio")?.getattr("get_running_loop")?.unbind())
    })?
    .bind(py)
    .call0()
}

/// A future of `event_loop` (the running loop, looked up before the call
/// does any work), already resolved with `r`.
fn resolved<'py>(
    event_loop: &Bound<'py, PyAny>,
    r: PyResult<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let fut = event_loop.call_method0("create_future")?;
    match r {
        Ok(v) => fut.call_method1("set_result", (v,))?,
        Err(e) => fut.call_method1("set_exception", (e.into_value(event_loop.py()),))?,
    };
    Ok(fut)
}

/// An engine reply as a future of `event_loop`, already resolved: the value
/// as Python objects, or the error mapped to its exception.
fn answer<'py, T: serde::Serialize>(
    event_loop: &Bound<'py, PyAny>,
    r: Result<T, kvselect::app::ServiceError>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = event_loop.py();
    resolved(event_loop, r.map_err(to_py).and_then(|v| to_object(py, &v)))
}

fn to_object<'py, T: serde::Serialize>(py: Python<'py>, v: &T) -> PyResult<Bound<'py, PyAny>> {
    pythonize::pythonize(py, v).map_err(PyErr::from)
}

/// A selection as a dict in Dynamo's key order: `selection_id`, then
/// `sequence_hashes` (a list of i64) when booked, then the rest.
fn selection_object<'py>(py: Python<'py>, sel: &Selection) -> PyResult<Bound<'py, PyAny>> {
    let fields = to_object(py, sel)?;
    let Some(h) = sel.sequence_hashes.as_deref() else {
        return Ok(fields);
    };
    let fields = fields.cast_into::<PyDict>()?;
    let out = PyDict::new(py);
    if let Some(id) = fields.get_item("selection_id")? {
        out.set_item("selection_id", id)?;
    }
    out.set_item(
        "sequence_hashes",
        PyList::new(py, h.iter().map(|&x| x as i64))?,
    )?;
    for (k, v) in fields.iter() {
        out.set_item(k, v)?;
    }
    Ok(out.into_any())
}

impl SelectionService {
    fn check_open(&self) -> PyResult<()> {
        if self.closed.load(Ordering::SeqCst) {
            Err(shutting_down())
        } else {
            Ok(())
        }
    }
}

#[pymethods]
impl SelectionService {
    #[new]
    #[pyo3(signature = (
        *,
        indexer_threads = 4,
        indexer_peers = None,
        replica_sync_port = None,
        replica_sync_peers = None,
        selection_cache = None,
        session_affinity_ttl_secs = None,
        booking_expiry_secs = None,
        max_tokens = None,
        replica_sync_host = "127.0.0.1",
        allow_ipc_endpoints = false,
        simd = None,
        // Literals, so the text signature shows them: the server's
        // DEFAULT_MAX_INDEX_LAG_MS and DEFAULT_INDEX_LAG_MAX_WAIT_MS.
        max_index_lag_ms = 50,
        index_lag_max_wait_ms = 1000,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        #[pyo3(from_py_with = args::indexer_threads)] indexer_threads: usize,
        #[pyo3(from_py_with = args::indexer_peers)] indexer_peers: Option<Vec<String>>,
        #[pyo3(from_py_with = args::replica_sync_port)] replica_sync_port: Option<u16>,
        #[pyo3(from_py_with = args::replica_sync_peers)] replica_sync_peers: Option<Vec<String>>,
        #[pyo3(from_py_with = args::selection_cache)] selection_cache: Option<
            Bound<'_, SelectionCacheConfig>,
        >,
        #[pyo3(from_py_with = args::session_affinity_ttl_secs)] session_affinity_ttl_secs: Option<
            f64,
        >,
        #[pyo3(from_py_with = args::booking_expiry_secs)] booking_expiry_secs: Option<f64>,
        #[pyo3(from_py_with = args::max_tokens)] max_tokens: Option<usize>,
        #[pyo3(from_py_with = args::replica_sync_host)] replica_sync_host: &str,
        #[pyo3(from_py_with = args::allow_ipc_endpoints)] allow_ipc_endpoints: bool,
        #[pyo3(from_py_with = args::simd)] simd: Option<String>,
        #[pyo3(from_py_with = args::max_index_lag_ms)] max_index_lag_ms: u64,
        #[pyo3(from_py_with = args::index_lag_max_wait_ms)] index_lag_max_wait_ms: u64,
    ) -> PyResult<Self> {
        if index_lag_max_wait_ms == 0 {
            return Err(PyValueError::new_err(
                "index_lag_max_wait_ms must be at least 1",
            ));
        }
        if let Some(t) = session_affinity_ttl_secs {
            if !(1.0..=31_536_000.0).contains(&t) {
                return Err(PyValueError::new_err(
                    "session_affinity_ttl_secs must be between 1 and 31536000",
                ));
            }
        }
        if replica_sync_peers.is_some() && replica_sync_port.is_none() {
            return Err(PyValueError::new_err(
                "replica_sync_peers requires replica_sync_port",
            ));
        }
        let router = RouterConfig::from_env_with(|k| std::env::var(k).ok())
            .map_err(PyValueError::new_err)?;
        let replica_sync_peers = replica_sync_peers.unwrap_or_default();
        for peer in &replica_sync_peers {
            kvselect::ingest::validate_endpoint(peer)
                .map_err(|e| PyValueError::new_err(format!("replica_sync_peers: {e}")))?;
        }
        let host: std::net::IpAddr = replica_sync_host.parse().map_err(|_| {
            PyValueError::new_err(format!(
                "replica_sync_host `{replica_sync_host}` is not an IP address"
            ))
        })?;
        // Dynamo's check (its message too): the mesh needs a real port.
        if replica_sync_port == Some(0) {
            return Err(PyValueError::new_err(
                "replica sync port must be greater than zero",
            ));
        }
        // The token loop: the keyword, else KVSELECT_SIMD, else the best
        // this CPU has (as the server's --simd).
        let simd = simd
            .or_else(|| std::env::var("KVSELECT_SIMD").ok())
            .unwrap_or_else(|| "auto".to_string());
        let number_path = kvselect::parse::NumberPath::choose_here(&simd)
            .map_err(|e| PyValueError::new_err(e.replacen("--simd", "simd", 1)))?;
        let mut config = Config {
            // The mesh's PUB binds on the address's IP; there is no HTTP
            // listener in the embedded form.
            addr: std::net::SocketAddr::new(host, 0),
            // 0 is one thread: the reference still indexes with it. Above
            // the server's cap, the cap: the reference takes any value (it
            // runs a fixed few threads), and each of ours holds sockets.
            ingest_threads: indexer_threads.clamp(1, kvselect::config::MAX_INGEST_THREADS),
            indexer_peers: indexer_peers.unwrap_or_default(),
            router,
            replica_sync_port,
            replica_sync_peers,
            session_affinity_ttl: session_affinity_ttl_secs.map(Duration::from_secs_f64),
            allow_ipc_endpoints,
            number_path,
            // The freshness gate, as the server's --max-index-lag-ms (0: off).
            freshness: kvselect::config::Freshness {
                max_lag: (max_index_lag_ms > 0).then(|| Duration::from_millis(max_index_lag_ms)),
                max_wait: Duration::from_millis(index_lag_max_wait_ms),
            },
            ..Config::default()
        };
        if let Some(c) = selection_cache.map(|c| c.get().clone()) {
            if let Some(t) = c.ttl_secs {
                config.selection_cache_ttl = Duration::from_secs_f64(t);
            }
            if let Some(n) = c.max_entries {
                config.selection_cache_max_entries = n;
            }
            if let Some(n) = c.max_bytes {
                config.selection_cache_max_bytes = n;
            }
        }
        if let Some(s) = booking_expiry_secs {
            if !s.is_finite() || s <= 0.0 {
                return Err(PyValueError::new_err(
                    "booking_expiry_secs must be positive",
                ));
            }
            config.booking_expiry = Duration::from_secs_f64(s);
        }
        if let Some(n) = max_tokens {
            config.max_tokens = n;
        }
        for peer in &config.indexer_peers {
            if !peer.starts_with("http://") {
                return Err(PyValueError::new_err(format!(
                    "indexer_peers entry `{peer}` must start with http://"
                )));
            }
        }
        let peers = config.indexer_peers.clone();
        let app = py
            .detach(|| -> Result<Arc<App>, String> {
                let app = Arc::new(App::new(config));
                if !peers.is_empty() {
                    recover(&app, &peers, false);
                }
                // The same replica mesh as the server's --replica-sync-port; no
                // HTTP listener here, so peers cannot repair from this replica
                // over HTTP (they still get its live messages).
                app.start_mesh(None)?;
                Ok(app)
            })
            .map_err(|e| PyValueError::new_err(format!("cannot start the replica mesh: {e}")))?;
        let sweeper = Arc::new(Sweeper {
            stop: Mutex::new(false),
            wake: Condvar::new(),
        });
        let thread = {
            let (app, sweeper) = (Arc::clone(&app), Arc::clone(&sweeper));
            std::thread::Builder::new()
                .name("kvselect-sweeper".into())
                .spawn(move || sweep_until_stopped(&app, &sweeper))
                .map_err(|e| PyValueError::new_err(format!("cannot start the sweeper: {e}")))?
        };
        Ok(SelectionService {
            app,
            closed: AtomicBool::new(false),
            sweeper,
            sweeper_thread: Mutex::new(Some(thread)),
        })
    }

    // ----- workers -----

    fn upsert_worker<'py>(
        &self,
        py: Python<'py>,
        worker: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let fields = extract::worker_fields(worker, extract::WorkerDict::Upsert)?;
        let event_loop = running_loop(py)?;
        let r = if self.closed.load(Ordering::SeqCst) {
            Err(shutting_down())
        } else {
            let rec = py.detach(|| self.app.upsert_worker(fields));
            to_object(py, &rec)
        };
        resolved(&event_loop, r)
    }

    fn patch_worker<'py>(
        &self,
        py: Python<'py>,
        worker_id: &Bound<'py, PyAny>,
        patch: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let worker_id = extract::worker_id_arg(worker_id)?;
        let fields = extract::worker_fields(patch, extract::WorkerDict::Patch)?;
        let event_loop = running_loop(py)?;
        answer(
            &event_loop,
            py.detach(|| self.app.patch_worker(worker_id, fields)),
        )
    }

    fn delete_worker<'py>(
        &self,
        py: Python<'py>,
        worker_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let worker_id = extract::worker_id_arg(worker_id)?;
        let event_loop = running_loop(py)?;
        answer(&event_loop, py.detach(|| self.app.delete_worker(worker_id)))
    }

    #[pyo3(signature = (*, model_name=None, routing_group=None))]
    fn list_workers<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = args::model_name)] model_name: Option<String>,
        #[pyo3(from_py_with = args::routing_group)] routing_group: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        to_object(
            py,
            &self
                .app
                .list_workers(model_name.as_deref(), routing_group.as_deref()),
        )
    }

    fn ready<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_object(py, &self.app.readiness())
    }

    // ----- selection -----

    fn select<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.select_kind(py, request, SelectKind::Select)
    }

    fn select_and_reserve<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.select_kind(py, request, SelectKind::SelectAndReserve)
    }

    fn overlap_scores<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let req = extract::prompt_query_request(&self.app.parser, request)?;
        let event_loop = running_loop(py)?;
        answer(&event_loop, py.detach(|| self.app.overlap_scores(&req)))
    }

    fn potential_loads<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let req = extract::prompt_query_request(&self.app.parser, request)?;
        let event_loop = running_loop(py)?;
        answer(&event_loop, py.detach(|| self.app.potential_loads(&req)))
    }

    // ----- reservations -----

    fn create_reservation<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let req = extract::reservation_request(&self.app.parser, request)?;
        let event_loop = running_loop(py)?;
        answer(&event_loop, py.detach(|| self.app.create_reservation(&req)))
    }

    fn prefill_complete<'py>(
        &self,
        py: Python<'py>,
        selection_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let selection_id = extract::selection_id_arg(selection_id)?;
        let event_loop = running_loop(py)?;
        let r = self
            .app
            .prefill_complete(&selection_id)
            .map_err(to_py)
            .map(|()| PyTuple::empty(py).into_any());
        resolved(&event_loop, r)
    }

    #[pyo3(signature = (selection_id, *, decay_fraction=None))]
    fn add_output_block(
        &self,
        selection_id: &Bound<'_, PyAny>,
        decay_fraction: Option<f64>,
    ) -> PyResult<()> {
        let selection_id = extract::selection_id_arg(selection_id)?;
        self.app
            .output_block(&selection_id, decay_fraction)
            .map_err(to_py)
    }

    fn free_reservation<'py>(
        &self,
        py: Python<'py>,
        selection_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let selection_id = extract::selection_id_arg(selection_id)?;
        let event_loop = running_loop(py)?;
        let r = self
            .app
            .free_reservation(&selection_id)
            .map_err(to_py)
            .map(|()| PyTuple::empty(py).into_any());
        resolved(&event_loop, r)
    }

    // ----- reports -----

    #[pyo3(signature = (*, model_name=None, routing_group=None))]
    fn loads<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = args::model_name)] model_name: Option<String>,
        #[pyo3(from_py_with = args::routing_group)] routing_group: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        to_object(
            py,
            &self
                .app
                .loads(model_name.as_deref(), routing_group.as_deref()),
        )
    }

    /// The index in the `/dump` recovery format: a future resolved with it
    /// as a dict, as Dynamo's.
    fn indexer_snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let event_loop = running_loop(py)?;
        let json = py.detach(|| self.app.dump());
        let dump = json_loads(py).and_then(|loads| loads.call1((json,)));
        resolved(&event_loop, dump)
    }

    /// Loads the index from the first of `peers` (`http://host:port`, as
    /// `indexer_peers`) whose `/dump` loads; the future resolves with
    /// whether one did. The fetches (each up to the recovery timeout) run
    /// on a thread of their own, so the event loop keeps running.
    fn recover_indexer_from_peers<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = args::peers)] peers: Vec<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let event_loop = running_loop(py)?;
        let app = Arc::clone(&self.app);
        future_from_thread(
            event_loop,
            "kvselect-recovery",
            move |_| Some(recover(&app, &peers, true)),
            |py, recovered| {
                Ok(pyo3::types::PyBool::new(py, recovered)
                    .to_owned()
                    .into_any())
            },
        )
    }

    // ----- replica mesh -----

    /// The mesh's peer endpoints, sorted; `[]` when replica sync is off.
    fn list_replica_peers(&self) -> Vec<String> {
        self.app.replica_peers()
    }

    /// Subscribes to one more peer replica's PUB endpoint (`tcp://host:port`,
    /// as `replica_sync_peers`); the future resolves with whether the
    /// membership changed.
    fn register_replica_peer<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = args::endpoint)] endpoint: String,
    ) -> PyResult<Bound<'py, PyAny>> {
        let event_loop = running_loop(py)?;
        answer(&event_loop, self.app.register_replica_peer(&endpoint))
    }

    /// Stops following a peer replica; the future resolves with whether the
    /// membership changed.
    fn deregister_replica_peer<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = args::endpoint)] endpoint: String,
    ) -> PyResult<Bound<'py, PyAny>> {
        let event_loop = running_loop(py)?;
        let r = match self.app.deregister_replica_peer(&endpoint) {
            Ok(()) => Ok(true),
            Err(kvselect::app::ServiceError::UnknownPeer(_)) => Ok(false),
            Err(e) => Err(e),
        };
        answer(&event_loop, r)
    }

    // ----- lifecycle -----

    /// Stops taking new work (selections and worker upserts fail with
    /// `not_ready`), stops the KV-event threads and the sweeper, and closes
    /// every socket. Live bookings can still be completed and freed. Safe to
    /// call twice.
    fn shutdown(&self, py: Python<'_>) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        self.app.begin_shutdown();
        py.detach(|| {
            *self.sweeper.stop.lock().unwrap_or_else(|p| p.into_inner()) = true;
            self.sweeper.wake.notify_all();
            if let Some(t) = self
                .sweeper_thread
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
            {
                let _ = t.join();
            }
            self.app.catalog.hub().shutdown();
            if let Some(m) = self.app.mesh() {
                m.stop();
            }
        });
    }

    fn shutdown_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let event_loop = running_loop(py)?;
        self.shutdown(py);
        resolved(&event_loop, Ok(PyTuple::empty(py).into_any()))
    }
}

impl SelectionService {
    fn select_kind<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        kind: SelectKind,
    ) -> PyResult<Bound<'py, PyAny>> {
        let req = extract::select_request(&self.app.parser, request, kind)?;
        // Before any work: without a running loop the call fails and books
        // nothing.
        let event_loop = running_loop(py)?;
        if let Err(e) = self.check_open() {
            return resolved(&event_loop, Err(e));
        }
        if let Some(r) = py.detach(|| self.app.select_if_admitted(&req, kind)) {
            return resolved(
                &event_loop,
                r.map_err(to_py).and_then(|sel| selection_object(py, &sel)),
            );
        }
        // Queued (DYN_ROUTER_QUEUE_THRESHOLD): wait on a thread of its own
        // and settle the future on its loop; a cancelled future leaves the
        // queue unbooked.
        let app = Arc::clone(&self.app);
        future_from_thread(
            event_loop,
            "kvselect-queued",
            move |pending| {
                let wanted = || {
                    Python::attach(|py| {
                        !pending
                            .bind(py)
                            .call_method0("done")
                            .and_then(|d| d.is_truthy())
                            .unwrap_or(true)
                    })
                };
                app.select_blocking(&req, kind, wanted)
            },
            |py, r| r.map_err(to_py).and_then(|s| selection_object(py, &s)),
        )
    }
}

impl Drop for SelectionService {
    fn drop(&mut self) {
        *self.sweeper.stop.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.sweeper.wake.notify_all();
    }
}

fn sweep_until_stopped(app: &App, s: &Sweeper) {
    let mut stop = s.stop.lock().unwrap_or_else(|p| p.into_inner());
    while !*stop {
        let (g, timeout) = s
            .wake
            .wait_timeout(stop, SWEEP_INTERVAL)
            .unwrap_or_else(|p| p.into_inner());
        stop = g;
        if timeout.timed_out() && !*stop {
            let n = app.sweep();
            if n > 0 {
                tracing::info!(expired = n, "expired stale bookings");
            }
        }
    }
}

/// Loads the peers' indexes: every peer's at start-up (as the server does),
/// or with `first` only the first that loads. Whether any did.
fn recover(app: &App, peers: &[String], first: bool) -> bool {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::warn!(error = %e, "index recovery skipped: no runtime");
            return false;
        }
    };
    let mut any = false;
    for peer in peers {
        match rt.block_on(kvselect::recovery::load_peer_dump(app, peer)) {
            Ok(n) => {
                tracing::info!(%peer, events = n, "recovered index from peer");
                any = true;
                if first {
                    break;
                }
            }
            Err(e) => tracing::warn!(%peer, error = %e, "index recovery from peer failed"),
        }
    }
    any
}

/// A future of `event_loop` settled from a thread of its own (`name`):
/// `work` runs there without the GIL and gets the pending future (to see
/// whether it was cancelled); its value, unless `None`, becomes the answer
/// through `answer` with the GIL, on the loop (`call_soon_threadsafe`, then
/// [`settle`]). A closed loop has nobody awaiting the answer.
fn future_from_thread<'py, T: 'static>(
    event_loop: Bound<'py, PyAny>,
    name: &str,
    work: impl FnOnce(&Py<PyAny>) -> Option<T> + Send + 'static,
    answer: impl for<'a> FnOnce(Python<'a>, T) -> PyResult<Bound<'a, PyAny>> + Send + 'static,
) -> PyResult<Bound<'py, PyAny>> {
    let fut = event_loop.call_method0("create_future")?;
    let (event_loop, pending) = (event_loop.unbind(), fut.clone().unbind());
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let Some(v) = work(&pending) else {
                return;
            };
            Python::attach(|py| {
                let (ok, value) = match answer(py, v) {
                    Ok(v) => (true, v.unbind()),
                    Err(e) => (false, e.into_value(py).into_any()),
                };
                let sent = wrap_pyfunction!(settle, py).and_then(|f| {
                    event_loop.call_method1(py, "call_soon_threadsafe", (f, &pending, ok, value))
                });
                if let Err(e) = sent {
                    tracing::debug!(error = %e, "a future's loop is gone");
                }
            });
        })
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start a thread: {e}")))?;
    Ok(fut)
}

/// Settles a future on its loop (a queued selection, a recovery), unless it
/// was cancelled meanwhile.
#[pyfunction]
fn settle(fut: &Bound<'_, PyAny>, ok: bool, value: &Bound<'_, PyAny>) -> PyResult<()> {
    if fut.call_method0("done")?.is_truthy()? {
        return Ok(());
    }
    let method = if ok { "set_result" } else { "set_exception" };
    fut.call_method1(method, (value,))?;
    Ok(())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SelectionService>()?;
    m.add_class::<SelectionCacheConfig>()?;
    m.add(
        "SelectionServiceError",
        m.py().get_type::<SelectionServiceError>(),
    )?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
