//! The replica mesh's wire format (`replica-sync.md`): pure msgpack encoding
//! and decoding of the two Dynamo topics, plus kvselect's heartbeat topic.
//!
//! Owns: the byte layout. Dynamo 1.6.1 writes named-field maps with
//! minimal-width integers (rmp-serde); [`encode_slot`] and
//! [`encode_binding`] write the same keys in the same order, so a message
//! without kvselect's extensions is byte for byte what Dynamo sends (the
//! captured bytes are the tests). kvselect's extensions are extra top-level
//! keys appended at the end (`seq`, the per-origin sequence number, and
//! `chained`, the identity form of an `AddRequest`), which Dynamo ignores.
//!
//! Does not own: what a message does to the ledger (`replica.rs`), sockets,
//! or any state. Decoding never panics: every length from the wire is
//! bounds-checked, nesting is limited, and unknown keys are skipped.

use std::fmt;

/// Active-load events: bookings, prefill completion, frees.
pub const SLOT_TOPIC: &str = "dynamo.slot-tracker.v1";
/// Session bindings.
pub const AFFINITY_TOPIC: &str = "dynamo.session-affinity.v1";
/// kvselect only: liveness, the origin's last sequence number and its HTTP
/// address for repairs. Dynamo drops topics it does not know.
pub const HEARTBEAT_TOPIC: &str = "kvselect.replica-heartbeat.v1";

/// What a slot event does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotData {
    Add(AddRequest),
    PrefillCompleted,
    Free,
}

/// The booking carried by an `AddRequest`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AddRequest {
    /// The booking's identities (sequence hashes as u64).
    pub token_sequence: Vec<u64>,
    pub track_prefill_tokens: bool,
    pub expected_output_tokens: Option<u32>,
    /// `prefill_load_hint.initial_effective_prefill_tokens`.
    pub initial_effective_prefill_tokens: u64,
}

/// One message of [`SLOT_TOPIC`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotEvent {
    pub model_name: String,
    pub routing_group: String,
    pub block_size: u32,
    pub request_id: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub data: SlotData,
    pub router_id: u64,
    pub lora_name: Option<String>,
    /// kvselect extension: the origin's sequence number (absent from Dynamo).
    pub seq: Option<u64>,
    /// kvselect extension: the identities are a hash chain (the ledger's
    /// `IdentityForm::Chained`). Absent means arbitrary.
    pub chained: bool,
}

/// One message of [`AFFINITY_TOPIC`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    pub model_name: String,
    pub routing_group: String,
    pub session_id: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    /// Dynamo writes wall-clock nanoseconds; the newest binding wins.
    pub sequence: u64,
    pub writer_id: u64,
    /// kvselect extension, as in [`SlotEvent::seq`].
    pub seq: Option<u64>,
}

/// One message of [`HEARTBEAT_TOPIC`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heartbeat {
    pub router_id: u64,
    /// The last sequence number the origin sent (or gave up on) so far.
    pub seq: u64,
    /// `http://host:port` serving `GET /replica_sync/bookings`, if any.
    pub http: Option<String>,
}

/// A decoded message of any topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Slot(SlotEvent),
    Binding(Binding),
    Heartbeat(Heartbeat),
}

/// Why a message was not understood.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    UnknownTopic,
    Truncated,
    TooDeep,
    /// A required field is missing or has the wrong type.
    Field(&'static str),
    Malformed,
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::UnknownTopic => f.write_str("unknown topic"),
            WireError::Truncated => f.write_str("truncated msgpack"),
            WireError::TooDeep => f.write_str("msgpack nested too deeply"),
            WireError::Field(name) => write!(f, "missing or mistyped field `{name}`"),
            WireError::Malformed => f.write_str("malformed msgpack"),
        }
    }
}

impl std::error::Error for WireError {}

// ----- encoding -----

fn key(out: &mut Vec<u8>, k: &str) {
    let _ = rmp::encode::write_str(out, k);
}

fn uint(out: &mut Vec<u8>, v: u64) {
    let _ = rmp::encode::write_uint(out, v);
}

fn opt_str(out: &mut Vec<u8>, v: Option<&str>) {
    match v {
        Some(s) => {
            let _ = rmp::encode::write_str(out, s);
        }
        None => {
            let _ = rmp::encode::write_nil(out);
        }
    }
}

/// The second frame of a [`SLOT_TOPIC`] message.
pub fn encode_slot(e: &SlotEvent, out: &mut Vec<u8>) {
    let chained = e.chained && matches!(e.data, SlotData::Add(_));
    let n = 4 + u32::from(e.seq.is_some()) + u32::from(chained);
    let _ = rmp::encode::write_map_len(out, n);
    key(out, "model_name");
    let _ = rmp::encode::write_str(out, &e.model_name);
    key(out, "routing_group");
    let _ = rmp::encode::write_str(out, &e.routing_group);
    key(out, "block_size");
    uint(out, e.block_size.into());
    key(out, "event");
    let _ = rmp::encode::write_map_len(out, 5);
    key(out, "request_id");
    let _ = rmp::encode::write_str(out, &e.request_id);
    key(out, "worker");
    let _ = rmp::encode::write_map_len(out, 2);
    key(out, "worker_id");
    uint(out, e.worker_id);
    key(out, "dp_rank");
    uint(out, e.dp_rank.into());
    key(out, "data");
    match &e.data {
        SlotData::Add(a) => {
            let _ = rmp::encode::write_map_len(out, 1);
            key(out, "AddRequest");
            let _ = rmp::encode::write_map_len(out, 4);
            key(out, "token_sequence");
            let _ = rmp::encode::write_array_len(out, a.token_sequence.len() as u32);
            for &h in &a.token_sequence {
                uint(out, h);
            }
            key(out, "track_prefill_tokens");
            let _ = rmp::encode::write_bool(out, a.track_prefill_tokens);
            key(out, "expected_output_tokens");
            match a.expected_output_tokens {
                Some(n) => uint(out, n.into()),
                None => {
                    let _ = rmp::encode::write_nil(out);
                }
            }
            key(out, "prefill_load_hint");
            let _ = rmp::encode::write_map_len(out, 2);
            key(out, "initial_effective_prefill_tokens");
            uint(out, a.initial_effective_prefill_tokens);
            key(out, "expected_prefill_duration");
            let _ = rmp::encode::write_nil(out);
        }
        SlotData::PrefillCompleted => key(out, "MarkPrefillCompleted"),
        SlotData::Free => key(out, "Free"),
    }
    key(out, "router_id");
    uint(out, e.router_id);
    key(out, "lora_name");
    opt_str(out, e.lora_name.as_deref());
    if let Some(seq) = e.seq {
        key(out, "seq");
        uint(out, seq);
    }
    if chained {
        key(out, "chained");
        let _ = rmp::encode::write_bool(out, true);
    }
}

/// The second frame of an [`AFFINITY_TOPIC`] message.
pub fn encode_binding(b: &Binding, out: &mut Vec<u8>) {
    let _ = rmp::encode::write_map_len(out, 7 + u32::from(b.seq.is_some()));
    key(out, "model_name");
    let _ = rmp::encode::write_str(out, &b.model_name);
    key(out, "routing_group");
    let _ = rmp::encode::write_str(out, &b.routing_group);
    key(out, "session_id");
    let _ = rmp::encode::write_str(out, &b.session_id);
    key(out, "worker_id");
    uint(out, b.worker_id);
    key(out, "dp_rank");
    uint(out, b.dp_rank.into());
    key(out, "sequence");
    uint(out, b.sequence);
    key(out, "writer_id");
    uint(out, b.writer_id);
    if let Some(seq) = b.seq {
        key(out, "seq");
        uint(out, seq);
    }
}

/// The second frame of a [`HEARTBEAT_TOPIC`] message.
pub fn encode_heartbeat(h: &Heartbeat, out: &mut Vec<u8>) {
    let _ = rmp::encode::write_map_len(out, 3);
    key(out, "router_id");
    uint(out, h.router_id);
    key(out, "seq");
    uint(out, h.seq);
    key(out, "http");
    opt_str(out, h.http.as_deref());
}

// ----- decoding -----

const MAX_DEPTH: usize = 16;

/// A decoded msgpack value; strings and binaries borrow from the input.
#[derive(Debug, Clone, PartialEq)]
enum Value<'a> {
    Nil,
    Bool(bool),
    UInt(u64),
    Int(i64),
    Float(f64),
    Str(&'a str),
    Bin(&'a [u8]),
    Array(Vec<Value<'a>>),
    Map(Vec<(Value<'a>, Value<'a>)>),
}

impl<'a> Value<'a> {
    fn get(&self, k: &str) -> Option<&Value<'a>> {
        match self {
            Value::Map(kv) => kv
                .iter()
                .find(|(key, _)| matches!(key, Value::Str(s) if *s == k))
                .map(|(_, v)| v),
            _ => None,
        }
    }
    fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::UInt(v) => Some(v),
            Value::Int(v) if v >= 0 => Some(v as u64),
            // A negative i64 identity travels as its two's-complement u64.
            Value::Int(v) => Some(v as u64),
            _ => None,
        }
    }
    fn as_str(&self) -> Option<&'a str> {
        match *self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let end = self.pos.checked_add(n).ok_or(WireError::Truncated)?;
        let s = self.b.get(self.pos..end).ok_or(WireError::Truncated)?;
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    fn be(&mut self, n: usize) -> Result<u64, WireError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }
    fn str(&mut self, n: usize) -> Result<Value<'a>, WireError> {
        std::str::from_utf8(self.take(n)?)
            .map(Value::Str)
            .map_err(|_| WireError::Malformed)
    }
    fn array(&mut self, n: usize, depth: usize) -> Result<Value<'a>, WireError> {
        // Every element is at least one byte: bound the reservation.
        let mut v = Vec::with_capacity(n.min(self.b.len() - self.pos));
        for _ in 0..n {
            v.push(self.value(depth + 1)?);
        }
        Ok(Value::Array(v))
    }
    fn map(&mut self, n: usize, depth: usize) -> Result<Value<'a>, WireError> {
        let mut v = Vec::with_capacity(n.min((self.b.len() - self.pos) / 2));
        for _ in 0..n {
            let k = self.value(depth + 1)?;
            let val = self.value(depth + 1)?;
            v.push((k, val));
        }
        Ok(Value::Map(v))
    }
    fn value(&mut self, depth: usize) -> Result<Value<'a>, WireError> {
        if depth > MAX_DEPTH {
            return Err(WireError::TooDeep);
        }
        let m = self.u8()?;
        Ok(match m {
            0x00..=0x7f => Value::UInt(m.into()),
            0x80..=0x8f => return self.map((m & 0x0f).into(), depth),
            0x90..=0x9f => return self.array((m & 0x0f).into(), depth),
            0xa0..=0xbf => return self.str((m & 0x1f).into()),
            0xc0 => Value::Nil,
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4..=0xc6 => {
                let n = self.be(1 << (m - 0xc4))? as usize;
                Value::Bin(self.take(n)?)
            }
            0xc7..=0xc9 => {
                // ext: length, type, data. Not used by the mesh: skipped.
                let n = self.be(1 << (m - 0xc7))? as usize;
                self.take(1 + n)?;
                Value::Nil
            }
            0xca => Value::Float(f32::from_bits(self.be(4)? as u32).into()),
            0xcb => Value::Float(f64::from_bits(self.be(8)?)),
            0xcc..=0xcf => Value::UInt(self.be(1 << (m - 0xcc))?),
            0xd0 => Value::Int(self.be(1)? as u8 as i8 as i64),
            0xd1 => Value::Int(self.be(2)? as u16 as i16 as i64),
            0xd2 => Value::Int(self.be(4)? as u32 as i32 as i64),
            0xd3 => Value::Int(self.be(8)? as i64),
            0xd4..=0xd8 => {
                self.take(1 + (1 << (m - 0xd4)))?;
                Value::Nil
            }
            0xd9..=0xdb => {
                let n = self.be(1 << (m - 0xd9))? as usize;
                return self.str(n);
            }
            0xdc | 0xdd => {
                let n = self.be(if m == 0xdc { 2 } else { 4 })? as usize;
                return self.array(n, depth);
            }
            0xde | 0xdf => {
                let n = self.be(if m == 0xde { 2 } else { 4 })? as usize;
                return self.map(n, depth);
            }
            0xe0..=0xff => Value::Int((m as i8).into()),
            0xc1 => return Err(WireError::Malformed),
        })
    }
}

fn parse(bytes: &[u8]) -> Result<Value<'_>, WireError> {
    Reader { b: bytes, pos: 0 }.value(0)
}

fn req_u64(v: &Value<'_>, k: &'static str) -> Result<u64, WireError> {
    v.get(k).and_then(Value::as_u64).ok_or(WireError::Field(k))
}

fn req_u32(v: &Value<'_>, k: &'static str) -> Result<u32, WireError> {
    req_u64(v, k)?.try_into().map_err(|_| WireError::Field(k))
}

fn req_str(v: &Value<'_>, k: &'static str) -> Result<String, WireError> {
    v.get(k)
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or(WireError::Field(k))
}

fn opt_string(v: &Value<'_>, k: &'static str) -> Result<Option<String>, WireError> {
    match v.get(k) {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::Str(s)) => Ok(Some(s.to_string())),
        Some(_) => Err(WireError::Field(k)),
    }
}

fn opt_u64(v: &Value<'_>, k: &'static str) -> Result<Option<u64>, WireError> {
    match v.get(k) {
        None | Some(Value::Nil) => Ok(None),
        Some(x) => x.as_u64().map(Some).ok_or(WireError::Field(k)),
    }
}

fn decode_slot(bytes: &[u8]) -> Result<SlotEvent, WireError> {
    let top = parse(bytes)?;
    let ev = top.get("event").ok_or(WireError::Field("event"))?;
    let worker = ev.get("worker").ok_or(WireError::Field("worker"))?;
    let data = match ev.get("data").ok_or(WireError::Field("data"))? {
        Value::Str("MarkPrefillCompleted") => SlotData::PrefillCompleted,
        Value::Str("Free") => SlotData::Free,
        d @ Value::Map(_) => {
            let a = d.get("AddRequest").ok_or(WireError::Field("data"))?;
            let token_sequence = match a.get("token_sequence") {
                None | Some(Value::Nil) => Vec::new(),
                Some(Value::Array(xs)) => xs
                    .iter()
                    .map(|x| x.as_u64().ok_or(WireError::Field("token_sequence")))
                    .collect::<Result<_, _>>()?,
                Some(_) => return Err(WireError::Field("token_sequence")),
            };
            let track_prefill_tokens = match a.get("track_prefill_tokens") {
                Some(Value::Bool(b)) => *b,
                None | Some(Value::Nil) => true,
                Some(_) => return Err(WireError::Field("track_prefill_tokens")),
            };
            let expected_output_tokens =
                opt_u64(a, "expected_output_tokens")?.map(|n| u32::try_from(n).unwrap_or(u32::MAX));
            let initial_effective_prefill_tokens = match a.get("prefill_load_hint") {
                None | Some(Value::Nil) => 0,
                Some(h) => opt_u64(h, "initial_effective_prefill_tokens")?.unwrap_or(0),
            };
            SlotData::Add(AddRequest {
                token_sequence,
                track_prefill_tokens,
                expected_output_tokens,
                initial_effective_prefill_tokens,
            })
        }
        _ => return Err(WireError::Field("data")),
    };
    Ok(SlotEvent {
        model_name: req_str(&top, "model_name")?,
        routing_group: req_str(&top, "routing_group")?,
        block_size: req_u32(&top, "block_size")?,
        request_id: req_str(ev, "request_id")?,
        worker_id: req_u64(worker, "worker_id")?,
        dp_rank: req_u32(worker, "dp_rank")?,
        data,
        router_id: req_u64(ev, "router_id")?,
        lora_name: opt_string(ev, "lora_name")?,
        seq: opt_u64(&top, "seq")?,
        chained: matches!(top.get("chained"), Some(Value::Bool(true))),
    })
}

fn decode_binding(bytes: &[u8]) -> Result<Binding, WireError> {
    let top = parse(bytes)?;
    Ok(Binding {
        model_name: req_str(&top, "model_name")?,
        routing_group: req_str(&top, "routing_group")?,
        session_id: req_str(&top, "session_id")?,
        worker_id: req_u64(&top, "worker_id")?,
        dp_rank: req_u32(&top, "dp_rank")?,
        sequence: req_u64(&top, "sequence")?,
        writer_id: req_u64(&top, "writer_id")?,
        seq: opt_u64(&top, "seq")?,
    })
}

fn decode_heartbeat(bytes: &[u8]) -> Result<Heartbeat, WireError> {
    let top = parse(bytes)?;
    Ok(Heartbeat {
        router_id: req_u64(&top, "router_id")?,
        seq: req_u64(&top, "seq")?,
        http: opt_string(&top, "http")?,
    })
}

/// Decodes one two-frame message (topic, payload).
pub fn decode(topic: &[u8], payload: &[u8]) -> Result<Message, WireError> {
    match topic {
        t if t == SLOT_TOPIC.as_bytes() => decode_slot(payload).map(Message::Slot),
        t if t == AFFINITY_TOPIC.as_bytes() => decode_binding(payload).map(Message::Binding),
        t if t == HEARTBEAT_TOPIC.as_bytes() => decode_heartbeat(payload).map(Message::Heartbeat),
        _ => Err(WireError::UnknownTopic),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    // The captured bytes of replica-sync.md.
    const ADD_R1: &str = "84aa6d6f64656c5f6e616d65a16dad726f7574696e675f67726f7570a764656661756c74aa626c6f636b5f73697a6510
a56576656e7485aa726571756573745f6964a27231a6776f726b657282a9776f726b65725f69640ba764705f72616e6b00
a46461746181aa4164645265717565737484ae746f6b656e5f73657175656e636594cfea06fc71a5ee6e88cfad01835a37
dd294ccf0d55e56c2bccbd1acf445502a8048d6688b4747261636b5f70726566696c6c5f746f6b656e73c3b66578706563
7465645f6f75747075745f746f6b656e73c0b170726566696c6c5f6c6f61645f68696e7482d920696e697469616c5f6566
666563746976655f70726566696c6c5f746f6b656e7340b965787065637465645f70726566696c6c5f6475726174696f6e
c0a9726f757465725f6964cf57ec890614cfb59fa96c6f72615f6e616d65c0";
    const FREE_R1: &str = "84aa6d6f64656c5f6e616d65a16dad726f7574696e675f67726f7570a764656661756c74aa626c6f636b5f73697a6510
a56576656e7485aa726571756573745f6964a27231a6776f726b657282a9776f726b65725f69640ba764705f72616e6b00
a464617461a446726565a9726f757465725f6964cf57ec890614cfb59fa96c6f72615f6e616d65c0";
    const BIND_S1: &str = "87aa6d6f64656c5f6e616d65a16dad726f7574696e675f67726f7570a764656661756c74aa73657373696f6e5f6964a253
31a9776f726b65725f69640ba764705f72616e6b00a873657175656e6365cf18edcfd873dc854ea97772697465725f6964
cf57ec890614cfb59f";
    const ROUTER: u64 = 6335589435015411103;

    fn r1_add() -> SlotEvent {
        // The public sequence hashes of tokens 1..=64, block size 16.
        let tokens: Vec<u32> = (1..=64).collect();
        let (mut local, mut seq) = (Vec::new(), Vec::new());
        let seed = crate::hash::salt_seed(None, None);
        crate::hash::local_and_sequence_hashes(
            &tokens, 16, false, seed, 1337, None, &mut local, &mut seq,
        );
        SlotEvent {
            model_name: "m".into(),
            routing_group: "default".into(),
            block_size: 16,
            request_id: "r1".into(),
            worker_id: 11,
            dp_rank: 0,
            data: SlotData::Add(AddRequest {
                token_sequence: seq,
                track_prefill_tokens: true,
                expected_output_tokens: None,
                initial_effective_prefill_tokens: 64,
            }),
            router_id: ROUTER,
            lora_name: None,
            seq: None,
            chained: false,
        }
    }

    #[test]
    fn captured_add_request_decodes_and_reencodes_byte_for_byte() {
        let bytes = hex(ADD_R1);
        let m = decode(SLOT_TOPIC.as_bytes(), &bytes).unwrap();
        let Message::Slot(e) = &m else {
            panic!("{m:?}")
        };
        assert_eq!(e, &r1_add());
        // The first identity is the reply's -1583300653928780152 as u64.
        let SlotData::Add(a) = &e.data else {
            unreachable!()
        };
        assert_eq!(a.token_sequence[0], 16863443419780771464);
        assert_eq!(a.token_sequence[0] as i64, -1583300653928780152);
        let mut out = Vec::new();
        encode_slot(e, &mut out);
        assert_eq!(out, bytes);
    }

    #[test]
    fn captured_free_decodes_and_reencodes_byte_for_byte() {
        let bytes = hex(FREE_R1);
        let Message::Slot(e) = decode(SLOT_TOPIC.as_bytes(), &bytes).unwrap() else {
            panic!()
        };
        assert_eq!(e.data, SlotData::Free);
        assert_eq!(
            (e.request_id.as_str(), e.worker_id, e.dp_rank),
            ("r1", 11, 0)
        );
        assert_eq!(e.router_id, ROUTER);
        assert_eq!(e.seq, None);
        let mut out = Vec::new();
        encode_slot(&e, &mut out);
        assert_eq!(out, bytes);
        // Prefill completion is the other unit variant, same layout.
        let pc = SlotEvent {
            data: SlotData::PrefillCompleted,
            ..e
        };
        let mut out = Vec::new();
        encode_slot(&pc, &mut out);
        let want = hex(FREE_R1);
        let at = want.windows(5).position(|w| w == b"\xa4Free").unwrap();
        let mut want2 = want[..at].to_vec();
        want2.push(0xb4);
        want2.extend_from_slice(b"MarkPrefillCompleted");
        want2.extend_from_slice(&want[at + 5..]);
        assert_eq!(out, want2);
    }

    #[test]
    fn captured_binding_decodes_and_reencodes_byte_for_byte() {
        let bytes = hex(BIND_S1);
        let Message::Binding(b) = decode(AFFINITY_TOPIC.as_bytes(), &bytes).unwrap() else {
            panic!()
        };
        assert_eq!(
            (b.session_id.as_str(), b.worker_id, b.dp_rank, b.writer_id),
            ("S1", 11, 0, ROUTER)
        );
        assert_eq!(b.sequence, 0x18edcfd873dc854e);
        let mut out = Vec::new();
        encode_binding(&b, &mut out);
        assert_eq!(out, bytes);
    }

    #[test]
    fn extensions_are_appended_keys_and_round_trip() {
        let mut e = r1_add();
        e.seq = Some(7);
        e.chained = true;
        let mut out = Vec::new();
        encode_slot(&e, &mut out);
        let base = hex(ADD_R1);
        // Same layout, two more top-level keys at the end.
        assert_eq!(out[0], 0x86);
        assert_eq!(&out[1..base.len()], &base[1..]);
        assert_eq!(&out[base.len()..], b"\xa3seq\x07\xa7chained\xc3");
        assert_eq!(
            decode(SLOT_TOPIC.as_bytes(), &out).unwrap(),
            Message::Slot(e)
        );

        let hb = Heartbeat {
            router_id: 1,
            seq: 99,
            http: Some("http://127.0.0.1:1".into()),
        };
        let mut out = Vec::new();
        encode_heartbeat(&hb, &mut out);
        assert_eq!(
            decode(HEARTBEAT_TOPIC.as_bytes(), &out).unwrap(),
            Message::Heartbeat(hb)
        );
    }

    #[test]
    fn bad_bytes_are_errors_not_panics() {
        let bytes = hex(ADD_R1);
        for n in 0..bytes.len() {
            assert!(decode(SLOT_TOPIC.as_bytes(), &bytes[..n]).is_err());
        }
        assert_eq!(
            decode(b"other", &bytes).unwrap_err(),
            WireError::UnknownTopic
        );
        let deep = vec![0x91u8; 100];
        assert!(decode(SLOT_TOPIC.as_bytes(), &deep).is_err());
        let huge = [0xdd, 0xff, 0xff, 0xff, 0xff];
        assert!(decode(SLOT_TOPIC.as_bytes(), &huge).is_err());
        let mut x: u64 = 0x9e3779b97f4a7c15;
        for _ in 0..2000 {
            let mut b = bytes.clone();
            for _ in 0..3 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let i = (x as usize) % b.len();
                b[i] = (x >> 32) as u8;
            }
            let _ = decode(SLOT_TOPIC.as_bytes(), &b);
        }
    }
}
