//! Property test: random sequences of ledger operations against a plain
//! single-threaded model that recomputes every rank's load from scratch.
//!
//! Bookings come in three kinds: arbitrary small integers, chained lists
//! (paths in a small trie, hashed like sequence hashes, so they take the
//! ledger's per-rank prefix path), and chain values booked as `Arbitrary`
//! (reversed), which take ranks out of the prefix path. Chained queries are
//! checked after every operation; an arbitrary query (which also takes busy
//! ranks out of the prefix path) is an operation of its own.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use kvselect::index::WorkerRank;
use kvselect::reserve::{Booking, IdentityForm, Ledger, LedgerStats, RankLoad, ReserveError};
use proptest::prelude::*;

const EXPIRY_SECS: u64 = 10;
/// Dyadic fractions: exact in the ledger's fixed point and in f64.
const DECAYS: [Option<f64>; 6] = [
    None,
    Some(0.0),
    Some(0.25),
    Some(0.5),
    Some(0.75),
    Some(1.0),
];

fn rank(i: u8) -> WorkerRank {
    WorkerRank {
        worker_id: u64::from(i / 2),
        dp_rank: u32::from(i % 2),
    }
}

#[derive(Debug, Clone)]
enum Op {
    Book {
        id: u8,
        rank: u8,
        ids: Vec<u64>,
        form: IdentityForm,
        prefill: u64,
    },
    /// An arbitrary new_blocks query over all ranks.
    Query,
    PrefillComplete {
        id: u8,
    },
    Output {
        id: u8,
        decay: usize,
    },
    Free {
        id: u8,
    },
    DropWorker {
        worker: u8,
    },
    DropRank {
        rank: u8,
    },
    Advance {
        secs: u64,
    },
}

/// A chained identity list: the path `steps` in a trie, each identity a hash
/// of the one before and the step (like sequence hashes).
fn chain(steps: &[u64]) -> Vec<u64> {
    let mut h = 0x5eed_u64;
    steps
        .iter()
        .map(|&c| {
            let mut z = h ^ c.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            h = z ^ (z >> 31);
            h
        })
        .collect()
}

/// `len` steps: zeros up to `split`, then `tag` (long lists that share a
/// prefix and then part).
fn long_path(split: usize, len: usize, tag: u64) -> Vec<u64> {
    (0..len).map(|i| if i < split { 0 } else { tag }).collect()
}

fn op() -> impl Strategy<Value = Op> {
    use IdentityForm::{Arbitrary, Chained};
    prop_oneof![
        3 => (0..8u8, 0..4u8, prop::collection::vec(0..12u64, 0..7), prop_oneof![Just(0u64), 1..100u64])
            .prop_map(|(id, rank, ids, prefill)| Op::Book { id, rank, ids, form: Arbitrary, prefill }),
        // Large prompts take the grouped-by-shard paths of book/free/new_blocks.
        1 => (0..8u8, 0..4u8, 0..150u64, 64..120u64)
            .prop_map(|(id, rank, start, len)| Op::Book { id, rank, ids: (start..start + len).collect(), form: Arbitrary, prefill: len }),
        3 => (0..8u8, 0..4u8, prop::collection::vec(0..3u64, 0..7), prop_oneof![Just(0u64), 1..100u64])
            .prop_map(|(id, rank, steps, prefill)| Op::Book { id, rank, ids: chain(&steps), form: Chained, prefill }),
        2 => (0..8u8, 0..4u8, 0..130usize, 64..120usize, 1..3u64)
            .prop_map(|(id, rank, split, len, tag)| Op::Book { id, rank, ids: chain(&long_path(split, len, tag)), form: Chained, prefill: 0 }),
        1 => (0..8u8, 0..4u8, prop::collection::vec(0..3u64, 0..7))
            .prop_map(|(id, rank, steps)| {
                let mut ids = chain(&steps);
                ids.reverse();
                Op::Book { id, rank, ids, form: Arbitrary, prefill: 1 }
            }),
        1 => Just(Op::Query),
        2 => (0..8u8).prop_map(|id| Op::PrefillComplete { id }),
        3 => (0..8u8, 0..DECAYS.len()).prop_map(|(id, decay)| Op::Output { id, decay }),
        2 => (0..8u8).prop_map(|id| Op::Free { id }),
        1 => (0..2u8).prop_map(|worker| Op::DropWorker { worker }),
        1 => (0..4u8).prop_map(|rank| Op::DropRank { rank }),
        1 => (1..8u64).prop_map(|secs| Op::Advance { secs }),
    ]
}

/// A block in the model: a prompt identity, or the n-th output block ever
/// made (the ledger's output identities are random, so never shared).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Block {
    Id(u64),
    Out(u64),
}

struct MBooking {
    wr: WorkerRank,
    blocks: Vec<Block>,
    prefill: u64,
    at: u64,
}

#[derive(Default)]
struct Model {
    bookings: HashMap<String, MBooking>,
    /// Weight of (rank, block) while held; absent = 1.0.
    weights: HashMap<(WorkerRank, Block), f64>,
    outputs: u64,
}

impl Model {
    fn refs(&self, wr: WorkerRank, b: Block) -> usize {
        self.bookings
            .values()
            .filter(|m| m.wr == wr)
            .map(|m| m.blocks.iter().filter(|&&x| x == b).count())
            .sum()
    }

    fn load(&self, wr: WorkerRank) -> RankLoad {
        let on: Vec<&MBooking> = self.bookings.values().filter(|m| m.wr == wr).collect();
        let distinct: HashSet<Block> = on.iter().flat_map(|m| m.blocks.iter().copied()).collect();
        let weighted: f64 = distinct
            .iter()
            .map(|&b| self.weights.get(&(wr, b)).copied().unwrap_or(1.0))
            .sum();
        RankLoad {
            prefill_tokens: on.iter().map(|m| m.prefill).sum(),
            decode_blocks: weighted.round() as u64,
            active_requests: on.len() as u64,
        }
    }

    fn remove(&mut self, id: &str) -> Option<MBooking> {
        let m = self.bookings.remove(id)?;
        for &b in &m.blocks {
            if self.refs(m.wr, b) == 0 {
                self.weights.remove(&(m.wr, b));
            }
        }
        Some(m)
    }

    fn new_blocks(&self, wr: WorkerRank, ids: &[u64]) -> u64 {
        ids.iter()
            .filter(|&&x| self.refs(wr, Block::Id(x)) == 0)
            .count() as u64
    }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let ledger = Ledger::new(Duration::from_secs(EXPIRY_SECS));
    let mut model = Model::default();
    let t0 = Instant::now();
    let mut clock = 0u64;
    let ranks: Vec<WorkerRank> = (0..4).map(rank).collect();
    for op in ops {
        match op {
            Op::Book {
                id,
                rank: r,
                ids,
                form,
                prefill,
            } => {
                let id = format!("s{id}");
                let got = ledger.book(Booking {
                    selection_id: &id,
                    wr: rank(r),
                    identities: &ids,
                    form,
                    prefill_tokens: prefill,
                    now: t0 + Duration::from_secs(clock),
                });
                match model.bookings.entry(id) {
                    std::collections::hash_map::Entry::Occupied(_) => {
                        prop_assert_eq!(got, Err(ReserveError::Duplicate));
                    }
                    std::collections::hash_map::Entry::Vacant(v) => {
                        prop_assert_eq!(got, Ok(()));
                        let blocks = ids.iter().map(|&x| Block::Id(x)).collect();
                        v.insert(MBooking {
                            wr: rank(r),
                            blocks,
                            prefill,
                            at: clock,
                        });
                    }
                }
            }
            Op::Query => {
                // Arbitrary: small integers and chain values, out of order.
                let mut query: Vec<u64> = (0..280).collect();
                query.extend(chain(&long_path(60, 130, 1)).iter().rev());
                query.extend(chain(&[1, 2, 0, 2]));
                let mut nb = Vec::new();
                ledger.new_blocks(&ranks, &query, IdentityForm::Arbitrary, &mut nb);
                for (i, &wr) in ranks.iter().enumerate() {
                    prop_assert_eq!(nb[i], model.new_blocks(wr, &query), "rank {:?}", wr);
                }
            }
            Op::PrefillComplete { id } => {
                let id = format!("s{id}");
                let got = ledger.prefill_complete(&id);
                match model.bookings.get_mut(&id) {
                    Some(m) => {
                        prop_assert_eq!(got, Ok(()));
                        m.prefill = 0;
                    }
                    None => prop_assert_eq!(got, Err(ReserveError::NotFound)),
                }
            }
            Op::Output { id, decay } => {
                let id = format!("s{id}");
                let decay = DECAYS[decay];
                let got = ledger.output_block(&id, decay);
                if !model.bookings.contains_key(&id) {
                    prop_assert_eq!(got, Err(ReserveError::NotFound));
                    continue;
                }
                prop_assert_eq!(got, Ok(()));
                model.outputs += 1;
                let out = Block::Out(model.outputs);
                let m = model.bookings.get_mut(&id).unwrap();
                m.blocks.push(out);
                let (wr, blocks) = (m.wr, m.blocks.clone());
                if let Some(f) = decay {
                    for &b in blocks.iter().rev() {
                        if model.refs(wr, b) != 1 {
                            break;
                        }
                        model.weights.insert((wr, b), f);
                    }
                }
            }
            Op::Free { id } => {
                let id = format!("s{id}");
                let got = ledger.free(&id).map(|i| (i.wr, i.prefill_tokens));
                match model.remove(&id) {
                    Some(m) => prop_assert_eq!(got, Ok((m.wr, m.prefill))),
                    None => prop_assert_eq!(got, Err(ReserveError::NotFound)),
                }
            }
            Op::DropWorker { worker } => {
                let ids: Vec<String> = model
                    .bookings
                    .iter()
                    .filter(|(_, m)| m.wr.worker_id == u64::from(worker))
                    .map(|(k, _)| k.clone())
                    .collect();
                for id in &ids {
                    model.remove(id);
                }
                prop_assert_eq!(ledger.drop_worker(u64::from(worker)), ids.len());
            }
            Op::DropRank { rank: r } => {
                let ids: Vec<String> = model
                    .bookings
                    .iter()
                    .filter(|(_, m)| m.wr == rank(r))
                    .map(|(k, _)| k.clone())
                    .collect();
                for id in &ids {
                    model.remove(id);
                }
                prop_assert_eq!(ledger.drop_rank(rank(r)), ids.len());
            }
            Op::Advance { secs } => {
                clock += secs;
                let ids: Vec<String> = model
                    .bookings
                    .iter()
                    .filter(|(_, m)| clock - m.at >= EXPIRY_SECS)
                    .map(|(k, _)| k.clone())
                    .collect();
                for id in &ids {
                    model.remove(id);
                }
                let swept = ledger.sweep_expired(t0 + Duration::from_secs(clock));
                prop_assert_eq!(swept, ids.len());
            }
        }
        let mut loads = Vec::new();
        ledger.loads(&ranks, &mut loads);
        for (i, &wr) in ranks.iter().enumerate() {
            prop_assert_eq!(loads[i], model.load(wr), "rank {:?}", wr);
        }
        // Chained queries (they leave the ranks' modes as they are).
        for steps in [
            long_path(130, 130, 0),
            long_path(40, 125, 2),
            vec![1; 10],
            vec![0, 1, 2, 0, 1, 2, 0, 1],
        ] {
            let query = chain(&steps);
            let mut nb = Vec::new();
            ledger.new_blocks(&ranks, &query, IdentityForm::Chained, &mut nb);
            for (i, &wr) in ranks.iter().enumerate() {
                prop_assert_eq!(
                    nb[i],
                    model.new_blocks(wr, &query),
                    "rank {:?} {:?}",
                    wr,
                    steps
                );
            }
        }
        for (id, m) in &model.bookings {
            let info = ledger.lookup(id);
            prop_assert_eq!(
                info.map(|i| (i.wr, i.prefill_tokens)),
                Some((m.wr, m.prefill))
            );
        }
    }
    // Draining everything leaves nothing behind.
    let left: Vec<String> = model.bookings.keys().cloned().collect();
    for id in left {
        prop_assert!(ledger.free(&id).is_ok());
    }
    prop_assert_eq!(ledger.stats(), LedgerStats::default());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn ledger_matches_model(ops in prop::collection::vec(op(), 1..80)) {
        run(ops)?;
    }
}
