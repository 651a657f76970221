//! The embedded selector against the reference's, call by call, in the test
//! command: `harness/interop/py_diff.py` loads Dynamo 1.6.1's
//! `dynamo._core.SelectionService` and this build's
//! `kvselect.SelectionService` (the native module this `cargo test` built,
//! as `pytest.rs` uses it) into the reference venv's interpreter, feeds both
//! the same KV events, makes the same seeded corpus of calls on both (valid
//! ones and ones broken the way Python callers break them) and exits 1 on
//! any outcome (value, or exception type, message, `.kind`, `.status_code`)
//! that differs other than as documented (see the script's doc).
//!
//! Needs the reference in a venv made from the interpreter pyo3 builds for
//! (`tests/common/reference.rs`); `.ci/run` makes it.

#[path = "../../tests/common/reference.rs"]
mod reference;

use std::path::Path;

/// One run of `py_diff.py` on `calls` calls of seed `seed`, with the
/// constructor keywords `ctor` (JSON) given to both selectors.
fn diff(calls: &str, seed: &str, ctor: &str) {
    let python = reference::python();
    // `target/<profile>/deps`, where this test binary and the module live.
    let exe = std::env::current_exe().expect("test binary path");
    let so = exe.parent().expect("deps dir").join("lib_native.so");
    assert!(so.exists(), "{} was not built", so.display());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repository root");
    let native = so.to_str().expect("a UTF-8 target path");
    reference::run_diff(
        &python,
        root,
        "py_diff.py",
        &[
            "--calls", calls, "--seed", seed, "--ctor", ctor, "--native", native,
        ],
    );
}

#[test]
fn embedded_selector_answers_as_the_reference_does() {
    diff("2000", "29", "{}");
}

/// With session affinity and a selection cache of two entries, so that
/// pending selections are evicted and replays miss, as in the reference.
#[test]
fn embedded_selector_with_affinity_and_a_small_cache_answers_as_the_reference_does() {
    diff(
        "1500",
        "37",
        r#"{"session_affinity_ttl_secs": 60, "selection_cache": {"ttl_secs": 1, "max_entries": 2, "max_bytes": 100000}}"#,
    );
}
