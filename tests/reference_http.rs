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
use std::process::Command;

#[test]
fn http_api_answers_as_the_reference_does() {
    let py = reference::python();
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
    reference::assert_agrees("http_diff", &out);
}
