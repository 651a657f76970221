//! GET /metrics: Prometheus text exposition 0.0.4, every family with `# HELP`
//! and `# TYPE`.
//!
//! Built on the `prometheus` crate (tikv/rust-prometheus) rather than
//! `prometheus-client`: its `TextEncoder` writes exactly the 0.0.4 text format
//! that `promtool check metrics` and every Prometheus server read, served as
//! `text/plain; version=0.0.4`, whereas `prometheus-client` writes
//! OpenMetrics (`# EOF`, `_total` family names). Default features are off, so
//! no protobuf code is built.
//!
//! Two kinds of metric:
//! - request-path metrics ([`Metrics`]): counters and histograms updated as
//!   requests and connections come and go; labels are `&'static str` route
//!   templates and status codes, so their cardinality is fixed.
//! - state read at scrape time ([`Metrics::render`]): the catalog, the index
//!   per partition, the ledger, the pending-selection cache and the ingest
//!   hub's counters and per-stream state, taken from their own `stats()` and
//!   written into a registry built for that one scrape.

use crate::app::App;
use crate::ingest::ListenerState;
use prometheus::{
    Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};
use std::time::Duration;

/// `Content-Type` of /metrics.
pub const CONTENT_TYPE: &str = prometheus::TEXT_FORMAT;

/// Request latency buckets, seconds: a selection takes tens of microseconds
/// to a few milliseconds; the tail buckets catch stalls.
const LATENCY_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
];

/// Parse-time buckets, seconds (a 100k-token body parses in well under 1 ms).
const PARSE_BUCKETS: &[f64] = &[
    0.000_001, 0.000_005, 0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001,
    0.002_5, 0.005, 0.01, 0.05,
];

/// Why the server closed a connection on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timeout {
    /// A request head (or TLS handshake) did not arrive in time.
    Header,
    /// A request body did not arrive in time (the request got 408).
    Body,
    /// No request for the idle timeout.
    Idle,
}

impl Timeout {
    fn label(self) -> &'static str {
        match self {
            Timeout::Header => "header",
            Timeout::Body => "body",
            Timeout::Idle => "idle",
        }
    }
}

/// The request-path metrics of one server.
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    latency: HistogramVec,
    parse: HistogramVec,
    connections: IntGauge,
    accepted: IntCounter,
    rejected: IntCounter,
    evicted: IntCounter,
    timeouts: IntCounterVec,
}

fn registered<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
    r.register(Box::new(c.clone()))
        .expect("metric names are unique and valid");
    c
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let r = Registry::new();
        let hist = |name: &str, help: &str, buckets: &[f64], labels: &[&str]| {
            HistogramVec::new(
                HistogramOpts::new(name, help).buckets(buckets.to_vec()),
                labels,
            )
            .expect("valid histogram")
        };
        Metrics {
            requests: registered(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvselect_http_requests_total",
                        "HTTP requests answered, by route template and status.",
                    ),
                    &["route", "status"],
                )
                .expect("valid"),
            ),
            latency: registered(
                &r,
                hist(
                    "kvselect_http_request_duration_seconds",
                    "Time from a request's head to its response, by route template and status.",
                    LATENCY_BUCKETS,
                    &["route", "status"],
                ),
            ),
            parse: registered(
                &r,
                hist(
                    "kvselect_parse_duration_seconds",
                    "Time parsing request bodies once received, by body kind (failed parses included); prompt bodies convert their token arrays while they arrive, before this time.",
                    PARSE_BUCKETS,
                    &["body"],
                ),
            ),
            connections: registered(
                &r,
                IntGauge::new("kvselect_http_connections", "Open client connections.")
                    .expect("valid"),
            ),
            accepted: registered(
                &r,
                IntCounter::new(
                    "kvselect_http_connections_accepted_total",
                    "Client connections accepted.",
                )
                .expect("valid"),
            ),
            rejected: registered(
                &r,
                IntCounter::new(
                    "kvselect_http_connections_rejected_total",
                    "Client connections closed on accept because --max-connections were open.",
                )
                .expect("valid"),
            ),
            evicted: registered(
                &r,
                IntCounter::new(
                    "kvselect_http_connections_evicted_total",
                    "Idle client connections closed to make room for a new one at --max-connections.",
                )
                .expect("valid"),
            ),
            timeouts: registered(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvselect_http_timeouts_total",
                        "Connections closed or requests answered 408 by a timeout (header, body, idle).",
                    ),
                    &["kind"],
                )
                .expect("valid"),
            ),
            registry: r,
        }
    }

    pub fn request(&self, route: &'static str, status: u16, elapsed: Duration) {
        let mut buf = itoa::Buffer::new();
        let labels = [route, buf.format(status)];
        self.requests.with_label_values(&labels).inc();
        self.latency
            .with_label_values(&labels)
            .observe(elapsed.as_secs_f64());
    }

    pub fn parse_time(&self, body: &'static str, elapsed: Duration) {
        self.parse
            .with_label_values(&[body])
            .observe(elapsed.as_secs_f64());
    }

    pub fn connection_opened(&self) {
        self.accepted.inc();
        self.connections.inc();
    }

    pub fn connection_closed(&self) {
        self.connections.dec();
    }

    pub fn connection_rejected(&self) {
        self.rejected.inc();
    }

    pub fn connection_evicted(&self) {
        self.evicted.inc();
    }

    pub fn timeout(&self, kind: Timeout) {
        self.timeouts.with_label_values(&[kind.label()]).inc();
    }

    /// The whole exposition: request-path metrics and the state of `app`.
    pub fn render(&self, app: &App) -> String {
        let mut families = self.registry.gather();
        families.extend(state_registry(app).gather());
        families.sort_by(|a, b| a.name().cmp(b.name()));
        let mut out = String::with_capacity(16 * 1024);
        TextEncoder::new()
            .encode_utf8(&families, &mut out)
            .expect("metric families encode");
        if let Some(aff) = &app.affinity {
            out.push_str("# HELP kvselect_session_bindings Live session-affinity bindings.\n");
            out.push_str("# TYPE kvselect_session_bindings gauge\n");
            out.push_str(&format!("kvselect_session_bindings {}\n", aff.len()));
        }
        if let Some(mesh) = app.mesh() {
            let mut text = String::new();
            crate::mesh::render_metrics(mesh, &mut text);
            with_help(&text, &mut out);
        }
        out
    }
}

/// Copies the replica mesh's text, giving each family the HELP line the
/// exposition format asks for (the family's name, in words).
fn with_help(text: &str, out: &mut String) {
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest.split(' ').next().unwrap_or_default();
            let words = name
                .trim_start_matches("kvselect_replica_")
                .replace('_', " ");
            out.push_str(&format!("# HELP {name} Replica mesh: {words}.\n"));
        }
        out.push_str(line);
        out.push('\n');
    }
}

/// A registry holding the state of `app` as of now.
fn state_registry(app: &App) -> Registry {
    let r = Registry::new();
    let gauge = |name: &str, help: &str, v: f64| {
        registered(&r, Gauge::new(name, help).expect("valid")).set(v);
    };
    let gauge_vec = |name: &str, help: &str, labels: &[&str]| {
        registered(
            &r,
            GaugeVec::new(Opts::new(name, help), labels).expect("valid"),
        )
    };
    let int_gauge_vec = |name: &str, help: &str, labels: &[&str]| {
        registered(
            &r,
            IntGaugeVec::new(Opts::new(name, help), labels).expect("valid"),
        )
    };

    registered(
        &r,
        IntGaugeVec::new(
            Opts::new("kvselect_build_info", "Build of this kvselect; always 1."),
            &["version"],
        )
        .expect("valid"),
    )
    .with_label_values(&[env!("CARGO_PKG_VERSION")])
    .set(1);
    registered(
        &r,
        IntGaugeVec::new(
            Opts::new(
                "kvselect_simd_path",
                "Token-array loop this server runs (--simd resolved); always 1.",
            ),
            &["path"],
        )
        .expect("valid"),
    )
    .with_label_values(&[app.config.number_path.effective_name()])
    .set(1);
    gauge(
        "kvselect_shutting_down",
        "1 while the server drains after SIGTERM/SIGINT (/ready answers 503).",
        u8::from(app.is_shutting_down()).into(),
    );

    let snap = app.catalog.snapshot();
    gauge(
        "kvselect_schedulable_workers",
        "Workers whose lifecycle is schedulable.",
        snap.schedulable_workers as f64,
    );
    let workers = int_gauge_vec(
        "kvselect_workers",
        "Registered workers by lifecycle.",
        &["lifecycle"],
    );
    for w in app.catalog.list(None, None) {
        let lifecycle = serde_json::to_value(w.lifecycle)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        workers.with_label_values(&[lifecycle.as_str()]).inc();
    }

    let part = ["model_name", "routing_group"];
    let entries = gauge_vec(
        "kvselect_index_entries",
        "KV index entries (block, worker rank, tier) per partition.",
        &part,
    );
    let nodes = gauge_vec(
        "kvselect_index_nodes",
        "KV index nodes (distinct blocks) per partition.",
        &part,
    );
    let bytes = gauge_vec(
        "kvselect_index_bytes",
        "Approximate memory of the KV index per partition, bytes.",
        &part,
    );
    let memo_hits = registered(
        &r,
        IntCounterVec::new(
            Opts::new(
                "kvselect_index_prefix_memo_hits_total",
                "Overlap walks that began from the kept state of their shared prompt prefix, per partition.",
            ),
            &part,
        )
        .expect("valid"),
    );
    for p in app.catalog.partitions() {
        let st = p.index.stats();
        let l = [p.model_name.as_str(), p.routing_group.as_str()];
        entries.with_label_values(&l).set(st.entries as f64);
        nodes.with_label_values(&l).set(st.nodes as f64);
        bytes.with_label_values(&l).set(st.bytes as f64);
        memo_hits.with_label_values(&l).inc_by(st.prefix_memo_hits);
    }

    let ls = app.ledger.stats();
    gauge(
        "kvselect_bookings",
        "Active bookings in the reservation ledger.",
        ls.bookings as f64,
    );
    gauge(
        "kvselect_active_identities",
        "Distinct block identities booked in the ledger.",
        ls.identities as f64,
    );
    gauge(
        "kvselect_active_chained_identities",
        "Chained (prefix-shared) identities booked in the ledger.",
        ls.chained_identities as f64,
    );
    gauge(
        "kvselect_pending_selections",
        "Unclaimed selections in the pending-selection cache.",
        app.pending.len() as f64,
    );
    gauge(
        "kvselect_pending_selection_bytes",
        "Approximate bytes held by the pending-selection cache.",
        app.pending.bytes() as f64,
    );

    if let Some(q) = &app.queue {
        let st = q.stats();
        gauge(
            "kvselect_queue_waiting",
            "Selections waiting in the queue (DYN_ROUTER_QUEUE_THRESHOLD) for a worker with room.",
            st.waiting as f64,
        );
        registered(
            &r,
            IntCounter::new(
                "kvselect_queue_admitted_after_wait_total",
                "Selections admitted after waiting in the queue.",
            )
            .expect("valid"),
        )
        .inc_by(st.admitted_after_wait);
        let rejected = registered(
            &r,
            IntCounterVec::new(
                Opts::new(
                    "kvselect_queue_rejected_total",
                    "Selections answered 429 by the queue: full, or waited past its bound (timeout).",
                ),
                &["reason"],
            )
            .expect("valid"),
        );
        rejected
            .with_label_values(&["full"])
            .inc_by(st.rejected_full);
        rejected
            .with_label_values(&["timeout"])
            .inc_by(st.rejected_timeout);
    }

    // The freshness gate (app/freshness.rs).
    gauge(
        "kvselect_index_lag_seconds",
        "How far the index is behind the KV events that reached the process: the longest time an ingest thread has had unapplied work.",
        app.catalog.hub().lag().now().as_secs_f64(),
    );
    gauge(
        "kvselect_index_lag_bound_seconds",
        "The freshness bound (--max-index-lag-ms); 0 when the gate is off.",
        app.config
            .freshness
            .max_lag
            .map_or(0.0, |d| d.as_secs_f64()),
    );
    for (name, help, v) in [
        (
            "kvselect_freshness_waited_total",
            "Selections that found the index past the freshness bound and waited for it to catch up.",
            &app.gate.waited,
        ),
        (
            "kvselect_freshness_rejected_total",
            "Selections answered 429 because the index stayed past the freshness bound for --index-lag-max-wait-ms.",
            &app.gate.rejected,
        ),
        (
            "kvselect_freshness_stale_answers_total",
            "Advisory selects answered while the index was past the freshness bound (flagged x-kvselect-index-stale).",
            &app.gate.stale_answers,
        ),
        (
            "kvselect_stale_overlap_discounts_total",
            "Candidates whose overlap counted half because their KV stream was stale (replaying, not connected, or silent while it has bookings).",
            &app.gate.discounted,
        ),
    ] {
        registered(&r, IntCounter::new(name, help).expect("valid"))
            .inc_by(v.load(std::sync::atomic::Ordering::Relaxed));
    }

    let stats = app.catalog.hub().stats();
    let c = stats.counters;
    let a = c.apply;
    for (name, help, v) in [
        (
            "messages",
            "KV-event messages received on live streams.",
            c.messages,
        ),
        (
            "batches_applied",
            "KV-event batches applied (live and replayed).",
            c.batches_applied,
        ),
        (
            "malformed_dropped",
            "KV-event messages or replay replies that failed to decode.",
            c.malformed,
        ),
        (
            "gaps",
            "Sequence gaps seen on live KV-event streams.",
            c.gaps,
        ),
        (
            "gaps_lost",
            "Sequence gaps, or parts of them, that replay could not recover.",
            c.gaps_lost,
        ),
        ("replays_started", "Gap replays started.", c.replays_started),
        (
            "replays_completed",
            "Gap replays completed.",
            c.replays_completed,
        ),
        (
            "replays_failed",
            "Gap replays abandoned (timeout or socket error).",
            c.replays_failed,
        ),
        (
            "replayed_batches",
            "Batches received by replay.",
            c.replayed_batches,
        ),
        (
            "engine_restarts",
            "Engine restarts detected (sequence went backwards).",
            c.restarts,
        ),
        (
            "stale_dropped",
            "Batches at or below the stream's cursor, dropped.",
            c.stale_dropped,
        ),
        (
            "connect_errors",
            "KV-event socket creation or connect failures.",
            c.connect_errors,
        ),
        (
            "listeners_started",
            "KV-event stream listeners started.",
            c.listeners_started,
        ),
        (
            "listeners_stopped",
            "KV-event stream listeners stopped.",
            c.listeners_stopped,
        ),
        (
            "events_applied",
            "KV events applied to the index.",
            a.events_applied,
        ),
        (
            "blocks_stored",
            "Blocks stored into the index.",
            a.blocks_stored,
        ),
        (
            "blocks_removed",
            "Blocks removed from the index.",
            a.blocks_removed,
        ),
        ("clears", "AllBlocksCleared events applied.", a.clears),
        (
            "stores_dropped_block_size",
            "Stores dropped: block size differs from the worker's.",
            a.stores_dropped_block_size,
        ),
        (
            "stores_dropped_shape",
            "Stores dropped: token and hash counts disagree.",
            a.stores_dropped_shape,
        ),
        (
            "stores_dropped_self_reference",
            "Stores dropped: a block names itself as parent.",
            a.stores_dropped_self_reference,
        ),
        (
            "stores_dropped_unknown_parent",
            "Stores dropped: parent block unknown.",
            a.stores_dropped_unknown_parent,
        ),
        (
            "stores_dropped_other",
            "Stores dropped for other reasons.",
            a.stores_dropped_other,
        ),
        (
            "events_ignored_group",
            "Events of a non-main KV cache group, ignored.",
            a.events_ignored_group,
        ),
        (
            "events_dropped_unknown_medium",
            "Events dropped: unknown storage medium.",
            a.events_dropped_unknown_medium,
        ),
        (
            "events_dropped_non_local",
            "Events dropped: not for a local rank.",
            a.events_dropped_non_local,
        ),
        (
            "events_dropped_unknown_type",
            "Events dropped: unknown event type.",
            a.events_dropped_unknown_type,
        ),
    ] {
        registered(
            &r,
            IntCounter::new(format!("kvselect_ingest_{name}_total"), help).expect("valid"),
        )
        .inc_by(v);
    }

    let stream = ["worker_id", "dp_rank"];
    let state = int_gauge_vec(
        "kvselect_kv_stream_state",
        "KV-event stream state per worker rank: 1 for the current state (connecting, live, replaying, failed: the socket could not be opened and is retried), 0 otherwise.",
        &["worker_id", "dp_rank", "state"],
    );
    let last_seq = gauge_vec(
        "kvselect_kv_stream_last_seq",
        "Last applied KV-event sequence number per worker rank (absent before the first batch).",
        &stream,
    );
    let age = gauge_vec(
        "kvselect_kv_stream_last_applied_age_seconds",
        "Seconds since the newest KV-event batch of the worker rank was applied (absent before the first batch).",
        &stream,
    );
    let engine_delay = gauge_vec(
        "kvselect_kv_stream_engine_delay_seconds",
        "Seconds from the newest applied batch's own timestamp to its application, per worker rank (absent without a timestamp; negative when the engine's clock is ahead).",
        &stream,
    );
    let queued = int_gauge_vec(
        "kvselect_kv_stream_queued_batches",
        "KV-event batches received but not yet applied, per worker rank.",
        &stream,
    );
    let stream_counter = |name: &str, help: &str| {
        registered(
            &r,
            IntCounterVec::new(Opts::new(name, help), &stream).expect("valid"),
        )
    };
    let gaps = stream_counter(
        "kvselect_kv_stream_gaps_total",
        "Sequence gaps seen on the worker rank's KV-event stream.",
    );
    let replays = stream_counter(
        "kvselect_kv_stream_replays_total",
        "Gap replays completed on the worker rank's KV-event stream.",
    );
    let malformed = stream_counter(
        "kvselect_kv_stream_malformed_total",
        "Messages of the worker rank's KV-event stream dropped because they failed to decode.",
    );
    let queued_total = registered(
        &r,
        IntGauge::new(
            "kvselect_ingest_queued_batches",
            "KV-event batches received but not yet applied, all streams.",
        )
        .expect("valid"),
    );
    let delays = app.catalog.hub().delays();
    registered(&r, delays.apply.clone());
    registered(&r, delays.engine.clone());
    for l in &stats.listeners {
        let (mut w, mut d) = (itoa::Buffer::new(), itoa::Buffer::new());
        let (w, d) = (w.format(l.worker_id), d.format(l.dp_rank));
        for (s, name) in [
            (ListenerState::Connecting, "connecting"),
            (ListenerState::Live, "live"),
            (ListenerState::Replaying, "replaying"),
            (ListenerState::Failed, "failed"),
        ] {
            state
                .with_label_values(&[w, d, name])
                .set(i64::from(l.state == s));
        }
        if let Some(seq) = l.last_seq {
            last_seq.with_label_values(&[w, d]).set(seq as f64);
        }
        if let Some(a) = l.last_applied_age {
            age.with_label_values(&[w, d]).set(a.as_secs_f64());
        }
        if let Some(e) = l.engine_delay {
            engine_delay.with_label_values(&[w, d]).set(e);
        }
        queued
            .with_label_values(&[w, d])
            .set(l.queued.min(i64::MAX as u64) as i64);
        queued_total.add(l.queued.min(i64::MAX as u64) as i64);
        gaps.with_label_values(&[w, d]).inc_by(l.gaps);
        replays.with_label_values(&[w, d]).inc_by(l.replays);
        malformed.with_label_values(&[w, d]).inc_by(l.malformed);
    }
    r
}
