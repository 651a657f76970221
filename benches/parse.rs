//! /select body parsing: our parser (every token loop this CPU has: scalar,
//! avx2, avx512, each row labelled by the loop it ran) against
//! serde_json (flattened prompt, as the reference does it; and a flat typed
//! struct), simd-json and sonic-rs into the same flat struct, and a memcpy of
//! the body as the floor. Bodies of 10k, 100k and 1M tokens, with realistic
//! ids (uniform in 0..151936, the Qwen vocabulary) and with small ids (0..100).
//!
//! Criterion reports GB/s (`Throughput::Bytes`). After the criterion groups a
//! summary table gives ns per token and the ratio to serde_json typed,
//! measured in the same run (absolute times drift on a shared machine; the
//! ratios are what to compare).
//!
//! `cargo bench --bench parse` (short: measurement_time 3 s per case).

// Reads the thread CPU clock through `libc::clock_gettime`.
#![allow(unsafe_code)]

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use kvselect::parse::oracle::{RefSelect, RefSelectFlatten};
use kvselect::parse::{NumberPath, ParseLimits, Parser, SelectKind};
use kvselect::pool::Pool;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use std::time::Duration;

const VOCAB: u32 = 151_936;

fn body(tokens: usize, max_id: u32, seed: u64) -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut s = String::with_capacity(tokens * 7 + 100);
    s.push_str(r#"{"model_name":"qwen","routing_group":"default","token_ids":["#);
    for i in 0..tokens {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&rng.random_range(0..max_id).to_string());
    }
    s.push_str(r#"],"router_config_override":{"track_prefill_tokens":true}}"#);
    s.into_bytes()
}

fn parser(path: NumberPath) -> Parser {
    let limits = ParseLimits::default();
    // Pools large enough to keep a 1M-token buffer, so steady state is measured.
    Parser::new(limits, Pool::new(8, 1 << 21), Pool::new(8, 1 << 21)).with_number_path(path)
}

type Case = (&'static str, Box<dyn FnMut(&[u8]) -> usize>);

/// Every contender, each returning the token count it read: the peers, then
/// one `kvselect_<path>` per token loop this CPU really has (a path it lacks
/// is left out rather than run under its name by the quiet fall-back).
fn contenders() -> Vec<Case> {
    let mut scratch: Vec<u8> = Vec::new();
    let mut copy: Vec<u8> = Vec::new();
    let mut cases: Vec<Case> = vec![
        (
            "memcpy",
            Box::new(move |b: &[u8]| {
                copy.clear();
                copy.extend_from_slice(b);
                copy.len()
            }),
        ),
        (
            "serde_json_flatten",
            Box::new(|b: &[u8]| {
                serde_json::from_slice::<RefSelectFlatten>(b)
                    .unwrap()
                    .token_count()
            }),
        ),
        (
            "serde_json_typed",
            Box::new(|b: &[u8]| {
                serde_json::from_slice::<RefSelect>(b)
                    .unwrap()
                    .token_count()
            }),
        ),
        (
            "simd_json_typed",
            Box::new(move |b: &[u8]| {
                // simd-json parses in place: the copy is part of its cost.
                scratch.clear();
                scratch.extend_from_slice(b);
                simd_json::serde::from_slice::<RefSelect>(&mut scratch)
                    .unwrap()
                    .token_count()
            }),
        ),
        (
            "sonic_rs_typed",
            Box::new(|b: &[u8]| sonic_rs::from_slice::<RefSelect>(b).unwrap().token_count()),
        ),
    ];
    for (path, name) in NumberPath::available() {
        assert_eq!(path.effective_name(), name);
        let p = parser(path);
        let label: &'static str = match name {
            "scalar" => "kvselect_scalar",
            "avx2" => "kvselect_avx2",
            _ => "kvselect_avx512",
        };
        cases.push((
            label,
            Box::new(move |b: &[u8]| {
                let r = p.select(b, SelectKind::Select).unwrap();
                r.prompt.token_ids.as_ref().map_or(0, |t| t.len())
            }),
        ));
    }
    cases
}

fn sizes() -> Vec<(String, usize, Vec<u8>)> {
    let mut out = Vec::new();
    for &(n, label) in &[(10_000usize, "10k"), (100_000, "100k"), (1_000_000, "1M")] {
        out.push((format!("{label}_realistic"), n, body(n, VOCAB, n as u64)));
        out.push((format!("{label}_small"), n, body(n, 100, n as u64 + 1)));
    }
    out
}

fn bench(c: &mut Criterion) {
    let mut cases = contenders();
    for (label, n, b) in sizes() {
        let mut g = c.benchmark_group(format!("select_{label}"));
        g.throughput(Throughput::Bytes(b.len() as u64));
        g.measurement_time(Duration::from_secs(3));
        g.warm_up_time(Duration::from_millis(500));
        g.sample_size(if n >= 1_000_000 { 10 } else { 20 });
        for (name, f) in cases.iter_mut() {
            g.bench_with_input(BenchmarkId::from_parameter(*name), &b, |bch, b| {
                bch.iter(|| black_box(f(black_box(b))))
            });
        }
        g.finish();
    }
}

/// This thread's CPU time in ns (wall time on a shared machine measures the
/// scheduler as much as the parser).
fn thread_cpu_ns() -> u128 {
    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut t = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as u128 * 1_000_000_000 + t.tv_nsec as u128
}

/// Median CPU time of `f` on `b` over `rounds` rounds of `iters` calls each.
fn median_ns(f: &mut dyn FnMut(&[u8]) -> usize, b: &[u8], iters: u32, rounds: usize) -> f64 {
    let mut t: Vec<f64> = (0..rounds)
        .map(|_| {
            let start = thread_cpu_ns();
            for _ in 0..iters {
                black_box(f(black_box(b)));
            }
            (thread_cpu_ns() - start) as f64 / iters as f64
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[rounds / 2]
}

/// ns per token and ratio to serde_json typed, all contenders in one run
/// (thread CPU time, median of 7 rounds).
fn summary() {
    let mut cases = contenders();
    println!(
        "\nsummary: ns/token, GB/s, ratio = serde_json_typed time / contender time; \
         token loops this CPU has: {}",
        NumberPath::names(&NumberPath::available())
    );
    for (label, n, b) in sizes() {
        let iters = (2_000_000 / n).max(1) as u32;
        let times: Vec<(&str, f64)> = cases
            .iter_mut()
            .map(|(name, f)| {
                assert_eq!(f(&b), if *name == "memcpy" { b.len() } else { n });
                (*name, median_ns(f.as_mut(), &b, iters, 7))
            })
            .collect();
        let serde_typed = times
            .iter()
            .find(|(n, _)| *n == "serde_json_typed")
            .map_or(1.0, |t| t.1);
        for (name, ns) in &times {
            println!(
                "{label:>15} {name:>20} {:>8.3} ns/token {:>7.3} GB/s  ratio {:>6.2}",
                ns / n as f64,
                b.len() as f64 / ns,
                serde_typed / ns
            );
        }
    }
}

criterion_group!(benches, bench);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    summary();
}
