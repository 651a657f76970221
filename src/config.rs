//! Command line and environment -> a validated, plain [`Config`].
//!
//! Flag names follow the reference service where they overlap
//! (`selection-api.md` §1.1); cost weights come from the environment (§1.2).
//! Every default is a named constant.

use crate::hash::TrackingKey;
use clap::Parser as ClapParser;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

pub const DEFAULT_HOST: &str = "127.0.0.1";
pub const DEFAULT_PORT: u16 = 8092;
/// The reference's body limit: 8 MiB, inclusive.
pub const DEFAULT_BODY_LIMIT_BYTES: usize = 8 * 1024 * 1024;
pub const DEFAULT_SELECTION_CACHE_TTL_SECS: f64 = 120.0;
pub const DEFAULT_SELECTION_CACHE_MAX_ENTRIES: usize = 4096;
pub const DEFAULT_SELECTION_CACHE_MAX_BYTES: usize = 268_435_456;
/// Stale bookings are force-expired after this age.
pub const DEFAULT_BOOKING_EXPIRY_SECS: f64 = 300.0;
pub const DEFAULT_INGEST_THREADS: usize = 4;
/// Most KV-event threads: each holds a few sockets (file descriptors) and its
/// own lag record, and past a few per core they only contend.
pub const MAX_INGEST_THREADS: usize = 64;
/// Credit of a device (GPU) hit, per block.
pub const DEFAULT_OVERLAP_SCORE_CREDIT: f64 = 1.0;
pub const DEFAULT_HOST_CACHE_HIT_WEIGHT: f64 = 0.75;
pub const DEFAULT_DISK_CACHE_HIT_WEIGHT: f64 = 0.25;
pub const DEFAULT_PREFILL_LOAD_SCALE: f64 = 1.0;
/// `--session-affinity-ttl-secs` must lie in this range (Dynamo's).
pub const SESSION_AFFINITY_TTL_RANGE: std::ops::RangeInclusive<f64> = 1.0..=31_536_000.0;
/// Heartbeat period of the replica mesh.
pub const DEFAULT_REPLICA_HEARTBEAT: Duration = crate::mesh::DEFAULT_HEARTBEAT;
/// A silent kvselect replica's bookings are dropped after this.
pub const DEFAULT_REPLICA_LEASE: Duration = crate::mesh::DEFAULT_LEASE;
/// `worker_load.prefill_token_capacity` when a worker has no
/// `max_num_batched_tokens`.
pub const DEFAULT_PREFILL_TOKEN_CAPACITY: u64 = 10_000_000;
/// A request head (HTTP/1 headers, or any bytes before an HTTP/2 stream
/// opens) must arrive within this, counted from its first byte.
pub const DEFAULT_HEADER_READ_TIMEOUT_SECS: f64 = 10.0;
/// A request body must arrive in full within this, counted from the end of
/// its head; otherwise 408 and the connection closes.
pub const DEFAULT_BODY_READ_TIMEOUT_SECS: f64 = 30.0;
/// A connection with no request in flight and no bytes moving is closed after
/// this.
pub const DEFAULT_IDLE_TIMEOUT_SECS: f64 = 60.0;
/// Open connections at most; one more is accepted and closed at once.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// Concurrent HTTP/2 streams per connection (SETTINGS_MAX_CONCURRENT_STREAMS).
pub const DEFAULT_HTTP2_MAX_STREAMS: u32 = 128;
/// On SIGTERM/SIGINT, in-flight requests get this long to finish before the
/// process exits anyway. Below Kubernetes' default 30 s grace period.
pub const DEFAULT_SHUTDOWN_TIMEOUT_SECS: f64 = 25.0;
/// With `DYN_ROUTER_QUEUE_THRESHOLD`: the longest a selection waits for a
/// worker with room before it is answered 429.
pub const DEFAULT_QUEUE_MAX_WAIT_SECS: f64 = 30.0;
/// With `DYN_ROUTER_QUEUE_THRESHOLD`: selections waiting at once, at most;
/// one more is answered 429 at once.
pub const DEFAULT_QUEUE_MAX_LEN: usize = 4096;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines; ANSI colour only when writing to a terminal.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TrackingHash {
    #[value(name = "public-xxh3-v1")]
    Public,
    #[value(name = "keyed-xxh3-v1")]
    Keyed,
}

/// kvselect: a KV-cache-aware worker selector, compatible with Dynamo's
/// standalone selection service API.
#[derive(Debug, ClapParser)]
#[command(name = "kvselect", version)]
pub struct Cli {
    /// Address to bind. The reference binds 0.0.0.0 without authentication;
    /// kvselect binds loopback unless told otherwise.
    #[arg(long, default_value = DEFAULT_HOST)]
    pub host: IpAddr,
    /// HTTP port (0 picks a free one).
    #[arg(long, default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// Tokio worker threads serving HTTP (default: one per core in --cores,
    /// else one per available core).
    #[arg(long)]
    pub http_threads: Option<usize>,
    /// Pin the runtime's worker threads to these cores, e.g. `0-15` or `2,3,8-11`.
    #[arg(long)]
    pub cores: Option<String>,
    /// Threads polling the ZeroMQ KV-event subscriptions.
    /// `--threads` as in the reference (its KV indexer threads, default 4;
    /// 0 is one, as the reference still indexes with it);
    /// `--ingest-threads` is kvselect's earlier name for it.
    #[arg(long = "threads", visible_alias = "ingest-threads", default_value_t = DEFAULT_INGEST_THREADS)]
    pub ingest_threads: usize,
    /// Comma-separated `http://host:port` peers whose GET /dump is loaded into
    /// the index at start-up.
    #[arg(long, value_delimiter = ',')]
    pub indexer_peers: Vec<String>,
    /// Lifetime of an unclaimed pending selection, seconds.
    #[arg(long, default_value_t = DEFAULT_SELECTION_CACHE_TTL_SECS)]
    pub selection_cache_ttl_secs: f64,
    /// Cap on pending selections (oldest evicted first).
    #[arg(long, default_value_t = DEFAULT_SELECTION_CACHE_MAX_ENTRIES)]
    pub selection_cache_max_entries: usize,
    /// Approximate byte budget of pending selections.
    #[arg(long, default_value_t = DEFAULT_SELECTION_CACHE_MAX_BYTES)]
    pub selection_cache_max_bytes: usize,
    /// Largest accepted request body, bytes (inclusive).
    #[arg(long, default_value_t = DEFAULT_BODY_LIMIT_BYTES)]
    pub body_limit_bytes: usize,
    /// Largest token array accepted in one request.
    #[arg(long, default_value_t = crate::parse::DEFAULT_MAX_TOKENS)]
    pub max_tokens: usize,
    /// Deepest JSON nesting accepted.
    #[arg(long, default_value_t = crate::parse::DEFAULT_MAX_DEPTH)]
    pub max_depth: usize,
    /// Bookings older than this are force-expired, seconds
    /// (env DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS).
    #[arg(long, env = "DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS", default_value_t = DEFAULT_BOOKING_EXPIRY_SECS)]
    pub booking_expiry_secs: f64,
    /// Book sequence hashes as block identities (shared prefixes share decode
    /// blocks). `--no-router-assume-kv-reuse` books random identities.
    #[arg(long, overrides_with = "no_router_assume_kv_reuse")]
    pub router_assume_kv_reuse: bool,
    #[arg(long)]
    pub no_router_assume_kv_reuse: bool,
    /// Tracking-hash algorithm for booking identities
    /// (env DYN_ROUTER_TRACKING_HASH).
    #[arg(
        long,
        env = "DYN_ROUTER_TRACKING_HASH",
        value_enum,
        default_value = "public-xxh3-v1"
    )]
    pub router_tracking_hash: TrackingHash,
    /// File holding exactly 32 raw key bytes (keyed-xxh3-v1).
    #[arg(long)]
    pub router_tracking_key_file: Option<std::path::PathBuf>,
    /// Key id mixed into keyed tracking hashes.
    #[arg(long)]
    pub router_tracking_key_id: Option<String>,
    /// Bind the replica mesh's ZeroMQ PUB on this port (on --host) and
    /// share bookings and session bindings with peer replicas.
    #[arg(long)]
    pub replica_sync_port: Option<u16>,
    /// Comma-separated ZeroMQ PUB endpoints of peer replicas
    /// (`tcp://host:port`) to subscribe to; needs --replica-sync-port.
    #[arg(long, value_delimiter = ',', requires = "replica_sync_port")]
    pub replica_sync_peers: Vec<String>,
    /// Pin each session to the (worker, rank) its booking went to, for this
    /// many seconds after its last use (1..=31536000).
    #[arg(long)]
    pub session_affinity_ttl_secs: Option<f64>,
    /// Seconds a client has to send a complete request head.
    #[arg(long, default_value_t = DEFAULT_HEADER_READ_TIMEOUT_SECS)]
    pub header_read_timeout_secs: f64,
    /// Seconds a client has to send a complete request body (408 after).
    #[arg(long, default_value_t = DEFAULT_BODY_READ_TIMEOUT_SECS)]
    pub body_read_timeout_secs: f64,
    /// Seconds an idle keep-alive connection is kept open.
    #[arg(long, default_value_t = DEFAULT_IDLE_TIMEOUT_SECS)]
    pub idle_timeout_secs: f64,
    /// Open connections at most (further ones are closed on accept).
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Concurrent HTTP/2 streams per connection.
    #[arg(long, default_value_t = DEFAULT_HTTP2_MAX_STREAMS)]
    pub http2_max_streams: u32,
    /// Seconds in-flight requests get to finish after SIGTERM/SIGINT.
    #[arg(long, default_value_t = DEFAULT_SHUTDOWN_TIMEOUT_SECS)]
    pub shutdown_timeout_secs: f64,
    /// File of bearer tokens, one per line (`#` comments allowed); every
    /// route but /health then requires `Authorization: Bearer <token>`.
    /// Re-read on SIGHUP.
    #[arg(long)]
    pub auth_token_file: Option<std::path::PathBuf>,
    /// PEM certificate chain; with --tls-key, serve HTTPS (HTTP/1.1 and h2).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
    /// Accept `ipc://path` KV-event and replay endpoints from registering
    /// workers (otherwise only `tcp://host:port`; `inproc://` never).
    #[arg(long)]
    pub allow_ipc_endpoints: bool,
    /// Log line format (filter with RUST_LOG, default `info`).
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Token-array loop: auto (the best the CPU has), avx512, avx2, sse4.1
    /// or scalar; also `KVSELECT_SIMD` (the flag wins). A path the CPU
    /// lacks is a start-up error.
    #[arg(long, value_name = "auto|avx512|avx2|sse4.1|scalar")]
    pub simd: Option<String>,
    /// With DYN_ROUTER_QUEUE_THRESHOLD set: the longest a selection waits
    /// for a worker with room; 429 after.
    #[arg(long, default_value_t = DEFAULT_QUEUE_MAX_WAIT_SECS)]
    pub router_queue_max_wait_secs: f64,
    /// With DYN_ROUTER_QUEUE_THRESHOLD set: selections waiting at once, at
    /// most; more are answered 429 at once.
    #[arg(long, default_value_t = DEFAULT_QUEUE_MAX_LEN)]
    pub router_queue_max_len: usize,
    /// Freshness bound: a selection waits while the index is more than
    /// this far behind the KV events that reached the process (0 turns the
    /// gate off). Advisory selects are answered at once, flagged.
    #[arg(long, default_value_t = DEFAULT_MAX_INDEX_LAG_MS)]
    pub max_index_lag_ms: u64,
    /// The longest a selection waits for the index to come within
    /// --max-index-lag-ms; 429 with Retry-After after.
    #[arg(long, default_value_t = DEFAULT_INDEX_LAG_MAX_WAIT_MS)]
    pub index_lag_max_wait_ms: u64,
}

/// Default freshness bound (`--max-index-lag-ms`).
pub const DEFAULT_MAX_INDEX_LAG_MS: u64 = 50;
/// Default wait for the index to come within the bound.
pub const DEFAULT_INDEX_LAG_MAX_WAIT_MS: u64 = 1000;

/// The freshness gate (`app/freshness.rs`): how far behind its events the
/// index may be when a selection is answered, and how long a selection
/// waits for that.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Freshness {
    /// `None`: the gate is off.
    pub max_lag: Option<Duration>,
    pub max_wait: Duration,
}

impl Default for Freshness {
    fn default() -> Self {
        Freshness {
            max_lag: Some(Duration::from_millis(DEFAULT_MAX_INDEX_LAG_MS)),
            max_wait: Duration::from_millis(DEFAULT_INDEX_LAG_MAX_WAIT_MS),
        }
    }
}

/// The selection queue's bounds (it runs only with
/// `DYN_ROUTER_QUEUE_THRESHOLD`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueLimits {
    pub max_wait: Duration,
    pub max_len: usize,
}

impl Default for QueueLimits {
    fn default() -> Self {
        QueueLimits {
            max_wait: Duration::from_secs_f64(DEFAULT_QUEUE_MAX_WAIT_SECS),
            max_len: DEFAULT_QUEUE_MAX_LEN,
        }
    }
}

/// Connection and request bounds of the HTTP front door.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HttpLimits {
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
    pub http2_max_streams: u32,
    pub shutdown_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            header_read_timeout: Duration::from_secs_f64(DEFAULT_HEADER_READ_TIMEOUT_SECS),
            body_read_timeout: Duration::from_secs_f64(DEFAULT_BODY_READ_TIMEOUT_SECS),
            idle_timeout: Duration::from_secs_f64(DEFAULT_IDLE_TIMEOUT_SECS),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            http2_max_streams: DEFAULT_HTTP2_MAX_STREAMS,
            shutdown_timeout: Duration::from_secs_f64(DEFAULT_SHUTDOWN_TIMEOUT_SECS),
        }
    }
}

/// Certificate chain and key files for HTTPS.
#[derive(Debug, Clone, PartialEq)]
pub struct TlsFiles {
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
}

/// The cost model's weights (§1.2, §7.3). Defaults from the environment; a
/// request's `router_config_override` refines them per request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterConfig {
    pub overlap_score_credit: f64,
    pub overlap_score_credit_decay: f64,
    pub prefill_load_scale: f64,
    pub decode_active_request_weight: f64,
    pub host_cache_hit_weight: f64,
    pub disk_cache_hit_weight: f64,
    pub router_temperature: f64,
    pub track_prefill_tokens: bool,
    pub track_output_blocks: bool,
    pub assume_kv_reuse: bool,
    /// `DYN_ROUTER_QUEUE_THRESHOLD`: when set, a selection waits while every
    /// candidate's active prefill tokens exceed this share of its
    /// `max_num_batched_tokens` (see `app/admission.rs`).
    pub queue_threshold: Option<f64>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            overlap_score_credit: DEFAULT_OVERLAP_SCORE_CREDIT,
            overlap_score_credit_decay: 0.0,
            prefill_load_scale: DEFAULT_PREFILL_LOAD_SCALE,
            decode_active_request_weight: 0.0,
            host_cache_hit_weight: DEFAULT_HOST_CACHE_HIT_WEIGHT,
            disk_cache_hit_weight: DEFAULT_DISK_CACHE_HIT_WEIGHT,
            router_temperature: 0.0,
            track_prefill_tokens: true,
            track_output_blocks: false,
            assume_kv_reuse: true,
            queue_threshold: None,
        }
    }
}

impl RouterConfig {
    /// Reads the `DYN_*` variables through `get` (so tests need not touch the
    /// process environment).
    pub fn from_env_with(get: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let mut c = RouterConfig::default();
        let num = |name: &str| -> Result<Option<f64>, String> {
            match get(name) {
                None => Ok(None),
                Some(v) => v
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x >= 0.0)
                    .map(Some)
                    .ok_or_else(|| {
                        format!("{name} must be a finite, non-negative number, got `{v}`")
                    }),
            }
        };
        let flag = |name: &str| -> Result<Option<bool>, String> {
            match get(name) {
                None => Ok(None),
                Some(v) => match v.trim().to_ascii_lowercase().as_str() {
                    "1" | "true" | "yes" | "on" => Ok(Some(true)),
                    "0" | "false" | "no" | "off" => Ok(Some(false)),
                    _ => Err(format!("{name} must be a boolean, got `{v}`")),
                },
            }
        };
        // The deprecated weight applies first so the explicit variables win.
        for name in [
            "DYN_OVERLAP_SCORE_WEIGHT",
            "DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT",
        ] {
            if let Some(w) = num(name)? {
                c.prefill_load_scale = w;
                if w == 0.0 {
                    c.overlap_score_credit = 0.0;
                }
            }
        }
        if let Some(v) = num("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT")? {
            c.overlap_score_credit = v;
        }
        if let Some(v) = num("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY")? {
            c.overlap_score_credit_decay = v;
        }
        if let Some(v) = num("DYN_ROUTER_PREFILL_LOAD_SCALE")? {
            c.prefill_load_scale = v;
        }
        if let Some(v) = num("DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT")? {
            c.decode_active_request_weight = v;
        }
        if let Some(v) = num("DYN_ROUTER_TEMPERATURE")? {
            c.router_temperature = v;
        }
        if let Some(v) = flag("DYN_ROUTER_TRACK_PREFILL_TOKENS")? {
            c.track_prefill_tokens = v;
        }
        if let Some(v) = flag("DYN_ROUTER_TRACK_OUTPUT_BLOCKS")? {
            c.track_output_blocks = v;
        }
        if let Some(v) = flag("DYN_ROUTER_ASSUME_KV_REUSE")? {
            c.assume_kv_reuse = v;
        }
        // The reference's routing without KV events (a cache predicted
        // from its own routing decisions) is not built here: refuse it
        // rather than route as if no worker cached anything.
        if flag("DYN_USE_KV_EVENTS")? == Some(false) {
            return Err(
                "DYN_USE_KV_EVENTS=false (routing on a cache predicted without KV \
                        events) is not supported: kvselect routes on the engines' KV events"
                    .to_string(),
            );
        }
        c.queue_threshold = num("DYN_ROUTER_QUEUE_THRESHOLD")?;
        Ok(c)
    }
}

/// Everything the server needs, validated.
#[derive(Debug, Clone)]
pub struct Config {
    pub addr: SocketAddr,
    pub threads: usize,
    pub cores: Option<Vec<usize>>,
    pub ingest_threads: usize,
    pub indexer_peers: Vec<String>,
    pub selection_cache_ttl: Duration,
    pub selection_cache_max_entries: usize,
    pub selection_cache_max_bytes: usize,
    pub body_limit_bytes: usize,
    pub max_tokens: usize,
    pub max_depth: usize,
    pub booking_expiry: Duration,
    pub router: RouterConfig,
    /// `Some` in keyed-xxh3-v1 mode.
    pub tracking_key: Option<TrackingKey>,
    /// The replica mesh's PUB port (0 picks one); `None`: no mesh.
    pub replica_sync_port: Option<u16>,
    pub replica_sync_peers: Vec<String>,
    pub session_affinity_ttl: Option<Duration>,
    pub replica_heartbeat: Duration,
    pub replica_lease: Duration,
    /// Fault injection for tests: the share of received replica messages
    /// dropped on purpose. No flag sets it; it stays 0 in the server.
    pub replica_fault_drop_rate: f64,
    pub limits: HttpLimits,
    /// Bearer tokens required on every route but /health when set.
    pub auth_token_file: Option<std::path::PathBuf>,
    pub tls: Option<TlsFiles>,
    pub log_format: LogFormat,
    /// The token-array loop (`--simd`), resolved against this CPU.
    pub number_path: crate::parse::NumberPath,
    /// Workers may register `ipc://` KV-event and replay endpoints.
    pub allow_ipc_endpoints: bool,
    pub queue: QueueLimits,
    pub freshness: Freshness,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            addr: SocketAddr::new(DEFAULT_HOST.parse().unwrap(), DEFAULT_PORT),
            threads: 2,
            cores: None,
            ingest_threads: DEFAULT_INGEST_THREADS,
            indexer_peers: Vec::new(),
            selection_cache_ttl: Duration::from_secs_f64(DEFAULT_SELECTION_CACHE_TTL_SECS),
            selection_cache_max_entries: DEFAULT_SELECTION_CACHE_MAX_ENTRIES,
            selection_cache_max_bytes: DEFAULT_SELECTION_CACHE_MAX_BYTES,
            body_limit_bytes: DEFAULT_BODY_LIMIT_BYTES,
            max_tokens: crate::parse::DEFAULT_MAX_TOKENS,
            max_depth: crate::parse::DEFAULT_MAX_DEPTH,
            booking_expiry: Duration::from_secs_f64(DEFAULT_BOOKING_EXPIRY_SECS),
            router: RouterConfig::default(),
            tracking_key: None,
            replica_sync_port: None,
            replica_sync_peers: Vec::new(),
            session_affinity_ttl: None,
            replica_heartbeat: DEFAULT_REPLICA_HEARTBEAT,
            replica_lease: DEFAULT_REPLICA_LEASE,
            replica_fault_drop_rate: 0.0,
            limits: HttpLimits::default(),
            auth_token_file: None,
            tls: None,
            log_format: LogFormat::Text,
            number_path: crate::parse::NumberPath::Auto,
            allow_ipc_endpoints: false,
            queue: QueueLimits::default(),
            freshness: Freshness::default(),
        }
    }
}

/// Parses `0-3,8,10-11` into core ids.
pub fn parse_cores(s: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || format!("invalid core list `{s}`: expected e.g. `0-15` or `2,3,8-11`");
        match part.split_once('-') {
            Some((a, b)) => {
                let a: usize = a.trim().parse().map_err(|_| bad())?;
                let b: usize = b.trim().parse().map_err(|_| bad())?;
                if a > b || b - a > 4096 {
                    return Err(bad());
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().map_err(|_| bad())?),
        }
    }
    if out.is_empty() {
        return Err(format!("invalid core list `{s}`: no cores"));
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

fn secs(name: &str, v: f64) -> Result<Duration, String> {
    if v.is_finite() && v >= 0.0 {
        Ok(Duration::from_secs_f64(v))
    } else {
        Err(format!(
            "--{name} must be a finite, non-negative number of seconds"
        ))
    }
}

impl Config {
    /// Validates the command line against the process environment.
    pub fn from_cli(cli: Cli) -> Result<Config, String> {
        Config::from_cli_with_env(cli, |k| std::env::var(k).ok())
    }

    pub fn from_cli_with_env(
        cli: Cli,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, String> {
        let mut router = RouterConfig::from_env_with(&env)?;
        if cli.no_router_assume_kv_reuse {
            router.assume_kv_reuse = false;
        } else if cli.router_assume_kv_reuse {
            router.assume_kv_reuse = true;
        }
        let cores = cli.cores.as_deref().map(parse_cores).transpose()?;
        let available = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = cli
            .http_threads
            .unwrap_or_else(|| cores.as_ref().map_or(available, Vec::len));
        if threads == 0 {
            return Err("--http-threads must be at least 1".into());
        }
        if cli.body_limit_bytes == 0 {
            return Err("--body-limit-bytes must be at least 1".into());
        }
        let tracking_key = match cli.router_tracking_hash {
            TrackingHash::Public => {
                if cli.router_tracking_key_file.is_some() || cli.router_tracking_key_id.is_some() {
                    return Err(
                        "router tracking key options require router_tracking_hash=keyed-xxh3-v1"
                            .into(),
                    );
                }
                None
            }
            TrackingHash::Keyed => {
                let path = cli
                    .router_tracking_key_file
                    .ok_or("keyed-xxh3-v1 requires router_tracking_key_file")?;
                let bytes = std::fs::read(&path).map_err(|e| {
                    format!(
                        "cannot read router_tracking_key_file {}: {e}",
                        path.display()
                    )
                })?;
                let key: [u8; 32] = bytes.as_slice().try_into().map_err(|_| {
                    format!(
                        "router_tracking_key_file must hold exactly 32 bytes, {} has {}",
                        path.display(),
                        bytes.len()
                    )
                })?;
                let key_id = cli
                    .router_tracking_key_id
                    .ok_or("keyed-xxh3-v1 requires router_tracking_key_id")?;
                if key_id.is_empty() || key_id.trim() != key_id {
                    return Err(
                        "router_tracking_key_id must be non-empty without surrounding whitespace"
                            .into(),
                    );
                }
                Some(TrackingKey { key, key_id })
            }
        };
        for peer in &cli.indexer_peers {
            if !peer.starts_with("http://") {
                return Err(format!(
                    "--indexer-peers entry `{peer}` must start with http://"
                ));
            }
        }
        for peer in &cli.replica_sync_peers {
            crate::ingest::validate_endpoint(peer)
                .map_err(|e| format!("--replica-sync-peers: {e}"))?;
        }
        let session_affinity_ttl = match cli.session_affinity_ttl_secs {
            None => None,
            Some(t) if SESSION_AFFINITY_TTL_RANGE.contains(&t) => Some(Duration::from_secs_f64(t)),
            Some(_) => {
                return Err("session_affinity_ttl_secs must be between 1 and 31536000".into())
            }
        };
        let positive = |name: &str, v: f64| -> Result<Duration, String> {
            match secs(name, v)? {
                d if d.is_zero() => Err(format!("--{name} must be greater than 0")),
                d => Ok(d),
            }
        };
        let limits = HttpLimits {
            header_read_timeout: positive(
                "header-read-timeout-secs",
                cli.header_read_timeout_secs,
            )?,
            body_read_timeout: positive("body-read-timeout-secs", cli.body_read_timeout_secs)?,
            idle_timeout: positive("idle-timeout-secs", cli.idle_timeout_secs)?,
            max_connections: cli.max_connections,
            http2_max_streams: cli.http2_max_streams,
            shutdown_timeout: secs("shutdown-timeout-secs", cli.shutdown_timeout_secs)?,
        };
        if limits.max_connections == 0 || limits.max_connections > u32::MAX as usize {
            return Err("--max-connections must be between 1 and 4294967295".into());
        }
        if limits.http2_max_streams == 0 {
            return Err("--http2-max-streams must be at least 1".into());
        }
        let tls = match (cli.tls_cert, cli.tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles { cert, key }),
            (None, None) => None,
            _ => return Err("--tls-cert and --tls-key go together".into()),
        };
        let simd = cli
            .simd
            .clone()
            .or_else(|| env("KVSELECT_SIMD"))
            .unwrap_or_else(|| "auto".into());
        let number_path = crate::parse::NumberPath::choose_here(&simd)?;
        if cli.router_queue_max_len == 0 {
            return Err("--router-queue-max-len must be at least 1".into());
        }
        let queue = QueueLimits {
            max_wait: positive("router-queue-max-wait-secs", cli.router_queue_max_wait_secs)?,
            max_len: cli.router_queue_max_len,
        };
        if cli.index_lag_max_wait_ms == 0 {
            return Err("--index-lag-max-wait-ms must be at least 1".into());
        }
        let freshness = Freshness {
            max_lag: (cli.max_index_lag_ms > 0)
                .then(|| Duration::from_millis(cli.max_index_lag_ms)),
            max_wait: Duration::from_millis(cli.index_lag_max_wait_ms),
        };
        if cli.ingest_threads > MAX_INGEST_THREADS {
            return Err(format!("--threads must be at most {MAX_INGEST_THREADS}"));
        }
        Ok(Config {
            addr: SocketAddr::new(cli.host, cli.port),
            threads,
            cores,
            // The reference starts and indexes with `--threads 0`: one thread.
            ingest_threads: cli.ingest_threads.max(1),
            indexer_peers: cli.indexer_peers,
            selection_cache_ttl: secs("selection-cache-ttl-secs", cli.selection_cache_ttl_secs)?,
            selection_cache_max_entries: cli.selection_cache_max_entries,
            selection_cache_max_bytes: cli.selection_cache_max_bytes,
            body_limit_bytes: cli.body_limit_bytes,
            max_tokens: cli.max_tokens,
            max_depth: cli.max_depth,
            booking_expiry: secs("booking-expiry-secs", cli.booking_expiry_secs)?,
            router,
            tracking_key,
            limits,
            auth_token_file: cli.auth_token_file,
            tls,
            log_format: cli.log_format,
            allow_ipc_endpoints: cli.allow_ipc_endpoints,
            replica_sync_port: cli.replica_sync_port,
            replica_sync_peers: cli.replica_sync_peers,
            session_affinity_ttl,
            number_path,
            queue,
            freshness,
            ..Config::default()
        })
    }

    /// The effective configuration as `(name, value)` pairs for the start-up
    /// log: every flag's value and the `DYN_*` variables that are set. No
    /// secret is included (the tracking key shows only its id; token files
    /// only their path).
    pub fn describe(&self, env: impl Fn(&str) -> Option<String>) -> Vec<(&'static str, String)> {
        let l = &self.limits;
        let r = &self.router;
        let opt = |p: &Option<std::path::PathBuf>| {
            p.as_ref()
                .map_or_else(|| "-".to_string(), |p| p.display().to_string())
        };
        let mut out = vec![
            ("addr", self.addr.to_string()),
            ("http_threads", self.threads.to_string()),
            ("cores", format!("{:?}", self.cores)),
            ("ingest_threads", self.ingest_threads.to_string()),
            ("indexer_peers", self.indexer_peers.join(",")),
            (
                "selection_cache_ttl",
                format!("{:?}", self.selection_cache_ttl),
            ),
            (
                "selection_cache_max_entries",
                self.selection_cache_max_entries.to_string(),
            ),
            (
                "selection_cache_max_bytes",
                self.selection_cache_max_bytes.to_string(),
            ),
            ("body_limit_bytes", self.body_limit_bytes.to_string()),
            ("max_tokens", self.max_tokens.to_string()),
            ("max_depth", self.max_depth.to_string()),
            ("booking_expiry", format!("{:?}", self.booking_expiry)),
            (
                "router_tracking_hash",
                match &self.tracking_key {
                    None => "public-xxh3-v1".to_string(),
                    Some(k) => format!("keyed-xxh3-v1 (key id {})", k.key_id),
                },
            ),
            ("router", format!("{r:?}")),
            (
                "header_read_timeout",
                format!("{:?}", l.header_read_timeout),
            ),
            ("body_read_timeout", format!("{:?}", l.body_read_timeout)),
            ("idle_timeout", format!("{:?}", l.idle_timeout)),
            ("max_connections", l.max_connections.to_string()),
            ("http2_max_streams", l.http2_max_streams.to_string()),
            ("shutdown_timeout", format!("{:?}", l.shutdown_timeout)),
            ("auth_token_file", opt(&self.auth_token_file)),
            ("tls_cert", opt(&self.tls.as_ref().map(|t| t.cert.clone()))),
            ("allow_ipc_endpoints", self.allow_ipc_endpoints.to_string()),
            (
                "log_format",
                format!("{:?}", self.log_format).to_ascii_lowercase(),
            ),
            ("simd", self.number_path.effective_name().to_string()),
            (
                "router_queue_max_wait",
                format!("{:?}", self.queue.max_wait),
            ),
            ("router_queue_max_len", self.queue.max_len.to_string()),
            (
                "max_index_lag",
                self.freshness
                    .max_lag
                    .map_or("off".into(), |d| format!("{d:?}")),
            ),
            (
                "index_lag_max_wait",
                format!("{:?}", self.freshness.max_wait),
            ),
        ];
        for name in DYN_ENV_VARS {
            if let Some(v) = env(name) {
                out.push((name, v));
            }
        }
        out
    }
}

/// The environment variables kvselect reads (§1.2).
pub const DYN_ENV_VARS: &[&str] = &[
    "DYN_OVERLAP_SCORE_WEIGHT",
    "DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT",
    "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT",
    "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY",
    "DYN_ROUTER_PREFILL_LOAD_SCALE",
    "DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT",
    "DYN_ROUTER_TEMPERATURE",
    "DYN_ROUTER_TRACK_PREFILL_TOKENS",
    "DYN_ROUTER_TRACK_OUTPUT_BLOCKS",
    "DYN_ROUTER_ASSUME_KV_REUSE",
    "DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS",
    "DYN_ROUTER_QUEUE_THRESHOLD",
    "DYN_USE_KV_EVENTS",
];

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("kvselect").chain(args.iter().copied())).unwrap()
    }

    #[test]
    fn defaults_bind_loopback_8092() {
        let c = Config::from_cli_with_env(cli(&[]), |_| None).unwrap();
        assert_eq!(c.addr.to_string(), "127.0.0.1:8092");
        assert_eq!(c.body_limit_bytes, 8 * 1024 * 1024);
        assert_eq!(c.router, RouterConfig::default());
        assert!(c.tracking_key.is_none());
    }

    #[test]
    fn env_weights_apply_and_deprecated_weight_zeroes_credit() {
        let env = |k: &str| match k {
            "DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT" => Some("0".to_string()),
            "DYN_ROUTER_TEMPERATURE" => Some("0.5".to_string()),
            _ => None,
        };
        let r = RouterConfig::from_env_with(env).unwrap();
        assert_eq!(r.prefill_load_scale, 0.0);
        assert_eq!(r.overlap_score_credit, 0.0);
        assert_eq!(r.router_temperature, 0.5);
        let bad = RouterConfig::from_env_with(|k| {
            (k == "DYN_ROUTER_PREFILL_LOAD_SCALE").then(|| "-1".into())
        });
        assert!(bad.is_err());
    }

    #[test]
    fn routing_without_kv_events_is_refused() {
        let with = |v: &'static str| {
            RouterConfig::from_env_with(move |k| (k == "DYN_USE_KV_EVENTS").then(|| v.into()))
        };
        let e = with("false").unwrap_err();
        assert!(e.starts_with("DYN_USE_KV_EVENTS=false"), "{e}");
        assert!(with("0").is_err());
        assert_eq!(with("true").unwrap(), RouterConfig::default());
        assert!(with("maybe").unwrap_err().contains("must be a boolean"));
    }

    #[test]
    fn core_lists() {
        assert_eq!(
            parse_cores("0-3,8,10-11").unwrap(),
            vec![0, 1, 2, 3, 8, 10, 11]
        );
        assert!(parse_cores("3-1").is_err());
        assert!(parse_cores("x").is_err());
        let c = Config::from_cli_with_env(cli(&["--cores", "0-1"]), |_| None).unwrap();
        assert_eq!(c.threads, 2);
    }

    #[test]
    fn threads_means_what_it_means_in_the_reference() {
        let c = Config::from_cli_with_env(cli(&[]), |_| None).unwrap();
        assert_eq!(c.ingest_threads, 4);
        let c =
            Config::from_cli_with_env(cli(&["--threads", "3", "--http-threads", "5"]), |_| None)
                .unwrap();
        assert_eq!((c.ingest_threads, c.threads), (3, 5));
        let c = Config::from_cli_with_env(cli(&["--ingest-threads", "6"]), |_| None).unwrap();
        assert_eq!(c.ingest_threads, 6);
        let c = Config::from_cli_with_env(cli(&["--threads", "0"]), |_| None).unwrap();
        assert_eq!(c.ingest_threads, 1);
        let e = Config::from_cli_with_env(cli(&["--http-threads", "0"]), |_| None).unwrap_err();
        assert_eq!(e, "--http-threads must be at least 1");
        let c = Config::from_cli_with_env(cli(&["--threads", "64"]), |_| None).unwrap();
        assert_eq!(c.ingest_threads, 64);
        let e = Config::from_cli_with_env(cli(&["--threads", "65"]), |_| None).unwrap_err();
        assert_eq!(e, "--threads must be at most 64");
    }

    #[test]
    fn keyed_mode_needs_its_key() {
        let e =
            Config::from_cli_with_env(cli(&["--router-tracking-hash", "keyed-xxh3-v1"]), |_| None)
                .unwrap_err();
        assert_eq!(e, "keyed-xxh3-v1 requires router_tracking_key_file");
        let e = Config::from_cli_with_env(cli(&["--router-tracking-key-id", "k"]), |_| None)
            .unwrap_err();
        assert_eq!(
            e,
            "router tracking key options require router_tracking_hash=keyed-xxh3-v1"
        );
    }

    #[test]
    fn replica_sync_flags_with_dynamo_meaning() {
        let c = Config::from_cli_with_env(cli(&[]), |_| None).unwrap();
        assert_eq!(c.replica_sync_port, None);
        assert!(c.replica_sync_peers.is_empty());
        assert_eq!(c.session_affinity_ttl, None);
        assert_eq!(c.replica_fault_drop_rate, 0.0);
        let c = Config::from_cli_with_env(
            cli(&[
                "--replica-sync-port",
                "19097",
                "--replica-sync-peers",
                "tcp://127.0.0.1:19098,tcp://10.0.0.2:19097",
            ]),
            |_| None,
        )
        .unwrap();
        assert_eq!(c.replica_sync_port, Some(19097));
        assert_eq!(
            c.replica_sync_peers,
            vec!["tcp://127.0.0.1:19098", "tcp://10.0.0.2:19097"]
        );
        // Peers without a port are refused; peers need the port flag (clap).
        let e = Config::from_cli_with_env(
            cli(&[
                "--replica-sync-port",
                "1",
                "--replica-sync-peers",
                "tcp://h",
            ]),
            |_| None,
        )
        .unwrap_err();
        assert!(
            e.contains("invalid ZMQ endpoint `tcp://h`: missing port"),
            "{e}"
        );
        let e = Cli::try_parse_from(["kvselect", "--replica-sync-peers", "tcp://h:1"]).unwrap_err();
        assert!(e
            .to_string()
            .contains("the following required arguments were not provided"));
        assert!(Cli::try_parse_from(["kvselect", "--replica-sync-port", "70000"]).is_err());
    }

    #[test]
    fn session_affinity_ttl_range() {
        for ok in ["1", "30", "0.5e1", "31536000"] {
            let c = Config::from_cli_with_env(cli(&["--session-affinity-ttl-secs", ok]), |_| None)
                .unwrap();
            let want: f64 = ok.parse().unwrap();
            assert_eq!(c.session_affinity_ttl, Some(Duration::from_secs_f64(want)));
        }
        for bad in ["0", "0.5", "31536001", "NaN", "inf"] {
            let e = Config::from_cli_with_env(cli(&["--session-affinity-ttl-secs", bad]), |_| None)
                .unwrap_err();
            assert_eq!(
                e,
                "session_affinity_ttl_secs must be between 1 and 31536000"
            );
        }
    }

    #[test]
    fn tracking_hash_from_the_environment() {
        // clap reads DYN_ROUTER_TRACKING_HASH itself; the parsed value is
        // what Config validates.
        let e = Config::from_cli_with_env(
            Cli::try_parse_from(["kvselect"])
                .map(|mut c| {
                    c.router_tracking_hash = TrackingHash::Keyed;
                    c
                })
                .unwrap(),
            |_| None,
        )
        .unwrap_err();
        assert_eq!(e, "keyed-xxh3-v1 requires router_tracking_key_file");
        let cmd = <Cli as clap::CommandFactory>::command();
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_id() == "router_tracking_hash")
            .unwrap();
        assert_eq!(
            arg.get_env().and_then(|e| e.to_str()),
            Some("DYN_ROUTER_TRACKING_HASH")
        );
    }

    #[test]
    fn assume_kv_reuse_flag_pair() {
        let c = Config::from_cli_with_env(cli(&["--no-router-assume-kv-reuse"]), |_| None).unwrap();
        assert!(!c.router.assume_kv_reuse);
    }

    #[test]
    fn simd_choice_against_any_cpu() {
        use crate::parse::NumberPath as P;
        // (sse4.1, avx2, avx512) of a CPU and what each value gives.
        assert_eq!(P::choose("auto", true, true, true), Ok(P::Avx512));
        assert_eq!(P::choose("auto", true, true, false), Ok(P::Avx2));
        assert_eq!(P::choose("auto", true, false, false), Ok(P::Sse41));
        assert_eq!(P::choose("auto", false, false, false), Ok(P::Scalar));
        assert_eq!(P::choose("scalar", true, true, true), Ok(P::Scalar));
        assert_eq!(P::choose("AVX2", true, true, false), Ok(P::Avx2));
        assert_eq!(P::choose("avx512", true, true, true), Ok(P::Avx512));
        assert_eq!(P::choose("SSE4.1", true, true, true), Ok(P::Sse41));
        let e = P::choose("avx512", true, true, false).unwrap_err();
        assert!(
            e.contains("lacks the avx512") && e.contains("available: scalar, sse4.1, avx2"),
            "{e}"
        );
        let e = P::choose("avx2", true, false, false).unwrap_err();
        assert!(
            e.contains("lacks the avx2") && e.contains("available: scalar, sse4.1)"),
            "{e}"
        );
        let e = P::choose("sse4.1", false, false, false).unwrap_err();
        assert!(
            e.contains("lacks the sse4.1") && e.contains("available: scalar)"),
            "{e}"
        );
        let e = P::choose("sse", true, true, true).unwrap_err();
        assert!(
            e.contains("`sse` is not one of auto, avx512, avx2, sse4.1, scalar"),
            "{e}"
        );
    }

    #[test]
    fn simd_flag_wins_over_the_environment() {
        use crate::parse::NumberPath as P;
        let env = |k: &str| (k == "KVSELECT_SIMD").then(|| "bogus".to_string());
        let e = Config::from_cli_with_env(cli(&[]), env).unwrap_err();
        assert!(e.contains("`bogus`"), "{e}");
        let c = Config::from_cli_with_env(cli(&["--simd", "scalar"]), env).unwrap();
        assert_eq!(c.number_path, P::Scalar);
        let scalar = |k: &str| (k == "KVSELECT_SIMD").then(|| "scalar".to_string());
        let c = Config::from_cli_with_env(cli(&[]), scalar).unwrap();
        assert_eq!(c.number_path, P::Scalar);
        let c = Config::from_cli_with_env(cli(&[]), |_| None).unwrap();
        assert_eq!(c.number_path, P::choose_here("auto").unwrap());
        assert!(c
            .describe(|_| None)
            .iter()
            .any(|(n, v)| *n == "simd" && v == c.number_path.effective_name()));
    }
}
