//! Runs the Python suite (`python/tests/*.py`) against the native module this
//! `cargo test` just built, so that the README's one test command covers the
//! Python package too.
//!
//! The extension is `target/<profile>/deps/lib_native.so` (this crate's
//! cdylib as cargo builds it for this test; the copy cargo lifts into
//! `target/<profile>/` is refreshed only when the library itself is a
//! target), linked against the interpreter pyo3 built for (`PYO3_PYTHON`,
//! else `python3`). It is laid next to a copy of `python/kvselect/` in a temporary
//! directory that goes first on `PYTHONPATH`, so the test never picks up a
//! stale installed `kvselect`. That interpreter needs pytest, numpy, pyzmq
//! and msgpack (and `ray[serve]==2.60.0` for the Ray tests); `.ci/run`
//! installs them.

use std::path::{Path, PathBuf};
use std::process::Command;

fn python() -> String {
    std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// `target/<profile>/deps`, where this test binary itself lives.
fn deps_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent().expect("target/<profile>/deps").to_path_buf()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let p = e.path();
        if p.is_file() {
            std::fs::copy(&p, to.join(e.file_name())).unwrap();
        }
    }
}

#[test]
fn python_suite_passes_against_this_build() {
    let py = python();
    let probe = Command::new(&py)
        .args([
            "-c",
            "import sysconfig, pytest, numpy, zmq, msgpack; print(sysconfig.get_config_var('EXT_SUFFIX'))",
        ])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {py}: {e}"));
    assert!(
        probe.status.success(),
        "{py} lacks the test dependencies; install them with\n  {py} -m pip install pytest numpy pyzmq msgpack 'ray[serve]==2.60.0'\n{}",
        String::from_utf8_lossy(&probe.stderr)
    );
    let suffix = String::from_utf8(probe.stdout).unwrap().trim().to_string();

    let so = deps_dir().join("lib_native.so");
    assert!(
        so.exists(),
        "{} was not built (run through `cargo test --workspace`)",
        so.display()
    );
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let site = deps_dir().join(format!("pytest-site-{}", std::process::id()));
    let pkg = site.join("kvselect");
    copy_dir(&crate_dir.join("kvselect"), &pkg);
    std::fs::copy(&so, pkg.join(format!("_native{suffix}"))).unwrap();

    let status = Command::new(&py)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-ra"])
        .arg(crate_dir.join("tests"))
        .env("PYTHONPATH", &site)
        .env("KVSELECT_TEST_IMPL", "kvselect")
        // Run from a directory without a `kvselect` folder of its own.
        .current_dir(&site)
        .status()
        .expect("run pytest");
    let _ = std::fs::remove_dir_all(&site);
    assert!(status.success(), "the Python suite failed: {status}");
}
