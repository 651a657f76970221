//! Hashing of u64 identities for the ledger's sharded maps.
//!
//! Identities are usually sequence hashes (already uniform), but precomputed
//! `sequence_hashes` come straight from clients and may be `1, 2, 3, ...` or
//! multiples of a power of two. So every identity is mixed once with a
//! per-process random key (folded 128-bit multiply) before it picks a shard or
//! a bucket. The shard takes bits 48..56 of the mixed value: hashbrown uses the
//! low bits for the bucket and the top 7 bits as the probe tag, so taking the
//! shard from either would make every key in a shard share them.

use std::hash::{BuildHasher, Hasher};

const MUL: u64 = 0x9E37_79B9_7F4A_7C15;

/// Folded multiply of `x` with a keyed constant.
#[inline]
pub(crate) fn mix(x: u64, key: u64) -> u64 {
    let m = u128::from(x ^ key).wrapping_mul(u128::from(MUL));
    (m as u64) ^ ((m >> 64) as u64)
}

/// Shard index in `0..shards` (`shards` a power of two, at most 256).
#[inline]
pub(crate) fn shard_of(mixed: u64, shards: usize) -> usize {
    ((mixed >> 48) as usize) & (shards - 1)
}

/// `BuildHasher` for maps keyed by one u64 identity.
#[derive(Clone, Copy)]
pub(crate) struct IdentBuild {
    pub(crate) key: u64,
}

impl BuildHasher for IdentBuild {
    type Hasher = IdentHasher;
    fn build_hasher(&self) -> IdentHasher {
        IdentHasher {
            key: self.key,
            state: 0,
        }
    }
}

pub(crate) struct IdentHasher {
    key: u64,
    state: u64,
}

impl Hasher for IdentHasher {
    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.state = mix(x ^ self.state, self.key);
    }

    // Only u64 keys are hashed through here; any other input still hashes
    // deterministically, one byte at a time.
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
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
        let b = IdentBuild { key: 7 };
        assert_eq!(b.hash_one(42u64), mix(42, 7));
    }
}
