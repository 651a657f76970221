//! Replays the committed fuzz seeds (`fuzz/corpus/<target>/seed-*`) and any
//! crash libFuzzer left (`fuzz/artifacts/<target>/*`) through the same library
//! calls the fuzz targets make, so a found crash stays fixed.
//!
//! The replay is driven by [`TARGETS`], an explicit list; a test holds it
//! equal to the `[[bin]]` targets of `fuzz/Cargo.toml` and checks that each
//! has a non-empty corpus, so a new fuzz target cannot go unreplayed.

use kvselect::ingest::decode::{decode_batch, decode_message, decode_replay_reply};
use kvselect::parse::oracle::{differential_select, fuzz_body, fuzz_stream, BodyKind};
use kvselect::parse::NumberPath;
use std::path::{Path, PathBuf};

/// A fuzz target's name and what it runs on one input (its `fuzz_target!` body).
type Target = (&'static str, fn(&[u8]));

/// Every fuzz target.
const TARGETS: &[Target] = &[
    ("select", |data| {
        fuzz_body(BodyKind::Select, data);
        fuzz_body(BodyKind::SelectAndReserve, data);
    }),
    ("reservation", |data| fuzz_body(BodyKind::Reservation, data)),
    ("output_block", |data| {
        fuzz_body(BodyKind::OutputBlock, data)
    }),
    ("prompt_query", |data| {
        fuzz_body(BodyKind::PromptQuery, data)
    }),
    ("worker", |data| {
        fuzz_body(BodyKind::WorkerUpsert, data);
        fuzz_body(BodyKind::WorkerPatch, data);
    }),
    ("peer_endpoint", |data| {
        fuzz_body(BodyKind::PeerEndpoint, data)
    }),
    ("select_differential", differential_select),
    ("stream_split", fuzz_stream),
    // Its seeds' stricter checks (valid payloads must decode) are in
    // tests/ingest_fuzz_replay.rs.
    ("kv_event_decode", |data| {
        let _ = decode_batch(data);
        let (seq, payload) = data.split_at(data.len().min(8));
        let _ = decode_message(&[b"", seq, payload]);
        let _ = decode_replay_reply(&[b"", seq, payload]);
    }),
];

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// Runs every file of `dir/<target>` (only `seed-*` files if `only_seeds`)
/// through its target; returns how many ran.
fn replay_dir(dir: &Path, only_seeds: bool) -> usize {
    let mut n = 0;
    for &(target, run) in TARGETS {
        let Ok(files) = std::fs::read_dir(dir.join(target)) else {
            continue;
        };
        for f in files.flatten() {
            let name = f.file_name().to_string_lossy().into_owned();
            if only_seeds && !name.starts_with("seed-") {
                continue;
            }
            let data = std::fs::read(f.path()).unwrap();
            let r = std::panic::catch_unwind(|| run(&data));
            assert!(
                r.is_ok(),
                "{target}/{name} fails: {:?}",
                String::from_utf8_lossy(&data)
            );
            n += 1;
        }
    }
    n
}

/// Subdirectory names of `dir` (none if it does not exist), sorted.
fn subdirs(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The `name`s of the `[[bin]]` tables of a Cargo manifest (a line reader:
/// the fuzz manifest writes each as `name = "..."`).
fn bin_names(manifest: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut in_bin = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_bin = line == "[[bin]]";
            continue;
        }
        if let Some(v) = line.strip_prefix("name") {
            let v = v.trim_start();
            if in_bin && v.starts_with('=') {
                names.push(v[1..].trim().trim_matches('"').to_string());
            }
        }
    }
    names.sort();
    names
}

#[test]
fn fuzz_seeds_replay() {
    // `fuzz_body` holds every vector path this CPU has to the scalar loop.
    eprintln!(
        "parse paths tested: {}",
        NumberPath::names(&NumberPath::available())
    );
    let n = replay_dir(&fuzz_dir().join("corpus"), true);
    assert!(n >= 50, "expected the committed seeds, found {n}");
}

#[test]
fn fuzz_artifacts_replay() {
    replay_dir(&fuzz_dir().join("artifacts"), false);
}

#[test]
fn every_fuzz_target_is_replayed() {
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).unwrap();
    let bins = bin_names(&manifest);
    let mut listed: Vec<String> = TARGETS.iter().map(|&(t, _)| t.to_string()).collect();
    listed.sort();
    assert_eq!(listed, bins, "TARGETS must list fuzz/Cargo.toml's [[bin]]s");
    for t in &bins {
        let corpus = fuzz_dir().join("corpus").join(t);
        let files = std::fs::read_dir(&corpus)
            .unwrap_or_else(|e| panic!("{}: {e}", corpus.display()))
            .count();
        assert!(files > 0, "{} is empty", corpus.display());
    }
    // Corpora and crashes of targets not in the list would never replay.
    for dir in ["corpus", "artifacts"] {
        for d in subdirs(&fuzz_dir().join(dir)) {
            assert!(bins.contains(&d), "fuzz/{dir}/{d} belongs to no target");
        }
    }
}

#[test]
fn bin_names_reads_only_bin_tables() {
    let manifest = "[package]\nname = \"kvselect-fuzz\"\n\n[[bin]]\nname = \"b\"\npath = \"x.rs\"\n\n[[bin]]\nname=\"a\"\n[dependencies]\nname_like = \"1\"\n";
    assert_eq!(bin_names(manifest), ["a", "b"]);
}
