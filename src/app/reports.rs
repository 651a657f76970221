//! Read-only reports: /loads, /potential_loads, /overlap_scores (§4.12-4.14)
//! and the /dump recovery format (§4.15).

use super::selection::overlap_in;
use super::{App, ServiceError};
use crate::index::{Overlap, WorkerRank};
use crate::parse::PromptQueryRequest;
use crate::reserve::RankLoad;
use crate::select::{self, CostContext};
use serde::Serialize;
use std::collections::BTreeMap;

/// One rank's load, as /loads and /potential_loads report it.
#[derive(Debug, Serialize)]
pub struct LoadRow {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub potential_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub active_requests: u64,
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

/// One partition of GET /loads.
#[derive(Debug, Serialize)]
pub struct PartitionLoads {
    pub model_name: String,
    pub routing_group: String,
    pub loads: Vec<LoadRow>,
    pub pending_count: u64,
    pub pending_isl_tokens: u64,
}

/// One rank of /overlap_scores, in blocks.
#[derive(Debug, Serialize)]
pub struct OverlapRow {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub device_blocks: u32,
    pub host_pinned_blocks: u32,
    pub disk_blocks: u32,
    pub host_pinned_extension_blocks: u32,
    pub disk_extension_blocks: u32,
    pub shared_beyond_device_blocks: Option<u32>,
}

/// The shared-cache part of /overlap_scores: kvselect has no shared cache.
#[derive(Debug, Serialize)]
pub struct SharedCache {
    pub enabled: bool,
    pub total_hit_blocks: u64,
    /// Always empty (a list, in JSON and in Python).
    pub ranges: Vec<u8>,
    pub error: Option<String>,
}

/// The reply of /overlap_scores.
#[derive(Debug, Serialize)]
pub struct OverlapScores {
    pub block_size: u32,
    pub num_blocks: usize,
    pub workers: Vec<OverlapRow>,
    pub shared_cache: SharedCache,
}

impl App {
    pub fn loads(&self, model: Option<&str>, group: Option<&str>) -> Vec<PartitionLoads> {
        let snap = self.catalog.snapshot();
        let mut out = Vec::new();
        for ((m, g), view) in &snap.partitions {
            if model.is_some_and(|x| x != m) || group.is_some_and(|x| x != g) {
                continue;
            }
            let wrs: Vec<WorkerRank> = view.ranks.iter().map(|r| r.wr).collect();
            let mut loads = Vec::with_capacity(wrs.len());
            self.ledger.loads(&wrs, &mut loads);
            let (pending_count, pending_isl_tokens) =
                self.queue.as_ref().map_or((0, 0), |q| q.pending(m, g));
            out.push(PartitionLoads {
                model_name: m.clone(),
                routing_group: g.clone(),
                loads: wrs
                    .iter()
                    .zip(&loads)
                    .map(|(wr, l)| LoadRow::new(*wr, l, 0, 0))
                    .collect(),
                pending_count,
                pending_isl_tokens,
            });
        }
        out
    }

    pub fn potential_loads(
        &self,
        req: &PromptQueryRequest<'_>,
    ) -> Result<Vec<LoadRow>, ServiceError> {
        let t = self.target(
            req.model_name.as_ref(),
            req.routing_group.as_ref(),
            req.router_config_override.as_ref(),
        )?;
        let (view, cfg) = (&t.view, &t.cfg);
        let prompt = self.normalize(&req.prompt, view, cfg, true)?;
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
        Ok(wrs
            .iter()
            .zip(loads.iter().zip(&new_blocks))
            .map(|(wr, (l, &nb))| {
                let o = overlap_in(&hits, *wr);
                let prefill = if cfg.track_prefill_tokens {
                    select::effective_prefill_tokens(&o, cfg, &ctx)
                } else {
                    0
                };
                LoadRow::new(*wr, l, prefill, nb)
            })
            .collect())
    }

    pub fn overlap_scores(
        &self,
        req: &PromptQueryRequest<'_>,
    ) -> Result<OverlapScores, ServiceError> {
        let t = self.target(
            req.model_name.as_ref(),
            req.routing_group.as_ref(),
            req.router_config_override.as_ref(),
        )?;
        let view = &t.view;
        let prompt = self.normalize(&req.prompt, view, &t.cfg, true)?;
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
            .map(|(wr, o)| OverlapRow {
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
        Ok(OverlapScores {
            block_size: view.partition.block_size,
            num_blocks: prompt.seq_keys.len().max(prompt.identities.len()),
            workers,
            shared_cache: SharedCache {
                enabled: false,
                total_hit_blocks: 0,
                ranges: Vec::new(),
                error: None,
            },
        })
    }

    /// GET /dump: every partition's index in the reference's recovery
    /// format, as JSON text.
    pub fn dump(&self) -> String {
        let parts = self.catalog.partitions();
        crate::index::dump::dump_body(parts.iter().map(|p| {
            (
                p.model_name.as_str(),
                p.routing_group.as_str(),
                p.block_size,
                &*p.index,
            )
        }))
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
}
