//! ZeroMQ KV-event ingestion: engine events -> the partition's KV index.
//!
//! | file | owns |
//! |---|---|
//! | `decode.rs` | pure wire decoding: frames, replay replies, msgpack batches |
//! | `encode.rs` | the same wire format written out (test publishers, benches) |
//!
//! Ingestion never decides routing; it only keeps the index in step with what
//! each engine reports.

pub mod decode;
pub mod encode;
