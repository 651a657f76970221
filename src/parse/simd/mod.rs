//! The vector runs over token arrays: the only `unsafe` in the parser. The
//! AVX-512 run (`avx512.rs`, described there) is used where the CPU has it;
//! this header describes the AVX2 run, which has the same contract.
//!
//! [`u32_run`] starts at the first byte of an array element and converts
//! elements while they have the common shape: 1 to 10 digits, no leading zero,
//! value <= `u32::MAX`, followed by `,` / `, ` or by `]`. It walks FIXED
//! 64-byte blocks from its start, so a block's loads and masks never wait for
//! the previous block's numbers: the only state carried across a boundary is
//! whether the last byte was a digit / a comma and the start of a number that
//! straddles it. Per block, AVX2 compares give bit masks of digits, commas,
//! spaces and zeros; the masks prove the separators valid for the whole block
//! (every comma follows a digit, every space follows a comma, nothing else),
//! each number start is a bit, its length a `trailing_zeros`, and four numbers
//! at a time are converted in one vector (`maddubs`/`madd`/`mul_epu32` on one
//! 8-byte window per lane) and stored straight into reserved capacity. Blocks
//! that are not that clean (other whitespace, the array's end) go element by
//! element (SWAR on one 8-byte load). At the first element of any other shape
//! (leading zero, > 8 digits goes to an exact check first, sign, `.`, ...) the
//! run returns [`Run::Bail`] with the position of that element, and the scalar
//! loop in [`super::numbers`] (which this module is tested against) parses it
//! and reports the exact error.
//!
//! Invariants: no read past the body (whole-chunk loads only while
//! `p + MARGIN <= b.len()`, everything else bounds-checked); an element is
//! kept (`set_len`) only once it is known valid; the run never pushes past
//! `max` elements.

// Calls the AVX2 and AVX-512 runs (target-feature fns) once detection proved the CPU has them.
#![allow(unsafe_code)]

/// Where a vector run (AVX2 or AVX-512) stopped.
pub(crate) enum Run {
    /// The array ended; the offset is just past its `]`.
    Done(usize),
    /// Resume the scalar loop at this element start.
    Bail(usize),
}

/// Are AVX2 (and the BMI1/LZCNT/POPCNT bit tricks the run uses) available
/// on this CPU? Detected once, then a relaxed load.
pub fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static STATE: AtomicU8 = AtomicU8::new(UNKNOWN);
        detected_once(&STATE, || {
            std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("bmi1")
                && std::is_x86_feature_detected!("lzcnt")
                && std::is_x86_feature_detected!("popcnt")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Are the AVX-512 parts the 512-bit run uses (F, BW, VBMI's byte permutes,
/// VBMI2's byte compress) and the bit tricks available on this CPU?
/// Detected once, then a relaxed load.
pub fn avx512_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static STATE: AtomicU8 = AtomicU8::new(UNKNOWN);
        detected_once(&STATE, || {
            avx2_available()
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vbmi")
                && std::is_x86_feature_detected!("avx512vbmi2")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
use std::sync::atomic::{AtomicU8, Ordering};
#[cfg(target_arch = "x86_64")]
const UNKNOWN: u8 = 0;

/// `detect()`'s answer, computed on the first call and kept in `state`
/// (0 unknown, 1 no, 2 yes).
#[cfg(target_arch = "x86_64")]
fn detected_once(state: &AtomicU8, detect: impl FnOnce() -> bool) -> bool {
    match state.load(Ordering::Relaxed) {
        2 => true,
        1 => false,
        _ => {
            let yes = detect();
            state.store(if yes { 2 } else { 1 }, Ordering::Relaxed);
            yes
        }
    }
}

/// A vector run this CPU has. Only [`Vector::detect`] makes one, so holding
/// a `Vector` proves its features were detected: [`u32_run`] does not check
/// again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Vector(Isa);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    Avx2,
    Avx512,
}

impl Vector {
    /// The widest run the CPU has (AVX-512 only when `avx512`), or `None`:
    /// then the scalar loop does all the work.
    pub(crate) fn detect(avx512: bool) -> Option<Vector> {
        if avx512 && avx512_available() {
            Some(Vector(Isa::Avx512))
        } else {
            avx2_available().then_some(Vector(Isa::Avx2))
        }
    }
}

/// Converts common-shape elements starting at `i` (an element start) into
/// `out` until the array ends, an element of another shape appears, the body
/// is too close to its end for whole-chunk loads, or `out` reaches `max`.
#[inline]
pub(crate) fn u32_run(b: &[u8], i: usize, out: &mut Vec<u32>, max: usize, v: Vector) -> Run {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: a `Vector` exists only once its features were detected at
        // run time (`Vector::detect`): the AVX-512 parts or AVX2, each with
        // BMI1, LZCNT and POPCNT.
        unsafe {
            match v.0 {
                Isa::Avx512 => avx512::u32_run(b, i, out, max),
                Isa::Avx2 => avx2::u32_run(b, i, out, max),
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        // Unreachable: `Vector::detect` gives `None` off x86-64.
        let _ = (b, out, max, v);
        Run::Bail(i)
    }
}

/// Eight ASCII digits (first digit in the lowest byte, already minus `'0'`)
/// to their value: three multiply-add steps combine pairs, quads, octets.
#[inline(always)]
pub(crate) fn swar8(x: u64) -> u64 {
    let x = (x.wrapping_mul(10).wrapping_add(x >> 8)) & 0x00FF_00FF_00FF_00FF;
    let x = (x.wrapping_mul(100).wrapping_add(x >> 16)) & 0x0000_FFFF_0000_FFFF;
    (x.wrapping_mul(10000).wrapping_add(x >> 32)) & 0xFFFF_FFFF
}

/// Value of the `n` (1..=10) ASCII digits at `b[q..]`; needs `q + 10 <= b.len()`.
#[inline(always)]
fn digits_value(b: &[u8], q: usize, n: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[q..q + 8]);
    let x = u64::from_le_bytes(w).wrapping_sub(0x3030_3030_3030_3030);
    if n <= 8 {
        // Shift the n digits to the top; the zero bytes below act as leading
        // zeros. Bytes past the run (possibly borrowed from) are shifted out.
        swar8(x << (8 * (8 - n)))
    } else {
        let mut v = swar8(x);
        for k in 8..n {
            v = v * 10 + (b[q + k] - b'0') as u64;
        }
        v
    }
}

/// The exact check of one digit run of `n` digits at `b[q..]` (the vector
/// runs' slow path): its value if it is a u32 without a leading zero, else
/// `None` (the scalar loop then reports it). Needs `q + 10 <= b.len()`.
#[inline]
fn exact_u32(b: &[u8], q: usize, n: usize) -> Option<u32> {
    if !(1..=10).contains(&n) || (n > 1 && b[q] == b'0') {
        return None;
    }
    u32::try_from(digits_value(b, q, n)).ok()
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(test)]
mod tests;
