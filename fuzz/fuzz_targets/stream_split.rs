//! The streamed path (`src/parse/stream.rs`) against the whole-body parser:
//! the first byte picks random frame splits, the rest is the body; same
//! class, values, error text, offset and path for every prompt body kind.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvselect::parse::oracle::fuzz_stream(data);
});
