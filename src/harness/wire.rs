//! vLLM 0.34 KV-event wire encoding, publisher side (spec `kv-events.md` §2-§3).
//!
//! Owns the exact bytes a mock engine puts on its PUB socket: the 3 frames
//! `[topic, seq u64 BE, payload]`, and the msgpack payload
//! `[ts f64, [event, ...], data_parallel_rank]` with each event a tagged map in
//! the key order and header width that msgspec produces (`BlockStored` declares
//! 16 fields, so its header is map16 even with 11 keys present; `BlockRemoved`
//! declares 6, so fixmap). The encoder is hand-written because every value it
//! writes is one of six msgpack forms and writing into a `Vec` cannot fail;
//! tests decode it with the independent `rmp` reader.

/// One event of a batch, borrowed from the mock engine's state.
#[derive(Debug, Clone, Copy)]
pub enum Event<'a> {
    /// Newly cached full blocks, chained to `parent` (the engine hash of the
    /// block just before the first one, `None` at the root).
    Stored {
        block_hashes: &'a [u64],
        parent: Option<u64>,
        token_ids: &'a [u32],
        block_size: u32,
    },
    /// One evicted block (vLLM emits one event per evicted block).
    Removed { block_hash: u64 },
    /// Everything on the worker dropped (`reset_prefix_cache`).
    AllCleared,
}

/// Seq value of the replay end marker.
pub const END_MARKER_SEQ: u64 = u64::MAX;

fn put_uint(out: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        out.push(v as u8);
    } else if v <= u8::MAX as u64 {
        out.extend_from_slice(&[0xcc, v as u8]);
    } else if v <= u16::MAX as u64 {
        out.push(0xcd);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= u32::MAX as u64 {
        out.push(0xce);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let n = s.len();
    if n < 32 {
        out.push(0xa0 | n as u8);
    } else if n <= u8::MAX as usize {
        out.extend_from_slice(&[0xd9, n as u8]);
    } else {
        // Our keys and tags are all short; a longer string only comes from
        // the topic, which is a raw frame and never goes through here.
        out.push(0xda);
        out.extend_from_slice(&(n.min(u16::MAX as usize) as u16).to_be_bytes());
    }
    out.extend_from_slice(&s.as_bytes()[..n.min(u16::MAX as usize)]);
}

fn put_array_len(out: &mut Vec<u8>, n: usize) {
    if n < 16 {
        out.push(0x90 | n as u8);
    } else if n <= u16::MAX as usize {
        out.push(0xdc);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdd);
        out.extend_from_slice(&(n.min(u32::MAX as usize) as u32).to_be_bytes());
    }
}

const NIL: u8 = 0xc0;

fn put_event(out: &mut Vec<u8>, ev: &Event<'_>) {
    match *ev {
        Event::Stored {
            block_hashes,
            parent,
            token_ids,
            block_size,
        } => {
            // map16 with 11 present keys, as msgspec writes 0.34's BlockStored.
            out.extend_from_slice(&[0xde, 0x00, 0x0b]);
            put_str(out, "type");
            put_str(out, "BlockStored");
            put_str(out, "block_hashes");
            put_array_len(out, block_hashes.len());
            for &h in block_hashes {
                put_uint(out, h);
            }
            put_str(out, "parent_block_hash");
            match parent {
                Some(p) => put_uint(out, p),
                None => out.push(NIL),
            }
            put_str(out, "token_ids");
            put_array_len(out, token_ids.len());
            for &t in token_ids {
                put_uint(out, t as u64);
            }
            put_str(out, "block_size");
            put_uint(out, block_size as u64);
            put_str(out, "lora_id");
            out.push(NIL);
            put_str(out, "medium");
            put_str(out, "GPU");
            put_str(out, "lora_name");
            out.push(NIL);
            put_str(out, "extra_keys");
            put_array_len(out, block_hashes.len());
            out.resize(out.len() + block_hashes.len(), NIL);
            put_str(out, "group_idx");
            put_uint(out, 0);
            put_str(out, "kv_cache_spec_kind");
            put_str(out, "full_attention");
        }
        Event::Removed { block_hash } => {
            out.push(0x84);
            put_str(out, "type");
            put_str(out, "BlockRemoved");
            put_str(out, "block_hashes");
            put_array_len(out, 1);
            put_uint(out, block_hash);
            put_str(out, "medium");
            put_str(out, "GPU");
            put_str(out, "group_idx");
            put_uint(out, 0);
        }
        Event::AllCleared => {
            out.push(0x81);
            put_str(out, "type");
            put_str(out, "AllBlocksCleared");
        }
    }
}

/// Encodes one batch `[ts, events, dp_rank]` into `out` (cleared first).
pub fn encode_batch(out: &mut Vec<u8>, ts: f64, events: &[Event<'_>], dp_rank: u32) {
    out.clear();
    out.push(0x93);
    out.push(0xcb);
    out.extend_from_slice(&ts.to_bits().to_be_bytes());
    put_array_len(out, events.len());
    for ev in events {
        put_event(out, ev);
    }
    put_uint(out, dp_rank as u64);
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

    #[test]
    fn removed_event_matches_the_captured_vllm_bytes() {
        // Frame captured from vLLM 0.34 in kv-events.md §3.2 (ts aside).
        let mut out = Vec::new();
        let ts = f64::from_bits(0x41dac409318d25c6);
        encode_batch(
            &mut out,
            ts,
            &[Event::Removed {
                block_hash: 0xe57ac088eb28b677,
            }],
            0,
        );
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
        encode_batch(
            &mut out,
            1.0,
            &[Event::Stored {
                block_hashes: &[1, 2],
                parent: None,
                token_ids: &[7; 32],
                block_size: 16,
            }],
            0,
        );
        assert_eq!(&out[10..14], &[0x91, 0xde, 0x00, 0x0b]);
    }
}
