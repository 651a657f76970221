//! The SSE4.1 run: the AVX2 run's method with 128-bit parts, for x86-64
//! CPUs without AVX2 (x86-64-v2: older Xeons and Atoms, and guests whose
//! hypervisor CPU model hides AVX2). The step, the part it converts
//! ([`part`]) and the windows are the AVX2 run's (`avx2.rs`); here a vector
//! holds two numbers' windows, and `tzcnt`/`lzcnt` are not assumed (the bit
//! scans compile to `bsf`/`bsr`). x86-64 only.

// Target-feature intrinsics and raw stores into reserved capacity.
#![allow(unsafe_code)]

use super::{steps, BLOCK};
use std::arch::x86_64::*;

/// The 64-bit masks of one block: digits, commas, spaces, zeros.
#[target_feature(enable = "sse4.1,ssse3,popcnt")]
fn classify(b: &[u8], p: usize) -> [u64; 4] {
    debug_assert!(p + BLOCK <= b.len());
    let zero_c = _mm_set1_epi8(b'0' as i8);
    let comma_c = _mm_set1_epi8(b',' as i8);
    let space_c = _mm_set1_epi8(b' ' as i8);
    let shift = _mm_set1_epi8(0x50);
    let low = _mm_set1_epi8(-118);
    let mut m = [0u64; 4];
    for quarter in 0..BLOCK / 16 {
        // SAFETY: p + BLOCK <= b.len() (the caller checks p + MARGIN <=
        // b.len()), so each unaligned 16-byte load reads only bytes of `b`.
        let v = unsafe { _mm_loadu_si128(b.as_ptr().add(p + 16 * quarter) as *const __m128i) };
        // '0'..='9' + 0x50 are exactly the signed bytes -128..=-119.
        let digit = _mm_cmpgt_epi8(low, _mm_add_epi8(v, shift));
        let sh = 16 * quarter as u32;
        let mask = |x| (_mm_movemask_epi8(x) as u32 as u64) << sh;
        m[0] |= mask(digit);
        m[1] |= mask(_mm_cmpeq_epi8(v, comma_c));
        m[2] |= mask(_mm_cmpeq_epi8(v, space_c));
        m[3] |= mask(_mm_cmpeq_epi8(v, zero_c));
    }
    m
}

/// Byte order reversed within each 8-byte lane.
static REVERSE: [u8; 16] = [7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8];

/// The next two numbers of 1 to 8 digits whose last digits are the lowest
/// bits of `ends` (bits taken off), as two 4-digit values per 64-bit lane:
/// the AVX2 run's `quads4` for two lanes (its doc has the method). An
/// exhausted mask gives offset 64, whose lane is junk the caller leaves out.
///
/// # Safety
/// `w + 7` is a step start `p` with `p >= BEHIND` and `p + MARGIN` within
/// the body `w` points into.
#[target_feature(enable = "sse4.1,ssse3,popcnt")]
unsafe fn quads2(w: *const u8, ends: &mut u64) -> __m128i {
    let x = ends.trailing_zeros() as usize;
    *ends &= ends.wrapping_sub(1);
    let y = ends.trailing_zeros() as usize;
    *ends &= ends.wrapping_sub(1);
    // SAFETY: each offset is at most 64, so each 8-byte load reads
    // p - 7 + offset .. p + offset + 1 <= p + MARGIN: bytes of the body
    // (the caller's contract).
    let v = unsafe {
        _mm_castpd_si128(_mm_loadh_pd(
            _mm_castsi128_pd(_mm_loadl_epi64(w.add(x) as *const __m128i)),
            w.add(y) as *const f64,
        ))
    };
    // SAFETY: REVERSE is exactly 16 bytes (one unaligned 128-bit load).
    let rev = unsafe { _mm_loadu_si128(REVERSE.as_ptr() as *const __m128i) };
    let d = _mm_sub_epi8(_mm_shuffle_epi8(v, rev), _mm_set1_epi8(b'0' as i8));
    // 0xFF where the byte is not a digit (d >= 10 unsigned).
    let nd = _mm_cmpeq_epi8(_mm_max_epu8(d, _mm_set1_epi8(10)), d);
    // Per lane, the bits below the lowest non-digit byte.
    let keep = _mm_andnot_si128(nd, _mm_sub_epi64(nd, _mm_set1_epi64x(1)));
    let d = _mm_and_si128(d, keep);
    let d = _mm_maddubs_epi16(d, _mm_set1_epi16(0x0A01));
    _mm_madd_epi16(d, _mm_set1_epi32(0x0064_0001))
}

/// Two [`quads2`] results to four u32 values in order (`a`'s two, then
/// `c`'s): high * 10000 + low with one `madd`.
#[target_feature(enable = "sse4.1,ssse3,popcnt")]
fn finish4(a: __m128i, c: __m128i) -> __m128i {
    _mm_madd_epi16(_mm_packus_epi32(a, c), _mm_set1_epi32(0x2710_0001))
}

/// The next four numbers of the step into `dst`.
///
/// # Safety
/// As [`quads2`]; `dst` has room for four slots.
#[target_feature(enable = "sse4.1,ssse3,popcnt")]
unsafe fn four(w: *const u8, ends: &mut u64, dst: *mut u32) {
    // SAFETY: the caller's contract.
    let v = unsafe { finish4(quads2(w, ends), quads2(w, ends)) };
    // SAFETY: four slots at dst (the caller's contract); unaligned store.
    unsafe { _mm_storeu_si128(dst as *mut __m128i, v) };
}

/// The steps of [`super::steps`] with SSE4.1 parts: the AVX2 run's method
/// (`avx2.rs`) with two numbers per vector.
#[target_feature(enable = "sse4.1,ssse3,popcnt")]
pub(super) unsafe fn u32_run(b: &[u8], i: usize, out: &mut Vec<u32>, max: usize) -> usize {
    let convert = |w: *const u8, mut ends: u64, n: usize, dst: *mut u32| {
        // The first 12 unconditionally (a count that varies from step to
        // step would cost a mispredicted branch per step), then four at a
        // time.
        // SAFETY: `w` is 7 bytes before a step start p >= BEHIND with p +
        // MARGIN within the body, and SPARE slots at dst are reserved (the
        // contract of `steps`); slots k..k + 4 <= SPARE (k < n <= 32, k = 4j).
        unsafe {
            four(w, &mut ends, dst);
            four(w, &mut ends, dst.add(4));
            four(w, &mut ends, dst.add(8));
            let mut k = 12;
            while k < n {
                four(w, &mut ends, dst.add(k));
                k += 4;
            }
        }
    };
    // SAFETY: `classify` loads the 64 bytes at p (p + BLOCK <= p + MARGIN
    // <= b.len()); `convert` writes at most SPARE slots and loads windows
    // ending at offsets up to 64: the contract of `steps`.
    unsafe { steps(b, i, out, max, |b, p| classify(b, p), convert) }
}
