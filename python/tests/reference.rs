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
use std::process::Command;

#[test]
fn embedded_selector_answers_as_the_reference_does() {
    let py = reference::python();
    // `target/<profile>/deps`, where this test binary and the module live.
    let exe = std::env::current_exe().expect("test binary path");
    let so = exe.parent().expect("deps dir").join("lib_native.so");
    assert!(so.exists(), "{} was not built", so.display());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repository root");
    let out = Command::new(&py)
        .arg(root.join("harness/interop/py_diff.py"))
        .args(["--calls", "2000", "--seed", "29"])
        .arg("--native")
        .arg(&so)
        .current_dir(root)
        .output()
        .expect("run harness/interop/py_diff.py");
    reference::assert_agrees("py_diff", &out);
}
