//! The AVX2 run over token arrays: the only `unsafe` in the parser.
//!
//! [`u32_run`] starts at the first byte of an array element and converts
//! elements while they have the common shape: 1 to 10 digits, no leading zero,
//! value <= `u32::MAX`, followed by `,` (plus any whitespace) or by `]`. Per
//! 32-byte chunk one AVX2 compare classifies every byte as digit or not; the
//! length of each digit run is then a `trailing_zeros` on that mask, and the
//! run is converted by a SWAR multiply on one 8-byte load. At the first element
//! of any other shape it returns [`Run::Bail`] with the position of that
//! element, and the scalar loop in [`super::numbers`] (which this module is
//! property-tested against) parses it and reports the exact error.
//!
//! Invariants: no read past the body (each load is checked against
//! `b.len()`); an element is pushed only once it is known valid; the run never
//! pushes past `max` elements.

/// Where an AVX2 run stopped.
pub(crate) enum Run {
    /// The array ended; the offset is just past its `]`.
    Done(usize),
    /// Resume the scalar loop at this element start.
    Bail(usize),
}

/// Is AVX2 available on this CPU? Detected once, then a relaxed load.
pub fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::atomic::{AtomicU8, Ordering};
        static STATE: AtomicU8 = AtomicU8::new(0); // 0 unknown, 1 no, 2 yes
        match STATE.load(Ordering::Relaxed) {
            2 => true,
            1 => false,
            _ => {
                let yes = std::is_x86_feature_detected!("avx2");
                STATE.store(if yes { 2 } else { 1 }, Ordering::Relaxed);
                yes
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Converts common-shape elements starting at `i` (an element start) into
/// `out` until the array ends, an element of another shape appears, the body
/// is too close to its end for whole-chunk loads, or `out` reaches `max`.
#[inline]
pub(crate) fn u32_run(b: &[u8], i: usize, out: &mut Vec<u32>, max: usize) -> Run {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_available() {
            // SAFETY: AVX2 support was detected at run time just above.
            return unsafe { avx2::u32_run(b, i, out, max) };
        }
    }
    let _ = (b, out, max);
    Run::Bail(i)
}

/// Eight ASCII digits (first digit in the lowest byte, already minus `'0'`)
/// to their value: three multiply-add steps combine pairs, quads, octets.
#[inline(always)]
fn swar8(x: u64) -> u64 {
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{digits_value, Run};
    use crate::parse::cursor::is_ws;
    use std::arch::x86_64::*;

    /// Bytes that must follow a chunk start so that a digit run found in the
    /// chunk (<= 32 bytes), its SWAR load (8) and its separator stay in bounds.
    const MARGIN: usize = 64;
    /// Numbers converted per branch-free group (a 32-byte chunk of realistic
    /// 5-6 digit ids holds 4-5).
    const GROUP: usize = 6;

    /// `digits_value` for n <= 8 without branches; junk (never kept) for
    /// n == 0 or n > 8. Needs `q + 8 <= b.len()`.
    #[inline(always)]
    fn swar_upto8(b: &[u8], q: usize, n: usize) -> u64 {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[q..q + 8]);
        let x = u64::from_le_bytes(w).wrapping_sub(0x3030_3030_3030_3030);
        super::swar8(x.wrapping_shl(8u32.wrapping_sub(n as u32).wrapping_mul(8) & 63))
    }

    /// Per-chunk byte classes, one bit per byte.
    struct Masks {
        digit: u32,
        comma: u32,
        space: u32,
        zero: u32,
    }

    #[target_feature(enable = "avx2")]
    fn classify(v: __m256i) -> Masks {
        let zero_c = _mm256_set1_epi8(b'0' as i8);
        let t = _mm256_sub_epi8(v, zero_c);
        let is_digit = _mm256_cmpeq_epi8(_mm256_min_epu8(t, _mm256_set1_epi8(9)), t);
        Masks {
            digit: _mm256_movemask_epi8(is_digit) as u32,
            comma: _mm256_movemask_epi8(_mm256_cmpeq_epi8(v, _mm256_set1_epi8(b',' as i8))) as u32,
            space: _mm256_movemask_epi8(_mm256_cmpeq_epi8(v, _mm256_set1_epi8(b' ' as i8))) as u32,
            zero: _mm256_movemask_epi8(_mm256_cmpeq_epi8(v, zero_c)) as u32,
        }
    }

    /// The bulk run. Per chunk, when the bytes up to the last comma are only
    /// digit runs separated by `,` or `, ` (checked on the masks: every comma
    /// follows a digit, every space follows a comma), all numbers ending
    /// before that comma are converted without a serial scan: each start bit
    /// gives a number, its length is a `trailing_zeros`, and the numbers are
    /// independent of each other. Other chunks go element by element
    /// ([`step`]).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn u32_run(b: &[u8], mut p: usize, out: &mut Vec<u32>, max: usize) -> Run {
        while p + MARGIN <= b.len() && out.len() + 16 <= max {
            // SAFETY: p + 32 <= p + MARGIN <= b.len(), so the unaligned 32-byte
            // load reads only bytes of `b`.
            let v = unsafe { _mm256_loadu_si256(b.as_ptr().add(p) as *const __m256i) };
            let m = classify(v);
            let other = !(m.digit | m.comma | m.space);
            let region = if other == 0 {
                u32::MAX
            } else {
                (1u32 << other.trailing_zeros()) - 1
            };
            let commas = m.comma & region;
            let bulk = m.digit & 1 != 0
                && commas != 0
                && commas & !(m.digit << 1) == 0
                && m.space & region & !(m.comma << 1) == 0;
            if !bulk {
                match step(b, p, m.digit, out) {
                    Ok(np) => {
                        p = np;
                        continue;
                    }
                    Err(run) => return run,
                }
            }
            let last_comma = 31 - commas.leading_zeros();
            let span = if last_comma == 31 {
                u32::MAX
            } else {
                (1u32 << (last_comma + 1)) - 1
            };
            let mut starts = m.digit & !(m.digit << 1) & span;
            // A start '0' followed by a digit is a leading zero: stop there.
            let bad = starts & m.zero & (m.digit >> 1);
            if bad != 0 {
                starts &= (bad & bad.wrapping_neg()) - 1;
            }
            let non_digit = !(m.digit as u64);
            out.reserve(16 + GROUP);
            let base = out.len();
            let count = starts.count_ones() as usize;
            let dst = out.spare_capacity_mut();
            // Fast: groups of GROUP numbers with no data-dependent branch
            // inside a group (a trip count that varies per chunk would cost a
            // mispredicted branch per chunk). Slots past `count` get junk that
            // `set_len` leaves out. A run longer than 8 digits sends the
            // chunk to the exact loop below.
            let mut long = false;
            let mut k = 0usize;
            let mut rest = starts;
            while k < count {
                for _ in 0..GROUP {
                    let pos = rest.trailing_zeros() as usize; // 32 once empty
                    rest &= rest.wrapping_sub(1);
                    let n = (non_digit >> pos).trailing_zeros() as usize; // 0 once empty
                    long |= n > 8;
                    dst[k].write(swar_upto8(b, p + pos, n) as u32);
                    k += 1;
                }
            }
            if !long {
                // SAFETY: slots base..base + count were written above (k >= count).
                unsafe { out.set_len(base + count) };
            } else {
                let mut k = 0usize;
                while starts != 0 {
                    let pos = starts.trailing_zeros() as usize;
                    starts &= starts - 1;
                    let n = (non_digit >> pos).trailing_zeros() as usize;
                    let q = p + pos;
                    let value = if n <= 10 {
                        digits_value(b, q, n)
                    } else {
                        u64::MAX
                    };
                    if value > u32::MAX as u64 {
                        // SAFETY: the first k slots past `base` were written below.
                        unsafe { out.set_len(base + k) };
                        return Run::Bail(q);
                    }
                    // At most 16 starts fit in 32 bytes and room for 16 + GROUP
                    // was reserved, so k < dst.len().
                    dst[k].write(value as u32);
                    k += 1;
                }
                // SAFETY: slots base..base + k were initialised in the loop above.
                unsafe { out.set_len(base + k) };
            }
            if bad != 0 {
                return Run::Bail(p + bad.trailing_zeros() as usize);
            }
            // The next element starts after the last comma and its space.
            let mut np = p + last_comma as usize + 1;
            if b[np] == b' ' {
                np += 1;
            }
            p = np;
        }
        Run::Bail(p)
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
}
