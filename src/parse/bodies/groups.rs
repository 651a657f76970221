//! The field groups several bodies share: the flattened prompt, multimodal
//! routing info, the router config override, session context, worker ranks
//! and routing constraints.
//!
//! Owns: parsing one group into its part of a view. Does not: read a whole
//! body, or decide the top-level error path (`mod.rs`).

use super::*;

impl Parser {
    /// One field of the flattened prompt group; `Ok(false)` if `k` is not one.
    pub(super) fn prompt_field<'a>(
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

    /// [`Parser::prompt_field`] as the reference orders its errors. The
    /// reference buffers the prompt group's fields while it reads the
    /// object (checking only their JSON syntax) and converts them after the
    /// object's `}` and after the other fields' missing-field checks. So a
    /// prompt field's shape error is kept in `deferred` (the first one
    /// wins), the value is read again for its syntax only, and the caller
    /// goes on: any error of a later field, of the object's syntax or a
    /// missing field comes first, and [`deferred_or`] reports the kept one
    /// at the end.
    pub(super) fn prompt_or_defer<'a>(
        &self,
        cur: &mut Cur<'a>,
        k: &Key<'a>,
        p: &mut Prompt<'a>,
        set: &mut u64,
        deferred: &mut Option<Box<failure::Fail>>,
    ) -> PResult<bool> {
        let at = cur.mark();
        match self.prompt_field(cur, k, p, set) {
            Err(e) if e.flattened => {
                cur.reset(at);
                skip(cur, k)?;
                deferred.get_or_insert(e);
                Ok(true)
            }
            r => r,
        }
    }

    pub(super) fn opt_hashes(&self, cur: &mut Cur<'_>) -> PResult<Option<Pooled<u64>>> {
        if cur.null()? {
            return Ok(None);
        }
        let mut buf = self.hashes.take();
        i64_array(cur, &mut buf, self.limits.max_tokens)?;
        Ok(Some(buf))
    }

    /// `mm_routing_info` (`MmRoutingInfoRequest`): `routing_token_ids` is
    /// required and not nullable, `block_mm_infos` defaults to empty but is
    /// not nullable either. A prompt field: read as serde's buffered content.
    pub(super) fn mm_routing_info(&self, cur: &mut Cur<'_>) -> PResult<Option<MmRoutingInfo>> {
        if cur.null()? {
            return Ok(None);
        }
        let mut m = MmRoutingInfo::default();
        let tokens = |cur: &mut Cur<'_>| -> PResult<Pooled<u32>> {
            let mut buf = self.tokens.take();
            u32_array(cur, &mut buf, self.limits.max_tokens, self.vector())?;
            Ok(buf)
        };
        let infos = |cur: &mut Cur<'_>| -> PResult<Vec<Option<Vec<u64>>>> {
            match cur.ws() {
                Some(b'n') => Err(cur.wrong_type("a sequence")),
                _ => Ok(block_mm_infos(cur)?.unwrap_or_default()),
            }
        };
        match struct_start(cur, "struct MmRoutingInfoRequest")? {
            Form::Map => {
                let mut set = 0u64;
                fields(cur, |cur, k| match &*k.bytes {
                    b"routing_token_ids" => {
                        seen(cur, &mut set, 0, &k, "routing_token_ids")?;
                        m.routing_token_ids = Some(tokens(cur).key("routing_token_ids")?);
                        Ok(())
                    }
                    b"block_mm_infos" => {
                        seen(cur, &mut set, 1, &k, "block_mm_infos")?;
                        m.block_mm_infos = Some(infos(cur).key("block_mm_infos")?);
                        Ok(())
                    }
                    _ => skip(cur, &k),
                })?;
                if m.routing_token_ids.is_none() {
                    return Err(missing(cur, "routing_token_ids"));
                }
            }
            Form::Seq => {
                let mut seq = SeqStruct::new("MmRoutingInfoRequest", 2, true);
                seq.field(cur, false)?;
                m.routing_token_ids = Some(tokens(cur).index(0)?);
                if seq.field(cur, true)? {
                    m.block_mm_infos = Some(infos(cur).index(1)?);
                }
                seq.finish(cur)?;
            }
        }
        Ok(Some(m))
    }

    /// `router_config_override`, validated (§7.5) once the object is read.
    pub(super) fn router_config_override(
        cur: &mut Cur<'_>,
    ) -> PResult<Option<RouterConfigOverride>> {
        if cur.null()? {
            return Ok(None);
        }
        let mut o = RouterConfigOverride::default();
        match struct_start(cur, "struct RouterConfigOverrideSerde")? {
            Form::Map => {
                let mut set = 0u64;
                fields(cur, |cur, k| {
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
                        b"prefill_load_scale" => {
                            f64_field!(1, "prefill_load_scale", o.prefill_load_scale)
                        }
                        b"overlap_score_weight" => {
                            f64_field!(2, "overlap_score_weight", o.overlap_score_weight)
                        }
                        b"router_temperature" => {
                            f64_field!(3, "router_temperature", o.router_temperature)
                        }
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
                        _ => skip_ignored(cur, &k)?,
                    }
                    Ok(())
                })?;
            }
            Form::Seq => {
                // Declaration order; no field has a serde default.
                let mut seq = SeqStruct::new("RouterConfigOverrideSerde", 7, false);
                for (i, slot) in [
                    &mut o.overlap_score_credit,
                    &mut o.prefill_load_scale,
                    &mut o.overlap_score_weight,
                    &mut o.router_temperature,
                ]
                .into_iter()
                .enumerate()
                {
                    seq.field(cur, false)?;
                    *slot = opt_f64(cur, "f64").index(i)?;
                }
                seq.field(cur, false)?;
                o.assume_kv_reuse = opt_bool(cur).index(4)?;
                seq.field(cur, false)?;
                o.track_prefill_tokens = opt_bool(cur).index(5)?;
                seq.field(cur, false)?;
                o.shared_cache_multiplier = opt_f64(cur, "f64").index(6)?;
                seq.finish(cur)?;
            }
        }
        match o.check() {
            Err(m) => Err(cur.shape(after_value_offset(cur), m.to_string())),
            Ok(()) => Ok(Some(o)),
        }
    }
}

/// `block_mm_infos`: per block `null` or `{"mm_objects":[{"mm_hash","offsets"}]}`.
pub(super) fn block_mm_infos(cur: &mut Cur<'_>) -> PResult<Option<Vec<Option<Vec<u64>>>>> {
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

/// One `BlockExtraInfo` (`{"mm_objects": [...]}` or `[[...]]`), or `null`.
/// A prompt field: read as serde's buffered content.
pub(super) fn block_mm_info(cur: &mut Cur<'_>) -> PResult<Option<Vec<u64>>> {
    if cur.peek() == Some(b']') {
        return Err(cur.syntax_here("trailing comma"));
    }
    if cur.null()? {
        return Ok(None);
    }
    let list = |cur: &mut Cur<'_>| -> PResult<Vec<u64>> {
        let mut hashes = Vec::new();
        if cur.array_start()? {
            return Ok(hashes);
        }
        loop {
            let n = hashes.len();
            hashes.push(mm_object(cur).index(n)?);
            if !cur.array_next()? {
                return Ok(hashes);
            }
        }
    };
    match struct_start(cur, "struct BlockExtraInfo")? {
        Form::Map => {
            let mut objs: Option<Vec<u64>> = None;
            let mut set = 0u64;
            fields(cur, |cur, k| match &*k.bytes {
                b"mm_objects" => {
                    seen(cur, &mut set, 0, &k, "mm_objects")?;
                    objs = Some(list(cur).key("mm_objects")?);
                    Ok(())
                }
                _ => skip(cur, &k),
            })?;
            objs.ok_or_else(|| missing(cur, "mm_objects")).map(Some)
        }
        Form::Seq => {
            let mut seq = SeqStruct::new("BlockExtraInfo", 1, true);
            seq.field(cur, false)?;
            let objs = list(cur).index(0)?;
            seq.finish(cur)?;
            Ok(Some(objs))
        }
    }
}

/// One `BlockMmObjectInfo` (`{"mm_hash", "offsets"}` or `[mm_hash, offsets]`):
/// its hash.
pub(super) fn mm_object(cur: &mut Cur<'_>) -> PResult<u64> {
    if cur.peek() == Some(b']') {
        return Err(cur.syntax_here("trailing comma"));
    }
    match struct_start(cur, "struct BlockMmObjectInfo")? {
        Form::Map => {
            let mut hash = None;
            let mut offsets = false;
            let mut set = 0u64;
            fields(cur, |cur, k| match &*k.bytes {
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
        Form::Seq => {
            let mut seq = SeqStruct::new("BlockMmObjectInfo", 2, true);
            seq.field(cur, false)?;
            let hash = cur.u64_val("u64").index(0)?;
            seq.field(cur, false)?;
            offset_pairs(cur).index(1)?;
            seq.finish(cur)?;
            Ok(hash)
        }
    }
}

/// `[[start, end], ...]` of usize, validated and dropped (not hashed).
pub(super) fn offset_pairs(cur: &mut Cur<'_>) -> PResult<()> {
    if cur.array_start()? {
        return Ok(());
    }
    let mut n = 0;
    loop {
        let r: PResult<()> = (|| {
            match cur.ws() {
                Some(b'[') => cur.enter()?,
                _ => return Err(cur.wrong_type("a tuple of size 2")),
            }
            let mut len = 0;
            if !cur.array_empty()? {
                loop {
                    cur.u64_val("usize").index(len)?;
                    len += 1;
                    if len == 2 {
                        // The tuple visitor stops here; the prompt group's
                        // buffer counts any more elements.
                        return buffered_rest(cur, 2);
                    }
                    if !cur.array_next()? {
                        break;
                    }
                }
            }
            Err(cur.shape(
                cur.i,
                format!("invalid length {len}, expected a tuple of size 2"),
            ))
        })();
        r.index(n)?;
        n += 1;
        if !cur.array_next()? {
            return Ok(());
        }
    }
}

/// `session_context` (`SelectionSessionContext`): `session_id` required;
/// `agent_headers` (a map of string lists) is validated and dropped. In the
/// sequence form only `session_id` is required (the others have serde
/// defaults); the order is session_id, parent_session_id, session_final,
/// input_trigger, agent_headers.
pub(super) fn session_context<'a>(cur: &mut Cur<'a>) -> PResult<Option<SessionContext<'a>>> {
    if cur.null()? {
        return Ok(None);
    }
    fn trigger(cur: &mut Cur<'_>) -> PResult<Option<InputTrigger>> {
        if cur.null()? {
            return Ok(None);
        }
        let v = enum_val(cur, &["user_message", "tool_result", "other"])?;
        Ok(Some(match v {
            0 => InputTrigger::UserMessage,
            1 => InputTrigger::ToolResult,
            _ => InputTrigger::Other,
        }))
    }
    fn headers(cur: &mut Cur<'_>) -> PResult<()> {
        if cur.null()? {
            return Ok(());
        }
        cur.object_start("a map")?;
        object(cur, |cur, k| {
            str_array(cur).map(|_| ()).key_with(|| k.text())
        })
    }
    let mut ctx = SessionContext {
        session_id: Cow::Borrowed(""),
        parent_session_id: None,
        session_final: None,
        input_trigger: None,
    };
    match struct_start(cur, "struct SelectionSessionContext")? {
        Form::Map => {
            let mut id = None;
            let mut set = 0u64;
            fields(cur, |cur, k| {
                match &*k.bytes {
                    b"session_id" => {
                        seen(cur, &mut set, 0, &k, "session_id")?;
                        id = Some(cur.str_val().key("session_id")?);
                    }
                    b"parent_session_id" => {
                        seen(cur, &mut set, 1, &k, "parent_session_id")?;
                        ctx.parent_session_id = opt_str(cur).key("parent_session_id")?;
                    }
                    b"session_final" => {
                        seen(cur, &mut set, 2, &k, "session_final")?;
                        ctx.session_final = opt_bool(cur).key("session_final")?;
                    }
                    b"input_trigger" => {
                        seen(cur, &mut set, 3, &k, "input_trigger")?;
                        ctx.input_trigger = trigger(cur).key("input_trigger")?;
                    }
                    b"agent_headers" => {
                        seen(cur, &mut set, 4, &k, "agent_headers")?;
                        headers(cur).key("agent_headers")?;
                    }
                    _ => skip_ignored(cur, &k)?,
                }
                Ok(())
            })?;
            ctx.session_id = id.ok_or_else(|| missing(cur, "session_id"))?;
        }
        Form::Seq => {
            let mut seq = SeqStruct::new("SelectionSessionContext", 5, false);
            seq.field(cur, false)?;
            ctx.session_id = cur.str_val().index(0)?;
            if seq.field(cur, true)? {
                ctx.parent_session_id = opt_str(cur).index(1)?;
            }
            if seq.field(cur, true)? {
                ctx.session_final = opt_bool(cur).index(2)?;
            }
            if seq.field(cur, true)? {
                ctx.input_trigger = trigger(cur).index(3)?;
            }
            if seq.field(cur, true)? {
                headers(cur).index(4)?;
            }
            seq.finish(cur)?;
        }
    }
    Ok(Some(ctx))
}

/// `pinned_worker` (`WorkerWithDpRank`, `dp_rank` required) and
/// `affinity_target` (`WorkerAffinityTarget`, `dp_rank` optional). In the
/// sequence form both take exactly `[worker_id, dp_rank]`.
pub(super) fn worker_rank(
    cur: &mut Cur<'_>,
    name: &str,
    rank_required: bool,
) -> PResult<Option<(u64, Option<u32>)>> {
    if cur.null()? {
        return Ok(None);
    }
    let rank_val = |cur: &mut Cur<'_>| {
        if rank_required {
            cur.u32_val().map(Some)
        } else {
            opt_u32(cur)
        }
    };
    // serde's `expecting` text, without formatting it on the happy path.
    let expected = match name {
        "WorkerWithDpRank" => "struct WorkerWithDpRank",
        "WorkerAffinityTarget" => "struct WorkerAffinityTarget",
        _ => "a struct",
    };
    match struct_start(cur, expected)? {
        Form::Map => {
            let mut wid = None;
            let mut rank = None;
            let mut set = 0u64;
            fields(cur, |cur, k| {
                match &*k.bytes {
                    b"worker_id" => {
                        seen(cur, &mut set, 0, &k, "worker_id")?;
                        wid = Some(cur.u64_val("u64").key("worker_id")?);
                    }
                    b"dp_rank" => {
                        seen(cur, &mut set, 1, &k, "dp_rank")?;
                        rank = rank_val(cur).key("dp_rank")?;
                    }
                    _ => skip_ignored(cur, &k)?,
                }
                Ok(())
            })?;
            let wid = wid.ok_or_else(|| missing(cur, "worker_id"))?;
            if rank_required && rank.is_none() {
                return Err(missing(cur, "dp_rank"));
            }
            Ok(Some((wid, rank)))
        }
        Form::Seq => {
            let mut seq = SeqStruct::new(name, 2, false);
            seq.field(cur, false)?;
            let wid = cur.u64_val("u64").index(0)?;
            seq.field(cur, false)?;
            let rank = rank_val(cur).index(1)?;
            seq.finish(cur)?;
            Ok(Some((wid, rank)))
        }
    }
}

/// `routing_constraints`: both fields default, so `[]` is all defaults. Not
/// nullable: the reference declares the field with a default, not as an
/// `Option`, so `null` is `invalid type: null, expected struct
/// RoutingConstraints`.
pub(super) fn routing_constraints<'a>(
    cur: &mut Cur<'a>,
) -> PResult<Option<RoutingConstraints<'a>>> {
    let mut rc = RoutingConstraints::default();
    fn preferred<'a>(cur: &mut Cur<'a>, out: &mut Vec<(Str<'a>, f32)>) -> PResult<()> {
        cur.object_start("a map")?;
        object(cur, |cur, k| {
            let name: Str<'a> = match &k.bytes {
                Cow::Borrowed(b) => Cow::Borrowed(std::str::from_utf8(b).unwrap_or("")),
                Cow::Owned(b) => Cow::Owned(String::from_utf8_lossy(b).into_owned()),
            };
            let w = cur.f64_val("f32").key_with(|| k.text())? as f32;
            // A map: a repeated key replaces the earlier weight.
            match out.iter_mut().find(|(n, _)| *n == name) {
                Some(slot) => slot.1 = w,
                None => out.push((name, w)),
            }
            Ok(())
        })
    }
    match struct_start(cur, "struct RoutingConstraints")? {
        Form::Map => {
            let mut set = 0u64;
            fields(cur, |cur, k| {
                match &*k.bytes {
                    b"required_taints" => {
                        seen(cur, &mut set, 0, &k, "required_taints")?;
                        rc.required_taints = str_array(cur).key("required_taints")?;
                    }
                    b"preferred_taints" => {
                        seen(cur, &mut set, 1, &k, "preferred_taints")?;
                        preferred(cur, &mut rc.preferred_taints).key("preferred_taints")?;
                    }
                    _ => skip_ignored(cur, &k)?,
                }
                Ok(())
            })?;
        }
        Form::Seq => {
            let mut seq = SeqStruct::new("RoutingConstraints", 2, false);
            if seq.field(cur, true)? {
                rc.required_taints = str_array(cur).index(0)?;
            }
            if seq.field(cur, true)? {
                preferred(cur, &mut rc.preferred_taints).index(1)?;
            }
            seq.finish(cur)?;
        }
    }
    Ok(Some(rc))
}

pub(super) fn str_array<'a>(cur: &mut Cur<'a>) -> PResult<Vec<Str<'a>>> {
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

pub(super) fn opt_u64_vec(cur: &mut Cur<'_>) -> PResult<Option<Vec<u64>>> {
    if cur.null()? {
        return Ok(None);
    }
    let mut v = Vec::new();
    u64_array(cur, &mut v, usize::MAX)?;
    Ok(Some(v))
}
