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

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn u32_run(b: &[u8], mut p: usize, out: &mut Vec<u32>, max: usize) -> Run {
        let zero = _mm256_set1_epi8(b'0' as i8);
        let nine = _mm256_set1_epi8(9);
        while p + MARGIN <= b.len() && out.len() + 16 <= max {
            // SAFETY: p + 32 <= p + MARGIN <= b.len(), so the unaligned 32-byte
            // load reads only bytes of `b`.
            let v = unsafe { _mm256_loadu_si256(b.as_ptr().add(p) as *const __m256i) };
            let t = _mm256_sub_epi8(v, zero);
            let is_digit = _mm256_cmpeq_epi8(_mm256_min_epu8(t, nine), t);
            // Bits 32..64 are zero: "not a digit" beyond the chunk.
            let non_digit = !(_mm256_movemask_epi8(is_digit) as u32 as u64);
            out.reserve(16);
            let mut s = 0usize;
            loop {
                let n = (non_digit >> s).trailing_zeros() as usize;
                if s + n >= 32 {
                    // The run may continue past the chunk: reload from its start.
                    break;
                }
                let q = p + s;
                if n == 0 || n > 10 || (n > 1 && b[q] == b'0') {
                    return Run::Bail(q);
                }
                let e = q + n;
                let value = digits_value(b, q, n);
                if value > u32::MAX as u64 {
                    return Run::Bail(q);
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
                        return Run::Done(e + 1);
                    }
                    _ => return Run::Bail(q),
                }
                if s >= 32 {
                    break;
                }
            }
            if s == 0 {
                // A 32-digit run: not a u32; let the scalar loop say so.
                return Run::Bail(p);
            }
            p += s;
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
}
