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

/// A binding as a repair snapshot carries it (`GET /replica_sync/bookings`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ExportedBinding {
    pub model_name: String,
    pub routing_group: String,
    pub session_id: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    /// Its newest-wins order (wall-clock nanoseconds of the bind).
    pub sequence: u64,
    /// How long it has been idle on the replica that sent it.
    pub idle_ms: u64,
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

    /// Forgets the session's binding.
    pub fn unbind(&self, model: &str, group: &str, session: &str) {
        self.map.lock().remove(&key(model, group, session));
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

    /// Every live binding with its idle time, for a repair snapshot.
    pub fn export(&self, now: Instant) -> Vec<ExportedBinding> {
        let m = self.map.lock();
        m.iter()
            .filter_map(|((model, group, session), b)| {
                let idle = now.saturating_duration_since(b.last_used);
                (idle < self.ttl).then(|| ExportedBinding {
                    model_name: model.clone(),
                    routing_group: group.clone(),
                    session_id: session.clone(),
                    worker_id: b.wr.worker_id,
                    dp_rank: b.wr.dp_rank,
                    sequence: b.sequence,
                    idle_ms: idle.as_millis() as u64,
                })
            })
            .collect()
    }

    /// A binding from a peer's snapshot: as [`Affinity::apply_remote`], with
    /// the idle time the peer reported (so it does not outlive its TTL there
    /// by being copied). Returns whether it was taken.
    pub fn apply_exported(&self, b: &ExportedBinding, now: Instant) -> bool {
        let idle = Duration::from_millis(b.idle_ms);
        if idle >= self.ttl {
            return false;
        }
        let last_used = now.checked_sub(idle).unwrap_or(now);
        let wr = WorkerRank {
            worker_id: b.worker_id,
            dp_rank: b.dp_rank,
        };
        let mut m = self.map.lock();
        let k = key(&b.model_name, &b.routing_group, &b.session_id);
        match m.get_mut(&k) {
            Some(cur) if cur.sequence >= b.sequence => false,
            Some(cur) => {
                cur.wr = wr;
                cur.sequence = b.sequence;
                cur.last_used = cur.last_used.max(last_used);
                true
            }
            None => {
                m.insert(
                    k,
                    Bound {
                        wr,
                        sequence: b.sequence,
                        last_used,
                    },
                );
                true
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
    fn exported_bindings_keep_their_idle_time_and_order() {
        let a = Affinity::new(Duration::from_secs(10));
        let t0 = Instant::now();
        a.bind("m", "g", "s", wr(1), t0).unwrap();
        let later = t0 + Duration::from_secs(4);
        let out = a.export(later);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].worker_id, out[0].idle_ms), (1, 4000));

        let b = Affinity::new(Duration::from_secs(10));
        assert!(b.apply_exported(&out[0], later));
        assert!(
            !b.apply_exported(&out[0], later),
            "same sequence: no change"
        );
        // Idle 4 s on the sender: it idles out 6 s later here, not 10.
        assert_eq!(
            b.lookup("m", "g", "s", later + Duration::from_secs(5)),
            Some(wr(1))
        );
        let c = Affinity::new(Duration::from_secs(10));
        assert!(c.apply_exported(&out[0], later));
        assert_eq!(
            c.lookup("m", "g", "s", later + Duration::from_secs(7)),
            None
        );
        // A newer local binding is kept.
        let d = Affinity::new(Duration::from_secs(10));
        d.bind("m", "g", "s", wr(2), later).unwrap();
        assert!(!d.apply_exported(&out[0], later));
        assert_eq!(d.lookup("m", "g", "s", later), Some(wr(2)));
        // One idle past the TTL is not taken.
        let stale = ExportedBinding {
            idle_ms: 10_000,
            ..out[0].clone()
        };
        assert!(!Affinity::new(Duration::from_secs(10)).apply_exported(&stale, later));
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
