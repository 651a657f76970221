//! The rules between a decoded batch and the real `Index` (kv-events.md
//! §5.3-§5.7): attention-group filtering, block size, content hashing with
//! LoRA / salt / EAGLE, tiers, ranks, and what gets counted when dropped.

use kvselect::hash::{local_block_hashes, salt_seed, sequence_hashes, PUBLIC_SEED};
use kvselect::index::{Index, Overlap, Tier, WorkerRank};
use kvselect::ingest::apply::{Applier, ApplyCounts};
use kvselect::ingest::decode::{
    decode_batch, BlockMm, Group, GroupKind, KvBatch, KvEvent, Removed, Stored,
};
use kvselect::ingest::encode::{encode_batch, EventForm};

const BS: u32 = 16;
const W: u64 = 11;

fn range(a: u32, b: u32) -> Vec<u32> {
    (a..=b).collect()
}

fn keys(tokens: &[u32], eagle: bool, lora: Option<&str>, salt: Option<&str>) -> Vec<u64> {
    let mut local = Vec::new();
    local_block_hashes(tokens, BS, eagle, salt_seed(lora, salt), None, &mut local);
    let mut k = Vec::new();
    sequence_hashes(&local, PUBLIC_SEED, &mut k);
    k
}

fn row(index: &Index, keys: &[u64], dp_rank: u32) -> Overlap {
    let mut out = Vec::new();
    index.overlap(keys, &mut out);
    out.into_iter()
        .find(|(wr, _)| {
            *wr == WorkerRank {
                worker_id: W,
                dp_rank,
            }
        })
        .map_or(Overlap::default(), |(_, o)| o)
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> Stored {
    Stored {
        block_hashes: hashes.to_vec(),
        parent_hash: parent,
        token_ids: tokens,
        eagle: false,
        block_size: BS,
        medium: Tier::Device,
        lora_name: None,
        cache_salt: None,
        mm_hashes: None,
        group: Group::default(),
    }
}

/// Goes through the wire on purpose: encode, decode, apply.
fn apply(ap: &mut Applier, index: &Index, events: Vec<KvEvent>, dp: Option<u32>) -> ApplyCounts {
    let mut p = Vec::new();
    encode_batch(&mut p, 0.0, &events, dp, EventForm::Map);
    let b: KvBatch = decode_batch(&p).unwrap();
    let mut c = ApplyCounts::default();
    ap.apply(index, &b, &mut c);
    c
}

#[test]
fn stores_chain_and_removals_match_request_keys() {
    let index = Index::new();
    let mut ap = Applier::new(W, 0, BS);
    let prompt = range(1, 64);
    let k = keys(&prompt, false, None, None);
    let c = apply(
        &mut ap,
        &index,
        vec![
            KvEvent::Stored(stored(&[1, 2], None, range(1, 32))),
            KvEvent::Stored(stored(&[3, 4], Some(2), range(33, 64))),
        ],
        None,
    );
    assert_eq!((c.events_applied, c.blocks_stored), (2, 4));
    assert_eq!(row(&index, &k, 0).device, 4);
    let c = apply(
        &mut ap,
        &index,
        vec![KvEvent::Removed(Removed {
            block_hashes: vec![2],
            medium: Tier::Device,
            group: Group::default(),
        })],
        None,
    );
    assert_eq!(c.blocks_removed, 1);
    // Removing block 2 makes its descendants unreachable.
    assert_eq!(row(&index, &k, 0).device, 1);
}

#[test]
fn tiers_are_cumulative_and_clear_removes_every_tier() {
    let index = Index::new();
    let mut ap = Applier::new(W, 0, BS);
    let k = keys(&range(1, 64), false, None, None);
    let mut gpu = stored(&[1, 2], None, range(1, 32));
    let mut cpu = stored(&[11, 12, 13, 14], None, range(1, 64));
    cpu.medium = Tier::HostPinned;
    let mut disk = stored(&[21, 22, 23, 24], None, range(1, 64));
    disk.medium = Tier::Disk;
    gpu.medium = Tier::Device;
    apply(
        &mut ap,
        &index,
        vec![
            KvEvent::Stored(gpu),
            KvEvent::Stored(cpu),
            KvEvent::Stored(disk),
        ],
        None,
    );
    let o = row(&index, &k, 0);
    assert_eq!(o.device, 2);
    assert_eq!(o.device + o.host_ext, 4);
    let c = apply(&mut ap, &index, vec![KvEvent::Cleared], None);
    assert_eq!(c.clears, 1);
    assert_eq!(row(&index, &k, 0), Overlap::default());
}

#[test]
fn batch_rank_wins_and_clear_all_covers_every_rank_fed() {
    let index = Index::new();
    let mut ap = Applier::new(W, 0, BS);
    let k = keys(&range(1, 16), false, None, None);
    apply(
        &mut ap,
        &index,
        vec![KvEvent::Stored(stored(&[1], None, range(1, 16)))],
        Some(3),
    );
    apply(
        &mut ap,
        &index,
        vec![KvEvent::Stored(stored(&[1], None, range(1, 16)))],
        None,
    );
    assert_eq!(row(&index, &k, 3).device, 1);
    assert_eq!(row(&index, &k, 0).device, 1);
    assert_eq!(ap.ranks(), [0, 3]);
    ap.clear_all(&index);
    assert_eq!(row(&index, &k, 3).device, 0);
    assert_eq!(row(&index, &k, 0).device, 0);
}

#[test]
fn lora_salt_and_eagle_change_the_content_hash() {
    let index = Index::new();
    let mut ap = Applier::new(W, 0, BS);
    let t = range(1, 32);
    let mut lora = stored(&[1, 2], None, t.clone());
    lora.lora_name = Some("adapter-a".into());
    let mut salted = stored(&[3, 4], None, t.clone());
    salted.cache_salt = Some("tenant-a".into());
    // EAGLE: 32 bigrams = 33 tokens = two bs+1 windows.
    let mut eagle = stored(&[5, 6], None, range(1, 33));
    eagle.eagle = true;
    apply(
        &mut ap,
        &index,
        vec![
            KvEvent::Stored(lora),
            KvEvent::Stored(salted),
            KvEvent::Stored(eagle),
        ],
        None,
    );
    assert_eq!(row(&index, &keys(&t, false, None, None), 0).device, 0);
    assert_eq!(
        row(&index, &keys(&t, false, Some("adapter-a"), None), 0).device,
        2
    );
    assert_eq!(
        row(&index, &keys(&t, false, None, Some("tenant-a")), 0).device,
        2
    );
    assert_eq!(
        row(&index, &keys(&range(1, 33), true, None, None), 0).device,
        2
    );
}

#[test]
fn non_main_groups_are_ignored_unless_learnt() {
    let index = Index::new();
    let mut ap = Applier::new(W, 0, BS);
    let k = keys(&range(1, 16), false, None, None);
    let with_group = |h: u64, idx: Option<u32>, kind: Option<GroupKind>| {
        let mut s = stored(&[h], None, range(1, 16));
        s.group = Group { idx, kind };
        KvEvent::Stored(s)
    };
    let c = apply(
        &mut ap,
        &index,
        vec![
            with_group(1, Some(0), Some(GroupKind::Other)), // sliding window
            with_group(2, Some(1), None),                   // unknown group 1
        ],
        None,
    );
    assert_eq!(c.events_ignored_group, 2);
    assert_eq!(row(&index, &k, 0).device, 0);
    // Group 2 is taught to be full attention by a store carrying the kind;
    // its later BlockRemoved (group_idx only) is then applied.
    let c = apply(
        &mut ap,
        &index,
        vec![with_group(3, Some(2), Some(GroupKind::MainAttention))],
        None,
    );
    assert_eq!(c.events_applied, 1);
    assert_eq!(row(&index, &k, 0).device, 1);
    let c = apply(
        &mut ap,
        &index,
        vec![KvEvent::Removed(Removed {
            block_hashes: vec![3],
            medium: Tier::Device,
            group: Group {
                idx: Some(2),
                kind: None,
            },
        })],
        None,
    );
    assert_eq!(c.blocks_removed, 1);
    assert_eq!(row(&index, &k, 0).device, 0);
}

#[test]
fn bad_stores_are_dropped_and_counted() {
    let index = Index::new();
    let mut ap = Applier::new(W, 0, BS);
    let mut bs32 = stored(&[1], None, range(1, 32));
    bs32.block_size = 32;
    let c = apply(
        &mut ap,
        &index,
        vec![
            KvEvent::Stored(bs32),
            // 3 hashes for 2 full blocks.
            KvEvent::Stored(stored(&[1, 2, 3], None, range(1, 40))),
            // Parent never stored.
            KvEvent::Stored(stored(&[4], Some(999), range(1, 16))),
            // Hash repeats its parent.
            KvEvent::Stored(stored(&[5, 6], None, range(1, 32))),
            KvEvent::Stored(stored(&[7], Some(6), range(33, 48))),
            KvEvent::Stored(stored(&[6], Some(6), range(33, 48))),
        ],
        None,
    );
    assert_eq!(c.stores_dropped_block_size, 1);
    assert_eq!(c.stores_dropped_shape, 1);
    assert_eq!(c.stores_dropped_unknown_parent, 1);
    assert_eq!(c.stores_dropped_self_reference, 1);
    assert_eq!(c.events_applied, 2);
    assert_eq!(
        row(&index, &keys(&range(1, 48), false, None, None), 0).device,
        3
    );
}

// ----- block_mm_infos and inherited salts, pinned to Dynamo 1.6.1 -----
//
// The numbers below are the `tokens_hash` values Dynamo 1.6.1's GET /dump
// showed for the same stores published to it over ZMQ (block size 4, see
// ARCHITECTURE.md "Multimodal blocks in KV events").

/// Index keys (the public chain) of content hashes given as numbers.
fn chain_of(local: &[u64]) -> Vec<u64> {
    let mut k = Vec::new();
    sequence_hashes(local, PUBLIC_SEED, &mut k);
    k
}

fn store4(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> Stored {
    Stored {
        block_size: 4,
        ..stored(hashes, parent, tokens)
    }
}

/// `block_mm_infos`, LoRA name, cache salt, Dynamo's two content hashes.
type MmCase = (
    BlockMm,
    Option<&'static str>,
    Option<&'static str>,
    [u64; 2],
);

#[test]
fn block_mm_infos_hash_as_the_reference_does() {
    let cases: [MmCase; 5] = [
        (
            vec![Some(vec![42]), None],
            None,
            None,
            [14000361058806882387, 16777012769546811212],
        ),
        (
            vec![None, Some(vec![42])],
            None,
            None,
            [14643705804678351452, 15219722816958438665],
        ),
        (
            vec![Some(vec![7, 3])],
            None,
            None,
            [3497545641356191295, 16777012769546811212],
        ),
        (
            vec![Some(vec![42]), None],
            Some("adapter-a"),
            None,
            [17870798172997178923, 5698110331184095209],
        ),
        (
            vec![Some(vec![42]), None],
            None,
            Some("tenant-a"),
            [1179317707491474123, 11202231085456067787],
        ),
    ];
    for (i, (mm, lora, salt, want)) in cases.into_iter().enumerate() {
        let index = Index::new();
        let mut ap = Applier::new(W, 0, 4);
        let mut s = store4(&[10, 11], None, range(1, 8));
        s.mm_hashes = Some(mm);
        s.lora_name = lora.map(Into::into);
        s.cache_salt = salt.map(Into::into);
        let c = apply(&mut ap, &index, vec![KvEvent::Stored(s)], None);
        assert_eq!(c.blocks_stored, 2, "case {i}");
        assert_eq!(row(&index, &chain_of(&want), 0).device, 2, "case {i}");
        // Plain tokens match at most the blocks without images.
        let plain = chain_of(&[14643705804678351452, 16777012769546811212]);
        let expect_plain = u32::from(i == 1);
        assert_eq!(row(&index, &plain, 0).device, expect_plain, "case {i}");
    }
}

/// A child store that names no salt (absent or "") takes its parent's, and
/// passes it on; one naming its own salt uses that. LoRA is not inherited.
#[test]
fn child_stores_inherit_the_parent_salt_as_the_reference_does() {
    let chain = |salts: [Option<&str>; 3], lora: [Option<&str>; 3], base: u32| {
        let index = Index::new();
        let mut ap = Applier::new(W, 0, 4);
        for i in 0..3u32 {
            let h = u64::from(base) * 10 + u64::from(i);
            let mut s = store4(
                &[h],
                (i > 0).then(|| h - 1),
                range(base * 100 + 1 + 4 * i, base * 100 + 4 + 4 * i),
            );
            s.cache_salt = salts[i as usize].map(Into::into);
            s.lora_name = lora[i as usize].map(Into::into);
            let c = apply(&mut ap, &index, vec![KvEvent::Stored(s)], None);
            assert_eq!(c.blocks_stored, 1);
        }
        (index, ap)
    };
    // Reference case 2: A, -, - (all three under A).
    let (index, _) = chain([Some("A"), None, None], [None; 3], 2);
    let want = [
        15741857537459240199,
        2513939586369685226,
        17699483198704287371,
    ];
    assert_eq!(row(&index, &chain_of(&want), 0).device, 3);
    // Reference case 3: A, B, - (the grandchild inherits B).
    let (index, _) = chain([Some("A"), Some("B"), None], [None; 3], 3);
    let want = [
        16982328497751873124,
        4947956004422305166,
        13770575599896816736,
    ];
    assert_eq!(row(&index, &chain_of(&want), 0).device, 3);
    // Reference case 4: A, "", - (empty is absent: inherits A).
    let (index, _) = chain([Some("A"), Some(""), None], [None; 3], 4);
    let t = range(401, 412);
    assert_eq!(row(&index, &keys4(&t, None, Some("A")), 0).device, 3);
    // Reference case 5: -, A, - (the root stays plain).
    let (index, _) = chain([None, Some("A"), None], [None; 3], 5);
    let want = [
        17138012588094636213,
        7762991077897862120,
        7696366397388037703,
    ];
    assert_eq!(row(&index, &chain_of(&want), 0).device, 3);
    // Reference case 1: LoRA on the root only: the children are plain.
    let (index, _) = chain([None; 3], [Some("adapter-a"), None, None], 1);
    let t = range(101, 112);
    assert_eq!(
        row(&index, &keys4(&t, Some("adapter-a"), None), 0).device,
        1
    );
    assert_eq!(row(&index, &keys4(&t, None, None), 0).device, 0);
}

/// The remembered salt leaves with its block: a parent removed and stored
/// again without a salt passes no salt on.
#[test]
fn removed_and_cleared_blocks_pass_no_salt_on() {
    let index = Index::new();
    let mut ap = Applier::new(W, 0, 4);
    let t = range(1, 8);
    let mut root = store4(&[1], None, range(1, 4));
    root.cache_salt = Some("A".into());
    apply(&mut ap, &index, vec![KvEvent::Stored(root)], None);
    apply(
        &mut ap,
        &index,
        vec![
            KvEvent::Removed(Removed {
                block_hashes: vec![1],
                medium: Tier::Device,
                group: Group::default(),
            }),
            KvEvent::Stored(store4(&[1], None, range(1, 4))),
            KvEvent::Stored(store4(&[2], Some(1), range(5, 8))),
        ],
        None,
    );
    assert_eq!(row(&index, &keys4(&t, None, None), 0).device, 2);
    let mut root = store4(&[3], None, range(1, 4));
    root.cache_salt = Some("A".into());
    apply(
        &mut ap,
        &index,
        vec![
            KvEvent::Cleared,
            KvEvent::Stored(root),
            KvEvent::Stored(store4(&[4], Some(3), range(5, 8))),
        ],
        None,
    );
    assert_eq!(row(&index, &keys4(&t, None, Some("A")), 0).device, 2);
    apply(
        &mut ap,
        &index,
        vec![
            KvEvent::Cleared,
            KvEvent::Stored(store4(&[3], None, range(1, 4))),
            KvEvent::Stored(store4(&[4], Some(3), range(5, 8))),
        ],
        None,
    );
    assert_eq!(row(&index, &keys4(&t, None, None), 0).device, 2);
}

fn keys4(tokens: &[u32], lora: Option<&str>, salt: Option<&str>) -> Vec<u64> {
    let mut local = Vec::new();
    local_block_hashes(tokens, 4, false, salt_seed(lora, salt), None, &mut local);
    chain_of(&local)
}

/// A batch of single-block removals (vLLM's form) is applied as runs per
/// tier; the result must be that of applying each event on its own: across
/// tier changes, an ignored group in the middle, repeats and unknown hashes.
#[test]
fn runs_of_removals_equal_one_event_at_a_time() {
    let rm = |h: u64, medium: Tier, group: Group| {
        KvEvent::Removed(Removed {
            block_hashes: vec![h],
            medium,
            group,
        })
    };
    let other = Group {
        idx: Some(3),
        kind: Some(GroupKind::Other),
    };
    let main = Group::default();
    let removals = vec![
        rm(4, Tier::Device, main),
        rm(3, Tier::Device, main),
        rm(14, Tier::HostPinned, main),
        rm(2, Tier::Device, other),
        rm(2, Tier::Device, main),
        rm(2, Tier::Device, main),
        rm(99, Tier::Device, main),
        rm(13, Tier::HostPinned, main),
    ];
    let k = keys(&range(1, 64), false, None, None);
    let fill = |index: &Index, ap: &mut Applier| {
        let mut cpu = stored(&[11, 12, 13, 14], None, range(1, 64));
        cpu.medium = Tier::HostPinned;
        apply(
            ap,
            index,
            vec![
                KvEvent::Stored(stored(&[1, 2, 3, 4], None, range(1, 64))),
                KvEvent::Stored(cpu),
            ],
            None,
        );
    };
    let batched = (Index::new(), &mut Applier::new(W, 0, BS));
    fill(&batched.0, batched.1);
    let c = apply(batched.1, &batched.0, removals.clone(), None);
    let single = (Index::new(), &mut Applier::new(W, 0, BS));
    fill(&single.0, single.1);
    let mut sum = ApplyCounts::default();
    for ev in removals {
        let one = apply(single.1, &single.0, vec![ev], None);
        sum.events_applied += one.events_applied;
        sum.blocks_removed += one.blocks_removed;
        sum.events_ignored_group += one.events_ignored_group;
    }
    assert_eq!(c, sum);
    assert_eq!(
        (c.events_applied, c.blocks_removed, c.events_ignored_group),
        (7, 5, 1)
    );
    let o = row(&batched.0, &k, 0);
    assert_eq!(o, row(&single.0, &k, 0));
    assert_eq!((o.device, o.device + o.host_ext), (1, 2));
    assert_eq!(batched.0.stats(), single.0.stats());
}
