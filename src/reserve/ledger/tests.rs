//! Unit tests of the ledger through its public calls: the spec's lifecycle
//! table, sharing, decay, `new_blocks` against brute force, chained and
//! tabled ranks, and that every map drains back to empty.

use super::*;

const R200: WorkerRank = WorkerRank {
    worker_id: 200,
    dp_rank: 0,
};
const R201: WorkerRank = WorkerRank {
    worker_id: 201,
    dp_rank: 0,
};
const R202: WorkerRank = WorkerRank {
    worker_id: 202,
    dp_rank: 0,
};
/// Stand-ins for the 64-token prompt's four sequence hashes (spec §5.4 #1).
const PROMPT: [u64; 4] = [
    -1583300653928780152i64 as u64,
    -5980354406663771828i64 as u64,
    960926348267535642,
    4923844688253642376,
];

fn load(p: u64, d: u64, a: u64) -> RankLoad {
    RankLoad {
        prefill_tokens: p,
        decode_blocks: d,
        active_requests: a,
    }
}

fn book(
    l: &Ledger,
    id: &str,
    wr: WorkerRank,
    ids: &[u64],
    prefill: u64,
) -> Result<(), ReserveError> {
    l.book(Booking {
        selection_id: id,
        wr,
        identities: ids,
        form: IdentityForm::Arbitrary,
        prefill_tokens: prefill,
        now: Instant::now(),
    })
}

fn new_blocks(l: &Ledger, ranks: &[WorkerRank], ids: &[u64]) -> Vec<u64> {
    let mut out = vec![99; 3];
    l.new_blocks(ranks, ids, IdentityForm::Arbitrary, &mut out);
    out
}

#[test]
fn spec_6_4_lifecycle_table() {
    let l = Ledger::default();
    // before
    assert_eq!(l.rank_load(R200), load(0, 0, 0));
    // select_and_reserve r1 (effective_prefill 16: 200 caches 3 of 4 blocks)
    book(&l, "r1", R200, &PROMPT, 16).unwrap();
    assert_eq!(l.rank_load(R200), load(16, 4, 1));
    // potential_loads for the same prompt = active + this prompt's part:
    // prefill active + (isl - cached), decode active + new blocks.
    let nb = new_blocks(&l, &[R200, R201, R202], &PROMPT);
    assert_eq!(nb, vec![0, 4, 4]);
    let cached = [48u64, 16, 0]; // 200: 3 blocks, 201: 1, 202: none
    let mut loads = Vec::new();
    l.loads(&[R200, R201, R202], &mut loads);
    let potential: Vec<(u64, u64)> = (0..3)
        .map(|i| {
            (
                loads[i].prefill_tokens + (64 - cached[i]),
                loads[i].decode_blocks + nb[i],
            )
        })
        .collect();
    assert_eq!(potential, vec![(32, 4), (48, 4), (64, 4)]);
    // prefill_complete r1
    l.prefill_complete("r1").unwrap();
    assert_eq!(l.rank_load(R200), load(0, 4, 1));
    // prefill_complete again: ok, unchanged
    l.prefill_complete("r1").unwrap();
    assert_eq!(l.rank_load(R200), load(0, 4, 1));
    // output_block {}
    l.output_block("r1", None).unwrap();
    assert_eq!(l.rank_load(R200), load(0, 5, 1));
    // output_block {"decay_fraction":0.5}: 6 exclusive blocks x 0.5
    l.output_block("r1", Some(0.5)).unwrap();
    assert_eq!(l.rank_load(R200), load(0, 3, 1));
    let info = l.lookup("r1").unwrap();
    assert_eq!((info.identities, info.output_blocks), (4, 2));
    // DELETE r1
    let freed = l.free("r1").unwrap();
    assert_eq!(freed.wr, R200);
    assert_eq!(l.rank_load(R200), load(0, 0, 0));
    // DELETE r1 again
    assert_eq!(l.free("r1"), Err(ReserveError::NotFound));
    assert_eq!(l.stats(), LedgerStats::default());
}

#[test]
fn identical_prompts_share_blocks_but_not_prefill_or_requests() {
    let l = Ledger::default();
    book(&l, "a", R200, &PROMPT, 16).unwrap();
    book(&l, "b", R200, &PROMPT, 24).unwrap();
    assert_eq!(l.rank_load(R200), load(40, 4, 2));
    l.free("a").unwrap();
    assert_eq!(l.rank_load(R200), load(24, 4, 1));
    l.free("b").unwrap();
    assert_eq!(l.stats(), LedgerStats::default());
}

#[test]
fn ids_are_global_and_claimed_once() {
    let l = Ledger::default();
    book(&l, "x", R200, &PROMPT, 0).unwrap();
    assert_eq!(book(&l, "x", R201, &[], 5), Err(ReserveError::Duplicate));
    // The refused booking left no trace.
    assert_eq!(l.rank_load(R201), RankLoad::default());
    assert!(l.is_booked("x") && !l.is_booked("y"));
    // The empty string is a legal id.
    book(&l, "", R201, &[], 0).unwrap();
    assert_eq!(l.rank_load(R201), load(0, 0, 1));
}

#[test]
fn unknown_ids_are_not_found() {
    let l = Ledger::default();
    assert_eq!(l.prefill_complete("nope"), Err(ReserveError::NotFound));
    assert_eq!(
        l.output_block("nope", Some(0.5)),
        Err(ReserveError::NotFound)
    );
    assert_eq!(l.free("nope"), Err(ReserveError::NotFound));
    assert_eq!(l.lookup("nope"), None);
    assert_eq!(l.stats(), LedgerStats::default());
}

#[test]
fn decay_reweights_only_the_exclusive_suffix() {
    let l = Ledger::default();
    book(&l, "a", R200, &[1, 2, 3, 4], 0).unwrap();
    book(&l, "b", R200, &[1, 2, 7, 8], 0).unwrap();
    assert_eq!(l.rank_load(R200).decode_blocks, 6);
    // a's suffix: out, 4, 3 -> 0.5 each; 2 is shared, the walk stops.
    // 1 + 1 + .5 + .5 + 1 + 1 + .5 = 5.5 -> 6 (half away from zero)
    l.output_block("a", Some(0.5)).unwrap();
    assert_eq!(l.rank_load(R200).decode_blocks, 6);
    l.output_block("a", Some(0.25)).unwrap();
    // out2, out1, 4, 3 at .25 = 1; plus 1, 2, 7, 8 = 5
    assert_eq!(l.rank_load(R200).decode_blocks, 5);
    // b gone: 1 and 2 are now a's alone but keep weight 1 until decayed.
    l.free("b").unwrap();
    assert_eq!(l.rank_load(R200).decode_blocks, 3);
    l.output_block("a", Some(0.0)).unwrap();
    assert_eq!(l.rank_load(R200).decode_blocks, 0);
    // The same identities on ANOTHER rank are not "shared" for decay.
    book(&l, "c", R201, &[1, 2, 3, 4], 0).unwrap();
    l.output_block("a", Some(1.0)).unwrap();
    assert_eq!(l.rank_load(R200).decode_blocks, 8);
    assert_eq!(l.rank_load(R201).decode_blocks, 4);
    l.free("a").unwrap();
    l.free("c").unwrap();
    assert_eq!(l.stats(), LedgerStats::default());
}

#[test]
fn decay_weight_sticks_to_a_block_that_becomes_shared() {
    let l = Ledger::default();
    book(&l, "a", R200, &[1, 2], 0).unwrap();
    l.output_block("a", Some(0.5)).unwrap(); // 3 x .5 = 1.5 -> 2
    assert_eq!(l.rank_load(R200).decode_blocks, 2);
    book(&l, "b", R200, &[1, 2, 9], 0).unwrap(); // + 9 at 1.0 -> 2.5 -> 3
    assert_eq!(l.rank_load(R200).decode_blocks, 3);
    l.free("a").unwrap(); // 1, 2 at .5 + 9 = 2
    assert_eq!(l.rank_load(R200).decode_blocks, 2);
    l.free("b").unwrap();
    // Re-booking starts from weight 1 again.
    book(&l, "c", R200, &[1, 2], 0).unwrap();
    assert_eq!(l.rank_load(R200).decode_blocks, 2);
}

#[test]
fn nan_decay_is_ignored_and_out_of_range_is_clamped() {
    let l = Ledger::default();
    book(&l, "a", R200, &[1, 2, 3], 0).unwrap();
    l.output_block("a", Some(f64::NAN)).unwrap();
    assert_eq!(l.rank_load(R200).decode_blocks, 4);
    l.output_block("a", Some(-3.0)).unwrap();
    assert_eq!(l.rank_load(R200).decode_blocks, 0);
    l.output_block("a", Some(7.0)).unwrap();
    assert_eq!(l.rank_load(R200).decode_blocks, 6);
}

#[test]
fn repeated_identity_in_one_booking_counts_once() {
    let l = Ledger::default();
    book(&l, "a", R200, &[5, 5, 6], 0).unwrap();
    assert_eq!(l.rank_load(R200).decode_blocks, 2);
    assert_eq!(new_blocks(&l, &[R200], &[5, 6, 7]), vec![1]);
    l.free("a").unwrap();
    assert_eq!(l.stats(), LedgerStats::default());
}

#[test]
fn new_blocks_counts_misses_per_rank() {
    let l = Ledger::default();
    let other = WorkerRank {
        worker_id: 999,
        dp_rank: 3,
    };
    book(&l, "a", R200, &[1, 2, 3], 0).unwrap();
    book(&l, "b", R201, &[1, 2], 0).unwrap();
    book(&l, "c", other, &[1, 2, 3, 4], 0).unwrap();
    // idle rank, repeated rank, rank outside the query holding everything
    assert_eq!(
        new_blocks(&l, &[R200, R201, R202, R200], &[1, 2, 3, 4]),
        vec![1, 2, 4, 1]
    );
    assert_eq!(new_blocks(&l, &[], &[1]), Vec::<u64>::new());
    assert_eq!(new_blocks(&l, &[R200, R202], &[]), vec![0, 0]);
    // Slots are reused after a rank drains; answers stay per rank.
    l.free("a").unwrap();
    book(&l, "d", R202, &[4], 0).unwrap();
    assert_eq!(
        new_blocks(&l, &[R200, R201, R202], &[1, 2, 3, 4]),
        vec![4, 2, 3]
    );
}

#[test]
fn new_blocks_with_runs_of_widely_shared_identities_matches_brute_force() {
    // 20 ranks; identities 0..40, where identity x is held by rank r when
    // a pattern says so. Long runs with identical holder sets (the shared
    // prefix case), broken by sets differing in one rank, and sets too
    // small for run detection.
    let l = Ledger::default();
    let ranks: Vec<WorkerRank> = (0..20)
        .map(|w| WorkerRank {
            worker_id: w,
            dp_rank: 0,
        })
        .collect();
    let holds = |x: u64, r: u64| match x {
        0..=14 => true,
        15 => r != 7,
        16..=24 => true,
        25..=29 => r < 3,
        30..=34 => r.is_multiple_of(2),
        _ => r == x % 20,
    };
    let mut held: Vec<Vec<u64>> = vec![Vec::new(); 20];
    for r in 0..20u64 {
        held[r as usize] = (0..40).filter(|&x| holds(x, r)).collect();
        // Two bookings per rank so refcounts are above 1 as well.
        book(
            &l,
            &format!("a{r}"),
            ranks[r as usize],
            &held[r as usize],
            0,
        )
        .unwrap();
        book(
            &l,
            &format!("b{r}"),
            ranks[r as usize],
            &held[r as usize][..5],
            0,
        )
        .unwrap();
    }
    let query: Vec<u64> = (0..45).collect();
    let mut query_ranks = ranks.clone();
    query_ranks.push(WorkerRank {
        worker_id: 77,
        dp_rank: 0,
    });
    let mut out = Vec::new();
    l.new_blocks(&query_ranks, &query, IdentityForm::Arbitrary, &mut out);
    let mut want: Vec<u64> = (0..20u64)
        .map(|r| query.iter().filter(|&&x| !(x < 40 && holds(x, r))).count() as u64)
        .collect();
    want.push(45);
    assert_eq!(out, want);
    // The same with the identities in reverse order (runs cross shards).
    let rev: Vec<u64> = query.iter().rev().copied().collect();
    l.new_blocks(&query_ranks, &rev, IdentityForm::Arbitrary, &mut out);
    assert_eq!(out, want);
}

#[test]
fn drop_worker_and_rank_remove_bookings_and_load() {
    let l = Ledger::default();
    let r1 = WorkerRank {
        worker_id: 200,
        dp_rank: 1,
    };
    book(&l, "a", R200, &PROMPT, 10).unwrap();
    book(&l, "b", r1, &PROMPT, 10).unwrap();
    book(&l, "c", R201, &PROMPT, 10).unwrap();
    assert_eq!(l.drop_rank(r1), 1);
    assert_eq!(l.free("b"), Err(ReserveError::NotFound));
    assert_eq!(l.rank_load(r1), RankLoad::default());
    assert_eq!(l.drop_worker(200), 1);
    assert_eq!(l.prefill_complete("a"), Err(ReserveError::NotFound));
    assert_eq!(l.rank_load(R200), RankLoad::default());
    assert_eq!(l.rank_load(R201), load(10, 4, 1));
    assert_eq!(l.drop_worker(200), 0);
    assert_eq!(l.drop_worker(201), 1);
    assert_eq!(l.stats(), LedgerStats::default());
}

/// Every call that releases load runs the release callback once; calls
/// that release nothing (a repeated prefill completion, an unknown id, a
/// sweep or drop that finds nothing) do not.
#[test]
fn releases_call_the_callback() {
    use std::sync::atomic::AtomicUsize;
    let l = Ledger::new(Duration::from_secs(300));
    let n = Arc::new(AtomicUsize::new(0));
    let m = Arc::clone(&n);
    l.set_on_release(Box::new(move || {
        m.fetch_add(1, Ordering::Relaxed);
    }));
    let calls = || n.load(Ordering::Relaxed);
    book(&l, "a", R200, &PROMPT, 10).unwrap();
    book(&l, "b", R201, &PROMPT, 10).unwrap();
    book(&l, "c", R202, &PROMPT, 10).unwrap();
    assert_eq!(calls(), 0, "booking releases nothing");
    l.prefill_complete("a").unwrap();
    assert_eq!(calls(), 1);
    l.prefill_complete("a").unwrap();
    assert_eq!(calls(), 1, "nothing left to release");
    l.free("a").unwrap();
    assert_eq!(calls(), 2);
    assert!(l.free("a").is_err());
    assert_eq!(l.drop_worker(999), 0);
    assert_eq!(calls(), 2);
    assert_eq!(l.drop_worker(201), 1);
    assert_eq!(calls(), 3);
    assert_eq!(
        l.sweep_expired(Instant::now() + Duration::from_secs(301)),
        1
    );
    assert_eq!(calls(), 4);
}

#[test]
fn sweep_expires_only_old_bookings() {
    let l = Ledger::new(Duration::from_secs(300));
    let t0 = Instant::now();
    let b = |id, now| Booking {
        selection_id: id,
        wr: R200,
        identities: &PROMPT,
        form: IdentityForm::Chained,
        prefill_tokens: 8,
        now,
    };
    l.book(b("old", t0)).unwrap();
    l.book(b("new", t0 + Duration::from_secs(200))).unwrap();
    assert_eq!(l.sweep_expired(t0 + Duration::from_secs(299)), 0);
    assert_eq!(l.sweep_expired(t0 + Duration::from_secs(300)), 1);
    assert!(!l.is_booked("old") && l.is_booked("new"));
    assert_eq!(l.rank_load(R200), load(8, 4, 1));
    assert_eq!(l.sweep_expired(t0 + Duration::from_secs(500)), 1);
    assert_eq!(l.stats(), LedgerStats::default());
}

fn book_chained(l: &Ledger, id: &str, wr: WorkerRank, ids: &[u64]) {
    l.book(Booking {
        selection_id: id,
        wr,
        identities: ids,
        form: IdentityForm::Chained,
        prefill_tokens: 0,
        now: Instant::now(),
    })
    .unwrap();
}

#[test]
fn chained_bookings_count_their_common_prefix_once() {
    let l = Ledger::default();
    // Two chained prompts sharing their first two identities.
    book_chained(&l, "a", R200, &[10, 11, 12, 13]);
    book_chained(&l, "b", R200, &[10, 11, 22]);
    assert_eq!(l.rank_load(R200), load(0, 5, 2));
    let s = l.stats();
    assert_eq!((s.identities, s.chained_identities), (0, 5));
    let chained = |ids: &[u64]| {
        let mut out = Vec::new();
        l.new_blocks(&[R200, R201], ids, IdentityForm::Chained, &mut out);
        out
    };
    assert_eq!(chained(&[10, 11, 12, 30]), vec![1, 4]);
    assert_eq!(chained(&[10, 11, 22, 40, 41]), vec![2, 5]);
    // Output blocks are in the table even on a chained rank.
    l.output_block("b", None).unwrap();
    assert_eq!(l.rank_load(R200), load(0, 6, 2));
    assert_eq!(l.stats().identities, 1);
    l.free("a").unwrap();
    assert_eq!(l.rank_load(R200), load(0, 4, 1));
    assert_eq!(chained(&[10, 11, 12, 30]), vec![2, 4]);
    l.free("b").unwrap();
    assert_eq!(l.stats(), LedgerStats::default());
}

#[test]
fn arbitrary_identities_move_a_rank_into_the_table() {
    let l = Ledger::default();
    book_chained(&l, "a", R200, &[10, 11, 12, 13]);
    book_chained(&l, "b", R201, &[10, 11, 12]);
    // An arbitrary booking on R200 matches the chain out of order.
    book(&l, "c", R200, &[13, 10, 50], 0).unwrap();
    assert_eq!(l.rank_load(R200), load(0, 5, 2));
    let s = l.stats();
    assert_eq!((s.identities, s.chained_identities), (5, 3));
    // An arbitrary query tables every busy rank it asks about ...
    assert_eq!(new_blocks(&l, &[R200, R201], &[12, 11, 50]), vec![0, 1]);
    let s = l.stats();
    assert_eq!((s.identities, s.chained_identities), (5, 0));
    // ... and a chained query then reads the table: same answers.
    let mut out = Vec::new();
    l.new_blocks(
        &[R200, R201],
        &[10, 11, 12, 13],
        IdentityForm::Chained,
        &mut out,
    );
    assert_eq!(out, vec![0, 1]);
    // A decay re-weights per identity, so it tables the rank too.
    book_chained(&l, "d", R202, &[10, 11]);
    l.output_block("d", Some(0.5)).unwrap();
    assert_eq!(l.rank_load(R202).decode_blocks, 2); // 0.5 * 3 = 1.5, rounded
    for id in ["a", "b", "c", "d"] {
        l.free(id).unwrap();
    }
    assert_eq!(l.stats(), LedgerStats::default());
    // A drained rank starts over in chained mode.
    book_chained(&l, "e", R200, &[10]);
    assert_eq!(l.stats().chained_identities, 1);
}

#[test]
fn holders_promote_and_collapse() {
    let l = Ledger::default();
    let ranks: Vec<WorkerRank> = (0..10)
        .map(|w| WorkerRank {
            worker_id: w,
            dp_rank: 0,
        })
        .collect();
    for (i, &wr) in ranks.iter().enumerate().rev() {
        book(&l, &format!("b{i}"), wr, &[42, i as u64 + 100], 0).unwrap();
    }
    let mut out = Vec::new();
    l.new_blocks(&ranks, &[42], IdentityForm::Arbitrary, &mut out);
    assert_eq!(out, vec![0; 10]);
    for i in (0..10).step_by(2) {
        l.free(&format!("b{i}")).unwrap();
    }
    l.new_blocks(&ranks, &[42, 105], IdentityForm::Arbitrary, &mut out);
    assert_eq!(out, vec![2, 1, 2, 1, 2, 0, 2, 1, 2, 1]);
    for i in (1..10).step_by(2) {
        l.free(&format!("b{i}")).unwrap();
    }
    assert_eq!(l.stats(), LedgerStats::default());
}
