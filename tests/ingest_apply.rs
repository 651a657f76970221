//! The rules between a decoded batch and the real `Index` (kv-events.md
//! §5.3-§5.7): attention-group filtering, block size, content hashing with
//! LoRA / salt / EAGLE, tiers, ranks, and what gets counted when dropped.

use kvselect::hash::{local_block_hashes, salt_seed, sequence_hashes, PUBLIC_SEED};
use kvselect::index::{Index, Overlap, Tier, WorkerRank};
use kvselect::ingest::apply::{Applier, ApplyCounts};
use kvselect::ingest::decode::{decode_batch, Group, GroupKind, KvBatch, KvEvent, Removed, Stored};
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
