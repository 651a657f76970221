//! Simulated vLLM workers for load tests: each owns a ZMQ XPUB socket (a PUB
//! that also reports subscriptions), a replay ROUTER socket and an LRU prefix
//! cache, and publishes exactly the KV events a vLLM 0.34 engine would for
//! the prompts it is told to serve.
//!
//! Owns: socket setup (ephemeral loopback ports), the per-worker cache and seq
//! counter, the replay buffer and the one thread that answers replay requests
//! for every worker. Does NOT own any HTTP: registering the workers with a
//! selector lives in `harness::loadgen`, which drives [`Mocker::serve`].
//!
//! Engine block hashes are the public sequence-hash chain of the prompt, so
//! they are unique per prefix position, and `parent_block_hash` always names
//! a block this worker has announced and not removed (the cache is kept
//! prefix-closed: a served prompt's blocks are touched tail first, so a parent
//! is always more recently used than its children and is evicted after them).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kvselect::hash;
use kvselect::index::Tier;
use kvselect::ingest::decode::{Group, GroupKind, KvEvent, Removed, Stored};
use kvselect::ingest::encode::{encode_batch, now_ts, EventForm};

/// Defaults of the simulated engine.
pub const DEFAULT_WORKERS: usize = 1024;
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
pub const DEFAULT_CAPACITY_BLOCKS: usize = 32_768;
pub const DEFAULT_REPLAY_STEPS: usize = 256;
pub const DEFAULT_REPLAY_BYTES: usize = 8 << 20;
/// libzmq refuses more than 1023 sockets per context by default; 2 sockets
/// per worker, so this many workers share one context.
const WORKERS_PER_CONTEXT: usize = 400;
/// Seq value of the replay end marker (`kv-events.md` §4).
pub const END_MARKER_SEQ: u64 = u64::MAX;
/// The one KV-cache group a mock engine has: vLLM's group 0, full attention.
const GROUP: Group = Group {
    idx: Some(0),
    kind: Some(GroupKind::MainAttention),
};

/// Configuration of a fleet of mock workers.
#[derive(Debug, Clone)]
pub struct MockerConfig {
    pub workers: usize,
    pub block_size: u32,
    /// LRU capacity of each worker's KV cache, in blocks.
    pub capacity_blocks: usize,
    /// Worker `i` gets worker id `worker_id_base + i`.
    pub worker_id_base: u64,
    /// Topic frame of every message (vLLM default: empty).
    pub topic: String,
    /// Replay buffer bounds per worker: at most this many batches and bytes
    /// (the newest batch is always kept).
    pub replay_steps: usize,
    pub replay_bytes: usize,
}

impl Default for MockerConfig {
    fn default() -> Self {
        Self {
            workers: DEFAULT_WORKERS,
            block_size: DEFAULT_BLOCK_SIZE,
            capacity_blocks: DEFAULT_CAPACITY_BLOCKS,
            worker_id_base: 1,
            topic: String::new(),
            replay_steps: DEFAULT_REPLAY_STEPS,
            replay_bytes: DEFAULT_REPLAY_BYTES,
        }
    }
}

/// Errors of the mock fleet.
#[derive(Debug)]
pub enum MockerError {
    Zmq(zmq::Error),
    BadEndpoint(String),
    UnknownWorker(u64),
}

impl std::fmt::Display for MockerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MockerError::Zmq(e) => write!(f, "zmq: {e}"),
            MockerError::BadEndpoint(e) => write!(f, "unexpected endpoint {e}"),
            MockerError::UnknownWorker(w) => write!(f, "no mock worker {w}"),
        }
    }
}

impl std::error::Error for MockerError {}

impl From<zmq::Error> for MockerError {
    fn from(e: zmq::Error) -> Self {
        MockerError::Zmq(e)
    }
}

/// What one [`Mocker::serve`] call did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServeOutcome {
    /// Leading full blocks already cached.
    pub hit_blocks: usize,
    /// Blocks newly stored (announced in one `BlockStored`).
    pub stored_blocks: usize,
    /// Blocks evicted (one `BlockRemoved` each).
    pub removed_blocks: usize,
    /// Seq of the published batch; `None` when nothing changed.
    pub seq: Option<u64>,
}

/// What the whole fleet has published since it started (every batch sent,
/// including one whose send failed at the high-water mark: its seq is
/// consumed and replay can still deliver it). Read before and after a
/// measured window, the difference is what the engines published in it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Published {
    /// KV-event batches (one per `serve` that changed the cache, one per
    /// `clear`).
    pub batches: u64,
    /// Block hashes announced in `BlockStored` events.
    pub stored_blocks: u64,
    /// Block hashes announced in `BlockRemoved` events.
    pub removed_blocks: u64,
}

impl Published {
    /// `self - earlier`, per field.
    pub fn since(&self, earlier: &Published) -> Published {
        Published {
            batches: self.batches.saturating_sub(earlier.batches),
            stored_blocks: self.stored_blocks.saturating_sub(earlier.stored_blocks),
            removed_blocks: self.removed_blocks.saturating_sub(earlier.removed_blocks),
        }
    }
}

#[derive(Default)]
struct PublishedCounters {
    batches: AtomicU64,
    stored_blocks: AtomicU64,
    removed_blocks: AtomicU64,
}

/// Public endpoints of one worker, for registration.
#[derive(Debug, Clone)]
pub struct WorkerEndpoints {
    pub worker_id: u64,
    /// `tcp://127.0.0.1:PORT` of the XPUB socket.
    pub kv_events: String,
    /// `tcp://127.0.0.1:PORT` of the replay ROUTER socket.
    pub replay: String,
}

/// Keys are already uniform hashes; hashing them again is wasted work.
#[derive(Default)]
struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | b as u64;
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdentityHasher>>;

const NONE: u32 = u32::MAX;

#[derive(Clone, Copy)]
struct Node {
    key: u64,
    prev: u32,
    next: u32,
}

/// LRU set of engine block hashes: a slab-backed doubly linked list (head =
/// most recent) plus a map from key to slot. Every operation is O(1).
struct Lru {
    map: IdMap<u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
}

impl Lru {
    fn new() -> Self {
        Self {
            map: IdMap::default(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NONE,
            tail: NONE,
        }
    }

    fn len(&self) -> usize {
        self.map.len()
    }

    fn slot(&self, key: u64) -> Option<u32> {
        self.map.get(&key).copied()
    }

    fn unlink(&mut self, s: u32) {
        let Node { prev, next, .. } = self.nodes[s as usize];
        if prev != NONE {
            self.nodes[prev as usize].next = next;
        } else {
            self.head = next;
        }
        if next != NONE {
            self.nodes[next as usize].prev = prev;
        } else {
            self.tail = prev;
        }
    }

    fn push_front(&mut self, s: u32) {
        self.nodes[s as usize].prev = NONE;
        self.nodes[s as usize].next = self.head;
        if self.head != NONE {
            self.nodes[self.head as usize].prev = s;
        } else {
            self.tail = s;
        }
        self.head = s;
    }

    fn touch(&mut self, s: u32) {
        if self.head != s {
            self.unlink(s);
            self.push_front(s);
        }
    }

    fn insert(&mut self, key: u64) -> u32 {
        if let Some(s) = self.slot(key) {
            self.touch(s);
            return s;
        }
        let node = Node {
            key,
            prev: NONE,
            next: NONE,
        };
        let s = match self.free.pop() {
            Some(s) => {
                self.nodes[s as usize] = node;
                s
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.map.insert(key, s);
        self.push_front(s);
        s
    }

    fn pop_lru(&mut self) -> Option<u64> {
        let s = self.tail;
        if s == NONE {
            return None;
        }
        self.unlink(s);
        let key = self.nodes[s as usize].key;
        self.map.remove(&key);
        self.free.push(s);
        Some(key)
    }

    fn clear(&mut self) {
        self.map.clear();
        self.nodes.clear();
        self.free.clear();
        self.head = NONE;
        self.tail = NONE;
    }
}

/// Recent batches of one worker, shared between its publisher and the replay
/// thread.
#[derive(Default)]
struct ReplayBuffer {
    batches: VecDeque<(u64, Arc<Vec<u8>>)>,
    bytes: usize,
}

struct WorkerState {
    /// An XPUB, so the fleet can tell when a selector's subscription has
    /// arrived: a PUB drops what it sends before then (ZeroMQ's slow
    /// joiner), and a test that starts publishing at once loses its first
    /// batches.
    publisher: zmq::Socket,
    /// A subscription has arrived on `publisher`.
    subscribed: bool,
    next_seq: u64,
    cache: Lru,
    scratch_local: Vec<u64>,
    scratch_seq: Vec<u64>,
    scratch_slots: Vec<u32>,
    scratch_removed: Vec<u64>,
}

struct Worker {
    endpoints: WorkerEndpoints,
    state: Mutex<WorkerState>,
    replay: Arc<Mutex<ReplayBuffer>>,
}

/// A fleet of mock vLLM workers. Dropping it stops the replay thread and
/// closes every socket.
pub struct Mocker {
    cfg: MockerConfig,
    topic: Vec<u8>,
    workers: Vec<Worker>,
    stop: Arc<AtomicBool>,
    replay_thread: Option<JoinHandle<()>>,
    published: PublishedCounters,
    // Kept last so sockets close before their contexts terminate.
    _contexts: Vec<zmq::Context>,
}

fn bind_loopback(sock: &zmq::Socket) -> Result<String, MockerError> {
    sock.bind("tcp://127.0.0.1:*")?;
    match sock.get_last_endpoint()? {
        Ok(ep) if ep.starts_with("tcp://127.0.0.1:") => Ok(ep),
        Ok(ep) => Err(MockerError::BadEndpoint(ep)),
        Err(raw) => Err(MockerError::BadEndpoint(
            String::from_utf8_lossy(&raw).into_owned(),
        )),
    }
}

impl Mocker {
    /// Binds every worker's XPUB and ROUTER socket on loopback ephemeral ports
    /// and starts the replay thread.
    pub fn start(cfg: MockerConfig) -> Result<Self, MockerError> {
        let mut contexts = Vec::new();
        let mut workers = Vec::with_capacity(cfg.workers);
        let mut routers = Vec::with_capacity(cfg.workers);
        for i in 0..cfg.workers {
            if i % WORKERS_PER_CONTEXT == 0 {
                contexts.push(zmq::Context::new());
            }
            let ctx = &contexts[contexts.len() - 1];
            let publisher = ctx.socket(zmq::XPUB)?;
            publisher.set_linger(0)?;
            // vLLM's high-water mark.
            publisher.set_sndhwm(100_000)?;
            let kv_events = bind_loopback(&publisher)?;
            let router = ctx.socket(zmq::ROUTER)?;
            router.set_linger(0)?;
            let replay_ep = bind_loopback(&router)?;
            let replay = Arc::new(Mutex::new(ReplayBuffer::default()));
            routers.push((router, Arc::clone(&replay)));
            workers.push(Worker {
                endpoints: WorkerEndpoints {
                    worker_id: cfg.worker_id_base + i as u64,
                    kv_events,
                    replay: replay_ep,
                },
                state: Mutex::new(WorkerState {
                    publisher,
                    subscribed: false,
                    next_seq: 0,
                    cache: Lru::new(),
                    scratch_local: Vec::new(),
                    scratch_seq: Vec::new(),
                    scratch_slots: Vec::new(),
                    scratch_removed: Vec::new(),
                }),
                replay,
            });
        }
        let stop = Arc::new(AtomicBool::new(false));
        let topic = cfg.topic.clone().into_bytes();
        let thread_stop = Arc::clone(&stop);
        let thread_topic = topic.clone();
        let replay_thread = std::thread::Builder::new()
            .name("mock-replay".into())
            .spawn(move || replay_loop(routers, thread_topic, thread_stop))
            .map_err(|e| MockerError::BadEndpoint(format!("replay thread: {e}")))?;
        Ok(Self {
            cfg,
            topic,
            workers,
            stop,
            replay_thread: Some(replay_thread),
            published: PublishedCounters::default(),
            _contexts: contexts,
        })
    }

    pub fn config(&self) -> &MockerConfig {
        &self.cfg
    }

    /// Totals the fleet has published so far (see [`Published`]).
    pub fn published(&self) -> Published {
        let p = &self.published;
        Published {
            batches: p.batches.load(Ordering::Relaxed),
            stored_blocks: p.stored_blocks.load(Ordering::Relaxed),
            removed_blocks: p.removed_blocks.load(Ordering::Relaxed),
        }
    }

    /// How many workers have seen a subscription on their KV-event socket
    /// (a selector connected and subscribed). Does not wait.
    pub fn subscribed(&self) -> usize {
        self.workers
            .iter()
            .filter(|w| {
                let mut st = w.state.lock().unwrap_or_else(|p| p.into_inner());
                // XPUB hands each (un)subscription up as a message whose
                // first byte is 1 (subscribe) or 0 (unsubscribe).
                while let Ok(m) = st.publisher.recv_bytes(zmq::DONTWAIT) {
                    if m.first() == Some(&1) {
                        st.subscribed = true;
                    }
                }
                st.subscribed
            })
            .count()
    }

    /// Endpoints of every worker, in worker order.
    pub fn endpoints(&self) -> Vec<WorkerEndpoints> {
        self.workers.iter().map(|w| w.endpoints.clone()).collect()
    }

    fn worker(&self, worker_id: u64) -> Result<&Worker, MockerError> {
        worker_id
            .checked_sub(self.cfg.worker_id_base)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| self.workers.get(i))
            .ok_or(MockerError::UnknownWorker(worker_id))
    }

    /// Number of blocks currently cached by `worker_id`.
    pub fn cached_blocks(&self, worker_id: u64) -> Result<usize, MockerError> {
        let w = self.worker(worker_id)?;
        let st = w.state.lock().unwrap_or_else(|p| p.into_inner());
        Ok(st.cache.len())
    }

    /// Serves `tokens` on `worker_id` as vLLM would with prefix caching: the
    /// cached leading blocks are reused, LRU blocks are evicted to make room
    /// (one `BlockRemoved` each) and the remaining full blocks are stored (one
    /// `BlockStored` chained to the last hit block), all in one batch. Blocks
    /// beyond the cache capacity are not cached, as a prompt longer than the
    /// KV pool could not be either.
    pub fn serve(&self, worker_id: u64, tokens: &[u32]) -> Result<ServeOutcome, MockerError> {
        let w = self.worker(worker_id)?;
        let bs = self.cfg.block_size;
        let mut guard = w.state.lock().unwrap_or_else(|p| p.into_inner());
        let st = &mut *guard;

        st.scratch_local.clear();
        hash::local_block_hashes(
            tokens,
            bs,
            false,
            hash::PUBLIC_SEED,
            None,
            &mut st.scratch_local,
        );
        st.scratch_seq.clear();
        hash::sequence_hashes(&st.scratch_local, hash::PUBLIC_SEED, &mut st.scratch_seq);
        let n = st.scratch_seq.len().min(self.cfg.capacity_blocks);
        let seqs = &st.scratch_seq[..n];

        // Leading hits; the cache is prefix-closed, so the first miss ends them.
        st.scratch_slots.clear();
        for &h in seqs {
            match st.cache.slot(h) {
                Some(s) => st.scratch_slots.push(s),
                None => break,
            }
        }
        let hit = st.scratch_slots.len();
        // Hits become most recent (tail first) so eviction cannot take them.
        for &s in st.scratch_slots.iter().rev() {
            st.cache.touch(s);
        }
        let new = n - hit;
        st.scratch_removed.clear();
        while st.cache.len() + new > self.cfg.capacity_blocks {
            match st.cache.pop_lru() {
                Some(k) => st.scratch_removed.push(k),
                None => break,
            }
        }
        for &h in seqs[hit..].iter().rev() {
            st.cache.insert(h);
        }
        // Parents stay more recent than the children just stored.
        for &s in st.scratch_slots.iter().rev() {
            st.cache.touch(s);
        }

        let mut outcome = ServeOutcome {
            hit_blocks: hit,
            stored_blocks: new,
            removed_blocks: st.scratch_removed.len(),
            seq: None,
        };
        if new == 0 && st.scratch_removed.is_empty() {
            return Ok(outcome);
        }
        // vLLM emits one BlockRemoved per evicted block, in group 0.
        let mut events: Vec<KvEvent> = st
            .scratch_removed
            .iter()
            .map(|&h| {
                KvEvent::Removed(Removed {
                    block_hashes: vec![h],
                    medium: Tier::Device,
                    group: GROUP,
                })
            })
            .collect();
        if new > 0 {
            let b = bs as usize;
            events.push(KvEvent::Stored(Stored {
                block_hashes: seqs[hit..].to_vec(),
                parent_hash: hit.checked_sub(1).map(|i| seqs[i]),
                token_ids: tokens[hit * b..n * b].to_vec(),
                eagle: false,
                block_size: bs,
                medium: Tier::Device,
                lora_name: None,
                cache_salt: None,
                mm_hashes: None,
                group: GROUP,
            }));
        }
        let mut payload = Vec::new();
        encode_batch(&mut payload, now_ts(), &events, Some(0), EventForm::Map);
        drop(events);
        let seq = st.next_seq;
        st.next_seq += 1;
        // Like vLLM, a failed send still consumes the seq (a gap for the
        // subscriber, which replay then closes).
        let _ = st.publisher.send_multipart(
            [&self.topic[..], &seq.to_be_bytes()[..], &payload[..]],
            zmq::DONTWAIT,
        );
        self.remember(w, seq, payload);
        let p = &self.published;
        p.batches.fetch_add(1, Ordering::Relaxed);
        p.stored_blocks.fetch_add(new as u64, Ordering::Relaxed);
        p.removed_blocks
            .fetch_add(outcome.removed_blocks as u64, Ordering::Relaxed);
        outcome.seq = Some(seq);
        Ok(outcome)
    }

    /// Drops every cached block of `worker_id` and publishes `AllBlocksCleared`.
    pub fn clear(&self, worker_id: u64) -> Result<u64, MockerError> {
        let w = self.worker(worker_id)?;
        let mut st = w.state.lock().unwrap_or_else(|p| p.into_inner());
        st.cache.clear();
        let mut payload = Vec::new();
        encode_batch(
            &mut payload,
            now_ts(),
            &[KvEvent::Cleared],
            Some(0),
            EventForm::Map,
        );
        let seq = st.next_seq;
        st.next_seq += 1;
        let _ = st.publisher.send_multipart(
            [&self.topic[..], &seq.to_be_bytes()[..], &payload[..]],
            zmq::DONTWAIT,
        );
        drop(st);
        self.remember(w, seq, payload);
        self.published.batches.fetch_add(1, Ordering::Relaxed);
        Ok(seq)
    }

    fn remember(&self, w: &Worker, seq: u64, payload: Vec<u8>) {
        let mut rb = w.replay.lock().unwrap_or_else(|p| p.into_inner());
        rb.bytes += payload.len();
        rb.batches.push_back((seq, Arc::new(payload)));
        while rb.batches.len() > 1
            && (rb.batches.len() > self.cfg.replay_steps || rb.bytes > self.cfg.replay_bytes)
        {
            if let Some((_, old)) = rb.batches.pop_front() {
                rb.bytes -= old.len();
            }
        }
    }
}

impl Drop for Mocker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.replay_thread.take() {
            let _ = t.join();
        }
    }
}

/// Answers `["", start_seq]` requests on every worker's ROUTER with one
/// `["", topic, seq, payload]` reply per buffered batch with `seq >= start`
/// and the end marker `["", "", 0xFF*8, ""]` (vLLM >= PR #45177 framing).
fn replay_loop(
    routers: Vec<(zmq::Socket, Arc<Mutex<ReplayBuffer>>)>,
    topic: Vec<u8>,
    stop: Arc<AtomicBool>,
) {
    let end = END_MARKER_SEQ.to_be_bytes();
    while !stop.load(Ordering::Relaxed) {
        let mut items: Vec<zmq::PollItem<'_>> = routers
            .iter()
            .map(|(s, _)| s.as_poll_item(zmq::POLLIN))
            .collect();
        match zmq::poll(&mut items, 100) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(_) => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        }
        let ready: Vec<usize> = items
            .iter()
            .enumerate()
            .filter(|(_, it)| it.is_readable())
            .map(|(i, _)| i)
            .collect();
        drop(items);
        for i in ready {
            let (sock, buffer) = &routers[i];
            while let Ok(frames) = sock.recv_multipart(zmq::DONTWAIT) {
                // Exactly [identity, "", start_seq(8)], anything else ignored.
                let [ident, empty, start] = &frames[..] else {
                    continue;
                };
                let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) else {
                    continue;
                };
                if !empty.is_empty() {
                    continue;
                }
                let start = u64::from_be_bytes(start);
                let batches: Vec<(u64, Arc<Vec<u8>>)> = {
                    let rb = buffer.lock().unwrap_or_else(|p| p.into_inner());
                    rb.batches
                        .iter()
                        .filter(|(s, _)| *s >= start)
                        .cloned()
                        .collect()
                };
                for (seq, payload) in batches {
                    let _ = sock.send_multipart(
                        [
                            &ident[..],
                            &[][..],
                            &topic[..],
                            &seq.to_be_bytes()[..],
                            &payload[..],
                        ],
                        0,
                    );
                }
                let _ = sock.send_multipart([&ident[..], &[][..], &[][..], &end[..], &[][..]], 0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_least_recent_first() {
        let mut l = Lru::new();
        for k in 1..=3 {
            l.insert(k);
        }
        let s1 = l.slot(1).unwrap();
        l.touch(s1);
        assert_eq!(l.pop_lru(), Some(2));
        assert_eq!(l.pop_lru(), Some(3));
        assert_eq!(l.pop_lru(), Some(1));
        assert_eq!(l.pop_lru(), None);
        l.insert(9);
        assert_eq!(l.len(), 1);
    }
}
