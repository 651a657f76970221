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
