//! Pure decoder for engine KV-cache events (`kv-events.md` §2-§3, §5.2, §6).
//!
//! Owns: the wire format of one ZMQ message (`[topic, seq, payload]`), of a
//! replay reply, and of the msgpack batch inside the payload. Bytes in, typed
//! values out; no I/O, no index, no state.
//!
//! Invariants, because every byte here comes from the network:
//! - nothing panics: every read goes through `Cursor` (`cursor.rs`), which checks bounds;
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
//!
//! `extra_keys` and `block_mm_infos` are held to the grammar Dynamo 1.6.1
//! accepts (a violation fails the batch there and here); only
//! `block_mm_infos` reaches the hashes (`mm.rs` has the established facts).
//!
//! Files: this one holds the types, frames, replay replies and the batch and
//! event schema; `cursor.rs` the msgpack reader; `mm.rs` the multimodal and
//! extra-key fields; `tests.rs` the unit tests.

use crate::index::Tier;

mod cursor;
mod mm;

use cursor::{Container, Cursor};
pub use mm::BlockMm;

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
    /// `block_mm_infos`: per block the `mm_hash`es hashed after its tokens
    /// (`mm.rs`). `extra_keys` is checked but not kept: it changes no hash.
    pub mm_hashes: Option<BlockMm>,
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
    mm: Option<BlockMm>,
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
                Some("extra_keys") => c.extra_keys()?,
                Some("block_mm_infos") => self.mm = c.block_mm_infos()?,
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
                        5 => c.skip()?,
                        8 => c.extra_keys()?,
                        6 => self.medium = c.opt_str()?,
                        7 => self.lora_name = c.opt_str()?,
                        _ => {
                            if tail == 0 && c.peek_is_array() {
                                self.mm = c.block_mm_infos()?;
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
                        mm_hashes: self.mm,
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

#[cfg(test)]
mod tests;
