//! msgpack encoder for KV-event batches in the layouts real engines put on the
//! wire (`kv-events.md` §3): a test publisher's half of [`super::decode`].
//!
//! Owns: building payloads, the one encoder of this format in the project.
//! Compiled for unit tests and with the `testkit` feature only: integration
//! tests, benches, fuzzing and the load harness's mock engines use it; the
//! server never encodes events. Tests additionally pin the exact
//! bytes of the spec's captured examples, so this encoder and the decoder
//! cannot drift together unnoticed.

use super::decode::{GroupKind, KvEvent};
use crate::index::Tier;
use rmp::encode as w;

/// How events are laid out inside the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventForm {
    /// Tagged map with a `"type"` key (vLLM >= 0.24, SGLang, TRT-LLM bridge),
    /// as msgspec writes vLLM 0.34's structs: `BlockStored` declares 16 fields,
    /// so its header is map16 whatever the count; its keys are `type,
    /// block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
    /// lora_name, extra_keys` (one nil per block), then the set optional keys.
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

/// `block_mm_infos` as Dynamo's TRT-LLM bridge sends it: per block nil or
/// `{"mm_objects": [{"mm_hash", "offsets": []}]}` (offsets are not hashed).
fn block_mm_infos(out: &mut Vec<u8>, mm: &[Option<Vec<u64>>]) {
    ok(w::write_array_len(out, mm.len() as u32));
    for block in mm {
        let Some(hs) = block else {
            ok(w::write_nil(out));
            continue;
        };
        ok(w::write_map_len(out, 1));
        str_(out, "mm_objects");
        ok(w::write_array_len(out, hs.len() as u32));
        for &h in hs {
            ok(w::write_map_len(out, 2));
            str_(out, "mm_hash");
            uint(out, h);
            str_(out, "offsets");
            ok(w::write_array_len(out, 0));
        }
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
            let n = 9
                + s.cache_salt.is_some() as u16
                + s.mm_hashes.is_some() as u16
                + s.group.idx.is_some() as u16
                + s.group.kind.is_some() as u16;
            // map16 even below 16 keys, as msgspec writes a 16-field struct.
            out.push(0xde);
            out.extend_from_slice(&n.to_be_bytes());
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
            str_(out, "extra_keys");
            ok(w::write_array_len(out, s.block_hashes.len() as u32));
            out.resize(out.len() + s.block_hashes.len(), 0xc0);
            if let Some(salt) = &s.cache_salt {
                str_(out, "cache_salt");
                str_(out, salt);
            }
            if let Some(mm) = &s.mm_hashes {
                str_(out, "block_mm_infos");
                block_mm_infos(out, mm);
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
            ok(w::write_array_len(out, 12 + s.mm_hashes.is_some() as u32));
            str_(out, "BlockStored");
            hashes(out, &s.block_hashes);
            opt_uint(out, s.parent_hash);
            tokens(out, &s.token_ids, s.eagle);
            uint(out, s.block_size as u64);
            ok(w::write_nil(out)); // lora_id
            str_(out, medium_of(s.medium));
            opt_str(out, s.lora_name.as_deref());
            ok(w::write_nil(out)); // extra_keys
            if let Some(mm) = &s.mm_hashes {
                block_mm_infos(out, mm);
            }
            opt_uint(out, s.group.idx.map(u64::from));
            opt_str(out, s.group.kind.map(kind_str));
            ok(w::write_nil(out)); // sliding window
        }
    }
}

/// Seconds since the Unix epoch, as vLLM stamps its batches.
pub fn now_ts() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::decode::{Group, GroupKind, Removed, Stored};

    const GROUP0: Group = Group {
        idx: Some(0),
        kind: Some(GroupKind::MainAttention),
    };

    #[test]
    fn removed_event_matches_the_captured_vllm_bytes() {
        // Frame captured from vLLM 0.34 in kv-events.md §3.2 (ts aside).
        let mut out = Vec::new();
        let ts = f64::from_bits(0x41dac409318d25c6);
        let ev = KvEvent::Removed(Removed {
            block_hashes: vec![0xe57ac088eb28b677],
            medium: Tier::Device,
            group: Group {
                idx: Some(0),
                kind: None,
            },
        });
        encode_batch(&mut out, ts, &[ev], Some(0), EventForm::Map);
        let mut want = vec![
            0x93, 0xcb, 0x41, 0xda, 0xc4, 0x09, 0x31, 0x8d, 0x25, 0xc6, 0x91,
        ];
        want.push(0x84);
        want.push(0xa4);
        want.extend_from_slice(b"type");
        want.push(0xac);
        want.extend_from_slice(b"BlockRemoved");
        want.push(0xac);
        want.extend_from_slice(b"block_hashes");
        want.extend_from_slice(&[0x91, 0xcf, 0xe5, 0x7a, 0xc0, 0x88, 0xeb, 0x28, 0xb6, 0x77]);
        want.push(0xa6);
        want.extend_from_slice(b"medium");
        want.push(0xa3);
        want.extend_from_slice(b"GPU");
        want.push(0xa9);
        want.extend_from_slice(b"group_idx");
        want.push(0x00);
        want.push(0x00);
        assert_eq!(out, want);
    }

    #[test]
    fn stored_event_uses_a_map16_header() {
        let mut out = Vec::new();
        let ev = KvEvent::Stored(Stored {
            block_hashes: vec![1, 2],
            parent_hash: None,
            token_ids: vec![7; 32],
            eagle: false,
            block_size: 16,
            medium: Tier::Device,
            lora_name: None,
            cache_salt: None,
            mm_hashes: None,
            group: GROUP0,
        });
        encode_batch(&mut out, 1.0, &[ev], Some(0), EventForm::Map);
        assert_eq!(&out[10..14], &[0x91, 0xde, 0x00, 0x0b]);
    }
}
