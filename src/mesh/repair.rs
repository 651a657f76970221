//! Repair: a receiver that saw a gap in an origin's sequence numbers, or
//! hears an origin for the first time (a late start), fetches the origin's
//! live bookings over HTTP (`GET /replica_sync/bookings` on the origin) and
//! replaces everything it holds for that origin with them.
//!
//! Owns: the snapshot's JSON form, taking it exactly (every journal shard
//! locked, then the sequence read), the blocking fetch (plain HTTP/1.1 over
//! a `TcpStream`, from the SUB thread, never the request path), and applying
//! it: free what the origin no longer has, book what is missing, complete
//! prefills the origin completed, and move the origin's last sequence to
//! the snapshot's so older messages still in flight are skipped.
//!
//! The snapshot also carries every session binding the replica knows
//! (with its idle time), so a late replica learns them and a lost binding
//! message is repaired; newest wins, as for messages.
//!
//! Does not own: deciding when to repair (`replica.rs`).

use super::{Held, Mesh};
use crate::app::App;
use crate::index::WorkerRank;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Timeout of one repair fetch (connect, and each read and write).
const FETCH_TIMEOUT: Duration = Duration::from_secs(1);
/// Largest snapshot body accepted.
const MAX_SNAPSHOT_BYTES: u64 = 512 * 1024 * 1024;

/// `GET /replica_sync/bookings`: the replica's own live bookings.
#[derive(Debug, Serialize, Deserialize)]
pub struct BookingsSnapshot {
    pub router_id: u64,
    /// The last sequence number this snapshot reflects.
    pub seq: u64,
    pub bookings: Vec<SnapshotBooking>,
    /// Live session bindings (empty without session affinity).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sessions: Vec<super::affinity::ExportedBinding>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotBooking {
    pub selection_id: String,
    pub model_name: String,
    pub routing_group: String,
    pub block_size: u32,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub identities: Vec<u64>,
    pub chained: bool,
    pub track_prefill_tokens: bool,
    /// The prefill tokens it was booked with.
    pub effective_prefill_tokens: u64,
    /// False once prefill completed.
    pub prefill_outstanding: bool,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub expected_output_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub lora_name: Option<String>,
}

impl Mesh {
    /// This replica's live bookings and the sequence number they reflect.
    pub fn snapshot(
        &self,
        ledger: &crate::reserve::Ledger,
        affinity: Option<&super::affinity::Affinity>,
    ) -> BookingsSnapshot {
        let guards: Vec<_> = self.shards.iter().map(|s| s.lock()).collect();
        let seq = self.out.lock().seq;
        let mut bookings = Vec::new();
        for g in &guards {
            for (id, h) in g.iter() {
                if h.origin != self.router_id {
                    continue;
                }
                let Some(info) = ledger.lookup(id) else {
                    continue;
                };
                bookings.push(SnapshotBooking {
                    selection_id: id.to_string(),
                    model_name: h.model.to_string(),
                    routing_group: h.group.to_string(),
                    block_size: h.block_size,
                    worker_id: h.wr.worker_id,
                    dp_rank: h.wr.dp_rank,
                    identities: h.identities.to_vec(),
                    chained: h.chained,
                    track_prefill_tokens: h.track,
                    effective_prefill_tokens: h.effective_prefill,
                    prefill_outstanding: !h.prefill_done && info.prefill_tokens > 0,
                    expected_output_tokens: h.expected_output_tokens,
                    lora_name: h.lora.as_deref().map(str::to_string),
                });
            }
        }
        drop(guards);
        BookingsSnapshot {
            router_id: self.router_id,
            seq,
            bookings,
            sessions: affinity.map_or_else(Vec::new, |a| a.export(Instant::now())),
        }
    }

    /// Replaces what is held for `origin` with `snap`; returns (freed, booked).
    fn apply_snapshot(&self, app: &App, origin: u64, snap: BookingsSnapshot) -> (usize, usize) {
        if let Some(aff) = &app.affinity {
            let now = Instant::now();
            for b in &snap.sessions {
                aff.apply_exported(b, now);
            }
        }
        let mut want: HashMap<String, SnapshotBooking> = snap
            .bookings
            .into_iter()
            .map(|b| (b.selection_id.clone(), b))
            .collect();
        let mut freed = 0;
        for s in self.shards.iter() {
            let mut g = s.lock();
            g.retain(|id, h| {
                if h.origin != origin {
                    return true;
                }
                match want.remove(&**id) {
                    None => {
                        let _ = app.ledger.free(id);
                        freed += 1;
                        false
                    }
                    Some(b) => {
                        if !b.prefill_outstanding && !h.prefill_done {
                            let _ = app.ledger.prefill_complete(id);
                            h.prefill_done = true;
                        }
                        true
                    }
                }
            });
        }
        let mut booked = 0;
        for (id, b) in want {
            let wr = WorkerRank {
                worker_id: b.worker_id,
                dp_rank: b.dp_rank,
            };
            if !super::known_target(app, &b.model_name, &b.routing_group, b.block_size, wr) {
                continue;
            }
            let held = Held {
                origin,
                wr,
                model: b.model_name.as_str().into(),
                group: b.routing_group.as_str().into(),
                block_size: b.block_size,
                identities: b.identities.as_slice().into(),
                chained: b.chained,
                track: b.track_prefill_tokens,
                effective_prefill: b.effective_prefill_tokens,
                expected_output_tokens: b.expected_output_tokens,
                lora: b.lora_name.as_deref().map(Into::into),
                prefill_done: false,
            };
            if self.insert_held(&app.ledger, &id, held) {
                booked += 1;
                if !b.prefill_outstanding {
                    let mut g = self.shard(&id).lock();
                    let _ = app.ledger.prefill_complete(&id);
                    if let Some(h) = g.get_mut(id.as_str()) {
                        h.prefill_done = true;
                    }
                }
            }
        }
        (freed, booked)
    }
}

/// Fetches `origin`'s snapshot from `http` and applies it. On failure the
/// origin is marked for a retry.
pub(super) fn repair(mesh: &Mesh, app: &App, origin: u64, http: Option<&str>) {
    {
        let mut o = mesh.origins.lock();
        let st = super::replica_origin(&mut o, origin);
        st.last_repair_attempt = Some(Instant::now());
        st.needs_repair = true;
    }
    let Some(base) = http else {
        // No address yet: the next heartbeat brings it.
        return;
    };
    let fetch = |base: &str| {
        http_get(base, "/replica_sync/bookings").and_then(|body| {
            serde_json::from_slice::<BookingsSnapshot>(&body).map_err(|e| e.to_string())
        })
    };
    let mut fetched = fetch(base);
    if let Some(port) = unspecified_port(base) {
        // The origin listens on all interfaces: try the hosts we reach
        // peers on; the router id check below picks the right one.
        for host in mesh.peers().iter().filter_map(|p| peer_host(p)) {
            if matches!(&fetched, Ok(s) if s.router_id == origin) {
                break;
            }
            fetched = fetch(&format!("http://{host}:{port}"));
        }
    }
    let snap = match fetched {
        Ok(s) if s.router_id == origin => s,
        Ok(s) => {
            // The address now serves another process (a restart).
            tracing::debug!(origin, got = s.router_id, "repair source changed identity");
            let mut o = mesh.origins.lock();
            super::replica_origin(&mut o, origin).repair_failures += 1;
            return;
        }
        Err(e) => {
            tracing::warn!(origin, %base, error = %e, "replica repair fetch failed");
            let mut o = mesh.origins.lock();
            super::replica_origin(&mut o, origin).repair_failures += 1;
            return;
        }
    };
    let seq = snap.seq;
    let (freed, booked) = mesh.apply_snapshot(app, origin, snap);
    let mut o = mesh.origins.lock();
    let st = super::replica_origin(&mut o, origin);
    st.repairs += 1;
    st.needs_repair = false;
    st.last_seq = Some(st.last_seq.map_or(seq, |l| l.max(seq)));
    tracing::debug!(
        origin,
        seq,
        freed,
        booked,
        "replica repaired from its origin"
    );
}

/// The port of `http://0.0.0.0:port` or `http://[::]:port`.
fn unspecified_port(base: &str) -> Option<&str> {
    let rest = base.strip_prefix("http://")?;
    rest.strip_prefix("0.0.0.0:")
        .or_else(|| rest.strip_prefix("[::]:"))
}

/// The host of a `tcp://host:port` endpoint.
fn peer_host(endpoint: &str) -> Option<&str> {
    let rest = endpoint.strip_prefix("tcp://")?;
    rest.rsplit_once(':').map(|(h, _)| h).filter(|h| *h != "*")
}

/// A blocking `GET base+path` (`base` = `http://host:port`); the body of a
/// 200 answer.
pub(crate) fn http_get(base: &str, path: &str) -> Result<Vec<u8>, String> {
    let hostport = base
        .strip_prefix("http://")
        .ok_or_else(|| format!("`{base}` is not an http:// address"))?
        .trim_end_matches('/');
    let addr = hostport
        .to_socket_addrs()
        .map_err(|e| e.to_string())?
        .next()
        .ok_or_else(|| format!("`{hostport}` does not resolve"))?;
    let mut s = TcpStream::connect_timeout(&addr, FETCH_TIMEOUT).map_err(|e| e.to_string())?;
    let _ = s.set_read_timeout(Some(FETCH_TIMEOUT));
    let _ = s.set_write_timeout(Some(FETCH_TIMEOUT));
    let _ = s.set_nodelay(true);
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {hostport}\r\nConnection: close\r\nAccept: application/json\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.take(MAX_SNAPSHOT_BYTES)
        .read_to_end(&mut raw)
        .map_err(|e| e.to_string())?;
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no HTTP header end")?;
    let head = String::from_utf8_lossy(&raw[..end]);
    let status = head.split_whitespace().nth(1).unwrap_or("");
    if status != "200" {
        return Err(format!("status {status}"));
    }
    let body = &raw[end + 4..];
    if head
        .lines()
        .any(|l| l.to_ascii_lowercase().starts_with("transfer-encoding:") && l.contains("chunked"))
    {
        return dechunk(body);
    }
    Ok(body.to_vec())
}

fn dechunk(mut b: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let nl = b.windows(2).position(|w| w == b"\r\n").ok_or("bad chunk")?;
        let size_s = std::str::from_utf8(&b[..nl]).map_err(|_| "bad chunk")?;
        let size = usize::from_str_radix(size_s.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| "bad chunk size")?;
        b = &b[nl + 2..];
        if size == 0 {
            return Ok(out);
        }
        out.extend_from_slice(b.get(..size).ok_or("truncated chunk")?);
        b = b.get(size + 2..).ok_or("truncated chunk")?;
    }
}
