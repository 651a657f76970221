//! Agentic-session load generator: registers a [`Mocker`] fleet with a
//! selector and drives turns against it over keep-alive HTTP, measuring
//! throughput, selection latency and the CPU of both the selector and itself.
//!
//! Owns the workload model and its accounting. A session's prompt is a shared
//! system prefix plus a per-session history that grows by `turn_growth`
//! tokens each turn; a session that passes the top length restarts as a new
//! session (new history) at the bottom length, so prompt lengths stay
//! uniform between the two and average `mean_isl`. Each turn is one booking
//! lifecycle (spec `selection-api.md` §4.9-§4.11):
//!
//! - `Reserve` flow: `POST /select_and_reserve` (the timed call), the chosen
//!   mock worker serves the prompt (publishing its KV events), then
//!   `prefill_complete`, `output_blocks` x `output_block`, the decode wait
//!   (`decode`, the booking held), `DELETE`.
//! - `Ray` flow (the embedded-Python pattern): `POST /select` with a
//!   `selection_id` (timed), serve, `POST /reservations` replay, then the same
//!   lifecycle.
//!
//! A selection answered 429 is retried after its `Retry-After` and counted
//! apart from errors. Besides latency and CPU, the report carries routing
//! quality measured here (hit ratio, session moves, blocks the mock engines
//! stored) and the server's own freshness figures (`harness::freshness`).
//!
//! Tokens are a pure function of (session, generation, position), so nothing
//! but a length is stored per session unless the JSON cache fits the budget.
//! Every loop is bounded by `duration` and `max_requests`; only loopback
//! addresses are used.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::task::JoinSet;

use super::freshness::{Freshness, Reading};
use super::http::{scan_u64, HttpConn};
use super::mocker::{Mocker, Published};
use super::procstat;

/// Llama-3 vocabulary size; token ids are drawn below it.
const VOCAB: u64 = 128_256;

/// Which request sequence a turn uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Flow {
    Reserve,
    Ray,
}

impl std::str::FromStr for Flow {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "reserve" | "select_and_reserve" => Ok(Flow::Reserve),
            "ray" | "select" => Ok(Flow::Ray),
            _ => Err(format!("unknown flow {s:?} (reserve | ray)")),
        }
    }
}

/// Workload and run bounds.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// `127.0.0.1:PORT` of the selector.
    pub addr: String,
    pub sessions: usize,
    pub prefix_tokens: usize,
    pub mean_isl: usize,
    pub turn_growth: usize,
    pub output_blocks: usize,
    pub flow: Flow,
    pub warmup: Duration,
    pub duration: Duration,
    /// Upper bound on turns started (all sessions together).
    pub max_requests: u64,
    /// Pause of a session between two turns (simulated engine time).
    pub think: Duration,
    pub request_timeout: Duration,
    /// Selector process to account CPU for.
    pub server_pid: Option<u32>,
    pub seed: u64,
    /// Per-session prompt JSON is cached while the total stays under this.
    pub json_cache_bytes: usize,
    /// Turns in progress at once (each holds its prompt buffers, ~1 MB at
    /// 99k tokens); sessions beyond it wait for a slot before selecting.
    pub max_inflight: usize,
    /// Turns started per second, all sessions together (`None`: each
    /// session starts its next turn as soon as the last one ends). Turns
    /// are spaced evenly; when every session is busy the rate falls short
    /// and no backlog builds up (so a slow server sees fewer turns, never a
    /// burst), which the report's requests/s shows. A turn waits for its
    /// start time first, then for a `max_inflight` slot; the selection
    /// latency is timed from the request's send, so keep `max_inflight` at
    /// the session count (the `small` profile does) when comparing latency.
    ///
    /// A session's first turn is not paced: all sessions start at once, so
    /// that their histories spread over the workers as in a fleet that has
    /// been running. Paced first turns (one every 10 ms at 100 turns/s) can
    /// meet idle workers one at a time, and then the shared prefix draws
    /// each new session to the few workers that already hold it (fewer
    /// uncached blocks); those workers' caches thrash and the hit ratio falls
    /// to about the prefix's share (0.17 for `small`), depending on timing.
    pub rate: Option<f64>,
    /// Time a turn holds its reservation between its last `output_block`
    /// and the free (the engine's decode).
    pub decode: Duration,
    /// After the load stops, the server's CPU is sampled this long (a
    /// backlog of KV events shows as CPU with no requests).
    pub tail: Duration,
}

/// Longest spacing of paced turns (a rate below one turn a day is taken as
/// one a day).
const MAX_TURN_SPACING: Duration = Duration::from_secs(86_400);

impl Default for LoadConfig {
    fn default() -> Self {
        Self {
            addr: "127.0.0.1:8092".into(),
            sessions: 8192,
            prefix_tokens: 16_384,
            mean_isl: 99_000,
            turn_growth: 2_048,
            output_blocks: 3,
            flow: Flow::Reserve,
            warmup: Duration::from_secs(5),
            duration: Duration::from_secs(60),
            max_requests: 10_000_000,
            think: Duration::ZERO,
            request_timeout: Duration::from_secs(30),
            server_pid: None,
            seed: 7,
            json_cache_bytes: 1 << 30,
            max_inflight: 256,
            rate: None,
            decode: Duration::ZERO,
            tail: Duration::from_secs(5),
        }
    }
}

/// Results of one run, printed as a table and as one JSON line.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Report {
    pub server: String,
    pub flow: String,
    /// Offered turns/s (`None`: unpaced).
    pub offered_rate: Option<f64>,
    /// Pause of a session between its turns.
    pub think_ms: u64,
    /// Reservation held between the last output block and the free.
    pub decode_ms: u64,
    /// How the server and the harness were placed on cores (`unpinned`, or
    /// `server 0, client 1`); `None` when the runner did not say.
    pub pinning: Option<String>,
    pub workers: usize,
    pub sessions: usize,
    pub mean_isl_target: usize,
    pub mean_isl_observed: f64,
    pub window_s: f64,
    pub requests: u64,
    /// Failed calls (a 429 is not one: see `rejected_429`).
    pub errors: u64,
    /// Selections answered 429 (shed by the server's admission control) in
    /// the window; each turn was retried after `Retry-After`.
    pub rejected_429: u64,
    pub requests_per_s: f64,
    pub select_p50_ms: f64,
    pub select_p99_ms: f64,
    pub select_p999_ms: f64,
    pub select_max_ms: f64,
    pub server_cpu_s: Option<f64>,
    pub server_cpu_ms_per_request: Option<f64>,
    pub server_cores_used: Option<f64>,
    /// Length of the tail period sampled once the load stopped.
    pub tail_s: Option<f64>,
    /// Server cores used in the tail period (work left after the load).
    pub tail_server_cores_used: Option<f64>,
    pub harness_cpu_s: f64,
    pub harness_cores_used: f64,
    /// Cores busy machine-wide minus server and harness: other processes
    /// competing for the same cores during the window.
    pub other_cores_used: Option<f64>,
    /// Share of prompt blocks the chosen mock worker already had cached.
    pub kv_hit_ratio: f64,
    /// Counted turns whose session (same history) had its previous turn
    /// counted in the window too.
    pub session_turns_with_previous: u64,
    /// Of those, turns sent to a different worker than the previous turn.
    pub session_moves: u64,
    /// `session_moves / session_turns_with_previous`.
    pub session_moves_per_request: Option<f64>,
    /// Blocks the mock engines announced in `BlockStored` in the window.
    pub blocks_stored: u64,
    pub blocks_stored_per_request: Option<f64>,
    /// Blocks the mock engines evicted (`BlockRemoved`) in the window.
    pub blocks_removed: u64,
    pub blocks_removed_per_request: Option<f64>,
    /// KV-event batches the mock engines published in the window.
    pub kv_batches_published: u64,
    /// The server's own freshness figures (`None`s for the reference).
    pub freshness: Freshness,
    /// The server's token-array loop (`avx512`, `avx2`, `sse4.1`, `scalar`), read from
    /// its `/metrics` gauge `kvselect_simd_path`; `None` for a server without
    /// it (the reference).
    pub simd_path: Option<String>,
    pub first_error: Option<String>,
}

#[derive(Debug)]
pub struct LoadError(pub String);

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LoadError {}

fn err(msg: impl Into<String>) -> LoadError {
    LoadError(msg.into())
}

#[inline]
fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Token at `pos` of the stream identified by `stream`.
#[inline]
fn token(stream: u64, pos: usize) -> u32 {
    (splitmix(stream ^ (pos as u64).wrapping_mul(0xd6e8_feb8_6659_fd93)) % VOCAB) as u32
}

fn push_json_tokens(out: &mut Vec<u8>, stream: u64, from: usize, to: usize) {
    let mut b = itoa::Buffer::new();
    for pos in from..to {
        out.extend_from_slice(b.format(token(stream, pos)).as_bytes());
        out.push(b',');
    }
}

/// Registers every mock worker with the selector (`POST /workers`) and waits
/// until `/ready` counts them all as schedulable and every worker's KV-event
/// socket has the selector's subscription, so no event published after this
/// returns is lost to ZeroMQ's slow joiner.
pub async fn register_workers(
    addr: &str,
    mocker: &Mocker,
    timeout: Duration,
) -> Result<(), LoadError> {
    let mut conn = HttpConn::connect(addr)
        .await
        .map_err(|e| err(format!("connect {addr}: {e}")))?;
    let bs = mocker.config().block_size;
    let eps = mocker.endpoints();
    for ep in &eps {
        let body = serde_json::json!({
            "worker_id": ep.worker_id,
            "endpoint": format!("http://127.0.0.1:9/mock/{}", ep.worker_id),
            "block_size": bs,
            "kv_events_endpoints": {"0": ep.kv_events},
            "replay_endpoint": ep.replay,
        })
        .to_string();
        if !conn.reusable() {
            conn = HttpConn::connect(addr)
                .await
                .map_err(|e| err(format!("connect {addr}: {e}")))?;
        }
        let status = conn
            .request("POST", "/workers", Some(body.as_bytes()), timeout)
            .await
            .map_err(|e| err(format!("POST /workers: {e}")))?;
        let text = String::from_utf8_lossy(conn.body());
        if status != 201 || !text.contains("\"schedulable\"") {
            return Err(err(format!(
                "POST /workers for {} -> {status}: {text}",
                ep.worker_id
            )));
        }
    }
    let deadline = Instant::now() + timeout;
    loop {
        let status = conn
            .request("GET", "/ready", None, timeout)
            .await
            .map_err(|e| err(format!("GET /ready: {e}")))?;
        let n = scan_u64(conn.body(), "schedulable_workers").unwrap_or(0);
        let subscribed = mocker.subscribed();
        if status == 200 && n as usize >= eps.len() && subscribed == eps.len() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(err(format!(
                "selector not ready: {n} of {} schedulable, {subscribed} subscribed",
                eps.len()
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Connection pool shared by the sessions: a stack of idle keep-alive
/// connections; a session takes one per request and gives it back.
struct Pool {
    addr: String,
    idle: Mutex<Vec<HttpConn>>,
}

impl Pool {
    async fn get(&self) -> std::io::Result<HttpConn> {
        let c = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match c {
            Some(c) => Ok(c),
            None => HttpConn::connect(&self.addr).await,
        }
    }

    fn put(&self, c: HttpConn) {
        if c.reusable() {
            self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(c);
        }
    }
}

struct Shared {
    cfg: LoadConfig,
    mocker: Arc<Mocker>,
    pool: Pool,
    prefix_json: Vec<u8>,
    prefix_stream: u64,
    measure_start: Instant,
    end: Instant,
    started: AtomicU64,
    inflight: tokio::sync::Semaphore,
    cache_json: bool,
    min_len: usize,
    max_len: usize,
    /// With a rate: (start time of the next turn, spacing of turns).
    pacer: Option<(Mutex<Instant>, Duration)>,
}

impl Shared {
    /// Waits for this turn's start time when the load is paced.
    async fn pace(&self) {
        let Some((next, every)) = &self.pacer else {
            return;
        };
        let at = {
            let mut n = next.lock().unwrap_or_else(|p| p.into_inner());
            let at = (*n).max(Instant::now());
            *n = at + *every;
            at
        };
        tokio::time::sleep_until(at.into()).await;
    }
}

#[derive(Default)]
struct SessionStats {
    lat_us: Vec<u32>,
    requests: u64,
    errors: u64,
    isl_sum: u64,
    hit_blocks: u64,
    prompt_blocks: u64,
    rejected_429: u64,
    turns_with_previous: u64,
    moves: u64,
    first_error: Option<String>,
}

impl SessionStats {
    fn error(&mut self, in_window: bool, msg: String) {
        if in_window {
            self.errors += 1;
            if self.first_error.is_none() {
                self.first_error = Some(msg);
            }
        }
    }
}

/// Wait before retrying a selection answered 429 without a usable
/// `Retry-After`.
const SHED_BACKOFF: Duration = Duration::from_millis(50);
/// Longest `Retry-After` honoured (a larger one is cut to this).
const MAX_RETRY_AFTER: Duration = Duration::from_secs(10);

/// A successful answer of [`call`].
enum Answer {
    /// The expected status; the `worker_id` when asked for.
    Done(Option<u64>),
    /// 429 (only when the caller accepts it): retry after this long.
    Shed(Duration),
}

/// One call on a pooled connection; `Err` text names the call. Returns the
/// response's `worker_id` when `want_worker` (an error if it is missing).
/// With `shed_ok`, a 429 is an answer, not an error.
async fn call(
    sh: &Shared,
    method: &str,
    path: &str,
    body: Option<&[&[u8]]>,
    want: u16,
    want_worker: bool,
    shed_ok: bool,
) -> Result<Answer, String> {
    let mut c = sh.pool.get().await.map_err(|e| format!("connect: {e}"))?;
    let r = c
        .request_parts(method, path, body, sh.cfg.request_timeout)
        .await;
    let res = match r {
        Ok(s) if s == want => {
            if want_worker {
                match scan_u64(c.body(), "worker_id") {
                    Some(w) => Ok(Answer::Done(Some(w))),
                    None => Err(format!("{method} {path}: no worker_id in response")),
                }
            } else {
                Ok(Answer::Done(None))
            }
        }
        Ok(429) if shed_ok => Ok(Answer::Shed(
            c.retry_after()
                .unwrap_or(SHED_BACKOFF)
                .clamp(Duration::from_millis(1), MAX_RETRY_AFTER),
        )),
        Ok(s) => Err(format!(
            "{method} {path} -> {s}: {}",
            String::from_utf8_lossy(&c.body()[..c.body().len().min(300)])
        )),
        Err(e) => Err(format!("{method} {path}: {e}")),
    };
    sh.pool.put(c);
    res
}

/// A lifecycle call: the expected status or an error.
async fn step(
    sh: &Shared,
    method: &str,
    path: &str,
    body: Option<&[&[u8]]>,
    want: u16,
) -> Result<(), String> {
    call(sh, method, path, body, want, false, false)
        .await
        .map(|_| ())
}

/// One lifecycle call of a turn: method, path, JSON body parts.
type Step<'a> = (&'a str, String, Option<&'a [&'a [u8]]>);

async fn run_session(sh: Arc<Shared>, sid: u64, start_len: usize) -> SessionStats {
    let cfg = &sh.cfg;
    let mut st = SessionStats::default();
    let mut gen: u64 = 0;
    let mut len = start_len;
    let mut turn: u64 = 0;
    let prefix = cfg.prefix_tokens;
    // With the cache on, the session keeps its prompt tokens and the JSON of
    // its history (every token followed by ',') and only appends each turn.
    let mut cached_tokens: Vec<u32> = Vec::new();
    let mut hist_json: Vec<u8> = Vec::new();
    let mut hist_json_len = prefix; // history tokens covered by hist_json
                                    // Worker of the session's previous answered turn, and whether that turn
                                    // was counted in the window; reset when the session restarts.
    let mut prev: Option<(u64, bool)> = None;
    loop {
        if Instant::now() >= sh.end {
            break;
        }
        // A session's first turn is not paced: all sessions start together,
        // as in a fleet that has been running (see `LoadConfig::rate`).
        if turn > 0 {
            sh.pace().await;
        }
        if Instant::now() >= sh.end
            || sh.started.fetch_add(1, Ordering::Relaxed) >= cfg.max_requests
        {
            break;
        }
        let Ok(_permit) = sh.inflight.acquire().await else {
            break;
        };
        if Instant::now() >= sh.end {
            break;
        }
        let stream = splitmix(cfg.seed ^ splitmix(sid << 24 | gen));
        // Without the cache, buffers live for one turn only, so memory
        // follows the turns in flight rather than the number of sessions.
        let mut turn_tokens: Vec<u32> = Vec::new();
        let tokens: &mut Vec<u32> = if sh.cache_json {
            &mut cached_tokens
        } else {
            &mut turn_tokens
        };
        if tokens.len() > len {
            tokens.clear();
        }
        if tokens.len() < prefix.min(len) {
            tokens.clear();
            tokens.extend((0..prefix.min(len)).map(|p| token(sh.prefix_stream, p)));
        }
        let from = tokens.len();
        tokens.extend((from..len).map(|p| token(stream, p)));
        if !sh.cache_json || hist_json_len > len {
            hist_json.clear();
            hist_json_len = prefix;
        }
        if len > prefix {
            push_json_tokens(&mut hist_json, stream, hist_json_len, len);
            hist_json_len = len;
        }
        let sel_id = format!("s{sid}g{gen}t{turn}");
        let tail = format!("],\"selection_id\":\"{sel_id}\"}}");
        // Body = head, prefix JSON, history JSON, tail; the last token's
        // trailing comma is cut.
        let pre = &sh.prefix_json[..json_prefix_bytes(&sh, len)];
        let (pre, hist) = if hist_json.is_empty() {
            (&pre[..pre.len().saturating_sub(1)], &hist_json[..])
        } else {
            (pre, &hist_json[..hist_json.len() - 1])
        };
        let parts: [&[u8]; 4] = [b"{\"token_ids\":[", pre, hist, tail.as_bytes()];

        let route = match cfg.flow {
            Flow::Reserve => "/select_and_reserve",
            Flow::Ray => "/select",
        };
        // A 429 is the server shedding load: the turn waits `Retry-After`
        // and tries again (until the run ends), and only the answered
        // attempt is timed.
        let (r, t0, t1) = loop {
            let t0 = Instant::now();
            let r = call(&sh, "POST", route, Some(&parts), 200, true, true).await;
            let t1 = Instant::now();
            match r {
                Ok(Answer::Shed(wait)) => {
                    if t0 >= sh.measure_start && t0 < sh.end {
                        st.rejected_429 += 1;
                    }
                    if Instant::now() + wait >= sh.end {
                        break (Ok(None), t0, t1);
                    }
                    tokio::time::sleep(wait).await;
                }
                Ok(Answer::Done(w)) => break (Ok(w), t0, t1),
                Err(e) => break (Err(e), t0, t1),
            }
        };
        let in_window = t0 >= sh.measure_start && t1 <= sh.end;
        // A turn that started in the window counts its failures even when
        // they surface after it (a timeout outlives the window).
        let err_window = t0 >= sh.measure_start;
        let shed_to_the_end = matches!(r, Ok(None));
        let worker = match r {
            Ok(w) => w,
            Err(e) => {
                st.error(err_window, e);
                None
            }
        };
        if let Some(w) = worker {
            // A move: the session's previous turn (same history, counted in
            // the window) went to another worker.
            if in_window {
                if let Some((pw, true)) = prev {
                    st.turns_with_previous += 1;
                    st.moves += u64::from(pw != w);
                }
            }
            prev = Some((w, in_window));
        }
        if let Some(worker) = worker {
            if in_window {
                st.lat_us
                    .push((t1 - t0).as_micros().min(u32::MAX as u128) as u32);
                st.requests += 1;
                st.isl_sum += len as u64;
            }
            let mut failed = false;
            match sh.mocker.serve(worker, tokens) {
                Ok(o) => {
                    if in_window {
                        st.hit_blocks += o.hit_blocks as u64;
                        st.prompt_blocks += (o.hit_blocks + o.stored_blocks) as u64;
                    }
                }
                Err(e) => {
                    st.error(err_window, format!("serve: {e}"));
                    failed = true;
                }
            }
            if cfg.flow == Flow::Ray && !failed {
                let rb = format!("{{\"selection_id\":\"{sel_id}\"}}");
                let rb: [&[u8]; 1] = [rb.as_bytes()];
                if let Err(e) = step(&sh, "POST", "/reservations", Some(&rb), 201).await {
                    st.error(err_window, e);
                    failed = true;
                }
            }
            if !failed {
                let base = format!("/reservations/{sel_id}");
                let empty: [&[u8]; 1] = [b"{}"];
                let mut steps: Vec<Step<'_>> =
                    vec![("POST", format!("{base}/prefill_complete"), None)];
                for _ in 0..cfg.output_blocks {
                    steps.push(("POST", format!("{base}/output_block"), Some(&empty)));
                }
                steps.push(("DELETE", base.clone(), None));
                for (m, p, b) in steps {
                    if m == "DELETE" && !cfg.decode.is_zero() {
                        // The engine decodes with the booking held.
                        tokio::time::sleep(cfg.decode).await;
                    }
                    if let Err(e) = step(&sh, m, &p, b, 200).await {
                        st.error(err_window, e);
                        break;
                    }
                }
            }
        } else if shed_to_the_end {
            break;
        } else {
            // Back off a little so a failing server is not spun on.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop((turn_tokens, _permit));
        if !sh.cache_json {
            hist_json = Vec::new();
        }
        turn += 1;
        len += cfg.turn_growth;
        if len > sh.max_len {
            gen += 1;
            prev = None;
            len = sh.min_len;
            cached_tokens.clear();
            hist_json.clear();
            hist_json_len = prefix;
        }
        if !cfg.think.is_zero() {
            tokio::time::sleep(cfg.think).await;
        }
    }
    st
}

/// JSON bytes of the first `min(len, prefix)` prefix tokens.
fn json_prefix_bytes(sh: &Shared, len: usize) -> usize {
    if len >= sh.cfg.prefix_tokens {
        sh.prefix_json.len()
    } else {
        // Only when the prompt is shorter than the prefix (tiny profiles):
        // count commas.
        let mut seen = 0;
        for (i, &c) in sh.prefix_json.iter().enumerate() {
            if c == b',' {
                seen += 1;
                if seen == len {
                    return i + 1;
                }
            }
        }
        sh.prefix_json.len()
    }
}

fn percentile(sorted: &[u32], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i] as f64 / 1000.0
}

/// Runs the sessions against an already registered fleet and returns the
/// measured report. Bounded by `cfg.warmup + cfg.duration` (plus the turns in
/// flight at the end) and by `cfg.max_requests`.
pub async fn run(cfg: LoadConfig, mocker: Arc<Mocker>, server: &str) -> Report {
    let ticks = procstat::clock_ticks();
    let me = std::process::id();
    let min_len = cfg.prefix_tokens + cfg.turn_growth.max(1);
    let max_len = (2 * cfg.mean_isl).saturating_sub(min_len).max(min_len);
    let prefix_stream = splitmix(cfg.seed ^ 0x05ee_d0f5_ba7e);
    let mut prefix_json = Vec::new();
    push_json_tokens(&mut prefix_json, prefix_stream, 0, cfg.prefix_tokens);
    let cache_json = (cfg.sessions as u128) * (max_len as u128) * 7 <= cfg.json_cache_bytes as u128;
    let t0 = Instant::now();
    let measure_start = t0 + cfg.warmup;
    let end = measure_start + cfg.duration;
    let sh = Arc::new(Shared {
        pool: Pool {
            addr: cfg.addr.clone(),
            idle: Mutex::new(Vec::new()),
        },
        cfg: cfg.clone(),
        mocker: Arc::clone(&mocker),
        prefix_json,
        prefix_stream,
        measure_start,
        end,
        started: AtomicU64::new(0),
        inflight: tokio::sync::Semaphore::new(cfg.max_inflight.max(1)),
        cache_json,
        min_len,
        max_len,
        pacer: cfg
            .rate
            .and_then(|r| Duration::try_from_secs_f64(1.0 / r).ok())
            .map(|every| (Mutex::new(Instant::now()), every.min(MAX_TURN_SPACING))),
    });
    // The window opens at `measure_start`: these readings are taken then
    // (before the sessions start when there is no warm-up, so that the
    // window holds every turn).
    let mut set = JoinSet::new();
    let mut stats = Vec::new();
    let mut opened: Option<Opening> = None;
    if cfg.warmup.is_zero() {
        opened = Some(Opening::take(&cfg, &mocker, ticks, me).await);
    }
    let span = (max_len - min_len) / cfg.turn_growth.max(1);
    for sid in 0..cfg.sessions as u64 {
        // Spread the sessions' starting points over their life so prompt
        // lengths are uniform from the first turn.
        let k = (splitmix(cfg.seed ^ sid) % (span as u64 + 1)) as usize;
        let start_len = min_len + k * cfg.turn_growth;
        set.spawn(run_session(Arc::clone(&sh), sid, start_len));
    }
    let _ = tokio::time::timeout_at(measure_start.into(), async {
        while let Some(r) = set.join_next().await {
            if let Ok(s) = r {
                stats.push(s);
            }
        }
    })
    .await;
    let open = match opened {
        Some(o) => o,
        None => Opening::take(&cfg, &mocker, ticks, me).await,
    };
    let _ = tokio::time::timeout_at(end.into(), async {
        while let Some(r) = set.join_next().await {
            if let Ok(s) = r {
                stats.push(s);
            }
        }
    })
    .await;
    let srv1 = cfg.server_pid.and_then(|p| procstat::cpu_seconds(p, ticks));
    let me1 = procstat::cpu_seconds(me, ticks).unwrap_or(0.0);
    let all1 = procstat::machine_busy_seconds(ticks);
    let pub1 = mocker.published();
    let window = open.at.elapsed().as_secs_f64().max(1e-9);
    let metrics1 = server_metrics(&cfg.addr).await;
    while let Some(r) = set.join_next().await {
        if let Ok(s) = r {
            stats.push(s);
        }
    }
    // The load has stopped: what the server still does now is work the
    // load left behind (a backlog of KV events).
    let mut tail = None;
    if !cfg.tail.is_zero() {
        if let Some(t0) = cfg.server_pid.and_then(|p| procstat::cpu_seconds(p, ticks)) {
            let at = Instant::now();
            tokio::time::sleep(cfg.tail).await;
            if let Some(t1) = cfg.server_pid.and_then(|p| procstat::cpu_seconds(p, ticks)) {
                let secs = at.elapsed().as_secs_f64().max(1e-9);
                tail = Some((secs, (t1 - t0) / secs));
            }
        }
    }
    let metrics2 = server_metrics(&cfg.addr).await;

    let simd_path = metrics2
        .as_deref()
        .or(metrics1.as_deref())
        .and_then(simd_path_of);
    let mut lat: Vec<u32> = Vec::new();
    let mut rep = Report {
        server: server.to_string(),
        flow: format!("{:?}", cfg.flow).to_lowercase(),
        offered_rate: sh.pacer.as_ref().and(cfg.rate),
        think_ms: cfg.think.as_millis() as u64,
        decode_ms: cfg.decode.as_millis() as u64,
        workers: mocker.config().workers,
        sessions: cfg.sessions,
        mean_isl_target: cfg.mean_isl,
        window_s: window,
        simd_path,
        ..Report::default()
    };
    let (mut isl, mut hit, mut blocks) = (0u64, 0u64, 0u64);
    for s in stats {
        lat.extend_from_slice(&s.lat_us);
        rep.requests += s.requests;
        rep.errors += s.errors;
        rep.rejected_429 += s.rejected_429;
        rep.session_turns_with_previous += s.turns_with_previous;
        rep.session_moves += s.moves;
        isl += s.isl_sum;
        hit += s.hit_blocks;
        blocks += s.prompt_blocks;
        if rep.first_error.is_none() {
            rep.first_error = s.first_error;
        }
    }
    lat.sort_unstable();
    let per_request = |v: u64| (rep.requests > 0).then(|| v as f64 / rep.requests as f64);
    rep.requests_per_s = rep.requests as f64 / window;
    rep.mean_isl_observed = isl as f64 / rep.requests.max(1) as f64;
    rep.kv_hit_ratio = hit as f64 / blocks.max(1) as f64;
    rep.session_moves_per_request = (rep.session_turns_with_previous > 0)
        .then(|| rep.session_moves as f64 / rep.session_turns_with_previous as f64);
    let published = pub1.since(&open.published);
    rep.blocks_stored = published.stored_blocks;
    rep.blocks_removed = published.removed_blocks;
    rep.kv_batches_published = published.batches;
    rep.blocks_stored_per_request = per_request(rep.blocks_stored);
    rep.blocks_removed_per_request = per_request(rep.blocks_removed);
    rep.select_p50_ms = percentile(&lat, 0.50);
    rep.select_p99_ms = percentile(&lat, 0.99);
    rep.select_p999_ms = percentile(&lat, 0.999);
    rep.select_max_ms = lat.last().map(|&v| v as f64 / 1000.0).unwrap_or(0.0);
    if let (Some(a), Some(b)) = (open.server_cpu, srv1) {
        let cpu = b - a;
        rep.server_cpu_s = Some(cpu);
        rep.server_cores_used = Some(cpu / window);
        if rep.requests > 0 {
            rep.server_cpu_ms_per_request = Some(cpu * 1000.0 / rep.requests as f64);
        }
    }
    if let Some((secs, cores)) = tail {
        rep.tail_s = Some(secs);
        rep.tail_server_cores_used = Some(cores);
    }
    rep.harness_cpu_s = me1 - open.harness_cpu;
    rep.harness_cores_used = rep.harness_cpu_s / window;
    if let (Some(a), Some(b)) = (open.machine_busy, all1) {
        let others = (b - a) - rep.harness_cpu_s - rep.server_cpu_s.unwrap_or(0.0);
        rep.other_cores_used = Some((others / window).max(0.0));
    }
    if let (Some(m0), Some(m1)) = (&open.metrics, &metrics1) {
        rep.freshness = Freshness::between(&Reading::parse(m0), &Reading::parse(m1));
        rep.freshness.queued_batches_after_tail = metrics2
            .as_deref()
            .and_then(|m| Reading::parse(m).queued_batches);
    }
    rep
}

/// The readings that open the measured window.
struct Opening {
    at: Instant,
    server_cpu: Option<f64>,
    harness_cpu: f64,
    machine_busy: Option<f64>,
    published: Published,
    /// The server's `/metrics` text (`None` if it has none).
    metrics: Option<String>,
}

impl Opening {
    /// Reads `/metrics` first (a request, the slow part), then the
    /// counters, so the window starts with the counters.
    async fn take(cfg: &LoadConfig, mocker: &Mocker, ticks: u64, me: u32) -> Opening {
        let metrics = server_metrics(&cfg.addr).await;
        Opening {
            server_cpu: cfg.server_pid.and_then(|p| procstat::cpu_seconds(p, ticks)),
            harness_cpu: procstat::cpu_seconds(me, ticks).unwrap_or(0.0),
            machine_busy: procstat::machine_busy_seconds(ticks),
            published: mocker.published(),
            metrics,
            at: Instant::now(),
        }
    }
}

/// The text of `GET /metrics` of the selector at `addr`; `None` when it
/// does not answer 200 with UTF-8.
pub async fn server_metrics(addr: &str) -> Option<String> {
    let mut c = HttpConn::connect(addr).await.ok()?;
    let status = c
        .request("GET", "/metrics", None, Duration::from_secs(10))
        .await
        .ok()?;
    if status != 200 {
        return None;
    }
    String::from_utf8(c.body().to_vec()).ok()
}

/// The token-array loop the selector at `addr` runs: the `path` label of
/// its `kvselect_simd_path` gauge on `GET /metrics`. `None` when the server
/// has no such gauge (the reference) or does not answer.
pub async fn server_simd_path(addr: &str) -> Option<String> {
    simd_path_of(&server_metrics(addr).await?)
}

/// The `path` label of the `kvselect_simd_path` sample in a Prometheus text
/// exposition.
pub fn simd_path_of(metrics: &str) -> Option<String> {
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("kvselect_simd_path{"))
        .find_map(|l| {
            let rest = &l[l.find("path=\"")? + 6..];
            Some(rest[..rest.find('"')?].to_string())
        })
}

fn opt(v: Option<f64>, prec: usize) -> String {
    v.map(|v| format!("{v:.prec$}"))
        .unwrap_or_else(|| "n/a".into())
}

fn opt_u64(v: Option<u64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "n/a".into())
}

/// Table rows `(metric, value)` of a report, shared by the single and the
/// side-by-side printers. Every report has the same rows; a figure the
/// server does not publish reads `n/a`.
pub fn rows(r: &Report) -> Vec<(&'static str, String)> {
    let f = &r.freshness;
    let lag = if f.index_lag.is_empty() {
        "n/a".to_string()
    } else {
        f.index_lag
            .iter()
            .map(|(k, v)| format!("{k} {v:.3}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    vec![
        (
            "server SIMD path",
            r.simd_path.clone().unwrap_or_else(|| "n/a".into()),
        ),
        ("requests/s", format!("{:.1}", r.requests_per_s)),
        ("requests (window)", r.requests.to_string()),
        ("errors", r.errors.to_string()),
        ("rejected 429 (retried)", r.rejected_429.to_string()),
        ("server CPU ms/request", opt(r.server_cpu_ms_per_request, 2)),
        ("server cores used", opt(r.server_cores_used, 2)),
        (
            "server cores in the tail after the load",
            opt(r.tail_server_cores_used, 2),
        ),
        ("select p50 ms", format!("{:.2}", r.select_p50_ms)),
        ("select p99 ms", format!("{:.2}", r.select_p99_ms)),
        ("select p999 ms", format!("{:.2}", r.select_p999_ms)),
        ("harness cores used", format!("{:.2}", r.harness_cores_used)),
        ("other processes, cores", opt(r.other_cores_used, 2)),
        ("mean ISL (tokens)", format!("{:.0}", r.mean_isl_observed)),
        ("KV hit ratio", format!("{:.3}", r.kv_hit_ratio)),
        (
            "session moves per request",
            opt(r.session_moves_per_request, 3),
        ),
        (
            "blocks stored per request",
            opt(r.blocks_stored_per_request, 0),
        ),
        ("blocks stored (window)", r.blocks_stored.to_string()),
        (
            "blocks removed per request",
            opt(r.blocks_removed_per_request, 0),
        ),
        ("KV batches applied (server)", opt_u64(f.batches_applied)),
        ("receipt-to-index ms, mean", opt(f.apply_delay_mean_ms, 3)),
        ("receipt-to-index ms, p99", opt(f.apply_delay_p99_ms, 3)),
        ("engine-to-index ms, mean", opt(f.engine_delay_mean_ms, 3)),
        ("engine-to-index ms, p99", opt(f.engine_delay_p99_ms, 3)),
        (
            "queued batches at window end",
            opt(f.queued_batches_at_end, 0),
        ),
        (
            "queued batches after the tail",
            opt(f.queued_batches_after_tail, 0),
        ),
        ("index lag gauges (max)", lag),
    ]
}

/// Markdown table of one or more reports side by side.
pub fn table(reports: &[Report]) -> String {
    let mut s = String::from("| metric |");
    for r in reports {
        s.push_str(&format!(" {} |", r.server));
    }
    s.push_str("\n|---|");
    for _ in reports {
        s.push_str("---:|");
    }
    s.push('\n');
    let all: Vec<Vec<(&str, String)>> = reports.iter().map(rows).collect();
    if let Some(first) = all.first() {
        for (i, (name, _)) in first.iter().enumerate() {
            s.push_str(&format!("| {name} |"));
            for r in &all {
                s.push_str(&format!(" {} |", r[i].1));
            }
            s.push('\n');
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_deterministic_and_in_vocab() {
        assert_eq!(token(5, 10), token(5, 10));
        assert_ne!(
            (0..64).map(|p| token(1, p)).collect::<Vec<_>>(),
            (0..64).map(|p| token(2, p)).collect::<Vec<_>>()
        );
        assert!((0..1000).all(|p| (token(3, p) as u64) < VOCAB));
    }

    #[test]
    fn simd_path_is_read_from_the_gauge() {
        let text = "# HELP kvselect_simd_path Token-array loop\n\
                    # TYPE kvselect_simd_path gauge\n\
                    kvselect_simd_path_other{path=\"x\"} 1\n\
                    kvselect_simd_path{path=\"avx2\"} 1\n";
        assert_eq!(simd_path_of(text).as_deref(), Some("avx2"));
        assert_eq!(simd_path_of("kvselect_build_info{version=\"1\"} 1\n"), None);
    }

    #[test]
    fn percentile_picks_nearest_rank() {
        let v: Vec<u32> = (1..=1000).map(|i| i * 1000).collect();
        assert_eq!(percentile(&v, 0.5), 500.0);
        assert_eq!(percentile(&v, 0.99), 990.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }
}
