//! JSON output that serde_json writes slowly: arrays of i64.
//!
//! A /select_and_reserve reply carries the prompt's `sequence_hashes`, one i64
//! per block (6,250 for a 100k-token prompt, ~125 KB of digits). serde_json
//! formats each with `itoa` and appends it with a `memmove` call of its own;
//! in the server that was ~8% of the request path. [`push_i64_array`] writes
//! the same bytes: on CPUs with the AVX-512 parts the token parser uses, eight
//! values at a time (below), else with `itoa` into reserved capacity.
//!
//! The AVX-512 step: each value's magnitude is split into three parts below
//! 10^8 (scalar: two divisions by a constant), and every part becomes eight
//! ASCII digits in a 64-bit lane by three multiply-shift rounds (/10^4, /100,
//! /10) over all eight values at once. Per value, a 32-byte slot holds a
//! prefix (`,` and `-`) and its 24 digits, leading zeros included; a byte
//! mask keeps the comma (not before the first value), the sign (negative
//! values only) and the digits from the first non-zero one, and `vpcompressb`
//! packs two slots into place per store.

// The AVX-512 writer: target-feature intrinsics and raw stores into reserved capacity.
#![allow(unsafe_code)]

/// Appends `[v0,v1,...]`, each value written as the i64 it encodes (the wire
/// form of block and sequence hashes); byte for byte serde_json's output.
pub fn push_i64_array(out: &mut Vec<u8>, values: &[u64]) {
    push_i64_array_on(out, values, true)
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
    let mut buf = itoa::Buffer::new();
    for (k, &v) in values.iter().enumerate().skip(done) {
        if k > 0 {
            out.push(b',');
        }
        out.extend_from_slice(buf.format(v as i64).as_bytes());
    }
    out.push(b']');
}

/// Longest element: a comma, a sign and 19 digits (i64::MIN).
const MAX_ELEMENT: usize = 21;

/// Bytes [`push_i64_array`] may need for `n` values (it reserves them): the
/// longest elements, the brackets, and the vector path's last store, which
/// writes a whole 64 bytes. Callers size their buffer with it.
pub fn i64_array_capacity(n: usize) -> usize {
    n * MAX_ELEMENT + 2 + 64
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::MAX_ELEMENT;
    use std::arch::x86_64::*;

    /// Values per step.
    const GROUP: usize = 8;
    const E8: u64 = 100_000_000;

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

#[cfg(test)]
mod tests {
    use super::*;

    /// The writers this CPU really runs, each with its name: `itoa` always,
    /// the AVX-512 step only where the CPU has it.
    fn paths() -> Vec<(bool, &'static str)> {
        let mut p = vec![(false, "itoa")];
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
}
