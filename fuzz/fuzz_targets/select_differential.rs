//! Differential: our /select parser against serde_json (flat typed struct) on
//! the same bytes; same class (ok / 400 / 422) and the same values.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvselect::parse::oracle::differential_select(data);
});
