//! Block and sequence hashes, compatible with Dynamo's `public-xxh3-v1` and
//! `keyed-xxh3-v1` (spec `selection-api.md` §5).
//!
//! - A *local block hash* is XXH3-64 over one full block's tokens as
//!   little-endian `u32`s (plus, for multimodal blocks, the block's sorted
//!   `mm_hash`es as little-endian `u64`s), seeded from the LoRA name and cache
//!   salt. It is position independent: the index matches on it.
//! - A *sequence hash* chains local hashes so that it identifies a whole prefix.
//!   It is the booking identity of a block, and the index uses the public chain
//!   as its position-aware key.
//!
//! Everything here is pure: slices in, values out. A trailing partial block is
//! never hashed.

use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

/// Seed of the public block hash and of the public sequence chain.
pub const PUBLIC_SEED: u64 = 1337;

/// Seed of a block hash with the given LoRA name and cache salt (§5.1). Empty
/// strings behave exactly like absent values.
pub fn salt_seed(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    seed_with_salt_term(lora_name, cache_salt.and_then(salt_term))
}

/// What a non-empty cache salt adds to the seed (`None` for an empty salt).
/// The KV-event path keeps it per salted block, because a child store that
/// names no salt inherits its parent's (`ingest/apply.rs`).
pub fn salt_term(cache_salt: &str) -> Option<u64> {
    (!cache_salt.is_empty()).then(|| xxh3_64_with_seed(cache_salt.as_bytes(), 1))
}

/// [`salt_seed`] with the salt given as its [`salt_term`].
pub fn seed_with_salt_term(lora_name: Option<&str>, salt_term: Option<u64>) -> u64 {
    let mut seed = PUBLIC_SEED;
    if let Some(lora) = lora_name.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(lora.as_bytes(), 0));
    }
    if let Some(term) = salt_term {
        seed = seed.wrapping_add(term);
    }
    seed
}

/// Number of full blocks of `n` tokens: `floor(n / bs)`, or `floor((n-1) / bs)`
/// for eagle windows of `bs + 1` tokens.
pub fn block_count(n: usize, block_size: u32, eagle: bool) -> usize {
    let bs = block_size as usize;
    if bs == 0 {
        return 0;
    }
    if eagle {
        n.saturating_sub(1) / bs
    } else {
        n / bs
    }
}

/// The little-endian bytes of a token window, without copying on little-endian
/// targets.
#[inline]
fn token_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(tokens))
    } else {
        std::borrow::Cow::Owned(tokens.iter().flat_map(|t| t.to_le_bytes()).collect())
    }
}

/// Appends the local block hash of every full block of `tokens` to `out`.
///
/// `mm_hashes`, when given, holds per block the multimodal hashes to mix in
/// (`None` or an empty list for a plain block); they are hashed sorted
/// ascending, after the tokens.
pub fn local_block_hashes(
    tokens: &[u32],
    block_size: u32,
    eagle: bool,
    seed: u64,
    mm_hashes: Option<&[Option<Vec<u64>>]>,
    out: &mut Vec<u64>,
) {
    let bs = block_size as usize;
    let blocks = block_count(tokens.len(), block_size, eagle);
    let window = if eagle { bs + 1 } else { bs };
    out.reserve(blocks);
    let plain = mm_hashes.is_none_or(|m| m.iter().all(|x| x.as_ref().is_none_or(Vec::is_empty)));
    if plain && cfg!(target_endian = "little") {
        let bytes: &[u8] = bytemuck::cast_slice(tokens);
        // Common windows at a compile-time length: xxh3 then unrolls to the
        // exact mix steps of that length (about 1.7x the throughput).
        let done = match (bs, eagle) {
            (16, false) => fixed_windows::<64>(bytes, 64, blocks, seed, out),
            (16, true) => fixed_windows::<68>(bytes, 64, blocks, seed, out),
            (32, false) => fixed_windows::<128>(bytes, 128, blocks, seed, out),
            (32, true) => fixed_windows::<132>(bytes, 128, blocks, seed, out),
            (64, false) => fixed_windows::<256>(bytes, 256, blocks, seed, out),
            (64, true) => fixed_windows::<260>(bytes, 256, blocks, seed, out),
            _ => false,
        };
        if done {
            return;
        }
    }
    let mut sorted = Vec::new();
    for i in 0..blocks {
        let start = i * bs;
        let win = &tokens[start..start + window];
        let mm = mm_hashes
            .and_then(|m| m.get(i))
            .and_then(Option::as_ref)
            .filter(|m| !m.is_empty());
        let h = match mm {
            None => xxh3_64_with_seed(&token_bytes(win), seed),
            Some(mm) => {
                sorted.clear();
                sorted.extend_from_slice(mm);
                sorted.sort_unstable();
                let mut st = Xxh3::with_seed(seed);
                st.update(&token_bytes(win));
                for h in &sorted {
                    st.update(&h.to_le_bytes());
                }
                st.digest()
            }
        };
        out.push(h);
    }
}

/// `local_block_hashes` and then `sequence_hashes` of the result under
/// `chain_seed`, appended to `local` and `seq`, in one pass for the common
/// block sizes: each block's content hash does not depend on the chain, so the
/// CPU computes it while the (serial) chain link of the previous block is in
/// flight. Same values as the two calls.
#[allow(clippy::too_many_arguments)]
pub fn local_and_sequence_hashes(
    tokens: &[u32],
    block_size: u32,
    eagle: bool,
    seed: u64,
    chain_seed: u64,
    mm_hashes: Option<&[Option<Vec<u64>>]>,
    local: &mut Vec<u64>,
    seq: &mut Vec<u64>,
) {
    let plain = mm_hashes.is_none_or(|m| m.iter().all(|x| x.as_ref().is_none_or(Vec::is_empty)));
    if plain && cfg!(target_endian = "little") {
        let bytes: &[u8] = bytemuck::cast_slice(tokens);
        let blocks = block_count(tokens.len(), block_size, eagle);
        let args = (bytes, blocks, seed, chain_seed);
        let done = match (block_size, eagle) {
            (16, false) => fused_windows::<64>(args, 64, local, seq),
            (16, true) => fused_windows::<68>(args, 64, local, seq),
            (32, false) => fused_windows::<128>(args, 128, local, seq),
            (32, true) => fused_windows::<132>(args, 128, local, seq),
            (64, false) => fused_windows::<256>(args, 256, local, seq),
            (64, true) => fused_windows::<260>(args, 256, local, seq),
            _ => false,
        };
        if done {
            return;
        }
    }
    let start = local.len();
    local_block_hashes(tokens, block_size, eagle, seed, mm_hashes, local);
    sequence_hashes(&local[start..], chain_seed, seq);
}

#[inline(always)]
fn fused_windows<const W: usize>(
    (bytes, blocks, seed, chain_seed): (&[u8], usize, u64, u64),
    stride: usize,
    local: &mut Vec<u64>,
    seq: &mut Vec<u64>,
) -> bool {
    if blocks > 0 && (blocks - 1) * stride + W > bytes.len() {
        return false;
    }
    local.reserve(blocks);
    seq.reserve(blocks);
    let mut prev = 0;
    for i in 0..blocks {
        let Ok(w) = <&[u8; W]>::try_from(&bytes[i * stride..i * stride + W]) else {
            return false;
        };
        let h = xxh3_64_with_seed(w, seed);
        prev = if i == 0 {
            h
        } else {
            chain(prev, h, chain_seed)
        };
        local.push(h);
        seq.push(prev);
    }
    true
}

/// Hashes `blocks` windows of `W` bytes starting every `stride` bytes.
/// Returns false (doing nothing) if `bytes` is too short, which the callers'
/// block count rules out.
#[inline(always)]
fn fixed_windows<const W: usize>(
    bytes: &[u8],
    stride: usize,
    blocks: usize,
    seed: u64,
    out: &mut Vec<u64>,
) -> bool {
    if blocks > 0 && (blocks - 1) * stride + W > bytes.len() {
        return false;
    }
    for i in 0..blocks {
        let Ok(w) = <&[u8; W]>::try_from(&bytes[i * stride..i * stride + W]) else {
            return false;
        };
        out.push(xxh3_64_with_seed(w, seed));
    }
    true
}

/// One link of a sequence chain: `XXH3_64(le(prev) || le(local), seed)`.
#[inline]
pub fn chain(prev: u64, local: u64, seed: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&prev.to_le_bytes());
    buf[8..].copy_from_slice(&local.to_le_bytes());
    xxh3_64_with_seed(&buf, seed)
}

/// Appends the sequence hashes of `local` to `out` (§5.2): the first equals the
/// first local hash; each next one chains the previous sequence hash with the
/// next local hash under `chain_seed` (1337 in public mode).
pub fn sequence_hashes(local: &[u64], chain_seed: u64, out: &mut Vec<u64>) {
    out.reserve(local.len());
    let mut prev = 0;
    for (i, &h) in local.iter().enumerate() {
        prev = if i == 0 {
            h
        } else {
            chain(prev, h, chain_seed)
        };
        out.push(prev);
    }
}

/// Secret material of `keyed-xxh3-v1` tracking (§5.5).
#[derive(Clone)]
pub struct TrackingKey {
    pub key: [u8; 32],
    pub key_id: String,
}

impl std::fmt::Debug for TrackingKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrackingKey")
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

/// What identifies a keyed tracking domain.
pub struct KeyedDomain<'a> {
    pub model_name: &'a str,
    pub routing_group: &'a str,
    pub block_size: u32,
    pub cache_salt: Option<&'a str>,
    pub lora_name: Option<&'a str>,
    pub is_eagle: bool,
}

const KEYED_DOMAIN: &[u8] = b"dynamo.router.tracking-hash/keyed-xxh3-v1";

impl TrackingKey {
    /// `(block_seed, chain_seed)` of a keyed tracking domain.
    pub fn seeds(&self, d: &KeyedDomain<'_>) -> (u64, u64) {
        fn fixed(h: &mut blake3::Hasher, tag: u8, bytes: &[u8]) {
            h.update(&[tag]);
            h.update(&(bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        }
        fn optional(h: &mut blake3::Hasher, tag: u8, s: Option<&str>) {
            match s.filter(|s| !s.is_empty()) {
                None => {
                    h.update(&[tag, 0]);
                }
                Some(s) => {
                    h.update(&[tag, 1]);
                    h.update(&(s.len() as u64).to_le_bytes());
                    h.update(s.as_bytes());
                }
            }
        }
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(KEYED_DOMAIN);
        h.update(&[0]);
        fixed(&mut h, 1, self.key_id.as_bytes());
        fixed(&mut h, 2, d.model_name.as_bytes());
        fixed(&mut h, 3, d.routing_group.as_bytes());
        fixed(&mut h, 4, &d.block_size.to_le_bytes());
        optional(&mut h, 5, d.cache_salt);
        optional(&mut h, 6, d.lora_name);
        fixed(&mut h, 7, &[d.is_eagle as u8]);
        let digest = h.finalize();
        let b = digest.as_bytes();
        let block_seed = u64::from_le_bytes(b[0..8].try_into().unwrap());
        let chain_seed = u64::from_le_bytes(b[8..16].try_into().unwrap());
        (block_seed, chain_seed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(
        tokens: &[u32],
        bs: u32,
        eagle: bool,
        lora: Option<&str>,
        salt: Option<&str>,
    ) -> Vec<i64> {
        let mut local = Vec::new();
        local_block_hashes(tokens, bs, eagle, salt_seed(lora, salt), None, &mut local);
        let mut out = Vec::new();
        sequence_hashes(&local, PUBLIC_SEED, &mut out);
        out.into_iter().map(|h| h as i64).collect()
    }

    fn range(a: u32, b: u32) -> Vec<u32> {
        (a..=b).collect()
    }

    const V1: [i64; 4] = [
        -1583300653928780152,
        -5980354406663771828,
        960926348267535642,
        4923844688253642376,
    ];
    const V9: [i64; 3] = [
        6752489653130089168,
        9179783426037465070,
        -1110493754701239145,
    ];
    const V10: [i64; 4] = [
        6752489653130089168,
        9179783426037465070,
        -1110493754701239145,
        5272114047328302112,
    ];

    #[test]
    fn vector_01_02_full_blocks_and_partial_tail() {
        assert_eq!(seq(&range(1, 64), 16, false, None, None), V1);
        assert_eq!(seq(&range(1, 70), 16, false, None, None), V1);
    }

    #[test]
    fn vector_03_04_short_and_empty() {
        assert!(seq(&range(1, 15), 16, false, None, None).is_empty());
        assert!(seq(&[], 16, false, None, None).is_empty());
        assert!(seq(&[], 16, true, None, None).is_empty());
    }

    #[test]
    fn vector_05_to_08_block_sizes() {
        assert_eq!(
            seq(&range(1, 64), 32, false, None, None),
            [6399025751206689338, 5363944788349247025]
        );
        assert_eq!(
            seq(&range(1, 10), 4, false, None, None),
            [-3803038269031200164, 4945711292740353085]
        );
        assert_eq!(
            seq(&[7, 8, 9], 1, false, None, None),
            [
                -7434946186450102303,
                2981139977121471219,
                -5886198947169695428
            ]
        );
        assert_eq!(
            seq(&range(100, 109), 3, false, None, None),
            [
                4316466824175819665,
                8541951440943600741,
                2704221756428056394
            ]
        );
    }

    #[test]
    fn vector_09_to_13_eagle_windows() {
        assert_eq!(seq(&range(1, 64), 16, true, None, None), V9);
        assert_eq!(seq(&range(1, 65), 16, true, None, None), V10);
        // #13: an eagle partition with is_eagle:false hashes plain windows.
        assert_eq!(seq(&range(1, 65), 16, false, None, None), V1);
    }

    #[test]
    fn vector_14_to_18_lora_and_salt() {
        assert_eq!(
            seq(&range(1, 64), 16, false, Some("adapter-a"), None),
            [
                4377081107200288488,
                7377467575642017039,
                -46267199052646533,
                1112326616743196530
            ]
        );
        assert_eq!(
            seq(&range(1, 64), 16, false, None, Some("tenant-a")),
            [
                8175209796170318505,
                1199464708288223189,
                8909045955271374968,
                5834240986346145931
            ]
        );
        assert_eq!(
            seq(
                &range(1, 64),
                16,
                false,
                Some("adapter-a"),
                Some("tenant-a")
            ),
            [
                6479329714943191495,
                1048832103984355278,
                -7557696592854020439,
                8012940166391839893
            ]
        );
        assert_eq!(seq(&range(1, 64), 16, false, Some(""), Some("")), V1);
    }

    #[test]
    fn vector_19_20_extreme_tokens() {
        assert_eq!(
            seq(&[0; 32], 16, false, None, None),
            [5523182284766269584, 3102875163438626881]
        );
        assert_eq!(
            seq(&[u32::MAX; 16], 16, false, None, None),
            [9046446989928805549]
        );
    }

    #[test]
    fn vector_21_22_multimodal() {
        let tokens = range(0, 39);
        let mut local = Vec::new();
        let mm = vec![Some(vec![42u64]), None];
        local_block_hashes(&tokens, 16, false, PUBLIC_SEED, Some(&mm), &mut local);
        let mut out = Vec::new();
        sequence_hashes(&local, PUBLIC_SEED, &mut out);
        let out: Vec<i64> = out.into_iter().map(|h| h as i64).collect();
        assert_eq!(out, [-1150668130253449645, 8017126656147137792]);
        assert_eq!(
            seq(&tokens, 16, false, None, None),
            [-3136036677815684470, -4677586368451018952]
        );
    }

    #[test]
    fn supporting_values() {
        let mut local = Vec::new();
        local_block_hashes(&range(1, 64), 16, false, PUBLIC_SEED, None, &mut local);
        assert_eq!(
            local,
            [
                16863443419780771464,
                2287610619914608821,
                12129935312930971799,
                5453111288643762282
            ]
        );
        let mut local = Vec::new();
        local_block_hashes(&range(1, 65), 16, true, PUBLIC_SEED, None, &mut local);
        let local: Vec<i64> = local.into_iter().map(|h| h as i64).collect();
        assert_eq!(
            local,
            [
                6752489653130089168,
                -3923387398594483938,
                9119873847327268477,
                -8304392038066847110
            ]
        );
        let mut local = Vec::new();
        local_block_hashes(&range(1, 64), 32, false, PUBLIC_SEED, None, &mut local);
        assert_eq!(local, [6399025751206689338, 8774225238254794491]);
        assert_eq!(xxh3_64_with_seed(b"adapter-a", 0), 8842669519798866845);
        assert_eq!(salt_seed(Some("adapter-a"), None), 8842669519798868182);
        assert_eq!(xxh3_64_with_seed(b"tenant-a", 1), 1948188790972762749);
        assert_eq!(salt_seed(None, Some("tenant-a")), 1948188790972764086);
        assert_eq!(
            salt_seed(Some("adapter-a"), Some("tenant-a")),
            10790858310771630931
        );
        // Event side: a LoRA store of tokens 1..32.
        let mut local = Vec::new();
        local_block_hashes(
            &range(1, 32),
            16,
            false,
            salt_seed(Some("adapter-a"), None),
            None,
            &mut local,
        );
        assert_eq!(local, [4377081107200288488, 16216151377791080369]);
    }

    #[test]
    fn keyed_vector() {
        let key = TrackingKey {
            key: [0x5a; 32],
            key_id: "2026-01".into(),
        };
        let tokens: Vec<u32> = (0..12).collect();
        let run = |salt, lora| {
            let (block_seed, chain_seed) = key.seeds(&KeyedDomain {
                model_name: "model-a",
                routing_group: "tenant-a",
                block_size: 4,
                cache_salt: salt,
                lora_name: lora,
                is_eagle: false,
            });
            let mut local = Vec::new();
            local_block_hashes(&tokens, 4, false, block_seed, None, &mut local);
            let mut out = Vec::new();
            sequence_hashes(&local, chain_seed, &mut out);
            out.into_iter().map(|h| h as i64).collect::<Vec<_>>()
        };
        assert_eq!(
            run(Some("cache-a"), Some("adapter-a")),
            [
                4363769719052127296,
                -3448220111546932189,
                -4525829865824556860
            ]
        );
        assert_eq!(
            run(None, None),
            [
                9128120665308694112,
                3464444111544908762,
                -3717274867117557559
            ]
        );
    }

    #[test]
    fn fused_pass_equals_the_two_calls() {
        let mut x = 7u32;
        let tokens: Vec<u32> = (0..1000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x
            })
            .collect();
        let mm = [None, Some(vec![9u64, 3]), None];
        for bs in [1u32, 3, 16, 32, 64] {
            for eagle in [false, true] {
                for n in [0usize, 15, 16, 17, 64, 65, 999, 1000] {
                    for mmh in [None, Some(&mm[..])] {
                        for chain_seed in [PUBLIC_SEED, 42] {
                            let t = &tokens[..n];
                            let (mut l1, mut s1) = (vec![5], vec![6]);
                            local_block_hashes(t, bs, eagle, 99, mmh, &mut l1);
                            sequence_hashes(&l1[1..], chain_seed, &mut s1);
                            let (mut l2, mut s2) = (vec![5], vec![6]);
                            local_and_sequence_hashes(
                                t, bs, eagle, 99, chain_seed, mmh, &mut l2, &mut s2,
                            );
                            assert_eq!((&l1, &s1), (&l2, &s2), "bs {bs} eagle {eagle} n {n}");
                            // and the fixed-window fast path equals plain xxh3
                            let w = if eagle { bs + 1 } else { bs } as usize;
                            let plain: Vec<u64> = (0..block_count(n, bs, eagle))
                                .map(|i| {
                                    xxh3_64_with_seed(
                                        &token_bytes(&t[i * bs as usize..i * bs as usize + w]),
                                        99,
                                    )
                                })
                                .collect();
                            if mmh.is_none() {
                                assert_eq!(&l1[1..], &plain[..]);
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn block_count_rules() {
        assert_eq!(block_count(64, 16, false), 4);
        assert_eq!(block_count(64, 16, true), 3);
        assert_eq!(block_count(65, 16, true), 4);
        assert_eq!(block_count(0, 16, true), 0);
        assert_eq!(block_count(10, 0, false), 0);
    }
}
