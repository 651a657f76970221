//! The AVX2 run: the AVX-512 run's steps with 256-bit parts (the contract
//! and the method are in `mod.rs`'s header). x86-64 only.

// Target-feature intrinsics and raw stores into reserved capacity.
#![allow(unsafe_code)]

use super::{steps, BLOCK};
use std::arch::x86_64::*;

/// Numbers converted per vector (one 64-bit lane each).
const GROUP: usize = 4;

/// The 64-bit masks of one block: digits, commas, spaces, zeros.
#[target_feature(enable = "avx2,bmi1,lzcnt,popcnt")]
fn classify(b: &[u8], p: usize) -> [u64; 4] {
    debug_assert!(p + BLOCK <= b.len());
    let zero_c = _mm256_set1_epi8(b'0' as i8);
    let comma_c = _mm256_set1_epi8(b',' as i8);
    let space_c = _mm256_set1_epi8(b' ' as i8);
    let shift = _mm256_set1_epi8(0x50);
    let low = _mm256_set1_epi8(-118);
    let mut m = [0u64; 4];
    for half in 0..BLOCK / 32 {
        // SAFETY: p + BLOCK <= b.len() (the caller checks p + MARGIN <=
        // b.len()), so each unaligned 32-byte load reads only bytes of `b`.
        let v = unsafe { _mm256_loadu_si256(b.as_ptr().add(p + 32 * half) as *const __m256i) };
        // '0'..='9' + 0x50 are exactly the signed bytes -128..=-119.
        let digit = _mm256_cmpgt_epi8(low, _mm256_add_epi8(v, shift));
        let sh = 32 * half as u32;
        let mask = |x| (_mm256_movemask_epi8(x) as u32 as u64) << sh;
        m[0] |= mask(digit);
        m[1] |= mask(_mm256_cmpeq_epi8(v, comma_c));
        m[2] |= mask(_mm256_cmpeq_epi8(v, space_c));
        m[3] |= mask(_mm256_cmpeq_epi8(v, zero_c));
    }
    m
}

/// Byte order reversed within each 8-byte lane.
static REVERSE: [u8; 32] = [
    7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12,
    11, 10, 9, 8,
];

/// The next four numbers of 1 to 8 digits whose last digits are the lowest
/// bits of `ends` (bits taken off), as two 4-digit values per 64-bit lane:
/// the last four digits in the low dword, the four before them in the high
/// dword. `w` points 7 bytes before the step start, so `w + k` is the
/// 8-byte window that ends at the step's byte k. Lane j holds the window
/// that ends at number j's last digit, reversed (last digit first); the
/// bytes from the first non-digit on (the separator before the number and
/// whatever precedes it) are zeroed, so the missing digits read as leading
/// zeros; `maddubs` combines digit pairs and `madd` pairs of pairs. An
/// exhausted mask gives offset 64: that lane reads the 8 bytes ending at
/// the step's byte 64 (in bounds: MARGIN) and its value is junk the caller
/// leaves out.
///
/// # Safety
/// `w + 7` is a step start `p` with `p >= BEHIND` and `p + MARGIN` within
/// the body `w` points into.
#[target_feature(enable = "avx2,bmi1,lzcnt,popcnt")]
unsafe fn quads4(w: *const u8, ends: &mut u64) -> __m256i {
    let mut e = [0usize; GROUP];
    for slot in e.iter_mut() {
        *slot = ends.trailing_zeros() as usize;
        *ends &= ends.wrapping_sub(1);
    }
    // SAFETY: each offset is at most 64, so each 8-byte load reads
    // p - 7 + offset .. p + offset + 1 <= p + MARGIN: bytes of the body
    // (the caller's contract).
    let pair = |x: usize, y: usize| unsafe {
        _mm_castpd_si128(_mm_loadh_pd(
            _mm_castsi128_pd(_mm_loadl_epi64(w.add(x) as *const __m128i)),
            w.add(y) as *const f64,
        ))
    };
    let lo = pair(e[0], e[1]);
    let hi = pair(e[2], e[3]);
    let v = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi);
    // SAFETY: REVERSE is exactly 32 bytes (one unaligned 256-bit load).
    let rev = unsafe { _mm256_loadu_si256(REVERSE.as_ptr() as *const __m256i) };
    let d = _mm256_sub_epi8(_mm256_shuffle_epi8(v, rev), _mm256_set1_epi8(b'0' as i8));
    // 0xFF where the byte is not a digit (d >= 10 unsigned).
    let nd = _mm256_cmpeq_epi8(_mm256_max_epu8(d, _mm256_set1_epi8(10)), d);
    // Per lane, the bits below the lowest non-digit byte (all of them when
    // the lane is eight digits): (nd - 1) & !nd.
    let keep = _mm256_andnot_si256(nd, _mm256_sub_epi64(nd, _mm256_set1_epi64x(1)));
    let d = _mm256_and_si256(d, keep);
    let d = _mm256_maddubs_epi16(d, _mm256_set1_epi16(0x0A01));
    _mm256_madd_epi16(d, _mm256_set1_epi32(0x0064_0001))
}

/// Two [`quads4`] results to eight u32 values in order (`a`'s four, then
/// `c`'s): the 4-digit halves (<= 9999) are packed to 16 bits and combined
/// as high * 10000 + low with one `madd`.
#[target_feature(enable = "avx2,bmi1,lzcnt,popcnt")]
fn finish8(a: __m256i, c: __m256i) -> __m256i {
    // Per 128-bit half: a's two numbers, then c's two.
    let v = _mm256_madd_epi16(_mm256_packus_epi32(a, c), _mm256_set1_epi32(0x2710_0001));
    _mm256_permute4x64_epi64::<0xD8>(v)
}

/// The steps of [`super::steps`] with AVX2 parts: [`classify`], then each
/// number's last digit taken from `ends` GROUP at a time, converted from
/// the 8-byte window that ends there ([`quads4`], [`finish8`]) and stored
/// straight into reserved capacity.
#[target_feature(enable = "avx2,bmi1,lzcnt,popcnt")]
pub(super) unsafe fn u32_run(b: &[u8], i: usize, out: &mut Vec<u32>, max: usize) -> usize {
    let convert = |w: *const u8, mut ends: u64, n: usize, dst: *mut u32| {
        // The first 12 numbers unconditionally: a count that varies from
        // step to step (about ten realistic ids per step) would cost a
        // mispredicted branch per step.
        // SAFETY: `w` is 7 bytes before a step start p >= BEHIND with p +
        // MARGIN within the body (the contract of `steps`): quads4's.
        let (q0, q1, q2) = unsafe {
            (
                quads4(w, &mut ends),
                quads4(w, &mut ends),
                quads4(w, &mut ends),
            )
        };
        let v01 = finish8(q0, q1);
        let v2 = _mm256_castsi256_si128(finish8(q2, q2));
        // SAFETY: SPARE >= 12 slots at dst are reserved (the contract of
        // `steps`); unaligned stores.
        unsafe {
            _mm256_storeu_si256(dst as *mut __m256i, v01);
            _mm_storeu_si128(dst.add(8) as *mut __m128i, v2);
        }
        let mut k = 12;
        while k < n {
            // SAFETY: as for the first twelve.
            let (q0, q1) = unsafe { (quads4(w, &mut ends), quads4(w, &mut ends)) };
            // SAFETY: k + 8 <= SPARE (k < n <= 32, k = 12 + 8j), reserved;
            // unaligned store.
            unsafe { _mm256_storeu_si256(dst.add(k) as *mut __m256i, finish8(q0, q1)) };
            k += 8;
        }
    };
    // SAFETY: `classify` loads the 64 bytes at p (p + BLOCK <= p + MARGIN
    // <= b.len()); `convert` writes at most SPARE slots and loads windows
    // ending at offsets up to 64: the contract of `steps`.
    unsafe { steps(b, i, out, max, |b, p| classify(b, p), convert) }
}
