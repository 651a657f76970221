//! The AVX2 run (the contract and the method are in `mod.rs`'s header).
//! x86-64 only.

// Target-feature intrinsics and raw stores into reserved capacity.
#![allow(unsafe_code)]

use super::{digits_value, exact_u32, Run};
use crate::parse::cursor::is_ws;
use std::arch::x86_64::*;

/// Bytes that must follow a chunk start so that a digit run found in the
/// chunk (<= 32 bytes), its SWAR load (8) and its separator stay in bounds.
const MARGIN: usize = 128;
/// Bytes classified per block (one bit each in a u64 mask).
const CHUNK: usize = 64;
/// Numbers converted per vector (one 64-bit lane each).
const GROUP: usize = 4;

/// Four 8-byte digit windows (first digit in the lowest byte) and their
/// left shifts (8 * (8 - digits)) to four u32 values: `maddubs` combines
/// digit pairs, `madd` pairs of pairs, `mul_epu32` the two halves.
#[target_feature(enable = "avx2,bmi1,lzcnt,popcnt")]
fn convert4(win: [i64; GROUP], shift: [i64; GROUP]) -> __m128i {
    let v = _mm256_set_epi64x(win[3], win[2], win[1], win[0]);
    let sh = _mm256_set_epi64x(shift[3], shift[2], shift[1], shift[0]);
    let v = _mm256_sub_epi8(v, _mm256_set1_epi8(b'0' as i8));
    let v = _mm256_sllv_epi64(v, sh);
    let v = _mm256_maddubs_epi16(v, _mm256_set1_epi16(0x010A));
    let v = _mm256_madd_epi16(v, _mm256_set1_epi32(0x0001_0064));
    let v = _mm256_add_epi64(
        _mm256_mul_epu32(v, _mm256_set1_epi64x(10_000)),
        _mm256_srli_epi64(v, 32),
    );
    let v = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    _mm256_castsi256_si128(v)
}

/// Per-chunk byte classes, one bit per byte.
struct Masks {
    digit: u64,
    comma: u64,
    space: u64,
    zero: u64,
}

#[target_feature(enable = "avx2,bmi1,lzcnt,popcnt")]
fn classify32(v: __m256i) -> [u64; 4] {
    let zero_c = _mm256_set1_epi8(b'0' as i8);
    let t = _mm256_sub_epi8(v, zero_c);
    let is_digit = _mm256_cmpeq_epi8(_mm256_min_epu8(t, _mm256_set1_epi8(9)), t);
    let mask = |x| _mm256_movemask_epi8(x) as u32 as u64;
    [
        mask(is_digit),
        mask(_mm256_cmpeq_epi8(v, _mm256_set1_epi8(b',' as i8))),
        mask(_mm256_cmpeq_epi8(v, _mm256_set1_epi8(b' ' as i8))),
        mask(_mm256_cmpeq_epi8(v, zero_c)),
    ]
}

/// Classifies the CHUNK bytes at `b[p..]`; needs `p + CHUNK <= b.len()`.
#[target_feature(enable = "avx2,bmi1,lzcnt,popcnt")]
fn classify(b: &[u8], p: usize) -> Masks {
    debug_assert!(p + CHUNK <= b.len());
    let mut m = Masks {
        digit: 0,
        comma: 0,
        space: 0,
        zero: 0,
    };
    for j in 0..CHUNK / 32 {
        // SAFETY: p + CHUNK <= b.len() (callers check p + MARGIN <=
        // b.len()), so each unaligned 32-byte load reads only bytes of `b`.
        let v = unsafe { _mm256_loadu_si256(b.as_ptr().add(p + 32 * j) as *const __m256i) };
        let c = classify32(v);
        let sh = 32 * j as u32;
        m.digit |= (c[0] as u64) << sh;
        m.comma |= (c[1] as u64) << sh;
        m.space |= (c[2] as u64) << sh;
        m.zero |= (c[3] as u64) << sh;
    }
    m
}

/// Most numbers one 64-byte block can finish: 32 runs started in it plus
/// the one carried in, rounded up to whole vector groups.
const SLOTS: usize = 36;

/// The bulk run: FIXED 64-byte blocks from the run start, so that the next
/// block's loads and masks do not wait for this block's numbers (the only
/// state carried from block to block is a few bits and the start of a
/// number that straddles the boundary). Per block, the masks prove the
/// bytes are digit runs separated by `,` or `, ` (every comma follows a
/// digit, every space follows a comma, nothing else); every run start is a
/// bit, its length a `trailing_zeros`, and the finished numbers are
/// converted GROUP at a time. A block with anything else goes element by
/// element from its first unfinished element ([`step`]); an element of
/// another shape ends the run at its start ([`Run::Bail`]).
#[target_feature(enable = "avx2,bmi1,lzcnt,popcnt")]
pub(super) unsafe fn u32_run(b: &[u8], i: usize, out: &mut Vec<u32>, max: usize) -> Run {
    let mut p = i;
    // Start of a digit run that reached the end of the previous block.
    let mut pending: Option<usize> = None;
    // Was the previous block's last byte a digit / a comma?
    let mut prev_digit = 0u64;
    let mut prev_comma = 0u64;
    // Number starts and lane shifts of one block; unused slots keep
    // in-bounds positions from earlier blocks (their values are dropped).
    let mut pos = [i as u64; SLOTS];
    let mut shift = [0i64; SLOTS];
    while p + MARGIN <= b.len() && out.len() + SLOTS <= max {
        let m = classify(b, p);
        let other = !(m.digit | m.comma | m.space);
        if other != 0
            || m.comma & !((m.digit << 1) | prev_digit) != 0
            || m.space & !((m.comma << 1) | prev_comma) != 0
        {
            // Messy block (other whitespace, the array's end, an error):
            // element by element from its first unfinished element.
            let e = pending.unwrap_or(p);
            let md = classify(b, e).digit as u32;
            match step(b, e, md, out) {
                Ok(np) => {
                    p = np;
                    pending = None;
                    prev_digit = 0;
                    prev_comma = 0;
                    continue;
                }
                Err(run) => return run,
            }
        }
        let non_digit = !m.digit;
        let mut starts = m.digit & !((m.digit << 1) | prev_digit);
        // A run reaching the block end finishes in a later block.
        let mut carry = None;
        if m.digit >> 63 != 0 {
            if starts != 0 {
                let last = 63 - starts.leading_zeros();
                starts &= !(1u64 << last);
                carry = Some(p + last as usize);
            } else {
                carry = pending;
            }
        }
        // A leading '0' followed by a digit, inside the block.
        let mut odd = starts & m.zero & (m.digit >> 1) != 0;
        let mut count = 0usize;
        if let (Some(q), true) = (pending, non_digit != 0) {
            let n = p + non_digit.trailing_zeros() as usize - q;
            odd |= n > 8 || (n > 1 && b[q] == b'0');
            pos[0] = q as u64;
            shift[0] = (8u64.wrapping_sub(n as u64) << 3) as i64;
            count = 1;
        }
        let mut rest = starts;
        while rest != 0 {
            let at = rest.trailing_zeros() as usize;
            rest &= rest - 1;
            let n = (non_digit >> at).trailing_zeros() as u64;
            odd |= n > 8;
            // count < SLOTS: at most 32 runs start in 64 bytes, plus one.
            pos[count] = (p + at) as u64;
            shift[count] = (8u64.wrapping_sub(n) << 3) as i64;
            count += 1;
        }
        out.reserve(SLOTS);
        let base = out.len();
        // SAFETY: `reserve(SLOTS)` guarantees SLOTS spare slots past `len`.
        let dst = unsafe { out.as_mut_ptr().add(base) };
        if !odd {
            let mut k = 0usize;
            while k < count {
                let mut win = [0i64; GROUP];
                for j in 0..GROUP {
                    let q = pos[k + j] as usize;
                    let mut w = [0u8; 8];
                    w.copy_from_slice(&b[q..q + 8]);
                    win[j] = i64::from_le_bytes(w);
                }
                let sh = [shift[k], shift[k + 1], shift[k + 2], shift[k + 3]];
                let packed = convert4(win, sh);
                // SAFETY: k + GROUP <= SLOTS (count <= 33, SLOTS = 36) and
                // SLOTS slots past `base` are reserved; unaligned store.
                unsafe { _mm_storeu_si128(dst.add(k) as *mut __m128i, packed) };
                k += GROUP;
            }
            // SAFETY: slots base..base + count were written above.
            unsafe { out.set_len(base + count) };
        } else {
            // Exact, in order: the first element of another shape ends
            // the run with the elements before it kept.
            for k in 0..count {
                let q = pos[k] as usize;
                let n = 8 - (shift[k] >> 3);
                let Some(value) = exact_u32(b, q, n as usize) else {
                    // SAFETY: slots base..base + k were written below.
                    unsafe { out.set_len(base + k) };
                    return Run::Bail(q);
                };
                // SAFETY: k < count <= SLOTS, reserved above.
                unsafe { dst.add(k).write(value) };
            }
            // SAFETY: slots base..base + count were written in the loop.
            unsafe { out.set_len(base + count) };
        }
        pending = carry;
        prev_digit = m.digit >> 63;
        prev_comma = m.comma >> 63;
        p += CHUNK;
    }
    Run::Bail(pending.unwrap_or(p))
}

/// Element-by-element conversion within one chunk, for chunks with other
/// whitespace, the array's end, or anything unusual. `Ok` gives the next
/// chunk start (an element start); `Err` ends the run.
fn step(b: &[u8], p: usize, digit: u32, out: &mut Vec<u32>) -> Result<usize, Run> {
    let non_digit = !(digit as u64);
    let mut s = 0usize;
    loop {
        let n = (non_digit >> s).trailing_zeros() as usize;
        if s + n >= 32 {
            if s == 0 {
                // A 32-digit run: not a u32; the scalar loop says so.
                return Err(Run::Bail(p));
            }
            // The run may continue past the chunk: reload from its start.
            return Ok(p + s);
        }
        let q = p + s;
        if n == 0 || n > 10 || (n > 1 && b[q] == b'0') {
            return Err(Run::Bail(q));
        }
        let e = q + n;
        let value = digits_value(b, q, n);
        if value > u32::MAX as u64 {
            return Err(Run::Bail(q));
        }
        match b[e] {
            b',' => {
                let mut k = e + 1;
                while k < b.len() && is_ws(b[k]) {
                    k += 1;
                }
                out.push(value as u32);
                s = k - p;
            }
            b']' => {
                out.push(value as u32);
                return Err(Run::Done(e + 1));
            }
            _ => return Err(Run::Bail(q)),
        }
        if s >= 32 {
            return Ok(p + s);
        }
    }
}
