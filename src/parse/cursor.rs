//! The byte cursor every body visitor reads through: whitespace, strings
//! (borrowed unless escaped), numbers classified the way serde_json classifies
//! them, literals, a validating skipper for unknown values, and the internal
//! error type.
//!
//! Invariants:
//! - the cursor never reads past the body (all access goes through `get`);
//! - every nested `[`/`{` goes through [`Cur::enter`], so the depth limit holds
//!   for typed and skipped values alike (serde_json semantics: with limit 128,
//!   127 levels are accepted);
//! - errors are built only on the error path: the happy path allocates nothing.

use super::failure::{fail, Context, Fail, PResult};
use super::{ErrorClass, Str};
use std::borrow::Cow;

/// A JSON number as serde_json classifies it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Num {
    U64(u64),
    I64(i64),
    F64(f64),
}

/// serde_json's rendering of an unexpected float in a type error (its
/// `JsonUnexpected`: the shortest round-trip form, `2000.0`, `1e+16`,
/// `1e-7`), which the reference's messages carry.
pub(crate) fn float_text(f: f64) -> String {
    zmij::Buffer::new().format(f).to_owned()
}

impl Num {
    /// serde's `Unexpected` text for this number.
    pub(crate) fn unexpected(self) -> String {
        match self {
            Num::U64(v) => format!("integer `{v}`"),
            Num::I64(v) => format!("integer `{v}`"),
            Num::F64(f) => format!("floating point `{}`", float_text(f)),
        }
    }
}

/// An error raised before an object's key was known: serde_path_to_error's
/// unknown segment.
#[cold]
fn unknown_key(mut e: Box<Fail>) -> Box<Fail> {
    e.segs.push(super::failure::Seg::Unknown);
    e
}

#[inline(always)]
pub(crate) fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\n' | b'\r' | b'\t')
}

pub(crate) struct Cur<'a> {
    pub b: &'a [u8],
    pub i: usize,
    depth: usize,
    max_depth: usize,
    /// Token arrays a streamed body's front already converted, by the
    /// offset of the `[]` that stands for each in `b` (`stream.rs`).
    pub side: Option<&'a super::stream::Side>,
    /// Skipping a value serde reads as `IgnoredAny`: its strings (and keys)
    /// are checked only as serde_json's `ignore_str` checks them.
    pub lenient: bool,
}

impl<'a> Cur<'a> {
    pub(crate) fn new(b: &'a [u8], max_depth: usize) -> Self {
        Cur {
            b,
            i: 0,
            depth: 0,
            max_depth,
            side: None,
            lenient: false,
        }
    }

    #[inline(always)]
    pub(crate) fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    /// Skips whitespace and returns the next byte, if any.
    #[inline(always)]
    pub(crate) fn ws(&mut self) -> Option<u8> {
        while let Some(&c) = self.b.get(self.i) {
            if !is_ws(c) {
                return Some(c);
            }
            self.i += 1;
        }
        None
    }

    #[cold]
    pub(crate) fn syntax_here(&self, msg: &str) -> Box<Fail> {
        // serde's peek_error: one past the offending byte.
        fail(ErrorClass::Syntax, (self.i + 1).min(self.b.len()), msg)
    }

    #[cold]
    pub(crate) fn eof(&self, what: &str) -> Box<Fail> {
        fail(
            ErrorClass::Syntax,
            self.b.len(),
            format!("EOF while parsing {what}"),
        )
    }

    #[cold]
    pub(crate) fn shape(&self, offset: usize, msg: String) -> Box<Fail> {
        fail(ErrorClass::Shape, offset, msg)
    }

    /// Where the cursor is (position and nesting), for [`Cur::reset`].
    #[inline]
    pub(crate) fn mark(&self) -> (usize, usize) {
        (self.i, self.depth)
    }

    /// Goes back to a [`Cur::mark`] taken earlier in the same body.
    #[inline]
    pub(crate) fn reset(&mut self, (i, depth): (usize, usize)) {
        self.i = i;
        self.depth = depth;
    }

    /// Opens a nesting level (the `[` or `{` at the cursor).
    #[inline]
    pub(crate) fn enter(&mut self) -> PResult<()> {
        self.depth += 1;
        if self.depth >= self.max_depth {
            return Err(self.syntax_here("recursion limit exceeded"));
        }
        self.i += 1;
        Ok(())
    }

    #[inline]
    pub(crate) fn leave(&mut self) {
        self.depth -= 1;
    }

    /// After a value inside an array: `,` (returns true: another element
    /// follows) or `]` (returns false). Rejects a trailing comma.
    #[inline]
    pub(crate) fn array_next(&mut self) -> PResult<bool> {
        match self.ws() {
            Some(b',') => {
                self.i += 1;
                match self.ws() {
                    Some(b']') => Err(self.syntax_here("trailing comma")),
                    None => Err(self.eof("a value")),
                    _ => Ok(true),
                }
            }
            Some(b']') => {
                self.i += 1;
                self.leave();
                Ok(false)
            }
            None => Err(self.eof("a list")),
            Some(_) => Err(self.syntax_here("expected `,` or `]`")),
        }
    }

    /// Just after `[` was entered: is the array empty (consumes `]`)?
    #[inline]
    pub(crate) fn array_empty(&mut self) -> PResult<bool> {
        match self.ws() {
            Some(b']') => {
                self.i += 1;
                self.leave();
                Ok(true)
            }
            None => Err(self.eof("a list")),
            Some(_) => Ok(false),
        }
    }

    /// Reads the next key of an object (cursor after `{` or after a value).
    /// Returns `None` at `}` (consumed). `first` says whether this is the
    /// first key (no comma expected).
    ///
    /// An error before the key is known carries serde_path_to_error's
    /// unknown segment (`?`); an error at the colon carries none, as the
    /// reference's paths have it.
    #[inline]
    pub(crate) fn next_key(&mut self, first: bool) -> PResult<Option<Key<'a>>> {
        let Some(key) = self.key_only(first).map_err(unknown_key)? else {
            return Ok(None);
        };
        self.colon()?;
        Ok(Some(key))
    }

    /// A struct's next field name: [`Cur::next_key`] without the colon,
    /// which serde reads only after it checked the name for a duplicate
    /// (`bodies::seen`, or `bodies::skip` for an unknown one).
    #[inline]
    pub(crate) fn next_field(&mut self, first: bool) -> PResult<Option<Key<'a>>> {
        self.key_only(first).map_err(unknown_key)
    }

    /// A map's next key up to its opening quote (`true`, the cursor on the
    /// quote) or its end (`false`, `}` consumed), for keys read in place
    /// (numeric keys). Errors carry the unknown segment.
    #[inline]
    pub(crate) fn map_key_start(&mut self, first: bool) -> PResult<bool> {
        self.key_start(first)
            .map(|k| k.is_some())
            .map_err(unknown_key)
    }

    /// [`Cur::next_key`] up to the key's closing quote, without the unknown
    /// segment on an error (an enum's map form, whose variant name serde
    /// checks before the colon).
    #[inline]
    pub(crate) fn key_only(&mut self, first: bool) -> PResult<Option<Key<'a>>> {
        match self.key_start(first)? {
            Some(()) => self.key_raw().map(Some),
            None => Ok(None),
        }
    }

    /// The `:` after a key.
    #[inline]
    pub(crate) fn colon(&mut self) -> PResult<()> {
        match self.ws() {
            Some(b':') => {
                self.i += 1;
                Ok(())
            }
            None => Err(self.eof("an object")),
            Some(_) => Err(self.syntax_here("expected `:`")),
        }
    }

    /// Up to a key's opening quote: `Some(())` on it, `None` at `}`
    /// (consumed).
    #[inline]
    fn key_start(&mut self, first: bool) -> PResult<Option<()>> {
        let mut c = self.ws();
        if !first {
            match c {
                Some(b',') => {
                    self.i += 1;
                    c = self.ws();
                    match c {
                        Some(b'}') => return Err(self.syntax_here("trailing comma")),
                        None => return Err(self.eof("a value")),
                        _ => {}
                    }
                }
                Some(b'}') => {
                    self.i += 1;
                    self.leave();
                    return Ok(None);
                }
                None => return Err(self.eof("an object")),
                Some(_) => return Err(self.syntax_here("expected `,` or `}`")),
            }
        } else if c == Some(b'}') {
            self.i += 1;
            self.leave();
            return Ok(None);
        }
        match c {
            Some(b'"') => Ok(Some(())),
            None => Err(self.eof("an object")),
            Some(_) => Err(self.syntax_here("key must be a string")),
        }
    }

    /// A key string at the cursor (on its `"`). Keys without backslashes stay
    /// raw bytes, matched directly; escaped keys are decoded.
    #[inline]
    fn key_raw(&mut self) -> PResult<Key<'a>> {
        if self.lenient {
            // Inside a skipped value: the key is not looked at.
            self.skip_string_lenient()?;
            return Ok(Key {
                bytes: Cow::Borrowed(b""),
                end: self.i,
            });
        }
        let start = self.i + 1;
        let mut j = start;
        while let Some(&c) = self.b.get(j) {
            match c {
                b'"' => {
                    let raw = &self.b[start..j];
                    if !raw.is_ascii() && std::str::from_utf8(raw).is_err() {
                        self.i = j;
                        return Err(self.syntax_here("invalid unicode code point"));
                    }
                    self.i = j + 1;
                    return Ok(Key {
                        bytes: Cow::Borrowed(raw),
                        end: j + 1,
                    });
                }
                b'\\' => {
                    let s = self.string()?;
                    let end = self.i;
                    return Ok(Key {
                        bytes: match s {
                            Cow::Borrowed(s) => Cow::Borrowed(s.as_bytes()),
                            Cow::Owned(s) => Cow::Owned(s.into_bytes()),
                        },
                        end,
                    });
                }
                0..=0x1f => {
                    self.i = j;
                    return Err(self.syntax_here(
                        "control character (\\u0000-\\u001F) found while parsing a string",
                    ));
                }
                _ => j += 1,
            }
        }
        self.i = self.b.len();
        Err(self.eof("a string"))
    }

    /// A string at the cursor (on its `"`): borrowed unless it holds escapes.
    #[inline]
    pub(crate) fn string(&mut self) -> PResult<Str<'a>> {
        let start = self.i + 1;
        let mut j = start;
        while let Some(&c) = self.b.get(j) {
            match c {
                b'"' => {
                    let raw = &self.b[start..j];
                    return match std::str::from_utf8(raw) {
                        Ok(s) => {
                            self.i = j + 1;
                            Ok(Cow::Borrowed(s))
                        }
                        Err(_) => {
                            // serde_json checks UTF-8 once the closing quote
                            // is read, and reports it after that quote.
                            self.i = j;
                            Err(self.syntax_here("invalid unicode code point"))
                        }
                    };
                }
                b'\\' => return self.string_escaped(start, j).map(Cow::Owned),
                0..=0x1f => {
                    self.i = j;
                    return Err(self.syntax_here(
                        "control character (\\u0000-\\u001F) found while parsing a string",
                    ));
                }
                _ => j += 1,
            }
        }
        self.i = self.b.len();
        Err(self.eof("a string"))
    }

    /// Slow path of [`Cur::string`]: `j` is the first backslash.
    fn string_escaped(&mut self, start: usize, mut j: usize) -> PResult<String> {
        let mut out: Vec<u8> = self.b[start..j].to_vec();
        loop {
            let Some(&c) = self.b.get(j) else {
                self.i = self.b.len();
                return Err(self.eof("a string"));
            };
            match c {
                b'"' => {
                    self.i = j + 1;
                    return match String::from_utf8(out) {
                        Ok(s) => Ok(s),
                        Err(_) => {
                            self.i = j;
                            Err(self.syntax_here("invalid unicode code point"))
                        }
                    };
                }
                b'\\' => {
                    j += 1;
                    let Some(&e) = self.b.get(j) else {
                        self.i = self.b.len();
                        return Err(self.eof("a string"));
                    };
                    j += 1;
                    match e {
                        b'"' => out.push(b'"'),
                        b'\\' => out.push(b'\\'),
                        b'/' => out.push(b'/'),
                        b'b' => out.push(8),
                        b'f' => out.push(12),
                        b'n' => out.push(b'\n'),
                        b'r' => out.push(b'\r'),
                        b't' => out.push(b'\t'),
                        b'u' => {
                            let ch = self.unicode_escape(&mut j)?;
                            let mut buf = [0u8; 4];
                            out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                        }
                        _ => {
                            self.i = j - 2;
                            return Err(fail(ErrorClass::Syntax, j, "invalid escape"));
                        }
                    }
                }
                0..=0x1f => {
                    self.i = j;
                    return Err(self.syntax_here(
                        "control character (\\u0000-\\u001F) found while parsing a string",
                    ));
                }
                _ => {
                    out.push(c);
                    j += 1;
                }
            }
        }
    }

    /// The four hex digits after `\u`, as serde_json reads them: fewer than
    /// four bytes left is EOF; otherwise all four are taken and a bad one is
    /// `invalid escape` after them.
    fn hex4(&self, j: &mut usize) -> PResult<u16> {
        let Some(digits) = self.b.get(*j..*j + 4) else {
            return Err(self.eof("a string"));
        };
        *j += 4;
        let mut v: u16 = 0;
        for &c in digits {
            let d = match c {
                b'0'..=b'9' => c - b'0',
                b'a'..=b'f' => c - b'a' + 10,
                b'A'..=b'F' => c - b'A' + 10,
                _ => return Err(fail(ErrorClass::Syntax, *j, "invalid escape")),
            };
            v = (v << 4) | d as u16;
        }
        Ok(v)
    }

    /// After `\u`: one code point, pairing surrogates; lone surrogates are
    /// errors, with serde_json's texts and positions: a leading surrogate
    /// not followed by `\u` is `unexpected end of hex escape` after the
    /// byte that broke it, any other unpaired one `lone leading surrogate`.
    fn unicode_escape(&self, j: &mut usize) -> PResult<char> {
        let n = self.hex4(j)?;
        match n {
            0xD800..=0xDBFF => {
                for want in [b'\\', b'u'] {
                    match self.b.get(*j) {
                        None => return Err(self.eof("a string")),
                        Some(&c) if c == want => *j += 1,
                        Some(_) => {
                            return Err(fail(
                                ErrorClass::Syntax,
                                *j + 1,
                                "unexpected end of hex escape",
                            ))
                        }
                    }
                }
                let lo = self.hex4(j)?;
                if !(0xDC00..=0xDFFF).contains(&lo) {
                    return Err(fail(
                        ErrorClass::Syntax,
                        *j,
                        "lone leading surrogate in hex escape",
                    ));
                }
                let c = 0x10000 + (((n as u32 - 0xD800) << 10) | (lo as u32 - 0xDC00));
                char::from_u32(c)
                    .ok_or_else(|| fail(ErrorClass::Syntax, *j, "invalid unicode code point"))
            }
            0xDC00..=0xDFFF => Err(fail(
                ErrorClass::Syntax,
                *j,
                "lone leading surrogate in hex escape",
            )),
            _ => char::from_u32(n as u32)
                .ok_or_else(|| fail(ErrorClass::Syntax, *j, "invalid unicode code point")),
        }
    }

    /// A string serde skips as `IgnoredAny` (`Cur::lenient`): escapes are
    /// checked for their shape only (a `\u` needs four hex digits), and
    /// neither surrogates nor UTF-8 are validated, as serde_json's
    /// `ignore_str` has it.
    fn skip_string_lenient(&mut self) -> PResult<()> {
        let mut j = self.i + 1;
        loop {
            let Some(&c) = self.b.get(j) else {
                self.i = self.b.len();
                return Err(self.eof("a string"));
            };
            match c {
                b'"' => {
                    self.i = j + 1;
                    return Ok(());
                }
                b'\\' => {
                    let Some(&e) = self.b.get(j + 1) else {
                        self.i = self.b.len();
                        return Err(self.eof("a string"));
                    };
                    j += 2;
                    match e {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {}
                        b'u' => {
                            self.hex4(&mut j)?;
                        }
                        _ => return Err(fail(ErrorClass::Syntax, j, "invalid escape")),
                    }
                }
                0..=0x1f => {
                    self.i = j;
                    return Err(self.syntax_here(
                        "control character (\\u0000-\\u001F) found while parsing a string",
                    ));
                }
                _ => j += 1,
            }
        }
    }

    /// Validates a string at the cursor without keeping it.
    fn skip_string(&mut self) -> PResult<()> {
        if self.lenient {
            return self.skip_string_lenient();
        }
        let start = self.i + 1;
        let mut j = start;
        while let Some(&c) = self.b.get(j) {
            match c {
                b'"' => {
                    if std::str::from_utf8(&self.b[start..j]).is_err() {
                        // After the closing quote, as in [`Cur::string`].
                        self.i = j;
                        return Err(self.syntax_here("invalid unicode code point"));
                    }
                    self.i = j + 1;
                    return Ok(());
                }
                b'\\' => {
                    self.string_escaped(start, j)?;
                    return Ok(());
                }
                0..=0x1f => {
                    self.i = j;
                    return Err(self.syntax_here(
                        "control character (\\u0000-\\u001F) found while parsing a string",
                    ));
                }
                _ => j += 1,
            }
        }
        self.i = self.b.len();
        Err(self.eof("a string"))
    }

    /// A number at the cursor (on `-` or a digit), classified like serde_json.
    /// A float too large for f64 is serde's "number out of range" (syntax).
    pub(crate) fn number(&mut self) -> PResult<Num> {
        let start = self.i;
        let neg = self.peek() == Some(b'-');
        if neg {
            self.i += 1;
        }
        let int_start = self.i;
        match self.peek() {
            Some(b'0') => {
                self.i += 1;
                if matches!(self.peek(), Some(b'0'..=b'9')) {
                    return Err(self.syntax_here("invalid number"));
                }
            }
            Some(b'1'..=b'9') => {
                while matches!(self.peek(), Some(b'0'..=b'9')) {
                    self.i += 1;
                }
            }
            None => return Err(self.eof("a value")),
            Some(_) => {
                self.i += 1;
                return Err(fail(ErrorClass::Syntax, self.i, "invalid number"));
            }
        }
        let int_end = self.i;
        let mut float = false;
        if self.peek() == Some(b'.') {
            float = true;
            self.i += 1;
            match self.peek() {
                Some(b'0'..=b'9') => {}
                None => return Err(self.eof("a value")),
                Some(_) => return Err(self.syntax_here("invalid number")),
            }
            while matches!(self.peek(), Some(b'0'..=b'9')) {
                self.i += 1;
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            float = true;
            self.i += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
            match self.peek() {
                Some(b'0'..=b'9') => {}
                None => return Err(self.eof("a value")),
                Some(_) => return Err(self.syntax_here("invalid number")),
            }
            while matches!(self.peek(), Some(b'0'..=b'9')) {
                self.i += 1;
            }
        }
        let digits = &self.b[int_start..int_end];
        if !float && digits.len() <= 20 {
            let mut v: u64 = 0;
            let mut ok = true;
            for &d in digits {
                match v
                    .checked_mul(10)
                    .and_then(|v| v.checked_add((d - b'0') as u64))
                {
                    Some(n) => v = n,
                    None => {
                        ok = false;
                        break;
                    }
                }
            }
            if ok {
                if !neg {
                    return Ok(Num::U64(v));
                }
                let n = (v as i64).wrapping_neg();
                // serde_json: `-0` and magnitudes past i64::MIN become floats.
                if n < 0 {
                    return Ok(Num::I64(n));
                }
                if v == 0 {
                    return Ok(Num::F64(-0.0));
                }
            }
        }
        // The text is ASCII digits/sign/./e only, so this cannot fail.
        let text = std::str::from_utf8(&self.b[start..self.i]).unwrap_or("0");
        let f: f64 = text.parse().unwrap_or(f64::NAN);
        if !f.is_finite() {
            return Err(fail(ErrorClass::Syntax, self.i, "number out of range"));
        }
        Ok(Num::F64(f))
    }

    /// A literal (`true`, `false`, `null`) at the cursor; `rest` is the
    /// literal without its first byte.
    fn literal(&mut self, rest: &[u8]) -> PResult<()> {
        self.i += 1;
        for &want in rest {
            match self.peek() {
                Some(c) if c == want => self.i += 1,
                None => return Err(self.eof("a value")),
                Some(_) => return Err(self.syntax_here("expected ident")),
            }
        }
        Ok(())
    }

    /// Skips one value (cursor on its first byte, whitespace already skipped
    /// or not), validating it fully and respecting the depth limit. Builds
    /// nothing.
    pub(crate) fn skip_value(&mut self) -> PResult<()> {
        match self.ws() {
            None => Err(self.eof("a value")),
            Some(b'"') => self.skip_string(),
            Some(b'{') => {
                self.enter()?;
                let mut first = true;
                while let Some(k) = self.next_key(first)? {
                    first = false;
                    if let Err(e) = self.skip_value() {
                        return Err(e).key(&k.text());
                    }
                }
                Ok(())
            }
            Some(b'[') => {
                self.enter()?;
                if self.array_empty()? {
                    return Ok(());
                }
                let mut n = 0usize;
                loop {
                    self.skip_value().index(n)?;
                    n += 1;
                    if !self.array_next()? {
                        return Ok(());
                    }
                }
            }
            Some(b't') => self.literal(b"rue"),
            Some(b'f') => self.literal(b"alse"),
            Some(b'n') => self.literal(b"ull"),
            Some(b'-' | b'0'..=b'9') => self.skip_number(),
            Some(_) => Err(self.syntax_here("expected value")),
        }
    }

    /// Validates a number; the common short integer avoids float parsing.
    fn skip_number(&mut self) -> PResult<()> {
        let start = self.i;
        let mut j = start;
        if self.b.get(j) == Some(&b'-') {
            j += 1;
        }
        let mut plain = true;
        let mut k = j;
        while let Some(c) = self.b.get(k) {
            match c {
                b'0'..=b'9' => k += 1,
                b'.' | b'e' | b'E' | b'+' | b'-' => {
                    plain = false;
                    break;
                }
                _ => break,
            }
        }
        let n = k - j;
        if plain && n > 0 && n < 300 && !(n > 1 && self.b[j] == b'0') {
            self.i = k;
            return Ok(());
        }
        match self.number() {
            // serde_json skips an ignored number by its shape alone, so a
            // valid number beyond f64's range passes there (`number` has
            // already read up to its end).
            Err(e) if self.lenient && e.message == "number out of range" => Ok(()),
            r => r.map(|_| ()),
        }
    }

    /// Parses a value that is not what the field wanted, to describe it the
    /// way serde does (`invalid type: string "x", expected ...`). Syntax errors
    /// inside it win. Containers are described without being parsed.
    #[cold]
    pub(crate) fn wrong_type(&mut self, expected: &str) -> Box<Fail> {
        let start = self.i;
        let what = match self.peek() {
            Some(b'"') => match self.string() {
                Ok(s) => format!("string {s:?}"),
                Err(e) => return e,
            },
            Some(b't') => match self.literal(b"rue") {
                Ok(()) => "boolean `true`".to_string(),
                Err(e) => return e,
            },
            Some(b'f') => match self.literal(b"alse") {
                Ok(()) => "boolean `false`".to_string(),
                Err(e) => return e,
            },
            Some(b'n') => match self.literal(b"ull") {
                Ok(()) => "null".to_string(),
                Err(e) => return e,
            },
            Some(b'-' | b'0'..=b'9') => match self.number() {
                Ok(n) => n.unexpected(),
                Err(e) => return e,
            },
            Some(b'[') => {
                return self.shape(
                    start,
                    format!("invalid type: sequence, expected {expected}"),
                )
            }
            Some(b'{') => {
                return self.shape(start, format!("invalid type: map, expected {expected}"))
            }
            None => return self.eof("a value"),
            Some(_) => return self.syntax_here("expected value"),
        };
        self.shape(self.i, format!("invalid type: {what}, expected {expected}"))
    }

    // ---- typed scalars -------------------------------------------------

    /// `null` at the cursor? Consumes it. Used for `Option` fields.
    #[inline]
    pub(crate) fn null(&mut self) -> PResult<bool> {
        if self.ws() == Some(b'n') {
            self.literal(b"ull")?;
            return Ok(true);
        }
        Ok(false)
    }

    pub(crate) fn str_val(&mut self) -> PResult<Str<'a>> {
        match self.ws() {
            Some(b'"') => self.string(),
            _ => Err(self.wrong_type("a string")),
        }
    }

    pub(crate) fn bool_val(&mut self) -> PResult<bool> {
        match self.ws() {
            Some(b't') => self.literal(b"rue").map(|_| true),
            Some(b'f') => self.literal(b"alse").map(|_| false),
            _ => Err(self.wrong_type("a boolean")),
        }
    }

    fn num_val(&mut self, expected: &str) -> PResult<Num> {
        match self.ws() {
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => Err(self.wrong_type(expected)),
        }
    }

    pub(crate) fn u64_val(&mut self, expected: &str) -> PResult<u64> {
        let n = self.num_val(expected)?;
        self.u64_of(n, expected)
    }

    /// `n`, the number just read, as an unsigned integer (serde's errors
    /// for a negative or fractional one, at the number's end).
    fn u64_of(&self, n: Num, expected: &str) -> PResult<u64> {
        match n {
            Num::U64(v) => Ok(v),
            Num::I64(_) => Err(self.shape(
                self.i,
                format!("invalid value: {}, expected {expected}", n.unexpected()),
            )),
            Num::F64(_) => Err(self.shape(
                self.i,
                format!("invalid type: {}, expected {expected}", n.unexpected()),
            )),
        }
    }

    pub(crate) fn u32_val(&mut self) -> PResult<u32> {
        let n = self.num_val("u32")?;
        self.u32_of(n)
    }

    /// `n`, the number just read, as a u32.
    pub(crate) fn u32_of(&self, n: Num) -> PResult<u32> {
        let v = self.u64_of(n, "u32")?;
        u32::try_from(v).map_err(|_| {
            self.shape(
                self.i,
                format!("invalid value: integer `{v}`, expected u32"),
            )
        })
    }

    pub(crate) fn i64_val(&mut self) -> PResult<i64> {
        match self.num_val("i64")? {
            Num::U64(v) => i64::try_from(v).map_err(|_| {
                self.shape(
                    self.i,
                    format!("invalid value: integer `{v}`, expected i64"),
                )
            }),
            Num::I64(v) => Ok(v),
            n @ Num::F64(_) => Err(self.shape(
                self.i,
                format!("invalid type: {}, expected i64", n.unexpected()),
            )),
        }
    }

    pub(crate) fn f64_val(&mut self, expected: &str) -> PResult<f64> {
        Ok(match self.num_val(expected)? {
            Num::U64(v) => v as f64,
            Num::I64(v) => v as f64,
            Num::F64(f) => f,
        })
    }

    /// Expects `{` and enters it.
    pub(crate) fn object_start(&mut self, expected: &str) -> PResult<()> {
        match self.ws() {
            Some(b'{') => self.enter(),
            _ => Err(self.wrong_type(expected)),
        }
    }

    /// Expects `[` and enters it; returns true if the array is empty.
    pub(crate) fn array_start(&mut self) -> PResult<bool> {
        match self.ws() {
            Some(b'[') => {
                self.enter()?;
                self.array_empty()
            }
            _ => Err(self.wrong_type("a sequence")),
        }
    }
}

/// An object key: raw bytes when it had no escapes.
pub(crate) struct Key<'a> {
    pub bytes: Cow<'a, [u8]>,
    /// Offset just past the key's closing quote (serde reports duplicate
    /// fields there).
    pub end: usize,
}

impl Key<'_> {
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }
}
