//! The reference (Dynamo 1.6.1) for the differential tests
//! (`tests/reference_http.rs`, `python/tests/reference.rs`): its venv, and
//! a run of a `harness/interop/*_diff.py` script with its verdict.

use std::path::{Path, PathBuf};
use std::process::Command;

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

/// Runs `harness/interop/<script>` with `python` from the repository root
/// `root`, and asserts that it agreed: exit 0 and its summary line with no
/// mismatch.
pub fn run_diff(python: &Path, root: &Path, script: &str, args: &[&str]) {
    let out = Command::new(python)
        .arg(root.join("harness/interop").join(script))
        .args(args)
        .current_dir(root)
        .output()
        .unwrap_or_else(|e| panic!("run {script}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} found outcomes that differ ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains(" 0 mismatches"),
        "{script} printed no summary line:\n{stdout}\n{stderr}"
    );
}
