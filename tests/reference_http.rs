//! The HTTP API against the reference, request by request, in the test
//! command: `harness/interop/http_diff.py` starts this build's server and
//! Dynamo 1.6.1's `dynamo.select_service` on loopback, feeds both the same KV
//! events from three mock engines, sends both the same seeded corpus of
//! valid and broken requests, and exits 1 on any answer that differs other
//! than as the README's "Switching from Dynamo" lists (see the script's
//! doc). A regression in a status, an error text or a body shape fails here.
//!
//! Needs the reference in a venv (`KVSELECT_REFERENCE_VENV`, default
//! `/opt/dynamo-venv`, with `ai-dynamo-runtime==1.6.1`) and pyzmq and msgpack
//! in `python3`; `.ci/run` installs both.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The reference venv's interpreter, which must import the reference.
fn reference_python() -> PathBuf {
    let venv =
        std::env::var("KVSELECT_REFERENCE_VENV").unwrap_or_else(|_| "/opt/dynamo-venv".into());
    let py = Path::new(&venv).join("bin/python");
    let ok = Command::new(&py)
        .args(["-c", "import dynamo.select_service"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        ok,
        "{} cannot import the reference; create it with\n  python3 -m venv {venv} && {venv}/bin/pip install ai-dynamo-runtime==1.6.1 pyzmq msgpack",
        py.display()
    );
    py
}

#[test]
fn http_api_answers_as_the_reference_does() {
    let py = reference_python();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("python3")
        .arg(root.join("harness/interop/http_diff.py"))
        .args(["--requests", "1500", "--seed", "23"])
        .arg("--bin")
        .arg(env!("CARGO_BIN_EXE_kvselect"))
        .arg("--dynamo-python")
        .arg(&py)
        .current_dir(root)
        .output()
        .expect("run python3 harness/interop/http_diff.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "http_diff found answers that differ ({}):\n{stdout}\n{stderr}",
        out.status
    );
    // The summary line: every request was compared and none differed.
    assert!(
        stdout.contains(" 0 mismatches"),
        "no summary line:\n{stdout}\n{stderr}"
    );
}
