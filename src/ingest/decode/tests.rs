//! Unit tests of the decoder: the medium table, group rules, the spec's
//! example bytes, frames, replay replies, and hostile lengths and nesting.

use super::*;

#[test]
fn medium_table() {
    for (m, t) in [
        (None, Some(Tier::Device)),
        (Some(""), Some(Tier::Device)),
        (Some("GPU"), Some(Tier::Device)),
        (Some("DEVICE"), Some(Tier::Device)),
        (Some("CPU"), Some(Tier::HostPinned)),
        (Some("CPU_PINNED"), Some(Tier::HostPinned)),
        (Some("CPU_TIER1"), Some(Tier::HostPinned)),
        (Some("CPU_TIER2"), Some(Tier::Disk)),
        (Some("DISK"), Some(Tier::Disk)),
        (Some("NVME"), Some(Tier::Disk)),
        (Some("STORAGE"), Some(Tier::Disk)),
        (Some("EXTERNAL"), Some(Tier::External)),
        (Some("NETWORK"), Some(Tier::External)),
        (Some("REMOTE"), Some(Tier::External)),
        (Some("SHARED"), Some(Tier::External)),
        (Some("gpu"), None),
        (Some("MARS"), None),
    ] {
        assert_eq!(tier_of_medium(m), t, "{m:?}");
    }
}

#[test]
fn group_rules() {
    let g = |idx, kind| Group { idx, kind };
    assert_eq!(g(None, None).is_main(), Some(true));
    assert_eq!(g(Some(0), None).is_main(), Some(true));
    assert_eq!(g(Some(1), None).is_main(), None);
    assert_eq!(
        g(Some(1), Some(GroupKind::MainAttention)).is_main(),
        Some(true)
    );
    assert_eq!(g(Some(0), Some(GroupKind::Other)).is_main(), Some(false));
    assert_eq!(kind_of("sliding_window"), GroupKind::Other);
    assert_eq!(kind_of("mla_attention"), GroupKind::MainAttention);
}

/// The BlockRemoved message of `kv-events.md` §3.2, byte for byte.
#[test]
fn spec_block_removed_bytes() {
    let mut p = vec![
        0x93, 0xcb, 0x41, 0xda, 0xc4, 0x09, 0x31, 0x8d, 0x25, 0xc6, 0x91, 0x84,
    ];
    p.extend_from_slice(b"\xa4type\xacBlockRemoved");
    p.extend_from_slice(b"\xacblock_hashes\x91\xcf\xe5\x7a\xc0\x88\xeb\x28\xb6\x77");
    p.extend_from_slice(b"\xa6medium\xa3GPU");
    p.extend_from_slice(b"\xa9group_idx\x00");
    p.push(0x00);
    let seq = 1u64.to_be_bytes();
    let m = decode_message(&[b"", &seq, &p]).unwrap();
    assert_eq!(m.seq, 1);
    assert_eq!(m.batch.dp_rank, Some(0));
    assert!(m.batch.ts > 1.7e9);
    assert_eq!(
        m.batch.events,
        vec![KvEvent::Removed(Removed {
            block_hashes: vec![0xe57a_c088_eb28_b677],
            medium: Tier::Device,
            group: Group {
                idx: Some(0),
                kind: None
            },
        })]
    );
    // Every strict prefix is an error, never a panic.
    for cut in 0..p.len() {
        assert!(decode_batch(&p[..cut]).is_err(), "prefix {cut}");
    }
    // So is a trailing byte.
    let mut q = p.clone();
    q.push(0xc0);
    assert_eq!(
        decode_batch(&q).unwrap_err().kind,
        DecodeErrorKind::Trailing
    );
}

#[test]
fn frames_and_seq() {
    assert_eq!(
        decode_message(&[b"", b"12345678"]).unwrap_err().kind,
        DecodeErrorKind::FrameCount { got: 2 }
    );
    assert_eq!(
        decode_message(&[b"", b"1234567", b"\x92\x00\x90"])
            .unwrap_err()
            .kind,
        DecodeErrorKind::SeqLength { got: 7 }
    );
    let m = decode_message(&[b"kv", &7u64.to_be_bytes(), b"\x92\x00\x90"]).unwrap();
    assert_eq!(m.seq, 7);
    assert!(m.batch.events.is_empty());
    assert_eq!(m.batch.dp_rank, None);
}

#[test]
fn replay_replies() {
    let end = u64::MAX.to_be_bytes();
    let s5 = 5u64.to_be_bytes();
    assert_eq!(
        decode_replay_reply(&[b"", &end, b""]).unwrap(),
        ReplayReply::End
    );
    assert_eq!(
        decode_replay_reply(&[b"", b"", &end, b""]).unwrap(),
        ReplayReply::End
    );
    assert_eq!(
        decode_replay_reply(&[b"", b"topic", &s5, b"xx"]).unwrap(),
        ReplayReply::Batch {
            seq: 5,
            payload: b"xx"
        }
    );
    assert_eq!(
        decode_replay_reply(&[b"", &s5, b"xx"]).unwrap(),
        ReplayReply::Batch {
            seq: 5,
            payload: b"xx"
        }
    );
    assert!(decode_replay_reply(&[b"x", &s5, b"xx"]).is_err());
    assert!(decode_replay_reply(&[b"", &s5]).is_err());
}

#[test]
fn huge_length_prefixes_are_rejected_without_allocating() {
    // array32 claiming 4 billion events in a 9-byte payload.
    let p = [0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0, 0xc0];
    assert_eq!(decode_batch(&p).unwrap_err().kind, DecodeErrorKind::Length);
    // map32 inside skip.
    let p = [0x93, 0x00, 0x90, 0xdf, 0xff, 0xff, 0xff, 0xff];
    assert!(decode_batch(&p).is_err());
    // str32 length overflowing.
    let p = [0x92, 0x00, 0x91, 0x91, 0xdb, 0xff, 0xff, 0xff, 0xff];
    assert_eq!(decode_batch(&p).unwrap_err().kind, DecodeErrorKind::Eof);
}

#[test]
fn deep_nesting_is_skipped_without_recursion() {
    // Batch map with an unknown key whose value nests 100k arrays.
    let mut p = vec![0x82, 0xa6];
    p.extend_from_slice(b"events");
    p.push(0x90);
    p.extend_from_slice(b"\xa1x");
    p.extend(std::iter::repeat_n(0x91, 100_000));
    p.push(0xc0);
    let b = decode_batch(&p).unwrap();
    assert!(b.events.is_empty());
}

// ----- multimodal fields (`mm.rs`) -----

/// A msgpack value, to spell test payloads the way engines build them.
enum V {
    Nil,
    U(u64),
    I(i64),
    F(f64),
    B(bool),
    S(&'static str),
    Bin(&'static [u8]),
    A(Vec<V>),
    M(Vec<(&'static str, V)>),
}

fn enc(v: &V, out: &mut Vec<u8>) {
    use rmp::encode as w;
    match v {
        V::Nil => w::write_nil(out).unwrap(),
        V::U(x) => drop(w::write_uint(out, *x).unwrap()),
        V::I(x) => drop(w::write_sint(out, *x).unwrap()),
        V::F(x) => w::write_f64(out, *x).unwrap(),
        V::B(x) => w::write_bool(out, *x).unwrap(),
        V::S(s) => w::write_str(out, s).unwrap(),
        V::Bin(b) => w::write_bin(out, b).unwrap(),
        V::A(xs) => {
            w::write_array_len(out, xs.len() as u32).unwrap();
            xs.iter().for_each(|x| enc(x, out));
        }
        V::M(kv) => {
            w::write_map_len(out, kv.len() as u32).unwrap();
            for (k, x) in kv {
                w::write_str(out, k).unwrap();
                enc(x, out);
            }
        }
    }
}

const IMG: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

/// A vLLM 0.34 `BlockStored` of two 4-token blocks, keys in msgspec's
/// declaration order under a map16 header, with `extra` keys appended.
fn vllm_store(extra_keys: V, extra: Vec<(&'static str, V)>) -> Vec<u8> {
    let mut kv = vec![
        ("type", V::S("BlockStored")),
        ("block_hashes", V::A(vec![V::U(1), V::U(u64::MAX)])),
        ("parent_block_hash", V::Nil),
        ("token_ids", V::A((1..=8).map(V::U).collect())),
        ("block_size", V::U(4)),
        ("lora_id", V::Nil),
        ("medium", V::S("GPU")),
        ("lora_name", V::Nil),
        ("extra_keys", extra_keys),
    ];
    kv.extend(extra);
    kv.push(("group_idx", V::U(0)));
    kv.push(("kv_cache_spec_kind", V::S("full_attention")));
    let mut ev = Vec::new();
    ev.push(0xde);
    ev.extend_from_slice(&(kv.len() as u16).to_be_bytes());
    for (k, x) in &kv {
        rmp::encode::write_str(&mut ev, k).unwrap();
        enc(x, &mut ev);
    }
    let mut p = vec![0x93, 0xcb];
    p.extend_from_slice(&1.7e9f64.to_bits().to_be_bytes());
    p.push(0x91);
    p.extend_from_slice(&ev);
    p.push(0x00);
    p
}

fn only_store(p: &[u8]) -> Stored {
    let b = decode_batch(p).unwrap();
    match &b.events[..] {
        [KvEvent::Stored(s)] => s.clone(),
        other => panic!("{other:?}"),
    }
}

fn mm(hashes: &[u64]) -> V {
    V::M(vec![(
        "mm_objects",
        V::A(
            hashes
                .iter()
                .map(|&h| {
                    V::M(vec![
                        ("mm_hash", V::U(h)),
                        ("offsets", V::A(vec![V::A(vec![V::U(0), V::U(2)])])),
                    ])
                })
                .collect(),
        ),
    )])
}

/// The layout vLLM's publisher writes for an image prompt: block 0 carries
/// the image as `[mm_identifier, offset]`, block 1 nothing. It decodes, and
/// (as in Dynamo 1.6.1) leaves no multimodal hashes behind.
#[test]
fn vllm_multimodal_store_decodes_and_extra_keys_change_nothing() {
    let p = vllm_store(
        V::A(vec![V::A(vec![V::A(vec![V::S(IMG), V::U(0)])]), V::Nil]),
        vec![],
    );
    let s = only_store(&p);
    assert_eq!(s.block_hashes, vec![1, u64::MAX]);
    assert_eq!(s.token_ids, (1..=8).collect::<Vec<_>>());
    assert_eq!(s.mm_hashes, None);
    assert_eq!(s.cache_salt, None);
    // Same event with plain `[nil, nil]` extra keys: identical.
    assert_eq!(
        only_store(&vllm_store(V::A(vec![V::Nil, V::Nil]), vec![])),
        s
    );
    for cut in 0..p.len() {
        assert!(decode_batch(&p[..cut]).is_err(), "prefix {cut}");
    }
}

#[test]
fn block_mm_infos_are_read_per_block() {
    let p = vllm_store(
        V::A(vec![V::Nil, V::Nil]),
        vec![("block_mm_infos", V::A(vec![mm(&[7, 3]), V::Nil]))],
    );
    assert_eq!(only_store(&p).mm_hashes, Some(vec![Some(vec![7, 3]), None]));
    // Structs as arrays (`[[ [mm_hash, offsets] ]]`), unknown keys, empty
    // offsets and u64::MAX are all accepted, as by the reference.
    let as_arrays = V::A(vec![V::A(vec![V::A(vec![V::A(vec![
        V::U(42),
        V::A(vec![V::A(vec![V::U(0), V::U(u64::MAX)])]),
    ])])])]);
    let p = vllm_store(V::Nil, vec![("block_mm_infos", as_arrays)]);
    assert_eq!(only_store(&p).mm_hashes, Some(vec![Some(vec![42])]));
    let odd = V::A(vec![V::M(vec![
        ("y", V::U(2)),
        (
            "mm_objects",
            V::A(vec![V::M(vec![
                ("offsets", V::A(vec![])),
                ("x", V::S("ignored")),
                ("mm_hash", V::U(u64::MAX)),
            ])]),
        ),
    ])]);
    let p = vllm_store(V::Nil, vec![("block_mm_infos", odd)]);
    assert_eq!(only_store(&p).mm_hashes, Some(vec![Some(vec![u64::MAX])]));
    let p = vllm_store(V::Nil, vec![("block_mm_infos", V::Nil)]);
    assert_eq!(only_store(&p).mm_hashes, None);
}

/// The positional form carries `block_mm_infos` right after `extra_keys`,
/// before `group_idx`.
#[test]
fn block_mm_infos_in_the_array_form() {
    let ev = V::A(vec![
        V::S("BlockStored"),
        V::A(vec![V::U(1), V::U(2)]),
        V::Nil,
        V::A((1..=8).map(V::U).collect()),
        V::U(4),
        V::Nil,
        V::S("GPU"),
        V::Nil,
        V::A(vec![V::A(vec![V::A(vec![V::S(IMG), V::U(0)])]), V::Nil]),
        V::A(vec![mm(&[42]), V::Nil]),
        V::U(0),
        V::S("full_attention"),
    ]);
    let mut p = Vec::new();
    enc(&V::A(vec![V::F(0.0), V::A(vec![ev]), V::Nil]), &mut p);
    let s = only_store(&p);
    assert_eq!(s.mm_hashes, Some(vec![Some(vec![42]), None]));
    assert_eq!(s.group.kind, Some(GroupKind::MainAttention));
}

/// Every `extra_keys` / `block_mm_infos` shape below was published to Dynamo
/// 1.6.1: the accepted ones were stored, the rejected ones failed the batch.
#[test]
fn extra_keys_and_block_mm_infos_grammar_matches_the_reference() {
    let item = |x: V| V::A(vec![V::A(vec![x]), V::Nil]);
    let pair = |a: V, b: V| item(V::A(vec![a, b]));
    let accepted = [
        V::Nil,
        V::A(vec![]),
        V::A(vec![V::Nil]),
        V::A(vec![V::Nil, V::Nil, V::Nil]),
        V::A(vec![V::A(vec![]), V::A(vec![])]),
        item(V::S("tenant-a")),
        item(V::Bin(b"\x01\x02")),
        item(V::U(u64::MAX)),
        item(V::I(-5)),
        item(V::B(true)),
        item(V::F(1.5)),
        item(V::A(vec![])),
        item(V::A(vec![V::U(1), V::U(2), V::U(3)])),
        item(V::A(vec![V::U(7)])),
        pair(V::U(255), V::U(255)),
        pair(V::S(IMG), V::U(0)),
        pair(V::S("h"), V::I(-1)),
        pair(V::S("h"), V::U(u64::MAX)),
        pair(V::Bin(b"x"), V::U(0)),
        V::A(vec![
            V::A(vec![
                V::S("adapter-a"),
                V::A(vec![V::S("h"), V::U(0)]),
                V::S("salt"),
                V::Bin(&[0; 32]),
            ]),
            V::A(vec![V::S("adapter-a")]),
        ]),
    ];
    for (i, ek) in accepted.into_iter().enumerate() {
        let p = vllm_store(ek, vec![]);
        assert!(decode_batch(&p).is_ok(), "accepted #{i}");
    }
    let rejected = [
        V::S("abc"),
        V::M(vec![("a", V::U(1))]),
        V::A(vec![V::U(5), V::Nil]),
        V::A(vec![V::S("abc"), V::Nil]),
        V::A(vec![V::M(vec![("a", V::U(1))]), V::Nil]),
        item(V::Nil),
        item(V::M(vec![("a", V::U(1))])),
        item(V::Bin(b"\xff")),
        item(V::A(vec![V::S("h")])),
        item(V::A(vec![V::S("h"), V::U(0), V::U(1)])),
        item(V::A(vec![V::A(vec![V::U(1), V::U(2)]), V::S("x")])),
        pair(V::U(1), V::S("h")),
        pair(V::U(1), V::I(-1)),
        pair(V::U(300), V::U(0)),
        pair(V::U(256), V::U(0)),
        pair(V::F(1.5), V::U(0)),
        pair(V::B(true), V::U(0)),
        pair(V::S("h"), V::F(1.5)),
        pair(V::S("h"), V::S("g")),
        pair(V::S("h"), V::Nil),
        pair(V::Bin(b"\xff"), V::U(0)),
    ];
    for (i, ek) in rejected.into_iter().enumerate() {
        let p = vllm_store(ek, vec![]);
        let e = decode_batch(&p).unwrap_err();
        assert!(
            matches!(
                e.kind,
                DecodeErrorKind::Shape { .. }
                    | DecodeErrorKind::Type { .. }
                    | DecodeErrorKind::InvalidUtf8
            ),
            "rejected #{i}: {e}"
        );
    }
    let obj = |h: V, off: V| {
        V::A(vec![V::M(vec![(
            "mm_objects",
            V::A(vec![V::M(vec![("mm_hash", h), ("offsets", off)])]),
        )])])
    };
    let ok_off = || V::A(vec![V::A(vec![V::U(0), V::U(2)])]);
    let bad_mm = [
        V::S("x"),
        V::M(vec![("a", V::U(1))]),
        V::A(vec![V::U(5)]),
        V::A(vec![V::M(vec![])]),
        V::A(vec![V::M(vec![("mm_objects", V::Nil)])]),
        V::A(vec![V::M(vec![(
            "mm_objects",
            V::A(vec![V::M(vec![("mm_hash", V::U(42))])]),
        )])]),
        obj(V::I(-1), ok_off()),
        obj(V::S("42"), ok_off()),
        obj(V::F(42.0), ok_off()),
        obj(V::U(42), V::Nil),
        obj(V::U(42), V::S("x")),
        obj(V::U(42), V::A(vec![V::A(vec![V::U(0), V::U(2), V::U(3)])])),
        obj(V::U(42), V::A(vec![V::A(vec![V::I(-1), V::U(2)])])),
        V::A(vec![V::A(vec![
            V::A(vec![V::A(vec![V::U(42), ok_off()])]),
            V::U(7),
        ])]),
        V::A(vec![V::A(vec![V::A(vec![V::A(vec![
            V::U(42),
            ok_off(),
            V::U(9),
        ])])])]),
    ];
    for (i, bmi) in bad_mm.into_iter().enumerate() {
        let p = vllm_store(V::Nil, vec![("block_mm_infos", bmi)]);
        assert!(decode_batch(&p).is_err(), "bad block_mm_infos #{i}");
    }
}

/// The committed fuzz seeds for multimodal stores decode to what they spell.
#[test]
fn multimodal_fuzz_seeds_decode() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/kv_event_decode/");
    let vllm = std::fs::read(format!("{dir}seed-vllm-0.34-multimodal-store")).unwrap();
    let s = only_store(&vllm);
    assert_eq!((s.block_hashes.len(), s.mm_hashes), (2, None));
    assert_eq!(s.lora_name.as_deref(), Some("adapter-a"));
    let bridge = std::fs::read(format!("{dir}seed-trtllm-bridge-block-mm-infos")).unwrap();
    let s = only_store(&bridge);
    assert_eq!(s.block_hashes, vec![(-5i64) as u64, 7]);
    assert_eq!(s.mm_hashes, Some(vec![Some(vec![42]), None]));
    assert_eq!(s.cache_salt.as_deref(), Some("tenant-a"));
}
