//! /potential_loads and /overlap_scores bodies.
#![no_main]

use kvselect::parse::oracle::{fuzz_body, BodyKind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    fuzz_body(BodyKind::PromptQuery, data);
});
