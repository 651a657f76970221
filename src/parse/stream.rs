//! The streamed request path: a body is fed to the parser one hyper frame
//! at a time, as it arrives, and its token arrays are converted while each
//! frame is still in cache. The body is never copied whole into a second
//! buffer on the common path.
//!
//! Design: a resumable *front* ([`BodyStream::feed`]) scans each frame once.
//! - Outside token arrays it only tracks what it needs to recognise them
//!   (depth, whether it is inside a string and after a backslash, the keys
//!   of the top-level object and of its `mm_routing_info` object) and copies
//!   the bytes into a small *skeleton* buffer.
//! - The value of the top-level `token_ids` and of
//!   `mm_routing_info.routing_token_ids`, when it is an array, is converted
//!   straight from the frame into a pooled `u32` buffer: the AVX-512 / AVX2
//!   run of [`super::simd`] over the frame's interior, the scalar twin near
//!   the frame's end, and a byte-at-a-time state for the one number (or the
//!   separator) that straddles two frames. That number is the only state
//!   carried across a boundary. In the skeleton the array becomes `[]`,
//!   and its buffer is recorded against that `[`'s offset.
//! - At the end the ordinary visitor reads the skeleton; [`numbers::u32_array`](super::numbers)
//!   takes a recorded buffer when it meets one of those `[]` (the same depth
//!   check runs on it), so every visitor, field rule and limit is the
//!   contiguous path's own code.
//!
//! The front converts only the exact shape the contiguous loop accepts
//! without error (`0` or `[1-9][0-9]*` up to `u32::MAX`, JSON whitespace,
//! commas, at most `max_tokens` elements). At anything else, or at any error
//! of the skeleton's visitor, or if a recorded buffer was not taken where the
//! front put it, the body falls back to the contiguous parser on the whole
//! body: the frames are kept (as the reference-counted [`Bytes`] hyper hands
//! over, not copied), so the contiguous body is assembled only then (a
//! single-frame body is parsed in place). Errors therefore come from the
//! contiguous parser, with its classes, texts, byte offsets and field paths;
//! the skeleton never reports one. A body without token arrays is parsed
//! from its skeleton, which then equals the body. A body whose skeleton
//! outgrows 64 KiB plus the token bytes taken out of it (a long
//! `block_hashes` list without tokens, say) also goes to the contiguous
//! parser: the front stops scanning it, since its byte-at-a-time scan of
//! non-token bytes costs more than one copy.
//!
//! Why this is the same answer: the skeleton equals the body except that
//! each recorded array's contents are gone. The visitor is deterministic on
//! the bytes before such a `[`, so it reaches it in the same state on both;
//! on the body it would call the same `u32_array` there, which on that valid
//! shape produces exactly the recorded values and stops right after the
//! `]`; from there both inputs are the same bytes again. A success on the
//! skeleton with every buffer taken is thus the body's success, value for
//! value; anything else is decided by the body itself.
//!
//! Allocations: the skeleton, the frame list and the token buffers come from
//! pools on [`Parser`], so a warm streamed parse allocates nothing.

use super::cursor::is_ws;
use super::numbers::scalar_u32;
use super::simd::{self, Vector};
use super::*;
use crate::pool::Pooled;
use bytes::Bytes;
use std::cell::{Cell, OnceCell};

/// Skeleton bytes the front keeps before it compares them with the token
/// bytes it took out: once the skeleton is larger than this plus those, the
/// body goes to the whole-body parser (scanning costs more than it saves).
const SKELETON_FREE: usize = 64 * 1024;

/// Token arrays one body may have streamed (a prompt has at most two; a
/// further one stays in the skeleton and is parsed there).
const STREAMED_MAX: usize = 4;

/// The token arrays taken out of the skeleton: each one's buffer, keyed by
/// the skeleton offset of the `[]` that replaced it. Taken once each by the
/// visitor (`Cell`, because the visitor holds the skeleton shared).
#[derive(Default)]
pub(crate) struct Side {
    at: [usize; STREAMED_MAX],
    bufs: [Cell<Option<Pooled<u32>>>; STREAMED_MAX],
    n: usize,
}

impl Side {
    /// The buffer recorded for the `[` at skeleton offset `at`, if any.
    pub(crate) fn take(&self, at: usize) -> Option<Pooled<u32>> {
        (0..self.n)
            .find(|&k| self.at[k] == at)
            .and_then(|k| self.bufs[k].take())
    }

    /// Were all recorded buffers taken? Drops any left.
    fn all_taken(&self) -> bool {
        let mut all = true;
        for b in &self.bufs[..self.n] {
            all &= b.take().is_none();
        }
        all
    }
}

/// Keys the front recognises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    None,
    TokenIds,
    MmRoutingInfo,
    RoutingTokenIds,
}

/// Where the front is in a token array.
#[derive(Debug, Clone, Copy)]
enum Tok {
    /// Before an element (after `[` if `first`, else after `,`).
    Elem { first: bool },
    /// Inside a number: its value and digit count so far.
    Num { v: u64, digits: u8 },
    /// After a number: whitespace, then `,` or `]`.
    AfterNum,
}

#[derive(Debug, Clone, Copy)]
enum Mode {
    Skeleton,
    /// Inside a string; `esc` after a backslash.
    Str {
        esc: bool,
    },
    Tokens(Tok),
    /// The contiguous parser decides; frames are only kept.
    Fallback,
}

enum Step {
    /// The frame ended inside the array.
    More,
    /// The array ended; the skeleton resumes at this offset.
    Done(usize),
    Fallback,
}

/// A body being received: feed it every frame with [`BodyStream::feed`],
/// then parse it with one of the `*_stream` methods of [`Parser`].
pub struct BodyStream {
    frames: Pooled<Bytes>,
    len: usize,
    skeleton: Pooled<u8>,
    side: Side,
    mode: Mode,
    depth: usize,
    /// The value at depth 1 is an object (the top-level one).
    top_obj: bool,
    /// The container at depth 2 is the top object's `mm_routing_info` object.
    mm_obj: bool,
    /// The next string of the current object is a key.
    expect_key: bool,
    /// The string being read is a key of a tracked object.
    capture: bool,
    key: [u8; 20],
    /// Bytes of the captured key so far; past `key.len()` (or after an
    /// escape): matches nothing.
    key_len: usize,
    /// A recognised key just closed (waiting for its `:`).
    last_key: Key,
    /// A recognised key's `:` was read (waiting for its value).
    pending: Key,
    /// The array being filled.
    filling: Option<Pooled<u32>>,
    tokens: Pool<u32>,
    bytes: Pool<u8>,
    max_tokens: usize,
    vector: Option<Vector>,
    contiguous: OnceCell<Pooled<u8>>,
    /// Parsed once already (a second parse reads the whole body).
    used: Cell<bool>,
}

impl std::fmt::Debug for BodyStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BodyStream")
            .field("len", &self.len)
            .field("frames", &self.frames.len())
            .field("streamed_arrays", &self.side.n)
            .field("mode", &self.mode)
            .finish()
    }
}

impl BodyStream {
    /// Bytes fed so far (the HTTP layer's body limit counts these).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many token arrays were converted while streaming (0 after a
    /// fall-back); for tests and benches.
    pub fn streamed_arrays(&self) -> usize {
        match self.mode {
            Mode::Fallback => 0,
            _ => self.side.n,
        }
    }

    /// Takes the next frame: scans it (converting token arrays), then keeps
    /// it for a possible fall-back.
    pub fn feed(&mut self, frame: Bytes) {
        self.len += frame.len();
        if !matches!(self.mode, Mode::Fallback) {
            self.scan(&frame);
            // A body that is mostly not token arrays (a long hash list) is
            // cheaper copied once and parsed whole than scanned here.
            let kept = self.skeleton.len();
            if kept > SKELETON_FREE + self.len.saturating_sub(kept) {
                self.fall_back();
            }
        }
        if !frame.is_empty() {
            self.frames.push(frame);
        }
    }

    /// Copies `b` into the skeleton.
    fn keep(&mut self, b: &[u8]) {
        self.skeleton.extend_from_slice(b);
    }

    fn fall_back(&mut self) {
        self.mode = Mode::Fallback;
        self.filling = None;
    }

    fn tracked(&self) -> bool {
        (self.depth == 1 && self.top_obj) || (self.depth == 2 && self.mm_obj)
    }

    fn scan(&mut self, b: &[u8]) {
        let n = b.len();
        let mut i = 0;
        // Skeleton bytes of this frame not yet copied start here.
        let mut from = 0;
        while i < n {
            match self.mode {
                Mode::Fallback => return,
                Mode::Tokens(st) => match self.tokens_in(b, i, st) {
                    Step::More => return,
                    Step::Done(j) => {
                        let buf = self.filling.take();
                        self.side.bufs[self.side.n].set(buf);
                        self.side.n += 1;
                        self.mode = Mode::Skeleton;
                        i = j;
                        from = j;
                    }
                    Step::Fallback => return self.fall_back(),
                },
                Mode::Str { mut esc } => {
                    while i < n {
                        let c = b[i];
                        i += 1;
                        if esc {
                            esc = false;
                            continue;
                        }
                        match c {
                            b'\\' => {
                                esc = true;
                                // An escaped key is decoded by the visitor;
                                // the front matches raw keys only.
                                self.key_len = usize::MAX;
                            }
                            b'"' => {
                                self.mode = Mode::Skeleton;
                                if self.capture {
                                    self.capture = false;
                                    self.last_key = self.classify_key();
                                }
                                break;
                            }
                            _ if self.capture => {
                                if self.key_len < self.key.len() {
                                    self.key[self.key_len] = c;
                                }
                                self.key_len = self.key_len.saturating_add(1);
                            }
                            _ => {}
                        }
                    }
                    if let Mode::Str { .. } = self.mode {
                        self.mode = Mode::Str { esc };
                    }
                }
                Mode::Skeleton => {
                    let c = b[i];
                    if is_ws(c) {
                        i += 1;
                        continue;
                    }
                    let last = std::mem::replace(&mut self.last_key, Key::None);
                    let pending = std::mem::replace(&mut self.pending, Key::None);
                    match c {
                        b'"' => {
                            self.capture = self.expect_key && self.tracked();
                            self.key_len = 0;
                            self.expect_key = false;
                            self.mode = Mode::Str { esc: false };
                        }
                        b':' => self.pending = last,
                        b'{' => {
                            self.depth += 1;
                            match self.depth {
                                1 => self.top_obj = true,
                                2 => self.mm_obj = pending == Key::MmRoutingInfo,
                                _ => {}
                            }
                            self.expect_key = true;
                        }
                        b'[' if matches!(pending, Key::TokenIds | Key::RoutingTokenIds)
                            && self.side.n < STREAMED_MAX =>
                        {
                            self.keep(&b[from..i]);
                            self.side.at[self.side.n] = self.skeleton.len();
                            self.keep(b"[]");
                            self.filling = Some(self.tokens.take());
                            self.mode = Mode::Tokens(Tok::Elem { first: true });
                            i += 1;
                            from = i;
                            continue;
                        }
                        b'[' => {
                            self.depth += 1;
                            match self.depth {
                                1 => self.top_obj = false,
                                2 => self.mm_obj = false,
                                _ => {}
                            }
                            self.expect_key = false;
                        }
                        b'}' | b']' => {
                            self.depth = self.depth.saturating_sub(1);
                            self.expect_key = false;
                        }
                        b',' => self.expect_key = true,
                        b'-' | b'0'..=b'9' => {
                            // The rest of a number changes no state (hash
                            // arrays are long runs of them).
                            i += 1;
                            while i < n
                                && matches!(b[i], b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
                            {
                                i += 1;
                            }
                            continue;
                        }
                        _ => {}
                    }
                    i += 1;
                }
            }
        }
        if matches!(self.mode, Mode::Skeleton | Mode::Str { .. }) {
            self.keep(&b[from..]);
        }
    }

    /// The key just captured, if the front recognises it where it stands.
    fn classify_key(&self) -> Key {
        let Some(k) = self.key.get(..self.key_len) else {
            return Key::None;
        };
        match (self.depth, k) {
            (1, b"token_ids") => Key::TokenIds,
            (1, b"mm_routing_info") => Key::MmRoutingInfo,
            (2, b"routing_token_ids") => Key::RoutingTokenIds,
            _ => Key::None,
        }
    }

    /// Converts the token array from `b[i..]` on, in state `st`.
    fn tokens_in(&mut self, b: &[u8], mut i: usize, mut st: Tok) -> Step {
        let n = b.len();
        let max = self.max_tokens;
        let vector = self.vector;
        let Some(out) = self.filling.as_mut() else {
            return Step::Fallback;
        };
        let out: &mut Vec<u32> = out;
        loop {
            match st {
                Tok::Elem { first } => {
                    while i < n && is_ws(b[i]) {
                        i += 1;
                    }
                    if i == n {
                        break;
                    }
                    let c = b[i];
                    if c == b']' && first {
                        return Step::Done(i + 1);
                    }
                    if !c.is_ascii_digit() {
                        return Step::Fallback;
                    }
                    // `b[i - 1]` is `[`, `,` or whitespace of this frame
                    // when i >= 8, as the vector run requires.
                    if let Some(v) = vector {
                        let j = simd::u32_run(b, i, out, max, v);
                        if j != i {
                            // It stopped just past a comma.
                            i = j;
                            st = Tok::Elem { first: false };
                            continue;
                        }
                    }
                    if i + 11 <= n {
                        // Any number of up to 10 digits ends inside the frame.
                        match scalar_u32(b, &mut i) {
                            Some(v) if out.len() < max => {
                                out.push(v);
                                st = Tok::AfterNum;
                            }
                            _ => return Step::Fallback,
                        }
                    } else {
                        st = Tok::Num { v: 0, digits: 0 };
                    }
                }
                Tok::Num { mut v, mut digits } => {
                    while i < n {
                        let d = b[i].wrapping_sub(b'0');
                        if d > 9 {
                            break;
                        }
                        if digits == 1 && v == 0 {
                            return Step::Fallback; // leading zero
                        }
                        v = v * 10 + d as u64;
                        digits += 1;
                        if digits > 10 {
                            return Step::Fallback;
                        }
                        i += 1;
                    }
                    if i == n {
                        st = Tok::Num { v, digits };
                        break;
                    }
                    if matches!(b[i], b'.' | b'e' | b'E') || v > u32::MAX as u64 || out.len() >= max
                    {
                        return Step::Fallback;
                    }
                    out.push(v as u32);
                    st = Tok::AfterNum;
                }
                Tok::AfterNum => {
                    while i < n && is_ws(b[i]) {
                        i += 1;
                    }
                    if i == n {
                        break;
                    }
                    match b[i] {
                        b',' => {
                            i += 1;
                            st = Tok::Elem { first: false };
                        }
                        b']' => return Step::Done(i + 1),
                        _ => return Step::Fallback,
                    }
                }
            }
        }
        self.mode = Mode::Tokens(st);
        Step::More
    }

    /// The skeleton is whole and its recorded arrays are worth a try.
    fn skeleton_ready(&self) -> bool {
        self.side.n > 0 && matches!(self.mode, Mode::Skeleton | Mode::Str { .. })
    }

    /// The whole body, contiguous: the skeleton when no array was taken out
    /// of it (then it is the body), the only frame, or the frames copied
    /// once into a pooled buffer.
    pub fn contiguous(&self) -> &[u8] {
        if self.side.n == 0 && matches!(self.mode, Mode::Skeleton | Mode::Str { .. }) {
            return &self.skeleton;
        }
        match &self.frames[..] {
            [] => &[],
            [one] => one,
            frames => self.contiguous.get_or_init(|| {
                let mut buf = self.bytes.take();
                buf.reserve(self.len);
                for f in frames {
                    buf.extend_from_slice(f);
                }
                buf
            }),
        }
    }
}

/// The bounds of the frame-list and skeleton pools: a 630 KB body in 8 KiB
/// frames is about 80 frames; a skeleton is small unless the body is mostly
/// not token arrays.
const FRAME_LIST_MAX: usize = 16 * 1024;
const BYTES_MAX: usize = 1024 * 1024;
const IDLE_MAX: usize = 16;

/// The pools a [`BodyStream`] takes its skeleton and frame list from.
#[derive(Debug, Clone)]
pub struct StreamPools {
    bytes: Pool<u8>,
    frames: Pool<Bytes>,
}

impl Default for StreamPools {
    fn default() -> Self {
        StreamPools {
            bytes: Pool::new(IDLE_MAX, BYTES_MAX),
            frames: Pool::new(IDLE_MAX, FRAME_LIST_MAX),
        }
    }
}

impl Parser {
    /// A body to feed frame by frame.
    pub fn stream(&self) -> BodyStream {
        BodyStream {
            frames: self.stream_pools.frames.take(),
            len: 0,
            skeleton: self.stream_pools.bytes.take(),
            side: Side::default(),
            mode: Mode::Skeleton,
            depth: 0,
            top_obj: false,
            mm_obj: false,
            expect_key: false,
            capture: false,
            key: [0; 20],
            key_len: 0,
            last_key: Key::None,
            pending: Key::None,
            filling: None,
            tokens: self.tokens.clone(),
            bytes: self.stream_pools.bytes.clone(),
            max_tokens: self.limits.max_tokens,
            vector: self.vector(),
            contiguous: OnceCell::new(),
            used: Cell::new(false),
        }
    }

    /// The skeleton with its recorded arrays if that parse succeeds with all
    /// of them taken, else the whole body (module doc).
    fn streamed<'a, T>(
        &self,
        s: &'a BodyStream,
        f: impl Fn(&'a [u8], Option<&'a Side>) -> Result<T, ParseError>,
    ) -> Result<T, ParseError> {
        if s.skeleton_ready() && !s.used.replace(true) {
            if let Ok(v) = f(&s.skeleton, Some(&s.side)) {
                if s.side.all_taken() {
                    return Ok(v);
                }
            }
        }
        f(s.contiguous(), None)
    }

    /// [`Parser::select`] of a streamed body.
    pub fn select_stream<'a>(
        &self,
        s: &'a BodyStream,
        kind: SelectKind,
    ) -> Result<SelectRequest<'a>, ParseError> {
        self.streamed(s, |b, side| self.select_in(b, side, kind))
    }

    /// [`Parser::reservation`] of a streamed body.
    pub fn reservation_stream<'a>(
        &self,
        s: &'a BodyStream,
    ) -> Result<ReservationRequest<'a>, ParseError> {
        self.streamed(s, |b, side| self.reservation_in(b, side))
    }

    /// [`Parser::prompt_query`] of a streamed body.
    pub fn prompt_query_stream<'a>(
        &self,
        s: &'a BodyStream,
    ) -> Result<PromptQueryRequest<'a>, ParseError> {
        self.streamed(s, |b, side| {
            self.prompt_query_in(b, side, "PotentialLoadsRequest")
        })
    }

    /// [`Parser::overlap_scores_query`] of a streamed body.
    pub fn overlap_scores_query_stream<'a>(
        &self,
        s: &'a BodyStream,
    ) -> Result<PromptQueryRequest<'a>, ParseError> {
        self.streamed(s, |b, side| {
            self.prompt_query_in(b, side, "OverlapScoresRequest")
        })
    }
}
