//! Wire-format tests of the pure KV-event decoder: payloads written byte by
//! byte the way each engine release puts them on the wire (kv-events.md §3),
//! the encoder round trip, and a property test that arbitrary bytes never
//! panic the decoder.

use kvselect::index::Tier;
use kvselect::ingest::decode::{
    decode_batch, decode_message, DecodeErrorKind, Group, GroupKind, KvBatch, KvEvent, Removed,
    Stored,
};
use kvselect::ingest::encode::{encode_batch, EventForm};
use proptest::prelude::*;

// ---- hand-written msgpack, independent of the library encoder ----

fn s(out: &mut Vec<u8>, text: &str) {
    assert!(text.len() < 32);
    out.push(0xa0 | text.len() as u8);
    out.extend_from_slice(text.as_bytes());
}

fn u64_(out: &mut Vec<u8>, v: u64) {
    out.push(0xcf);
    out.extend_from_slice(&v.to_be_bytes());
}

fn fixint(out: &mut Vec<u8>, v: u8) {
    assert!(v < 128);
    out.push(v);
}

fn ts(out: &mut Vec<u8>) {
    out.push(0xcb);
    out.extend_from_slice(&1_777_000_000.25f64.to_be_bytes());
}

const H0: u64 = 1615469113370930379;
const H1: u64 = 16535740676137596535;

/// Body (keys and values, no header) of the spec's vLLM 0.34 GPU store of 2
/// blocks, tokens 1..=32: 11 keys.
fn stored_0_34_body(out: &mut Vec<u8>) {
    s(out, "type");
    s(out, "BlockStored");
    s(out, "block_hashes");
    out.push(0x92);
    u64_(out, H0);
    u64_(out, H1);
    s(out, "parent_block_hash");
    out.push(0xc0);
    s(out, "token_ids");
    out.extend_from_slice(&[0xdc, 0x00, 0x20]); // array16(32): fixarray holds at most 15
    for t in 1..=32 {
        fixint(out, t);
    }
    s(out, "block_size");
    fixint(out, 16);
    s(out, "lora_id");
    out.push(0xc0);
    s(out, "medium");
    s(out, "GPU");
    s(out, "lora_name");
    out.push(0xc0);
    s(out, "extra_keys");
    out.extend_from_slice(&[0x92, 0xc0, 0xc0]);
    s(out, "group_idx");
    fixint(out, 0);
    s(out, "kv_cache_spec_kind");
    s(out, "full_attention");
}

fn batch_with(event: &[u8], dp: u8) -> Vec<u8> {
    let mut p = vec![0x93];
    ts(&mut p);
    p.push(0x91);
    p.extend_from_slice(event);
    fixint(&mut p, dp);
    p
}

fn expected_store() -> Stored {
    Stored {
        block_hashes: vec![H0, H1],
        parent_hash: None,
        token_ids: (1..=32).collect(),
        eagle: false,
        block_size: 16,
        medium: Tier::Device,
        lora_name: None,
        cache_salt: None,
        mm_hashes: None,
        group: Group {
            idx: Some(0),
            kind: Some(GroupKind::MainAttention),
        },
    }
}

fn one_store(b: &KvBatch) -> &Stored {
    assert_eq!(b.events.len(), 1, "{b:?}");
    match &b.events[0] {
        KvEvent::Stored(s) => s,
        e => panic!("not a store: {e:?}"),
    }
}

#[test]
fn vllm_0_34_map16_header() {
    let mut ev = vec![0xde, 0x00, 0x0b];
    stored_0_34_body(&mut ev);
    let p = batch_with(&ev, 0);
    let m = decode_message(&[b"", &0u64.to_be_bytes(), &p]).unwrap();
    assert_eq!(m.seq, 0);
    assert_eq!(m.batch.ts, 1_777_000_000.25);
    assert_eq!(m.batch.dp_rank, Some(0));
    assert_eq!(one_store(&m.batch), &expected_store());
}

#[test]
fn vllm_0_24_fixmap_header_same_content() {
    let mut ev = vec![0x8b];
    stored_0_34_body(&mut ev);
    let b = decode_batch(&batch_with(&ev, 3)).unwrap();
    assert_eq!(b.dp_rank, Some(3));
    assert_eq!(one_store(&b), &expected_store());
}

#[test]
fn map_keys_in_any_order_and_unknown_keys_ignored() {
    // type last, plus 0.34's extra keys (locality LOCAL, session_id,
    // lookahead_token_ids nested arrays).
    let mut ev = vec![0x87];
    s(&mut ev, "session_id");
    s(&mut ev, "abc");
    s(&mut ev, "lookahead_token_ids");
    ev.extend_from_slice(&[0x92, 0x91, 0x05, 0x90]);
    s(&mut ev, "token_ids");
    ev.extend_from_slice(&[0x94, 1, 2, 3, 4]);
    s(&mut ev, "block_size");
    fixint(&mut ev, 4);
    s(&mut ev, "locality");
    s(&mut ev, "LOCAL");
    s(&mut ev, "block_hashes");
    ev.extend_from_slice(&[0x91, 0x07]);
    s(&mut ev, "type");
    s(&mut ev, "BlockStored");
    let b = decode_batch(&batch_with(&ev, 0)).unwrap();
    let st = one_store(&b);
    assert_eq!(st.block_hashes, [7]);
    assert_eq!(st.token_ids, [1, 2, 3, 4]);
    assert_eq!(st.medium, Tier::Device); // medium omitted (SGLang GPU)
    assert_eq!(st.parent_hash, None);
}

#[test]
fn vllm_0_23_array_events() {
    // ["BlockStored", hashes, parent, tokens, bs, lora_id, medium, lora_name,
    //  extra_keys, group_idx, kv_cache_spec_kind, sliding_window]
    let mut ev = vec![0x9c];
    s(&mut ev, "BlockStored");
    ev.push(0x91);
    u64_(&mut ev, H1);
    u64_(&mut ev, H0); // parent
    ev.extend_from_slice(&[0x94, 9, 8, 7, 6]);
    fixint(&mut ev, 4);
    ev.push(0xc0);
    s(&mut ev, "CPU");
    s(&mut ev, "adapter-a");
    ev.extend_from_slice(&[0x91, 0xc0]);
    fixint(&mut ev, 0);
    s(&mut ev, "full_attention");
    ev.push(0xc0);
    // ["BlockRemoved", hashes, medium, group_idx]
    let mut rm = vec![0x94];
    s(&mut rm, "BlockRemoved");
    rm.push(0x91);
    u64_(&mut rm, H1);
    s(&mut rm, "CPU");
    rm.push(0xc0);
    let mut p = vec![0x93];
    ts(&mut p);
    p.push(0x93);
    p.extend_from_slice(&ev);
    p.extend_from_slice(&rm);
    p.push(0x91);
    s(&mut p, "AllBlocksCleared");
    p.push(0xc0); // dp rank nil
    let b = decode_batch(&p).unwrap();
    assert_eq!(b.dp_rank, None);
    assert_eq!(b.events.len(), 3);
    let KvEvent::Stored(st) = &b.events[0] else {
        panic!()
    };
    assert_eq!(st.block_hashes, [H1]);
    assert_eq!(st.parent_hash, Some(H0));
    assert_eq!(st.token_ids, [9, 8, 7, 6]);
    assert_eq!(st.medium, Tier::HostPinned);
    assert_eq!(st.lora_name.as_deref(), Some("adapter-a"));
    assert_eq!(st.group.is_main(), Some(true));
    assert_eq!(
        b.events[1],
        KvEvent::Removed(Removed {
            block_hashes: vec![H1],
            medium: Tier::HostPinned,
            group: Group::default()
        })
    );
    assert_eq!(b.events[2], KvEvent::Cleared);
}

#[test]
fn vllm_0_11_and_0_9_array_forms_and_two_element_batch() {
    // 0.11: [tag, hashes, parent, tokens, bs, lora_id, medium]; 0.9 batch is
    // [ts, events] and BlockStored has no medium, BlockRemoved only hashes.
    let mut st = vec![0x96];
    s(&mut st, "BlockStored");
    st.extend_from_slice(&[0x91, 0x01, 0xc0, 0x92, 0x05, 0x06]);
    fixint(&mut st, 2);
    st.push(0xc0);
    let mut rm = vec![0x92];
    s(&mut rm, "BlockRemoved");
    rm.extend_from_slice(&[0x91, 0x01]);
    let mut p = vec![0x92];
    ts(&mut p);
    p.push(0x92);
    p.extend_from_slice(&st);
    p.extend_from_slice(&rm);
    let b = decode_batch(&p).unwrap();
    assert_eq!(b.dp_rank, None);
    let KvEvent::Stored(x) = &b.events[0] else {
        panic!()
    };
    assert_eq!((x.block_size, x.medium), (2, Tier::Device));
    assert_eq!(x.token_ids, [5, 6]);
    assert!(matches!(&b.events[1], KvEvent::Removed(r) if r.block_hashes == [1]));
}

#[test]
fn map_batch_is_accepted() {
    let mut p = vec![0x83];
    s(&mut p, "data_parallel_rank");
    fixint(&mut p, 2);
    s(&mut p, "ts");
    ts(&mut p);
    s(&mut p, "events");
    p.push(0x91);
    p.push(0x81);
    s(&mut p, "type");
    s(&mut p, "AllBlocksCleared");
    let b = decode_batch(&p).unwrap();
    assert_eq!(b.dp_rank, Some(2));
    assert_eq!(b.events, vec![KvEvent::Cleared]);
    // A map batch without events is malformed.
    let mut q = vec![0x81];
    s(&mut q, "ts");
    ts(&mut q);
    assert_eq!(
        decode_batch(&q).unwrap_err().kind,
        DecodeErrorKind::MissingField { field: "events" }
    );
}

#[test]
fn sglang_signed_hashes_salt_and_eagle_bigrams() {
    let mut ev = vec![0x86];
    s(&mut ev, "type");
    s(&mut ev, "BlockStored");
    s(&mut ev, "block_hashes");
    ev.push(0x91);
    ev.push(0xd3);
    ev.extend_from_slice(&(-5i64).to_be_bytes());
    s(&mut ev, "parent_block_hash");
    ev.push(0xff); // fixneg -1
    s(&mut ev, "token_ids");
    ev.extend_from_slice(&[0x93, 0x92, 1, 2, 0x92, 2, 3, 0x92, 3, 4]);
    s(&mut ev, "block_size");
    fixint(&mut ev, 3);
    s(&mut ev, "cache_salt");
    s(&mut ev, "tenant-a");
    let mut p = vec![0x93];
    ts(&mut p);
    p.push(0x91);
    p.extend_from_slice(&ev);
    p.push(0xc0);
    let b = decode_batch(&p).unwrap();
    let st = one_store(&b);
    assert_eq!(st.block_hashes, [(-5i64) as u64]);
    assert_eq!(st.parent_hash, Some(u64::MAX));
    assert!(st.eagle);
    assert_eq!(st.token_ids, [1, 2, 3, 4]);
    assert_eq!(st.cache_salt.as_deref(), Some("tenant-a"));
}

#[test]
fn bin_hashes_take_the_last_eight_bytes_big_endian() {
    let mut digest = [0u8; 32];
    for (i, b) in digest.iter_mut().enumerate() {
        *b = i as u8;
    }
    let mut ev = vec![0x83];
    s(&mut ev, "type");
    s(&mut ev, "BlockRemoved");
    s(&mut ev, "block_hashes");
    ev.extend_from_slice(&[0x91, 0xc4, 32]);
    ev.extend_from_slice(&digest);
    s(&mut ev, "medium");
    ev.push(0xc0);
    let b = decode_batch(&batch_with(&ev, 0)).unwrap();
    assert_eq!(
        b.events,
        vec![KvEvent::Removed(Removed {
            block_hashes: vec![0x18191a1b1c1d1e1f],
            medium: Tier::Device,
            group: Group::default()
        })]
    );
    // A 4-byte digest cannot be a 64-bit hash.
    let mut bad = vec![0x82];
    s(&mut bad, "type");
    s(&mut bad, "BlockRemoved");
    s(&mut bad, "block_hashes");
    bad.extend_from_slice(&[0x91, 0xc4, 4, 1, 2, 3, 4]);
    assert!(decode_batch(&batch_with(&bad, 0)).is_err());
}

#[test]
fn unusable_events_are_dropped_and_counted_not_fatal() {
    let removed = |medium: &str, locality: Option<&str>| {
        let mut ev = vec![0x83 + locality.is_some() as u8];
        s(&mut ev, "type");
        s(&mut ev, "BlockRemoved");
        s(&mut ev, "block_hashes");
        ev.extend_from_slice(&[0x91, 0x01]);
        s(&mut ev, "medium");
        s(&mut ev, medium);
        if let Some(l) = locality {
            s(&mut ev, "locality");
            s(&mut ev, l);
        }
        ev
    };
    let mut p = vec![0x93];
    ts(&mut p);
    p.push(0x95);
    p.extend_from_slice(&removed("gpu", None)); // case-sensitive: unknown
    p.extend_from_slice(&removed("MARS", None));
    p.extend_from_slice(&removed("CPU", Some("REMOTE")));
    p.push(0x81);
    s(&mut p, "type");
    s(&mut p, "BlockUpdated");
    p.extend_from_slice(&removed("DISK", Some("LOCAL")));
    p.push(0x00);
    let b = decode_batch(&p).unwrap();
    assert_eq!(b.dropped.unknown_medium, 2);
    assert_eq!(b.dropped.non_local, 1);
    assert_eq!(b.dropped.unknown_type, 1);
    assert_eq!(b.events.len(), 1);
    assert!(matches!(&b.events[0], KvEvent::Removed(r) if r.medium == Tier::Disk));
}

#[test]
fn structural_errors_fail_the_batch() {
    let cases: &[(&[u8], &str)] = &[
        (b"", "empty"),
        (b"\x91\xcb\0\0\0\0\0\0\0\0", "1-element batch"),
        (b"\x93\xa1x\x90\xc0", "string ts"),
        (b"\x93\x00\x90\xff", "negative rank"),
        (b"\x93\x00\x91\x81\xa4type\x05", "non-string tag"),
        (b"\x93\x00\x91\x80\xc0", "event without type"),
        (
            b"\x93\x00\x91\x92\xabBlockStored\x90\xc0",
            "short stored array",
        ),
        (b"\x93\x00\x90\xc0\xc1", "trailing reserved byte"),
        (
            b"\x93\x00\x91\x82\xa4type\xabBlockStored\xa9token_ids\x91\xff\xc0",
            "negative token",
        ),
    ];
    for (p, what) in cases {
        assert!(decode_batch(p).is_err(), "{what} should fail");
    }
}

fn sample_events() -> Vec<KvEvent> {
    vec![
        KvEvent::Stored(Stored {
            block_hashes: vec![1, u64::MAX, 1 << 40],
            parent_hash: Some(9),
            token_ids: (0..49).map(|t| t * 100_003).collect(),
            eagle: true,
            block_size: 16,
            medium: Tier::Disk,
            lora_name: Some("adapter-a".into()),
            cache_salt: Some("salt".into()),
            mm_hashes: None,
            group: Group {
                idx: Some(2),
                kind: Some(GroupKind::Other),
            },
        }),
        KvEvent::Removed(Removed {
            block_hashes: vec![u64::MAX - 1],
            medium: Tier::External,
            group: Group {
                idx: Some(0),
                kind: None,
            },
        }),
        KvEvent::Cleared,
    ]
}

#[test]
fn encoder_round_trips_in_both_forms() {
    for form in [EventForm::Map, EventForm::Array] {
        let mut events = sample_events();
        let mut p = Vec::new();
        if form == EventForm::Array {
            // The 0.23 array layout has no cache_salt slot.
            let KvEvent::Stored(st) = &mut events[0] else {
                panic!()
            };
            st.cache_salt = None;
        }
        encode_batch(&mut p, 12.5, &events, Some(7), form);
        let b = decode_batch(&p).unwrap();
        assert_eq!(b.ts, 12.5);
        assert_eq!(b.dp_rank, Some(7));
        assert_eq!(b.events, events, "{form:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_batch(&bytes);
        let _ = decode_message(&[b"", &bytes[..bytes.len().min(8)], &bytes]);
    }

    #[test]
    fn truncated_and_mutated_valid_batches_never_panic(
        cut in 0usize..400,
        flip_at in 0usize..400,
        flip in any::<u8>(),
    ) {
        let mut p = Vec::new();
        encode_batch(&mut p, 1.0, &sample_events(), Some(1), EventForm::Map);
        let cut = cut.min(p.len());
        let _ = decode_batch(&p[..cut]);
        if cut < p.len() {
            prop_assert!(decode_batch(&p[..cut]).is_err());
        }
        if flip_at < p.len() {
            p[flip_at] ^= flip;
            let _ = decode_batch(&p);
        }
    }
}
