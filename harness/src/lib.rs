//! Load harness: mock vLLM workers publishing real
//! ZMQ KV events, an agentic-session load generator, and the side-by-side
//! runner that measures kvselect and the Dynamo reference in one run.
//!
//! | module | owns | does NOT |
//! |---|---|---|
//! | `mocker` | mock workers: PUB + replay ROUTER sockets, LRU KV cache | speak HTTP |
//! | `http` | minimal keep-alive HTTP/1.1 client | retry or pool |
//! | `loadgen` | registration, sessions, measurements, report tables | start servers |
//! | `bench` | spawning/pinning the servers under test, venv setup, profiles | generate load itself |
//! | `procstat` | CPU seconds of a pid from `/proc` | anything else |
//! | `freshness` | the server's index-freshness figures from two `/metrics` readings | fetch them |
//!
//! Nothing here is used by the selector itself.

pub mod bench;
pub mod freshness;
pub mod http;
pub mod loadgen;
pub mod mocker;
pub mod procstat;
