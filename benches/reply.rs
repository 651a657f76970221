//! The largest field of a /select_and_reserve reply: 6,250 `sequence_hashes`
//! (a 100k-token prompt at block size 16) as JSON i64s, in the same run and
//! each into a buffer sized like the reply's (`json_out::i64_array_capacity`):
//! serde_json's `collect_seq` (what the reply used before); an `itoa` +
//! `extend_from_slice` loop (the baseline for a scalar writer); and
//! `json_out::push_i64_array` on every path this CPU has (`scalar`: the
//! portable SWAR step; `avx2`; `avx512`), the paths `--simd` picks.
//!
//! Run: `cargo bench --bench reply`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvselect::parse::NumberPath;
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

/// A scalar writer's baseline: `itoa` per value, appended with
/// `extend_from_slice`, into reserved capacity.
fn itoa_loop(out: &mut Vec<u8>, values: &[u64]) {
    out.reserve(values.len() * 21 + 2);
    out.push(b'[');
    let mut buf = itoa::Buffer::new();
    for (k, &v) in values.iter().enumerate() {
        if k > 0 {
            out.push(b',');
        }
        out.extend_from_slice(buf.format(v as i64).as_bytes());
    }
    out.push(b']');
}

fn bench(c: &mut Criterion) {
    let h = hashes();
    let mut a = Vec::new();
    serde_json::to_writer(&mut a, &AsI64(&h)).unwrap();
    let paths = NumberPath::available();
    eprintln!("json_out paths: {}", NumberPath::names(&paths));
    for &(path, name) in &paths {
        let mut b = Vec::new();
        kvselect::json_out::push_i64_array(&mut b, &h, path);
        assert_eq!(a, b, "the {name} writer disagrees");
    }
    let mut t = Vec::new();
    itoa_loop(&mut t, &h);
    assert_eq!(a, t, "the itoa loop disagrees");

    let capacity = kvselect::json_out::i64_array_capacity(BLOCKS);
    let mut g = c.benchmark_group("sequence_hashes_6250");
    g.throughput(Throughput::Elements(BLOCKS as u64));
    g.measurement_time(Duration::from_secs(3));
    g.bench_with_input(
        BenchmarkId::from_parameter("serde_json_collect_seq"),
        &h,
        |bch, h| {
            bch.iter(|| {
                let mut out = Vec::with_capacity(capacity);
                serde_json::to_writer(&mut out, &AsI64(black_box(h))).unwrap();
                out
            })
        },
    );
    g.bench_with_input(BenchmarkId::from_parameter("itoa_loop"), &h, |bch, h| {
        bch.iter(|| {
            let mut out = Vec::with_capacity(capacity);
            itoa_loop(&mut out, black_box(h));
            out
        })
    });
    for &(path, name) in &paths {
        g.bench_with_input(
            BenchmarkId::from_parameter(format!("json_out_{name}")),
            &h,
            |bch, h| {
                bch.iter(|| {
                    let mut out = Vec::with_capacity(capacity);
                    kvselect::json_out::push_i64_array(&mut out, black_box(h), path);
                    out
                })
            },
        );
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
