//! ZeroMQ KV-event ingestion: engine events -> the partition's KV index.
//!
//! | file | owns |
//! |---|---|
//! | `decode/` | pure wire decoding: frames, replay replies, msgpack batches (`cursor.rs`: the msgpack reader) |
//! | `encode.rs` | the same wire format written out; `testkit` feature only (tests, benches, harness) |
//! | `apply.rs` | decoded events -> index calls, per-listener filtering rules |
//! | `spec.rs` | the hub's config, one listener's source, endpoint syntax |
//! | `hub.rs` | the hub: listener registry, ingest threads, commands to them |
//! | `poll.rs` | one ingest thread: the poll loop over its listeners' sockets |
//! | `listener.rs` | one stream's sockets, reading, replay requests, applying |
//! | `sequence.rs` | the sequence rules (gaps, replay, stale, restarts) as a pure state machine |
//! | `lag.rs` | the index's lag: how long an ingest thread has been behind the events that reached it |
//! | `stats.rs` | counters, per-stream freshness, the delay histograms and the `stats()` snapshot |
//!
//! Ingestion never decides routing; it only keeps the index in step with what
//! each engine reports.

pub mod apply;
pub mod decode;
#[cfg(any(test, feature = "testkit"))]
pub mod encode;
mod hub;
pub mod lag;
mod listener;
mod poll;
mod sequence;
pub mod spec;
mod stats;
mod zctx;

pub use hub::IngestHub;
pub use spec::{
    validate_endpoint, validate_kv_endpoint, EndpointError, EndpointProblem, IngestConfig,
    ListenerSpec,
};
pub use stats::{
    stale_by, Delays, IngestCounters, IngestStats, ListenerState, ListenerStats, Stale,
    StreamHealth, SILENCE,
};
