//! Who holds one identity in the ledger's identity table: per rank slot a
//! refcount and a weight, and the holds that keep a rank's weighted sum in
//! step with them.
//!
//! Owns: [`Holders`] (inline for the usual single holder, slot-sorted columns
//! otherwise) and [`hold`] / [`unhold`], called with the identity's shard
//! locked. Does not: pick shards, lock, or know about bookings.

use std::sync::atomic::Ordering;

use super::chains::RankCell;
use super::{IdentMap, WEIGHT_ONE};

#[derive(Clone, Copy)]
pub(super) struct Holder {
    slot: u32,
    refs: u32,
    weight: u32,
}

/// The ranks (by slot) holding one identity. Most identities are held by one
/// rank, so that case is inline; otherwise columns sorted by slot, so the
/// `new_blocks` scan reads a dense `u32` array.
pub(super) enum Holders {
    One(Holder),
    Many(Box<ManyHolders>),
}

pub(super) struct ManyHolders {
    slots: Vec<u32>,
    refs: Vec<u32>,
    weights: Vec<u32>,
}

pub(super) enum Release {
    Kept,
    Removed { weight: u32, empty: bool },
    Absent,
}

impl Holders {
    pub(super) fn new(slot: u32) -> Holders {
        Holders::One(Holder {
            slot,
            refs: 1,
            weight: WEIGHT_ONE,
        })
    }

    pub(super) fn slots(&self) -> &[u32] {
        match self {
            Holders::One(h) => std::slice::from_ref(&h.slot),
            Holders::Many(m) => &m.slots,
        }
    }

    /// Adds one reference from `slot`; true if `slot` was not holding it yet.
    pub(super) fn acquire(&mut self, slot: u32) -> bool {
        match self {
            Holders::One(h) if h.slot == slot => {
                // 2^32 holds of one identity on one rank would need >32 GiB of
                // bookings; saturating keeps a bug from wrapping to zero.
                h.refs = h.refs.saturating_add(1);
                false
            }
            Holders::One(h) => {
                let (a, b) = if h.slot < slot {
                    (*h, Holder::new_ref(slot))
                } else {
                    (Holder::new_ref(slot), *h)
                };
                *self = Holders::Many(Box::new(ManyHolders {
                    slots: vec![a.slot, b.slot],
                    refs: vec![a.refs, b.refs],
                    weights: vec![a.weight, b.weight],
                }));
                true
            }
            Holders::Many(m) => match m.slots.binary_search(&slot) {
                Ok(i) => {
                    m.refs[i] = m.refs[i].saturating_add(1);
                    false
                }
                Err(i) => {
                    m.slots.insert(i, slot);
                    m.refs.insert(i, 1);
                    m.weights.insert(i, WEIGHT_ONE);
                    true
                }
            },
        }
    }

    /// Drops one reference from `slot`.
    pub(super) fn release(&mut self, slot: u32) -> Release {
        match self {
            Holders::One(h) if h.slot == slot => {
                if h.refs > 1 {
                    h.refs -= 1;
                    Release::Kept
                } else {
                    Release::Removed {
                        weight: h.weight,
                        empty: true,
                    }
                }
            }
            Holders::One(_) => Release::Absent,
            Holders::Many(m) => {
                let Ok(i) = m.slots.binary_search(&slot) else {
                    return Release::Absent;
                };
                if m.refs[i] > 1 {
                    m.refs[i] -= 1;
                    return Release::Kept;
                }
                let weight = m.weights[i];
                m.slots.remove(i);
                m.refs.remove(i);
                m.weights.remove(i);
                if m.slots.len() == 1 {
                    *self = Holders::One(Holder {
                        slot: m.slots[0],
                        refs: m.refs[0],
                        weight: m.weights[0],
                    });
                }
                Release::Removed {
                    weight,
                    empty: false,
                }
            }
        }
    }

    /// Sets the weight of `slot`'s hold if `slot` is its only holder
    /// reference; returns the old weight.
    pub(super) fn reweight_if_exclusive(&mut self, slot: u32, weight: u32) -> Option<u32> {
        let (refs, w) = match self {
            Holders::One(h) if h.slot == slot => (h.refs, &mut h.weight),
            Holders::One(_) => return None,
            Holders::Many(m) => {
                let i = m.slots.binary_search(&slot).ok()?;
                (m.refs[i], &mut m.weights[i])
            }
        };
        if refs != 1 {
            return None;
        }
        Some(std::mem::replace(w, weight))
    }
}

impl Holder {
    fn new_ref(slot: u32) -> Holder {
        Holder {
            slot,
            refs: 1,
            weight: WEIGHT_ONE,
        }
    }
}

/// One more hold of `x` by `cell`'s rank (called with `x`'s shard locked,
/// so the rank's weighted sum changes under the lock that owns the weight).
pub(super) fn hold(map: &mut IdentMap, x: u64, m: u64, cell: &RankCell) {
    if hold_unweighted(map, x, m, cell) {
        cell.weighted
            .fetch_add(u64::from(WEIGHT_ONE), Ordering::Relaxed);
    }
}

/// `hold` without the weight; true if `x` is new on the rank.
pub(super) fn hold_unweighted(map: &mut IdentMap, x: u64, m: u64, cell: &RankCell) -> bool {
    let (h, inserted) = map.get_or_insert_with(x, m, || Holders::new(cell.slot));
    inserted || h.acquire(cell.slot)
}

/// One hold of `x` by `cell`'s rank less (called with `x`'s shard locked).
pub(super) fn unhold(map: &mut IdentMap, x: u64, m: u64, cell: &RankCell) {
    let Some(h) = map.get_mut(x, m) else {
        debug_assert!(false, "released identity not held");
        return;
    };
    match h.release(cell.slot) {
        Release::Kept => {}
        Release::Removed { weight, empty } => {
            if empty {
                map.remove(x, m);
            }
            cell.weighted
                .fetch_sub(u64::from(weight), Ordering::Relaxed);
        }
        Release::Absent => debug_assert!(false, "released identity not held by rank"),
    }
}
