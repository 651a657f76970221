//! msgpack encoder for KV-event batches in the layouts real engines put on the
//! wire (`kv-events.md` §3): a test publisher's half of [`super::decode`].
//!
//! Owns: building payloads. Used by integration tests, benches and anyone who
//! needs to drive kvselect without an engine. Tests additionally pin the exact
//! bytes of the spec's captured examples, so this encoder and the decoder
//! cannot drift together unnoticed.

use super::decode::{GroupKind, KvEvent};
use crate::index::Tier;
use rmp::encode as w;

/// How events are laid out inside the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventForm {
    /// Tagged map with a `"type"` key (vLLM >= 0.24, SGLang, TRT-LLM bridge):
    /// `type, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
    /// medium, lora_name`, then set optional keys.
    Map,
    /// Tagged positional array as vLLM 0.23 (12-element BlockStored, 4-element
    /// BlockRemoved, trailing nils included).
    Array,
}

/// The `medium` string an engine would send for a tier.
pub fn medium_of(tier: Tier) -> &'static str {
    match tier {
        Tier::Device => "GPU",
        Tier::HostPinned => "CPU",
        Tier::Disk => "DISK",
        Tier::External => "EXTERNAL",
    }
}

// Writing into a Vec<u8> cannot fail; `rmp` still returns Results.
fn ok<T, E>(r: Result<T, E>) {
    drop(r);
}

fn str_(out: &mut Vec<u8>, s: &str) {
    ok(w::write_str(out, s));
}

fn opt_str(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => str_(out, s),
        None => ok(w::write_nil(out)),
    }
}

fn uint(out: &mut Vec<u8>, v: u64) {
    ok(w::write_uint(out, v));
}

fn opt_uint(out: &mut Vec<u8>, v: Option<u64>) {
    match v {
        Some(v) => uint(out, v),
        None => ok(w::write_nil(out)),
    }
}

fn hashes(out: &mut Vec<u8>, hs: &[u64]) {
    ok(w::write_array_len(out, hs.len() as u32));
    for &h in hs {
        uint(out, h);
    }
}

fn tokens(out: &mut Vec<u8>, t: &[u32], eagle: bool) {
    if eagle && t.len() >= 2 {
        ok(w::write_array_len(out, (t.len() - 1) as u32));
        for p in t.windows(2) {
            ok(w::write_array_len(out, 2));
            uint(out, p[0] as u64);
            uint(out, p[1] as u64);
        }
    } else {
        ok(w::write_array_len(out, t.len() as u32));
        for &x in t {
            uint(out, x as u64);
        }
    }
}

fn kind_str(k: GroupKind) -> &'static str {
    match k {
        GroupKind::MainAttention => "full_attention",
        GroupKind::Other => "sliding_window",
    }
}

/// Appends one batch `[ts, [events], dp_rank]` to `out`.
pub fn encode_batch(
    out: &mut Vec<u8>,
    ts: f64,
    events: &[KvEvent],
    dp_rank: Option<u32>,
    form: EventForm,
) {
    ok(w::write_array_len(out, 3));
    ok(w::write_f64(out, ts));
    ok(w::write_array_len(out, events.len() as u32));
    for e in events {
        encode_event(out, e, form);
    }
    opt_uint(out, dp_rank.map(u64::from));
}

/// Appends one event.
pub fn encode_event(out: &mut Vec<u8>, e: &KvEvent, form: EventForm) {
    match (e, form) {
        (KvEvent::Cleared, EventForm::Map) => {
            ok(w::write_map_len(out, 1));
            str_(out, "type");
            str_(out, "AllBlocksCleared");
        }
        (KvEvent::Cleared, EventForm::Array) => {
            ok(w::write_array_len(out, 1));
            str_(out, "AllBlocksCleared");
        }
        (KvEvent::Removed(r), EventForm::Map) => {
            let n = 3 + r.group.idx.is_some() as u32;
            ok(w::write_map_len(out, n));
            str_(out, "type");
            str_(out, "BlockRemoved");
            str_(out, "block_hashes");
            hashes(out, &r.block_hashes);
            str_(out, "medium");
            str_(out, medium_of(r.medium));
            if let Some(g) = r.group.idx {
                str_(out, "group_idx");
                uint(out, g as u64);
            }
        }
        (KvEvent::Removed(r), EventForm::Array) => {
            ok(w::write_array_len(out, 4));
            str_(out, "BlockRemoved");
            hashes(out, &r.block_hashes);
            str_(out, medium_of(r.medium));
            opt_uint(out, r.group.idx.map(u64::from));
        }
        (KvEvent::Stored(s), EventForm::Map) => {
            let n = 8
                + s.cache_salt.is_some() as u32
                + s.group.idx.is_some() as u32
                + s.group.kind.is_some() as u32;
            ok(w::write_map_len(out, n));
            str_(out, "type");
            str_(out, "BlockStored");
            str_(out, "block_hashes");
            hashes(out, &s.block_hashes);
            str_(out, "parent_block_hash");
            opt_uint(out, s.parent_hash);
            str_(out, "token_ids");
            tokens(out, &s.token_ids, s.eagle);
            str_(out, "block_size");
            uint(out, s.block_size as u64);
            str_(out, "lora_id");
            ok(w::write_nil(out));
            str_(out, "medium");
            str_(out, medium_of(s.medium));
            str_(out, "lora_name");
            opt_str(out, s.lora_name.as_deref());
            if let Some(salt) = &s.cache_salt {
                str_(out, "cache_salt");
                str_(out, salt);
            }
            if let Some(g) = s.group.idx {
                str_(out, "group_idx");
                uint(out, g as u64);
            }
            if let Some(k) = s.group.kind {
                str_(out, "kv_cache_spec_kind");
                str_(out, kind_str(k));
            }
        }
        (KvEvent::Stored(s), EventForm::Array) => {
            ok(w::write_array_len(out, 12));
            str_(out, "BlockStored");
            hashes(out, &s.block_hashes);
            opt_uint(out, s.parent_hash);
            tokens(out, &s.token_ids, s.eagle);
            uint(out, s.block_size as u64);
            ok(w::write_nil(out)); // lora_id
            str_(out, medium_of(s.medium));
            opt_str(out, s.lora_name.as_deref());
            ok(w::write_nil(out)); // extra_keys
            opt_uint(out, s.group.idx.map(u64::from));
            opt_str(out, s.group.kind.map(kind_str));
            ok(w::write_nil(out)); // sliding window
        }
    }
}
