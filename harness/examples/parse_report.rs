//! A short version of `benches/parse.rs` on one 100k-token /select body with
//! realistic ids: every token loop this CPU has (scalar, avx2, avx512; each
//! row names the loop it ran, `simd=peer` for the other parsers and the
//! memcpy) timed in the same run as serde_json typed, then one
//! `<path>_ratio_vs_serde_typed_100k=` line per loop, `best_path=` and
//! `ratio_vs_serde_typed_100k=<serde_json typed time / our best time>` as the
//! last line. `PARSE_REPORT_PROFILE=<path>` loops one path instead (for
//! `perf record`).
//!
//! Before those last lines, the streamed path (`src/parse/stream.rs`) on the
//! same body cut into 16 KiB and 64 KiB frames, per loop: `whole` copies the
//! frames into one pooled buffer and parses it (what the HTTP layer did),
//! `streamed` feeds the frames to a `BodyStream` and parses its skeleton;
//! `stream_<path>_<frame>_whole_vs_streamed=<whole time / streamed time>`;
//! and the same for a 2 MB body of 100k `block_hashes` and no tokens
//! (`stream_hashes_16k_*`), which the front hands to the whole-body parser.
//!
//! `cargo run --release --example parse_report`

// Reads the thread CPU clock through `libc::clock_gettime`.
#![allow(unsafe_code)]

use kvselect::parse::oracle::{RefSelect, RefSelectFlatten};
use kvselect::parse::{
    avx2_available, avx512_available, NumberPath, ParseLimits, Parser, SelectKind,
};
use kvselect::pool::Pool;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;

/// This thread's CPU time in ns: on a machine shared by several builds,
/// wall time measures the scheduler more than the parser.
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

const TOKENS: usize = 100_000;

fn body() -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(100_000);
    let mut s = String::from(r#"{"model_name":"qwen","routing_group":"default","token_ids":["#);
    for i in 0..TOKENS {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&rng.random_range(0..151_936u32).to_string());
    }
    s.push_str(r#"],"router_config_override":{"track_prefill_tokens":true}}"#);
    s.into_bytes()
}

/// Median per-call CPU time over 9 rounds of 40 calls.
fn median_ns(mut f: impl FnMut(&[u8]) -> usize, b: &[u8]) -> f64 {
    for _ in 0..10 {
        black_box(f(b));
    }
    let mut t: Vec<f64> = (0..9)
        .map(|_| {
            let start = thread_cpu_ns();
            for _ in 0..40 {
                black_box(f(black_box(b)));
            }
            (thread_cpu_ns() - start) as f64 / 40.0
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[4]
}

fn main() {
    let b = body();
    let mk = |p| {
        Parser::new(
            ParseLimits::default(),
            Pool::new(4, 1 << 20),
            Pool::new(4, 1 << 20),
        )
        .with_number_path(p)
    };
    // Every token loop this CPU really has (a path it lacks is not listed,
    // so no row runs one loop under another's name).
    let paths: Vec<(Parser, &str)> = NumberPath::available()
        .into_iter()
        .map(|(p, name)| {
            assert_eq!(p.effective_name(), name);
            (mk(p), name)
        })
        .collect();
    let ours = |p: &Parser, b: &[u8]| {
        let r = p.select(b, SelectKind::Select).unwrap();
        r.prompt.token_ids.as_ref().map_or(0, |t| t.len())
    };
    if let Ok(which) = std::env::var("PARSE_REPORT_PROFILE") {
        // Profiling aid: loop one of our paths for a few seconds.
        let Some((p, _)) = paths.iter().find(|(_, name)| *name == which) else {
            eprintln!(
                "PARSE_REPORT_PROFILE={which}: this CPU has {}",
                NumberPath::names(&NumberPath::available())
            );
            std::process::exit(2);
        };
        for _ in 0..3000 {
            black_box(ours(p, &b));
        }
        return;
    }
    let mut scratch = Vec::new();
    let mut copy = Vec::new();
    // (row, token loop used: a kvselect path, or "peer"), time in ns.
    let mut rows: Vec<(String, &str, f64)> = vec![
        (
            "memcpy".into(),
            "peer",
            median_ns(
                |b| {
                    copy.clear();
                    copy.extend_from_slice(b);
                    copy.len()
                },
                &b,
            ),
        ),
        (
            "serde_json_flatten".into(),
            "peer",
            median_ns(
                |b| {
                    serde_json::from_slice::<RefSelectFlatten>(b)
                        .unwrap()
                        .token_count()
                },
                &b,
            ),
        ),
        (
            "serde_json_typed".into(),
            "peer",
            median_ns(
                |b| {
                    serde_json::from_slice::<RefSelect>(b)
                        .unwrap()
                        .token_count()
                },
                &b,
            ),
        ),
        (
            "simd_json_typed".into(),
            "peer",
            median_ns(
                |b| {
                    scratch.clear();
                    scratch.extend_from_slice(b);
                    simd_json::serde::from_slice::<RefSelect>(&mut scratch)
                        .unwrap()
                        .token_count()
                },
                &b,
            ),
        ),
        (
            "sonic_rs_typed".into(),
            "peer",
            median_ns(
                |b| sonic_rs::from_slice::<RefSelect>(b).unwrap().token_count(),
                &b,
            ),
        ),
    ];
    for (p, name) in &paths {
        rows.push((
            format!("kvselect_{name}"),
            name,
            median_ns(|b| ours(p, b), &b),
        ));
    }
    let serde_typed = rows[2].2;
    println!(
        "100k-token /select body: {} bytes; token loops this CPU has: {} (avx2={} avx512={})",
        b.len(),
        NumberPath::names(&NumberPath::available()),
        avx2_available(),
        avx512_available()
    );
    for (name, path, ns) in &rows {
        println!(
            "{name:>20} simd={path:<6} {:>9.1} us {:>7.3} ns/token {:>6.3} GB/s  ratio_vs_serde_typed {:>6.2}",
            ns / 1000.0,
            ns / TOKENS as f64,
            b.len() as f64 / ns,
            serde_typed / ns
        );
    }
    // The streamed path against copy + parse, over the same frames.
    let leaked: &'static [u8] = Box::leak(b.clone().into_boxed_slice());
    let body_pool: Pool<u8> = Pool::new(4, 1 << 21);
    for (p, name) in &paths {
        for (frame, label) in [(16 * 1024, "16k"), (64 * 1024, "64k")] {
            let whole = median_ns(
                |b| {
                    let mut buf = body_pool.take();
                    for f in b.chunks(frame) {
                        buf.extend_from_slice(f);
                    }
                    ours(p, &buf)
                },
                leaked,
            );
            let streamed = median_ns(
                |_| {
                    let mut s = p.stream();
                    for f in leaked.chunks(frame) {
                        s.feed(bytes::Bytes::from_static(f));
                    }
                    assert_eq!(s.streamed_arrays(), 1);
                    let r = p.select_stream(&s, SelectKind::Select).unwrap();
                    r.prompt.token_ids.as_ref().map_or(0, |t| t.len())
                },
                leaked,
            );
            println!(
                "{:>20} simd={name:<6} frames={label}: whole (copy+parse) {:>8.1} us, streamed {:>8.1} us",
                format!("stream_{name}_{label}"),
                whole / 1000.0,
                streamed / 1000.0
            );
            println!(
                "stream_{name}_{label}_whole_vs_streamed={:.2}",
                whole / streamed
            );
        }
    }
    // A body the front has no token array to take from: 100k block hashes
    // (scanned and kept in the skeleton, then parsed there).
    let hashes: &'static [u8] = {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut s = String::from(r#"{"model_name":"qwen","block_hashes":["#);
        for i in 0..TOKENS {
            if i > 0 {
                s.push(',');
            }
            s.push_str(&rng.random::<i64>().to_string());
        }
        s.push_str("]}");
        Box::leak(s.into_bytes().into_boxed_slice())
    };
    let p = &paths[0].0;
    let hash_count = |r: kvselect::parse::SelectRequest<'_>| {
        r.prompt.block_hashes.as_ref().map_or(0, |h| h.len())
    };
    let whole = median_ns(
        |b| {
            let mut buf = body_pool.take();
            for f in b.chunks(16 * 1024) {
                buf.extend_from_slice(f);
            }
            hash_count(p.select(&buf, SelectKind::Select).unwrap())
        },
        hashes,
    );
    let streamed = median_ns(
        |_| {
            let mut s = p.stream();
            for f in hashes.chunks(16 * 1024) {
                s.feed(bytes::Bytes::from_static(f));
            }
            hash_count(p.select_stream(&s, SelectKind::Select).unwrap())
        },
        hashes,
    );
    println!(
        "{:>20} simd={:<6} frames=16k: whole (copy+parse) {:>8.1} us, streamed {:>8.1} us ({} bytes)",
        "stream_hashes_16k",
        paths[0].1,
        whole / 1000.0,
        streamed / 1000.0,
        hashes.len()
    );
    println!(
        "stream_hashes_16k_whole_vs_streamed={:.2}",
        whole / streamed
    );
    let time_of = |path: &str| rows.iter().find(|r| r.1 == path).map(|r| r.2);
    if let (Some(avx2), Some(avx512)) = (time_of("avx2"), time_of("avx512")) {
        println!("avx512_vs_avx2_100k={:.2}", avx2 / avx512);
    }
    for (_, name) in &paths {
        if let Some(t) = time_of(name) {
            println!("{name}_ratio_vs_serde_typed_100k={:.2}", serde_typed / t);
        }
    }
    let (best_path, best) = paths
        .iter()
        .filter_map(|(_, name)| Some((*name, time_of(name)?)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .expect("the scalar loop is always listed");
    println!("best_path={best_path}");
    println!("ratio_vs_serde_typed_100k={:.2}", serde_typed / best);
}
