//! ZeroMQ KV-event ingestion: engine events -> the partition's KV index.
//!
//! | file | owns |
//! |---|---|
//! | `decode.rs` | pure wire decoding: frames, replay replies, msgpack batches |
//! | `encode.rs` | the same wire format written out; `testkit` feature only (tests, benches, harness) |
//! | `apply.rs` | decoded events -> index calls, per-listener filtering rules |
//! | `subscriber.rs` | the hub: threads, ZMQ sockets, cursors, replay, restarts |
//!
//! Ingestion never decides routing; it only keeps the index in step with what
//! each engine reports.

pub mod apply;
pub mod decode;
#[cfg(any(test, feature = "testkit"))]
pub mod encode;
pub mod subscriber;

pub use subscriber::{
    validate_endpoint, IngestConfig, IngestCounters, IngestHub, IngestStats, ListenerSpec,
    ListenerState, ListenerStats,
};
