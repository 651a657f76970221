//! Checks that hold the parser to references; called by the fuzz targets, the
//! property tests and the seed replay (not by the service).
//!
//! - [`differential_select`]: our /select parser against serde_json into a
//!   typed struct with the prompt group flattened, as the reference declares
//!   it (the oracle): same class (ok / 400 / 422) and the same values. The
//!   oracle's class is serde's category of the first error serde_json meets
//!   reading the body into that struct; trailing bytes after a valid body
//!   are a syntax error (kvselect's one deliberate difference).
//! - [`fuzz_body`]: any body kind must not panic, must return an error whose
//!   position is inside the body, and the scalar and AVX2 token loops must
//!   agree exactly.

use super::*;
use serde::Deserialize;
use std::collections::HashMap;

/// The body kinds with a parser entry point (one fuzz target each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    Select,
    SelectAndReserve,
    Reservation,
    OutputBlock,
    PromptQuery,
    WorkerUpsert,
    WorkerPatch,
    PeerEndpoint,
}

/// Parses `body` as `kind` with the given parser, rendering the result with
/// `Debug` so different runs can be compared.
pub fn parse_debug(p: &Parser, kind: BodyKind, body: &[u8]) -> Result<String, ParseError> {
    match kind {
        BodyKind::Select => p.select(body, SelectKind::Select).map(|r| format!("{r:?}")),
        BodyKind::SelectAndReserve => p
            .select(body, SelectKind::SelectAndReserve)
            .map(|r| format!("{r:?}")),
        BodyKind::Reservation => p.reservation(body).map(|r| format!("{r:?}")),
        BodyKind::OutputBlock => p.output_block(body).map(|r| format!("{r:?}")),
        BodyKind::PromptQuery => p.prompt_query(body).map(|r| format!("{r:?}")),
        BodyKind::WorkerUpsert => p.worker_upsert(body).map(|r| format!("{r:?}")),
        BodyKind::WorkerPatch => p.worker_patch(body).map(|r| format!("{r:?}")),
        BodyKind::PeerEndpoint => p.peer_endpoint(body).map(|r| format!("{r:?}")),
    }
}

/// Fuzz-target body: no panic, sane error positions, scalar == AVX2 ==
/// AVX-512 (each vector path where the CPU has it).
pub fn fuzz_body(kind: BodyKind, body: &[u8]) {
    let limits = ParseLimits {
        max_depth: DEFAULT_MAX_DEPTH,
        max_tokens: 1 << 16,
    };
    let scalar = Parser::new(limits, Pool::new(4, 1 << 16), Pool::new(4, 1 << 16))
        .with_number_path(NumberPath::Scalar);
    let a = parse_debug(&scalar, kind, body);
    for (path, name) in NumberPath::available_vectors() {
        let vector = scalar.clone().with_number_path(path);
        let b = parse_debug(&vector, kind, body);
        assert_eq!(a, b, "scalar and {name} token loops disagree");
    }
    if let Err(e) = &a {
        assert!(e.offset <= body.len(), "error offset past the body: {e:?}");
        assert!(e.line >= 1);
        assert!(!e.message.is_empty());
    }
}

// ---- the serde_json oracle for /select ---------------------------------

// The nested structs declare their fields in the reference's order, with
// its serde defaults: serde also reads a struct from a sequence, positionally,
// where a field without a default is required even when it is an `Option`.

#[derive(Deserialize, Debug)]
#[serde(rename = "SelectionSessionContext")]
struct RefSessionContext {
    session_id: String,
    #[serde(default)]
    parent_session_id: Option<String>,
    #[serde(default)]
    session_final: Option<bool>,
    #[serde(default)]
    input_trigger: Option<RefTrigger>,
    #[serde(default)]
    #[allow(dead_code)]
    agent_headers: Option<HashMap<String, Vec<String>>>,
}

#[derive(Deserialize, Debug, PartialEq)]
#[serde(rename_all = "snake_case")]
enum RefTrigger {
    UserMessage,
    ToolResult,
    Other,
}

#[derive(Deserialize, Debug)]
#[serde(rename = "RouterConfigOverrideSerde")]
struct RefOverride {
    overlap_score_credit: Option<f64>,
    prefill_load_scale: Option<f64>,
    overlap_score_weight: Option<f64>,
    router_temperature: Option<f64>,
    assume_kv_reuse: Option<bool>,
    track_prefill_tokens: Option<bool>,
    shared_cache_multiplier: Option<f64>,
}

#[derive(Deserialize, Debug)]
#[serde(rename = "WorkerWithDpRank")]
struct RefPinned {
    worker_id: u64,
    dp_rank: u32,
}

#[derive(Deserialize, Debug)]
#[serde(rename = "WorkerAffinityTarget")]
struct RefAffinity {
    worker_id: u64,
    dp_rank: Option<u32>,
}

#[derive(Deserialize, Debug)]
struct RefConstraints {
    #[serde(default)]
    required_taints: Vec<String>,
    #[serde(default)]
    preferred_taints: HashMap<String, f32>,
}

#[derive(Deserialize, Debug)]
#[serde(rename = "BlockMmObjectInfo")]
struct RefMmObject {
    mm_hash: u64,
    #[allow(dead_code)]
    offsets: Vec<(usize, usize)>,
}

#[derive(Deserialize, Debug)]
#[serde(rename = "BlockExtraInfo")]
struct RefBlockInfo {
    mm_objects: Vec<RefMmObject>,
}

#[derive(Deserialize, Debug)]
#[serde(rename = "MmRoutingInfoRequest")]
struct RefMm {
    routing_token_ids: Vec<u32>,
    #[serde(default)]
    block_mm_infos: Vec<Option<RefBlockInfo>>,
}

/// A string that defaults when absent but may not be `null` (the
/// reference's `String` with `#[serde(default)]`).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    String::deserialize(d).map(Some)
}

/// A `bool` that defaults when absent but is not an `Option` (`advisory`).
fn present_bool<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    bool::deserialize(d).map(Some)
}

/// `routing_constraints`: optional, but not null (the reference declares it
/// with a default, not as an `Option`).
fn present_constraints<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<RefConstraints>, D::Error> {
    RefConstraints::deserialize(d).map(Some)
}

/// The /select body as one flat serde struct: the oracle, and the "serde_json
/// typed" peer in the parse bench.
#[derive(Deserialize, Debug)]
#[allow(dead_code)] // the bench peers read it through Debug and token_count
pub struct RefSelect {
    #[serde(default, deserialize_with = "present")]
    model_name: Option<String>,
    #[serde(default, deserialize_with = "present")]
    routing_group: Option<String>,
    selection_id: Option<String>,
    session_id: Option<String>,
    session_context: Option<RefSessionContext>,
    router_config_override: Option<RefOverride>,
    expected_output_tokens: Option<u32>,
    priority_jump: Option<f64>,
    strict_priority: Option<u32>,
    pinned_worker: Option<RefPinned>,
    affinity_target: Option<RefAffinity>,
    allowed_worker_ids: Option<Vec<u64>>,
    #[serde(default, deserialize_with = "present_constraints")]
    routing_constraints: Option<RefConstraints>,
    #[serde(default, deserialize_with = "present_bool")]
    advisory: Option<bool>,
    token_ids: Option<Vec<u32>>,
    mm_routing_info: Option<RefMm>,
    block_mm_infos: Option<Vec<Option<RefBlockInfo>>>,
    block_hashes: Option<Vec<i64>>,
    sequence_hashes: Option<Vec<i64>>,
    isl_tokens: Option<usize>,
    lora_name: Option<String>,
    cache_salt: Option<String>,
    is_eagle: Option<bool>,
}

impl RefSelect {
    /// Tokens read (keeps benches from optimising the parse away).
    pub fn token_count(&self) -> usize {
        self.token_ids.as_ref().map_or(0, Vec::len)
    }
}

/// The flattened prompt group, as the reference declares it.
#[derive(Deserialize, Debug)]
#[allow(dead_code)] // read only through Debug: the bench measures the parse
pub struct RefPrompt {
    token_ids: Option<Vec<u32>>,
    mm_routing_info: Option<RefMm>,
    block_mm_infos: Option<Vec<Option<RefBlockInfo>>>,
    block_hashes: Option<Vec<i64>>,
    sequence_hashes: Option<Vec<i64>>,
    isl_tokens: Option<usize>,
    lora_name: Option<String>,
    cache_salt: Option<String>,
    is_eagle: Option<bool>,
}

/// The /select body with a `#[serde(flatten)]` prompt: the design the
/// reference uses (every field goes through serde's `Content` buffer). The
/// "serde_json flatten" peer in the parse bench.
#[derive(Deserialize, Debug)]
#[allow(dead_code)] // read only through Debug: the bench measures the parse
pub struct RefSelectFlatten {
    #[serde(default, deserialize_with = "present")]
    model_name: Option<String>,
    #[serde(default, deserialize_with = "present")]
    routing_group: Option<String>,
    selection_id: Option<String>,
    session_id: Option<String>,
    session_context: Option<RefSessionContext>,
    #[serde(default, deserialize_with = "checked_override")]
    router_config_override: Option<RefOverride>,
    expected_output_tokens: Option<u32>,
    priority_jump: Option<f64>,
    strict_priority: Option<u32>,
    pinned_worker: Option<RefPinned>,
    affinity_target: Option<RefAffinity>,
    allowed_worker_ids: Option<Vec<u64>>,
    #[serde(default, deserialize_with = "present_constraints")]
    routing_constraints: Option<RefConstraints>,
    #[serde(default, deserialize_with = "present_bool")]
    advisory: Option<bool>,
    #[serde(flatten)]
    prompt: RefPrompt,
}

impl RefSelectFlatten {
    /// Tokens read.
    pub fn token_count(&self) -> usize {
        self.prompt.token_ids.as_ref().map_or(0, Vec::len)
    }
}

/// The reference's checks on the effective values: the deprecated weight
/// replaces `prefill_load_scale`, and a weight of 0 zeroes the credit.
/// `router_config_override` checked as the reference checks it: while it is
/// read, so its error comes in reading order.
fn checked_override<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<RefOverride>, D::Error> {
    match Option::<RefOverride>::deserialize(d)? {
        Some(o) if !override_ok(&o) => Err(serde::de::Error::custom("override out of range")),
        o => Ok(o),
    }
}

fn override_ok(o: &RefOverride) -> bool {
    let ok = |v: Option<f64>| v.is_none_or(|v| v.is_finite() && v >= 0.0);
    let credit = if o.overlap_score_weight == Some(0.0) {
        Some(0.0)
    } else {
        o.overlap_score_credit
    };
    ok(credit)
        && ok(o.overlap_score_weight.or(o.prefill_load_scale))
        && ok(o.router_temperature)
        && o.shared_cache_multiplier
            .is_none_or(|v| (0.0..=1.0).contains(&v))
}

/// The oracle's verdict on a /select body, read as the reference reads it:
/// the prompt group `#[serde(flatten)]`ed (so the top level is a map only,
/// and the prompt fields are read from serde's buffered content, where a
/// struct given as a too-long sequence is a shape error, not a syntax one).
/// The reference's verdict: serde_json straight into the typed struct, so
/// the first error in reading order decides (a shape error before a later
/// syntax error stays a shape error; the flattened prompt group's shape
/// errors come after the whole object). Trailing bytes after a valid body
/// are kvselect's one deliberate difference: a syntax error.
fn reference(body: &[u8]) -> Result<RefSelectFlatten, ErrorClass> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let class = |e: serde_json::Error| match e.classify() {
        serde_json::error::Category::Data => ErrorClass::Shape,
        _ => ErrorClass::Syntax,
    };
    let r = RefSelectFlatten::deserialize(&mut de).map_err(class)?;
    de.end().map_err(|_| ErrorClass::Syntax)?;
    Ok(r)
}

fn feq(a: Option<f64>, b: Option<f64>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(x), Some(y)) => x == y || (x - y).abs() <= 1e-12 * x.abs().max(y.abs()),
        _ => false,
    }
}

fn s<'a>(v: &'a Option<Str<'_>>) -> Option<&'a str> {
    v.as_deref()
}

fn mm_infos(v: &[Option<RefBlockInfo>]) -> Vec<Option<Vec<u64>>> {
    v.iter()
        .map(|b| {
            b.as_ref()
                .map(|b| b.mm_objects.iter().map(|o| o.mm_hash).collect())
        })
        .collect()
}

fn hashes(v: &Option<Vec<i64>>) -> Option<Vec<u64>> {
    v.as_ref().map(|v| v.iter().map(|&h| h as u64).collect())
}

/// Differential check of one /select body: panics (with both verdicts) when
/// our parser and the serde_json oracle disagree on the class or on a value.
pub fn differential_select(body: &[u8]) {
    differential_select_with(&Parser::default(), body)
}

/// [`differential_select`] with a given parser (e.g. one token loop pinned).
pub fn differential_select_with(parser: &Parser, body: &[u8]) {
    let ours = parser.select(body, SelectKind::Select);
    let want = reference(body);
    let (ours, want) = match (ours, want) {
        (Err(e), Err(class)) => {
            assert_eq!(e.class, class, "class differs: ours {e:?}");
            return;
        }
        (Ok(o), Ok(w)) => (o, w),
        (o, w) => panic!("verdicts differ: ours {o:?}, oracle {w:?}"),
    };
    let p = &ours.prompt;
    let wp = &want.prompt;
    assert_eq!(s(&ours.model_name), want.model_name.as_deref());
    assert_eq!(s(&ours.routing_group), want.routing_group.as_deref());
    assert_eq!(s(&ours.selection_id), want.selection_id.as_deref());
    assert_eq!(s(&ours.session_id), want.session_id.as_deref());
    match (&ours.session_context, &want.session_context) {
        (None, None) => {}
        (Some(a), Some(b)) => {
            assert_eq!(a.session_id, b.session_id);
            assert_eq!(s(&a.parent_session_id), b.parent_session_id.as_deref());
            assert_eq!(a.session_final, b.session_final);
            let t = a.input_trigger.map(|t| match t {
                InputTrigger::UserMessage => RefTrigger::UserMessage,
                InputTrigger::ToolResult => RefTrigger::ToolResult,
                InputTrigger::Other => RefTrigger::Other,
            });
            assert_eq!(t, b.input_trigger);
        }
        (a, b) => panic!("session_context differs: {a:?} vs {b:?}"),
    }
    match (&ours.router_config_override, &want.router_config_override) {
        (None, None) => {}
        (Some(a), Some(b)) => {
            assert!(feq(a.overlap_score_credit, b.overlap_score_credit));
            assert!(feq(a.prefill_load_scale, b.prefill_load_scale));
            assert!(feq(a.overlap_score_weight, b.overlap_score_weight));
            assert!(feq(a.router_temperature, b.router_temperature));
            assert!(feq(a.shared_cache_multiplier, b.shared_cache_multiplier));
            assert_eq!(a.assume_kv_reuse, b.assume_kv_reuse);
            assert_eq!(a.track_prefill_tokens, b.track_prefill_tokens);
        }
        (a, b) => panic!("router_config_override differs: {a:?} vs {b:?}"),
    }
    assert_eq!(ours.expected_output_tokens, want.expected_output_tokens);
    assert!(feq(ours.priority_jump, want.priority_jump));
    assert_eq!(ours.strict_priority, want.strict_priority);
    assert_eq!(
        ours.pinned_worker.map(|w| (w.worker_id, w.dp_rank)),
        want.pinned_worker
            .as_ref()
            .map(|w| (w.worker_id, w.dp_rank))
    );
    assert_eq!(
        ours.affinity_target.map(|w| (w.worker_id, w.dp_rank)),
        want.affinity_target
            .as_ref()
            .map(|w| (w.worker_id, w.dp_rank))
    );
    assert_eq!(ours.allowed_worker_ids, want.allowed_worker_ids);
    match (&ours.routing_constraints, &want.routing_constraints) {
        (None, None) => {}
        (Some(a), Some(b)) => {
            let req: Vec<&str> = a.required_taints.iter().map(|t| &**t).collect();
            assert_eq!(req, b.required_taints);
            assert_eq!(a.preferred_taints.len(), b.preferred_taints.len());
            for (k, w) in &a.preferred_taints {
                assert_eq!(b.preferred_taints.get(&**k), Some(w));
            }
        }
        (a, b) => panic!("routing_constraints differs: {a:?} vs {b:?}"),
    }
    assert_eq!(ours.advisory, want.advisory);
    assert_eq!(
        p.token_ids.as_deref().map(|v| &v[..]),
        wp.token_ids.as_deref()
    );
    match (&p.mm_routing_info, &wp.mm_routing_info) {
        (None, None) => {}
        (Some(a), Some(b)) => {
            assert_eq!(
                a.routing_token_ids.as_deref().map(|v| &v[..]),
                Some(&b.routing_token_ids[..])
            );
            assert_eq!(
                a.block_mm_infos.clone().unwrap_or_default(),
                mm_infos(&b.block_mm_infos)
            );
        }
        (a, b) => panic!("mm_routing_info differs: {a:?} vs {b:?}"),
    }
    assert_eq!(p.block_mm_infos, wp.block_mm_infos.as_deref().map(mm_infos));
    assert_eq!(p.block_hashes.as_deref().cloned(), hashes(&wp.block_hashes));
    assert_eq!(
        p.sequence_hashes.as_deref().cloned(),
        hashes(&wp.sequence_hashes)
    );
    assert_eq!(p.isl_tokens, wp.isl_tokens.map(|v| v as u64));
    assert_eq!(s(&p.lora_name), wp.lora_name.as_deref());
    assert_eq!(s(&p.cache_salt), wp.cache_salt.as_deref());
    assert_eq!(p.is_eagle, wp.is_eagle);
}

// ---- the streamed path against the whole-body parser -------------------

/// The body kinds the HTTP layer streams (those with a prompt).
pub const STREAMED_KINDS: [BodyKind; 4] = [
    BodyKind::Select,
    BodyKind::SelectAndReserve,
    BodyKind::Reservation,
    BodyKind::PromptQuery,
];

/// Parses a streamed body as `kind` (a kind the HTTP layer streams; others
/// read the stream's contiguous body), rendered like [`parse_debug`].
pub fn parse_debug_stream(
    p: &Parser,
    kind: BodyKind,
    s: &BodyStream,
) -> Result<String, ParseError> {
    match kind {
        BodyKind::Select => p
            .select_stream(s, SelectKind::Select)
            .map(|r| format!("{r:?}")),
        BodyKind::SelectAndReserve => p
            .select_stream(s, SelectKind::SelectAndReserve)
            .map(|r| format!("{r:?}")),
        BodyKind::Reservation => p.reservation_stream(s).map(|r| format!("{r:?}")),
        BodyKind::PromptQuery => p.prompt_query_stream(s).map(|r| format!("{r:?}")),
        other => parse_debug(p, other, s.contiguous()),
    }
}

/// `body` fed to a fresh stream of `p` in frames that end at `cuts`
/// (ascending offsets; out-of-range ones are ignored).
pub fn stream_of(p: &Parser, body: &[u8], cuts: &[usize]) -> BodyStream {
    let mut s = p.stream();
    let mut at = 0;
    for &c in cuts {
        if c > at && c < body.len() {
            s.feed(bytes::Bytes::copy_from_slice(&body[at..c]));
            at = c;
        }
    }
    s.feed(bytes::Bytes::copy_from_slice(&body[at..]));
    s
}

/// The streamed parse of `body` cut at `cuts` equals the whole-body parse
/// (same class, values, error text, offset and path), on every token loop
/// this CPU has; returns how many token arrays the stream converted on the
/// last loop (0 when it fell back).
pub fn stream_differential(kind: BodyKind, body: &[u8], cuts: &[usize]) -> usize {
    let limits = ParseLimits {
        max_depth: DEFAULT_MAX_DEPTH,
        max_tokens: 1 << 16,
    };
    let base = Parser::new(limits, Pool::new(4, 1 << 16), Pool::new(4, 1 << 16));
    stream_differential_with(&base, kind, body, cuts)
}

/// [`stream_differential`] with the limits and pools of `base`.
pub fn stream_differential_with(
    base: &Parser,
    kind: BodyKind,
    body: &[u8],
    cuts: &[usize],
) -> usize {
    let mut converted = 0;
    for (path, name) in NumberPath::available() {
        let p = base.clone().with_number_path(path);
        let whole = parse_debug(&p, kind, body);
        let s = stream_of(&p, body, cuts);
        converted = s.streamed_arrays();
        let streamed = parse_debug_stream(&p, kind, &s);
        assert_eq!(
            whole,
            streamed,
            "{kind:?} on {name}: whole-body and streamed (cuts {cuts:?}) differ on {:?}",
            String::from_utf8_lossy(body)
        );
    }
    converted
}

/// Fuzz-target body for the streamed path: the first byte picks the frame
/// sizes (up to 1, 2, 3, 7, 16, 64, 200 or 1000 bytes, varied by a PRNG it
/// seeds), the rest is the body, checked by [`stream_differential`] for
/// every streamed kind.
pub fn fuzz_stream(data: &[u8]) {
    let Some((&seed, body)) = data.split_first() else {
        return;
    };
    let cuts = random_cuts(seed, body.len());
    for kind in STREAMED_KINDS {
        stream_differential(kind, body, &cuts);
    }
}

/// Frame ends for a body of `len` bytes, from `seed` (see [`fuzz_stream`]).
pub fn random_cuts(seed: u8, len: usize) -> Vec<usize> {
    const MAX: [usize; 8] = [1, 2, 3, 7, 16, 64, 200, 1000];
    let max = MAX[(seed & 7) as usize];
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (seed as u64) ^ ((len as u64) << 8);
    let mut cuts = Vec::new();
    let mut at = 0;
    loop {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        at += 1 + (x % max as u64) as usize;
        if at >= len {
            return cuts;
        }
        cuts.push(at);
    }
}
