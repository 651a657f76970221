//! The AVX-512 run: the same contract as the AVX2 one, with no per-number
//! scalar work on the common path.
//!
//! Each step loads the 64 bytes at an element start `p` and keeps the part up
//! to the block's last comma: every number in it is complete. Bit masks prove
//! that part clean (digits, commas after digits, one space after a comma), and
//! hold each number's start and end as a bit. `vpcompressb` packs those bit
//! positions into bytes, in order; per group of eight numbers, `vpermb` gives
//! every 8-byte lane the byte indices of its number's last eight characters
//! (bytes before the number's start zeroed), and one `maddubs`/`madd`/
//! `mul_epu32` chain converts the eight lanes. The next step starts just past
//! the last comma, so a number never straddles two steps.
//!
//! A part with a number of more than 8 digits or a leading zero is converted
//! one number at a time, exactly; a step whose part is not clean (other
//! whitespace, the array's end, an error) or that has no comma ends the run
//! at `p`, and the scalar loop takes that element.
//! x86-64 only.

// Target-feature intrinsics and raw stores into reserved capacity.
#![allow(unsafe_code)]

use super::{exact_part, MARGIN, PREFETCH, SLOTS};
use std::arch::x86_64::*;

/// Byte k holds k.
static IOTA: [u8; 64] = {
    let mut a = [0u8; 64];
    let mut k = 0;
    while k < 64 {
        a[k] = k as u8;
        k += 1;
    }
    a
};
/// Byte j of every 8-byte lane holds 7 - j (how far before the number's
/// last digit the lane's byte j reads).
static BACK: [u8; 64] = {
    let mut a = [0u8; 64];
    let mut k = 0;
    while k < 64 {
        a[k] = 7 - (k % 8) as u8;
        k += 1;
    }
    a
};
/// For group g, byte j of lane q holds 8g + q: `vpermb` with it copies the
/// group's q-th packed position to all eight bytes of lane q.
static LANE_OF: [[u8; 64]; 4] = {
    let mut a = [[0u8; 64]; 4];
    let mut g = 0;
    while g < 4 {
        let mut k = 0;
        while k < 64 {
            a[g][k] = (8 * g + k / 8) as u8;
            k += 1;
        }
        g += 1;
    }
    a
};

#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2,bmi1,lzcnt,popcnt")]
fn load(a: &[u8; 64]) -> __m512i {
    // SAFETY: a 64-byte array is exactly one unaligned 512-bit load.
    unsafe { _mm512_loadu_si512(a.as_ptr() as *const _) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2,bmi1,lzcnt,popcnt")]
pub(super) unsafe fn u32_run(b: &[u8], i: usize, out: &mut Vec<u32>, max: usize) -> usize {
    let zero_c = _mm512_set1_epi8(b'0' as i8);
    let comma_c = _mm512_set1_epi8(b',' as i8);
    let space_c = _mm512_set1_epi8(b' ' as i8);
    let ten = _mm512_set1_epi8(10);
    let pairs = _mm512_set1_epi16(0x010A);
    let quads = _mm512_set1_epi32(0x0001_0064);
    let tenk = _mm512_set1_epi64(10_000);
    let iota = load(&IOTA);
    let back = load(&BACK);
    let lane_of = [
        load(&LANE_OF[0]),
        load(&LANE_OF[1]),
        load(&LANE_OF[2]),
        load(&LANE_OF[3]),
    ];
    let mut p = i;
    while p + MARGIN <= b.len() && out.len() + SLOTS <= max {
        // SAFETY: p + BLOCK <= b.len(): the load reads only bytes of `b`.
        let v = unsafe { _mm512_loadu_si512(b.as_ptr().add(p) as *const _) };
        // The next step's start depends on this load (through the last
        // comma), so a cache miss here stalls the whole chain: ask for
        // the line PREFETCH bytes ahead (a hint; it never faults).
        _mm_prefetch::<_MM_HINT_T0>(b.as_ptr().wrapping_add(p + PREFETCH) as *const i8);
        let comma = _mm512_cmpeq_epi8_mask(v, comma_c);
        if comma == 0 {
            break;
        }
        let last = 63 - comma.leading_zeros() as usize;
        // Bits 0..=last: the part of the block whose numbers are complete.
        let part = u64::MAX >> (63 - last);
        let digit = _mm512_cmplt_epu8_mask(_mm512_sub_epi8(v, zero_c), ten);
        let space = _mm512_cmpeq_epi8_mask(v, space_c);
        // Every comma follows a digit, every space a comma, except a
        // space at bit 0: `p` is an element start (the byte before it is
        // `[`, `,` or whitespace), so that one is whitespace before an
        // element.
        let bad =
            (!(digit | comma | space) | (comma & !(digit << 1)) | (space & !((comma << 1) | 1)))
                & part;
        if bad != 0 {
            break;
        }
        let starts = digit & !(digit << 1) & part;
        let ends = digit & (comma >> 1) & part;
        let n = starts.count_ones() as usize;
        // A run of 9+ digits starts where 9 digit bits in a row begin.
        let d2 = digit & (digit >> 1);
        let d4 = d2 & (d2 >> 2);
        let d9 = d4 & (d4 >> 4) & (digit >> 8);
        let zero = _mm512_cmpeq_epi8_mask(v, zero_c);
        let odd = ((d9 | (zero & (digit >> 1) & starts)) & part) != 0;
        out.reserve(SLOTS);
        let base = out.len();
        // SAFETY: `reserve(SLOTS)` guarantees SLOTS spare slots past `len`.
        let dst = unsafe { out.as_mut_ptr().add(base) };
        if !odd {
            let spos = _mm512_maskz_compress_epi8(starts, iota);
            let epos = _mm512_maskz_compress_epi8(ends, iota);
            let mut g = 0;
            while 8 * g < n {
                let e = _mm512_permutexvar_epi8(lane_of[g], epos);
                let s = _mm512_permutexvar_epi8(lane_of[g], spos);
                // Lane q, byte j reads block byte end_q - (7 - j); bytes
                // before the number's start (signed: may be below 0) are 0.
                let idx = _mm512_sub_epi8(e, back);
                let keep = _mm512_cmpge_epi8_mask(idx, s);
                let d = _mm512_maskz_permutexvar_epi8(keep, idx, v);
                let d = _mm512_maskz_sub_epi8(keep, d, zero_c);
                let d = _mm512_maddubs_epi16(d, pairs);
                let d = _mm512_madd_epi16(d, quads);
                let d = _mm512_add_epi64(_mm512_mul_epu32(d, tenk), _mm512_srli_epi64(d, 32));
                // SAFETY: 8g + 8 <= SLOTS (n <= 32), reserved above;
                // unaligned store. Lanes past n hold junk that `set_len`
                // leaves out.
                unsafe {
                    _mm256_storeu_si256(dst.add(8 * g) as *mut __m256i, _mm512_cvtepi64_epi32(d))
                };
                g += 1;
            }
        } else {
            // Exact, in order: the first element of another shape ends
            // the run with the elements before it kept.
            // SAFETY: slots base..base + n are reserved (n <= SLOTS).
            if let Err((k, q)) = unsafe { exact_part(b, p, starts, digit, dst) } {
                // SAFETY: exact_part wrote slots base..base + k.
                unsafe { out.set_len(base + k) };
                return q;
            }
        }
        // SAFETY: slots base..base + n were written above.
        unsafe { out.set_len(base + n) };
        p += last + 1;
    }
    p
}
