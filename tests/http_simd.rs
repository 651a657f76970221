//! `--simd` / `KVSELECT_SIMD` on the real binary: each path this CPU has
//! starts, says which loop it runs (start-up log and /metrics) and parses
//! token arrays with the same answers; a path the CPU lacks or an unknown
//! value stops start-up with a clear message and a non-zero exit.
//! (Which value gives which path on which CPU is tested on the pure
//! function, `NumberPath::choose`, in `config.rs`.)

#[path = "common/process.rs"]
mod process;

use kvselect::parse::{avx2_available, avx512_available, sse41_available};
use process::{request, Binary};
use std::process::{Command, Stdio};

/// A /select body with `n` tokens and `bad` spliced in at token `at`.
fn body(n: usize, at: usize, bad: &str) -> Vec<u8> {
    let mut s = String::from(r#"{"model_name":"m","token_ids":["#);
    for k in 0..n {
        if k > 0 {
            s.push_str(if k % 7 == 0 { ", " } else { "," });
        }
        if k == at {
            s.push_str(bad);
        } else {
            s.push_str(&((k as u64 * 2_654_435_761) % 200_000).to_string());
        }
    }
    s.push_str("]}");
    s.into_bytes()
}

/// Status and body of each probe against a server started with `args`.
fn answers(args: &[&str], env: &[(&str, &str)], expect: &str) -> Vec<(u16, String)> {
    let b = Binary::start_env(args, env);
    // The listening line reaches the log just after the address is known.
    let mut log = b.log_text();
    for _ in 0..200 {
        if log.contains("kvselect listening") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
        log = b.log_text();
    }
    assert!(log.contains(&format!("simd value={expect}")), "{log}");
    assert!(
        log.contains(&format!("simd={expect}")) || log.contains(&format!("simd=\"{expect}\"")),
        "start-up log does not name {expect}:\n{log}"
    );
    let json = ("Content-Type", "application/json");
    let worker = br#"{"worker_id":1,"model_name":"m","endpoint":"http://w1","block_size":16}"#;
    assert_eq!(
        request(b.addr, "POST", "/workers", &[json], worker).status,
        201
    );
    let metrics = request(b.addr, "GET", "/metrics", &[], b"");
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    assert!(
        text.contains(&format!("kvselect_simd_path{{path=\"{expect}\"}} 1")),
        "{text}"
    );
    let mut out = Vec::new();
    for (n, at, bad) in [
        (5000, usize::MAX, ""),
        (5000, 4321, "007"),
        (5000, 1000, "4294967296"),
        (5000, 2500, "-3"),
        (5000, 3000, "1.5"),
        (5000, 77, "12345678901"),
    ] {
        let r = request(b.addr, "POST", "/select", &[json], &body(n, at, bad));
        out.push((r.status, String::from_utf8_lossy(&r.body).into_owned()));
    }
    // Every bad element is refused, naming a byte offset.
    for (status, text) in &out[1..] {
        assert!((400..500).contains(status), "{status} {text}");
        assert!(text.contains("error"), "{text}");
    }
    out
}

#[test]
fn every_path_the_cpu_has_starts_and_parses_alike() {
    let scalar = answers(&["--simd", "scalar"], &[], "scalar");
    let mut paths = vec![];
    if sse41_available() {
        paths.push("sse4.1");
    }
    if avx2_available() {
        paths.push("avx2");
    }
    if avx512_available() {
        paths.push("avx512");
    }
    for p in &paths {
        let got = answers(&["--simd", p], &[], p);
        assert_eq!(got[0].0, scalar[0].0, "{p}: valid body");
        assert_eq!(got[1..], scalar[1..], "{p}: error answers differ");
        // The environment variable does the same; the flag wins over it.
        let got = answers(&[], &[("KVSELECT_SIMD", p)], p);
        assert_eq!(got[1..], scalar[1..]);
    }
    let got = answers(
        &["--simd", "scalar"],
        &[("KVSELECT_SIMD", "bogus")],
        "scalar",
    );
    assert_eq!(got[1..], scalar[1..]);
    eprintln!("paths compared with scalar: {paths:?}");
}

/// Runs the binary expecting it to refuse to start; its stderr.
fn refused(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvselect"));
    cmd.args(["--port", "0"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run kvselect");
    assert!(!out.status.success(), "started with {args:?} {env:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn unknown_values_and_missing_features_stop_start_up() {
    let e = refused(&["--simd", "sse9"], &[]);
    assert!(
        e.contains("`sse9` is not one of auto, avx512, avx2, sse4.1, scalar"),
        "{e}"
    );
    let e = refused(&[], &[("KVSELECT_SIMD", "fast")]);
    assert!(e.contains("`fast` is not one of"), "{e}");
    // A path this CPU lacks (only testable where it does lack one; the
    // decision itself is tested for every CPU in config.rs).
    if !avx512_available() {
        let e = refused(&["--simd", "avx512"], &[]);
        assert!(e.contains("lacks the avx512"), "{e}");
    } else {
        eprintln!("this CPU has every path; the lacking case is covered by NumberPath::choose");
    }
    if !avx2_available() {
        let e = refused(&["--simd", "avx2"], &[]);
        assert!(e.contains("lacks the avx2"), "{e}");
    }
}
