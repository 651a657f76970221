//! Ingestion figures: the public snapshot types ([`IngestStats`] and its
//! parts), the hub-wide atomic counters behind them, and what each listener
//! publishes for `stats()` without a round trip to its thread.
//!
//! Owns: counting and snapshots. Does not: decide anything (the counters
//! record what `listener.rs` did).
//!
//! Freshness (issue #17 item 1): each listener publishes, in its [`Shared`],
//! when its newest batch was applied, that batch's engine-to-index delay
//! (wall clock now minus the batch's own `ts`), how many batches it holds
//! received but unapplied (its inbox, plus the live batch parked during a
//! replay), and its own gap, replay and malformed counts: plain relaxed
//! atomics written by the one thread that owns the listener, read by
//! `stats()`. The receipt-to-application and engine-to-index delays of every
//! batch also go into two hub-wide histograms ([`Delays`]); each ingest
//! thread observes into a thread-local copy and flushes it once per poll
//! round, so the threads never share a cache line per batch.

use super::apply::ApplyCounts;
use prometheus::{Histogram, HistogramOpts};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};
use std::time::{Duration, Instant};

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

/// Where a listener is (`/workers` `kv_streams[].state`, lower case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ListenerState {
    /// Its socket is about to be created.
    Connecting,
    /// Its socket could not be opened (fd or ZMQ socket limit, bad
    /// address); retried with exponential backoff.
    Failed,
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
    /// Why the socket could not be opened (state `Failed`).
    pub error: Option<String>,
    /// Time since the newest batch was applied (`None` before the first).
    pub last_applied_age: Option<Duration>,
    /// Wall-clock delay from the newest applied batch's `ts` to its
    /// application, seconds (negative when the engine's clock is ahead;
    /// `None` before the first batch or when the batch had no usable `ts`).
    pub engine_delay: Option<f64>,
    /// Batches received but not yet applied.
    pub queued: u64,
    /// Sequence gaps seen on this stream.
    pub gaps: u64,
    /// Replays of this stream completed.
    pub replays: u64,
    /// Messages or replay replies of this stream that failed to decode.
    pub malformed: u64,
}

#[derive(Debug, Clone, Default)]
pub struct IngestStats {
    pub counters: IngestCounters,
    /// Sorted by (worker_id, dp_rank).
    pub listeners: Vec<ListenerStats>,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) messages: AtomicU64,
    pub(super) batches_applied: AtomicU64,
    pub(super) events_applied: AtomicU64,
    pub(super) blocks_stored: AtomicU64,
    pub(super) blocks_removed: AtomicU64,
    pub(super) clears: AtomicU64,
    pub(super) stores_dropped_block_size: AtomicU64,
    pub(super) stores_dropped_shape: AtomicU64,
    pub(super) stores_dropped_self_reference: AtomicU64,
    pub(super) stores_dropped_unknown_parent: AtomicU64,
    pub(super) stores_dropped_other: AtomicU64,
    pub(super) events_ignored_group: AtomicU64,
    pub(super) events_dropped_unknown_medium: AtomicU64,
    pub(super) events_dropped_non_local: AtomicU64,
    pub(super) events_dropped_unknown_type: AtomicU64,
    pub(super) malformed: AtomicU64,
    pub(super) gaps: AtomicU64,
    pub(super) gaps_lost: AtomicU64,
    pub(super) replays_started: AtomicU64,
    pub(super) replays_completed: AtomicU64,
    pub(super) replays_failed: AtomicU64,
    pub(super) replayed_batches: AtomicU64,
    pub(super) restarts: AtomicU64,
    pub(super) stale_dropped: AtomicU64,
    pub(super) connect_errors: AtomicU64,
    pub(super) listeners_started: AtomicU64,
    pub(super) listeners_stopped: AtomicU64,
}

pub(super) fn inc(a: &AtomicU64) {
    a.fetch_add(1, Relaxed);
}

fn add(a: &AtomicU64, v: u64) {
    if v != 0 {
        a.fetch_add(v, Relaxed);
    }
}

impl Counters {
    pub(super) fn add_apply(&self, c: &ApplyCounts) {
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

    pub(super) fn snapshot(&self) -> IngestCounters {
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
pub(super) struct Shared {
    pub(super) state: AtomicU8,
    /// `u64::MAX` = no batch yet (a real seq never reaches it: it is the
    /// replay end marker).
    pub(super) last_seq: AtomicU64,
    /// The open error while the state is `Failed`.
    pub(super) error: std::sync::Mutex<Option<String>>,
    /// What `applied_at` counts from.
    epoch: Instant,
    /// Nanoseconds from `epoch` to the newest application, plus one (0 =
    /// nothing applied yet).
    applied_at: AtomicU64,
    /// `f64` bits of the newest batch's engine delay (NaN = none).
    engine_delay: AtomicU64,
    pub(super) queued: AtomicU64,
    pub(super) gaps: AtomicU64,
    pub(super) replays: AtomicU64,
    pub(super) malformed: AtomicU64,
}

impl Shared {
    pub(super) fn new(state: ListenerState) -> Shared {
        Shared {
            state: AtomicU8::new(state_code(state)),
            last_seq: AtomicU64::new(NO_SEQ),
            error: std::sync::Mutex::new(None),
            epoch: Instant::now(),
            applied_at: AtomicU64::new(0),
            engine_delay: AtomicU64::new(f64::NAN.to_bits()),
            queued: AtomicU64::new(0),
            gaps: AtomicU64::new(0),
            replays: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
        }
    }

    /// A batch was applied at `now`, `engine_delay` seconds after its `ts`.
    pub(super) fn applied(&self, now: Instant, engine_delay: Option<f64>) {
        let ns = now.saturating_duration_since(self.epoch).as_nanos() as u64;
        self.applied_at.store(ns.saturating_add(1), Relaxed);
        self.engine_delay
            .store(engine_delay.unwrap_or(f64::NAN).to_bits(), Relaxed);
    }

    /// Time since the newest application, as of `now`.
    pub(super) fn applied_age(&self, now: Instant) -> Option<Duration> {
        let at = self.applied_at.load(Relaxed).checked_sub(1)?;
        Some(now.saturating_duration_since(self.epoch + Duration::from_nanos(at)))
    }

    pub(super) fn engine_delay(&self) -> Option<f64> {
        Some(f64::from_bits(self.engine_delay.load(Relaxed))).filter(|d| !d.is_nan())
    }
}

/// Why a KV stream's part of the index may be wrong (issue #17 item 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stale {
    /// A gap is being replayed: batches after it wait.
    Replaying,
    /// No socket: still connecting, or it cannot open.
    NotConnected,
    /// Bookings are active on the rank, yet nothing was applied for
    /// [`SILENCE`]: an engine serving requests stores blocks as it goes.
    Silent,
}

impl Stale {
    pub fn as_str(self) -> &'static str {
        match self {
            Stale::Replaying => "replaying",
            Stale::NotConnected => "not-connected",
            Stale::Silent => "silent",
        }
    }
}

/// A stream with active bookings and no applied batch for this long is
/// [`Stale::Silent`]. An engine that prefills or decodes publishes a
/// store for every full block, several a second per request.
pub const SILENCE: Duration = Duration::from_secs(10);

/// A read handle on one stream's health, for the selector (the catalog
/// copies one into each rank of its snapshot).
#[derive(Clone)]
pub struct StreamHealth(pub(super) std::sync::Arc<Shared>);

impl std::fmt::Debug for StreamHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("StreamHealth")
            .field(&state_of(self.0.state.load(Relaxed)))
            .finish()
    }
}

impl StreamHealth {
    /// Whether the stream is stale now, given the rank's active bookings.
    pub fn staleness(&self, now: Instant, active_requests: u64) -> Option<Stale> {
        stale_by(
            state_of(self.0.state.load(Relaxed)),
            self.0
                .applied_age(now)
                .unwrap_or_else(|| now.saturating_duration_since(self.0.epoch)),
            active_requests,
        )
    }
}

/// The rule of [`StreamHealth::staleness`]: `quiet` is the time since the
/// newest applied batch (or since the stream started, without one).
pub fn stale_by(state: ListenerState, quiet: Duration, active_requests: u64) -> Option<Stale> {
    match state {
        ListenerState::Replaying => Some(Stale::Replaying),
        ListenerState::Connecting | ListenerState::Failed => Some(Stale::NotConnected),
        ListenerState::Live if active_requests > 0 && quiet >= SILENCE => Some(Stale::Silent),
        ListenerState::Live => None,
    }
}

/// Delay buckets, seconds: an idle stream applies within microseconds of
/// receipt; the upper buckets are the backlog issue #17 is about.
const DELAY_BUCKETS: &[f64] = &[
    0.000_01, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// The hub-wide delay histograms (module docs).
#[derive(Clone)]
pub struct Delays {
    /// From reading a batch off its socket to applying it.
    pub apply: Histogram,
    /// From the batch's `ts` (engine wall clock) to applying it; batches
    /// without a usable `ts` are left out, a negative delay counts as 0.
    pub engine: Histogram,
}

impl Delays {
    pub(super) fn new() -> Delays {
        let h = |name: &str, help: &str| {
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(DELAY_BUCKETS.to_vec()))
                .expect("valid histogram")
        };
        Delays {
            apply: h(
                "kvselect_ingest_apply_delay_seconds",
                "Time from reading a KV-event batch off its socket to applying it to the index.",
            ),
            engine: h(
                "kvselect_ingest_engine_delay_seconds",
                "Time from a KV-event batch's own timestamp (engine clock) to applying it (negative delays count as 0).",
            ),
        }
    }
}

pub(super) const NO_SEQ: u64 = u64::MAX;

pub(super) fn state_code(s: ListenerState) -> u8 {
    match s {
        ListenerState::Connecting => 0,
        ListenerState::Live => 1,
        ListenerState::Replaying => 2,
        ListenerState::Failed => 3,
    }
}

pub(super) fn state_of(c: u8) -> ListenerState {
    match c {
        1 => ListenerState::Live,
        2 => ListenerState::Replaying,
        3 => ListenerState::Failed,
        _ => ListenerState::Connecting,
    }
}
