//! Replays the `kv_event_decode` fuzz corpus (seeds and any saved crashes
//! under fuzz/corpus/kv_event_decode) through the same calls as the fuzz
//! target, as ordinary tests. Seeds named `seed-*` are valid engine payloads
//! and must decode. (`tests/fuzz_replay.rs` holds the list of all fuzz
//! targets against `fuzz/Cargo.toml`; this file adds the seeds' checks.)

use kvselect::ingest::decode::{decode_batch, decode_message, decode_replay_reply};
use std::path::Path;

/// The fuzz target whose corpus this file replays.
const TARGET: &str = "kv_event_decode";

#[test]
fn fuzz_corpus_replays_without_panics() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(TARGET);
    let mut seeds = 0;
    for entry in std::fs::read_dir(&dir).expect("corpus dir") {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        let batch = decode_batch(&data);
        let (seq, payload) = data.split_at(data.len().min(8));
        let _ = decode_message(&[b"", seq, payload]);
        let _ = decode_replay_reply(&[b"", seq, payload]);
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("seed-") {
            seeds += 1;
            let b = batch.unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(!b.events.is_empty(), "{name}");
            // Every strict prefix of a valid seed is an error, not a panic.
            for cut in 0..data.len() {
                assert!(decode_batch(&data[..cut]).is_err(), "{name} cut {cut}");
            }
        }
    }
    assert!(seeds >= 4, "seeds missing from {}", dir.display());
}
