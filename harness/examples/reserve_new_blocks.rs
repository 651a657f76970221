//! Timing of the ledger's selection-path reads (not a criterion bench).
//!
//! `cargo run --release --example reserve_new_blocks`
//!
//! new_blocks for 1,024 candidate ranks x a 6,250-identity prompt, in three
//! states, against a naive peer (one HashSet per rank, every identity probed
//! on every rank: O(ranks x identities)); plus loads() and book/free cost.
//! Everything runs twice in one process: with `Arbitrary` identities (the
//! identity table) and with `Chained` ones (the per-rank prefix path; the
//! test identities have the chain property: two lists share a prefix and
//! nothing after it). The last lines give the chained/table ratio of a
//! harness-shaped turn.

use std::collections::HashSet;
use std::hint::black_box;
use std::time::{Duration, Instant};

use kvselect::index::WorkerRank;
use kvselect::reserve::{Booking, IdentityForm, Ledger};

const RANKS: u64 = 1024;
const PROMPT: u64 = 6250;
const PREFIX: u64 = 1000;

fn median(mut f: impl FnMut(), iters: usize) -> Duration {
    let mut t: Vec<Duration> = (0..iters)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed()
        })
        .collect();
    t.sort();
    t[iters / 2]
}

fn naive(sets: &[HashSet<u64>], ids: &[u64], out: &mut Vec<u64>) {
    out.clear();
    out.extend(
        sets.iter()
            .map(|s| ids.iter().filter(|x| !s.contains(x)).count() as u64),
    );
}

fn main() {
    let table = run(IdentityForm::Arbitrary);
    let chained = run(IdentityForm::Chained);
    println!();
    for (i, name) in ["new_blocks", "book", "free"].iter().enumerate() {
        println!(
            "turn {name}: table/chained = {:.1}x ({:.1} us / {:.1} us)",
            table[i].as_secs_f64() / chained[i].as_secs_f64(),
            table[i].as_secs_f64() * 1e6,
            chained[i].as_secs_f64() * 1e6
        );
    }
}

/// Runs every case with identities of `form`; returns the harness-shaped
/// turn's medians (new_blocks, book, free).
fn run(form: IdentityForm) -> [Duration; 3] {
    println!("== {form:?} identities");
    let ranks: Vec<WorkerRank> = (0..RANKS)
        .map(|i| WorkerRank {
            worker_id: 1000 + i / 8,
            dp_rank: (i % 8) as u32,
        })
        .collect();
    // A 6,250-block prompt whose first 1,000 identities are the shared prefix.
    let prompt: Vec<u64> = (0..PROMPT)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 7)
        .collect();
    let mut out = Vec::new();
    let iters = 31;
    let report = |name: &str, ledger_t: Duration, naive_t: Option<Duration>| match naive_t {
        Some(n) => println!(
            "{name:<48} ledger {:>9.1} us   naive {:>9.1} us   naive/ledger {:>6.1}x",
            ledger_t.as_secs_f64() * 1e6,
            n.as_secs_f64() * 1e6,
            n.as_secs_f64() / ledger_t.as_secs_f64()
        ),
        None => println!("{name:<48} {:>9.1} us", ledger_t.as_secs_f64() * 1e6),
    };

    // 1. All ranks idle.
    let ledger = Ledger::default();
    let sets: Vec<HashSet<u64>> = vec![HashSet::new(); RANKS as usize];
    let t = median(
        || ledger.new_blocks(black_box(&ranks), black_box(&prompt), form, &mut out),
        iters,
    );
    assert!(out.iter().all(|&n| n == PROMPT));
    let n = median(|| naive(&sets, &prompt, &mut out), 5);
    report("new_blocks 1024 x 6250, all idle", t, Some(n));

    // 2. Every rank busy with 100 unrelated identities (no hits).
    let mut sets: Vec<HashSet<u64>> = Vec::new();
    for (i, &wr) in ranks.iter().enumerate() {
        let ids: Vec<u64> = (0..100)
            .map(|k| (1u64 << 63) | ((i as u64) << 20) | k)
            .collect();
        ledger
            .book(Booking {
                selection_id: &format!("u{i}"),
                wr,
                identities: &ids,
                form,
                prefill_tokens: 0,
                now: Instant::now(),
            })
            .unwrap();
        sets.push(ids.into_iter().collect());
    }
    let t = median(
        || ledger.new_blocks(black_box(&ranks), black_box(&prompt), form, &mut out),
        iters,
    );
    assert!(out.iter().all(|&n| n == PROMPT));
    let n = median(|| naive(&sets, &prompt, &mut out), 5);
    report("new_blocks 1024 x 6250, busy, no shared blocks", t, Some(n));

    // 3. The 1,000-identity prefix active on every rank (1,024,000 hits).
    for (i, &wr) in ranks.iter().enumerate() {
        ledger
            .book(Booking {
                selection_id: &format!("p{i}"),
                wr,
                identities: &prompt[..PREFIX as usize],
                form,
                prefill_tokens: 0,
                now: Instant::now(),
            })
            .unwrap();
        sets[i].extend(&prompt[..PREFIX as usize]);
    }
    let t = median(
        || ledger.new_blocks(black_box(&ranks), black_box(&prompt), form, &mut out),
        iters,
    );
    assert!(out.iter().all(|&n| n == PROMPT - PREFIX));
    let n = median(|| naive(&sets, &prompt, &mut out), 5);
    report(
        "new_blocks 1024 x 6250, 1000-prefix on every rank",
        t,
        Some(n),
    );

    let mut loads = Vec::new();
    let t = median(|| ledger.loads(black_box(&ranks), &mut loads), iters);
    report("loads 1024 ranks", t, None);

    // Book, then free, of the whole 6,250-identity prompt on one busy rank
    // (its first 1,000 identities are already held by all 1,024 ranks), and
    // on an idle ledger.
    let idle = Ledger::default();
    for (name, l) in [("busy", &ledger), ("idle", &idle)] {
        let (mut book_t, mut free_t) = (Vec::new(), Vec::new());
        for _ in 0..iters {
            let s = Instant::now();
            l.book(Booking {
                selection_id: "big",
                wr: ranks[0],
                identities: &prompt,
                form,
                prefill_tokens: 100,
                now: Instant::now(),
            })
            .unwrap();
            book_t.push(s.elapsed());
            let s = Instant::now();
            l.free("big").unwrap();
            free_t.push(s.elapsed());
        }
        book_t.sort();
        free_t.sort();
        report(
            &format!("book 6250 identities, {name} ledger"),
            book_t[iters / 2],
            None,
        );
        report(
            &format!("free 6250 identities, {name} ledger"),
            free_t[iters / 2],
            None,
        );
    }

    // The harness's shape: 64 ranks, 64 live bookings of 6,250 identities
    // each (1,000 shared, the rest their own: ~400k identities, far more
    // than L2), and a turn = new_blocks over the 64 ranks, book and free of
    // a fresh 6,250-identity prompt. Each turn uses identities never seen
    // before, so its lookups miss the caches as they do in the server.
    let busy = Ledger::default();
    let ranks64 = &ranks[..64];
    for (i, &wr) in ranks64.iter().enumerate() {
        let ids: Vec<u64> = prompt[..PREFIX as usize]
            .iter()
            .copied()
            .chain((PREFIX..PROMPT).map(|k| (i as u64) << 40 | k | 1 << 62))
            .collect();
        busy.book(Booking {
            selection_id: &format!("live{i}"),
            wr,
            identities: &ids,
            form,
            prefill_tokens: 0,
            now: Instant::now(),
        })
        .unwrap();
    }
    let mut turn = 0u64;
    let (mut nb_t, mut book_t, mut free_t) = (Vec::new(), Vec::new(), Vec::new());
    // In the server, other requests' bodies (~700 KB each) pass through the
    // caches between one turn's steps: stand-in, 32 MiB written per step.
    let mut junk = vec![0u8; 32 << 20];
    let mut pollute = |turn: u64| {
        for (i, b) in junk.iter_mut().enumerate().step_by(64) {
            *b = (i as u64 ^ turn) as u8;
        }
        black_box(&junk);
    };
    for _ in 0..iters * 4 {
        turn += 1;
        let ids: Vec<u64> = prompt[..PREFIX as usize]
            .iter()
            .copied()
            .chain(
                (PREFIX..PROMPT)
                    .map(|k| (turn << 40 | k | 1 << 61).wrapping_mul(0x2545_F491_4F6C_DD1D)),
            )
            .collect();
        pollute(turn);
        let s = Instant::now();
        busy.new_blocks(ranks64, &ids, form, &mut out);
        nb_t.push(s.elapsed());
        pollute(turn);
        let s = Instant::now();
        busy.book(Booking {
            selection_id: "turn",
            wr: ranks64[(turn % 64) as usize],
            identities: &ids,
            form,
            prefill_tokens: 0,
            now: Instant::now(),
        })
        .unwrap();
        book_t.push(s.elapsed());
        pollute(turn);
        let s = Instant::now();
        busy.free("turn").unwrap();
        free_t.push(s.elapsed());
    }
    let mut medians = [Duration::ZERO; 3];
    for (k, (name, mut v)) in [
        ("turn: new_blocks 64 x 6250, 400k live identities", nb_t),
        ("turn: book 6250 identities, 400k live", book_t),
        ("turn: free 6250 identities, 400k live", free_t),
    ]
    .into_iter()
    .enumerate()
    {
        v.sort();
        medians[k] = v[v.len() / 2];
        report(name, medians[k], None);
    }
    medians
}
