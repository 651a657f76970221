//! Session affinity (`--session-affinity-ttl-secs`, `selection-api.md` §7.6):
//! which (worker, rank) each session of a partition is bound to.
//!
//! Owns: the bindings, their idle TTL (a binding lives `ttl` past its last
//! use) and the newest-wins rule for bindings received from peers (Dynamo
//! orders them by `sequence`, wall-clock nanoseconds; so does kvselect).
//!
//! Does not own: whether the bound target is still schedulable (the
//! selection checks its candidates), publishing (the mesh), or request
//! parsing.

use crate::index::WorkerRank;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

type Key = (String, String, String);

#[derive(Debug, Clone, Copy)]
struct Bound {
    wr: WorkerRank,
    sequence: u64,
    last_used: Instant,
}

/// A change to publish: the binding's new target and sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bind {
    pub wr: WorkerRank,
    pub sequence: u64,
}

pub struct Affinity {
    ttl: Duration,
    map: Mutex<HashMap<Key, Bound>>,
    last_sequence: Mutex<u64>,
}

fn key(model: &str, group: &str, session: &str) -> Key {
    (model.to_string(), group.to_string(), session.to_string())
}

impl Affinity {
    pub fn new(ttl: Duration) -> Affinity {
        Affinity {
            ttl,
            map: Mutex::new(HashMap::new()),
            last_sequence: Mutex::new(0),
        }
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The session's target, if bound and not idle past the TTL; a hit
    /// counts as a use.
    pub fn lookup(
        &self,
        model: &str,
        group: &str,
        session: &str,
        now: Instant,
    ) -> Option<WorkerRank> {
        let mut m = self.map.lock();
        let k = key(model, group, session);
        let b = m.get_mut(&k)?;
        if now.saturating_duration_since(b.last_used) >= self.ttl {
            m.remove(&k);
            return None;
        }
        b.last_used = now;
        Some(b.wr)
    }

    /// Binds (or re-binds) the session to `wr`. Returns the change to
    /// publish when the binding is new or moved; a refresh of the same
    /// target only renews its idle time.
    pub fn bind(
        &self,
        model: &str,
        group: &str,
        session: &str,
        wr: WorkerRank,
        now: Instant,
    ) -> Option<Bind> {
        let mut m = self.map.lock();
        let k = key(model, group, session);
        if let Some(b) = m.get_mut(&k) {
            if b.wr == wr && now.saturating_duration_since(b.last_used) < self.ttl {
                b.last_used = now;
                return None;
            }
        }
        let sequence = self.next_sequence();
        m.insert(
            k,
            Bound {
                wr,
                sequence,
                last_used: now,
            },
        );
        Some(Bind { wr, sequence })
    }

    /// A binding from a peer: kept unless ours is newer.
    pub fn apply_remote(
        &self,
        model: &str,
        group: &str,
        session: &str,
        wr: WorkerRank,
        sequence: u64,
        now: Instant,
    ) {
        let mut m = self.map.lock();
        let k = key(model, group, session);
        match m.get_mut(&k) {
            Some(b) if b.sequence > sequence => {}
            Some(b) => {
                b.wr = wr;
                b.sequence = sequence;
                b.last_used = now;
            }
            None => {
                m.insert(
                    k,
                    Bound {
                        wr,
                        sequence,
                        last_used: now,
                    },
                );
            }
        }
    }

    /// Drops bindings idle past the TTL; returns how many.
    pub fn sweep(&self, now: Instant) -> usize {
        let mut m = self.map.lock();
        let before = m.len();
        m.retain(|_, b| now.saturating_duration_since(b.last_used) < self.ttl);
        before - m.len()
    }

    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Wall-clock nanoseconds, strictly increasing within the process.
    fn next_sequence(&self) -> u64 {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let mut last = self.last_sequence.lock();
        *last = now.max(*last + 1);
        *last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wr(w: u64) -> WorkerRank {
        WorkerRank {
            worker_id: w,
            dp_rank: 0,
        }
    }

    #[test]
    fn binds_refreshes_and_idles_out() {
        let a = Affinity::new(Duration::from_secs(10));
        let t0 = Instant::now();
        let b = a.bind("m", "g", "s", wr(1), t0).unwrap();
        assert_eq!(b.wr, wr(1));
        assert_eq!(a.bind("m", "g", "s", wr(1), t0), None, "refresh is silent");
        assert_eq!(
            a.lookup("m", "g", "s", t0 + Duration::from_secs(9)),
            Some(wr(1))
        );
        // The lookup renewed it.
        assert_eq!(
            a.lookup("m", "g", "s", t0 + Duration::from_secs(18)),
            Some(wr(1))
        );
        assert_eq!(a.lookup("m", "g", "s", t0 + Duration::from_secs(29)), None);
        assert_eq!(a.lookup("m", "other", "s", t0), None);
        let b2 = a.bind("m", "g", "s", wr(2), t0).unwrap();
        assert!(b2.sequence > b.sequence);
    }

    #[test]
    fn newest_remote_binding_wins() {
        let a = Affinity::new(Duration::from_secs(10));
        let t0 = Instant::now();
        a.apply_remote("m", "g", "s", wr(1), 100, t0);
        a.apply_remote("m", "g", "s", wr(2), 50, t0);
        assert_eq!(a.lookup("m", "g", "s", t0), Some(wr(1)));
        a.apply_remote("m", "g", "s", wr(3), 101, t0);
        assert_eq!(a.lookup("m", "g", "s", t0), Some(wr(3)));
        assert_eq!(a.sweep(t0 + Duration::from_secs(11)), 1);
        assert!(a.is_empty());
    }
}
