//! Exactness of the ledger under concurrency: many threads book, complete
//! prefill, add (decayed) output blocks and free on a few shared ranks with
//! overlapping prompts, while readers poll loads and new_blocks. Half the
//! writers book chained identities and half arbitrary ones, so ranks leave
//! the chained fast path (and come back to it when they drain) while others
//! read. Afterwards every counter must be zero and every internal map empty.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use kvselect::index::WorkerRank;
use kvselect::reserve::{
    Booking, IdentityForm, Ledger, LedgerStats, PendingCache, RankLoad, ReserveError,
};

const THREADS: u64 = 4;
const CYCLES: u64 = 2_000;

fn rank(i: u64) -> WorkerRank {
    WorkerRank {
        worker_id: 10 + i / 2,
        dp_rank: (i % 2) as u32,
    }
}

/// A prompt sharing a prefix with every other prompt, plus a per-request tail
/// (so it has the chain property: two prompts share a prefix, then nothing).
fn prompt(t: u64, i: u64) -> Vec<u64> {
    let mut p: Vec<u64> = (0..(i % 16)).collect();
    p.extend((0..(i % 7)).map(|k| (t << 40) | (i << 8) | k));
    p
}

#[test]
fn components_are_shareable_between_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<Ledger>();
    shareable::<PendingCache>();
}

#[test]
fn concurrent_lifecycles_return_every_counter_to_zero() {
    let ledger = Ledger::default();
    let ranks: Vec<WorkerRank> = (0..4).map(rank).collect();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        // Readers: the selection path running alongside.
        for form in [IdentityForm::Chained, IdentityForm::Arbitrary] {
            let (ledger, ranks, stop) = (&ledger, &ranks, &stop);
            s.spawn(move || {
                let (mut loads, mut nb) = (Vec::new(), Vec::new());
                let query: Vec<u64> = (0..16).collect();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    ledger.loads(ranks, &mut loads);
                    // An arbitrary query tables every busy rank: only now
                    // and then, so chained ranks are read concurrently too.
                    n += 1;
                    if form == IdentityForm::Arbitrary && !n.is_multiple_of(64) {
                        continue;
                    }
                    ledger.new_blocks(ranks, &query, form, &mut nb);
                    for (l, &n) in loads.iter().zip(&nb) {
                        // A wrapped (transiently negative) counter would show
                        // as a huge value.
                        assert!(l.active_requests <= THREADS, "{l:?}");
                        assert!(l.decode_blocks < 1 << 20, "{l:?}");
                        assert!(l.prefill_tokens < 1 << 30, "{l:?}");
                        assert!(n <= 16);
                    }
                }
            });
        }
        let writers: Vec<_> = (0..THREADS)
            .map(|t| {
                let ledger = &ledger;
                s.spawn(move || {
                    for i in 0..CYCLES {
                        let id = format!("t{t}-{i}");
                        let ids = prompt(t, i);
                        let wr = rank((t + i) % 4);
                        let form = if t % 2 == 0 {
                            IdentityForm::Chained
                        } else {
                            IdentityForm::Arbitrary
                        };
                        ledger
                            .book(Booking {
                                selection_id: &id,
                                wr,
                                identities: &ids,
                                form,
                                prefill_tokens: i % 100,
                                now: Instant::now(),
                            })
                            .unwrap();
                        if i % 3 != 0 {
                            ledger.prefill_complete(&id).unwrap();
                        }
                        for k in 0..(i % 4) {
                            let decay = [None, Some(0.5), Some(0.25), Some(1.0)][k as usize];
                            ledger.output_block(&id, decay).unwrap();
                        }
                        let info = ledger.free(&id).unwrap();
                        assert_eq!(info.wr, wr);
                        assert_eq!(info.output_blocks as u64, i % 4);
                        assert_eq!(ledger.free(&id), Err(ReserveError::NotFound));
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });
    for &wr in &ranks {
        assert_eq!(ledger.rank_load(wr), RankLoad::default());
    }
    assert_eq!(ledger.stats(), LedgerStats::default());
}

#[test]
fn concurrent_bookings_of_one_id_succeed_once() {
    let ledger = Ledger::default();
    let wins = AtomicUsize::new(0);
    const IDS: usize = 500;
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (ledger, wins) = (&ledger, &wins);
            s.spawn(move || {
                for i in 0..IDS {
                    let id = format!("c{i}");
                    let r = ledger.book(Booking {
                        selection_id: &id,
                        wr: rank(t),
                        identities: &[1, 2, 3, i as u64 + 100],
                        form: IdentityForm::Chained,
                        prefill_tokens: 16,
                        now: Instant::now(),
                    });
                    match r {
                        Ok(()) => {
                            wins.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => assert_eq!(e, ReserveError::Duplicate),
                    }
                }
            });
        }
    });
    assert_eq!(wins.load(Ordering::Relaxed), IDS);
    let total: u64 = (0..4)
        .map(|i| ledger.rank_load(rank(i)).active_requests)
        .sum();
    assert_eq!(total, IDS as u64);
    let prefill: u64 = (0..4)
        .map(|i| ledger.rank_load(rank(i)).prefill_tokens)
        .sum();
    assert_eq!(prefill, 16 * IDS as u64);
    // Free from several threads at once, including workers being dropped.
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let ledger = &ledger;
            s.spawn(move || {
                for i in (t as usize..IDS).step_by(THREADS as usize) {
                    let _ = ledger.free(&format!("c{i}"));
                }
            });
        }
        s.spawn(|| ledger.drop_worker(11));
    });
    assert_eq!(ledger.stats(), LedgerStats::default());
}
