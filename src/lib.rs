//! kvselect: a KV-cache-aware worker selector for LLM inference fleets,
//! compatible with the HTTP API of NVIDIA Dynamo's standalone selection
//! service.
//!
//! A request flows top to bottom through these modules:
//!
//! | module | owns | does NOT |
//! |---|---|---|
//! | `pool` | bounded pools of reusable `u32`/`u64` buffers | know about JSON |
//! | `parse` | JSON bodies -> typed request views; 400/422 classification | allocate per token |
//! | `hash` | block and sequence hashes over `&[u32]` (pure) | touch the index |
//! | `fold` | the one identity hasher for maps keyed by hashes or ids | hash tokens |
//! | `index` | lock-sharded KV index per partition: stores, removals, overlap | do I/O |
//! | `ingest` | ZMQ subscribers, msgpack event decoding, gap replay | decide routing |
//! | `reserve` | bookings, active load, pending-selection cache | pick workers |
//! | `select` | the cost model and the choice (pure) | lock or do I/O |
//! | `catalog` | worker records, lifecycle, partitions, readiness; keeps ingest, index and load in step | parse JSON |
//! | `app` | one method per route: typed view in, typed reply out, errors as `ServiceError` | know HTTP or JSON |
//! | `mesh` | the replica mesh (Dynamo's wire format, sequence numbers, repair, leases) and session affinity | sit on the request path beyond a queue push |
//! | `metrics` | /metrics: Prometheus text of request, connection, ingest, index and ledger metrics | keep state of its own beyond counters |
//! | `json_out` | i64 arrays of replies, byte for byte serde_json's (AVX-512, AVX2 or portable SWAR, as `--simd` chose) | allocate beyond its reserve |
//! | `http` | accept loop, connection bounds and timeouts, drain, routing, 401/415/413/408, the one error -> status mapping | hold domain state |
//! | `auth`, `tls` | bearer tokens (constant-time, reloadable); the rustls acceptor | know routes |
//! | `shutdown` | SIGTERM/SIGINT: drain on the first, exit on the second | |
//! | `config`, `runtime`, `recovery` | CLI/env -> `Config`; pinned runtime; start-up /dump recovery | |

mod fold;
pub mod hash;
pub mod index;
pub mod ingest;
pub mod parse;
pub mod pool;
pub mod reserve;

pub mod app;
pub mod auth;
pub mod catalog;
pub mod config;
pub mod http;
pub mod json_out;
pub mod mesh;
pub mod metrics;
pub mod recovery;
pub mod runtime;
pub mod select;
pub mod shutdown;
pub mod tls;
