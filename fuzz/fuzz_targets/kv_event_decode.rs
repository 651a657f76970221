//! Fuzzes the pure KV-event decoder: as a batch payload, as a live message
//! (first 8 bytes as seq) and as a 3-frame replay reply. Must never panic.
#![no_main]

use kvselect::ingest::decode::{decode_batch, decode_message, decode_replay_reply};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode_batch(data);
    let (seq, payload) = data.split_at(data.len().min(8));
    let _ = decode_message(&[b"", seq, payload]);
    let _ = decode_replay_reply(&[b"", seq, payload]);
});
