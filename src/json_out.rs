//! JSON output that serde_json writes slowly: arrays of i64.
//!
//! A /select_and_reserve reply carries the prompt's `sequence_hashes`, one i64
//! per block (6,250 for a 100k-token prompt, ~125 KB of digits). serde_json
//! formats each with `itoa` and appends it with a `memmove` call of its own;
//! in the server that was ~8% of the request path. [`push_i64_array`] writes
//! the same bytes into capacity reserved up front: four values at a time
//! where the request's [`NumberPath`] (`--simd`) has AVX2 (also the AVX-512
//! path: an AVX-512 step with `vpcompressb` ran slower than the portable one,
//! harness/README.md "Replies"), else one at a time with the portable SWAR
//! step, which also writes a tail shorter than a group. Both split each
//! magnitude into three parts below 10^8 (two scalar divisions by a
//! constant, [`split`]) and turn every part into eight ASCII digits in a
//! 64-bit word by three multiply-shift rounds: /10^4 into the two 32-bit
//! halves, /100 into 16-bit lanes, /10 into bytes, plus `'0'` in every byte.
//!
//! The AVX2 step does the rounds over the twelve parts of four values in
//! three vectors (16-bit multiplies for the last two rounds), then writes
//! each value's three digit words with the portable step's stores.
//!
//! The portable step does the digit rounds in a general-purpose register
//! (SWAR: the lanes of one u64, kept apart by masks) and writes every piece
//! with an unconditional 8-byte unaligned store, advancing the write pointer
//! by the piece's real length: the `,-` prefix (advance 1, or 2 when
//! negative), the first non-zero part shifted past its leading zeros (counted
//! with one `trailing_zeros` of the word xor `'0'`s), then the remaining
//! parts as whole words. Bytes a store writes past the advance are garbage
//! that the next store overwrites, or spare capacity after the last. Uniform
//! 64-bit hashes are almost all at least 10^16 (three parts), so the one
//! branch on the width is predicted; there is no per-digit loop, no length
//! lookup and no `memmove` call per value.

// The AVX2 and SWAR writers: target-feature intrinsics and raw stores into
// reserved capacity.
#![allow(unsafe_code)]

use crate::parse::NumberPath;

/// Appends `[v0,v1,...]`, each value written as the i64 it encodes (the wire
/// form of block and sequence hashes); byte for byte serde_json's output.
/// `path` picks the vector step ([`NumberPath::effective`]); every path
/// writes the same bytes.
pub fn push_i64_array(out: &mut Vec<u8>, values: &[u64], path: NumberPath) {
    out.reserve(i64_array_capacity(values.len()));
    out.push(b'[');
    let done = vector_groups(out, values, path);
    swar::push_values(out, &values[done..], done > 0);
    out.push(b']');
}

/// Writes the whole groups at the start of `values` with `path`'s vector
/// step, if it has one, and returns how many values it wrote.
#[inline]
fn vector_groups(out: &mut Vec<u8>, values: &[u64], path: NumberPath) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        match path.effective() {
            // SAFETY: `effective` gives Avx2 only where AVX2, BMI1, LZCNT and
            // POPCNT were detected at run time, and Avx512 only where those
            // and the AVX-512 parts were.
            NumberPath::Avx2 | NumberPath::Avx512 => unsafe { avx2::push_groups(out, values) },
            NumberPath::Scalar | NumberPath::Sse41 | NumberPath::Auto => 0,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (out, values, path);
        0
    }
}

/// A value's sign and the three parts of its magnitude (each < 10^8; the
/// high one < 923), most significant first.
#[inline(always)]
fn split(v: u64) -> (bool, [u64; 3]) {
    let v = v as i64;
    let a = v.unsigned_abs();
    let q = a / E8;
    let lo = a - q * E8;
    let hi = q / E8;
    (v < 0, [hi, q - hi * E8, lo])
}

/// Longest element: a comma, a sign and 19 digits (i64::MIN).
const MAX_ELEMENT: usize = 21;

/// 10^8: each value's magnitude is written as three parts below it.
const E8: u64 = 100_000_000;

/// Bytes [`push_i64_array`] may need for `n` values (it reserves them): the
/// longest elements, the brackets, and the room past the written length that
/// the last store touches (up to 7 bytes past its value). Callers size
/// their buffer with it.
pub fn i64_array_capacity(n: usize) -> usize {
    n * MAX_ELEMENT + 2 + swar::OVERRUN
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{split, swar, MAX_ELEMENT};
    use std::arch::x86_64::*;

    /// Values per step.
    const GROUP: usize = 4;

    /// [`swar::digits8`] of each 64-bit lane (< 10^8), the same three rounds
    /// (the lane layout is the word's). The first round's multiplies take
    /// the low dword (x < 2^32); the other two work on 16-bit lanes, since
    /// every dword is then below 10^4 and every word below 100.
    #[target_feature(enable = "avx2,bmi1,lzcnt,popcnt")]
    fn digits8(x: __m256i) -> __m256i {
        // x / 10^4 == (x * 1759218605) >> 44 for x < 10^8.
        let q = _mm256_srli_epi64(_mm256_mul_epu32(x, _mm256_set1_epi64x(1_759_218_605)), 44);
        let r = _mm256_sub_epi64(x, _mm256_mul_epu32(q, _mm256_set1_epi64x(10_000)));
        let y = _mm256_or_si256(q, _mm256_slli_epi64(r, 32));
        // Each dword is below 10^4: y / 100 == ((y * 5243) >> 16) >> 3.
        let q = _mm256_srli_epi16(_mm256_mulhi_epu16(y, _mm256_set1_epi16(5243)), 3);
        let r = _mm256_sub_epi16(y, _mm256_mullo_epi16(q, _mm256_set1_epi16(100)));
        let z = _mm256_or_si256(q, _mm256_slli_epi32(r, 16));
        // Each word is below 100: z / 10 == (z * 103) >> 10.
        let q = _mm256_srli_epi16(_mm256_mullo_epi16(z, _mm256_set1_epi16(103)), 10);
        let r = _mm256_sub_epi16(z, _mm256_mullo_epi16(q, _mm256_set1_epi16(10)));
        let d = _mm256_or_si256(q, _mm256_slli_epi16(r, 8));
        _mm256_add_epi8(d, _mm256_set1_epi8(b'0' as i8))
    }

    /// [`digits8`] of four parts.
    #[target_feature(enable = "avx2,bmi1,lzcnt,popcnt")]
    pub(super) fn words(parts: &[u64; GROUP]) -> [u64; GROUP] {
        let mut w = [0u64; GROUP];
        // SAFETY: a [u64; 4] is exactly one unaligned 256-bit load or store.
        unsafe {
            let x = _mm256_loadu_si256(parts.as_ptr() as *const __m256i);
            _mm256_storeu_si256(w.as_mut_ptr() as *mut __m256i, digits8(x));
        }
        w
    }

    /// Writes the whole groups of four at the start of `values` (the first
    /// without a comma: it follows the `[`) and returns how many it wrote.
    #[target_feature(enable = "avx2,bmi1,lzcnt,popcnt")]
    pub(super) unsafe fn push_groups(out: &mut Vec<u8>, values: &[u64]) -> usize {
        let groups = values.len() / GROUP;
        out.reserve(groups * GROUP * MAX_ELEMENT + swar::OVERRUN);
        let base = out.len();
        let start = out.spare_capacity_mut().as_mut_ptr().cast::<u8>();
        let mut dst = start;
        for (g, vals) in values.chunks_exact(GROUP).enumerate() {
            let mut parts = [[0u64; GROUP]; 3];
            let mut negative = [false; GROUP];
            for k in 0..GROUP {
                let (neg, [hi, md, lo]) = split(vals[k]);
                negative[k] = neg;
                (parts[0][k], parts[1][k], parts[2][k]) = (hi, md, lo);
            }
            let [hi, md, lo] = [words(&parts[0]), words(&parts[1]), words(&parts[2])];
            for k in 0..GROUP {
                let w = [hi[k], md[k], lo[k]];
                // SAFETY: the reserve above holds groups * GROUP elements of
                // at most MAX_ELEMENT bytes each, written in turn from
                // `start`, plus the OVERRUN the last one's stores may reach.
                dst = unsafe {
                    if g == 0 && k == 0 {
                        swar::put::<false>(dst, negative[k], w)
                    } else {
                        swar::put::<true>(dst, negative[k], w)
                    }
                };
            }
        }
        // SAFETY: bytes base..base + (dst - start) were written above, within
        // the capacity.
        unsafe { out.set_len(base + dst.offset_from(start) as usize) };
        groups * GROUP
    }
}

/// The portable writer: one value per step, digits by SWAR arithmetic in a
/// u64, every piece an unconditional 8-byte store.
mod swar {
    use super::{split, MAX_ELEMENT};

    /// `'0'` in every byte.
    const ZEROS: u64 = 0x3030_3030_3030_3030;
    /// The prefix of an element after the first: `,` then `-` (the `-` is
    /// kept, by advancing past it, only for a negative value).
    const COMMA_MINUS: u64 = (b',' as u64) | (b'-' as u64) << 8;
    /// Bytes an element's last store may write past its end: an 8-byte
    /// store of a part of which at least one digit is kept.
    pub(super) const OVERRUN: usize = 7;

    /// Eight ASCII digits of `x` (< 10^8), most significant first in memory
    /// (byte 0 the lowest of the little-endian word), leading zeros included.
    ///
    /// Each round splits every lane into quotient (low half) and remainder
    /// (high half) as `(y << w) - q * ((d << w) - 1)`, which equals
    /// `q | (y - q * d) << w` without a borrow or carry between lanes (every
    /// lane's remainder is non-negative, and every product and shifted lane
    /// stays within its lane and below 2^64): one multiply for the quotient,
    /// one for the split.
    #[inline(always)]
    pub(super) fn digits8(x: u64) -> u64 {
        // x / 10^4 == (x * 1759218605) >> 44 for x < 10^8 (the product
        // stays below 2^58). The first four digits go to the low half, the
        // last four to the high.
        let q = (x * 1_759_218_605) >> 44;
        let y = (x << 32) - q * ((10_000 << 32) - 1);
        // Per 32-bit half (each < 10^4): y / 100 == (y * 5243) >> 19 for
        // y < 43699. A half's product is below 2^26, so it does not reach the
        // other half; the high half's product, shifted down by 19, lands at
        // bit 13 and up of the low half, which the 7-bit mask (quotients
        // < 100) clears.
        let q = ((y * 5243) >> 19) & 0x0000_007F_0000_007F;
        let z = (y << 16) - q * ((100 << 16) - 1);
        // Per 16-bit lane (each < 100): z / 10 == (z * 103) >> 10 for z < 179.
        // A lane's product is below 2^14 (within its lane); the next lane's,
        // shifted down by 10, lands at bit 6 and up, which the 4-bit mask
        // (quotients < 10) clears.
        let q = ((z * 103) >> 10) & 0x000F_000F_000F_000F;
        let d = (z << 8) - q * ((10 << 8) - 1);
        d + ZEROS
    }

    /// Leading `'0'` digits of a [`digits8`] word, at most 7: a zero part
    /// keeps its last digit.
    #[inline(always)]
    pub(super) fn leading_zeros(word: u64) -> usize {
        ((word ^ ZEROS).trailing_zeros() as usize / 8).min(7)
    }

    /// Writes the 8 bytes of `word` (byte 0 the lowest) at `dst`.
    ///
    /// # Safety
    /// `dst..dst + 8` is writable.
    #[inline(always)]
    unsafe fn store(dst: *mut u8, word: u64) {
        // SAFETY: the caller's bound; unaligned store.
        unsafe { dst.cast::<u64>().write_unaligned(word.to_le()) }
    }

    /// Writes one element (`,` first if `COMMA`, `-` if `negative`) whose
    /// magnitude's parts have the digit words `[hi, md, lo]` ([`digits8`]) at
    /// `dst` and returns the pointer past it. It is at most [`MAX_ELEMENT`]
    /// bytes long (20 without the comma), and the stores reach at most
    /// [`OVERRUN`] bytes further.
    ///
    /// # Safety
    /// `dst..dst + MAX_ELEMENT + OVERRUN` is writable.
    #[inline(always)]
    pub(super) unsafe fn put<const COMMA: bool>(
        dst: *mut u8,
        negative: bool,
        [hi, md, lo]: [u64; 3],
    ) -> *mut u8 {
        let (prefix, len) = if COMMA {
            (COMMA_MINUS, 1 + negative as usize)
        } else {
            (b'-' as u64, negative as usize)
        };
        // SAFETY: for every store and `add` below, the element is at most
        // MAX_ELEMENT bytes (comma, sign, 19 digits), and every store starts
        // within it and ends at most OVERRUN bytes past its end: the prefix
        // store ends within the first digit store's reach, a stripped part's
        // store ends at most 7 bytes past its last kept digit and is followed
        // by whole 8-byte parts, if any. The caller guarantees that much.
        unsafe {
            store(dst, prefix);
            let dst = dst.add(len);
            if hi != ZEROS {
                // a >= 10^16: almost every hash.
                let z = leading_zeros(hi);
                store(dst, hi >> (8 * z));
                let dst = dst.add(8 - z);
                store(dst, md);
                store(dst.add(8), lo);
                dst.add(16)
            } else if md != ZEROS {
                let z = leading_zeros(md);
                store(dst, md >> (8 * z));
                let dst = dst.add(8 - z);
                store(dst, lo);
                dst.add(8)
            } else {
                let z = leading_zeros(lo);
                store(dst, lo >> (8 * z));
                dst.add(8 - z)
            }
        }
    }

    /// [`put`] of a value (its parts' digits done here, one at a time).
    ///
    /// # Safety
    /// As for [`put`].
    #[inline(always)]
    unsafe fn put_value<const COMMA: bool>(dst: *mut u8, v: u64) -> *mut u8 {
        let (negative, parts) = split(v);
        // SAFETY: the caller's bound.
        unsafe { put::<COMMA>(dst, negative, parts.map(digits8)) }
    }

    /// Appends `values` as array elements, each after a comma except the
    /// first when `!comma_first` (it follows the `[`).
    pub(super) fn push_values(out: &mut Vec<u8>, values: &[u64], comma_first: bool) {
        // Already reserved by the caller in `push_i64_array` (a no-op there);
        // it makes the bound below local.
        out.reserve(values.len() * MAX_ELEMENT + OVERRUN);
        let base = out.len();
        let start = out.spare_capacity_mut().as_mut_ptr().cast::<u8>();
        let mut dst = start;
        let mut rest = values;
        if !comma_first {
            if let Some((&v, tail)) = values.split_first() {
                // SAFETY: the spare capacity holds values.len() * MAX_ELEMENT
                // + OVERRUN bytes, and each element (written in turn from
                // `start`) takes at most MAX_ELEMENT of them; the last may
                // write OVERRUN more.
                dst = unsafe { put_value::<false>(dst, v) };
                rest = tail;
            }
        }
        for &v in rest {
            // SAFETY: as above.
            dst = unsafe { put_value::<true>(dst, v) };
        }
        // SAFETY: the elements were written to base..base + (dst - start),
        // within the capacity (above).
        unsafe { out.set_len(base + dst.offset_from(start) as usize) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The writers this CPU really runs, each with its name: the portable
    /// SWAR step always; AVX2 (which the AVX-512 path also takes) only
    /// where the CPU has it (the paths of `--simd`).
    fn paths() -> Vec<(NumberPath, &'static str)> {
        let p = NumberPath::available();
        eprintln!("json_out paths tested: {}", NumberPath::names(&p));
        p
    }

    fn serde(values: &[u64]) -> Vec<u8> {
        let v: Vec<i64> = values.iter().map(|&h| h as i64).collect();
        serde_json::to_vec(&v).unwrap()
    }

    /// Every length up to a few groups (whole groups, then the scalar tail),
    /// edge values in every position of a group, and random hashes.
    #[test]
    fn equals_serde_json() {
        let paths = paths();
        let edges: Vec<u64> = [
            0i64,
            1,
            -1,
            9,
            10,
            99_999_999,
            100_000_000,
            -100_000_000,
            9_999_999_999_999_999,
            10_000_000_000_000_000,
            -10_000_000_000_000_000,
            1_000_000_000_000_000_000,
            i64::MAX,
            i64::MIN,
            i64::MIN + 1,
            -9,
            12_345_678_901_234,
        ]
        .iter()
        .map(|&v| v as u64)
        .collect();
        let mut x = 0x243F_6A88_85A3_08D3u64;
        let mut random = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Random widths too: shift by 0..63 bits.
            x >> (x % 64)
        };
        for len in 0..40 {
            for shift in 0..edges.len() {
                let values: Vec<u64> = (0..len)
                    .map(|i| {
                        if i % 3 == 0 {
                            edges[(i + shift) % edges.len()]
                        } else {
                            random()
                        }
                    })
                    .collect();
                for &(path, name) in &paths {
                    let mut out = b"{\"k\":".to_vec();
                    push_i64_array(&mut out, &values, path);
                    assert_eq!(
                        String::from_utf8(out[5..].to_vec()).unwrap(),
                        String::from_utf8(serde(&values)).unwrap(),
                        "{name}"
                    );
                }
            }
        }
        let big: Vec<u64> = (0..6_250).map(|_| random()).collect();
        for &(path, name) in &paths {
            let mut out = Vec::new();
            push_i64_array(&mut out, &big, path);
            assert_eq!(out, serde(&big), "{name}");
        }
        // `auto`: the widest path the CPU has.
        let mut out = Vec::new();
        push_i64_array(&mut out, &big, NumberPath::Auto);
        assert_eq!(out, serde(&big));
    }

    /// `digits8` for every input it takes (< 10^8), against division digit
    /// by digit: this covers each multiply-shift round over its whole input
    /// range (the comments in `digits8` give the reasoning). A debug build (some
    /// 20 times slower) checks every 97th input and the last thousand.
    #[test]
    fn digits8_exhaustive() {
        let step = if cfg!(debug_assertions) { 97 } else { 1 };
        for x in (0..E8).step_by(step).chain(E8 - 1_000..E8) {
            let mut expected = [0u8; 8];
            let mut rest = x;
            for d in expected.iter_mut().rev() {
                *d = b'0' + (rest % 10) as u8;
                rest /= 10;
            }
            let word = swar::digits8(x);
            assert_eq!(word, u64::from_le_bytes(expected), "{x}");
            let zeros = expected.iter().take_while(|&&d| d == b'0').count();
            assert_eq!(swar::leading_zeros(word), zeros.min(7), "{x}");
        }
    }

    /// The AVX2 step's digit rounds equal the SWAR ones for every input
    /// (four lanes at a time, each lane's inputs in turn).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_digits8_exhaustive() {
        if !crate::parse::avx2_available() {
            eprintln!("no AVX2 on this CPU: the AVX2 digit rounds are not tested here");
            return;
        }
        let step = if cfg!(debug_assertions) { 97 } else { 1 };
        let quarter = E8 / 4;
        for x in (0..quarter).step_by(step).chain(quarter - 1_000..quarter) {
            let parts = [x, x + quarter, x + 2 * quarter, x + 3 * quarter];
            // SAFETY: AVX2, BMI1, LZCNT and POPCNT were detected above.
            let words = unsafe { avx2::words(&parts) };
            assert_eq!(words, parts.map(swar::digits8), "{parts:?}");
        }
    }

    /// Random values of every width (0 to 19 digits) and both signs, and
    /// the edges: 0, i64::MIN, i64::MAX, every power of ten and its
    /// neighbours; alone, in runs of one width, and shuffled together.
    #[test]
    fn every_width_equals_serde_json() {
        let paths = paths();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut all: Vec<u64> = vec![0, i64::MIN as u64, i64::MAX as u64];
        for k in 0..=18 {
            let p = 10i64.pow(k);
            for v in [p - 1, p, p + 1] {
                all.extend([v as u64, v.wrapping_neg() as u64]);
            }
        }
        for digits in 1..=19u32 {
            let low = if digits == 1 {
                0
            } else {
                10u64.pow(digits - 1)
            };
            // 19 digits: up to i64::MAX (i64::MIN is among the edges).
            let high = 10u64.pow(digits).min(i64::MAX as u64 + 1);
            let width: Vec<u64> = (0..2_000)
                .map(|i| {
                    // Magnitude uniform in low..high, every other one negated.
                    let m = low + next() % (high - low);
                    if i % 2 == 0 {
                        m
                    } else {
                        m.wrapping_neg()
                    }
                })
                .collect();
            for &(path, name) in &paths {
                let mut out = Vec::new();
                push_i64_array(&mut out, &width, path);
                assert_eq!(out, serde(&width), "{name}, {digits} digits");
            }
            all.extend(width);
        }
        for &v in &all {
            for &(path, name) in &paths {
                let mut out = Vec::new();
                push_i64_array(&mut out, &[v], path);
                assert_eq!(out, serde(&[v]), "{name}, {}", v as i64);
            }
        }
        for i in (1..all.len()).rev() {
            all.swap(i, next() as usize % (i + 1));
        }
        for &(path, name) in &paths {
            for chunk in all.chunks(97) {
                let mut out = b"x".to_vec();
                push_i64_array(&mut out, chunk, path);
                assert_eq!(out[1..], serde(chunk), "{name}");
            }
        }
    }
}
