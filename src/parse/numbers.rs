//! Number arrays: `token_ids`-style u32 arrays straight into a pooled buffer,
//! and i64 hash arrays.
//!
//! The u32 loop is the hot path of the whole service (a 100k-token prompt is
//! ~700 KB of digits and commas). It handles the common shape
//! `[n,n, n,...]` inline; anything unusual (sign, fraction, exponent, leading
//! zero, more than 10 digits, a value above `u32::MAX`, a non-number) goes to
//! the general cursor at that element, which produces serde's exact error.
//! With a vector [`NumberPath`](super::NumberPath) the AVX-512 or AVX2 run in
//! [`super::simd`] converts whole stretches first; it stops at the first
//! element it does not like and this loop carries on from there.

use super::cursor::{is_ws, Cur};
use super::failure::{fail, Context, PResult};
use super::simd::{self, Vector};
use super::ErrorClass;

#[cold]
fn too_large(offset: usize, max: usize) -> Box<super::failure::Fail> {
    fail(
        ErrorClass::TooLarge,
        offset,
        format!("array has more than {max} elements"),
    )
}

/// The common-case parse of one u32 at `*i`: `0` or `[1-9][0-9]{0,9}` not
/// followed by `.`/`e`/`E`/digit, and not above `u32::MAX`. `None` means
/// "not the common case"; `*i` is then unspecified.
#[inline(always)]
pub(super) fn scalar_u32(b: &[u8], i: &mut usize) -> Option<u32> {
    // Up to 7 digits (every realistic token id): find the run length and
    // convert it with one 8-byte word (SWAR, no per-digit loop).
    let q = *i;
    if let Some(w) = b.get(q..q + 8) {
        let mut a = [0u8; 8];
        a.copy_from_slice(w);
        let x = u64::from_le_bytes(a);
        // A byte is a digit iff its high nibble is 3 and stays 3 after +6.
        // (A carry out of a byte >= 0xFA only disturbs bytes after a
        // non-digit, which are not looked at.)
        const HI: u64 = 0xF0F0_F0F0_F0F0_F0F0;
        const THREES: u64 = 0x3030_3030_3030_3030;
        let non_digit =
            ((x & HI) ^ THREES) | ((x.wrapping_add(0x0606_0606_0606_0606) & HI) ^ THREES);
        let n = (non_digit.trailing_zeros() / 8) as usize; // 8 if all digits
        if (1..=7).contains(&n) {
            if (n > 1 && x as u8 == b'0') || matches!(b[q + n], b'.' | b'e' | b'E') {
                return None;
            }
            *i = q + n;
            return Some(simd::swar8(x.wrapping_sub(THREES) << (8 * (8 - n))) as u32);
        }
        if n == 0 {
            return None;
        }
    }
    let c = *b.get(*i)?;
    let mut v = c.wrapping_sub(b'0') as u64;
    if v > 9 {
        return None;
    }
    *i += 1;
    if v == 0 {
        return match b.get(*i) {
            Some(b'0'..=b'9' | b'.' | b'e' | b'E') => None,
            _ => Some(0),
        };
    }
    let mut n = 1;
    while let Some(&d) = b.get(*i) {
        let d = d.wrapping_sub(b'0');
        if d > 9 {
            break;
        }
        v = v * 10 + d as u64;
        *i += 1;
        n += 1;
        if n > 10 {
            return None;
        }
    }
    if v > u32::MAX as u64 || matches!(b.get(*i), Some(b'.' | b'e' | b'E')) {
        return None;
    }
    Some(v as u32)
}

/// One element the fast loops refused, parsed by the general cursor: either
/// a value after all or the exact error. The cursor may sit on whitespace
/// (a vector run hands over right after a comma). A `]` here follows a comma
/// (`[]` is handled up front): serde's `trailing comma`, reported on the
/// array itself, not on an element.
#[cold]
#[inline(never)]
fn slow_u32(cur: &mut Cur<'_>, index: usize) -> PResult<u32> {
    match cur.ws() {
        Some(b']') => Err(cur.syntax_here("trailing comma")),
        None => Err(cur.eof("a value")),
        _ => cur.u32_val().index(index),
    }
}

/// Parses a JSON array of u32 at the cursor into `out` (appending). `null`
/// must be handled by the caller. At most `max` elements.
pub(crate) fn u32_array(
    cur: &mut Cur<'_>,
    out: &mut Vec<u32>,
    max: usize,
    vector: Option<Vector>,
) -> PResult<()> {
    if cur.array_start()? {
        // A streamed body's `[]` may stand for an array its front converted.
        if let Some(mut done) = cur.side.and_then(|s| s.take(cur.i - 2)) {
            if out.is_empty() {
                std::mem::swap(out, &mut *done);
            } else {
                out.extend_from_slice(&done);
            }
        }
        return Ok(());
    }
    let b = cur.b;
    let base = out.len();
    let mut i = cur.i;
    loop {
        if let Some(v) = vector {
            i = simd::u32_run(b, i, out, base + max, v);
        }
        let start = i;
        let v = match scalar_u32(b, &mut i) {
            Some(v) => v,
            None => {
                cur.i = start;
                let v = slow_u32(cur, out.len() - base)?;
                i = cur.i;
                v
            }
        };
        if out.len() - base >= max {
            return Err(too_large(start, max));
        }
        out.push(v);
        match b.get(i) {
            Some(b',') => {
                i += 1;
                if !matches!(b.get(i), Some(b'0'..=b'9')) {
                    while matches!(b.get(i), Some(&c) if is_ws(c)) {
                        i += 1;
                    }
                    if b.get(i) == Some(&b']') {
                        cur.i = i;
                        return Err(cur.syntax_here("trailing comma"));
                    }
                }
            }
            Some(b']') => {
                cur.i = i + 1;
                cur.leave();
                return Ok(());
            }
            _ => {
                cur.i = i;
                if !cur.array_next()? {
                    return Ok(());
                }
                i = cur.i;
            }
        }
    }
}

/// Parses a JSON array of i64 (reinterpreted as u64) at the cursor into `out`.
pub(crate) fn i64_array(cur: &mut Cur<'_>, out: &mut Vec<u64>, max: usize) -> PResult<()> {
    if cur.array_start()? {
        return Ok(());
    }
    loop {
        let n = out.len();
        if n >= max {
            return Err(too_large(cur.i, max));
        }
        let v = match cur.peek() {
            Some(b']') => return Err(cur.syntax_here("trailing comma")),
            _ => cur.i64_val().index(n)?,
        };
        out.push(v as u64);
        if !cur.array_next()? {
            return Ok(());
        }
    }
}

/// Parses a JSON array of u64 at the cursor (e.g. `allowed_worker_ids`).
pub(crate) fn u64_array(cur: &mut Cur<'_>, out: &mut Vec<u64>, max: usize) -> PResult<()> {
    if cur.array_start()? {
        return Ok(());
    }
    loop {
        let n = out.len();
        if n >= max {
            return Err(too_large(cur.i, max));
        }
        let v = match cur.peek() {
            Some(b']') => return Err(cur.syntax_here("trailing comma")),
            _ => cur.u64_val("u64").index(n)?,
        };
        out.push(v);
        if !cur.array_next()? {
            return Ok(());
        }
    }
}
