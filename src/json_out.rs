//! JSON output that serde_json writes slowly: arrays of i64.
//!
//! A /select_and_reserve reply carries the prompt's `sequence_hashes`, one i64
//! per block (6,250 for a 100k-token prompt, ~125 KB of digits). serde_json
//! formats each with `itoa` and appends it with a `memmove` call of its own;
//! in the server that was ~8% of the request path. [`push_i64_array`] writes
//! the same bytes into capacity reserved up front: on CPUs with the AVX-512
//! parts the token parser uses, eight values at a time; elsewhere, and for a
//! tail of fewer than eight, one value at a time with the portable SWAR step.
//! Both split each magnitude into three parts below 10^8 (scalar: two
//! divisions by a constant) and turn every part into eight ASCII digits in a
//! 64-bit word by three multiply-shift rounds: /10^4 into the two 32-bit
//! halves, /100 into 16-bit lanes, /10 into bytes, plus `'0'` in every byte.
//!
//! The AVX-512 step does the digit rounds over eight values at once. Per
//! value, a 32-byte slot holds a prefix (`,` and `-`) and its 24 digits,
//! leading zeros included; a byte mask keeps the comma (not before the first
//! value), the sign (negative values only) and the digits from the first
//! non-zero one, and `vpcompressb` packs two slots into place per store.
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

// The AVX-512 and SWAR writers: target-feature intrinsics and raw stores into
// reserved capacity.
#![allow(unsafe_code)]

/// Appends `[v0,v1,...]`, each value written as the i64 it encodes (the wire
/// form of block and sequence hashes); byte for byte serde_json's output.
pub fn push_i64_array(out: &mut Vec<u8>, values: &[u64]) {
    push_i64_array_on(out, values, true)
}

/// [`push_i64_array`] without the AVX-512 step, whatever the CPU: the
/// portable path on its own, for `benches/reply.rs`.
#[doc(hidden)]
pub fn push_i64_array_portable(out: &mut Vec<u8>, values: &[u64]) {
    push_i64_array_on(out, values, false)
}

/// [`push_i64_array`], with the AVX-512 step only if `vector` (and the CPU
/// has it): the tests hold the two paths to each other.
#[inline]
fn push_i64_array_on(out: &mut Vec<u8>, values: &[u64], vector: bool) {
    out.reserve(i64_array_capacity(values.len()));
    out.push(b'[');
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    {
        if vector && crate::parse::avx512_available() {
            // SAFETY: the AVX-512 parts, BMI1, LZCNT and POPCNT were detected
            // at run time.
            done = unsafe { avx512::push_groups(out, values) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = vector;
    swar::push_values(out, &values[done..], done > 0);
    out.push(b']');
}

/// Longest element: a comma, a sign and 19 digits (i64::MIN).
const MAX_ELEMENT: usize = 21;

/// 10^8: each value's magnitude is written as three parts below it.
const E8: u64 = 100_000_000;

/// Bytes [`push_i64_array`] may need for `n` values (it reserves them): the
/// longest elements, the brackets, and the room past the written length that
/// the last store touches (the vector path's writes a whole 64 bytes, the
/// portable path's up to 7 bytes past its value). Callers size their buffer
/// with it.
pub fn i64_array_capacity(n: usize) -> usize {
    n * MAX_ELEMENT + 2 + 64
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{E8, MAX_ELEMENT};
    use std::arch::x86_64::*;

    /// Values per step.
    const GROUP: usize = 8;

    /// Qword indices for `vpermt2q`, per output vector j (slots 2j, 2j+1):
    /// lanes 1/5 take the high parts' digits, lanes 2/6 the middle parts'
    /// (index + 8: the second table), other lanes are overwritten.
    static MID: [[i64; 8]; 4] = [
        [0, 0, 8, 0, 0, 1, 9, 0],
        [0, 2, 10, 0, 0, 3, 11, 0],
        [0, 4, 12, 0, 0, 5, 13, 0],
        [0, 6, 14, 0, 0, 7, 15, 0],
    ];
    /// Lanes 0/4 take the prefix (second table), lanes 3/7 the low parts.
    static LOW: [[i64; 8]; 4] = [
        [8, 0, 0, 0, 8, 0, 0, 1],
        [8, 0, 0, 2, 8, 0, 0, 3],
        [8, 0, 0, 4, 8, 0, 0, 5],
        [8, 0, 0, 6, 8, 0, 0, 7],
    ];
    /// Lanes of an output vector that come from `LOW`'s permute.
    const FROM_LOW: __mmask8 = 0b1001_1001;
    /// A slot's prefix lane: `,` at byte 6, `-` at byte 7.
    const PREFIX: i64 = ((b'-' as i64) << 56) | ((b',' as i64) << 48);
    /// Bytes of a slot that hold digits of the value (the high part's first
    /// four digits are always 0: it is below 1845).
    const DIGITS: u32 = 0xFFFF_F000;

    /// Eight ASCII digits of each 64-bit lane (< 10^8), most significant first
    /// in memory: /10^4 into the two dwords, /100 into words, /10 into bytes
    /// (all but the first with 16-bit multiplies, one micro-op each).
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2,bmi1,lzcnt,popcnt")]
    fn digits8(x: __m512i) -> __m512i {
        // x / 10^4 == (x * 1759218605) >> 44 for x < 10^8 (checked
        // exhaustively; it fails from about 3.15e9).
        let q = _mm512_srli_epi64(_mm512_mul_epu32(x, _mm512_set1_epi64(1_759_218_605)), 44);
        let r = _mm512_sub_epi64(x, _mm512_mul_epu32(q, _mm512_set1_epi64(10_000)));
        let y = _mm512_or_si512(q, _mm512_slli_epi64(r, 32));
        // Each dword is below 10^4, so its high word is 0: work on words.
        // y / 100 == ((y * 5243) >> 16) >> 3 for y < 43699.
        let q = _mm512_srli_epi16(_mm512_mulhi_epu16(y, _mm512_set1_epi16(5243)), 3);
        let r = _mm512_sub_epi16(y, _mm512_mullo_epi16(q, _mm512_set1_epi16(100)));
        let z = _mm512_or_si512(q, _mm512_slli_epi32(r, 16));
        // z / 10 == (z * 103) >> 10 for z < 179.
        let q = _mm512_srli_epi16(_mm512_mullo_epi16(z, _mm512_set1_epi16(103)), 10);
        let r = _mm512_sub_epi16(z, _mm512_mullo_epi16(q, _mm512_set1_epi16(10)));
        let d = _mm512_or_si512(q, _mm512_slli_epi16(r, 8));
        _mm512_add_epi8(d, _mm512_set1_epi8(b'0' as i8))
    }

    /// The byte mask of one slot: digits from the first non-zero one (the
    /// last digit for 0), the sign, the comma.
    #[inline(always)]
    fn keep(nonzero: u32, negative: bool, comma: bool) -> u32 {
        let nz = nonzero & DIGITS;
        let first = if nz == 0 { 31 } else { nz.trailing_zeros() };
        (u32::MAX << first) | ((negative as u32) << 7) | ((comma as u32) << 6)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2,bmi1,lzcnt,popcnt")]
    fn load(a: &[i64; 8]) -> __m512i {
        // SAFETY: an [i64; 8] is exactly one unaligned 512-bit load.
        unsafe { _mm512_loadu_si512(a.as_ptr() as *const _) }
    }

    /// Writes the whole groups of eight at the start of `values` (the first
    /// without a comma: it follows the `[`) and returns how many it wrote.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2,bmi1,lzcnt,popcnt")]
    pub(super) unsafe fn push_groups(out: &mut Vec<u8>, values: &[u64]) -> usize {
        let groups = values.len() / GROUP;
        // Each store writes 64 bytes and advances by at most two elements.
        out.reserve(groups * GROUP * MAX_ELEMENT + 64);
        let base = out.len();
        // SAFETY: the reserve above leaves room for every store below: the
        // written length stays within groups * GROUP * MAX_ELEMENT, plus 64
        // for the last store's full width.
        let start = unsafe { out.as_mut_ptr().add(base) };
        let mut dst = start;
        let prefix = _mm512_set1_epi64(PREFIX);
        let zero = _mm512_set1_epi8(b'0' as i8);
        let mid = MID.map(|a| load(&a));
        let low = LOW.map(|a| load(&a));
        for g in 0..groups {
            let vals = &values[g * GROUP..(g + 1) * GROUP];
            let (mut hi, mut md, mut lo) = ([0i64; GROUP], [0i64; GROUP], [0i64; GROUP]);
            let mut negative = [false; GROUP];
            for k in 0..GROUP {
                let v = vals[k] as i64;
                negative[k] = v < 0;
                let a = v.unsigned_abs();
                let q = a / E8;
                lo[k] = (a - q * E8) as i64;
                hi[k] = (q / E8) as i64;
                md[k] = (q - (q / E8) * E8) as i64;
            }
            let hi = digits8(load(&hi));
            let md = digits8(load(&md));
            let lo = digits8(load(&lo));
            for j in 0..GROUP / 2 {
                let t = _mm512_permutex2var_epi64(hi, mid[j], md);
                let u = _mm512_permutex2var_epi64(lo, low[j], prefix);
                let slots = _mm512_mask_blend_epi64(FROM_LOW, t, u);
                let nonzero = _mm512_cmpneq_epi8_mask(slots, zero);
                let (a, b) = (2 * j, 2 * j + 1);
                let m = keep(nonzero as u32, negative[a], g * GROUP + a > 0) as u64
                    | (keep((nonzero >> 32) as u32, negative[b], true) as u64) << 32;
                let packed = _mm512_maskz_compress_epi8(m, slots);
                // SAFETY: within the reserved capacity (see above); unaligned.
                unsafe {
                    _mm512_storeu_si512(dst as *mut _, packed);
                    dst = dst.add(m.count_ones() as usize);
                }
            }
        }
        // SAFETY: bytes base..base + (dst - start) were written above.
        unsafe { out.set_len(base + dst.offset_from(start) as usize) };
        groups * GROUP
    }
}

/// The portable writer: one value per step, digits by SWAR arithmetic in a
/// u64, every piece an unconditional 8-byte store.
mod swar {
    use super::{E8, MAX_ELEMENT};

    /// `'0'` in every byte.
    const ZEROS: u64 = 0x3030_3030_3030_3030;
    /// The prefix of an element after the first: `,` then `-` (the `-` is
    /// kept, by advancing past it, only for a negative value).
    const COMMA_MINUS: u64 = (b',' as u64) | (b'-' as u64) << 8;
    /// Bytes an element's last store may write past its end: an 8-byte
    /// store of a part of which at least one digit is kept.
    const OVERRUN: usize = 7;

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

    /// Writes one element (`,` first if `COMMA`) at `dst` and returns the
    /// pointer past it. It is at most [`MAX_ELEMENT`] bytes long (20 without
    /// the comma), and the stores reach at most [`OVERRUN`] bytes further.
    ///
    /// # Safety
    /// `dst..dst + MAX_ELEMENT + OVERRUN` is writable.
    #[inline(always)]
    unsafe fn put<const COMMA: bool>(dst: *mut u8, v: u64) -> *mut u8 {
        let v = v as i64;
        let negative = v < 0;
        let a = v.unsigned_abs();
        let q = a / E8;
        let lo = a - q * E8;
        let hi = q / E8; // < 923
        let md = q - hi * E8;
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
            if hi != 0 {
                // a >= 10^16: almost every hash.
                let w = digits8(hi);
                let z = leading_zeros(w);
                store(dst, w >> (8 * z));
                let dst = dst.add(8 - z);
                store(dst, digits8(md));
                store(dst.add(8), digits8(lo));
                dst.add(16)
            } else if md != 0 {
                let w = digits8(md);
                let z = leading_zeros(w);
                store(dst, w >> (8 * z));
                let dst = dst.add(8 - z);
                store(dst, digits8(lo));
                dst.add(8)
            } else {
                let w = digits8(lo);
                let z = leading_zeros(w);
                store(dst, w >> (8 * z));
                dst.add(8 - z)
            }
        }
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
                dst = unsafe { put::<false>(dst, v) };
                rest = tail;
            }
        }
        for &v in rest {
            // SAFETY: as above.
            dst = unsafe { put::<true>(dst, v) };
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
    /// SWAR step always, the AVX-512 step only where the CPU has it.
    fn paths() -> Vec<(bool, &'static str)> {
        let mut p = vec![(false, "swar")];
        if crate::parse::avx512_available() {
            p.push((true, "avx512"));
        }
        let names: Vec<&str> = p.iter().map(|&(_, n)| n).collect();
        eprintln!("json_out paths tested: {}", names.join(", "));
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
                for &(vector, name) in &paths {
                    let mut out = b"{\"k\":".to_vec();
                    push_i64_array_on(&mut out, &values, vector);
                    assert_eq!(
                        String::from_utf8(out[5..].to_vec()).unwrap(),
                        String::from_utf8(serde(&values)).unwrap(),
                        "{name}"
                    );
                }
            }
        }
        let big: Vec<u64> = (0..6_250).map(|_| random()).collect();
        for &(vector, name) in &paths {
            let mut out = Vec::new();
            push_i64_array_on(&mut out, &big, vector);
            assert_eq!(out, serde(&big), "{name}");
        }
        // The public entry point takes the widest path the CPU has.
        let mut out = Vec::new();
        push_i64_array(&mut out, &big);
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
            for &(vector, name) in &paths {
                let mut out = Vec::new();
                push_i64_array_on(&mut out, &width, vector);
                assert_eq!(out, serde(&width), "{name}, {digits} digits");
            }
            all.extend(width);
        }
        for &v in &all {
            for &(vector, name) in &paths {
                let mut out = Vec::new();
                push_i64_array_on(&mut out, &[v], vector);
                assert_eq!(out, serde(&[v]), "{name}, {}", v as i64);
            }
        }
        for i in (1..all.len()).rev() {
            all.swap(i, next() as usize % (i + 1));
        }
        for &(vector, name) in &paths {
            for chunk in all.chunks(97) {
                let mut out = b"x".to_vec();
                push_i64_array_on(&mut out, chunk, vector);
                assert_eq!(out[1..], serde(chunk), "{name}");
            }
        }
    }
}
