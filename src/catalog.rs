//! The worker catalog (`selection-api.md` §3, §4.3–4.6): worker records,
//! lifecycle rules, partitions and readiness. It keeps the KV-event
//! subscriptions, the index and the active load in step with every change.
//!
//! Readers (every selection) take an `Arc<Snapshot>` under a momentary read
//! lock; writers serialise on `state` and publish a new snapshot when done, so
//! a slow catalog change (stopping a subscriber) never blocks a selection.

use crate::index::{Index, WorkerRank};
use crate::ingest::{validate_kv_endpoint, IngestHub, ListenerSpec, ListenerState, StreamHealth};
use crate::parse::{KvTransferEnforcement, WorkerFields};
use crate::reserve::Ledger;
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

pub const DEFAULT_MODEL: &str = "default";
pub const DEFAULT_ROUTING_GROUP: &str = "default";

/// One `(model_name, routing_group)`: its fixed block size and eagle setting,
/// and its KV index. Partitions are never deleted.
pub struct Partition {
    pub model_name: String,
    pub routing_group: String,
    pub block_size: u32,
    pub is_eagle: bool,
    pub index: Arc<Index>,
}

impl std::fmt::Debug for Partition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Partition")
            .field("model_name", &self.model_name)
            .field("routing_group", &self.routing_group)
            .field("block_size", &self.block_size)
            .field("is_eagle", &self.is_eagle)
            .finish_non_exhaustive()
    }
}

impl Partition {
    /// `model=<m> routing_group=<g>`, as error texts name a partition.
    pub fn display(&self) -> String {
        partition_display(&self.model_name, &self.routing_group)
    }
}

pub fn partition_display(model: &str, group: &str) -> String {
    format!("model={model} routing_group={group}")
}

/// A schedulable (worker, rank) as selection sees it.
#[derive(Debug, Clone)]
pub struct RankInfo {
    pub wr: WorkerRank,
    pub endpoint: Arc<str>,
    pub taints: Arc<[String]>,
    pub max_num_batched_tokens: Option<u64>,
    pub total_kv_blocks: Option<u64>,
    /// The health of the rank's KV-event stream (its overlap counts less
    /// while it is stale; `app/selection.rs`).
    pub stream: Option<StreamHealth>,
}

/// A partition with its schedulable ranks, sorted by (worker_id, dp_rank).
#[derive(Debug)]
pub struct PartitionView {
    pub partition: Arc<Partition>,
    pub ranks: Vec<RankInfo>,
}

impl PartitionView {
    pub fn worker_ranks(&self, worker_id: u64) -> &[RankInfo] {
        let start = self.ranks.partition_point(|r| r.wr.worker_id < worker_id);
        let end = self.ranks.partition_point(|r| r.wr.worker_id <= worker_id);
        &self.ranks[start..end]
    }

    pub fn rank(&self, wr: WorkerRank) -> Option<&RankInfo> {
        self.ranks
            .binary_search_by(|r| r.wr.cmp(&wr))
            .ok()
            .map(|i| &self.ranks[i])
    }
}

/// What readers see: every partition and how many workers are schedulable.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub partitions: BTreeMap<(String, String), Arc<PartitionView>>,
    pub schedulable_workers: usize,
}

impl Snapshot {
    pub fn partition(&self, model: &str, group: &str) -> Option<&Arc<PartitionView>> {
        // BTreeMap<(String, String)> cannot be queried by (&str, &str) without
        // allocating; partitions are few, so a scan beats two allocations.
        self.partitions
            .iter()
            .find(|((m, g), _)| m == model && g == group)
            .map(|(_, v)| v)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Lifecycle {
    Incomplete,
    Schedulable,
    Draining,
    Unschedulable,
}

/// A worker's catalog record, serialised in the reference's field order (§3.2).
#[derive(Debug, Clone, Serialize)]
pub struct WorkerRecord {
    pub worker_id: u64,
    pub model_name: String,
    pub routing_group: String,
    pub lifecycle: Lifecycle,
    pub endpoint: Option<String>,
    pub kv_events_endpoint: Option<String>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub kv_events_endpoints: BTreeMap<u32, String>,
    pub replay_endpoint: Option<String>,
    pub block_size: Option<u32>,
    pub data_parallel_start_rank: Option<u32>,
    pub data_parallel_size: Option<u32>,
    pub max_num_batched_tokens: Option<u64>,
    pub total_kv_blocks: Option<u64>,
    pub stable_routing_id: Option<String>,
    pub is_eagle: Option<bool>,
    pub taints: Vec<String>,
    pub topology_domains: BTreeMap<String, String>,
    pub kv_transfer_domain: Option<String>,
    pub kv_transfer_enforcement: Option<KvTransferEnforcement>,
    pub kv_transfer_preferred_weight: Option<f32>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_schedulable_reasons: Vec<String>,
    /// The KV-event stream of each rank as ingestion sees it now (filled by
    /// [`Catalog::list`]; absent for a worker without streams). kvselect's
    /// addition to the reference's record.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub kv_streams: Vec<KvStream>,
}

/// One rank's KV-event stream in a worker record. A `failed` stream (its
/// socket could not be opened; retried with backoff) leaves the worker
/// schedulable by load, but its KV overlap stays empty until the stream opens.
#[derive(Debug, Clone, Serialize)]
pub struct KvStream {
    pub dp_rank: u32,
    pub state: ListenerState,
    pub last_seq: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Seconds since the newest batch was applied (`null` before the first).
    pub last_applied_age_seconds: Option<f64>,
    /// Seconds from the newest applied batch's own `ts` to its application
    /// (engine clock to ours; `null` without a usable `ts`).
    pub engine_delay_seconds: Option<f64>,
    /// Batches received but not yet applied.
    pub queued_batches: u64,
    /// Sequence gaps seen, replays completed, and messages dropped as
    /// malformed on this stream since it started.
    pub gaps: u64,
    pub replays: u64,
    pub malformed: u64,
}

impl WorkerRecord {
    fn from_fields(f: WorkerFields) -> WorkerRecord {
        WorkerRecord {
            worker_id: f.worker_id,
            model_name: f.model_name.unwrap_or_else(|| DEFAULT_MODEL.to_string()),
            routing_group: f
                .routing_group
                .unwrap_or_else(|| DEFAULT_ROUTING_GROUP.to_string()),
            lifecycle: Lifecycle::Incomplete,
            endpoint: f.endpoint,
            kv_events_endpoint: f.kv_events_endpoint,
            kv_events_endpoints: f.kv_events_endpoints.unwrap_or_default(),
            replay_endpoint: f.replay_endpoint,
            block_size: f.block_size,
            data_parallel_start_rank: f.data_parallel_start_rank,
            data_parallel_size: f.data_parallel_size,
            max_num_batched_tokens: f.max_num_batched_tokens,
            total_kv_blocks: f.total_kv_blocks,
            stable_routing_id: f.stable_routing_id,
            is_eagle: f.is_eagle,
            taints: taint_set(f.taints.unwrap_or_default()),
            topology_domains: f.topology_domains.unwrap_or_default(),
            kv_transfer_domain: f.kv_transfer_domain,
            kv_transfer_enforcement: f.kv_transfer_enforcement,
            kv_transfer_preferred_weight: f.kv_transfer_preferred_weight,
            not_schedulable_reasons: Vec::new(),
            kv_streams: Vec::new(),
        }
    }

    /// PATCH semantics (§4.4): a present non-null field replaces the stored
    /// value; identity fields cannot change.
    fn patched(&self, p: WorkerFields) -> WorkerRecord {
        let mut r = self.clone();
        macro_rules! set {
            ($($f:ident),*) => { $( if p.$f.is_some() { r.$f = p.$f; } )* };
        }
        set!(
            endpoint,
            kv_events_endpoint,
            replay_endpoint,
            block_size,
            data_parallel_start_rank,
            data_parallel_size,
            max_num_batched_tokens,
            total_kv_blocks,
            stable_routing_id,
            is_eagle,
            kv_transfer_domain,
            kv_transfer_enforcement,
            kv_transfer_preferred_weight
        );
        if let Some(v) = p.kv_events_endpoints {
            r.kv_events_endpoints = v;
        }
        if let Some(v) = p.taints {
            r.taints = taint_set(v);
        }
        if let Some(v) = p.topology_domains {
            r.topology_domains = v;
        }
        r
    }

    fn ranks(&self) -> std::ops::Range<u32> {
        let start = self.data_parallel_start_rank.unwrap_or(0);
        let size = self.data_parallel_size.unwrap_or(1);
        start..start.saturating_add(size)
    }

    /// The KV-events endpoint of `rank` (§3.3 rule 5): the map wins when it is
    /// non-empty; the singular endpoint counts only for a single rank.
    fn kv_endpoint(&self, rank: u32) -> Option<&str> {
        let ep = if !self.kv_events_endpoints.is_empty() {
            self.kv_events_endpoints.get(&rank).map(String::as_str)
        } else if self.data_parallel_size.unwrap_or(1) == 1 {
            self.kv_events_endpoint.as_deref()
        } else {
            None
        };
        ep.filter(|e| !e.is_empty())
    }

    /// §3.3 rules 1–6, in order; every failing reason is listed. Rule 4
    /// applies only while the selection queue runs.
    fn metadata_reasons(&self, queueing: bool) -> Vec<String> {
        let mut reasons = Vec::new();
        if self.endpoint.as_deref().unwrap_or("").is_empty() {
            reasons.push("endpoint is required".to_string());
        }
        if self.block_size.unwrap_or(0) == 0 {
            reasons.push("block_size must be greater than 0".to_string());
        }
        if self.data_parallel_size == Some(0) {
            reasons.push("data_parallel_size must be greater than 0".to_string());
        }
        // Ranks are u32 and their range ends past the last one: a range
        // ending past u32::MAX would be cut short, leaving a schedulable
        // worker with fewer ranks than it declared (or none).
        let start = u64::from(self.data_parallel_start_rank.unwrap_or(0));
        let size = u64::from(self.data_parallel_size.unwrap_or(1));
        if start + size > u64::from(u32::MAX) {
            reasons.push(
                "data_parallel_start_rank + data_parallel_size must not exceed 4294967295"
                    .to_string(),
            );
        }
        if queueing && self.max_num_batched_tokens.is_none() {
            reasons
                .push("max_num_batched_tokens is required while queueing is enabled".to_string());
        }
        for r in self.ranks() {
            if self.kv_endpoint(r).is_none() {
                reasons.push(format!("kv_events endpoint is required for dp_rank {r}"));
            }
        }
        if self.replay_endpoint.is_some() && self.data_parallel_size.unwrap_or(1) > 1 {
            reasons.push("replay_endpoint is supported only for data_parallel_size 1".to_string());
        }
        reasons
    }
}

/// Catalog changes that reach other components.
struct State {
    workers: BTreeMap<u64, WorkerRecord>,
    partitions: BTreeMap<(String, String), Arc<Partition>>,
}

pub struct Catalog {
    state: Mutex<State>,
    snapshot: RwLock<Arc<Snapshot>>,
    hub: IngestHub,
    ledger: Arc<Ledger>,
    /// Accept `ipc://` KV-event and replay endpoints (`--allow-ipc-endpoints`).
    allow_ipc: bool,
    /// The selection queue runs (`DYN_ROUTER_QUEUE_THRESHOLD`): workers need
    /// `max_num_batched_tokens`.
    queueing: bool,
}

impl Catalog {
    pub fn new(hub: IngestHub, ledger: Arc<Ledger>, allow_ipc: bool, queueing: bool) -> Catalog {
        Catalog {
            state: Mutex::new(State {
                workers: BTreeMap::new(),
                partitions: BTreeMap::new(),
            }),
            snapshot: RwLock::new(Arc::new(Snapshot::default())),
            hub,
            ledger,
            allow_ipc,
            queueing,
        }
    }

    pub fn snapshot(&self) -> Arc<Snapshot> {
        Arc::clone(&self.snapshot.read())
    }

    pub fn hub(&self) -> &IngestHub {
        &self.hub
    }

    /// Every partition ever created, including those without workers.
    pub fn partitions(&self) -> Vec<Arc<Partition>> {
        self.state.lock().partitions.values().cloned().collect()
    }

    /// Creates (or returns) a partition with a given block size; used when
    /// recovering a peer's /dump before any worker registered.
    pub fn ensure_partition(
        &self,
        model: &str,
        group: &str,
        block_size: u32,
    ) -> Result<Arc<Partition>, String> {
        let mut st = self.state.lock();
        let key = (model.to_string(), group.to_string());
        if let Some(p) = st.partitions.get(&key) {
            if p.block_size != block_size {
                return Err(format!(
                    "block_size mismatch for {}: existing={} requested={block_size}",
                    p.display(),
                    p.block_size
                ));
            }
            return Ok(Arc::clone(p));
        }
        let p = Arc::new(Partition {
            model_name: key.0.clone(),
            routing_group: key.1.clone(),
            block_size,
            is_eagle: false,
            index: Arc::new(Index::new()),
        });
        st.partitions.insert(key, Arc::clone(&p));
        drop(st);
        self.publish();
        Ok(p)
    }

    /// All records, sorted by worker id, filtered by exact model / group.
    /// The workers in the reference's order: by model name, routing group,
    /// then worker id.
    pub fn list(&self, model: Option<&str>, group: Option<&str>) -> Vec<WorkerRecord> {
        let mut out: Vec<WorkerRecord> = self
            .state
            .lock()
            .workers
            .values()
            .filter(|w| model.is_none_or(|m| w.model_name == m))
            .filter(|w| group.is_none_or(|g| w.routing_group == g))
            .cloned()
            .collect();
        let mut streams: HashMap<u64, Vec<KvStream>> = HashMap::new();
        for l in self.hub.stats().listeners {
            streams.entry(l.worker_id).or_default().push(KvStream {
                dp_rank: l.dp_rank,
                state: l.state,
                last_seq: l.last_seq,
                error: l.error,
                last_applied_age_seconds: l.last_applied_age.map(|d| d.as_secs_f64()),
                engine_delay_seconds: l.engine_delay,
                queued_batches: l.queued,
                gaps: l.gaps,
                replays: l.replays,
                malformed: l.malformed,
            });
        }
        for w in &mut out {
            w.kv_streams = streams.remove(&w.worker_id).unwrap_or_default();
        }
        out.sort_by(|a, b| {
            (&a.model_name, &a.routing_group, a.worker_id).cmp(&(
                &b.model_name,
                &b.routing_group,
                b.worker_id,
            ))
        });
        out
    }

    /// POST /workers: replaces the whole record.
    pub fn upsert(&self, fields: WorkerFields) -> WorkerRecord {
        let record = WorkerRecord::from_fields(fields);
        let mut st = self.state.lock();
        let out = self.apply(&mut st, record);
        drop(st);
        self.publish();
        out
    }

    /// PATCH /workers/{id}; `None` when the worker is unknown.
    pub fn patch(&self, worker_id: u64, fields: WorkerFields) -> Option<WorkerRecord> {
        let mut st = self.state.lock();
        let record = st.workers.get(&worker_id)?.patched(fields);
        let out = self.apply(&mut st, record);
        drop(st);
        self.publish();
        Some(out)
    }

    /// DELETE /workers/{id}: the final record, `unschedulable`.
    pub fn delete(&self, worker_id: u64) -> Option<WorkerRecord> {
        let mut st = self.state.lock();
        let mut old = st.workers.remove(&worker_id)?;
        self.detach(&st, &old);
        drop(st);
        tracing::info!(
            worker_id,
            model_name = %old.model_name,
            routing_group = %old.routing_group,
            was = ?old.lifecycle,
            "worker left"
        );
        self.publish();
        old.lifecycle = Lifecycle::Unschedulable;
        old.not_schedulable_reasons.clear();
        Some(old)
    }

    /// Stops a worker's subscriptions and drops its KV state and bookings.
    fn detach(&self, st: &State, old: &WorkerRecord) {
        self.hub.remove_worker(old.worker_id);
        if old.lifecycle == Lifecycle::Schedulable {
            if let Some(p) = st
                .partitions
                .get(&(old.model_name.clone(), old.routing_group.clone()))
            {
                p.index.remove_worker(old.worker_id);
            }
        }
        self.ledger.drop_worker(old.worker_id);
    }

    fn apply(&self, st: &mut State, mut record: WorkerRecord) -> WorkerRecord {
        let id = record.worker_id;
        let key = (record.model_name.clone(), record.routing_group.clone());
        let mut reasons = record.metadata_reasons(self.queueing);
        if reasons.is_empty() {
            reasons.extend(self.reconcile(st, &record, &key));
        }
        record.lifecycle = if reasons.is_empty() {
            Lifecycle::Schedulable
        } else {
            Lifecycle::Incomplete
        };
        record.not_schedulable_reasons = reasons;

        let old = st.workers.remove(&id);
        log_change(old.as_ref(), &record);
        let same_place = old.as_ref().is_some_and(|o| {
            o.lifecycle == Lifecycle::Schedulable
                && o.model_name == record.model_name
                && o.routing_group == record.routing_group
        });
        if record.lifecycle != Lifecycle::Schedulable || !same_place {
            if let Some(old) = &old {
                self.detach(st, old);
            }
        }
        if record.lifecycle == Lifecycle::Schedulable {
            let partition = self.partition_for(st, &record, key);
            let wanted = listener_specs(&record, &partition);
            if same_place {
                self.resubscribe(old.as_ref().unwrap(), &partition, wanted);
            } else {
                self.hub.set_worker(id, wanted);
            }
        }
        st.workers.insert(id, record.clone());
        record
    }

    /// Keeps listeners whose endpoints did not change (with their KV state);
    /// clears the state of ranks whose listener changed or went away.
    fn resubscribe(
        &self,
        old: &WorkerRecord,
        partition: &Arc<Partition>,
        wanted: Vec<ListenerSpec>,
    ) {
        let before = listener_specs(old, partition);
        let unchanged: Vec<ListenerSpec> = wanted
            .iter()
            .filter(|w| before.iter().any(|b| same_listener(b, w)))
            .cloned()
            .collect();
        // Stop the changed listeners first, so none of their events lands
        // after the clear below.
        self.hub.set_worker(old.worker_id, unchanged.clone());
        for b in &before {
            if !unchanged.iter().any(|u| same_listener(b, u)) {
                let wr = WorkerRank {
                    worker_id: old.worker_id,
                    dp_rank: b.dp_rank,
                };
                partition.index.clear(wr);
                if !wanted.iter().any(|w| w.dp_rank == b.dp_rank) {
                    self.ledger.drop_rank(wr);
                }
            }
        }
        self.hub.set_worker(old.worker_id, wanted);
    }

    /// §3.3 rule 7: block size, eagle and endpoint syntax against the partition.
    fn reconcile(&self, st: &State, r: &WorkerRecord, key: &(String, String)) -> Vec<String> {
        let mut reasons = Vec::new();
        let display = partition_display(&key.0, &key.1);
        if let Some(p) = st.partitions.get(key) {
            let bs = r.block_size.unwrap_or(0);
            if p.block_size != bs {
                reasons.push(format!(
                    "reconciliation failed: block_size mismatch for {display}: existing={} requested={bs}",
                    p.block_size
                ));
            }
            let eagle = r.is_eagle.unwrap_or(false);
            if p.is_eagle != eagle && partition_has_other_workers(st, key, r.worker_id) {
                reasons.push(format!(
                    "reconciliation failed: is_eagle mismatch for {display}: existing={} requested={eagle}",
                    p.is_eagle
                ));
            }
        }
        for rank in r.ranks() {
            if let Some(ep) = r.kv_endpoint(rank) {
                if let Err(e) = validate_kv_endpoint(ep, self.allow_ipc) {
                    reasons.push(format!(
                        "reconciliation failed: invalid kv_events endpoint for worker {} dp_rank {rank}: {e}",
                        r.worker_id
                    ));
                }
            }
        }
        if let Some(ep) = r.replay_endpoint.as_deref().filter(|e| !e.is_empty()) {
            if let Err(e) = validate_kv_endpoint(ep, self.allow_ipc) {
                reasons.push(format!(
                    "reconciliation failed: invalid replay endpoint for worker {}: {e}",
                    r.worker_id
                ));
            }
        }
        reasons
    }

    fn partition_for(
        &self,
        st: &mut State,
        r: &WorkerRecord,
        key: (String, String),
    ) -> Arc<Partition> {
        let eagle = r.is_eagle.unwrap_or(false);
        let existing = st.partitions.get(&key).cloned();
        match existing {
            // A partition recovered from a peer's dump has no worker yet; the
            // first worker fixes its eagle setting.
            Some(p)
                if p.is_eagle != eagle && !partition_has_other_workers(st, &key, r.worker_id) =>
            {
                let p = Arc::new(Partition {
                    model_name: p.model_name.clone(),
                    routing_group: p.routing_group.clone(),
                    block_size: p.block_size,
                    is_eagle: eagle,
                    index: Arc::clone(&p.index),
                });
                st.partitions.insert(key, Arc::clone(&p));
                p
            }
            Some(p) => p,
            None => {
                let p = Arc::new(Partition {
                    model_name: key.0.clone(),
                    routing_group: key.1.clone(),
                    block_size: r.block_size.unwrap_or(0),
                    is_eagle: eagle,
                    index: Arc::new(Index::new()),
                });
                st.partitions.insert(key, Arc::clone(&p));
                p
            }
        }
    }

    /// Rebuilds the readers' snapshot from the state.
    fn publish(&self) {
        let st = self.state.lock();
        let mut ranks: HashMap<(String, String), Vec<RankInfo>> = HashMap::new();
        let mut schedulable = 0;
        for w in st.workers.values() {
            if w.lifecycle != Lifecycle::Schedulable {
                continue;
            }
            schedulable += 1;
            let endpoint: Arc<str> = Arc::from(w.endpoint.as_deref().unwrap_or(""));
            let taints: Arc<[String]> = Arc::from(w.taints.as_slice());
            let list = ranks
                .entry((w.model_name.clone(), w.routing_group.clone()))
                .or_default();
            let health = self.hub.health(w.worker_id);
            for dp_rank in w.ranks() {
                let stream = health
                    .iter()
                    .find(|(r, _)| *r == dp_rank)
                    .map(|(_, h)| h.clone());
                list.push(RankInfo {
                    wr: WorkerRank {
                        worker_id: w.worker_id,
                        dp_rank,
                    },
                    endpoint: Arc::clone(&endpoint),
                    taints: Arc::clone(&taints),
                    max_num_batched_tokens: w.max_num_batched_tokens,
                    total_kv_blocks: w.total_kv_blocks,
                    stream,
                });
            }
        }
        let partitions = st
            .partitions
            .iter()
            .map(|(key, p)| {
                let mut list = ranks.remove(key).unwrap_or_default();
                list.sort_by_key(|r| r.wr);
                (
                    key.clone(),
                    Arc::new(PartitionView {
                        partition: Arc::clone(p),
                        ranks: list,
                    }),
                )
            })
            .collect();
        let snap = Arc::new(Snapshot {
            partitions,
            schedulable_workers: schedulable,
        });
        *self.snapshot.write() = snap;
    }
}

fn partition_has_other_workers(st: &State, key: &(String, String), worker_id: u64) -> bool {
    st.workers.values().any(|w| {
        w.worker_id != worker_id
            && w.lifecycle == Lifecycle::Schedulable
            && w.model_name == key.0
            && w.routing_group == key.1
    })
}

fn listener_specs(r: &WorkerRecord, p: &Arc<Partition>) -> Vec<ListenerSpec> {
    r.ranks()
        .filter_map(|rank| {
            Some(ListenerSpec {
                dp_rank: rank,
                endpoint: r.kv_endpoint(rank)?.to_string(),
                replay_endpoint: r.replay_endpoint.clone().filter(|e| !e.is_empty()),
                index: Arc::clone(&p.index),
                block_size: p.block_size,
            })
        })
        .collect()
}

fn same_listener(a: &ListenerSpec, b: &ListenerSpec) -> bool {
    a.dp_rank == b.dp_rank
        && a.endpoint == b.endpoint
        && a.replay_endpoint == b.replay_endpoint
        && a.block_size == b.block_size
        && Arc::ptr_eq(&a.index, &b.index)
}

/// Taints are a set, as the reference keeps them: duplicates go. The
/// reference's set has no stable order; kvselect's is sorted.
fn taint_set(mut taints: Vec<String>) -> Vec<String> {
    taints.sort_unstable();
    taints.dedup();
    taints
}

/// Logs a worker joining, or its lifecycle or partition changing.
fn log_change(old: Option<&WorkerRecord>, new: &WorkerRecord) {
    let reasons = || new.not_schedulable_reasons.join("; ");
    match old {
        None => tracing::info!(
            worker_id = new.worker_id,
            model_name = %new.model_name,
            routing_group = %new.routing_group,
            lifecycle = ?new.lifecycle,
            reasons = %reasons(),
            "worker joined"
        ),
        Some(o)
            if o.lifecycle != new.lifecycle
                || o.model_name != new.model_name
                || o.routing_group != new.routing_group =>
        {
            tracing::info!(
                worker_id = new.worker_id,
                model_name = %new.model_name,
                routing_group = %new.routing_group,
                from = ?o.lifecycle,
                to = ?new.lifecycle,
                reasons = %reasons(),
                "worker state changed"
            )
        }
        Some(_) => tracing::debug!(worker_id = new.worker_id, "worker updated"),
    }
}
