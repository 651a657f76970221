//! The mesh's two threads.
//!
//! Owns: the PUB socket (bound on `--replica-sync-port`) and its thread,
//! which drains the bounded publish queue and sends a heartbeat every
//! `heartbeat`; the SUB socket (connected to every peer, subscribed to
//! everything) and its thread, which checks each origin's sequence numbers,
//! starts repairs on a gap or a first contact, expires the leases of silent
//! kvselect origins, and prunes the journal.
//!
//! Does not own: what a message does (`Mesh::apply_slot`), the repair
//! exchange (`repair.rs`). Sockets never leave their thread. Both threads
//! end once the `App` is dropped.

use super::wire::{
    self, Heartbeat, Message, SlotEvent, AFFINITY_TOPIC, HEARTBEAT_TOPIC, SLOT_TOPIC,
};
use super::{replica_origin as origin_entry, Mesh, Outgoing};
use crate::app::App;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Peer changes for the SUB thread.
pub(crate) enum Ctl {
    Connect(String),
    Disconnect(String),
}

/// How long the SUB thread waits for a message before its housekeeping.
const POLL: Duration = Duration::from_millis(50);
/// Messages read per round before housekeeping runs again.
const ROUND: usize = 4096;
/// A failed repair is retried at most this often.
const REPAIR_RETRY: Duration = Duration::from_millis(500);
const PRUNE_EVERY: Duration = Duration::from_secs(2);
/// Per-peer queue depth on both sides; beyond it ZeroMQ drops, and the
/// receivers repair through the gap.
const HWM: i32 = 100_000;

pub(crate) fn bind_pub(
    ctx: &zmq::Context,
    ip: IpAddr,
    port: u16,
) -> Result<(zmq::Socket, String), String> {
    let s = ctx.socket(zmq::PUB).map_err(|e| e.to_string())?;
    let _ = s.set_sndhwm(HWM);
    let _ = s.set_linger(0);
    let host = match ip {
        IpAddr::V4(v4) if v4.is_unspecified() => "*".to_string(),
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => {
            let _ = s.set_ipv6(true);
            if v6.is_unspecified() {
                "*".to_string()
            } else {
                format!("[{v6}]")
            }
        }
    };
    let port_s = if port == 0 {
        "*".to_string()
    } else {
        port.to_string()
    };
    let want = format!("tcp://{host}:{port_s}");
    s.bind(&want)
        .map_err(|e| format!("cannot bind the replica-sync PUB on {want}: {e}"))?;
    let endpoint = s
        .get_last_endpoint()
        .ok()
        .and_then(Result::ok)
        .unwrap_or(want);
    Ok((s, endpoint))
}

pub(crate) fn spawn(
    mesh: &Arc<Mesh>,
    ctx: zmq::Context,
    pub_socket: zmq::Socket,
    rx: mpsc::Receiver<Outgoing>,
    ctl: mpsc::Receiver<Ctl>,
) -> Result<(), String> {
    let sub = ctx.socket(zmq::SUB).map_err(|e| e.to_string())?;
    sub.set_subscribe(b"").map_err(|e| e.to_string())?;
    let _ = sub.set_rcvhwm(HWM);
    let _ = sub.set_linger(0);
    for p in &mesh.cfg.peers {
        sub.connect(p)
            .map_err(|e| format!("cannot connect to replica peer {p}: {e}"))?;
    }
    let m = Arc::clone(mesh);
    std::thread::Builder::new()
        .name("kvselect-mesh-pub".into())
        .spawn(move || pub_loop(&m, pub_socket, rx))
        .map_err(|e| e.to_string())?;
    let m = Arc::clone(mesh);
    std::thread::Builder::new()
        .name("kvselect-mesh-sub".into())
        .spawn(move || {
            sub_loop(&m, sub, ctl);
            drop(ctx);
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}

fn pub_loop(mesh: &Mesh, socket: zmq::Socket, rx: mpsc::Receiver<Outgoing>) {
    let mut last_sent = 0u64;
    let mut next_hb = Instant::now();
    let mut buf = Vec::with_capacity(1024);
    loop {
        if mesh.is_stopped() {
            return;
        }
        let wait = next_hb.saturating_duration_since(Instant::now());
        match rx.recv_timeout(wait) {
            Ok(msg) => {
                buf.clear();
                let (topic, seq) = match &msg {
                    Outgoing::Slot(e) => {
                        wire::encode_slot(e, &mut buf);
                        (SLOT_TOPIC, e.seq)
                    }
                    Outgoing::Binding(b) => {
                        wire::encode_binding(b, &mut buf);
                        (AFFINITY_TOPIC, b.seq)
                    }
                };
                let _ = socket.send_multipart([topic.as_bytes(), &buf[..]], 0);
                last_sent = last_sent.max(seq.unwrap_or(0));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        if Instant::now() >= next_hb {
            if mesh.app.strong_count() == 0 {
                return;
            }
            let hb = Heartbeat {
                router_id: mesh.router_id,
                seq: last_sent.max(mesh.dropped_max.load(Ordering::Relaxed)),
                http: mesh.http.lock().clone(),
            };
            buf.clear();
            wire::encode_heartbeat(&hb, &mut buf);
            let _ = socket.send_multipart([HEARTBEAT_TOPIC.as_bytes(), &buf[..]], 0);
            next_hb = Instant::now() + mesh.cfg.heartbeat;
        }
    }
}

fn sub_loop(mesh: &Mesh, sub: zmq::Socket, ctl: mpsc::Receiver<Ctl>) {
    let mut rng = rand::rng();
    let mut last_prune = Instant::now();
    loop {
        if mesh.is_stopped() {
            return;
        }
        let Some(app) = mesh.app.upgrade() else {
            return;
        };
        while let Ok(c) = ctl.try_recv() {
            let r = match &c {
                Ctl::Connect(ep) => sub.connect(ep),
                Ctl::Disconnect(ep) => sub.disconnect(ep),
            };
            if let Err(e) = r {
                tracing::warn!(error = %e, "replica peer change failed");
            }
        }
        let ready = {
            let mut items = [sub.as_poll_item(zmq::POLLIN)];
            zmq::poll(&mut items, POLL.as_millis() as i64).is_ok_and(|n| n > 0)
        };
        if ready {
            for _ in 0..ROUND {
                let Ok(frames) = sub.recv_multipart(zmq::DONTWAIT) else {
                    break;
                };
                mesh.counters.received.fetch_add(1, Ordering::Relaxed);
                if mesh.cfg.drop_rate > 0.0
                    && rand::Rng::random_bool(&mut rng, mesh.cfg.drop_rate.min(1.0))
                {
                    mesh.counters.fault_dropped.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let [topic, payload] = frames.as_slice() else {
                    mesh.counters.malformed.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                match wire::decode(topic, payload) {
                    Ok(msg) => handle(mesh, &app, msg),
                    Err(wire::WireError::UnknownTopic) => {}
                    Err(e) => {
                        mesh.counters.malformed.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(error = %e, "malformed replica message dropped");
                    }
                }
            }
        }
        housekeeping(mesh, &app);
        if last_prune.elapsed() >= PRUNE_EVERY {
            mesh.prune(&app.ledger);
            last_prune = Instant::now();
        }
    }
}

/// What to do with a message of sequence `seq` from an origin.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    Apply,
    Skip,
    Repair,
}

fn step(last: Option<u64>, seq: u64) -> Step {
    match last {
        // The origin's first message: nothing was missed.
        None if seq == 1 => Step::Apply,
        // A late start, or a restart of ours: fetch what is live.
        None => Step::Repair,
        Some(l) if seq <= l => Step::Skip,
        Some(l) if seq == l + 1 => Step::Apply,
        Some(_) => Step::Repair,
    }
}

fn handle(mesh: &Mesh, app: &App, msg: Message) {
    let (origin, seq) = match &msg {
        Message::Slot(e) => (e.router_id, e.seq),
        Message::Binding(b) => (b.writer_id, b.seq),
        Message::Heartbeat(h) => (h.router_id, Some(h.seq)),
    };
    if origin == mesh.router_id {
        mesh.counters.own_ignored.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let Some(seq) = seq else {
        // Dynamo: best effort, as it does itself.
        {
            let mut o = mesh.origins.lock();
            let st = origin_entry(&mut o, origin);
            st.last_heard = Instant::now();
            if !st.best_effort {
                st.best_effort = true;
                tracing::info!(
                    router_id = origin,
                    "replica peer sends no sequence numbers (a Dynamo selector): \
                     its messages are applied best effort, without gap repair or leases"
                );
            }
        }
        apply(mesh, app, msg);
        return;
    };
    if let Message::Heartbeat(h) = &msg {
        let (gap, http) = {
            let mut o = mesh.origins.lock();
            let st = origin_entry(&mut o, origin);
            st.last_heard = Instant::now();
            st.http = h.http.clone();
            st.best_effort = false;
            let gap = match st.last_seq {
                // Nothing published yet: nothing to fetch.
                None if h.seq == 0 => {
                    st.last_seq = Some(0);
                    false
                }
                None => true,
                Some(l) if h.seq > l => {
                    st.gaps += 1;
                    true
                }
                Some(_) => st.needs_repair,
            };
            (gap, st.http.clone())
        };
        if gap {
            super::repair::repair(mesh, app, origin, http.as_deref());
        }
        return;
    }
    let (s, http) = {
        let mut o = mesh.origins.lock();
        let st = origin_entry(&mut o, origin);
        st.last_heard = Instant::now();
        st.best_effort = false;
        let s = step(st.last_seq, seq);
        match s {
            Step::Apply => st.last_seq = Some(seq),
            Step::Repair if st.last_seq.is_some() => st.gaps += 1,
            _ => {}
        }
        (s, st.http.clone())
    };
    match s {
        Step::Apply => apply(mesh, app, msg),
        Step::Skip => {
            mesh.counters.stale_skipped.fetch_add(1, Ordering::Relaxed);
        }
        Step::Repair => {
            super::repair::repair(mesh, app, origin, http.as_deref());
            // The snapshot covers everything up to its sequence; a message
            // past it still applies.
            let apply_it = {
                let mut o = mesh.origins.lock();
                let st = origin_entry(&mut o, origin);
                match st.last_seq {
                    Some(l) if seq <= l => false,
                    _ => {
                        st.last_seq = Some(seq);
                        true
                    }
                }
            };
            if apply_it {
                apply(mesh, app, msg);
            } else {
                mesh.counters.stale_skipped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

fn apply(mesh: &Mesh, app: &App, msg: Message) {
    match msg {
        Message::Slot(e) => apply_slot(mesh, app, e),
        Message::Binding(b) => mesh.apply_binding(app, &b),
        Message::Heartbeat(_) => {}
    }
}

fn apply_slot(mesh: &Mesh, app: &App, e: SlotEvent) {
    mesh.apply_slot(app, e);
}

/// Leases of silent kvselect origins, and repairs that failed earlier.
fn housekeeping(mesh: &Mesh, app: &App) {
    let now = Instant::now();
    let mut expired = Vec::new();
    let mut retry = Vec::new();
    {
        let mut o = mesh.origins.lock();
        o.retain(|&id, st| {
            if !st.best_effort && now.saturating_duration_since(st.last_heard) >= mesh.cfg.lease {
                expired.push(id);
                return false;
            }
            if st.needs_repair
                && st
                    .last_repair_attempt
                    .is_none_or(|t| now.saturating_duration_since(t) >= REPAIR_RETRY)
            {
                retry.push((id, st.http.clone()));
            }
            true
        });
    }
    for id in expired {
        let n = mesh.drop_origin(&app.ledger, id);
        mesh.counters
            .lease_expired_bookings
            .fetch_add(n as u64, Ordering::Relaxed);
        tracing::warn!(
            router_id = id,
            bookings = n,
            "replica peer silent past its lease: its bookings were dropped"
        );
    }
    for (id, http) in retry {
        super::repair::repair(mesh, app, id, http.as_deref());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_steps() {
        assert_eq!(step(None, 1), Step::Apply);
        assert_eq!(step(None, 5), Step::Repair);
        assert_eq!(step(Some(4), 5), Step::Apply);
        assert_eq!(step(Some(4), 4), Step::Skip);
        assert_eq!(step(Some(4), 2), Step::Skip);
        assert_eq!(step(Some(4), 6), Step::Repair);
    }
}
