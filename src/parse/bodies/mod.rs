//! One visitor per request body (`selection-api.md` §4): keys are matched on
//! their raw bytes, known fields parsed straight into the view, unknown fields
//! skipped by the validating skipper, duplicates rejected.
//!
//! Error paths follow the reference (axum + serde_path_to_error + a
//! `#[serde(flatten)]`ed prompt): a shape error in a prompt field has no path
//! and is reported at the end of the top-level object; every other error names
//! its dotted field path.
//!
//! Files: this one holds the shared helpers and one entry point per body;
//! `groups.rs` the field groups several bodies share; `workers.rs` the
//! worker bodies.

use super::cursor::{Cur, Key, Num};
use super::failure::{fail, Context, PResult};
use super::numbers::{i64_array, u32_array, u64_array};
use super::*;
use crate::pool::Pooled;
use std::borrow::Cow;
use std::collections::BTreeMap;

/// A known field of a struct read with [`fields`]: its second occurrence is
/// serde's `duplicate field `x``, raised before the colon is read; then the
/// colon.
#[inline]
fn seen(cur: &mut Cur<'_>, set: &mut u64, bit: u32, key: &Key<'_>, name: &str) -> PResult<()> {
    if *set & (1 << bit) != 0 {
        // Placed after any whitespace that follows the name, as serde_json
        // places an error it raises there.
        let at = cur.i;
        cur.ws();
        let gap = cur.i - at;
        return Err(cur.shape(key.end + gap, format!("duplicate field `{name}`")));
    }
    *set |= 1 << bit;
    cur.colon()
}

/// The end of a body with the flattened prompt group: its first deferred
/// prompt error ([`Parser::prompt_or_defer`]), placed after the top-level
/// object's `}` where the reference reports it, or the parsed view.
fn deferred_or<T>(cur: &Cur<'_>, deferred: Option<Box<failure::Fail>>, v: T) -> PResult<T> {
    match deferred {
        None => Ok(v),
        Some(mut e) => {
            e.offset = cur.i;
            Err(e)
        }
    }
}

#[cold]
fn missing(cur: &Cur<'_>, name: &str) -> Box<failure::Fail> {
    cur.shape(cur.i, format!("missing field `{name}`"))
}

fn opt_str<'a>(cur: &mut Cur<'a>) -> PResult<Option<Str<'a>>> {
    if cur.null()? {
        return Ok(None);
    }
    cur.str_val().map(Some)
}

/// A string field that is a string whenever present: `null` is a shape
/// error, as the reference has it for `model_name` and `routing_group`
/// (they default when absent, but are not `Option`s).
fn present_str<'a>(cur: &mut Cur<'a>) -> PResult<Option<Str<'a>>> {
    cur.str_val().map(Some)
}

fn opt_string(cur: &mut Cur<'_>) -> PResult<Option<String>> {
    Ok(opt_str(cur)?.map(Cow::into_owned))
}

fn opt_bool(cur: &mut Cur<'_>) -> PResult<Option<bool>> {
    if cur.null()? {
        return Ok(None);
    }
    cur.bool_val().map(Some)
}

fn opt_u32(cur: &mut Cur<'_>) -> PResult<Option<u32>> {
    if cur.null()? {
        return Ok(None);
    }
    cur.u32_val().map(Some)
}

fn opt_u64(cur: &mut Cur<'_>, expected: &str) -> PResult<Option<u64>> {
    if cur.null()? {
        return Ok(None);
    }
    cur.u64_val(expected).map(Some)
}

fn opt_f64(cur: &mut Cur<'_>, expected: &str) -> PResult<Option<f64>> {
    if cur.null()? {
        return Ok(None);
    }
    cur.f64_val(expected).map(Some)
}

/// The top-level `{` of a body.
fn top_object(cur: &mut Cur<'_>, name: &str) -> PResult<()> {
    match cur.ws() {
        Some(b'{') => cur.enter(),
        _ => Err(cur.wrong_type(&format!("struct {name}"))),
    }
}

/// serde's `unknown variant` text.
fn unknown_variant(v: &str, variants: &[&str]) -> String {
    let list = match variants {
        [a] => format!("expected `{a}`"),
        [a, b] => format!("expected `{a}` or `{b}`"),
        _ => {
            let all: Vec<String> = variants.iter().map(|v| format!("`{v}`")).collect();
            format!("expected one of {}", all.join(", "))
        }
    };
    format!("unknown variant `{v}`, {list}")
}

/// A unit enum: a variant name string, or serde_json's map form
/// `{"variant": null}`. Any other token is serde_json's syntax error
/// `expected value`. `null` is handled by the caller.
fn enum_val(cur: &mut Cur<'_>, variants: &[&str]) -> PResult<usize> {
    let variant = |cur: &Cur<'_>, s: &str| {
        variants
            .iter()
            .position(|v| *v == s)
            .ok_or_else(|| cur.shape(cur.i, unknown_variant(s, variants)))
    };
    match cur.ws() {
        Some(b'"') => {
            let s = cur.string()?;
            variant(cur, &s)
        }
        Some(b'{') => {
            cur.enter()?;
            if cur.ws() == Some(b'}') {
                // serde_json wants the variant name here, not the `}`.
                return Err(cur.syntax_here("expected value"));
            }
            let Some(k) = cur.key_only(true)? else {
                return Err(cur.syntax_here("expected value"));
            };
            // serde checks the variant before the colon, and names it in the
            // path of an error in its (unit) value.
            let idx = variant(cur, &k.text())?;
            cur.colon()?;
            let name = variants[idx];
            if !cur.null().key(name)? {
                return Err(cur.wrong_type("unit")).key(name);
            }
            match cur.ws() {
                Some(b'}') => {
                    cur.i += 1;
                    cur.leave();
                    Ok(idx)
                }
                None => Err(cur.eof("an object")),
                Some(_) => Err(cur.syntax_here("expected value")),
            }
        }
        None => Err(cur.eof("a value")),
        Some(_) => Err(cur.syntax_here("expected value")),
    }
}

/// Which form a nested struct's value took: serde reads a struct from a map
/// or, positionally, from a sequence (fields in declaration order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    Map,
    Seq,
}

/// `{` or `[` for a struct (`expected` names it for the wrong-type error);
/// enters it.
fn struct_start(cur: &mut Cur<'_>, expected: &str) -> PResult<Form> {
    match cur.ws() {
        Some(b'{') => cur.enter().map(|_| Form::Map),
        Some(b'[') => cur.enter().map(|_| Form::Seq),
        _ => Err(cur.wrong_type(expected)),
    }
}

/// The rest of a sequence the reference buffered (serde's `Content`, as for
/// the flattened prompt group) after a visitor took `taken` elements, the
/// cursor just after the last of them: each further element is skipped (a
/// syntax error inside it under its index) and counted. More than `taken`
/// is serde's shape error `invalid length N, expected M elements in
/// sequence`.
fn buffered_rest(cur: &mut Cur<'_>, taken: usize) -> PResult<()> {
    let mut total = taken;
    while cur.array_next()? {
        cur.skip_value().index(total)?;
        total += 1;
    }
    if total == taken {
        return Ok(());
    }
    let s = if taken == 1 { "" } else { "s" };
    Err(cur.shape(
        cur.i,
        format!("invalid length {total}, expected {taken} element{s} in sequence"),
    ))
}

/// A struct read in serde's sequence form, one field per element.
///
/// Two readers exist in the reference and they differ after the last field:
/// a field read straight from serde_json ends with its `end_seq` (more
/// elements are the syntax errors `trailing characters` / `trailing comma`,
/// the extra elements unread), while a field of the flattened prompt group is
/// read from serde's buffered `Content` (more elements are the shape error
/// `invalid length N, expected M elements in sequence`).
struct SeqStruct<'n> {
    /// serde's `expecting` text: `struct NAME with M elements`.
    name: &'n str,
    fields: usize,
    /// Elements claimed so far.
    n: usize,
    /// The closing `]` was consumed.
    ended: bool,
    buffered: bool,
}

impl<'n> SeqStruct<'n> {
    fn new(name: &'n str, fields: usize, buffered: bool) -> Self {
        SeqStruct {
            name,
            fields,
            n: 0,
            ended: false,
            buffered,
        }
    }

    /// The next field's element: `Ok(true)` with the cursor on its value,
    /// `Ok(false)` when the sequence ended and the field has a serde default,
    /// else serde's `invalid length` (after the `]`).
    fn field(&mut self, cur: &mut Cur<'_>, has_default: bool) -> PResult<bool> {
        if !self.ended {
            let more = if self.n == 0 {
                !cur.array_empty()?
            } else {
                cur.array_next()?
            };
            if more {
                self.n += 1;
                return Ok(true);
            }
            self.ended = true;
        }
        if has_default {
            return Ok(false);
        }
        let s = if self.fields == 1 { "" } else { "s" };
        Err(cur.shape(
            cur.i,
            format!(
                "invalid length {}, expected struct {} with {} element{s}",
                self.n, self.name, self.fields
            ),
        ))
    }

    /// After the last field: the sequence must end there.
    fn finish(self, cur: &mut Cur<'_>) -> PResult<()> {
        if self.ended {
            return Ok(());
        }
        if self.buffered {
            return buffered_rest(cur, self.n);
        }
        // serde_json's end_seq.
        match cur.ws() {
            Some(b']') => {
                cur.i += 1;
                cur.leave();
                Ok(())
            }
            Some(b',') => {
                cur.i += 1;
                match cur.ws() {
                    Some(b']') => Err(cur.syntax_here("trailing comma")),
                    _ => Err(cur.syntax_here("trailing characters")),
                }
            }
            None => Err(cur.eof("a list")),
            Some(_) => Err(cur.syntax_here("trailing characters")),
        }
    }
}

/// Where serde_json places an error raised after a nested value was read
/// (a validation message): the enclosing object's `end_map` has skipped the
/// whitespace and consumed a closing `}`.
fn after_value_offset(cur: &Cur<'_>) -> usize {
    let mut j = cur.i;
    while cur.b.get(j).is_some_and(|&c| cursor::is_ws(c)) {
        j += 1;
    }
    if cur.b.get(j) == Some(&b'}') {
        j += 1;
    }
    j
}

/// Iterates an object's entries: `f(cur, key)` must consume the value.
fn object<'a>(
    cur: &mut Cur<'a>,
    f: impl FnMut(&mut Cur<'a>, Key<'a>) -> PResult<()>,
) -> PResult<()> {
    entries(cur, Cur::next_key, f)
}

/// The fields of a struct's map form. Unlike a map's entries, the colon is
/// left to `f`, which must start each field with [`seen`] (a known field)
/// or [`skip`] / [`skip_ignored`] (an unknown one): serde checks a field's
/// name for a duplicate before it reads the colon.
fn fields<'a>(
    cur: &mut Cur<'a>,
    f: impl FnMut(&mut Cur<'a>, Key<'a>) -> PResult<()>,
) -> PResult<()> {
    entries(cur, Cur::next_field, f)
}

/// The loop of [`object`] and [`fields`], with their way to read a key.
fn entries<'a>(
    cur: &mut Cur<'a>,
    next: fn(&mut Cur<'a>, bool) -> PResult<Option<Key<'a>>>,
    mut f: impl FnMut(&mut Cur<'a>, Key<'a>) -> PResult<()>,
) -> PResult<()> {
    let mut first = true;
    while let Some(k) = next(cur, first)? {
        first = false;
        f(cur, k)?;
    }
    Ok(())
}

/// Skips an unknown field's value in an object the reference buffers
/// (the top level of a body with the flattened prompt group, and the prompt
/// group's own values): a syntax error's path goes down into the value.
#[inline]
fn skip(cur: &mut Cur<'_>, k: &Key<'_>) -> PResult<()> {
    cur.colon()?;
    cur.skip_value().key_with(|| k.text())
}

/// Skips an unknown field's value in an object the reference reads straight
/// into a struct (serde's `IgnoredAny`): a syntax error's path ends at the
/// field's name, as serde_path_to_error tracks nothing inside it, and its
/// strings are checked leniently ([`Cur::lenient`]).
#[inline]
fn skip_ignored(cur: &mut Cur<'_>, k: &Key<'_>) -> PResult<()> {
    cur.colon()?;
    cur.lenient = true;
    let r = cur.skip_value();
    cur.lenient = false;
    r.map_err(|mut e| {
        e.segs.clear();
        e.segs.push(failure::Seg::Key(k.text()));
        e
    })
}

trait KeyWith<T> {
    fn key_with(self, f: impl FnOnce() -> String) -> PResult<T>;
}
impl<T> KeyWith<T> for PResult<T> {
    #[inline]
    fn key_with(self, f: impl FnOnce() -> String) -> PResult<T> {
        self.map_err(|mut e| {
            e.segs.push(failure::Seg::Key(f()));
            e
        })
    }
}

mod groups;
mod workers;

use groups::*;
use workers::worker_fields;

// ---- bodies ------------------------------------------------------------

impl Parser {
    /// Runs a body visitor, then requires only whitespace after the value.
    /// An error is the first one in the order the reference meets it (see
    /// [`Parser::prompt_or_defer`] for the prompt group's); trailing bytes
    /// are checked only after a body that parsed.
    fn run<'a, T>(
        &self,
        body: &'a [u8],
        f: impl FnOnce(&mut Cur<'a>) -> PResult<T>,
    ) -> Result<T, ParseError> {
        self.run_in(body, None, f)
    }

    /// [`Parser::run`] with the token arrays a streamed body's front
    /// converted (`stream.rs`).
    fn run_in<'a, T>(
        &self,
        body: &'a [u8],
        side: Option<&'a stream::Side>,
        f: impl FnOnce(&mut Cur<'a>) -> PResult<T>,
    ) -> Result<T, ParseError> {
        let mut cur = Cur::new(body, self.limits.max_depth);
        cur.side = side;
        let res = f(&mut cur).and_then(|v| match cur.ws() {
            None => Ok(v),
            Some(_) => Err(cur.syntax_here("trailing characters")),
        });
        res.map_err(|e| (*e).finish(body))
    }

    /// POST /select and /select_and_reserve (§4.8, §4.9).
    pub fn select<'a>(
        &self,
        body: &'a [u8],
        kind: SelectKind,
    ) -> Result<SelectRequest<'a>, ParseError> {
        self.select_in(body, None, kind)
    }

    pub(super) fn select_in<'a>(
        &self,
        body: &'a [u8],
        side: Option<&'a stream::Side>,
        kind: SelectKind,
    ) -> Result<SelectRequest<'a>, ParseError> {
        let name = match kind {
            SelectKind::Select => "SelectRequest",
            SelectKind::SelectAndReserve => "SelectAndReserveRequest",
        };
        self.run_in(body, side, |cur| {
            top_object(cur, name)?;
            let mut r = SelectRequest::default();
            let mut set = 0u64;
            let mut pset = 0u64;
            let mut first = true;
            let mut deferred = None;
            while let Some(k) = cur.next_field(first)? {
                first = false;
                if self.prompt_or_defer(cur, &k, &mut r.prompt, &mut pset, &mut deferred)? {
                    continue;
                }
                macro_rules! field {
                    ($bit:expr, $name:literal, $slot:expr, $e:expr) => {{
                        seen(cur, &mut set, $bit, &k, $name)?;
                        $slot = $e.key($name)?;
                    }};
                }
                match &*k.bytes {
                    b"model_name" => field!(0, "model_name", r.model_name, present_str(cur)),
                    b"routing_group" => {
                        field!(1, "routing_group", r.routing_group, present_str(cur))
                    }
                    b"selection_id" => field!(2, "selection_id", r.selection_id, opt_str(cur)),
                    b"session_id" => field!(3, "session_id", r.session_id, opt_str(cur)),
                    b"session_context" => field!(
                        4,
                        "session_context",
                        r.session_context,
                        session_context(cur)
                    ),
                    b"router_config_override" => field!(
                        5,
                        "router_config_override",
                        r.router_config_override,
                        Self::router_config_override(cur)
                    ),
                    b"expected_output_tokens" => field!(
                        6,
                        "expected_output_tokens",
                        r.expected_output_tokens,
                        opt_u32(cur)
                    ),
                    b"priority_jump" => {
                        field!(7, "priority_jump", r.priority_jump, opt_f64(cur, "f64"))
                    }
                    b"strict_priority" => {
                        field!(8, "strict_priority", r.strict_priority, opt_u32(cur))
                    }
                    b"pinned_worker" => field!(
                        9,
                        "pinned_worker",
                        r.pinned_worker,
                        worker_rank(cur, "WorkerWithDpRank", true).map(|o| {
                            o.map(|(worker_id, r)| PinnedWorker {
                                worker_id,
                                dp_rank: r.unwrap_or(0),
                            })
                        })
                    ),
                    b"affinity_target" => field!(
                        10,
                        "affinity_target",
                        r.affinity_target,
                        worker_rank(cur, "WorkerAffinityTarget", false).map(|o| {
                            o.map(|(worker_id, dp_rank)| AffinityTarget { worker_id, dp_rank })
                        })
                    ),
                    b"allowed_worker_ids" => field!(
                        11,
                        "allowed_worker_ids",
                        r.allowed_worker_ids,
                        opt_u64_vec(cur)
                    ),
                    b"routing_constraints" => field!(
                        12,
                        "routing_constraints",
                        r.routing_constraints,
                        routing_constraints(cur)
                    ),
                    b"advisory" if kind == SelectKind::Select => {
                        // Defaults when absent; `null` is a shape error,
                        // as in the reference (a `bool`, not an `Option`).
                        field!(13, "advisory", r.advisory, cur.bool_val().map(Some))
                    }
                    _ => skip(cur, &k)?,
                }
            }
            deferred_or(cur, deferred, r)
        })
    }

    /// POST /reservations, both forms (§4.10).
    pub fn reservation<'a>(&self, body: &'a [u8]) -> Result<ReservationRequest<'a>, ParseError> {
        self.reservation_in(body, None)
    }

    pub(super) fn reservation_in<'a>(
        &self,
        body: &'a [u8],
        side: Option<&'a stream::Side>,
    ) -> Result<ReservationRequest<'a>, ParseError> {
        self.run_in(body, side, |cur| {
            top_object(cur, "ReservationRequest")?;
            let mut r = ReservationRequest::default();
            let mut sid = None;
            let mut set = 0u64;
            let mut pset = 0u64;
            let mut first = true;
            let mut deferred = None;
            while let Some(k) = cur.next_field(first)? {
                first = false;
                if self.prompt_or_defer(cur, &k, &mut r.prompt, &mut pset, &mut deferred)? {
                    continue;
                }
                macro_rules! field {
                    ($bit:expr, $name:literal, $slot:expr, $e:expr) => {{
                        seen(cur, &mut set, $bit, &k, $name)?;
                        $slot = $e.key($name)?;
                    }};
                }
                match &*k.bytes {
                    b"selection_id" => {
                        field!(0, "selection_id", sid, cur.str_val().map(Some))
                    }
                    b"model_name" => field!(1, "model_name", r.model_name, present_str(cur)),
                    b"routing_group" => {
                        field!(2, "routing_group", r.routing_group, present_str(cur))
                    }
                    b"worker_id" => field!(3, "worker_id", r.worker_id, opt_u64(cur, "u64")),
                    b"dp_rank" => field!(4, "dp_rank", r.dp_rank, opt_u32(cur)),
                    b"router_config_override" => field!(
                        5,
                        "router_config_override",
                        r.router_config_override,
                        Self::router_config_override(cur)
                    ),
                    b"expected_output_tokens" => field!(
                        6,
                        "expected_output_tokens",
                        r.expected_output_tokens,
                        opt_u32(cur)
                    ),
                    b"effective_prefill_tokens" => field!(
                        7,
                        "effective_prefill_tokens",
                        r.effective_prefill_tokens,
                        opt_u64(cur, "usize")
                    ),
                    b"track_prefill_tokens" => field!(
                        8,
                        "track_prefill_tokens",
                        r.track_prefill_tokens,
                        opt_bool(cur)
                    ),
                    _ => skip(cur, &k)?,
                }
            }
            r.selection_id = sid.ok_or_else(|| missing(cur, "selection_id"))?;
            deferred_or(cur, deferred, r)
        })
    }

    /// POST /reservations/{id}/output_block.
    pub fn output_block(&self, body: &[u8]) -> Result<OutputBlockRequest, ParseError> {
        self.run(body, |cur| {
            top_object(cur, "OutputBlockRequest")?;
            let mut r = OutputBlockRequest::default();
            let mut set = 0u64;
            fields(cur, |cur, k| {
                match &*k.bytes {
                    b"decay_fraction" => {
                        seen(cur, &mut set, 0, &k, "decay_fraction")?;
                        r.decay_fraction = opt_f64(cur, "f64").key("decay_fraction")?;
                    }
                    _ => skip_ignored(cur, &k)?,
                }
                Ok(())
            })?;
            Ok(r)
        })
    }

    /// POST /potential_loads (§4.13).
    pub fn prompt_query<'a>(&self, body: &'a [u8]) -> Result<PromptQueryRequest<'a>, ParseError> {
        self.prompt_query_in(body, None, "PotentialLoadsRequest")
    }

    /// POST /overlap_scores (§4.14): the /potential_loads body under the
    /// reference's other struct name (it appears in the wrong-type message).
    pub fn overlap_scores_query<'a>(
        &self,
        body: &'a [u8],
    ) -> Result<PromptQueryRequest<'a>, ParseError> {
        self.prompt_query_in(body, None, "OverlapScoresRequest")
    }

    pub(super) fn prompt_query_in<'a>(
        &self,
        body: &'a [u8],
        side: Option<&'a stream::Side>,
        name: &str,
    ) -> Result<PromptQueryRequest<'a>, ParseError> {
        self.run_in(body, side, |cur| {
            top_object(cur, name)?;
            let mut r = PromptQueryRequest::default();
            let mut set = 0u64;
            let mut pset = 0u64;
            let mut first = true;
            let mut deferred = None;
            while let Some(k) = cur.next_field(first)? {
                first = false;
                if self.prompt_or_defer(cur, &k, &mut r.prompt, &mut pset, &mut deferred)? {
                    continue;
                }
                match &*k.bytes {
                    b"model_name" => {
                        seen(cur, &mut set, 0, &k, "model_name")?;
                        r.model_name = present_str(cur).key("model_name")?;
                    }
                    b"routing_group" => {
                        seen(cur, &mut set, 1, &k, "routing_group")?;
                        r.routing_group = present_str(cur).key("routing_group")?;
                    }
                    b"router_config_override" => {
                        seen(cur, &mut set, 2, &k, "router_config_override")?;
                        r.router_config_override =
                            Self::router_config_override(cur).key("router_config_override")?;
                    }
                    _ => skip(cur, &k)?,
                }
            }
            deferred_or(cur, deferred, r)
        })
    }

    /// POST /workers: `worker_id` required.
    pub fn worker_upsert(&self, body: &[u8]) -> Result<WorkerFields, ParseError> {
        self.run(body, |cur| worker_fields(cur, true))
    }

    /// PATCH /workers/{id}: `worker_id`, `model_name` and `routing_group` are
    /// skipped like unknown fields.
    pub fn worker_patch(&self, body: &[u8]) -> Result<WorkerFields, ParseError> {
        self.run(body, |cur| worker_fields(cur, false))
    }

    /// `{"endpoint": string}` of the replica_sync routes.
    pub fn peer_endpoint<'a>(&self, body: &'a [u8]) -> Result<Str<'a>, ParseError> {
        self.run(body, |cur| {
            top_object(cur, "PeerRequest")?;
            let mut ep = None;
            let mut set = 0u64;
            fields(cur, |cur, k| {
                match &*k.bytes {
                    b"endpoint" => {
                        seen(cur, &mut set, 0, &k, "endpoint")?;
                        ep = Some(cur.str_val().key("endpoint")?);
                    }
                    _ => skip_ignored(cur, &k)?,
                }
                Ok(())
            })?;
            ep.ok_or_else(|| missing(cur, "endpoint"))
        })
    }
}
