//! After warm-up, parsing a /select body allocates nothing: token and hash
//! buffers come back from the pools, strings are borrowed from the body.
//! Counted by this test binary's own global allocator, per thread.

// The counting allocator is an `unsafe impl GlobalAlloc`.
#![allow(unsafe_code)]

use kvselect::parse::{NumberPath, Parser, SelectKind};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; only counts calls on the side.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> usize {
    ALLOCS.with(|c| c.get())
}

fn body() -> Vec<u8> {
    let ids: Vec<String> = (0..100_000u32)
        .map(|i| (i * 7919 % 151_936).to_string())
        .collect();
    format!(
        r#"{{"model_name":"qwen","routing_group":"default","selection_id":"s-1","token_ids":[{}],
            "block_hashes":[1,-2,3],"sequence_hashes":[4,5,6],"isl_tokens":100000,
            "router_config_override":{{"overlap_score_credit":1.0,"track_prefill_tokens":true}},
            "pinned_worker":{{"worker_id":3,"dp_rank":0}},"unknown":{{"a":[1,2,{{"b":"c"}}]}}}}"#,
        ids.join(", ")
    )
    .into_bytes()
}

#[test]
fn steady_state_parse_allocates_nothing() {
    let b = body();
    let paths = NumberPath::available();
    eprintln!("parse paths tested: {}", NumberPath::names(&paths));
    for (path, name) in paths {
        let p = Parser::default().with_number_path(path);
        for _ in 0..3 {
            let r = p.select(&b, SelectKind::SelectAndReserve).unwrap();
            assert_eq!(r.prompt.token_ids.as_ref().unwrap().len(), 100_000);
        }
        let before = allocs();
        for _ in 0..20 {
            let r = p.select(&b, SelectKind::SelectAndReserve).unwrap();
            assert_eq!(r.prompt.token_ids.as_ref().unwrap()[1], 7919);
            assert_eq!(r.prompt.block_hashes.as_ref().unwrap().len(), 3);
            assert!(matches!(r.model_name, Some(std::borrow::Cow::Borrowed(_))));
        }
        let n = allocs() - before;
        assert_eq!(n, 0, "{name}: {n} allocations in 20 warm parses");
    }
}

#[test]
fn counter_sees_allocations() {
    // The counter is live: a cold parser (empty pools) must allocate.
    let b = body();
    let before = allocs();
    let p = Parser::default();
    drop(p.select(&b, SelectKind::Select).unwrap());
    assert!(allocs() > before);
}

#[test]
fn steady_state_streamed_parse_allocates_nothing() {
    // Frames borrowed from a leaked body: feeding them allocates nothing
    // on the test's side.
    let b: &'static [u8] = Box::leak(body().into_boxed_slice());
    for (path, name) in NumberPath::available() {
        let p = Parser::default().with_number_path(path);
        let parse = || {
            let mut s = p.stream();
            for f in b.chunks(16 * 1024) {
                s.feed(bytes::Bytes::from_static(f));
            }
            let r = p.select_stream(&s, SelectKind::SelectAndReserve).unwrap();
            assert_eq!(s.streamed_arrays(), 1, "{name}: fell back");
            assert_eq!(r.prompt.token_ids.as_ref().unwrap().len(), 100_000);
            assert_eq!(r.prompt.token_ids.as_ref().unwrap()[1], 7919);
            assert_eq!(r.prompt.block_hashes.as_ref().unwrap().len(), 3);
        };
        for _ in 0..3 {
            parse();
        }
        let before = allocs();
        for _ in 0..20 {
            parse();
        }
        let n = allocs() - before;
        assert_eq!(n, 0, "{name}: {n} allocations in 20 warm streamed parses");
    }
}
