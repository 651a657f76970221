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
//! Needs the reference in a venv (`KVSELECT_REFERENCE_VENV`, default
//! `/opt/dynamo-venv`, with `ai-dynamo-runtime==1.6.1`, pyzmq and msgpack),
//! made from the interpreter pyo3 builds for; `.ci/run` makes it.

use std::path::Path;
use std::process::Command;

#[test]
fn embedded_selector_answers_as_the_reference_does() {
    let venv =
        std::env::var("KVSELECT_REFERENCE_VENV").unwrap_or_else(|_| "/opt/dynamo-venv".into());
    let py = Path::new(&venv).join("bin/python");
    let ready = Command::new(&py)
        .args(["-c", "import dynamo._core, zmq, msgpack"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        ready,
        "{} cannot import the reference, pyzmq and msgpack; create it with\n  python3 -m venv {venv} && {venv}/bin/pip install ai-dynamo-runtime==1.6.1 pyzmq msgpack",
        py.display()
    );
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
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "py_diff found outcomes that differ ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains(" 0 mismatches"),
        "no summary line:\n{stdout}\n{stderr}"
    );
}
