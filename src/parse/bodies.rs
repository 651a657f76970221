//! One visitor per request body (`selection-api.md` §4): keys are matched on
//! their raw bytes, known fields parsed straight into the view, unknown fields
//! skipped by the validating skipper, duplicates rejected.
//!
//! Error paths follow the reference (axum + serde_path_to_error + a
//! `#[serde(flatten)]`ed prompt): a shape error in a prompt field has no path
//! and is reported at the end of the top-level object; every other error names
//! its dotted field path.

use super::cursor::{fail, Context, Cur, Key, Num, PResult};
use super::numbers::{i64_array, u32_array, u64_array};
use super::*;
use crate::pool::Pooled;
use std::borrow::Cow;
use std::collections::BTreeMap;

/// Rejects the second occurrence of a field (serde: `duplicate field `x``,
/// reported just after the key).
#[inline]
fn seen(cur: &Cur<'_>, set: &mut u64, bit: u32, key: &Key<'_>, name: &str) -> PResult<()> {
    if *set & (1 << bit) != 0 {
        return Err(cur.shape(key.end, format!("duplicate field `{name}`")));
    }
    *set |= 1 << bit;
    Ok(())
}

#[cold]
fn missing(cur: &Cur<'_>, name: &str) -> Box<cursor::Fail> {
    cur.shape(cur.i, format!("missing field `{name}`"))
}

fn opt_str<'a>(cur: &mut Cur<'a>) -> PResult<Option<Str<'a>>> {
    if cur.null()? {
        return Ok(None);
    }
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
            let Some(k) = cur.next_key(true)? else {
                return Err(cur.syntax_here("expected value"));
            };
            let idx = variant(cur, &k.text())?;
            if !cur.null()? {
                return Err(cur.wrong_type("unit"));
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

/// Iterates an object's entries: `f(cur, key)` must consume the value.
fn object<'a>(
    cur: &mut Cur<'a>,
    mut f: impl FnMut(&mut Cur<'a>, Key<'a>) -> PResult<()>,
) -> PResult<()> {
    let mut first = true;
    while let Some(k) = cur.next_key(first)? {
        first = false;
        f(cur, k)?;
    }
    Ok(())
}

/// Skips an unknown field's value, naming it in a syntax error's path.
#[inline]
fn skip(cur: &mut Cur<'_>, k: &Key<'_>) -> PResult<()> {
    cur.skip_value().key_with(|| k.text())
}

trait KeyWith<T> {
    fn key_with(self, f: impl FnOnce() -> String) -> PResult<T>;
}
impl<T> KeyWith<T> for PResult<T> {
    #[inline]
    fn key_with(self, f: impl FnOnce() -> String) -> PResult<T> {
        self.map_err(|mut e| {
            e.segs.push(cursor::Seg::Key(f()));
            e
        })
    }
}

// ---- shared groups -----------------------------------------------------

impl Parser {
    /// One field of the flattened prompt group; `Ok(false)` if `k` is not one.
    fn prompt_field<'a>(
        &self,
        cur: &mut Cur<'a>,
        k: &Key<'a>,
        p: &mut Prompt<'a>,
        set: &mut u64,
    ) -> PResult<bool> {
        macro_rules! field {
            ($bit:expr, $name:literal, $e:expr) => {{
                seen(cur, set, $bit, k, $name).flattened()?;
                $e.key($name).flattened()?;
            }};
        }
        match &*k.bytes {
            b"token_ids" => field!(0, "token_ids", {
                let r: PResult<()> = (|| {
                    if cur.null()? {
                        p.token_ids = None;
                        return Ok(());
                    }
                    let mut buf = self.tokens.take();
                    u32_array(cur, &mut buf, self.limits.max_tokens, self.vector())?;
                    p.token_ids = Some(buf);
                    Ok(())
                })();
                r
            }),
            b"block_hashes" => field!(1, "block_hashes", {
                self.opt_hashes(cur).map(|h| p.block_hashes = h)
            }),
            b"sequence_hashes" => field!(2, "sequence_hashes", {
                self.opt_hashes(cur).map(|h| p.sequence_hashes = h)
            }),
            b"isl_tokens" => field!(3, "isl_tokens", {
                opt_u64(cur, "usize").map(|v| p.isl_tokens = v)
            }),
            b"lora_name" => field!(4, "lora_name", opt_str(cur).map(|v| p.lora_name = v)),
            b"cache_salt" => field!(5, "cache_salt", opt_str(cur).map(|v| p.cache_salt = v)),
            b"is_eagle" => field!(6, "is_eagle", opt_bool(cur).map(|v| p.is_eagle = v)),
            b"block_mm_infos" => field!(7, "block_mm_infos", {
                block_mm_infos(cur).map(|v| p.block_mm_infos = v)
            }),
            b"mm_routing_info" => field!(8, "mm_routing_info", {
                self.mm_routing_info(cur).map(|v| p.mm_routing_info = v)
            }),
            _ => return Ok(false),
        }
        Ok(true)
    }

    fn opt_hashes(&self, cur: &mut Cur<'_>) -> PResult<Option<Pooled<u64>>> {
        if cur.null()? {
            return Ok(None);
        }
        let mut buf = self.hashes.take();
        i64_array(cur, &mut buf, self.limits.max_tokens)?;
        Ok(Some(buf))
    }

    fn mm_routing_info(&self, cur: &mut Cur<'_>) -> PResult<Option<MmRoutingInfo>> {
        if cur.null()? {
            return Ok(None);
        }
        cur.object_start("struct MmRoutingInfo")?;
        let mut m = MmRoutingInfo::default();
        let mut set = 0u64;
        object(cur, |cur, k| match &*k.bytes {
            b"routing_token_ids" => {
                seen(cur, &mut set, 0, &k, "routing_token_ids")?;
                let r: PResult<()> = (|| {
                    if cur.null()? {
                        m.routing_token_ids = None;
                        return Ok(());
                    }
                    let mut buf = self.tokens.take();
                    u32_array(cur, &mut buf, self.limits.max_tokens, self.vector())?;
                    m.routing_token_ids = Some(buf);
                    Ok(())
                })();
                r.key("routing_token_ids")
            }
            b"block_mm_infos" => {
                seen(cur, &mut set, 1, &k, "block_mm_infos")?;
                m.block_mm_infos = block_mm_infos(cur).key("block_mm_infos")?;
                Ok(())
            }
            _ => skip(cur, &k),
        })?;
        Ok(Some(m))
    }

    /// `router_config_override`, validated (§7.5) once the object is read.
    fn router_config_override(cur: &mut Cur<'_>) -> PResult<Option<RouterConfigOverride>> {
        if cur.null()? {
            return Ok(None);
        }
        cur.object_start("struct RouterConfigOverride")?;
        let mut o = RouterConfigOverride::default();
        let mut set = 0u64;
        object(cur, |cur, k| {
            macro_rules! f64_field {
                ($bit:expr, $name:literal, $slot:expr) => {{
                    seen(cur, &mut set, $bit, &k, $name)?;
                    $slot = opt_f64(cur, "f64").key($name)?;
                }};
            }
            match &*k.bytes {
                b"overlap_score_credit" => {
                    f64_field!(0, "overlap_score_credit", o.overlap_score_credit)
                }
                b"prefill_load_scale" => f64_field!(1, "prefill_load_scale", o.prefill_load_scale),
                b"overlap_score_weight" => {
                    f64_field!(2, "overlap_score_weight", o.overlap_score_weight)
                }
                b"router_temperature" => f64_field!(3, "router_temperature", o.router_temperature),
                b"shared_cache_multiplier" => {
                    f64_field!(4, "shared_cache_multiplier", o.shared_cache_multiplier)
                }
                b"assume_kv_reuse" => {
                    seen(cur, &mut set, 5, &k, "assume_kv_reuse")?;
                    o.assume_kv_reuse = opt_bool(cur).key("assume_kv_reuse")?;
                }
                b"track_prefill_tokens" => {
                    seen(cur, &mut set, 6, &k, "track_prefill_tokens")?;
                    o.track_prefill_tokens = opt_bool(cur).key("track_prefill_tokens")?;
                }
                _ => skip(cur, &k)?,
            }
            Ok(())
        })?;
        let msg = o.check().err();
        match msg {
            Some(m) => Err(cur.shape(cur.i, m.to_string())),
            None => Ok(Some(o)),
        }
    }
}

/// `block_mm_infos`: per block `null` or `{"mm_objects":[{"mm_hash","offsets"}]}`.
fn block_mm_infos(cur: &mut Cur<'_>) -> PResult<Option<Vec<Option<Vec<u64>>>>> {
    if cur.null()? {
        return Ok(None);
    }
    let mut out = Vec::new();
    if cur.array_start()? {
        return Ok(Some(out));
    }
    loop {
        let n = out.len();
        let entry = block_mm_info(cur).index(n)?;
        out.push(entry);
        if !cur.array_next()? {
            return Ok(Some(out));
        }
    }
}

fn block_mm_info(cur: &mut Cur<'_>) -> PResult<Option<Vec<u64>>> {
    if cur.peek() == Some(b']') {
        return Err(cur.syntax_here("trailing comma"));
    }
    if cur.null()? {
        return Ok(None);
    }
    cur.object_start("struct BlockExtraInfo")?;
    let mut objs: Option<Vec<u64>> = None;
    let mut set = 0u64;
    object(cur, |cur, k| match &*k.bytes {
        b"mm_objects" => {
            seen(cur, &mut set, 0, &k, "mm_objects")?;
            let mut hashes = Vec::new();
            let r: PResult<()> = (|| {
                if cur.array_start()? {
                    return Ok(());
                }
                loop {
                    let n = hashes.len();
                    hashes.push(mm_object(cur).index(n)?);
                    if !cur.array_next()? {
                        return Ok(());
                    }
                }
            })();
            r.key("mm_objects")?;
            objs = Some(hashes);
            Ok(())
        }
        _ => skip(cur, &k),
    })?;
    objs.ok_or_else(|| missing(cur, "mm_objects")).map(Some)
}

fn mm_object(cur: &mut Cur<'_>) -> PResult<u64> {
    if cur.peek() == Some(b']') {
        return Err(cur.syntax_here("trailing comma"));
    }
    cur.object_start("struct BlockMmObjectInfo")?;
    let mut hash = None;
    let mut offsets = false;
    let mut set = 0u64;
    object(cur, |cur, k| match &*k.bytes {
        b"mm_hash" => {
            seen(cur, &mut set, 0, &k, "mm_hash")?;
            hash = Some(cur.u64_val("u64").key("mm_hash")?);
            Ok(())
        }
        b"offsets" => {
            seen(cur, &mut set, 1, &k, "offsets")?;
            offset_pairs(cur).key("offsets")?;
            offsets = true;
            Ok(())
        }
        _ => skip(cur, &k),
    })?;
    let hash = hash.ok_or_else(|| missing(cur, "mm_hash"))?;
    if !offsets {
        return Err(missing(cur, "offsets"));
    }
    Ok(hash)
}

/// `[[start, end], ...]` of usize, validated and dropped (not hashed).
fn offset_pairs(cur: &mut Cur<'_>) -> PResult<()> {
    if cur.array_start()? {
        return Ok(());
    }
    let mut n = 0;
    loop {
        let r: PResult<()> = (|| {
            if cur.peek() == Some(b']') {
                return Err(cur.syntax_here("trailing comma"));
            }
            match cur.ws() {
                Some(b'[') => cur.enter()?,
                _ => return Err(cur.wrong_type("a tuple of size 2")),
            }
            let mut len = 0;
            if !cur.array_empty()? {
                loop {
                    if cur.peek() == Some(b']') {
                        return Err(cur.syntax_here("trailing comma"));
                    }
                    if len == 2 {
                        // serde_json's tuple visitor stops after two elements
                        // and then finds more: a syntax error there.
                        return Err(cur.syntax_here("trailing characters"));
                    }
                    cur.u64_val("usize").index(len)?;
                    len += 1;
                    if !cur.array_next()? {
                        break;
                    }
                }
            }
            if len != 2 {
                return Err(cur.shape(
                    cur.i,
                    format!("invalid length {len}, expected a tuple of size 2"),
                ));
            }
            Ok(())
        })();
        r.index(n)?;
        n += 1;
        if !cur.array_next()? {
            return Ok(());
        }
    }
}

fn session_context<'a>(cur: &mut Cur<'a>) -> PResult<Option<SessionContext<'a>>> {
    if cur.null()? {
        return Ok(None);
    }
    cur.object_start("struct SessionContext")?;
    let mut id = None;
    let mut parent = None;
    let mut fin = None;
    let mut trig = None;
    let mut set = 0u64;
    object(cur, |cur, k| {
        match &*k.bytes {
            b"session_id" => {
                seen(cur, &mut set, 0, &k, "session_id")?;
                id = Some(cur.str_val().key("session_id")?);
            }
            b"parent_session_id" => {
                seen(cur, &mut set, 1, &k, "parent_session_id")?;
                parent = opt_str(cur).key("parent_session_id")?;
            }
            b"session_final" => {
                seen(cur, &mut set, 2, &k, "session_final")?;
                fin = opt_bool(cur).key("session_final")?;
            }
            b"input_trigger" => {
                seen(cur, &mut set, 3, &k, "input_trigger")?;
                let r: PResult<Option<InputTrigger>> = (|| {
                    if cur.null()? {
                        return Ok(None);
                    }
                    let v = enum_val(cur, &["user_message", "tool_result", "other"])?;
                    Ok(Some(match v {
                        0 => InputTrigger::UserMessage,
                        1 => InputTrigger::ToolResult,
                        _ => InputTrigger::Other,
                    }))
                })();
                trig = r.key("input_trigger")?;
            }
            _ => skip(cur, &k)?,
        }
        Ok(())
    })?;
    let session_id = id.ok_or_else(|| missing(cur, "session_id"))?;
    Ok(Some(SessionContext {
        session_id,
        parent_session_id: parent,
        session_final: fin,
        input_trigger: trig,
    }))
}

/// `pinned_worker` (`dp_rank` required) and `affinity_target` (optional).
fn worker_rank(
    cur: &mut Cur<'_>,
    name: &str,
    rank_required: bool,
) -> PResult<Option<(u64, Option<u32>)>> {
    if cur.null()? {
        return Ok(None);
    }
    cur.object_start(name)?;
    let mut wid = None;
    let mut rank = None;
    let mut set = 0u64;
    object(cur, |cur, k| {
        match &*k.bytes {
            b"worker_id" => {
                seen(cur, &mut set, 0, &k, "worker_id")?;
                wid = Some(cur.u64_val("u64").key("worker_id")?);
            }
            b"dp_rank" => {
                seen(cur, &mut set, 1, &k, "dp_rank")?;
                rank = if rank_required {
                    Some(cur.u32_val().key("dp_rank")?)
                } else {
                    opt_u32(cur).key("dp_rank")?
                };
            }
            _ => skip(cur, &k)?,
        }
        Ok(())
    })?;
    let wid = wid.ok_or_else(|| missing(cur, "worker_id"))?;
    if rank_required && rank.is_none() {
        return Err(missing(cur, "dp_rank"));
    }
    Ok(Some((wid, rank)))
}

fn routing_constraints<'a>(cur: &mut Cur<'a>) -> PResult<Option<RoutingConstraints<'a>>> {
    if cur.null()? {
        return Ok(None);
    }
    cur.object_start("struct RoutingConstraints")?;
    let mut rc = RoutingConstraints::default();
    let mut set = 0u64;
    object(cur, |cur, k| {
        match &*k.bytes {
            b"required_taints" => {
                seen(cur, &mut set, 0, &k, "required_taints")?;
                rc.required_taints = str_array(cur).key("required_taints")?;
            }
            b"preferred_taints" => {
                seen(cur, &mut set, 1, &k, "preferred_taints")?;
                let r: PResult<()> = (|| {
                    cur.object_start("a map")?;
                    object(cur, |cur, k| {
                        let name: Str<'a> = match &k.bytes {
                            Cow::Borrowed(b) => Cow::Borrowed(std::str::from_utf8(b).unwrap_or("")),
                            Cow::Owned(b) => Cow::Owned(String::from_utf8_lossy(b).into_owned()),
                        };
                        let w = cur.f64_val("f32").key_with(|| k.text())? as f32;
                        // A map: a repeated key replaces the earlier weight.
                        match rc.preferred_taints.iter_mut().find(|(n, _)| *n == name) {
                            Some(slot) => slot.1 = w,
                            None => rc.preferred_taints.push((name, w)),
                        }
                        Ok(())
                    })
                })();
                r.key("preferred_taints")?;
            }
            _ => skip(cur, &k)?,
        }
        Ok(())
    })?;
    Ok(Some(rc))
}

fn str_array<'a>(cur: &mut Cur<'a>) -> PResult<Vec<Str<'a>>> {
    let mut out = Vec::new();
    if cur.array_start()? {
        return Ok(out);
    }
    loop {
        if cur.peek() == Some(b']') {
            return Err(cur.syntax_here("trailing comma"));
        }
        let n = out.len();
        out.push(cur.str_val().index(n)?);
        if !cur.array_next()? {
            return Ok(out);
        }
    }
}

fn opt_u64_vec(cur: &mut Cur<'_>) -> PResult<Option<Vec<u64>>> {
    if cur.null()? {
        return Ok(None);
    }
    let mut v = Vec::new();
    u64_array(cur, &mut v, usize::MAX)?;
    Ok(Some(v))
}

// ---- bodies ------------------------------------------------------------

impl Parser {
    /// Runs a body visitor, then requires only whitespace after the value.
    /// On a shape error the whole body is re-validated: invalid JSON anywhere
    /// makes it a syntax error instead.
    fn run<'a, T>(
        &self,
        body: &'a [u8],
        f: impl FnOnce(&mut Cur<'a>) -> PResult<T>,
    ) -> Result<T, ParseError> {
        let mut cur = Cur::new(body, self.limits.max_depth);
        let res = f(&mut cur).and_then(|v| match cur.ws() {
            None => Ok(v),
            Some(_) => Err(cur.syntax_here("trailing characters")),
        });
        res.map_err(|e| self.finish_error(body, *e))
    }

    #[cold]
    #[inline(never)]
    fn finish_error(&self, body: &[u8], e: cursor::Fail) -> ParseError {
        if e.class != ErrorClass::Shape {
            return e.finish(body, None);
        }
        let mut v = Cur::new(body, self.limits.max_depth);
        let checked = v.skip_value().and_then(|_| {
            let end = v.i;
            match v.ws() {
                None => Ok(end),
                Some(_) => Err(v.syntax_here("trailing characters")),
            }
        });
        match checked {
            Ok(end) => e.finish(body, Some(end)),
            Err(se) => se.finish(body, None),
        }
    }

    /// POST /select and /select_and_reserve (§4.8, §4.9).
    pub fn select<'a>(
        &self,
        body: &'a [u8],
        kind: SelectKind,
    ) -> Result<SelectRequest<'a>, ParseError> {
        let name = match kind {
            SelectKind::Select => "SelectRequest",
            SelectKind::SelectAndReserve => "SelectAndReserveRequest",
        };
        self.run(body, |cur| {
            top_object(cur, name)?;
            let mut r = SelectRequest::default();
            let mut set = 0u64;
            let mut pset = 0u64;
            let mut first = true;
            while let Some(k) = cur.next_key(first)? {
                first = false;
                if self.prompt_field(cur, &k, &mut r.prompt, &mut pset)? {
                    continue;
                }
                macro_rules! field {
                    ($bit:expr, $name:literal, $slot:expr, $e:expr) => {{
                        seen(cur, &mut set, $bit, &k, $name)?;
                        $slot = $e.key($name)?;
                    }};
                }
                match &*k.bytes {
                    b"model_name" => field!(0, "model_name", r.model_name, opt_str(cur)),
                    b"routing_group" => field!(1, "routing_group", r.routing_group, opt_str(cur)),
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
                        worker_rank(cur, "struct PinnedWorker", true).map(|o| {
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
                        worker_rank(cur, "struct AffinityTarget", false).map(|o| {
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
                        field!(13, "advisory", r.advisory, opt_bool(cur))
                    }
                    _ => skip(cur, &k)?,
                }
            }
            Ok(r)
        })
    }

    /// POST /reservations, both forms (§4.10).
    pub fn reservation<'a>(&self, body: &'a [u8]) -> Result<ReservationRequest<'a>, ParseError> {
        self.run(body, |cur| {
            top_object(cur, "CreateReservationRequest")?;
            let mut r = ReservationRequest::default();
            let mut sid = None;
            let mut set = 0u64;
            let mut pset = 0u64;
            let mut first = true;
            while let Some(k) = cur.next_key(first)? {
                first = false;
                if self.prompt_field(cur, &k, &mut r.prompt, &mut pset)? {
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
                    b"model_name" => field!(1, "model_name", r.model_name, opt_str(cur)),
                    b"routing_group" => field!(2, "routing_group", r.routing_group, opt_str(cur)),
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
            Ok(r)
        })
    }

    /// POST /reservations/{id}/output_block.
    pub fn output_block(&self, body: &[u8]) -> Result<OutputBlockRequest, ParseError> {
        self.run(body, |cur| {
            top_object(cur, "OutputBlockRequest")?;
            let mut r = OutputBlockRequest::default();
            let mut set = 0u64;
            object(cur, |cur, k| {
                match &*k.bytes {
                    b"decay_fraction" => {
                        seen(cur, &mut set, 0, &k, "decay_fraction")?;
                        r.decay_fraction = opt_f64(cur, "f64").key("decay_fraction")?;
                    }
                    _ => skip(cur, &k)?,
                }
                Ok(())
            })?;
            Ok(r)
        })
    }

    /// POST /potential_loads and POST /overlap_scores (§4.13, §4.14).
    pub fn prompt_query<'a>(&self, body: &'a [u8]) -> Result<PromptQueryRequest<'a>, ParseError> {
        self.run(body, |cur| {
            top_object(cur, "PromptQueryRequest")?;
            let mut r = PromptQueryRequest::default();
            let mut set = 0u64;
            let mut pset = 0u64;
            let mut first = true;
            while let Some(k) = cur.next_key(first)? {
                first = false;
                if self.prompt_field(cur, &k, &mut r.prompt, &mut pset)? {
                    continue;
                }
                match &*k.bytes {
                    b"model_name" => {
                        seen(cur, &mut set, 0, &k, "model_name")?;
                        r.model_name = opt_str(cur).key("model_name")?;
                    }
                    b"routing_group" => {
                        seen(cur, &mut set, 1, &k, "routing_group")?;
                        r.routing_group = opt_str(cur).key("routing_group")?;
                    }
                    b"router_config_override" => {
                        seen(cur, &mut set, 2, &k, "router_config_override")?;
                        r.router_config_override =
                            Self::router_config_override(cur).key("router_config_override")?;
                    }
                    _ => skip(cur, &k)?,
                }
            }
            Ok(r)
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
            object(cur, |cur, k| {
                match &*k.bytes {
                    b"endpoint" => {
                        seen(cur, &mut set, 0, &k, "endpoint")?;
                        ep = Some(cur.str_val().key("endpoint")?);
                    }
                    _ => skip(cur, &k)?,
                }
                Ok(())
            })?;
            ep.ok_or_else(|| missing(cur, "endpoint"))
        })
    }
}

fn worker_fields(cur: &mut Cur<'_>, upsert: bool) -> PResult<WorkerFields> {
    top_object(
        cur,
        if upsert {
            "UpsertWorkerRequest"
        } else {
            "PatchWorkerRequest"
        },
    )?;
    let mut w = WorkerFields::default();
    let mut wid = None;
    let mut set = 0u64;
    object(cur, |cur, k| {
        macro_rules! field {
            ($bit:expr, $name:literal, $slot:expr, $e:expr) => {{
                seen(cur, &mut set, $bit, &k, $name)?;
                $slot = $e.key($name)?;
            }};
        }
        match &*k.bytes {
            b"worker_id" if upsert => field!(0, "worker_id", wid, cur.u64_val("u64").map(Some)),
            b"model_name" if upsert => field!(1, "model_name", w.model_name, opt_string(cur)),
            b"routing_group" if upsert => {
                field!(2, "routing_group", w.routing_group, opt_string(cur))
            }
            b"endpoint" => field!(3, "endpoint", w.endpoint, opt_string(cur)),
            b"kv_events_endpoint" => {
                field!(
                    4,
                    "kv_events_endpoint",
                    w.kv_events_endpoint,
                    opt_string(cur)
                )
            }
            b"kv_events_endpoints" => field!(
                5,
                "kv_events_endpoints",
                w.kv_events_endpoints,
                rank_map(cur)
            ),
            b"replay_endpoint" => field!(6, "replay_endpoint", w.replay_endpoint, opt_string(cur)),
            b"block_size" => field!(7, "block_size", w.block_size, opt_u32(cur)),
            b"data_parallel_start_rank" => field!(
                8,
                "data_parallel_start_rank",
                w.data_parallel_start_rank,
                opt_u32(cur)
            ),
            b"data_parallel_size" => {
                field!(9, "data_parallel_size", w.data_parallel_size, opt_u32(cur))
            }
            b"max_num_batched_tokens" => field!(
                10,
                "max_num_batched_tokens",
                w.max_num_batched_tokens,
                opt_u64(cur, "u64")
            ),
            b"total_kv_blocks" => {
                field!(
                    11,
                    "total_kv_blocks",
                    w.total_kv_blocks,
                    opt_u64(cur, "u64")
                )
            }
            b"stable_routing_id" => {
                field!(
                    12,
                    "stable_routing_id",
                    w.stable_routing_id,
                    opt_string(cur)
                )
            }
            b"is_eagle" => field!(13, "is_eagle", w.is_eagle, opt_bool(cur)),
            b"taints" => field!(14, "taints", w.taints, {
                let r: PResult<Option<Vec<String>>> = (|| {
                    if cur.null()? {
                        return Ok(None);
                    }
                    Ok(Some(
                        str_array(cur)?.into_iter().map(Cow::into_owned).collect(),
                    ))
                })();
                r
            }),
            b"topology_domains" => field!(15, "topology_domains", w.topology_domains, {
                let r: PResult<Option<BTreeMap<String, String>>> = (|| {
                    if cur.null()? {
                        return Ok(None);
                    }
                    cur.object_start("a map")?;
                    let mut m = BTreeMap::new();
                    object(cur, |cur, k| {
                        let v = cur.str_val().key_with(|| k.text())?;
                        m.insert(k.text(), v.into_owned());
                        Ok(())
                    })?;
                    Ok(Some(m))
                })();
                r
            }),
            b"kv_transfer_domain" => {
                field!(
                    16,
                    "kv_transfer_domain",
                    w.kv_transfer_domain,
                    opt_string(cur)
                )
            }
            b"kv_transfer_enforcement" => {
                field!(17, "kv_transfer_enforcement", w.kv_transfer_enforcement, {
                    let r: PResult<Option<KvTransferEnforcement>> = (|| {
                        if cur.null()? {
                            return Ok(None);
                        }
                        Ok(Some(match enum_val(cur, &["required", "preferred"])? {
                            0 => KvTransferEnforcement::Required,
                            _ => KvTransferEnforcement::Preferred,
                        }))
                    })();
                    r
                })
            }
            b"kv_transfer_preferred_weight" => field!(
                18,
                "kv_transfer_preferred_weight",
                w.kv_transfer_preferred_weight,
                opt_f64(cur, "f32").map(|o| o.map(|v| v as f32))
            ),
            _ => skip(cur, &k)?,
        }
        Ok(())
    })?;
    if upsert {
        w.worker_id = wid.ok_or_else(|| missing(cur, "worker_id"))?;
    }
    Ok(w)
}

/// `kv_events_endpoints`: keys are decimal ranks in quotes. A key that is not
/// a number is a *syntax* error, as in serde_json (`expected key to be a
/// number in quotes`); a number that is not a u32 is a shape error. Both
/// carry the `?` path segment serde_path_to_error gives an unparsed key.
fn rank_map(cur: &mut Cur<'_>) -> PResult<Option<BTreeMap<u32, String>>> {
    if cur.null()? {
        return Ok(None);
    }
    cur.object_start("a map")?;
    let mut m = BTreeMap::new();
    object(cur, |cur, k| {
        let rank = rank_key(cur, &k).key("?")?;
        let url = cur.str_val().key_with(|| k.text())?;
        m.insert(rank, url.into_owned());
        Ok(())
    })?;
    Ok(Some(m))
}

fn rank_key(cur: &Cur<'_>, k: &Key<'_>) -> PResult<u32> {
    // Offset of the key's first content byte (just after its opening quote).
    let start = k.end - 1 - k.bytes.len();
    let raw: &[u8] = match &k.bytes {
        Cow::Borrowed(b) if matches!(b.first(), Some(b'0'..=b'9' | b'-')) => b,
        _ => {
            return Err(fail(
                ErrorClass::Syntax,
                start,
                "invalid value: expected key to be a number in quotes",
            ))
        }
    };
    let mut sub = Cur::new(raw, 1);
    let shift = |mut e: Box<cursor::Fail>| {
        e.offset += start;
        e
    };
    let n = sub.number().map_err(shift)?;
    if sub.i != raw.len() {
        return Err(fail(ErrorClass::Syntax, start + sub.i + 1, "expected `\"`"));
    }
    let end = k.end;
    match n {
        Num::U64(v) => u32::try_from(v)
            .map_err(|_| cur.shape(end, format!("invalid value: integer `{v}`, expected u32"))),
        n @ Num::I64(_) => Err(cur.shape(
            end,
            format!("invalid value: {}, expected u32", n.unexpected()),
        )),
        n @ Num::F64(_) => Err(cur.shape(
            end,
            format!("invalid type: {}, expected u32", n.unexpected()),
        )),
    }
}
