//! The selection service's behaviour, one method per route, independent of
//! HTTP: typed request views in, JSON bytes or an [`AppError`] out.
//!
//! The request path is parse -> normalise the prompt (hash once) -> resolve
//! the partition and candidates -> one index walk -> loads -> cost -> choice
//! -> (book) -> respond. The public sequence-hash chain of the prompt serves
//! both as the index lookup keys and, in the default tracking mode, as the
//! booking identities, so a token prompt is hashed exactly once.

use crate::catalog::{partition_display, Catalog, PartitionView, RankInfo, Snapshot};
use crate::config::{Config, RouterConfig, DEFAULT_PREFILL_TOKEN_CAPACITY};
use crate::hash::{self, KeyedDomain, PUBLIC_SEED};
use crate::index::{Overlap, WorkerRank};
use crate::ingest::{IngestConfig, IngestHub};
use crate::parse::{
    OutputBlockRequest, ParseError, ParseLimits, Parser, Prompt, PromptQueryRequest,
    ReservationRequest, SelectKind, SelectRequest, WorkerFields,
};
use crate::pool::{Pool, Pooled};
use crate::reserve::{
    Booking, ClaimError, IdentityForm, Ledger, PendingCache, PendingKey, PendingSelection,
    RankLoad, ReserveError,
};
use crate::select::{self, CandidateLoad, CostContext};
use rand::Rng;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Why a request failed, in domain terms; `http::error` chooses the status.
#[derive(Debug)]
pub enum AppError {
    /// The body was not valid JSON, or not the expected shape.
    Parse(ParseError),
    /// Handler validation (400).
    BadRequest(String),
    /// No schedulable worker (503).
    NotReady(String),
    /// No candidate left after filters (503).
    NoEndpoints,
    NotFound(String),
    Conflict(String),
}

impl From<ParseError> for AppError {
    fn from(e: ParseError) -> Self {
        AppError::Parse(e)
    }
}

/// A successful answer: JSON bytes, and whether a resource was created (201).
#[derive(Debug)]
pub struct Reply {
    pub created: bool,
    pub body: Vec<u8>,
}

impl Reply {
    fn ok(v: &impl Serialize) -> Reply {
        Reply::ok_sized(v, 128)
    }
    /// `ok` into a buffer of `capacity` bytes to start with, for replies
    /// whose size is known roughly (growing a 100 KB reply by doubling
    /// copies it several times).
    fn ok_sized(v: &impl Serialize, capacity: usize) -> Reply {
        let mut body = Vec::with_capacity(capacity);
        serde_json::to_writer(&mut body, v).expect("response types serialise");
        Reply {
            created: false,
            body,
        }
    }
    fn created(v: &impl Serialize) -> Reply {
        Reply {
            created: true,
            ..Reply::ok(v)
        }
    }
    fn status_ok() -> Reply {
        Reply {
            created: false,
            body: br#"{"status":"ok"}"#.to_vec(),
        }
    }
}

pub type AppResult = Result<Reply, AppError>;

pub struct App {
    pub config: Config,
    pub parser: Parser,
    pub catalog: Catalog,
    pub ledger: Arc<Ledger>,
    pub pending: PendingCache,
    shutting_down: AtomicBool,
}

/// A prompt reduced to what selection needs.
struct Normalized {
    isl_tokens: u64,
    /// Public sequence chain of the local block hashes: the index keys.
    seq_keys: Pooled<u64>,
    /// Booking identities (public chain, keyed chain, random, or as given).
    identities: Pooled<u64>,
    /// `Arbitrary` only for identities as given.
    form: IdentityForm,
}

fn no_schedulable(snap: &Snapshot, model: &str, group: &str) -> AppError {
    if snap.schedulable_workers == 0 {
        AppError::NotReady("no schedulable workers are available".into())
    } else {
        AppError::NotReady(format!(
            "no schedulable workers for {}",
            partition_display(model, group)
        ))
    }
}

impl App {
    pub fn new(config: Config) -> App {
        let ledger = Arc::new(Ledger::new(config.booking_expiry));
        let hub = IngestHub::new(IngestConfig {
            threads: config.ingest_threads,
            ..IngestConfig::default()
        });
        let parser = Parser::new(
            ParseLimits {
                max_depth: config.max_depth,
                max_tokens: config.max_tokens,
            },
            Pool::new(
                4 * config.threads + 4,
                crate::pool::DEFAULT_MAX_CAPACITY * 4,
            ),
            Pool::new(16 * config.threads + 16, crate::pool::DEFAULT_MAX_CAPACITY),
        );
        App {
            pending: PendingCache::new(
                config.selection_cache_ttl,
                config.selection_cache_max_entries,
                config.selection_cache_max_bytes,
            ),
            catalog: Catalog::new(hub, Arc::clone(&ledger)),
            ledger,
            parser,
            config,
            shutting_down: AtomicBool::new(false),
        }
    }

    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    // ----- health and catalog -----

    pub fn ready(&self) -> (bool, Vec<u8>) {
        #[derive(Serialize)]
        struct Ready {
            ready: bool,
            schedulable_workers: usize,
            workers: Vec<crate::catalog::WorkerRecord>,
        }
        let snap = self.catalog.snapshot();
        let ready = !self.shutting_down.load(Ordering::SeqCst) && snap.schedulable_workers > 0;
        let body = Ready {
            ready,
            schedulable_workers: snap.schedulable_workers,
            workers: self.catalog.list(None, None),
        };
        (ready, serde_json::to_vec(&body).expect("serialises"))
    }

    pub fn upsert_worker(&self, body: &[u8]) -> AppResult {
        let fields = self.parser.worker_upsert(body)?;
        Ok(Reply::created(&self.catalog.upsert(fields)))
    }

    pub fn patch_worker(&self, worker_id: u64, body: &[u8]) -> AppResult {
        let fields: WorkerFields = self.parser.worker_patch(body)?;
        self.catalog
            .patch(worker_id, fields)
            .map(|r| Reply::ok(&r))
            .ok_or_else(|| AppError::NotFound(format!("worker {worker_id} not found")))
    }

    pub fn delete_worker(&self, worker_id: u64) -> AppResult {
        self.catalog
            .delete(worker_id)
            .map(|r| Reply::ok(&r))
            .ok_or_else(|| AppError::NotFound(format!("worker {worker_id} not found")))
    }

    pub fn list_workers(&self, model: Option<&str>, group: Option<&str>) -> AppResult {
        Ok(Reply::ok(&self.catalog.list(model, group)))
    }

    // ----- prompt normalisation -----

    /// Resolves the prompt group (§4.7). `strict` is the /select rule set;
    /// explicit reservations only need `sequence_hashes` and `isl_tokens`.
    fn normalize(
        &self,
        p: &Prompt<'_>,
        view: &PartitionView,
        cfg: &RouterConfig,
        strict: bool,
    ) -> Result<Normalized, AppError> {
        let part = &view.partition;
        let bs = part.block_size;
        let routing = p
            .mm_routing_info
            .as_ref()
            .filter(|m| m.routing_token_ids.as_ref().is_some_and(|t| !t.is_empty()));
        let tokens = match routing {
            Some(m) => m
                .routing_token_ids
                .as_deref()
                .map(|t| (t, m.block_mm_infos.as_deref())),
            None => p
                .token_ids
                .as_deref()
                .map(|t| (t, p.block_mm_infos.as_deref())),
        };
        let mut seq_keys = self.parser.hashes.take();
        let mut identities = self.parser.hashes.take();
        if let Some((tokens, mm)) = tokens {
            let eagle = p.is_eagle.unwrap_or(part.is_eagle);
            let lora = p.lora_name.as_deref();
            let salt = p.cache_salt.as_deref();
            let mut local = self.parser.hashes.take();
            hash::local_and_sequence_hashes(
                tokens,
                bs,
                eagle,
                hash::salt_seed(lora, salt),
                PUBLIC_SEED,
                mm,
                &mut local,
                &mut seq_keys,
            );
            if !cfg.assume_kv_reuse {
                random_identities(local.len(), &mut identities);
            } else if let Some(key) = &self.config.tracking_key {
                let (block_seed, chain_seed) = key.seeds(&KeyedDomain {
                    model_name: &part.model_name,
                    routing_group: &part.routing_group,
                    block_size: bs,
                    cache_salt: salt,
                    lora_name: lora,
                    is_eagle: eagle,
                });
                local.clear();
                hash::local_and_sequence_hashes(
                    tokens,
                    bs,
                    eagle,
                    block_seed,
                    chain_seed,
                    mm,
                    &mut local,
                    &mut identities,
                );
            } else {
                identities.extend_from_slice(&seq_keys);
            }
            return Ok(Normalized {
                isl_tokens: tokens.len() as u64,
                seq_keys,
                identities,
                form: IdentityForm::Chained,
            });
        }
        let required =
            |what: &str| AppError::BadRequest(format!("{what} is required without token_ids"));
        if strict && p.block_hashes.is_none() {
            return Err(required("block_hashes"));
        }
        let seqs = p
            .sequence_hashes
            .as_deref()
            .ok_or_else(|| required("sequence_hashes"))?;
        let isl = p.isl_tokens.ok_or_else(|| required("isl_tokens"))?;
        if strict {
            let blocks = p.block_hashes.as_deref().map_or(&[][..], Vec::as_slice);
            if isl == 0 {
                return Err(AppError::BadRequest(
                    "isl_tokens must be greater than 0".into(),
                ));
            }
            if blocks.len() != seqs.len() {
                return Err(AppError::BadRequest(format!(
                    "block_hashes length {} must match sequence_hashes length {}",
                    blocks.len(),
                    seqs.len()
                )));
            }
        }
        if let Some(blocks) = p.block_hashes.as_deref() {
            hash::sequence_hashes(blocks, PUBLIC_SEED, &mut seq_keys);
        }
        let form = if cfg.assume_kv_reuse {
            identities.extend_from_slice(seqs);
            // Given hashes are a chain only if they are the chain of the
            // given block hashes (a client echoing /select's reply).
            if !seqs.is_empty() && seqs == &seq_keys[..] {
                IdentityForm::Chained
            } else {
                IdentityForm::Arbitrary
            }
        } else {
            random_identities(seqs.len(), &mut identities);
            IdentityForm::Chained
        };
        Ok(Normalized {
            isl_tokens: isl,
            seq_keys,
            identities,
            form,
        })
    }

    fn partition_view(
        &self,
        snap: &Snapshot,
        model: &str,
        group: &str,
    ) -> Result<Arc<PartitionView>, AppError> {
        match snap.partition(model, group) {
            Some(v) if !v.ranks.is_empty() => Ok(Arc::clone(v)),
            _ => Err(no_schedulable(snap, model, group)),
        }
    }

    // ----- selection -----

    pub fn select(&self, body: &[u8], kind: SelectKind) -> AppResult {
        let req = self.parser.select(body, kind)?;
        let model = req
            .model_name
            .as_deref()
            .unwrap_or(crate::catalog::DEFAULT_MODEL);
        let group = req
            .routing_group
            .as_deref()
            .unwrap_or(crate::catalog::DEFAULT_ROUTING_GROUP);
        let snap = self.catalog.snapshot();
        let view = self.partition_view(&snap, model, group)?;
        let cfg =
            select::effective_config(&self.config.router, req.router_config_override.as_ref());
        let prompt = self.normalize(&req.prompt, &view, &cfg, true)?;
        let choice = self.choose(&req, &view, &cfg, &prompt)?;
        let bs = view.partition.block_size;

        let mut identities = prompt.identities;
        let prompt_blocks = identities.len();
        let selection_id: Option<String> = match kind {
            SelectKind::Select => req.selection_id.as_deref().map(str::to_string),
            SelectKind::SelectAndReserve => Some(
                req.selection_id
                    .as_deref()
                    .map(str::to_string)
                    .unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
            ),
        };
        let track = cfg.track_prefill_tokens;
        if cfg.track_output_blocks {
            if let Some(eot) = req.expected_output_tokens {
                // Reserve the expected output as synthetic decode blocks.
                let n = (eot as u64).div_ceil(bs as u64) as usize;
                random_identities(n, &mut identities);
            }
        }
        match kind {
            SelectKind::Select => {
                if let Some(id) = &selection_id {
                    self.pending.insert(
                        PendingKey {
                            model_name: model.to_string(),
                            routing_group: group.to_string(),
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
                        },
                        Instant::now(),
                    );
                }
            }
            SelectKind::SelectAndReserve => {
                let id = selection_id.as_deref().unwrap_or_default();
                self.ledger
                    .book(Booking {
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
                    })
                    .map_err(|e| reserve_error(e, id))?;
            }
        }

        let rank_overlaps = |r: &RankInfo| -> Overlap { choice.overlap_of(r.wr) };
        let ranks = view.worker_ranks(choice.wr.worker_id);
        let tokens = |blocks: u32| blocks as u64 * bs as u64;
        let gpu = ranks
            .iter()
            .map(|r| tokens(rank_overlaps(r).device))
            .max()
            .unwrap_or(0);
        let cpu = ranks
            .iter()
            .map(|r| {
                let o = rank_overlaps(r);
                tokens(o.device + o.host_ext)
            })
            .max()
            .unwrap_or(0);
        let disk = ranks
            .iter()
            .map(|r| {
                let o = rank_overlaps(r);
                tokens(o.device + o.host_ext + o.disk_ext)
            })
            .max()
            .unwrap_or(0);
        let dp: BTreeMap<u32, u64> = ranks
            .iter()
            .map(|r| (r.wr.dp_rank, tokens(rank_overlaps(r).device)))
            .collect();
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
        let reserved = kind == SelectKind::SelectAndReserve;
        let resp = SelectResponse {
            selection_id: selection_id.as_deref(),
            isl_tokens: reserved.then_some(prompt.isl_tokens),
            track_prefill_tokens: reserved.then_some(track),
            model_name: model,
            routing_group: group,
            worker_id: choice.wr.worker_id,
            dp_rank: choice.wr.dp_rank,
            endpoint: &choice.rank.endpoint,
            block_size: bs,
            overlap: OverlapOut {
                longest_matched: gpu.max(cpu).max(disk),
                gpu,
                dp,
                cpu,
                disk,
            },
            effective_prefill_tokens: choice.effective_prefill_tokens,
            potential_decode_blocks,
            worker_load,
        };
        let hashes = if reserved {
            crate::json_out::i64_array_capacity(prompt_blocks)
        } else {
            0
        };
        let mut reply = Reply::ok_sized(&resp, 512 + hashes + resp.endpoint.len());
        if reserved {
            // The largest field, written last by the fast writer: the
            // object's closing brace comes off and goes back after it.
            let body = &mut reply.body;
            debug_assert_eq!(body.last(), Some(&b'}'));
            body.pop();
            body.extend_from_slice(br#","sequence_hashes":"#);
            crate::json_out::push_i64_array(body, &identities[..prompt_blocks]);
            body.push(b'}');
        }
        Ok(reply)
    }

    fn choose(
        &self,
        req: &SelectRequest<'_>,
        view: &PartitionView,
        cfg: &RouterConfig,
        prompt: &Normalized,
    ) -> Result<Choice, AppError> {
        let constraints = req.routing_constraints.as_ref();
        let candidates: Vec<&RankInfo> = view
            .ranks
            .iter()
            .filter(|r| {
                req.allowed_worker_ids
                    .as_ref()
                    .is_none_or(|ids| ids.contains(&r.wr.worker_id))
            })
            .filter(|r| {
                req.pinned_worker
                    .is_none_or(|p| p.worker_id == r.wr.worker_id && p.dp_rank == r.wr.dp_rank)
            })
            .filter(|r| {
                constraints.is_none_or(|c| {
                    c.required_taints
                        .iter()
                        .all(|t| r.taints.iter().any(|have| have == t.as_ref()))
                })
            })
            .collect();
        if candidates.is_empty() {
            return Err(AppError::NoEndpoints);
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
        let cands: Vec<CandidateLoad> = wrs
            .iter()
            .zip(loads.iter().zip(&new_blocks))
            .map(
                |(wr, (l, &nb)): (&WorkerRank, (&RankLoad, &u64))| CandidateLoad {
                    overlap: overlap_in(&hits, *wr),
                    active_prefill_tokens: l.prefill_tokens,
                    active_decode_blocks: l.decode_blocks,
                    active_requests: l.active_requests,
                    new_blocks: nb,
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
        let mut costs: Vec<f64> = cands.iter().map(|c| select::cost(c, cfg, &ctx)).collect();
        // Preferred taints scale the cost by exp(-tanh(sum of matching weights)).
        if let Some(c) = constraints.filter(|c| !c.preferred_taints.is_empty()) {
            for (cost, r) in costs.iter_mut().zip(&candidates) {
                let w: f64 = c
                    .preferred_taints
                    .iter()
                    .filter(|(t, _)| r.taints.iter().any(|have| have == t.as_ref()))
                    .map(|(_, w)| *w as f64)
                    .sum();
                *cost *= (-w.tanh()).exp();
            }
        }
        let i = select::choose(&costs, cfg.router_temperature, &mut rand::rng());
        let load = cands[i];
        Ok(Choice {
            wr: wrs[i],
            rank: candidates[i].clone(),
            load,
            effective_prefill_tokens: select::effective_prefill_tokens(&load.overlap, cfg, &ctx),
            hits,
        })
    }

    // ----- reservations -----

    pub fn create_reservation(&self, body: &[u8]) -> AppResult {
        let req = self.parser.reservation(body)?;
        let model = req
            .model_name
            .as_deref()
            .unwrap_or(crate::catalog::DEFAULT_MODEL);
        let group = req
            .routing_group
            .as_deref()
            .unwrap_or(crate::catalog::DEFAULT_ROUTING_GROUP);
        let key = PendingKey {
            model_name: model.to_string(),
            routing_group: group.to_string(),
            selection_id: req.selection_id.to_string(),
        };
        match req.worker_id {
            None => self.replay_reservation(&key),
            Some(worker_id) => {
                self.pending.discard(&key);
                self.explicit_reservation(&req, &key, worker_id)
            }
        }
    }

    fn replay_reservation(&self, key: &PendingKey) -> AppResult {
        let id = key.selection_id.as_str();
        let claimed = self
            .pending
            .claim(key, Instant::now(), |sel: &PendingSelection| {
                let snap = self.catalog.snapshot();
                let view = self.partition_view(&snap, &key.model_name, &key.routing_group)?;
                let rank = view.rank(sel.wr).ok_or_else(|| {
                    AppError::NotFound(format!(
                        "schedulable worker {} (dp_rank {}) not found for {}",
                        sel.wr.worker_id,
                        sel.wr.dp_rank,
                        view.partition.display()
                    ))
                })?;
                let prefill = if sel.track_prefill_tokens {
                    sel.effective_prefill_tokens
                } else {
                    0
                };
                self.ledger
                    .book(Booking {
                        selection_id: id,
                        wr: sel.wr,
                        identities: &sel.identities,
                        form: sel.identity_form,
                        prefill_tokens: prefill,
                        now: Instant::now(),
                    })
                    .map_err(|e| reserve_error(e, id))?;
                Ok(reservation_reply(id, key, sel.wr, &rank.endpoint))
            });
        match claimed {
            Ok(reply) => Ok(reply),
            Err(ClaimError::Rejected(e)) => Err(e),
            Err(ClaimError::InFlight) => Err(reserve_error(ReserveError::Duplicate, id)),
            Err(ClaimError::Missing) => Err(AppError::NotFound(format!(
                "no pending selection {id} for {} (expired, already used, or never selected)",
                partition_display(&key.model_name, &key.routing_group)
            ))),
        }
    }

    fn explicit_reservation(
        &self,
        req: &ReservationRequest<'_>,
        key: &PendingKey,
        worker_id: u64,
    ) -> AppResult {
        let id = key.selection_id.as_str();
        let snap = self.catalog.snapshot();
        let view = self.partition_view(&snap, &key.model_name, &key.routing_group)?;
        let cfg =
            select::effective_config(&self.config.router, req.router_config_override.as_ref());
        let prompt = self.normalize(&req.prompt, &view, &cfg, false)?;
        if let Some(eff) = req.effective_prefill_tokens {
            if eff > prompt.isl_tokens {
                return Err(AppError::BadRequest(format!(
                    "effective_prefill_tokens ({eff}) must not exceed isl_tokens ({})",
                    prompt.isl_tokens
                )));
            }
        }
        if view.worker_ranks(worker_id).is_empty() {
            return Err(AppError::NotFound(format!(
                "schedulable worker {worker_id} not found for {}",
                view.partition.display()
            )));
        }
        if self.ledger.is_booked(id) {
            return Err(reserve_error(ReserveError::Duplicate, id));
        }
        let dp_rank = req.dp_rank.unwrap_or(0);
        let wr = WorkerRank { worker_id, dp_rank };
        let rank = view.rank(wr).ok_or_else(|| {
            AppError::NotFound(format!(
                "Worker WorkerWithDpRank {{ worker_id: {worker_id}, dp_rank: {dp_rank} }} not found"
            ))
        })?;
        let track = req
            .track_prefill_tokens
            .unwrap_or(req.effective_prefill_tokens.is_some() || cfg.track_prefill_tokens);
        let prefill = match req.effective_prefill_tokens {
            Some(eff) if track => eff,
            _ => 0,
        };
        self.ledger
            .book(Booking {
                selection_id: id,
                wr,
                identities: &prompt.identities,
                form: prompt.form,
                prefill_tokens: prefill,
                now: Instant::now(),
            })
            .map_err(|e| reserve_error(e, id))?;
        Ok(reservation_reply(id, key, wr, &rank.endpoint))
    }

    pub fn prefill_complete(&self, id: &str) -> AppResult {
        self.ledger
            .prefill_complete(id)
            .map_err(|e| reserve_error(e, id))?;
        Ok(Reply::status_ok())
    }

    pub fn output_block(&self, id: &str, body: &[u8]) -> AppResult {
        let OutputBlockRequest { decay_fraction } = self.parser.output_block(body)?;
        if let Some(f) = decay_fraction {
            if !(0.0..=1.0).contains(&f) {
                return Err(AppError::BadRequest(
                    "decay_fraction must be between 0.0 and 1.0".into(),
                ));
            }
        }
        self.ledger
            .output_block(id, decay_fraction)
            .map_err(|e| reserve_error(e, id))?;
        Ok(Reply::status_ok())
    }

    pub fn free_reservation(&self, id: &str) -> AppResult {
        self.ledger.free(id).map_err(|e| reserve_error(e, id))?;
        Ok(Reply::status_ok())
    }

    // ----- load and overlap reports -----

    pub fn loads(&self, model: Option<&str>, group: Option<&str>) -> AppResult {
        #[derive(Serialize)]
        struct PartitionLoads<'a> {
            model_name: &'a str,
            routing_group: &'a str,
            loads: Vec<LoadRow>,
            pending_count: u64,
            pending_isl_tokens: u64,
        }
        let snap = self.catalog.snapshot();
        let mut out = Vec::new();
        for ((m, g), view) in &snap.partitions {
            if model.is_some_and(|x| x != m) || group.is_some_and(|x| x != g) {
                continue;
            }
            let wrs: Vec<WorkerRank> = view.ranks.iter().map(|r| r.wr).collect();
            let mut loads = Vec::with_capacity(wrs.len());
            self.ledger.loads(&wrs, &mut loads);
            out.push(PartitionLoads {
                model_name: m,
                routing_group: g,
                loads: wrs
                    .iter()
                    .zip(&loads)
                    .map(|(wr, l)| LoadRow::new(*wr, l, 0, 0))
                    .collect(),
                pending_count: 0,
                pending_isl_tokens: 0,
            });
        }
        Ok(Reply::ok(&out))
    }

    pub fn potential_loads(&self, body: &[u8]) -> AppResult {
        let (req, view, cfg, prompt) = self.prompt_query(body)?;
        drop(req);
        let mut hits = Vec::new();
        view.partition.index.overlap(&prompt.seq_keys, &mut hits);
        hits.sort_unstable_by_key(|(wr, _)| *wr);
        let wrs: Vec<WorkerRank> = view.ranks.iter().map(|r| r.wr).collect();
        let mut loads = Vec::with_capacity(wrs.len());
        self.ledger.loads(&wrs, &mut loads);
        let mut new_blocks = Vec::with_capacity(wrs.len());
        self.ledger
            .new_blocks(&wrs, &prompt.identities, prompt.form, &mut new_blocks);
        let ctx = CostContext {
            isl_tokens: prompt.isl_tokens,
            block_size: view.partition.block_size,
            track_prefill_tokens: cfg.track_prefill_tokens,
            min_active_prefill_tokens: 0,
        };
        let rows: Vec<LoadRow> = wrs
            .iter()
            .zip(loads.iter().zip(&new_blocks))
            .map(|(wr, (l, &nb))| {
                let o = overlap_in(&hits, *wr);
                let prefill = if cfg.track_prefill_tokens {
                    select::effective_prefill_tokens(&o, &cfg, &ctx)
                } else {
                    0
                };
                LoadRow::new(*wr, l, prefill, nb)
            })
            .collect();
        Ok(Reply::ok(&rows))
    }

    pub fn overlap_scores(&self, body: &[u8]) -> AppResult {
        #[derive(Serialize)]
        struct Row {
            worker_id: u64,
            dp_rank: u32,
            device_blocks: u32,
            host_pinned_blocks: u32,
            disk_blocks: u32,
            host_pinned_extension_blocks: u32,
            disk_extension_blocks: u32,
            shared_beyond_device_blocks: Option<u32>,
        }
        #[derive(Serialize)]
        struct SharedCache {
            enabled: bool,
            total_hit_blocks: u64,
            ranges: [u8; 0],
            error: Option<String>,
        }
        #[derive(Serialize)]
        struct Scores {
            block_size: u32,
            num_blocks: usize,
            workers: Vec<Row>,
            shared_cache: SharedCache,
        }
        let (_req, view, _cfg, prompt) = self.prompt_query(body)?;
        let mut hits = Vec::new();
        view.partition.index.overlap(&prompt.seq_keys, &mut hits);
        let mut rows: BTreeMap<WorkerRank, Overlap> = view
            .ranks
            .iter()
            .map(|r| (r.wr, Overlap::default()))
            .collect();
        rows.extend(hits);
        let workers = rows
            .into_iter()
            .map(|(wr, o)| Row {
                worker_id: wr.worker_id,
                dp_rank: wr.dp_rank,
                device_blocks: o.device,
                host_pinned_blocks: o.device + o.host_ext,
                disk_blocks: o.device + o.host_ext + o.disk_ext,
                host_pinned_extension_blocks: o.host_ext,
                disk_extension_blocks: o.disk_ext,
                shared_beyond_device_blocks: None,
            })
            .collect();
        Ok(Reply::ok(&Scores {
            block_size: view.partition.block_size,
            num_blocks: prompt.seq_keys.len().max(prompt.identities.len()),
            workers,
            shared_cache: SharedCache {
                enabled: false,
                total_hit_blocks: 0,
                ranges: [],
                error: None,
            },
        }))
    }

    #[allow(clippy::type_complexity)]
    fn prompt_query<'b>(
        &self,
        body: &'b [u8],
    ) -> Result<
        (
            PromptQueryRequest<'b>,
            Arc<PartitionView>,
            RouterConfig,
            Normalized,
        ),
        AppError,
    > {
        let req = self.parser.prompt_query(body)?;
        let model = req
            .model_name
            .as_deref()
            .unwrap_or(crate::catalog::DEFAULT_MODEL);
        let group = req
            .routing_group
            .as_deref()
            .unwrap_or(crate::catalog::DEFAULT_ROUTING_GROUP);
        let snap = self.catalog.snapshot();
        let view = self.partition_view(&snap, model, group)?;
        let cfg =
            select::effective_config(&self.config.router, req.router_config_override.as_ref());
        let prompt = self.normalize(&req.prompt, &view, &cfg, true)?;
        Ok((req, view, cfg, prompt))
    }

    /// Drops bookings older than the expiry; the server calls it periodically.
    pub fn sweep(&self) -> usize {
        self.ledger.sweep_expired(Instant::now())
    }
}

struct Choice {
    wr: WorkerRank,
    rank: RankInfo,
    load: CandidateLoad,
    effective_prefill_tokens: u64,
    hits: Vec<(WorkerRank, Overlap)>,
}

impl Choice {
    fn overlap_of(&self, wr: WorkerRank) -> Overlap {
        overlap_in(&self.hits, wr)
    }
}

/// The overlap of `wr` in hits sorted by rank (zero when it matched nothing).
fn overlap_in(hits: &[(WorkerRank, Overlap)], wr: WorkerRank) -> Overlap {
    hits.binary_search_by_key(&wr, |(w, _)| *w)
        .map(|i| hits[i].1)
        .unwrap_or_default()
}

fn random_identities(n: usize, out: &mut Vec<u64>) {
    let mut rng = rand::rng();
    out.extend((0..n).map(|_| rng.random::<u64>()));
}

fn reserve_error(e: ReserveError, id: &str) -> AppError {
    match e {
        ReserveError::Duplicate => AppError::Conflict(format!(
            "selection {id} is already reserved or being reserved"
        )),
        ReserveError::NotFound => AppError::NotFound(format!("reservation {id} not found")),
    }
}

fn reservation_reply(id: &str, key: &PendingKey, wr: WorkerRank, endpoint: &str) -> Reply {
    #[derive(Serialize)]
    struct ReservationResponse<'a> {
        selection_id: &'a str,
        model_name: &'a str,
        routing_group: &'a str,
        worker_id: u64,
        dp_rank: u32,
        endpoint: &'a str,
    }
    Reply::created(&ReservationResponse {
        selection_id: id,
        model_name: &key.model_name,
        routing_group: &key.routing_group,
        worker_id: wr.worker_id,
        dp_rank: wr.dp_rank,
        endpoint,
    })
}

#[derive(Serialize)]
struct LoadRow {
    worker_id: u64,
    dp_rank: u32,
    potential_prefill_tokens: u64,
    potential_decode_blocks: u64,
    active_requests: u64,
}

impl LoadRow {
    fn new(wr: WorkerRank, l: &RankLoad, extra_prefill: u64, extra_decode: u64) -> LoadRow {
        LoadRow {
            worker_id: wr.worker_id,
            dp_rank: wr.dp_rank,
            potential_prefill_tokens: l.prefill_tokens + extra_prefill,
            potential_decode_blocks: l.decode_blocks + extra_decode,
            active_requests: l.active_requests,
        }
    }
}

#[derive(Serialize)]
struct OverlapOut {
    longest_matched: u64,
    gpu: u64,
    dp: BTreeMap<u32, u64>,
    cpu: u64,
    disk: u64,
}

#[derive(Serialize)]
struct WorkerLoad {
    active_prefill_tokens: u64,
    prefill_token_capacity: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    total_kv_blocks: Option<u64>,
}

#[derive(Serialize)]
struct SelectResponse<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    selection_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    isl_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    track_prefill_tokens: Option<bool>,
    model_name: &'a str,
    routing_group: &'a str,
    worker_id: u64,
    dp_rank: u32,
    endpoint: &'a str,
    block_size: u32,
    overlap: OverlapOut,
    effective_prefill_tokens: u64,
    potential_decode_blocks: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    worker_load: Option<WorkerLoad>,
}

impl App {
    /// GET /dump: every partition's index in the reference's recovery format.
    pub fn dump(&self) -> AppResult {
        let parts = self.catalog.partitions();
        let body = crate::index::dump::dump_body(parts.iter().map(|p| {
            (
                p.model_name.as_str(),
                p.routing_group.as_str(),
                p.block_size,
                &*p.index,
            )
        }));
        Ok(Reply {
            created: false,
            body: body.into_bytes(),
        })
    }

    /// Loads a peer's whole /dump object into the local partitions (created
    /// with the dumped block size when missing); returns the chains applied.
    pub fn load_dump(&self, body: &[u8]) -> Result<usize, String> {
        let parts = crate::index::dump::parse_dump(body).map_err(|e| e.to_string())?;
        let mut applied = 0;
        for p in parts {
            let partition =
                self.catalog
                    .ensure_partition(&p.model_name, &p.routing_group, p.block_size)?;
            let report = crate::index::dump::load(&partition.index, &p.chains);
            if report.dropped > 0 {
                tracing::warn!(partition = %p.key, dropped = report.dropped, "dump chains without a parent were dropped");
            }
            applied += report.applied;
        }
        Ok(applied)
    }

    /// GET /metrics: Prometheus text exposition.
    pub fn metrics_text(&self) -> String {
        // `[(name, value)]` of the named fields of a counters struct.
        macro_rules! fields {
            ($s:expr; $($f:ident),* $(,)?) => { [$((stringify!($f), $s.$f)),*] };
        }
        use std::fmt::Write;
        let mut out = String::new();
        let snap = self.catalog.snapshot();
        let _ = writeln!(out, "# TYPE kvselect_schedulable_workers gauge");
        let _ = writeln!(
            out,
            "kvselect_schedulable_workers {}",
            snap.schedulable_workers
        );
        let _ = writeln!(out, "# TYPE kvselect_index_entries gauge");
        let _ = writeln!(out, "# TYPE kvselect_index_nodes gauge");
        let _ = writeln!(out, "# TYPE kvselect_index_bytes gauge");
        for p in self.catalog.partitions() {
            let st = p.index.stats();
            let labels = format!(
                "model_name={:?},routing_group={:?}",
                p.model_name, p.routing_group
            );
            let _ = writeln!(out, "kvselect_index_entries{{{labels}}} {}", st.entries);
            let _ = writeln!(out, "kvselect_index_nodes{{{labels}}} {}", st.nodes);
            let _ = writeln!(out, "kvselect_index_bytes{{{labels}}} {}", st.bytes);
        }
        let ls = self.ledger.stats();
        let _ = writeln!(out, "# TYPE kvselect_bookings gauge");
        let _ = writeln!(out, "kvselect_bookings {}", ls.bookings);
        let _ = writeln!(out, "# TYPE kvselect_active_identities gauge");
        let _ = writeln!(out, "kvselect_active_identities {}", ls.identities);
        let _ = writeln!(out, "# TYPE kvselect_active_chained_identities gauge");
        let _ = writeln!(
            out,
            "kvselect_active_chained_identities {}",
            ls.chained_identities
        );
        let _ = writeln!(out, "# TYPE kvselect_pending_selections gauge");
        let _ = writeln!(out, "kvselect_pending_selections {}", self.pending.len());
        let _ = writeln!(out, "# TYPE kvselect_pending_selection_bytes gauge");
        let _ = writeln!(
            out,
            "kvselect_pending_selection_bytes {}",
            self.pending.bytes()
        );
        let c = self.catalog.hub().stats().counters;
        for (name, v) in [
            ("messages", c.messages),
            ("batches_applied", c.batches_applied),
            ("malformed_dropped", c.malformed),
            ("gaps", c.gaps),
            ("gaps_lost", c.gaps_lost),
            ("replays_started", c.replays_started),
            ("replays_failed", c.replays_failed),
            ("replayed_batches", c.replayed_batches),
            ("engine_restarts", c.restarts),
            ("stale_dropped", c.stale_dropped),
            ("connect_errors", c.connect_errors),
        ]
        .into_iter()
        .chain(
            fields!(c.apply; events_applied, blocks_stored, blocks_removed, clears,
            stores_dropped_block_size, stores_dropped_shape, stores_dropped_self_reference,
            stores_dropped_unknown_parent, stores_dropped_other, events_ignored_group,
            events_dropped_unknown_medium, events_dropped_non_local, events_dropped_unknown_type),
        ) {
            let _ = writeln!(out, "# TYPE kvselect_ingest_{name}_total counter");
            let _ = writeln!(out, "kvselect_ingest_{name}_total {v}");
        }
        out
    }

    /// /replica_sync/register_peer and deregister_peer: the body is checked
    /// (422 without `endpoint`), then 409, since kvselect runs no replica mesh.
    pub fn replica_sync_peer(&self, body: &[u8]) -> AppResult {
        self.parser.peer_endpoint(body)?;
        Err(AppError::Conflict("replica sync is disabled".into()))
    }
}
