//! The vector runs over token arrays: the only `unsafe` in the parser. The
//! three runs (`avx512.rs`, `avx2.rs`, `sse41.rs`) have one contract and one
//! method.
//!
//! [`u32_run`] starts at the first byte of an array element and converts
//! elements while they have the common shape: 1 to 10 digits, no leading zero,
//! value <= `u32::MAX`, followed by `,` / `, ` or by `]`. Each step classifies
//! the 64 bytes at an element start into bit masks (digits, commas, spaces,
//! zeros), proves the part up to the last comma clean (every comma follows a
//! digit, every space follows a comma, nothing else), so that every number in
//! it is complete, and converts those numbers from their start / end bits
//! without a per-digit loop. The next step starts just past that comma, so a
//! number never straddles two steps. The AVX-512 run packs the bit positions
//! with `vpcompressb` and gathers eight numbers' digits with `vpermb`; the
//! AVX2 run takes each number's last-digit offset with `tzcnt`, loads the
//! 8-byte window that ends there, and zeroes each lane below its highest
//! non-digit byte (the separator), four numbers per vector; the SSE4.1 run
//! (x86-64-v2 CPUs) does the same with two per vector. Those two share the
//! loop ([`steps`]) and its choice of what a step converts ([`part`]), and
//! differ only in how they classify a block and convert a part. All convert with
//! `maddubs`/`madd` (AVX-512 also `mul_epu32`) and store straight into
//! reserved capacity.
//!
//! A part with a number of more than 8 digits or a leading zero is converted
//! one number at a time, exactly ([`exact_u32`]). At the first element of any
//! other shape (sign, `.`, other whitespace, the array's end, ...) the run
//! returns the position of that element, and the scalar
//! loop in [`super::numbers`] (the twin every run is tested against) parses
//! it and reports the exact error.
//!
//! Invariants: no read past the body (whole-block loads only while
//! `p + MARGIN <= b.len()`, everything else bounds-checked; the AVX2 windows
//! read up to 7 bytes before a step start, which it keeps at least 8 bytes
//! into the body); an element is kept (`set_len`) only once it is known
//! valid; the run never pushes past `max` elements.

// Calls the AVX2 and AVX-512 runs (target-feature fns) once detection proved the CPU has them.
#![allow(unsafe_code)]

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

/// Are SSE4.1 and SSSE3 (with POPCNT: x86-64-v2) available on this CPU?
/// Detected once, then a relaxed load.
pub fn sse41_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static STATE: AtomicU8 = AtomicU8::new(UNKNOWN);
        detected_once(&STATE, || {
            std::is_x86_feature_detected!("sse4.1")
                && std::is_x86_feature_detected!("ssse3")
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

/// The vector runs, narrowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Isa {
    Sse41,
    Avx2,
    Avx512,
}

impl Vector {
    /// The widest run the CPU has up to `widest`, or `None`: then the
    /// scalar loop does all the work.
    pub(crate) fn detect(widest: Isa) -> Option<Vector> {
        if widest >= Isa::Avx512 && avx512_available() {
            Some(Vector(Isa::Avx512))
        } else if widest >= Isa::Avx2 && avx2_available() {
            Some(Vector(Isa::Avx2))
        } else {
            sse41_available().then_some(Vector(Isa::Sse41))
        }
    }

    pub(crate) fn isa(self) -> Isa {
        self.0
    }
}

/// Converts common-shape elements starting at `i` (an element start) into
/// `out` until an element of another shape (or the array's end) appears,
/// the body is too close to its end for whole-block loads, or `out` nears
/// `max`; returns the element start where the scalar loop resumes.
#[inline]
pub(crate) fn u32_run(b: &[u8], i: usize, out: &mut Vec<u32>, max: usize, v: Vector) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: a `Vector` exists only once its features were detected at
        // run time (`Vector::detect`): the AVX-512 parts or AVX2, each with
        // BMI1, LZCNT and POPCNT, or SSE4.1 with SSSE3 and POPCNT.
        unsafe {
            match v.0 {
                Isa::Avx512 => avx512::u32_run(b, i, out, max),
                Isa::Avx2 => avx2::u32_run(b, i, out, max),
                Isa::Sse41 => sse41::u32_run(b, i, out, max),
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        // Unreachable: `Vector::detect` gives `None` off x86-64.
        let _ = (b, out, max, v);
        i
    }
}

/// Bytes classified per step (one bit each in a u64 mask).
const BLOCK: usize = 64;
/// Bytes that must follow a step start: the block, plus the 8-byte loads
/// past it (the window of an unused AVX2 or SSE4.1 lane, end 64; the exact
/// conversion's load near the end).
const MARGIN: usize = BLOCK + 16;
/// Bytes that must precede a step start in the AVX2 and SSE4.1 runs: a
/// number's 8-byte window ends at its last digit, so a number at the step
/// start reads up to 7 bytes before.
const BEHIND: usize = 8;
/// Most numbers one step finishes: 32 one-digit numbers and commas.
const SLOTS: usize = 32;
/// Slots the AVX2 and SSE4.1 runs write per step: up to 32 numbers, the
/// first 12 unconditionally, then in vectors of 8 (AVX2) or 4 (SSE4.1).
const SPARE: usize = 36;
/// How far ahead of a step its load prefetches (about 8 steps).
const PREFETCH: usize = 512;

/// The part of one 64-byte step that the AVX2 and SSE4.1 runs convert,
/// from the step's masks (bit k for byte p + k).
#[derive(Clone, Copy)]
pub(super) struct Part {
    /// The part is bytes 0..=last (its last byte is a comma).
    pub last: usize,
    /// First digit of each number of the part.
    pub starts: u64,
    /// Last digit of each number of the part.
    pub ends: u64,
    /// How many numbers the part holds.
    pub n: usize,
    /// A number of more than 8 digits or with a leading zero: convert the
    /// part exactly ([`exact_part`]).
    pub odd: bool,
}

/// The part of a step up to the last comma before the first byte that breaks
/// the shape: every number in it is complete and followed by `,` or `, `.
/// `None` when no number before the first odd byte (other whitespace, the
/// array's end, an error) is complete: the run ends there and the scalar
/// loop takes that element. Plain integer code, inlined into each run.
#[inline(always)]
pub(super) fn part(digit: u64, comma: u64, space: u64, zero: u64) -> Option<Part> {
    // Every comma follows a digit, every space a comma, except a space at
    // bit 0: `p` is an element start (the byte before it is `[`, `,` or
    // whitespace), so that one is whitespace before an element.
    let bad = !(digit | comma | space) | (comma & !(digit << 1)) | (space & !((comma << 1) | 1));
    // The part ends at the last comma; the next step's start depends on the
    // comma mask alone (not on `bad`), which keeps the chain from step to
    // step short.
    let mut last = 63usize.wrapping_sub(comma.leading_zeros() as usize);
    if comma == 0 || bad & (u64::MAX >> (63 - last)) != 0 {
        // Only the part before the first bad byte is the common shape.
        let clean = bad.wrapping_sub(1) & !bad;
        let commas = comma & clean;
        if commas == 0 {
            return None;
        }
        last = 63 - commas.leading_zeros() as usize;
    }
    // Bits 0..=last: the part of the block whose numbers are complete.
    let part = u64::MAX >> (63 - last);
    let starts = digit & !(digit << 1) & part;
    let ends = digit & (comma >> 1) & part;
    // A run of 9+ digits starts where 9 digit bits in a row begin.
    let d2 = digit & (digit >> 1);
    let d4 = d2 & (d2 >> 2);
    let d9 = d4 & (d4 >> 4) & (digit >> 8);
    let odd = ((d9 | (zero & (digit >> 1) & starts)) & part) != 0;
    Some(Part {
        last,
        starts,
        ends,
        n: ends.count_ones() as usize,
        odd,
    })
}

/// The AVX2 and SSE4.1 runs' loop: each step classifies the 64 bytes at an
/// element start `p` (`classify`: digits, commas, spaces, zeros) and keeps
/// the part up to the last comma before the first byte that breaks the
/// shape ([`part`]): every number in it is complete and followed by `,` or
/// `, `. A part of numbers of 1 to 8 digits without a leading zero goes to
/// `convert(w, ends, n, dst)`, which writes its `n` numbers (each one's last
/// digit a bit of `ends`) from the 8-byte windows that end at those digits
/// (`w + k` is the window that ends at the step's byte k) straight into
/// reserved capacity; any other part to [`exact_part`], one number at a
/// time. The next step starts just past the part's last comma, so a number
/// never straddles two steps. A step with no complete number before the
/// first odd byte (other whitespace, the array's end, an error) ends the
/// run at `p`, and the scalar loop takes that element.
///
/// Always inlined into each run, whose target features the two closures
/// inherit.
///
/// # Safety
/// `classify` may load the 64 bytes at `p`; `convert` may write `SPARE`
/// slots at `dst` and load the windows ending at offsets up to 64 (with the
/// 8 bytes past them); the loop keeps `p >= BEHIND` and `p + MARGIN <=
/// b.len()` for both.
#[inline(always)]
pub(super) unsafe fn steps(
    b: &[u8],
    i: usize,
    out: &mut Vec<u32>,
    max: usize,
    classify: impl Fn(&[u8], usize) -> [u64; 4],
    convert: impl Fn(*const u8, u64, usize, *mut u32),
) -> usize {
    let mut p = i;
    if p < BEHIND {
        return p;
    }
    while p + MARGIN <= b.len() && out.len() + SLOTS <= max {
        // The next step's start depends on this block (through the last
        // comma), so a cache miss here stalls the whole chain: ask for the
        // line PREFETCH bytes ahead (a hint; it never faults).
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(b.as_ptr().wrapping_add(p + PREFETCH) as *const i8);
        }
        let [digit, comma, space, zero] = classify(b, p);
        let Some(Part {
            last,
            starts,
            ends,
            n,
            odd,
        }) = part(digit, comma, space, zero)
        else {
            break;
        };
        out.reserve(SPARE);
        let base = out.len();
        // SAFETY: `reserve(SPARE)` guarantees SPARE spare slots past `len`.
        let dst = unsafe { out.as_mut_ptr().add(base) };
        if !odd {
            // `w + 7` is the step start p, p >= BEHIND (checked on entry; p
            // only grows) and p + MARGIN <= b.len() (the loop condition);
            // SPARE slots at dst are reserved: `convert`'s contract.
            convert(b.as_ptr().wrapping_add(p - 7), ends, n, dst);
        } else {
            // Exact, in order: the first element of another shape ends the
            // run with the elements before it kept.
            // SAFETY: slots base..base + n are reserved (n <= SLOTS <= SPARE).
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

/// The vector runs' exact conversion of a part of a step (`starts`, the
/// first digit of each number, at `p` + bit) that holds a number of more
/// than 8 digits or a leading zero: each number in order into `dst`, or,
/// at the first that is not a u32 without a leading zero, `Err((numbers
/// written, its position))`. Rare, so out of line: the common path keeps
/// its registers (AVX2 1.60-1.64 -> 1.50-1.54 ns per token with it).
///
/// # Safety
/// `dst` has room for one slot per bit of `starts`; every number of the
/// part has 10 bytes of `b` from its start (the runs' margins).
#[cold]
#[inline(never)]
pub(super) unsafe fn exact_part(
    b: &[u8],
    p: usize,
    starts: u64,
    digit: u64,
    dst: *mut u32,
) -> Result<(), (usize, usize)> {
    let mut rest = starts;
    let mut k = 0;
    while rest != 0 {
        let at = rest.trailing_zeros() as usize;
        rest &= rest - 1;
        let q = p + at;
        let len = (!digit >> at).trailing_zeros() as usize;
        // q + 10 <= b.len() for digits_value (the caller's margin).
        let Some(value) = exact_u32(b, q, len) else {
            return Err((k, q));
        };
        // SAFETY: k < starts.count_ones(), within the caller's room.
        unsafe { dst.add(k).write(value) };
        k += 1;
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod sse41;

#[cfg(test)]
mod tests;
