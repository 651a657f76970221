//! The one identity hasher: keys that are already hashes (sequence hashes,
//! node keys, engine hashes) or small ids (worker ids, dp ranks), spread by
//! one folded 64x64->128 multiply.
//!
//! Owns: [`mix`] (the function), [`shard_of`] (which bits pick a shard) and
//! [`FoldBuild`], the `BuildHasher` of every map keyed by such values in the
//! index and the ledger. Does not: hash tokens or prompts (`hash.rs`), or
//! resist an attacker who sees the output (it is a multiply, not a PRF).
//!
//! Why one multiply is enough: the folded product spreads every input bit
//! over the whole output, so hashbrown's bucket index (low bits) and tag (top
//! 7 bits) both vary even among keys that share their high bits (all keys of
//! one index shard do). Why a key: client-supplied identities (precomputed
//! `sequence_hashes`) may be `1, 2, 3, ...` or multiples of a power of two;
//! the ledger mixes them with a per-process random key so that clients
//! cannot choose collisions. The index uses key 0 (its keys are our own
//! hashes).

use std::hash::{BuildHasher, Hasher};

const MUL: u64 = 0x9E37_79B9_7F4A_7C15;

/// Folded multiply of `x ^ key` with a fixed odd constant.
#[inline]
pub(crate) fn mix(x: u64, key: u64) -> u64 {
    let m = u128::from(x ^ key).wrapping_mul(u128::from(MUL));
    (m as u64) ^ ((m >> 64) as u64)
}

/// Shard index in `0..shards` (`shards` a power of two, at most 256) of a
/// [`mix`]ed value. Bits 48..56: hashbrown uses the low bits for the bucket
/// and the top 7 bits as the probe tag, so a shard taken from either would
/// make every key in a shard share them.
#[inline]
pub(crate) fn shard_of(mixed: u64, shards: usize) -> usize {
    ((mixed >> 48) as usize) & (shards - 1)
}

/// `BuildHasher` for maps keyed by ids or hashes; `Default` is key 0.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct FoldBuild {
    pub(crate) key: u64,
}

impl BuildHasher for FoldBuild {
    type Hasher = FoldHasher;
    #[inline]
    fn build_hasher(&self) -> FoldHasher {
        FoldHasher {
            key: self.key,
            state: 0,
        }
    }
}

/// Each integer written is mixed into the state: `state = mix(v ^ state, key)`.
pub(crate) struct FoldHasher {
    key: u64,
    state: u64,
}

impl Hasher for FoldHasher {
    /// Maps hash integers (`write_u*`); other input still hashes
    /// deterministically, eight bytes at a time.
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for c in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            self.write_u64(u64::from_le_bytes(b));
        }
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.state = mix(v ^ self.state, self.key);
    }
    #[inline]
    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v))
    }
    #[inline]
    fn write_u8(&mut self, v: u8) {
        self.write_u64(u64::from(v))
    }
    #[inline]
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64)
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_identities_spread_over_shards() {
        let key = 0x1234_5678_9abc_def0;
        let mut counts = [0usize; 256];
        for x in 0..256 * 64u64 {
            counts[shard_of(mix(x << 20, key), 256)] += 1;
        }
        // 64 expected per shard; a poor mix would leave many shards empty.
        assert!(counts.iter().all(|&c| c > 16 && c < 160), "{counts:?}");
    }

    #[test]
    fn hasher_matches_mix() {
        let b = FoldBuild { key: 7 };
        assert_eq!(b.hash_one(42u64), mix(42, 7));
        // Key 0 (the index's maps) is the plain folded multiply.
        assert_eq!(FoldBuild::default().hash_one(42u64), mix(42, 0));
    }

    #[test]
    fn small_integers_hash_like_u64() {
        // Tuple keys such as (tier as u8, key) mix each field once.
        let b = FoldBuild::default();
        assert_eq!(b.hash_one((3u8, 9u64)), mix(9 ^ mix(3, 0), 0));
        assert_eq!(b.hash_one(5u32), mix(5, 0));
    }
}
