//! The HTTP API against the reference, request by request, in the test
//! command: `harness/interop/http_diff.py` starts this build's server and
//! Dynamo 1.6.1's `dynamo.select_service` on loopback, feeds both the same KV
//! events from three mock engines, sends both the same seeded corpus of
//! valid and broken requests, and exits 1 on any answer that differs other
//! than as the README's "Switching from Dynamo" lists (see the script's
//! doc). A regression in a status, an error text or a body shape fails here.
//!
//! Needs the reference in a venv (`common/reference.rs`) and pyzmq and
//! msgpack in `python3`; `.ci/run` installs both.

#[path = "common/reference.rs"]
mod reference;

use std::path::Path;

/// One run of `http_diff.py` on `requests` requests of seed `seed`, with
/// `server_args` given to both servers.
fn diff(requests: &str, seed: &str, server_args: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let venv_python = reference::python();
    let args = format!("--server-args={server_args}");
    let dynamo = venv_python.to_str().expect("a UTF-8 venv path");
    reference::run_diff(
        Path::new("python3"),
        root,
        "http_diff.py",
        &[
            "--requests",
            requests,
            "--seed",
            seed,
            &args,
            "--bin",
            env!("CARGO_BIN_EXE_kvselect"),
            "--dynamo-python",
            dynamo,
        ],
    );
}

#[test]
fn http_api_answers_as_the_reference_does() {
    diff("1500", "23", "");
}

/// With session affinity on, requests that name a session are bound and
/// followed as the reference binds and follows them (a session that a split
/// cost tie sent to different workers is set apart by the script).
#[test]
fn http_api_with_session_affinity_answers_as_the_reference_does() {
    diff("1000", "31", "--session-affinity-ttl-secs 60");
}
