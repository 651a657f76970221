//! Typed request views produced by the parser, one per JSON body of the API
//! (`selection-api.md` §4).
//!
//! Views borrow strings from the request body (`Str<'a>` is `Cow::Borrowed`
//! unless the JSON string held escapes) and keep token and hash arrays in pooled
//! buffers. Field names follow the wire names. `Option::None` means the field
//! was absent or JSON `null`, unless a field's doc says otherwise.

use crate::pool::Pooled;
use std::borrow::Cow;
use std::collections::BTreeMap;

/// A string borrowed from the body when it held no escapes.
pub type Str<'a> = Cow<'a, str>;

/// The prompt group shared by /select, /select_and_reserve, /potential_loads,
/// /overlap_scores and explicit /reservations (§4.7).
#[derive(Debug, Default)]
pub struct Prompt<'a> {
    /// `token_ids`; `Some` (possibly empty) when the body had an array.
    pub token_ids: Option<Pooled<u32>>,
    pub mm_routing_info: Option<MmRoutingInfo>,
    /// `block_mm_infos`: per block, the block's `mm_hash`es (`None` for a JSON
    /// `null` entry). Offsets are validated and dropped: they are not hashed.
    pub block_mm_infos: Option<Vec<Option<Vec<u64>>>>,
    /// `block_hashes`, i64 on the wire, reinterpreted as u64.
    pub block_hashes: Option<Pooled<u64>>,
    /// `sequence_hashes`, i64 on the wire, reinterpreted as u64.
    pub sequence_hashes: Option<Pooled<u64>>,
    pub isl_tokens: Option<u64>,
    pub lora_name: Option<Str<'a>>,
    pub cache_salt: Option<Str<'a>>,
    pub is_eagle: Option<bool>,
}

/// `mm_routing_info`: when its `routing_token_ids` is non-empty it replaces the
/// prompt's tokens and `block_mm_infos`.
#[derive(Debug, Default)]
pub struct MmRoutingInfo {
    pub routing_token_ids: Option<Pooled<u32>>,
    pub block_mm_infos: Option<Vec<Option<Vec<u64>>>>,
}

/// `router_config_override` (§7.5), validated while parsing: an out-of-range
/// value is a shape error (422) naming the field.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct RouterConfigOverride {
    pub overlap_score_credit: Option<f64>,
    pub prefill_load_scale: Option<f64>,
    /// Deprecated alias: sets prefill_load_scale, and if 0 also the credit to 0.
    pub overlap_score_weight: Option<f64>,
    pub router_temperature: Option<f64>,
    pub assume_kv_reuse: Option<bool>,
    pub track_prefill_tokens: Option<bool>,
    pub shared_cache_multiplier: Option<f64>,
}

impl RouterConfigOverride {
    /// The value rules of §7.5, on the effective values as the reference
    /// applies them: `overlap_score_weight` replaces `prefill_load_scale`,
    /// and a weight of 0 also sets the credit to 0 (so `prefill_load_scale:
    /// -1` next to a valid weight passes). The message names the first field
    /// that breaks one. Every reader of an override (the JSON visitor, the
    /// Python binding) applies them as a shape error.
    pub fn check(&self) -> Result<(), &'static str> {
        let bad = |v: Option<f64>| v.is_some_and(|v| !v.is_finite() || v < 0.0);
        let credit = if self.overlap_score_weight == Some(0.0) {
            Some(0.0)
        } else {
            self.overlap_score_credit
        };
        if bad(credit) {
            Err("overlap_score_credit must be a finite, non-negative number")
        } else if bad(self.overlap_score_weight.or(self.prefill_load_scale)) {
            Err("prefill_load_scale must be finite and non-negative")
        } else if bad(self.router_temperature) {
            Err("router_temperature must be finite and non-negative")
        } else if self
            .shared_cache_multiplier
            .is_some_and(|v| !(0.0..=1.0).contains(&v))
        {
            Err("shared_cache_multiplier must be between 0 and 1")
        } else {
            Ok(())
        }
    }
}

/// `{worker_id, dp_rank}` with both fields required (`pinned_worker`, the
/// reference's `WorkerWithDpRank`; also `[worker_id, dp_rank]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinnedWorker {
    pub worker_id: u64,
    pub dp_rank: u32,
}

/// `affinity_target`: `{worker_id, dp_rank?}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AffinityTarget {
    pub worker_id: u64,
    pub dp_rank: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputTrigger {
    UserMessage,
    ToolResult,
    Other,
}

/// `session_context`: `session_id` is required.
#[derive(Debug)]
pub struct SessionContext<'a> {
    pub session_id: Str<'a>,
    pub parent_session_id: Option<Str<'a>>,
    pub session_final: Option<bool>,
    pub input_trigger: Option<InputTrigger>,
}

/// `routing_constraints`.
#[derive(Debug, Default)]
pub struct RoutingConstraints<'a> {
    pub required_taints: Vec<Str<'a>>,
    pub preferred_taints: Vec<(Str<'a>, f32)>,
}

/// Which selection route a body is for: `advisory` is a field of /select only
/// (for /select_and_reserve it is an unknown field and is skipped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectKind {
    Select,
    SelectAndReserve,
}

/// POST /select and POST /select_and_reserve (§4.8, §4.9).
#[derive(Debug, Default)]
pub struct SelectRequest<'a> {
    pub model_name: Option<Str<'a>>,
    pub routing_group: Option<Str<'a>>,
    pub selection_id: Option<Str<'a>>,
    pub session_id: Option<Str<'a>>,
    pub session_context: Option<SessionContext<'a>>,
    pub router_config_override: Option<RouterConfigOverride>,
    pub expected_output_tokens: Option<u32>,
    pub priority_jump: Option<f64>,
    pub strict_priority: Option<u32>,
    pub pinned_worker: Option<PinnedWorker>,
    pub affinity_target: Option<AffinityTarget>,
    pub allowed_worker_ids: Option<Vec<u64>>,
    pub routing_constraints: Option<RoutingConstraints<'a>>,
    /// Always `None` for [`SelectKind::SelectAndReserve`].
    pub advisory: Option<bool>,
    pub prompt: Prompt<'a>,
}

/// POST /reservations, both forms (§4.10). `worker_id` present selects the
/// explicit form.
#[derive(Debug, Default)]
pub struct ReservationRequest<'a> {
    /// Required (422 `missing field `selection_id`` when absent).
    pub selection_id: Str<'a>,
    pub model_name: Option<Str<'a>>,
    pub routing_group: Option<Str<'a>>,
    pub worker_id: Option<u64>,
    pub dp_rank: Option<u32>,
    pub router_config_override: Option<RouterConfigOverride>,
    pub expected_output_tokens: Option<u32>,
    pub effective_prefill_tokens: Option<u64>,
    pub track_prefill_tokens: Option<bool>,
    pub prompt: Prompt<'a>,
}

/// POST /reservations/{id}/output_block.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct OutputBlockRequest {
    pub decay_fraction: Option<f64>,
}

/// POST /potential_loads and POST /overlap_scores (§4.13, §4.14).
#[derive(Debug, Default)]
pub struct PromptQueryRequest<'a> {
    pub model_name: Option<Str<'a>>,
    pub routing_group: Option<Str<'a>>,
    pub router_config_override: Option<RouterConfigOverride>,
    pub prompt: Prompt<'a>,
}

/// `kv_transfer_enforcement`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvTransferEnforcement {
    Required,
    Preferred,
}

/// The worker fields of POST /workers and PATCH /workers/{id} (§4.3, §4.4).
/// Owned: the catalog keeps it.
///
/// For an upsert `worker_id` is required. For a patch the parser skips
/// `worker_id`, `model_name` and `routing_group` like unknown fields, and
/// leaves them `None`/0.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct WorkerFields {
    pub worker_id: u64,
    pub model_name: Option<String>,
    pub routing_group: Option<String>,
    pub endpoint: Option<String>,
    pub kv_events_endpoint: Option<String>,
    /// Keys are ranks written as decimal strings on the wire; a key that is not
    /// a number is a *syntax* error (400), as in the reference.
    pub kv_events_endpoints: Option<BTreeMap<u32, String>>,
    pub replay_endpoint: Option<String>,
    pub block_size: Option<u32>,
    pub data_parallel_start_rank: Option<u32>,
    pub data_parallel_size: Option<u32>,
    pub max_num_batched_tokens: Option<u64>,
    pub total_kv_blocks: Option<u64>,
    pub stable_routing_id: Option<String>,
    pub is_eagle: Option<bool>,
    pub taints: Option<Vec<String>>,
    pub topology_domains: Option<BTreeMap<String, String>>,
    pub kv_transfer_domain: Option<String>,
    pub kv_transfer_enforcement: Option<KvTransferEnforcement>,
    pub kv_transfer_preferred_weight: Option<f32>,
}
