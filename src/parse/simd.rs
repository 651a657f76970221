//! The vector runs over token arrays: the only `unsafe` in the parser. The
//! AVX-512 run (`mod avx512`, described there) is used where the CPU has it;
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
mod avx2 {
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
}

/// The AVX-512 run: the same contract as the AVX2 one, with no per-number
/// scalar work on the common path.
///
/// Each step loads the 64 bytes at an element start `p` and keeps the part up
/// to the block's last comma: every number in it is complete. Bit masks prove
/// that part clean (digits, commas after digits, one space after a comma), and
/// hold each number's start and end as a bit. `vpcompressb` packs those bit
/// positions into bytes, in order; per group of eight numbers, `vpermb` gives
/// every 8-byte lane the byte indices of its number's last eight characters
/// (bytes before the number's start zeroed), and one `maddubs`/`madd`/
/// `mul_epu32` chain converts the eight lanes. The next step starts just past
/// the last comma, so a number never straddles two steps.
///
/// A part with a number of more than 8 digits or a leading zero is converted
/// one number at a time, exactly; a step whose part is not clean (other
/// whitespace, the array's end, an error) or that has no comma ends the run
/// at `p`, and the scalar loop takes that element.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{exact_u32, Run};
    use std::arch::x86_64::*;

    /// Bytes loaded per step (one bit each in a u64 mask).
    const BLOCK: usize = 64;
    /// Bytes that must follow a step start: the block, plus the 8-byte load
    /// of an exact conversion that starts near its end.
    const MARGIN: usize = BLOCK + 16;
    /// Most numbers one step finishes: 32 one-digit numbers and commas.
    const SLOTS: usize = 32;
    /// How far ahead of a step its load prefetches (about 8 steps).
    const PREFETCH: usize = 512;

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
    pub(super) unsafe fn u32_run(b: &[u8], i: usize, out: &mut Vec<u32>, max: usize) -> Run {
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
            let bad = (!(digit | comma | space)
                | (comma & !(digit << 1))
                | (space & !((comma << 1) | 1)))
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
                        _mm256_storeu_si256(
                            dst.add(8 * g) as *mut __m256i,
                            _mm512_cvtepi64_epi32(d),
                        )
                    };
                    g += 1;
                }
            } else {
                // Exact, in order: the first element of another shape ends
                // the run with the elements before it kept.
                let mut rest = starts;
                let mut k = 0;
                while rest != 0 {
                    let at = rest.trailing_zeros() as usize;
                    rest &= rest - 1;
                    let q = p + at;
                    let len = (!digit >> at).trailing_zeros() as usize;
                    // q + 10 <= p + MARGIN <= b.len() for digits_value.
                    let Some(value) = exact_u32(b, q, len) else {
                        // SAFETY: slots base..base + k were written below.
                        unsafe { out.set_len(base + k) };
                        return Run::Bail(q);
                    };
                    // SAFETY: k < n <= SLOTS, reserved above.
                    unsafe { dst.add(k).write(value) };
                    k += 1;
                }
            }
            // SAFETY: slots base..base + n were written above.
            unsafe { out.set_len(base + n) };
            p += last + 1;
        }
        Run::Bail(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swar_converts_every_length() {
        let text = b"4294967295,,,,,,,,,,,,,,,,";
        for n in 1..=10 {
            let want: u64 = std::str::from_utf8(&text[..n]).unwrap().parse().unwrap();
            assert_eq!(digits_value(text, 0, n), want, "n={n}");
        }
        assert_eq!(digits_value(b"0000000000", 0, 1), 0);
    }

    /// Every block alignment (the padding shifts the array start) and a
    /// refused element at many positions, including across block
    /// boundaries: the AVX2 and AVX-512 runs must give exactly the scalar
    /// loop's result.
    #[test]
    fn fixed_blocks_equal_scalar_at_every_alignment() {
        use crate::parse::oracle::{parse_debug, BodyKind};
        use crate::parse::{NumberPath, Parser};
        let scalar = Parser::default().with_number_path(NumberPath::Scalar);
        let paths = NumberPath::available_vectors();
        eprintln!("parse paths tested: scalar, {}", NumberPath::names(&paths));
        let vector: Vec<(Parser, &str)> = paths
            .iter()
            .map(|&(p, name)| (Parser::default().with_number_path(p), name))
            .collect();
        let ids: Vec<String> = (0..120u64)
            .map(|k| {
                // Mostly 1-7 digits (the vector path), a 10-digit id now and
                // then (the exact path).
                let digits = if k % 37 == 36 { 10 } else { k % 7 + 1 };
                ((k * 2_654_435_761) % 10u64.pow(digits as u32) % (1 << 32)).to_string()
            })
            .collect();
        let odd = [
            "0123",
            "-5",
            "1.5",
            "4294967296",
            "12345678901",
            "00",
            " 7",
            "\n7",
            "",
            "1e3",
            "99999999999999999999999",
            "4294967295",
            " ]",
        ];
        let mut checked_ok = 0;
        for pad in 0..64 {
            for at in 0..60 {
                for o in odd.iter().take(if at == 0 { 1 } else { odd.len() }) {
                    let mut elems = ids.clone();
                    if at > 0 {
                        elems[at] = o.to_string();
                    }
                    let body = format!(
                        r#"{{"model_name":"{}","routing_group":"d","token_ids":[{}]}}"#,
                        "m".repeat(pad),
                        elems.join(if pad % 2 == 0 { "," } else { ", " })
                    );
                    let want = parse_debug(&scalar, BodyKind::Select, body.as_bytes());
                    checked_ok += want.is_ok() as usize;
                    for (v, name) in &vector {
                        assert_eq!(
                            want,
                            parse_debug(v, BodyKind::Select, body.as_bytes()),
                            "{name}: {body}"
                        );
                    }
                }
            }
        }
        assert!(checked_ok > 64, "{checked_ok}");
    }

    /// Dense arrays (32 one-digit numbers per 64 bytes, the most one step
    /// finishes), mixed lengths up to 10 digits, both separator styles, and
    /// element limits just below, at and above the array's length: every
    /// vector run equals the scalar loop, values and errors.
    #[test]
    fn dense_arrays_and_limits_equal_scalar() {
        use crate::parse::oracle::{parse_debug, BodyKind};
        use crate::parse::{NumberPath, ParseLimits, Parser};
        let mk = |path, max_tokens| {
            Parser::new(
                ParseLimits {
                    max_tokens,
                    ..ParseLimits::default()
                },
                Default::default(),
                Default::default(),
            )
            .with_number_path(path)
        };
        let paths = NumberPath::available_vectors();
        eprintln!("parse paths tested: scalar, {}", NumberPath::names(&paths));
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for (len, max_digits) in [(300, 1), (301, 2), (257, 5), (400, 9), (333, 10)] {
            let ids: Vec<String> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let digits = 1 + (x % max_digits) as u32;
                    let v = (x >> 8) % 10u64.pow(digits);
                    v.min(u32::MAX as u64).to_string()
                })
                .collect();
            for sep in [",", ", "] {
                let body = format!(r#"{{"token_ids":[{}]}}"#, ids.join(sep));
                for max in [len - 33, len - 1, len, len + 1] {
                    let want = parse_debug(
                        &mk(NumberPath::Scalar, max),
                        BodyKind::Select,
                        body.as_bytes(),
                    );
                    assert_eq!(want.is_ok(), max >= len, "{max} {len}");
                    for &(path, name) in &paths {
                        let got = parse_debug(&mk(path, max), BodyKind::Select, body.as_bytes());
                        assert_eq!(want, got, "{name} max {max}: {body}");
                    }
                }
            }
        }
    }
}
