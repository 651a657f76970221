//! The prompt group (`selection-api.md` §4.7): a prompt as tokens (or
//! multimodal routing tokens) or as given hashes, reduced to the index keys
//! and booking identities selection needs. Tokens are hashed once.

use super::{no_schedulable, App, ServiceError};
use crate::catalog::{PartitionView, Snapshot, DEFAULT_MODEL, DEFAULT_ROUTING_GROUP};
use crate::config::RouterConfig;
use crate::hash::{self, KeyedDomain, PUBLIC_SEED};
use crate::parse::{Prompt, RouterConfigOverride, Str};
use crate::pool::Pooled;
use crate::reserve::IdentityForm;
use crate::select;
use rand::Rng;
use std::sync::Arc;

/// The largest `isl_tokens` a prompt given as hashes may state: far beyond
/// any model's context, and small enough that no number of bookings can
/// overflow a rank's 64-bit prefill sum (which would make a loaded worker
/// look idle).
pub const MAX_ISL_TOKENS: u64 = u32::MAX as u64;

/// A prompt reduced to what selection needs.
pub(super) struct Normalized {
    pub isl_tokens: u64,
    /// Public sequence chain of the local block hashes: the index keys.
    pub seq_keys: Pooled<u64>,
    /// Booking identities (public chain, keyed chain, random, or as given).
    pub identities: Pooled<u64>,
    /// `Arbitrary` only for identities as given.
    pub form: IdentityForm,
}

/// A request's partition, resolved against one catalog snapshot, with the
/// router configuration after the request's override.
pub(super) struct Target {
    pub model: String,
    pub group: String,
    pub view: Arc<PartitionView>,
    pub cfg: RouterConfig,
}

impl App {
    /// The partition named by `model`/`group` (defaults when absent), which
    /// must have schedulable ranks.
    pub(super) fn partition_view(
        &self,
        snap: &Snapshot,
        model: &str,
        group: &str,
    ) -> Result<Arc<PartitionView>, ServiceError> {
        match snap.partition(model, group) {
            Some(v) if !v.ranks.is_empty() => Ok(Arc::clone(v)),
            _ => Err(no_schedulable(snap, model, group)),
        }
    }

    /// Resolves the partition and the effective router configuration.
    pub(super) fn target(
        &self,
        model: Option<&Str<'_>>,
        group: Option<&Str<'_>>,
        config_override: Option<&RouterConfigOverride>,
    ) -> Result<Target, ServiceError> {
        let model = model.map_or(DEFAULT_MODEL, |m| m.as_ref());
        let group = group.map_or(DEFAULT_ROUTING_GROUP, |g| g.as_ref());
        let snap = self.catalog.snapshot();
        let view = self.partition_view(&snap, model, group)?;
        Ok(Target {
            model: model.to_string(),
            group: group.to_string(),
            view,
            cfg: select::effective_config(&self.config.router, config_override),
        })
    }

    /// Resolves the prompt group (§4.7). `strict` is the /select rule set;
    /// explicit reservations only need `sequence_hashes` and `isl_tokens`.
    pub(super) fn normalize(
        &self,
        p: &Prompt<'_>,
        view: &PartitionView,
        cfg: &RouterConfig,
        strict: bool,
    ) -> Result<Normalized, ServiceError> {
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
            |what: &str| ServiceError::Invalid(format!("{what} is required without token_ids"));
        if strict && p.block_hashes.is_none() {
            return Err(required("block_hashes"));
        }
        let seqs = p
            .sequence_hashes
            .as_deref()
            .ok_or_else(|| required("sequence_hashes"))?;
        let isl = p.isl_tokens.ok_or_else(|| required("isl_tokens"))?;
        if isl > MAX_ISL_TOKENS {
            return Err(ServiceError::Invalid(format!(
                "isl_tokens must be at most {MAX_ISL_TOKENS}"
            )));
        }
        if strict {
            let blocks = p.block_hashes.as_deref().map_or(&[][..], Vec::as_slice);
            if isl == 0 {
                return Err(ServiceError::Invalid(
                    "isl_tokens must be greater than 0".into(),
                ));
            }
            if blocks.len() != seqs.len() {
                return Err(ServiceError::Invalid(format!(
                    "block_hashes length {} must match sequence_hashes length {}",
                    blocks.len(),
                    seqs.len()
                )));
            }
        }
        if let Some(blocks) = p.block_hashes.as_deref() {
            hash::sequence_hashes(blocks, PUBLIC_SEED, &mut seq_keys);
        }
        // Given hashes are booked as given, whatever `assume_kv_reuse` says
        // (measured on the reference: only hashes it derives from tokens
        // become random). They are a chain only if they are the chain of
        // the given block hashes (a client echoing /select's reply).
        identities.extend_from_slice(seqs);
        let form = if !seqs.is_empty() && seqs == &seq_keys[..] {
            IdentityForm::Chained
        } else {
            IdentityForm::Arbitrary
        };
        Ok(Normalized {
            isl_tokens: isl,
            seq_keys,
            identities,
            form,
        })
    }
}

/// Appends `n` random identities: load that no other booking can share.
pub(super) fn random_identities(n: usize, out: &mut Vec<u64>) {
    let mut rng = rand::rng();
    out.extend((0..n).map(|_| rng.random::<u64>()));
}
