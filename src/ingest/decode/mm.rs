//! The multimodal and per-block extra fields of a `BlockStored`:
//! `block_mm_infos` (read and hashed) and `extra_keys` (checked, not hashed).
//!
//! What Dynamo 1.6.1 does with them was established by experiment: a ZMQ PUB
//! publishing vLLM-layout map events to `python -m dynamo.select_service`,
//! then `/overlap_scores` and `/dump` queries (block size 4, two blocks per
//! store; the commands and results are in ARCHITECTURE.md, "Multimodal blocks
//! in KV events"):
//!
//! - `block_mm_infos` (the form Dynamo's own TRT-LLM bridge sends; a map key,
//!   or the array after `extra_keys` in the positional form) is hashed like a
//!   request's `block_mm_infos`: block *i*'s `mm_hash`es are appended sorted,
//!   as little-endian u64, after its tokens. A store with `mm_hash` 42 on
//!   block 0 matched 2 blocks for a request carrying 42 there, 0 for 43 and 0
//!   for plain tokens; `[7, 3]` matched a request's `[3, 7]`; `offsets` are
//!   not hashed; a list shorter than the blocks leaves the rest plain; a
//!   block with empty `mm_objects` is plain.
//! - `extra_keys` does not change any hash. vLLM's image pair
//!   `[mm_identifier, offset]`, the cache salt string and the LoRA name as
//!   items all left the store matching plain tokens (2 blocks) and matching
//!   neither the same image (as `block_mm_infos`), nor `cache_salt`, nor
//!   `lora_name` in the request (0). So a vLLM image store matches only the
//!   same tokens without `mm_routing_info`, as in the reference.
//! - Both fields are still type-checked: a value outside the grammar below
//!   fails the whole batch in the reference ("data did not match any variant
//!   of untagged enum ExtraKeyItem", "missing field `offsets`", ...). Here it
//!   is a [`DecodeError`] too, so the batch is counted in
//!   `kvselect_ingest_malformed_dropped_total` and the stream goes on.
//!
//! Grammar accepted (anything else is malformed), each rule checked against
//! the reference:
//! - `extra_keys`: nil, or an array of entries; an entry is nil or an array
//!   of items; an item is a string, a bin holding UTF-8, an integer (any
//!   i64/u64), a bool, a float, an array of integers in 0..=255 (any length,
//!   even empty), or a pair `[string or UTF-8 bin, integer]`. Rejected: nil
//!   or map items, `[1, "h"]`, `["h"]`, `["h", 1.5]`, `[300, 0]`,
//!   non-UTF-8 bins, entries that are strings or ints. The entry count need
//!   not equal the block count.
//! - `block_mm_infos`: nil, or an array of nil or `{"mm_objects": [obj]}` (or
//!   the one-element array `[[obj]]`); `obj` is `{"mm_hash": u64, "offsets":
//!   [[u64, u64]...]}` (or `[mm_hash, offsets]`). Unknown map keys are
//!   ignored; `mm_objects`, `mm_hash` and `offsets` are required and not
//!   nullable; negative or float `mm_hash`es, offsets pairs of other lengths
//!   and negative offsets are rejected.

use super::cursor::{Container, Cursor, Int};
use super::{DecodeErrorKind, Result};
use rmp::Marker;

/// Per block, the multimodal hashes to mix into its content hash.
pub type BlockMm = Vec<Option<Vec<u64>>>;

impl<'a> Cursor<'a> {
    fn shape(&self, what: &'static str) -> super::DecodeError {
        self.err(DecodeErrorKind::Shape { what })
    }

    /// A bin value's bytes, if a bin is next (consumed).
    fn bin(&mut self) -> Result<Option<&'a [u8]>> {
        let n = match self.peek() {
            Some(Marker::Bin8) => {
                self.pos += 1;
                self.len8()?
            }
            Some(Marker::Bin16) => {
                self.pos += 1;
                self.len16()?
            }
            Some(Marker::Bin32) => {
                self.pos += 1;
                self.len32()?
            }
            _ => return Ok(None),
        };
        self.take(n).map(Some)
    }

    /// A string, or a bin holding UTF-8 (serde's string visitor takes both).
    fn text_like(&mut self) -> Result<bool> {
        if self.str_len_peek() {
            self.str()?;
            return Ok(true);
        }
        let at = self.pos;
        match self.bin()? {
            Some(b) if std::str::from_utf8(b).is_ok() => Ok(true),
            Some(_) => {
                self.pos = at;
                Err(self.err(DecodeErrorKind::InvalidUtf8))
            }
            None => Ok(false),
        }
    }

    fn is_int_next(&self) -> bool {
        matches!(
            self.peek(),
            Some(
                Marker::FixPos(_)
                    | Marker::FixNeg(_)
                    | Marker::U8
                    | Marker::U16
                    | Marker::U32
                    | Marker::U64
                    | Marker::I8
                    | Marker::I16
                    | Marker::I32
                    | Marker::I64
            )
        )
    }

    /// An unsigned integer (a non-negative signed encoding is fine, as serde
    /// reads it).
    fn unsigned(&mut self, field: &'static str) -> Result<u64> {
        let at = self.pos;
        match self.int("unsigned integer")? {
            Int::U(v) => Ok(v),
            Int::I(v) if v >= 0 => Ok(v as u64),
            Int::I(_) => {
                self.pos = at;
                Err(self.err(DecodeErrorKind::Range { field }))
            }
        }
    }

    /// `extra_keys`: checked against the grammar in the module docs and
    /// discarded (it does not change the hashes).
    pub(super) fn extra_keys(&mut self) -> Result<()> {
        if self.nil() {
            return Ok(());
        }
        let n = self.array_len("extra_keys array")?;
        for _ in 0..n {
            if self.nil() {
                continue;
            }
            let m = self.array_len("extra_keys entry (nil or array)")?;
            for _ in 0..m {
                self.extra_key_item()?;
            }
        }
        Ok(())
    }

    fn extra_key_item(&mut self) -> Result<()> {
        let at = self.pos;
        if self.text_like()? {
            return Ok(());
        }
        match self.peek() {
            Some(Marker::True | Marker::False | Marker::F32 | Marker::F64) => return self.skip(),
            _ if self.is_int_next() => return self.skip(),
            _ => {}
        }
        let bad = |c: &mut Self| {
            c.pos = at;
            Err(c.shape("extra_keys item"))
        };
        let Ok(Container::Array(k)) = self.container("extra_keys item") else {
            return bad(self);
        };
        // `[text, int]`: vLLM's `(mm_identifier, offset)`.
        if k == 2 && (self.str_len_peek() || self.bin_peek()) {
            if !self.text_like()? || !self.is_int_next() {
                return bad(self);
            }
            return self.skip();
        }
        // Otherwise a byte string spelt as an array of 0..=255.
        for _ in 0..k {
            match self.int("extra_keys byte") {
                Ok(Int::U(v)) if v <= 255 => {}
                Ok(Int::I(v)) if (0..=255).contains(&v) => {}
                _ => return bad(self),
            }
        }
        Ok(())
    }

    fn bin_peek(&self) -> bool {
        matches!(
            self.peek(),
            Some(Marker::Bin8 | Marker::Bin16 | Marker::Bin32)
        )
    }

    /// `block_mm_infos`: per block the `mm_hash`es of its `mm_objects`
    /// (`None` for a nil entry). Nil or absent means no multimodal blocks.
    pub(super) fn block_mm_infos(&mut self) -> Result<Option<BlockMm>> {
        if self.nil() {
            return Ok(None);
        }
        let n = self.array_len("block_mm_infos array")?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            if self.nil() {
                out.push(None);
                continue;
            }
            out.push(Some(self.block_mm_info()?));
        }
        Ok(Some(out))
    }

    /// One `BlockExtraInfo`: `{"mm_objects": [...]}` or `[[...]]`.
    fn block_mm_info(&mut self) -> Result<Vec<u64>> {
        match self.container("block_mm_infos entry (nil, map or array)")? {
            Container::Map(n) => {
                let mut objects = None;
                for _ in 0..n {
                    match self.key()? {
                        Some("mm_objects") => objects = Some(self.mm_objects()?),
                        _ => self.skip()?,
                    }
                }
                objects.ok_or_else(|| {
                    self.err(DecodeErrorKind::MissingField {
                        field: "mm_objects",
                    })
                })
            }
            Container::Array(1) => self.mm_objects(),
            Container::Array(_) => Err(self.shape("block_mm_infos entry (array of 1)")),
        }
    }

    fn mm_objects(&mut self) -> Result<Vec<u64>> {
        let n = self.array_len("mm_objects array")?;
        // Each object takes at least 3 bytes (`[0, []]`).
        let mut hashes = Vec::with_capacity(n.min(self.remaining() / 3));
        for _ in 0..n {
            hashes.push(self.mm_object()?);
        }
        Ok(hashes)
    }

    /// One `BlockMmObjectInfo`: `{"mm_hash", "offsets"}` or `[mm_hash,
    /// offsets]`; returns the hash (offsets are checked, not kept).
    fn mm_object(&mut self) -> Result<u64> {
        match self.container("mm_objects entry (map or array)")? {
            Container::Map(n) => {
                let (mut hash, mut offsets) = (None, false);
                for _ in 0..n {
                    match self.key()? {
                        Some("mm_hash") => hash = Some(self.unsigned("mm_hash")?),
                        Some("offsets") => {
                            self.offsets()?;
                            offsets = true;
                        }
                        _ => self.skip()?,
                    }
                }
                let missing = |c: &Self, field| c.err(DecodeErrorKind::MissingField { field });
                let hash = hash.ok_or_else(|| missing(self, "mm_hash"))?;
                if !offsets {
                    return Err(missing(self, "offsets"));
                }
                Ok(hash)
            }
            Container::Array(2) => {
                let hash = self.unsigned("mm_hash")?;
                self.offsets()?;
                Ok(hash)
            }
            Container::Array(_) => Err(self.shape("mm_objects entry (array of 2)")),
        }
    }

    /// `offsets`: `[[start, end], ...]` of unsigned integers.
    fn offsets(&mut self) -> Result<()> {
        let n = self.array_len("offsets array")?;
        for _ in 0..n {
            if self.array_len("offsets pair")? != 2 {
                return Err(self.shape("offsets pair (array of 2)"));
            }
            self.unsigned("offset")?;
            self.unsigned("offset")?;
        }
        Ok(())
    }
}
