//! Pure decoder for engine KV-cache events (`kv-events.md` §2-§3, §5.2, §6).
//!
//! Owns: the wire format of one ZMQ message (`[topic, seq, payload]`), of a
//! replay reply, and of the msgpack batch inside the payload. Bytes in, typed
//! values out; no I/O, no index, no state.
//!
//! Invariants, because every byte here comes from the network:
//! - nothing panics: every read goes through [`Cursor`], which checks bounds;
//! - no length prefix allocates more than the bytes that are left could
//!   possibly hold (each msgpack element takes at least one byte), so a 5-byte
//!   message cannot ask for a 4 GiB vector;
//! - skipping unknown values is iterative, so nesting depth cannot overflow
//!   the stack.
//!
//! Tolerance (wider than Dynamo 1.6.1, on purpose): batches as 2- or 3-element
//! arrays or as a map; events as tagged maps (any key order, unknown keys
//! ignored, any map header) or tagged arrays of any length that holds the
//! needed fields; hashes as uint, int (two's complement) or `bin` (low 64 bits
//! = last 8 bytes, big endian); token ids as plain ids or EAGLE bigrams.
//!
//! A structural error fails the whole batch ([`DecodeError`]); a well-formed
//! event we cannot use (unknown `medium`, non-local `locality`, unknown type
//! tag) is dropped on its own and counted in [`Dropped`].

use crate::index::Tier;
use rmp::Marker;

/// The sequence number of the end-of-replay marker.
pub const REPLAY_END_SEQ: u64 = u64::MAX;

/// One decoded batch (one engine step).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct KvBatch {
    pub ts: f64,
    /// `data_parallel_rank`; when present it wins over the listener's rank.
    pub dp_rank: Option<u32>,
    pub events: Vec<KvEvent>,
    /// Well-formed events that were left out of `events`.
    pub dropped: Dropped,
}

/// Counts of well-formed events the decoder left out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Dropped {
    /// `medium` not in the tier table (case-sensitive, like Dynamo).
    pub unknown_medium: u32,
    /// `locality` other than `"LOCAL"` (offloaded copies held elsewhere).
    pub non_local: u32,
    /// A `type` tag we do not know (a newer engine).
    pub unknown_type: u32,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    Stored(Stored),
    Removed(Removed),
    Cleared,
}

/// `BlockStored`.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    /// Engine hashes, one per block: opaque ids for parent links and removal.
    pub block_hashes: Vec<u64>,
    pub parent_hash: Option<u64>,
    /// The tokens; for EAGLE bigrams `[[t0,t1],..,[tn-1,tn]]` this is
    /// `[t0, .., tn-1, tn]` (first of every pair, then the last pair's second).
    pub token_ids: Vec<u32>,
    /// Whether `token_ids` came as bigrams (hash with `block_size + 1` windows).
    pub eagle: bool,
    pub block_size: u32,
    pub medium: Tier,
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
    pub group: Group,
}

/// `BlockRemoved`.
#[derive(Debug, Clone, PartialEq)]
pub struct Removed {
    pub block_hashes: Vec<u64>,
    pub medium: Tier,
    pub group: Group,
}

/// Which KV-cache group an event belongs to (hybrid models have several).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Group {
    pub idx: Option<u32>,
    pub kind: Option<GroupKind>,
}

/// `kv_cache_spec_kind`, reduced to what matters for prefix matching.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    /// Full, MLA or sink-full attention: every block of the prefix is kept.
    MainAttention,
    /// Sliding window, mamba, ...: not a prefix cache we can match on.
    Other,
}

impl Group {
    /// The stateless part of the filter: `Some(true)` main group, `Some(false)`
    /// other group, `None` when only a non-zero `group_idx` is known (the
    /// caller may have learnt that group's kind from an earlier store).
    pub fn is_main(&self) -> Option<bool> {
        match (self.kind, self.idx) {
            (Some(k), _) => Some(k == GroupKind::MainAttention),
            (None, None | Some(0)) => Some(true),
            (None, Some(_)) => None,
        }
    }
}

/// Maps a `medium` string to a tier (`kv-events.md` §5.3, case-sensitive).
/// `None` = unknown medium: the event is dropped.
pub fn tier_of_medium(medium: Option<&str>) -> Option<Tier> {
    Some(match medium {
        None | Some("") | Some("GPU") | Some("DEVICE") => Tier::Device,
        Some("CPU") | Some("CPU_PINNED") | Some("CPU_TIER1") => Tier::HostPinned,
        Some("CPU_TIER2") | Some("DISK") | Some("NVME") | Some("STORAGE") => Tier::Disk,
        Some("EXTERNAL") | Some("NETWORK") | Some("REMOTE") | Some("SHARED") => Tier::External,
        Some(_) => return None,
    })
}

fn kind_of(s: &str) -> GroupKind {
    match s {
        "full_attention" | "mla_attention" | "sink_full_attention" => GroupKind::MainAttention,
        _ => GroupKind::Other,
    }
}

/// Why bytes were rejected, and where.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeError {
    pub kind: DecodeErrorKind,
    /// Byte offset in the payload (0 for frame-level errors).
    pub offset: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeErrorKind {
    /// The payload ended inside a value.
    Eof,
    /// A value of another msgpack type than the field allows.
    Type {
        expected: &'static str,
    },
    /// A number that does not fit the field (negative token, rank > u32...).
    Range {
        field: &'static str,
    },
    /// A length prefix larger than the bytes that follow could hold.
    Length,
    InvalidUtf8,
    MissingField {
        field: &'static str,
    },
    /// A value with the right type but an impossible shape.
    Shape {
        what: &'static str,
    },
    /// Bytes after the batch.
    Trailing,
    /// A message with the wrong number of frames.
    FrameCount {
        got: usize,
    },
    /// A seq frame that is not 8 bytes.
    SeqLength {
        got: usize,
    },
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use DecodeErrorKind::*;
        match self.kind {
            Eof => write!(f, "unexpected end of payload")?,
            Type { expected } => write!(f, "expected {expected}")?,
            Range { field } => write!(f, "{field} out of range")?,
            Length => write!(f, "length prefix exceeds payload")?,
            InvalidUtf8 => write!(f, "invalid UTF-8 in string")?,
            MissingField { field } => write!(f, "missing field `{field}`")?,
            Shape { what } => write!(f, "malformed {what}")?,
            Trailing => write!(f, "trailing bytes after batch")?,
            FrameCount { got } => return write!(f, "expected 3 frames, got {got}"),
            SeqLength { got } => return write!(f, "seq frame must be 8 bytes, got {got}"),
        }
        write!(f, " at byte {}", self.offset)
    }
}

impl std::error::Error for DecodeError {}

type Result<T> = std::result::Result<T, DecodeError>;

/// A decoded live message.
#[derive(Debug, Clone, PartialEq)]
pub struct KvMessage {
    pub seq: u64,
    pub batch: KvBatch,
}

/// Decodes a live message `[topic, seq (8 bytes BE), payload]`. The topic is
/// not interpreted (the socket's subscription already filtered it).
pub fn decode_message(frames: &[&[u8]]) -> Result<KvMessage> {
    let [_topic, seq, payload] = frames else {
        return Err(frame_err(DecodeErrorKind::FrameCount { got: frames.len() }));
    };
    let seq = decode_seq(seq)?;
    Ok(KvMessage {
        seq,
        batch: decode_batch(payload)?,
    })
}

/// An 8-byte big-endian sequence number.
pub fn decode_seq(frame: &[u8]) -> Result<u64> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| frame_err(DecodeErrorKind::SeqLength { got: frame.len() }))?;
    Ok(u64::from_be_bytes(bytes))
}

fn frame_err(kind: DecodeErrorKind) -> DecodeError {
    DecodeError { kind, offset: 0 }
}

/// One reply frame set on the replay DEALER.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayReply<'a> {
    Batch {
        seq: u64,
        payload: &'a [u8],
    },
    /// seq `0xFFFF_FFFF_FFFF_FFFF` with an empty payload.
    End,
}

/// Parses a replay reply as the DEALER sees it: `["", seq, payload]` (vLLM
/// <= 0.24, older SGLang) or `["", topic, seq, payload]` (vLLM 0.34). The
/// payload is returned undecoded so the caller can skip stale batches cheaply.
pub fn decode_replay_reply<'a>(frames: &[&'a [u8]]) -> Result<ReplayReply<'a>> {
    let (delim, seq, payload) = match frames {
        [d, s, p] => (d, s, p),
        [d, _topic, s, p] => (d, s, p),
        _ => return Err(frame_err(DecodeErrorKind::FrameCount { got: frames.len() })),
    };
    if !delim.is_empty() {
        return Err(frame_err(DecodeErrorKind::Shape {
            what: "replay envelope (first frame must be empty)",
        }));
    }
    let seq = decode_seq(seq)?;
    if seq == REPLAY_END_SEQ && payload.is_empty() {
        return Ok(ReplayReply::End);
    }
    Ok(ReplayReply::Batch { seq, payload })
}

/// Decodes one msgpack batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<KvBatch> {
    let mut c = Cursor::new(payload);
    let mut batch = KvBatch::default();
    match c.container("batch array or map")? {
        Container::Array(n) => {
            if n < 2 {
                return Err(c.err(DecodeErrorKind::Shape {
                    what: "batch (fewer than 2 elements)",
                }));
            }
            batch.ts = c.f64()?;
            decode_events(&mut c, &mut batch)?;
            if n >= 3 {
                batch.dp_rank = c.opt_u32("data_parallel_rank")?;
            }
            for _ in 3..n {
                c.skip()?;
            }
        }
        Container::Map(n) => {
            let mut seen_events = false;
            for _ in 0..n {
                match c.key()? {
                    Some("ts") => batch.ts = c.f64()?,
                    Some("events") => {
                        batch.events.clear();
                        batch.dropped = Dropped::default();
                        decode_events(&mut c, &mut batch)?;
                        seen_events = true;
                    }
                    Some("data_parallel_rank") => {
                        batch.dp_rank = c.opt_u32("data_parallel_rank")?
                    }
                    _ => c.skip()?,
                }
            }
            if !seen_events {
                return Err(c.err(DecodeErrorKind::MissingField { field: "events" }));
            }
        }
    }
    if c.pos != payload.len() {
        return Err(c.err(DecodeErrorKind::Trailing));
    }
    Ok(batch)
}

/// `["AllBlocksCleared"]` is 18 bytes; `{"type": "AllBlocksCleared"}` 23.
const MIN_EVENT_BYTES: usize = 18;

fn decode_events(c: &mut Cursor<'_>, batch: &mut KvBatch) -> Result<()> {
    let n = c.array_len("events array")?;
    // A KvEvent is ~150 bytes but the smallest encoded event ~18: reserve by
    // what the remaining bytes could really hold, so a header cannot make us
    // allocate ~8x the message size up front.
    batch.events.reserve(n.min(c.remaining() / MIN_EVENT_BYTES));
    for _ in 0..n {
        let mut raw = RawEvent::default();
        match c.container("event map or array")? {
            Container::Map(n) => raw.read_map(c, n)?,
            Container::Array(n) => raw.read_array(c, n)?,
        }
        raw.finish(c, batch)?;
    }
    Ok(())
}

/// Field values of one event as read, before the type tag decides what they
/// mean (map keys may come in any order, the tag included).
#[derive(Default)]
struct RawEvent<'a> {
    tag: Option<&'a str>,
    hashes: Option<Vec<u64>>,
    parent: Option<u64>,
    tokens: Option<(Vec<u32>, bool)>,
    block_size: Option<u32>,
    medium: Option<&'a str>,
    lora_name: Option<&'a str>,
    cache_salt: Option<&'a str>,
    group_idx: Option<u32>,
    kind: Option<&'a str>,
    locality: Option<&'a str>,
}

impl<'a> RawEvent<'a> {
    fn read_map(&mut self, c: &mut Cursor<'a>, n: usize) -> Result<()> {
        for _ in 0..n {
            match c.key()? {
                Some("type") => self.tag = Some(c.str()?),
                Some("block_hashes") => self.hashes = Some(c.hashes()?),
                Some("parent_block_hash") => self.parent = c.opt_hash()?,
                Some("token_ids") => self.tokens = Some(c.tokens()?),
                Some("block_size") => self.block_size = Some(c.u32("block_size")?),
                Some("medium") => self.medium = c.opt_str()?,
                Some("lora_name") => self.lora_name = c.opt_str()?,
                Some("cache_salt") => self.cache_salt = c.opt_str()?,
                Some("group_idx") => self.group_idx = c.opt_u32("group_idx")?,
                Some("kv_cache_spec_kind") => self.kind = c.opt_str()?,
                Some("locality") => self.locality = c.opt_str()?,
                _ => c.skip()?,
            }
        }
        Ok(())
    }

    /// Positional form: `[tag, ...fields in declaration order]`. The layout
    /// after the tag depends on the tag, so it is read first.
    fn read_array(&mut self, c: &mut Cursor<'a>, n: usize) -> Result<()> {
        if n == 0 {
            return Err(c.err(DecodeErrorKind::Shape {
                what: "event (empty array)",
            }));
        }
        let tag = c.str()?;
        self.tag = Some(tag);
        let mut i = 1;
        match tag {
            "BlockStored" => {
                if n < 5 {
                    return Err(c.err(DecodeErrorKind::Shape {
                        what: "BlockStored array (fewer than 5 elements)",
                    }));
                }
                self.hashes = Some(c.hashes()?);
                self.parent = c.opt_hash()?;
                self.tokens = Some(c.tokens()?);
                self.block_size = Some(c.u32("block_size")?);
                i = 5;
                // [5] lora_id (deprecated), [6] medium, [7] lora_name,
                // [8] extra_keys, then a typed tail: an optional
                // block_mm_infos array, group_idx, kv_cache_spec_kind,
                // sliding_window, locality, ...
                let mut tail = 0;
                while i < n {
                    match i {
                        5 | 8 => c.skip()?,
                        6 => self.medium = c.opt_str()?,
                        7 => self.lora_name = c.opt_str()?,
                        _ => {
                            if tail == 0 && c.peek_is_array() {
                                c.skip()?; // block_mm_infos
                            } else {
                                match tail {
                                    0 => self.group_idx = c.opt_u32("group_idx")?,
                                    1 => self.kind = c.opt_str()?,
                                    3 => self.locality = c.opt_str()?,
                                    _ => c.skip()?,
                                }
                                tail += 1;
                            }
                        }
                    }
                    i += 1;
                }
            }
            "BlockRemoved" => {
                if n < 2 {
                    return Err(c.err(DecodeErrorKind::Shape {
                        what: "BlockRemoved array (no hashes)",
                    }));
                }
                self.hashes = Some(c.hashes()?);
                i = 2;
                while i < n {
                    match i {
                        2 => self.medium = c.opt_str()?,
                        3 => self.group_idx = c.opt_u32("group_idx")?,
                        _ => c.skip()?,
                    }
                    i += 1;
                }
            }
            _ => {}
        }
        while i < n {
            c.skip()?;
            i += 1;
        }
        Ok(())
    }

    fn finish(self, c: &Cursor<'_>, batch: &mut KvBatch) -> Result<()> {
        let missing = |field| c.err(DecodeErrorKind::MissingField { field });
        let group = Group {
            idx: self.group_idx,
            kind: self.kind.map(kind_of),
        };
        let Some(tag) = self.tag else {
            return Err(missing("type"));
        };
        let event = match tag {
            "BlockStored" | "BlockRemoved" => {
                let hashes = self.hashes.ok_or_else(|| missing("block_hashes"))?;
                let stored = tag == "BlockStored";
                let (tokens, block_size) = if stored {
                    (
                        Some(self.tokens.ok_or_else(|| missing("token_ids"))?),
                        self.block_size.ok_or_else(|| missing("block_size"))?,
                    )
                } else {
                    (None, 0)
                };
                let Some(medium) = tier_of_medium(self.medium) else {
                    batch.dropped.unknown_medium += 1;
                    return Ok(());
                };
                if self.locality.is_some_and(|l| l != "LOCAL") {
                    batch.dropped.non_local += 1;
                    return Ok(());
                }
                match tokens {
                    Some((token_ids, eagle)) => KvEvent::Stored(Stored {
                        block_hashes: hashes,
                        parent_hash: self.parent,
                        token_ids,
                        eagle,
                        block_size,
                        medium,
                        lora_name: self.lora_name.map(str::to_owned),
                        cache_salt: self.cache_salt.map(str::to_owned),
                        group,
                    }),
                    None => KvEvent::Removed(Removed {
                        block_hashes: hashes,
                        medium,
                        group,
                    }),
                }
            }
            "AllBlocksCleared" => KvEvent::Cleared,
            _ => {
                batch.dropped.unknown_type += 1;
                return Ok(());
            }
        };
        batch.events.push(event);
        Ok(())
    }
}

enum Container {
    Array(usize),
    Map(usize),
}

enum Int {
    U(u64),
    I(i64),
}

/// A bounds-checked msgpack reader over a borrowed payload.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Cursor { buf, pos: 0 }
    }

    fn err(&self, kind: DecodeErrorKind) -> DecodeError {
        DecodeError {
            kind,
            offset: self.pos,
        }
    }

    fn type_err(&self, expected: &'static str) -> DecodeError {
        self.err(DecodeErrorKind::Type { expected })
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| self.err(DecodeErrorKind::Eof))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn byte(&mut self) -> Result<u8> {
        let b = *self
            .buf
            .get(self.pos)
            .ok_or_else(|| self.err(DecodeErrorKind::Eof))?;
        self.pos += 1;
        Ok(b)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn marker(&mut self) -> Result<Marker> {
        Ok(Marker::from_u8(self.byte()?))
    }

    fn peek(&self) -> Option<Marker> {
        self.buf.get(self.pos).map(|&b| Marker::from_u8(b))
    }

    fn peek_is_array(&self) -> bool {
        matches!(
            self.peek(),
            Some(Marker::FixArray(_) | Marker::Array16 | Marker::Array32)
        )
    }

    /// Consumes a nil if one is next.
    fn nil(&mut self) -> bool {
        if self.peek() == Some(Marker::Null) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// Length of a variable-size value after its marker (str/bin/array/map
    /// 8/16/32 forms).
    fn len8(&mut self) -> Result<usize> {
        Ok(self.byte()? as usize)
    }
    fn len16(&mut self) -> Result<usize> {
        Ok(u16::from_be_bytes(self.be()?) as usize)
    }
    fn len32(&mut self) -> Result<usize> {
        Ok(u32::from_be_bytes(self.be()?) as usize)
    }

    /// An element count, checked against the bytes left: each element needs
    /// at least `min_bytes` (1 for an array, 2 for a map entry).
    fn count(&self, n: usize, min_bytes: usize) -> Result<usize> {
        if n.saturating_mul(min_bytes) > self.remaining() {
            return Err(self.err(DecodeErrorKind::Length));
        }
        Ok(n)
    }

    fn container(&mut self, expected: &'static str) -> Result<Container> {
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

    fn array_len(&mut self, expected: &'static str) -> Result<usize> {
        let at = self.pos;
        match self.container(expected)? {
            Container::Array(n) => Ok(n),
            Container::Map(_) => {
                self.pos = at;
                Err(self.type_err(expected))
            }
        }
    }

    fn int(&mut self, expected: &'static str) -> Result<Int> {
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

    fn u32(&mut self, field: &'static str) -> Result<u32> {
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

    fn opt_u32(&mut self, field: &'static str) -> Result<Option<u32>> {
        if self.nil() {
            return Ok(None);
        }
        self.u32(field).map(Some)
    }

    /// A block hash: uint64, int64 (two's complement, SGLang/TRT-LLM) or a
    /// binary digest (vLLM with int hashes off: its low 64 bits, i.e. the last
    /// 8 bytes read big endian).
    fn hash(&mut self) -> Result<u64> {
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

    fn opt_hash(&mut self) -> Result<Option<u64>> {
        if self.nil() {
            return Ok(None);
        }
        self.hash().map(Some)
    }

    fn hashes(&mut self) -> Result<Vec<u64>> {
        let n = self.array_len("block_hashes array")?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(self.hash()?);
        }
        Ok(v)
    }

    /// `token_ids`: `[t, ...]`, or EAGLE bigrams `[[t0, t1], [t1, t2], ...]`
    /// flattened to `[t0, t1, ..., tn]`. Returns `(tokens, is_bigram)`.
    fn tokens(&mut self) -> Result<(Vec<u32>, bool)> {
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
            v.push(self.u32("token id")?);
        }
        Ok((v, false))
    }

    fn f64(&mut self) -> Result<f64> {
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

    fn str_len(&mut self) -> Result<Option<usize>> {
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

    fn str(&mut self) -> Result<&'a str> {
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

    fn opt_str(&mut self) -> Result<Option<&'a str>> {
        if self.nil() {
            return Ok(None);
        }
        self.str().map(Some)
    }

    /// A map key: `Some(text)` for a string key, `None` (already skipped) for
    /// any other key type, whose value the caller then skips.
    fn key(&mut self) -> Result<Option<&'a str>> {
        if self.str_len_peek() {
            return self.str().map(Some);
        }
        self.skip()?;
        Ok(None)
    }

    fn str_len_peek(&self) -> bool {
        matches!(
            self.peek(),
            Some(Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32)
        )
    }

    /// Skips one complete value of any type. Iterative: `pending` counts the
    /// values still to skip, so nesting depth costs no stack.
    fn skip(&mut self) -> Result<()> {
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
    use super::*;

    #[test]
    fn medium_table() {
        for (m, t) in [
            (None, Some(Tier::Device)),
            (Some(""), Some(Tier::Device)),
            (Some("GPU"), Some(Tier::Device)),
            (Some("DEVICE"), Some(Tier::Device)),
            (Some("CPU"), Some(Tier::HostPinned)),
            (Some("CPU_PINNED"), Some(Tier::HostPinned)),
            (Some("CPU_TIER1"), Some(Tier::HostPinned)),
            (Some("CPU_TIER2"), Some(Tier::Disk)),
            (Some("DISK"), Some(Tier::Disk)),
            (Some("NVME"), Some(Tier::Disk)),
            (Some("STORAGE"), Some(Tier::Disk)),
            (Some("EXTERNAL"), Some(Tier::External)),
            (Some("NETWORK"), Some(Tier::External)),
            (Some("REMOTE"), Some(Tier::External)),
            (Some("SHARED"), Some(Tier::External)),
            (Some("gpu"), None),
            (Some("MARS"), None),
        ] {
            assert_eq!(tier_of_medium(m), t, "{m:?}");
        }
    }

    #[test]
    fn group_rules() {
        let g = |idx, kind| Group { idx, kind };
        assert_eq!(g(None, None).is_main(), Some(true));
        assert_eq!(g(Some(0), None).is_main(), Some(true));
        assert_eq!(g(Some(1), None).is_main(), None);
        assert_eq!(
            g(Some(1), Some(GroupKind::MainAttention)).is_main(),
            Some(true)
        );
        assert_eq!(g(Some(0), Some(GroupKind::Other)).is_main(), Some(false));
        assert_eq!(kind_of("sliding_window"), GroupKind::Other);
        assert_eq!(kind_of("mla_attention"), GroupKind::MainAttention);
    }

    /// The BlockRemoved message of `kv-events.md` §3.2, byte for byte.
    #[test]
    fn spec_block_removed_bytes() {
        let mut p = vec![
            0x93, 0xcb, 0x41, 0xda, 0xc4, 0x09, 0x31, 0x8d, 0x25, 0xc6, 0x91, 0x84,
        ];
        p.extend_from_slice(b"\xa4type\xacBlockRemoved");
        p.extend_from_slice(b"\xacblock_hashes\x91\xcf\xe5\x7a\xc0\x88\xeb\x28\xb6\x77");
        p.extend_from_slice(b"\xa6medium\xa3GPU");
        p.extend_from_slice(b"\xa9group_idx\x00");
        p.push(0x00);
        let seq = 1u64.to_be_bytes();
        let m = decode_message(&[b"", &seq, &p]).unwrap();
        assert_eq!(m.seq, 1);
        assert_eq!(m.batch.dp_rank, Some(0));
        assert!(m.batch.ts > 1.7e9);
        assert_eq!(
            m.batch.events,
            vec![KvEvent::Removed(Removed {
                block_hashes: vec![0xe57a_c088_eb28_b677],
                medium: Tier::Device,
                group: Group {
                    idx: Some(0),
                    kind: None
                },
            })]
        );
        // Every strict prefix is an error, never a panic.
        for cut in 0..p.len() {
            assert!(decode_batch(&p[..cut]).is_err(), "prefix {cut}");
        }
        // So is a trailing byte.
        let mut q = p.clone();
        q.push(0xc0);
        assert_eq!(
            decode_batch(&q).unwrap_err().kind,
            DecodeErrorKind::Trailing
        );
    }

    #[test]
    fn frames_and_seq() {
        assert_eq!(
            decode_message(&[b"", b"12345678"]).unwrap_err().kind,
            DecodeErrorKind::FrameCount { got: 2 }
        );
        assert_eq!(
            decode_message(&[b"", b"1234567", b"\x92\x00\x90"])
                .unwrap_err()
                .kind,
            DecodeErrorKind::SeqLength { got: 7 }
        );
        let m = decode_message(&[b"kv", &7u64.to_be_bytes(), b"\x92\x00\x90"]).unwrap();
        assert_eq!(m.seq, 7);
        assert!(m.batch.events.is_empty());
        assert_eq!(m.batch.dp_rank, None);
    }

    #[test]
    fn replay_replies() {
        let end = u64::MAX.to_be_bytes();
        let s5 = 5u64.to_be_bytes();
        assert_eq!(
            decode_replay_reply(&[b"", &end, b""]).unwrap(),
            ReplayReply::End
        );
        assert_eq!(
            decode_replay_reply(&[b"", b"", &end, b""]).unwrap(),
            ReplayReply::End
        );
        assert_eq!(
            decode_replay_reply(&[b"", b"topic", &s5, b"xx"]).unwrap(),
            ReplayReply::Batch {
                seq: 5,
                payload: b"xx"
            }
        );
        assert_eq!(
            decode_replay_reply(&[b"", &s5, b"xx"]).unwrap(),
            ReplayReply::Batch {
                seq: 5,
                payload: b"xx"
            }
        );
        assert!(decode_replay_reply(&[b"x", &s5, b"xx"]).is_err());
        assert!(decode_replay_reply(&[b"", &s5]).is_err());
    }

    #[test]
    fn huge_length_prefixes_are_rejected_without_allocating() {
        // array32 claiming 4 billion events in a 9-byte payload.
        let p = [0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0, 0xc0];
        assert_eq!(decode_batch(&p).unwrap_err().kind, DecodeErrorKind::Length);
        // map32 inside skip.
        let p = [0x93, 0x00, 0x90, 0xdf, 0xff, 0xff, 0xff, 0xff];
        assert!(decode_batch(&p).is_err());
        // str32 length overflowing.
        let p = [0x92, 0x00, 0x91, 0x91, 0xdb, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(decode_batch(&p).unwrap_err().kind, DecodeErrorKind::Eof);
    }

    #[test]
    fn deep_nesting_is_skipped_without_recursion() {
        // Batch map with an unknown key whose value nests 100k arrays.
        let mut p = vec![0x82, 0xa6];
        p.extend_from_slice(b"events");
        p.push(0x90);
        p.extend_from_slice(b"\xa1x");
        p.extend(std::iter::repeat_n(0x91, 100_000));
        p.push(0xc0);
        let b = decode_batch(&p).unwrap();
        assert!(b.events.is_empty());
    }
}
