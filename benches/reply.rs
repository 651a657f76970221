//! The largest field of a /select_and_reserve reply: 6,250 `sequence_hashes`
//! (a 100k-token prompt at block size 16) as JSON i64s. serde_json's
//! `collect_seq` (what the reply used before) against `json_out::push_i64_array`,
//! in the same run, into a buffer sized like the reply's.
//!
//! Run: `cargo bench --bench reply`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use serde::Serialize;
use std::hint::black_box;
use std::time::Duration;

const BLOCKS: usize = 6_250;

struct AsI64<'a>(&'a [u64]);

impl Serialize for AsI64<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|&h| h as i64))
    }
}

fn hashes() -> Vec<u64> {
    // Sequence hashes are uniform 64-bit values: about half negative, almost
    // all 18-19 digits.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    (0..BLOCKS)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let h = hashes();
    let mut a = Vec::new();
    serde_json::to_writer(&mut a, &AsI64(&h)).unwrap();
    let mut b = Vec::new();
    kvselect::json_out::push_i64_array(&mut b, &h);
    assert_eq!(a, b, "the writers disagree");

    let mut g = c.benchmark_group("sequence_hashes_6250");
    g.throughput(Throughput::Elements(BLOCKS as u64));
    g.measurement_time(Duration::from_secs(3));
    g.bench_with_input(
        BenchmarkId::from_parameter("serde_json_collect_seq"),
        &h,
        |bch, h| {
            bch.iter(|| {
                let mut out = Vec::with_capacity(BLOCKS * 21 + 2);
                serde_json::to_writer(&mut out, &AsI64(black_box(h))).unwrap();
                out
            })
        },
    );
    g.bench_with_input(
        BenchmarkId::from_parameter("json_out_push_i64_array"),
        &h,
        |bch, h| {
            bch.iter(|| {
                let mut out = Vec::with_capacity(BLOCKS * 21 + 2);
                kvselect::json_out::push_i64_array(&mut out, black_box(h));
                out
            })
        },
    );
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
