//! /select and /select_and_reserve (§4.8, §4.9): filter the candidates, walk
//! the index once, read the loads, cost every candidate (`select`), choose,
//! then remember the choice (a pending selection) or book it.

use super::admission;
use super::prompt::{random_identities, Normalized, Target};
use super::{App, ServiceError};
use crate::catalog::{PartitionView, RankInfo};
use crate::config::{RouterConfig, DEFAULT_PREFILL_TOKEN_CAPACITY};
use crate::index::{Overlap, WorkerRank};
use crate::ingest::Stale;
use crate::mesh::BookMeta;
use crate::parse::{SelectKind, SelectRequest};
use crate::pool::Pooled;
use crate::reserve::{Booking, PendingKey, PendingSelection, RankLoad};
use crate::select::{self, CandidateLoad, CostContext};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

/// The reply of /select and /select_and_reserve. `sequence_hashes` is not
/// serialised with the rest: the HTTP layer appends it with the fast array
/// writer (it is the largest field by far), the Python binding adds it as a
/// list.
#[derive(Debug, Serialize)]
pub struct Selection {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub selection_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub isl_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub track_prefill_tokens: Option<bool>,
    pub model_name: String,
    pub routing_group: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub endpoint: String,
    pub block_size: u32,
    pub overlap: OverlapOut,
    pub effective_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_load: Option<WorkerLoad>,
    /// The booked identities of the prompt's full blocks (reserving routes
    /// only): u64 in memory, i64 on the wire.
    #[serde(skip)]
    pub sequence_hashes: Option<Pooled<u64>>,
    /// How far behind its events the index was (the freshness gate,
    /// `freshness.rs`): sent as headers, not in the body.
    #[serde(skip)]
    pub index: super::freshness::Answered,
    /// Why the chosen rank's KV stream is stale, if it is (its overlap
    /// counted half): sent as a header.
    #[serde(skip)]
    pub worker_stale: Option<Stale>,
}

/// Matched prefix lengths in tokens, per tier and per DP rank of the chosen
/// worker.
#[derive(Debug, Serialize)]
pub struct OverlapOut {
    pub longest_matched: u64,
    pub gpu: u64,
    /// Keyed by the rank written as a string, as JSON has it (and as
    /// Dynamo's embedded selector returns it).
    #[serde(serialize_with = "rank_keys_as_strings")]
    pub dp: BTreeMap<u32, u64>,
    pub cpu: u64,
    pub disk: u64,
}

fn rank_keys_as_strings<S: serde::Serializer>(
    dp: &BTreeMap<u32, u64>,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_map(dp.iter().map(|(k, v)| (k.to_string(), v)))
}

/// The chosen rank's load, for `advisory` selects.
#[derive(Debug, Serialize)]
pub struct WorkerLoad {
    pub active_prefill_tokens: u64,
    pub prefill_token_capacity: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_kv_blocks: Option<u64>,
}

struct Choice {
    wr: WorkerRank,
    /// The session's binding, when the request's constraints left it out.
    excluded_binding: Option<WorkerRank>,
    rank: RankInfo,
    /// Why the chosen rank's stream is stale, if it is.
    stale: Option<Stale>,
    load: CandidateLoad,
    effective_prefill_tokens: u64,
    /// Every rank's overlap, sorted by rank.
    hits: Vec<(WorkerRank, Overlap)>,
}

impl App {
    /// A selection without the queue: busy workers are chosen like any other.
    pub fn select(
        &self,
        req: &SelectRequest<'_>,
        kind: SelectKind,
    ) -> Result<Selection, ServiceError> {
        self.select_once(req, kind, false)
    }

    /// A selection through the queue, when `DYN_ROUTER_QUEUE_THRESHOLD` runs
    /// one: waits (without blocking the thread) while every candidate is
    /// busy, up to `--router-queue-max-wait-secs`. Dropping the future leaves
    /// the queue.
    pub async fn select_queued(
        &self,
        req: &SelectRequest<'_>,
        kind: SelectKind,
    ) -> Result<Selection, ServiceError> {
        let index = self.await_fresh_index(req).await?;
        let mut sel = self.select_queued_inner(req, kind).await?;
        sel.index = index;
        Ok(sel)
    }

    async fn select_queued_inner(
        &self,
        req: &SelectRequest<'_>,
        kind: SelectKind,
    ) -> Result<Selection, ServiceError> {
        let Some(q) = self.queue_for(req) else {
            return self.select(req, kind);
        };
        let (model, group) = partition_of(req);
        let deadline = tokio::time::Instant::now() + q.limits.max_wait;
        let mut ticket = None;
        loop {
            let notified = q.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(r) = self.admit_step(q, req, kind, model, group, &mut ticket) {
                return r;
            }
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep(admission::RECHECK) => {}
                _ = tokio::time::sleep_until(deadline) => {
                    q.timed_out();
                    return Err(waited_too_long(q));
                }
            }
        }
    }

    /// As [`App::select_queued`], blocking the calling thread while it waits
    /// (for callers with a thread of their own, such as the Python binding).
    /// `wanted` is asked at each wake-up; once it says no, the request leaves
    /// the queue unbooked (`None`).
    pub fn select_blocking(
        &self,
        req: &SelectRequest<'_>,
        kind: SelectKind,
        wanted: impl Fn() -> bool,
    ) -> Option<Result<Selection, ServiceError>> {
        let index = match self.await_fresh_index_blocking(req) {
            Ok(a) => a,
            Err(e) => return Some(Err(e)),
        };
        if !wanted() {
            return None;
        }
        let r = self.select_blocking_inner(req, kind, wanted)?;
        Some(r.map(|mut sel| {
            sel.index = index;
            sel
        }))
    }

    fn select_blocking_inner(
        &self,
        req: &SelectRequest<'_>,
        kind: SelectKind,
        wanted: impl Fn() -> bool,
    ) -> Option<Result<Selection, ServiceError>> {
        let Some(q) = self.queue_for(req) else {
            return Some(self.select(req, kind));
        };
        let (model, group) = partition_of(req);
        let deadline = Instant::now() + q.limits.max_wait;
        let mut ticket = None;
        loop {
            let seen = q.generation();
            if let Some(r) = self.admit_step(q, req, kind, model, group, &mut ticket) {
                return Some(r);
            }
            let now = Instant::now();
            if now >= deadline {
                q.timed_out();
                return Some(Err(waited_too_long(q)));
            }
            q.wait_blocking(seen, admission::RECHECK.min(deadline - now));
            if !wanted() {
                return None;
            }
        }
    }

    /// The answer when it needs no wait: `None` when the request would
    /// queue (every candidate busy, or others already waiting).
    pub fn select_if_admitted(
        &self,
        req: &SelectRequest<'_>,
        kind: SelectKind,
    ) -> Option<Result<Selection, ServiceError>> {
        let index = self.fresh_index_now(req)?;
        let r = match self.queue_for(req) {
            None => self.select(req, kind),
            Some(q) => {
                let (model, group) = partition_of(req);
                if q.has_waiting(model, group) {
                    return None;
                }
                match self.select_once(req, kind, true) {
                    Err(ServiceError::Busy(_)) => return None,
                    r => r,
                }
            }
        };
        Some(r.map(|mut sel| {
            sel.index = index;
            sel
        }))
    }

    /// The queue, if this request goes through one (advisory selects never
    /// wait).
    fn queue_for(&self, req: &SelectRequest<'_>) -> Option<&admission::Queue> {
        self.queue.as_deref().filter(|_| req.advisory != Some(true))
    }

    /// One look at the queue: the answer once the request is first in line
    /// (or the line is empty) and a candidate has room; otherwise it joins
    /// the line (or is refused when the line is full) and `None` says wait.
    fn admit_step<'q>(
        &self,
        q: &'q admission::Queue,
        req: &SelectRequest<'_>,
        kind: SelectKind,
        model: &str,
        group: &str,
        ticket: &mut Option<admission::Ticket<'q>>,
    ) -> Option<Result<Selection, ServiceError>> {
        let my_turn = match ticket {
            None => !q.has_waiting(model, group),
            Some(t) => t.is_first(),
        };
        if my_turn {
            match self.select_once(req, kind, true) {
                Err(ServiceError::Busy(_)) => {}
                r => {
                    if let Some(t) = ticket.take() {
                        t.admitted();
                    }
                    return Some(r);
                }
            }
        }
        if ticket.is_none() {
            let isl = prompt_tokens(req);
            match q.enqueue(
                model,
                group,
                req.strict_priority.unwrap_or(0),
                req.priority_jump.unwrap_or(0.0),
                isl,
            ) {
                Ok(t) => *ticket = Some(t),
                Err(_) => {
                    return Some(Err(ServiceError::Busy(format!(
                        "every worker is busy and the selection queue is full ({} waiting)",
                        q.limits.max_len
                    ))))
                }
            }
        }
        None
    }

    fn select_once(
        &self,
        req: &SelectRequest<'_>,
        kind: SelectKind,
        check_busy: bool,
    ) -> Result<Selection, ServiceError> {
        let Target {
            model,
            group,
            view,
            cfg,
        } = self.target(
            req.model_name.as_ref(),
            req.routing_group.as_ref(),
            req.router_config_override.as_ref(),
        )?;
        check_free_id(self, req, kind)?;
        let prompt = self.normalize(&req.prompt, &view, &cfg, true)?;
        let choice = self.choose(req, &model, &group, &view, &cfg, &prompt, check_busy)?;
        let bs = view.partition.block_size;

        let mut identities = prompt.identities;
        let prompt_blocks = identities.len();
        let reserved = kind == SelectKind::SelectAndReserve;
        if let (true, Some(b), None, Some(session)) = (
            reserved,
            choice.excluded_binding,
            req.pinned_worker,
            session_of(req),
        ) {
            return Err(self.refuse_bound_elsewhere(&model, &group, session, b, choice.wr));
        }
        let selection_id: Option<String> = match req.selection_id.as_deref() {
            Some(id) => Some(id.to_string()),
            None if reserved => Some(uuid::Uuid::new_v4().to_string()),
            None => None,
        };
        let track = cfg.track_prefill_tokens;
        if cfg.track_output_blocks {
            if let Some(eot) = req.expected_output_tokens {
                // Reserve the expected output as synthetic decode blocks.
                let n = (eot as u64).div_ceil(bs as u64) as usize;
                random_identities(n, &mut identities);
            }
        }
        if reserved {
            let id = selection_id.as_deref().unwrap_or_default();
            self.book(
                Booking {
                    selection_id: id,
                    wr: choice.wr,
                    identities: &identities,
                    form: prompt.form,
                    prefill_tokens: if track {
                        choice.effective_prefill_tokens
                    } else {
                        0
                    },
                    now: Instant::now(),
                },
                &BookMeta {
                    model_name: &model,
                    routing_group: &group,
                    block_size: bs,
                    lora_name: req.prompt.lora_name.as_deref(),
                    track_prefill_tokens: track,
                    effective_prefill_tokens: choice.effective_prefill_tokens,
                    expected_output_tokens: req.expected_output_tokens,
                },
            )
            .map_err(|e| super::reservations::reserve_error(e, id))?;
            // A pinned or targeted booking binds nothing, as in Dynamo
            // (observed: no binding message for a pinned booking with a
            // session id; a later select of a session booked with an
            // `affinity_target` goes by cost).
            if let (Some(session), None, None) =
                (session_of(req), req.pinned_worker, req.affinity_target)
            {
                self.bind_session(&model, &group, session, choice.wr);
            }
        } else if let Some(id) = &selection_id {
            self.pending.insert(
                PendingKey {
                    model_name: model.clone(),
                    routing_group: group.clone(),
                    selection_id: id.clone(),
                },
                PendingSelection {
                    wr: choice.wr,
                    identities: identities.to_vec(),
                    identity_form: prompt.form,
                    isl_tokens: prompt.isl_tokens,
                    effective_prefill_tokens: choice.effective_prefill_tokens,
                    expected_output_tokens: req.expected_output_tokens,
                    track_prefill_tokens: track,
                    lora_name: req.prompt.lora_name.as_deref().map(str::to_string),
                    // Its replay binds the session, as a booking would (a
                    // pinned or targeted one binds nothing).
                    session_id: match (&self.affinity, req.pinned_worker, req.affinity_target) {
                        (Some(_), None, None) => session_of(req).map(str::to_string),
                        _ => None,
                    },
                },
                Instant::now(),
            );
        }

        let ranks = view.worker_ranks(choice.wr.worker_id);
        let overlap = overlap_of_worker(ranks, &choice.hits, bs);
        let partial = prompt
            .isl_tokens
            .div_ceil(bs as u64)
            .saturating_sub(prompt_blocks as u64);
        let potential_decode_blocks =
            choice.load.active_decode_blocks + choice.load.new_blocks + partial;
        let worker_load = (req.advisory == Some(true)).then(|| WorkerLoad {
            active_prefill_tokens: choice.load.active_prefill_tokens,
            prefill_token_capacity: choice
                .rank
                .max_num_batched_tokens
                .unwrap_or(DEFAULT_PREFILL_TOKEN_CAPACITY),
            total_kv_blocks: choice.rank.total_kv_blocks,
        });
        let sequence_hashes = reserved.then(|| {
            identities.truncate(prompt_blocks);
            identities
        });
        Ok(Selection {
            selection_id,
            isl_tokens: reserved.then_some(prompt.isl_tokens),
            track_prefill_tokens: reserved.then_some(track),
            model_name: model,
            routing_group: group,
            worker_id: choice.wr.worker_id,
            dp_rank: choice.wr.dp_rank,
            endpoint: choice.rank.endpoint.to_string(),
            block_size: bs,
            overlap,
            effective_prefill_tokens: choice.effective_prefill_tokens,
            potential_decode_blocks,
            worker_load,
            sequence_hashes,
            index: Default::default(),
            worker_stale: choice.stale,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn choose(
        &self,
        req: &SelectRequest<'_>,
        model: &str,
        group: &str,
        view: &PartitionView,
        cfg: &RouterConfig,
        prompt: &Normalized,
        check_busy: bool,
    ) -> Result<Choice, ServiceError> {
        check_pinned(req, view)?;
        let constraints = req.routing_constraints.as_ref();
        // Does the request's own choice of workers admit this rank?
        let admitted = |r: &RankInfo| {
            req.allowed_worker_ids
                .as_ref()
                .is_none_or(|ids| ids.contains(&r.wr.worker_id))
                && req
                    .pinned_worker
                    .is_none_or(|p| p.worker_id == r.wr.worker_id && p.dp_rank == r.wr.dp_rank)
                && constraints.is_none_or(|c| {
                    c.required_taints
                        .iter()
                        .all(|t| r.taints.iter().any(|have| have == t.as_ref()))
                })
        };
        let mut candidates: Vec<&RankInfo> = view.ranks.iter().filter(|r| admitted(r)).collect();
        if candidates.is_empty() {
            return Err(ServiceError::NoCandidates);
        }
        // The queue's test (admission.rs): busy when the active prefill
        // exceeds threshold x max_num_batched_tokens; all busy, wait. An
        // admitted request goes to a candidate with room.
        if let (true, Some(t)) = (check_busy, cfg.queue_threshold) {
            candidates.retain(|r| {
                let cap = r.max_num_batched_tokens.unwrap_or(u64::MAX) as f64;
                self.ledger.rank_load(r.wr).prefill_tokens as f64 <= t * cap
            });
            if candidates.is_empty() {
                return Err(ServiceError::Busy(
                    "every candidate worker is busy".to_string(),
                ));
            }
        }
        // Steering (§7.6): an `affinity_target` goes first, else a bound
        // session goes to its target, while that target is a candidate;
        // otherwise the cost decides. With an `affinity_target` the
        // session's binding is not looked at (measured on the reference: a
        // session bound to worker 1 follows `affinity_target` 2, and one to
        // an unknown worker, by cost).
        let bound = match req.affinity_target {
            Some(_) => None,
            None => self
                .affinity
                .as_ref()
                .and_then(|a| a.lookup(model, group, session_of(req)?, Instant::now())),
        };
        // A binding the request's own constraints leave out (the target is
        // schedulable, but not admitted) makes a booking fail; one to a
        // worker that left, or that is busy, is simply not followed.
        let excluded = bound.filter(|b| view.ranks.iter().any(|r| r.wr == *b && !admitted(r)));
        let target = req
            .affinity_target
            .map(|t| (t.worker_id, t.dp_rank))
            .or(bound.map(|wr| (wr.worker_id, Some(wr.dp_rank))));
        if let Some((worker_id, dp_rank)) = target {
            let steered: Vec<&RankInfo> = candidates
                .iter()
                .copied()
                .filter(|r| is_target(r, worker_id, dp_rank))
                .collect();
            if !steered.is_empty() {
                candidates = steered;
            }
        }
        let mut hits = Vec::new();
        view.partition.index.overlap(&prompt.seq_keys, &mut hits);
        hits.sort_unstable_by_key(|(wr, _)| *wr);
        let wrs: Vec<WorkerRank> = candidates.iter().map(|r| r.wr).collect();
        let mut loads = Vec::with_capacity(wrs.len());
        self.ledger.loads(&wrs, &mut loads);
        let mut new_blocks = Vec::with_capacity(wrs.len());
        self.ledger
            .new_blocks(&wrs, &prompt.identities, prompt.form, &mut new_blocks);
        // A rank whose stream is stale (replaying a gap, not connected, or
        // silent while it has bookings) may be missing blocks or holding
        // evicted ones: its overlap counts half (issue #17 item 4).
        let now = Instant::now();
        let stale: Vec<Option<Stale>> = candidates
            .iter()
            .zip(&loads)
            .map(|(r, l)| {
                r.stream
                    .as_ref()
                    .and_then(|h| h.staleness(now, l.active_requests))
            })
            .collect();
        let cands: Vec<CandidateLoad> = wrs
            .iter()
            .zip(loads.iter().zip(&new_blocks))
            .zip(&stale)
            .map(
                |((wr, (l, &nb)), st): ((&WorkerRank, (&RankLoad, &u64)), &Option<Stale>)| {
                    let mut overlap = overlap_in(&hits, *wr);
                    if st.is_some() && overlap != Overlap::default() {
                        overlap = discounted(overlap);
                        self.gate.discounted.fetch_add(1, Relaxed);
                    }
                    CandidateLoad {
                        overlap,
                        active_prefill_tokens: l.prefill_tokens,
                        active_decode_blocks: l.decode_blocks,
                        active_requests: l.active_requests,
                        new_blocks: nb,
                    }
                },
            )
            .collect();
        let ctx = CostContext {
            isl_tokens: prompt.isl_tokens,
            block_size: view.partition.block_size,
            track_prefill_tokens: cfg.track_prefill_tokens,
            min_active_prefill_tokens: cands
                .iter()
                .map(|c| c.active_prefill_tokens)
                .min()
                .unwrap_or(0),
        };
        let preferred = constraints
            .map(|c| &c.preferred_taints[..])
            .unwrap_or_default();
        let costs: Vec<f64> = cands
            .iter()
            .zip(&candidates)
            .map(|(c, r)| {
                let cost = select::cost(c, cfg, &ctx);
                if preferred.is_empty() {
                    cost
                } else {
                    cost * select::preferred_taint_factor(preferred, &r.taints)
                }
            })
            .collect();
        let i = select::choose(&costs, cfg.router_temperature, &mut rand::rng());
        let load = cands[i];
        Ok(Choice {
            wr: wrs[i],
            rank: candidates[i].clone(),
            stale: stale[i],
            load,
            effective_prefill_tokens: select::effective_prefill_tokens(&load.overlap, cfg, &ctx),
            hits,
            excluded_binding: excluded,
        })
    }
}

/// The request's partition, defaults applied.
fn partition_of<'r>(req: &'r SelectRequest<'_>) -> (&'r str, &'r str) {
    (
        req.model_name
            .as_deref()
            .unwrap_or(crate::catalog::DEFAULT_MODEL),
        req.routing_group
            .as_deref()
            .unwrap_or(crate::catalog::DEFAULT_ROUTING_GROUP),
    )
}

/// The prompt's length in tokens, for `/loads`' `pending_isl_tokens`.
fn prompt_tokens(req: &SelectRequest<'_>) -> u64 {
    let p = &req.prompt;
    p.mm_routing_info
        .as_ref()
        .and_then(|m| m.routing_token_ids.as_ref())
        .filter(|t| !t.is_empty())
        .or(p.token_ids.as_ref())
        .map(|t| t.len() as u64)
        .or(p.isl_tokens)
        .unwrap_or(0)
}

fn waited_too_long(q: &admission::Queue) -> ServiceError {
    ServiceError::Busy(format!(
        "every worker stayed busy for {} s (the selection queue's wait bound)",
        q.limits.max_wait.as_secs_f64()
    ))
}

/// The request's session: `session_context.session_id` wins over `session_id`.
fn session_of<'r>(req: &'r SelectRequest<'_>) -> Option<&'r str> {
    req.session_context
        .as_ref()
        .map(|c| c.session_id.as_ref())
        .or(req.session_id.as_deref())
}

/// The chosen worker's matched prefix over all its ranks, in tokens: the
/// longest per tier, and the device match of every rank.
fn overlap_of_worker(ranks: &[RankInfo], hits: &[(WorkerRank, Overlap)], bs: u32) -> OverlapOut {
    let tokens = |blocks: u32| blocks as u64 * bs as u64;
    let (mut gpu, mut cpu, mut disk) = (0, 0, 0);
    let mut dp = BTreeMap::new();
    for r in ranks {
        let o = overlap_in(hits, r.wr);
        gpu = gpu.max(tokens(o.device));
        cpu = cpu.max(tokens(o.device + o.host_ext));
        disk = disk.max(tokens(o.device + o.host_ext + o.disk_ext));
        dp.insert(r.wr.dp_rank, tokens(o.device));
    }
    OverlapOut {
        longest_matched: gpu.max(cpu).max(disk),
        gpu,
        dp,
        cpu,
        disk,
    }
}

/// A stale stream's overlap: half of each tier's blocks.
fn discounted(o: Overlap) -> Overlap {
    Overlap {
        device: o.device / 2,
        host_ext: o.host_ext / 2,
        disk_ext: o.disk_ext / 2,
    }
}

/// The overlap of `wr` in hits sorted by rank (zero when it matched nothing).
pub(super) fn overlap_in(hits: &[(WorkerRank, Overlap)], wr: WorkerRank) -> Overlap {
    hits.binary_search_by_key(&wr, |(w, _)| *w)
        .map(|i| hits[i].1)
        .unwrap_or_default()
}

/// The check the reference makes once it found the partition, before the
/// prompt's and the targets' (so 409 comes before their 400s and before 503
/// `no endpoints available to route work`): a booking's id must be free
/// (booking checks again, for a race).
fn check_free_id(app: &App, req: &SelectRequest<'_>, kind: SelectKind) -> Result<(), ServiceError> {
    if let (SelectKind::SelectAndReserve, Some(id)) = (kind, req.selection_id.as_deref()) {
        if app.ledger.is_booked(id) {
            return Err(super::reservations::reserve_error(
                crate::reserve::ReserveError::Duplicate,
                id,
            ));
        }
    }
    Ok(())
}

/// A pinned worker must be in the request's allowed set (400 otherwise),
/// which is, as the reference builds it, the `affinity_target`'s worker when
/// that target is a rank of the partition within `allowed_worker_ids`, else
/// `allowed_worker_ids` (when given, even empty).
fn check_pinned(req: &SelectRequest<'_>, view: &PartitionView) -> Result<(), ServiceError> {
    let Some(p) = req.pinned_worker else {
        return Ok(());
    };
    let allowed = |id: u64| {
        req.allowed_worker_ids
            .as_ref()
            .is_none_or(|ids| ids.contains(&id))
    };
    let target = req.affinity_target.filter(|t| {
        allowed(t.worker_id)
            && view
                .ranks
                .iter()
                .any(|r| is_target(r, t.worker_id, t.dp_rank))
    });
    let in_set = match target {
        Some(t) => t.worker_id == p.worker_id,
        None => allowed(p.worker_id),
    };
    if in_set {
        Ok(())
    } else {
        Err(ServiceError::Refused(format!(
            "pinned worker {} is not in allowed worker set",
            p.worker_id
        )))
    }
}

/// Is `r` the steering target (a worker, and its rank when given)?
fn is_target(r: &RankInfo, worker_id: u64, dp_rank: Option<u32>) -> bool {
    r.wr.worker_id == worker_id && dp_rank.is_none_or(|d| d == r.wr.dp_rank)
}
