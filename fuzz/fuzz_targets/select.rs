//! /select and /select_and_reserve bodies: no panic, sane errors, scalar == AVX2.
#![no_main]

use kvselect::parse::oracle::{fuzz_body, BodyKind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    fuzz_body(BodyKind::Select, data);
    fuzz_body(BodyKind::SelectAndReserve, data);
});
