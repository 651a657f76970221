//! The bounds-checked msgpack reader under the KV-event decoder.
//!
//! Owns: reading msgpack values from a borrowed payload (markers, lengths,
//! ints, strings, the hash and token-id forms engines send) and skipping
//! unknown values iteratively. Every read is checked against the bytes left,
//! and a length prefix is believed only as far as those bytes could hold it.
//! Does not: know the event schema (`mod.rs` walks batches and events).

use super::{DecodeError, DecodeErrorKind, Result};
use rmp::Marker;

pub(super) enum Container {
    Array(usize),
    Map(usize),
}

pub(super) enum Int {
    U(u64),
    I(i64),
}

/// A bounds-checked msgpack reader over a borrowed payload.
pub(super) struct Cursor<'a> {
    buf: &'a [u8],
    pub(super) pos: usize,
}

impl<'a> Cursor<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Cursor { buf, pos: 0 }
    }

    pub(super) fn err(&self, kind: DecodeErrorKind) -> DecodeError {
        DecodeError {
            kind,
            offset: self.pos,
        }
    }

    pub(super) fn type_err(&self, expected: &'static str) -> DecodeError {
        self.err(DecodeErrorKind::Type { expected })
    }

    pub(super) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| self.err(DecodeErrorKind::Eof))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    pub(super) fn byte(&mut self) -> Result<u8> {
        let b = *self
            .buf
            .get(self.pos)
            .ok_or_else(|| self.err(DecodeErrorKind::Eof))?;
        self.pos += 1;
        Ok(b)
    }

    pub(super) fn be<const N: usize>(&mut self) -> Result<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    pub(super) fn marker(&mut self) -> Result<Marker> {
        Ok(Marker::from_u8(self.byte()?))
    }

    pub(super) fn peek(&self) -> Option<Marker> {
        self.buf.get(self.pos).map(|&b| Marker::from_u8(b))
    }

    pub(super) fn peek_is_array(&self) -> bool {
        matches!(
            self.peek(),
            Some(Marker::FixArray(_) | Marker::Array16 | Marker::Array32)
        )
    }

    /// Consumes a nil if one is next.
    pub(super) fn nil(&mut self) -> bool {
        if self.peek() == Some(Marker::Null) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// Length of a variable-size value after its marker (str/bin/array/map
    /// 8/16/32 forms).
    pub(super) fn len8(&mut self) -> Result<usize> {
        Ok(self.byte()? as usize)
    }
    pub(super) fn len16(&mut self) -> Result<usize> {
        Ok(u16::from_be_bytes(self.be()?) as usize)
    }
    pub(super) fn len32(&mut self) -> Result<usize> {
        Ok(u32::from_be_bytes(self.be()?) as usize)
    }

    /// An element count, checked against the bytes left: each element needs
    /// at least `min_bytes` (1 for an array, 2 for a map entry).
    pub(super) fn count(&self, n: usize, min_bytes: usize) -> Result<usize> {
        if n.saturating_mul(min_bytes) > self.remaining() {
            return Err(self.err(DecodeErrorKind::Length));
        }
        Ok(n)
    }

    pub(super) fn container(&mut self, expected: &'static str) -> Result<Container> {
        let at = self.pos;
        let c = match self.marker()? {
            Marker::FixArray(n) => Container::Array(self.count(n as usize, 1)?),
            Marker::Array16 => {
                let n = self.len16()?;
                Container::Array(self.count(n, 1)?)
            }
            Marker::Array32 => {
                let n = self.len32()?;
                Container::Array(self.count(n, 1)?)
            }
            Marker::FixMap(n) => Container::Map(self.count(n as usize, 2)?),
            Marker::Map16 => {
                let n = self.len16()?;
                Container::Map(self.count(n, 2)?)
            }
            Marker::Map32 => {
                let n = self.len32()?;
                Container::Map(self.count(n, 2)?)
            }
            _ => {
                self.pos = at;
                return Err(self.type_err(expected));
            }
        };
        Ok(c)
    }

    pub(super) fn array_len(&mut self, expected: &'static str) -> Result<usize> {
        let at = self.pos;
        match self.container(expected)? {
            Container::Array(n) => Ok(n),
            Container::Map(_) => {
                self.pos = at;
                Err(self.type_err(expected))
            }
        }
    }

    pub(super) fn int(&mut self, expected: &'static str) -> Result<Int> {
        let at = self.pos;
        Ok(match self.marker()? {
            Marker::FixPos(v) => Int::U(v as u64),
            Marker::FixNeg(v) => Int::I(v as i64),
            Marker::U8 => Int::U(self.byte()? as u64),
            Marker::U16 => Int::U(u16::from_be_bytes(self.be()?) as u64),
            Marker::U32 => Int::U(u32::from_be_bytes(self.be()?) as u64),
            Marker::U64 => Int::U(u64::from_be_bytes(self.be()?)),
            Marker::I8 => Int::I(self.byte()? as i8 as i64),
            Marker::I16 => Int::I(i16::from_be_bytes(self.be()?) as i64),
            Marker::I32 => Int::I(i32::from_be_bytes(self.be()?) as i64),
            Marker::I64 => Int::I(i64::from_be_bytes(self.be()?)),
            _ => {
                self.pos = at;
                return Err(self.type_err(expected));
            }
        })
    }

    pub(super) fn u32(&mut self, field: &'static str) -> Result<u32> {
        let at = self.pos;
        let v = match self.int("unsigned integer")? {
            Int::U(v) => u32::try_from(v).ok(),
            Int::I(v) => u32::try_from(v).ok(),
        };
        v.ok_or(DecodeError {
            kind: DecodeErrorKind::Range { field },
            offset: at,
        })
    }

    pub(super) fn opt_u32(&mut self, field: &'static str) -> Result<Option<u32>> {
        if self.nil() {
            return Ok(None);
        }
        self.u32(field).map(Some)
    }

    /// A block hash: uint64, int64 (two's complement, SGLang/TRT-LLM) or a
    /// binary digest (vLLM with int hashes off: its low 64 bits, i.e. the last
    /// 8 bytes read big endian).
    pub(super) fn hash(&mut self) -> Result<u64> {
        let at = self.pos;
        let bin_len = match self.peek() {
            Some(Marker::Bin8) => {
                self.pos += 1;
                Some(self.len8()?)
            }
            Some(Marker::Bin16) => {
                self.pos += 1;
                Some(self.len16()?)
            }
            Some(Marker::Bin32) => {
                self.pos += 1;
                Some(self.len32()?)
            }
            _ => None,
        };
        if let Some(n) = bin_len {
            let bytes = self.take(n)?;
            let Some(tail) = bytes.len().checked_sub(8).map(|s| &bytes[s..]) else {
                return Err(DecodeError {
                    kind: DecodeErrorKind::Shape {
                        what: "binary block hash (shorter than 8 bytes)",
                    },
                    offset: at,
                });
            };
            let mut a = [0u8; 8];
            a.copy_from_slice(tail);
            return Ok(u64::from_be_bytes(a));
        }
        Ok(match self.int("block hash (int or bin)")? {
            Int::U(v) => v,
            Int::I(v) => v as u64,
        })
    }

    pub(super) fn opt_hash(&mut self) -> Result<Option<u64>> {
        if self.nil() {
            return Ok(None);
        }
        self.hash().map(Some)
    }

    pub(super) fn hashes(&mut self) -> Result<Vec<u64>> {
        let n = self.array_len("block_hashes array")?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(self.hash()?);
        }
        Ok(v)
    }

    /// `token_ids`: `[t, ...]`, or EAGLE bigrams `[[t0, t1], [t1, t2], ...]`
    /// flattened to `[t0, t1, ..., tn]`. Returns `(tokens, is_bigram)`.
    pub(super) fn tokens(&mut self) -> Result<(Vec<u32>, bool)> {
        let n = self.array_len("token_ids array")?;
        if n > 0 && self.peek_is_array() {
            // Each pair takes at least 3 bytes; `count` checked 1 per element.
            let mut v = Vec::with_capacity(n + 1);
            let mut last = 0;
            for _ in 0..n {
                if self.array_len("token bigram")? != 2 {
                    return Err(self.err(DecodeErrorKind::Shape {
                        what: "token bigram (not a pair)",
                    }));
                }
                v.push(self.u32("token id")?);
                last = self.u32("token id")?;
            }
            v.push(last);
            return Ok((v, true));
        }
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(self.token_id()?);
        }
        Ok((v, false))
    }

    /// One token id: [`Cursor::u32`] with the forms engines write (positive
    /// fixint, uint8, uint16, uint32) read straight off the buffer. A
    /// `BlockStored` carries 16 or more ids per block, and through the
    /// general `int` each cost a marker decode and a 10-way match; any other
    /// form, and a truncated one, takes that path and its errors.
    #[inline(always)]
    fn token_id(&mut self) -> Result<u32> {
        let b = &self.buf[self.pos..];
        let (v, len) = match *b {
            [m, ..] if m < 0x80 => (m as u32, 1),
            [0xcc, x, ..] => (x as u32, 2),
            [0xcd, x, y, ..] => (u16::from_be_bytes([x, y]) as u32, 3),
            [0xce, x, y, z, w, ..] => (u32::from_be_bytes([x, y, z, w]), 5),
            _ => return self.u32("token id"),
        };
        self.pos += len;
        Ok(v)
    }

    pub(super) fn f64(&mut self) -> Result<f64> {
        let at = self.pos;
        Ok(match self.peek() {
            Some(Marker::F64) => {
                self.pos += 1;
                f64::from_bits(u64::from_be_bytes(self.be()?))
            }
            Some(Marker::F32) => {
                self.pos += 1;
                f32::from_bits(u32::from_be_bytes(self.be()?)) as f64
            }
            _ => match self.int("float timestamp") {
                Ok(Int::U(v)) => v as f64,
                Ok(Int::I(v)) => v as f64,
                Err(_) => {
                    self.pos = at;
                    return Err(self.type_err("float timestamp"));
                }
            },
        })
    }

    pub(super) fn str_len(&mut self) -> Result<Option<usize>> {
        Ok(Some(match self.peek() {
            Some(Marker::FixStr(n)) => {
                self.pos += 1;
                n as usize
            }
            Some(Marker::Str8) => {
                self.pos += 1;
                self.len8()?
            }
            Some(Marker::Str16) => {
                self.pos += 1;
                self.len16()?
            }
            Some(Marker::Str32) => {
                self.pos += 1;
                self.len32()?
            }
            _ => return Ok(None),
        }))
    }

    pub(super) fn str(&mut self) -> Result<&'a str> {
        let at = self.pos;
        let Some(n) = self.str_len()? else {
            return Err(self.type_err("string"));
        };
        let bytes = self.take(n)?;
        std::str::from_utf8(bytes).map_err(|_| DecodeError {
            kind: DecodeErrorKind::InvalidUtf8,
            offset: at,
        })
    }

    pub(super) fn opt_str(&mut self) -> Result<Option<&'a str>> {
        if self.nil() {
            return Ok(None);
        }
        self.str().map(Some)
    }

    /// A map key: `Some(text)` for a string key, `None` (already skipped) for
    /// any other key type, whose value the caller then skips.
    pub(super) fn key(&mut self) -> Result<Option<&'a str>> {
        if self.str_len_peek() {
            return self.str().map(Some);
        }
        self.skip()?;
        Ok(None)
    }

    pub(super) fn str_len_peek(&self) -> bool {
        matches!(
            self.peek(),
            Some(Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32)
        )
    }

    /// Skips one complete value of any type. Iterative: `pending` counts the
    /// values still to skip, so nesting depth costs no stack.
    pub(super) fn skip(&mut self) -> Result<()> {
        let mut pending: usize = 1;
        while pending > 0 {
            pending -= 1;
            let add = match self.marker()? {
                Marker::FixPos(_)
                | Marker::FixNeg(_)
                | Marker::Null
                | Marker::True
                | Marker::False => 0,
                Marker::Reserved => return Err(self.type_err("msgpack value (0xc1)")),
                Marker::U8 | Marker::I8 => self.take(1).map(|_| 0)?,
                Marker::U16 | Marker::I16 => self.take(2).map(|_| 0)?,
                Marker::U32 | Marker::I32 | Marker::F32 => self.take(4).map(|_| 0)?,
                Marker::U64 | Marker::I64 | Marker::F64 => self.take(8).map(|_| 0)?,
                Marker::FixStr(n) => self.take(n as usize).map(|_| 0)?,
                Marker::Str8 | Marker::Bin8 => {
                    let n = self.len8()?;
                    self.take(n).map(|_| 0)?
                }
                Marker::Str16 | Marker::Bin16 => {
                    let n = self.len16()?;
                    self.take(n).map(|_| 0)?
                }
                Marker::Str32 | Marker::Bin32 => {
                    let n = self.len32()?;
                    self.take(n).map(|_| 0)?
                }
                Marker::FixExt1 => self.take(2).map(|_| 0)?,
                Marker::FixExt2 => self.take(3).map(|_| 0)?,
                Marker::FixExt4 => self.take(5).map(|_| 0)?,
                Marker::FixExt8 => self.take(9).map(|_| 0)?,
                Marker::FixExt16 => self.take(17).map(|_| 0)?,
                Marker::Ext8 => {
                    let n = self.len8()?;
                    self.take(n + 1).map(|_| 0)?
                }
                Marker::Ext16 => {
                    let n = self.len16()?;
                    self.take(n + 1).map(|_| 0)?
                }
                Marker::Ext32 => {
                    let n = self.len32()?;
                    self.take(n.saturating_add(1)).map(|_| 0)?
                }
                Marker::FixArray(n) => self.count(n as usize, 1)?,
                Marker::Array16 => {
                    let n = self.len16()?;
                    self.count(n, 1)?
                }
                Marker::Array32 => {
                    let n = self.len32()?;
                    self.count(n, 1)?
                }
                Marker::FixMap(n) => self.count(n as usize, 2)? * 2,
                Marker::Map16 => {
                    let n = self.len16()?;
                    self.count(n, 2)? * 2
                }
                Marker::Map32 => {
                    let n = self.len32()?;
                    self.count(n, 2)? * 2
                }
            };
            // `count` bounded `add` by the bytes left, so this cannot overflow
            // in practice; checked anyway.
            pending = pending
                .checked_add(add)
                .ok_or_else(|| self.err(DecodeErrorKind::Length))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Cursor;

    /// Every msgpack integer form a token id may come in (and some it must
    /// not), each value alone, in an array, and cut short at every byte: the
    /// token path gives what the general `u32` path gives, value or error.
    #[test]
    fn token_ids_read_as_the_general_path_reads_them() {
        let mut forms: Vec<Vec<u8>> = vec![
            vec![0x00],
            vec![0x7f],
            vec![0xcc, 0x80],
            vec![0xcc, 0xff],
            vec![0xcd, 0x01, 0x00],
            vec![0xcd, 0xff, 0xff],
            vec![0xce, 0x00, 0x01, 0x00, 0x00],
            vec![0xce, 0xff, 0xff, 0xff, 0xff],
            vec![0xcf, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff],
            vec![0xcf, 0, 0, 0, 1, 0, 0, 0, 0],
            vec![0xd0, 0x05],
            vec![0xd0, 0xfb],
            vec![0xe0],
            vec![0xd1, 0x7f, 0xff],
            vec![0xd2, 0x80, 0, 0, 0],
            vec![0xc0],
            vec![0xa1, b'x'],
            vec![0xca, 0, 0, 0, 0],
        ];
        // Every one-byte marker but the arrays' (an array of arrays is the
        // bigram form, read by its own path).
        forms.extend(
            (0..=255u8)
                .filter(|b| !matches!(b, 0x90..=0x9f | 0xdc | 0xdd))
                .map(|b| vec![b]),
        );
        for form in &forms {
            for cut in 0..=form.len() {
                let mut array = vec![0x91];
                array.extend_from_slice(&form[..cut]);
                let mut fast = Cursor::new(&array);
                let got = fast.tokens().map(|(v, _)| v);
                let mut general = Cursor::new(&array);
                let want = general
                    .array_len("token_ids array")
                    .and_then(|_| general.u32("token id"))
                    .map(|t| vec![t]);
                assert_eq!(got, want, "{form:02x?} cut at {cut}");
                if got.is_ok() {
                    assert_eq!(fast.pos, general.pos, "{form:02x?}");
                }
            }
        }
    }
}
