//! The reference (Dynamo 1.6.1) for the differential tests
//! (`tests/reference_http.rs`, `python/tests/reference.rs`): its venv, and
//! the verdict of a `harness/interop/*_diff.py` run.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The reference venv's interpreter (`KVSELECT_REFERENCE_VENV`, default
/// `/opt/dynamo-venv`), which must import the reference, pyzmq and msgpack.
pub fn python() -> PathBuf {
    let venv =
        std::env::var("KVSELECT_REFERENCE_VENV").unwrap_or_else(|_| "/opt/dynamo-venv".into());
    let py = Path::new(&venv).join("bin/python");
    let ok = Command::new(&py)
        .args([
            "-c",
            "import dynamo._core, dynamo.select_service, zmq, msgpack",
        ])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        ok,
        "{} cannot import the reference, pyzmq and msgpack; create it with\n  python3 -m venv {venv} && {venv}/bin/pip install ai-dynamo-runtime==1.6.1 pyzmq msgpack",
        py.display()
    );
    py
}

/// A diff script's run passed: exit 0 and its summary line with no
/// mismatch (`what` names the script in the message).
pub fn assert_agrees(what: &str, out: &Output) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{what} found outcomes that differ ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains(" 0 mismatches"),
        "{what} printed no summary line:\n{stdout}\n{stderr}"
    );
}
